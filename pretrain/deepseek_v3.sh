#!/usr/bin/env bash
# DeepSeek-V3-shaped MoE (671B parameters, 37B active) across nodes: 61 layers (the first 3 dense), multi-latent
# attention (query latent 1536, key/value latent 512, 128 + 64 RoPE dims per query/key head, 128 per value head,
# latents RMS-normalised), 256 routed experts of 2048 (top-8 in 4 of 8 groups, sigmoid scores with the
# aux-loss-free expert bias, weights x 2.5) plus one shared expert. PP=16 in Megatron's layout syntax (3 + 14 x 4
# + 2 layers: the first stage holds the 3 dense ones with the embedding, the last 2 with the MTP layer and the
# loss), EP=64,
# TP=1, data parallel over the rest, distributed optimizer with AdamW's moments in bf16 (as the DeepSeek-V3
# report), bf16 with bf16 gradient reduction.
# The architecture flags follow DeepSeek-V3's config.json; to continue training the released model, convert it
# (tools/checkpoint/convert.py --loader hf) into CKPT: its YaRN RoPE comes with the checkpoint, and a flag that
# disagrees with it stops the job. One multi-token-prediction depth (DeepSeek-V3's MTP module, converted with the
# checkpoint) adds a loss weighted 0.1 (the report's weight after its first 10T tokens; 0.3 before). From scratch
# RoPE is plain, as in the report's pretraining (YaRN came after it). --vocab-size is the vocabulary of a dry run
# without the tokenizer; a run takes the tokenizer's, padded to a multiple of 3232 to config.json's 129280 rows
# (Megatron's recipe; padding rows are masked, never stored).
#   NNODES=128 RDZV_HOST=node0 TOKENIZER=... DATA_PATH=... bash pretrain/deepseek_v3.sh   (on every node)
#   DRY_RUN=1 bash pretrain/deepseek_v3.sh
#   bash pretrain/deepseek_v3.sh --train-iters 100   # more flags: the last given wins
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES=${NNODES:-128}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RDZV_GIVEN=${RDZV_HOST:-${MASTER_ADDR:-}}
RDZV_HOST=${RDZV_GIVEN:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
CKPT=${CKPT:-checkpoints/deepseek_v3}
TOKENIZER=${TOKENIZER:-tokenizer.json}
DATA_PATH=${DATA_PATH:-data/deepseek_text_document}

ARGS=(
    --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 --kv-channels 128
    --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
    --v-head-dim 128 --qk-layernorm
    --seq-length 4096 --max-position-embeddings 163840
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
    --position-embedding-type rope --rotary-base 10000
    --untie-embeddings-and-output-weights --disable-bias-linear
    --hidden-dropout 0.0 --attention-dropout 0.0 --init-method-std 0.006
    --num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048
    --moe-layer-freq "([0]*3+[1]*58)" --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3 --moe-router-num-groups 8 --moe-router-group-topk 4
    --moe-router-topk-scaling-factor 2.5 --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
    --moe-router-dtype fp32 --moe-token-dispatcher-type alltoall --moe-grouped-gemm
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
    --expert-model-parallel-size 64
    --pipeline-model-parallel-size 16 --pipeline-model-parallel-layout "Et*3|(t*4|)*14,t*2mL"
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16
    --micro-batch-size 1 --global-batch-size 4096
    --train-iters 500000 --lr 2.2e-4 --min-lr 2.2e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
    --bf16 --grad-reduce-in-bf16 --distributed-timeout-minutes 60
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" --vocab-size 129280
    --make-vocab-size-divisible-by 3232
    --data-path $DATA_PATH --split 99,1,0
    --save "$CKPT" --load "$CKPT" --save-interval 500
    --log-interval 10 --eval-interval 1000 --eval-iters 10
    --wandb-project deepseek --wandb-exp-name "deepseek_v3_pp16_ep64_n${NNODES}"
    --exit-signal-handler
)

if [[ -n "${DRY_RUN:-}" && "$DRY_RUN" != 0 ]]; then
    WORLD_SIZE=$((NNODES * GPUS_PER_NODE)) exec python pretrain/pretrain_gpt.py "${ARGS[@]}" "$@" --dry-run
fi
if [[ "$NNODES" -gt 1 && -z "$RDZV_GIVEN" ]]; then  # (each node waited alone on its own localhost, unsaid)
    echo "error: NNODES=$NNODES needs RDZV_HOST (or MASTER_ADDR): the first node's address, the same on every node" >&2
    exit 2
fi
exec torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$MASTER_PORT" --rdzv-id "${RDZV_ID:-deepseek_v3}" \
    pretrain/pretrain_gpt.py "${ARGS[@]}" "$@"
