#!/usr/bin/env bash
# The tiny CPU demo: 4 ranks (tensor parallel 2 with sequence parallelism x pipeline parallel 2) pretrain a
# small Llama-shaped model on the embedded corpus (Python's standard library, tokenized by a BPE trained
# on it; built once and cached), with an offline W&B run and a checkpoint. A few minutes on 2 cores.
#
#   bash pretrain/demo_cpu.sh            # TRAIN_ITERS=300 RUN_DIR=runs/demo by default
#   DRY_RUN=1 bash pretrain/demo_cpu.sh  # validate and print memory per rank, allocate nothing
#   bash pretrain/demo_cpu.sh --train-iters 100   # more flags: the last given wins
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-runs/demo}
TRAIN_ITERS=${TRAIN_ITERS:-300}
NPROC=4

ARGS=(
    --num-layers 4 --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 8
    --group-query-attention --num-query-groups 4
    --seq-length 128 --max-position-embeddings 128
    --normalization RMSNorm --swiglu --position-embedding-type rope --rotary-base 10000
    --untie-embeddings-and-output-weights --disable-bias-linear
    --hidden-dropout 0.0 --attention-dropout 0.0
    --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 --distributed-backend gloo
    --micro-batch-size 4 --global-batch-size 16
    --train-iters "$TRAIN_ITERS" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine
    --lr-warmup-iters "$(( TRAIN_ITERS < 200 ? TRAIN_ITERS / 10 : 20 ))"  # (2 for a TRAIN_ITERS=20 try)
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95
    --log-interval 10 --eval-interval 100 --eval-iters 4
    --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 100
    --log-jsonl "$RUN_DIR/metrics.jsonl"
    --wandb-project megatron_lite_demo --wandb-exp-name demo_cpu --wandb-save-dir "$RUN_DIR"
)

if [[ -n "${DRY_RUN:-}" && "$DRY_RUN" != 0 ]]; then
    WORLD_SIZE=$NPROC exec python pretrain/pretrain_gpt.py "${ARGS[@]}" "$@" --dry-run
fi
mkdir -p "$RUN_DIR"
exec torchrun --standalone --nproc-per-node "$NPROC" pretrain/pretrain_gpt.py "${ARGS[@]}" "$@"
