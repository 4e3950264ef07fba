#!/usr/bin/env bash
# LoRA (or QLoRA) fine-tuning of Llama-3-8B on prompt/response JSONL, from Hugging Face weights, one node.
#   python tools/checkpoint/convert.py --loader hf --saver megatron_lite --load-dir Meta-Llama-3-8B --save-dir ckpt/llama3_8b
#   SFT_DATA=sft.jsonl BASE=ckpt/llama3_8b bash pretrain/finetune_llama3_8b_lora.sh      # QLORA=1 for an NF4 base
#   python tools/checkpoint/convert.py --loader megatron_lite --saver hf-peft --load-dir ckpt/llama3_8b_lora --save-dir adapter
#   DRY_RUN=1 bash pretrain/finetune_llama3_8b_lora.sh   # validate on any machine
#   bash pretrain/finetune_llama3_8b_lora.sh --train-iters 100   # more flags: the last given wins
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
BASE=${BASE:-ckpt/llama3_8b}
OUT=${OUT:-ckpt/llama3_8b_lora}
SFT_DATA=${SFT_DATA:-sft.jsonl}

ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --kv-channels 128
    --seq-length 4096 --max-position-embeddings 8192
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
    --position-embedding-type rope --rotary-base 500000
    --untie-embeddings-and-output-weights --disable-bias-linear
    --hidden-dropout 0.0 --attention-dropout 0.0
    --lora-rank 16 --lora-alpha 32 --lora-dropout 0.05
    --lora-target-modules q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
    --micro-batch-size 1 --global-batch-size 64 --recompute-granularity full --recompute-method uniform
    --recompute-num-layers 1
    --train-iters 2000 --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters 50
    --weight-decay 0.0 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.999
    --bf16
    # every record trains (--split 969,30,1, the default, would keep 3% for a validation --eval-iters 0 skips)
    --sft --data-path "$SFT_DATA" --split 100,0,0 --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$BASE/hf/tokenizer.json"
    --vocab-size 128256
    --load "$BASE" --finetune --save "$OUT" --save-interval 500
    --log-interval 10 --eval-iters 0 --log-memory-breakdown
    --exit-signal-handler
)
if [[ -n "${QLORA:-}" ]]; then
    ARGS+=(--qlora)
fi

if [[ -n "${DRY_RUN:-}" && "$DRY_RUN" != 0 ]]; then
    WORLD_SIZE=$GPUS_PER_NODE exec python pretrain/pretrain_gpt.py "${ARGS[@]}" "$@" --dry-run
fi
exec torchrun --standalone --nproc-per-node "$GPUS_PER_NODE" pretrain/pretrain_gpt.py "${ARGS[@]}" "$@"
