#!/usr/bin/env bash
# Qwen3-30B-A3B-shaped MoE across nodes: 48 layers, 128 experts (top-8, 768 wide), per-head q/k norms
# (--qk-layernorm), GQA 32/4 with head_dim 128. PP=2, EP=8, TP=1, data parallel over the rest (DP=16 on
# 4 nodes of 8 GPUs, two copies of each expert), distributed optimizer, bf16 with bf16 gradient reduction.
# The architecture flags follow Qwen3-30B-A3B's published config.json; to continue training the released model,
# convert it (tools/checkpoint/convert.py --loader hf) into CKPT: a flag that disagrees with it stops the job.
# --vocab-size is the vocabulary of a dry run without the tokenizer; a run takes the tokenizer's, padded to a
# multiple of 1187 to config.json's 151936 rows (Megatron's recipe; padding rows are masked, never stored).
# The schedule (lr 3e-4 to 3e-5, batch 512) is ours: Qwen has not published its.
#   NNODES=4 RDZV_HOST=node0 TOKENIZER=... DATA_PATH=... bash pretrain/qwen3_30b_a3b.sh   (on every node)
#   DRY_RUN=1 bash pretrain/qwen3_30b_a3b.sh
#   bash pretrain/qwen3_30b_a3b.sh --train-iters 100   # more flags: the last given wins
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES=${NNODES:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RDZV_GIVEN=${RDZV_HOST:-${MASTER_ADDR:-}}
RDZV_HOST=${RDZV_GIVEN:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
CKPT=${CKPT:-checkpoints/qwen3_30b_a3b}
TOKENIZER=${TOKENIZER:-tokenizer.json}
DATA_PATH=${DATA_PATH:-data/qwen3_text_document}

ARGS=(
    --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 32
    --group-query-attention --num-query-groups 4 --kv-channels 128 --qk-layernorm
    --seq-length 4096 --max-position-embeddings 40960
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
    --position-embedding-type rope --rotary-base 1000000
    --untie-embeddings-and-output-weights --disable-bias-linear
    --hidden-dropout 0.0 --attention-dropout 0.0 --init-method-std 0.02
    --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 768 --expert-model-parallel-size 8
    --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
    --moe-grouped-gemm
    --pipeline-model-parallel-size 2 --recompute-granularity selective
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --micro-batch-size 1 --global-batch-size 512
    --train-iters 200000 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
    --bf16 --grad-reduce-in-bf16 --distributed-timeout-minutes 30
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" --vocab-size 151936
    --make-vocab-size-divisible-by 1187
    --data-path $DATA_PATH --split 99,1,0
    --save "$CKPT" --load "$CKPT" --save-interval 1000
    --log-interval 10 --eval-interval 1000 --eval-iters 10
    --wandb-project qwen3 --wandb-exp-name "qwen3_30b_a3b_pp2_ep8_n${NNODES}"
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
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$MASTER_PORT" --rdzv-id "${RDZV_ID:-qwen3_30b_a3b}" \
    pretrain/pretrain_gpt.py "${ARGS[@]}" "$@"
