#!/usr/bin/env bash
# Mixtral 8x7B across nodes (Megatron's example layout): PP=4, EP=8, TP=1, data parallel over the rest
# (DP=16, two copies of each expert on 8 nodes of 8 GPUs), bf16, all-to-all dispatch, aux loss 1e-2, distributed
# optimizer, and its schedule (lr 1e-4 to 1e-5 over 320k iterations, 500 warm-up); AdamW's beta2 is 0.95 (the
# example leaves Megatron's 0.999).
#   NNODES=8 RDZV_HOST=node0 TOKENIZER=... DATA_PATH=... bash pretrain/mixtral_8x7b.sh   (on every node)
#   DRY_RUN=1 bash pretrain/mixtral_8x7b.sh
#   bash pretrain/mixtral_8x7b.sh --train-iters 100   # more flags: the last given wins
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES=${NNODES:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RDZV_GIVEN=${RDZV_HOST:-${MASTER_ADDR:-}}
RDZV_HOST=${RDZV_GIVEN:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
CKPT=${CKPT:-checkpoints/mixtral_8x7b}
TOKENIZER=${TOKENIZER:-tokenizer.json}
DATA_PATH=${DATA_PATH:-data/mixtral_text_document}

ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --kv-channels 128
    --seq-length 4096 --max-position-embeddings 32768
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
    --position-embedding-type rope --rotary-base 1000000
    --untie-embeddings-and-output-weights --disable-bias-linear
    --hidden-dropout 0.0 --attention-dropout 0.0 --init-method-std 0.01
    --num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 8
    --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --pipeline-model-parallel-size 4 --recompute-granularity selective
    --micro-batch-size 1 --global-batch-size 256
    --train-iters 500000 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 500
    --lr-decay-iters 320000
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
    --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --distributed-timeout-minutes 30
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" --vocab-size 32000
    --data-path $DATA_PATH --split 99,1,0
    --save "$CKPT" --load "$CKPT" --save-interval 500
    --log-interval 10 --eval-interval 1000 --eval-iters 10
    --wandb-project mixtral --wandb-exp-name "mixtral_8x7b_pp4_ep8_n${NNODES}"
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
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$MASTER_PORT" --rdzv-id "${RDZV_ID:-mixtral_8x7b}" \
    pretrain/pretrain_gpt.py "${ARGS[@]}" "$@"
