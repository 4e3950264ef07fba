#!/usr/bin/env bash
# Llama-3-70B across nodes with torchrun's c10d rendezvous. Run the same command on every node:
#   NNODES=8 RDZV_HOST=node0.example MASTER_PORT=29500 TOKENIZER=... DATA_PATH=... bash pretrain/llama3_70b_multinode.sh
#   DRY_RUN=1 bash pretrain/llama3_70b_multinode.sh   # validate and print memory per rank, allocate nothing
#   bash pretrain/llama3_70b_multinode.sh --train-iters 100   # more flags: the last given wins
# TP=8 within a node, 4 pipeline stages with interleaving (4 chunks of 5 layers per rank) across nodes,
# data parallel over the rest (DP=2 on 8 nodes), full recomputation. The architecture flags are Llama-3-70B's
# config.json (no RoPE scaling: that is Llama-3.1's, with 131072 positions); a converted model loads under them.
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES=${NNODES:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RDZV_GIVEN=${RDZV_HOST:-${MASTER_ADDR:-}}
RDZV_HOST=${RDZV_GIVEN:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
CKPT=${CKPT:-checkpoints/llama3_70b}
TOKENIZER=${TOKENIZER:-tokenizer.json}
DATA_PATH=${DATA_PATH:-data/llama3_text_document}

ARGS=(
    --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64
    --group-query-attention --num-query-groups 8 --kv-channels 128
    --seq-length 8192 --max-position-embeddings 8192
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
    --position-embedding-type rope --rotary-base 500000
    --untie-embeddings-and-output-weights --disable-bias-linear
    --hidden-dropout 0.0 --attention-dropout 0.0 --init-method-std 0.008
    --tensor-model-parallel-size 8 --sequence-parallel
    --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 5
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    --micro-batch-size 1 --global-batch-size 512
    --train-iters 100000 --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
    --bf16 --overlap-grad-reduce --distributed-timeout-minutes 30
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" --vocab-size 128256
    --data-path $DATA_PATH --split 99,1,0
    --save "$CKPT" --load "$CKPT" --save-interval 500
    --log-interval 10 --eval-interval 1000 --eval-iters 10
    --wandb-project llama3_70b --wandb-exp-name "llama3_70b_tp8_pp4_n${NNODES}"
    --exit-signal-handler --log-straggler
)

if [[ -n "${DRY_RUN:-}" && "$DRY_RUN" != 0 ]]; then
    WORLD_SIZE=$((NNODES * GPUS_PER_NODE)) exec python pretrain/pretrain_gpt.py "${ARGS[@]}" "$@" --dry-run
fi
# A rendezvous store of its own for each attempt: torchrun --max-restarts across nodes never meets on the shared one
# (each node counts only its own failures, and the shared store keeps a failed attempt's keys)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
if [[ "$NNODES" -gt 1 && -z "$RDZV_GIVEN" ]]; then  # (each node waited alone on its own localhost, unsaid)
    echo "error: NNODES=$NNODES needs RDZV_HOST (or MASTER_ADDR): the first node's address, the same on every node" >&2
    exit 2
fi
exec torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$MASTER_PORT" --rdzv-id "${RDZV_ID:-llama3_70b}" \
    pretrain/pretrain_gpt.py "${ARGS[@]}" "$@"
