#!/usr/bin/env bash
# A Mixtral-shaped MoE on 4 CPU ranks: 8 experts, top-2, expert parallel 4 (two experts per rank), the
# all-to-all dispatcher, Mixtral's router, an auxiliary load-balancing loss and z-loss. Trains on the
# embedded corpus; expert-load metrics (tokens per expert, imbalance, dropped tokens, aux loss) go to the
# console, runs/mixtral_demo/metrics.jsonl and the offline W&B run.
#   bash pretrain/mixtral_cpu_demo.sh
#   DRY_RUN=1 bash pretrain/mixtral_cpu_demo.sh
#   bash pretrain/mixtral_cpu_demo.sh --train-iters 100   # more flags: the last given wins
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-runs/mixtral_demo}
TRAIN_ITERS=${TRAIN_ITERS:-200}
NPROC=4

ARGS=(
    --num-layers 4 --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 8
    --group-query-attention --num-query-groups 4
    --seq-length 128 --max-position-embeddings 128
    --normalization RMSNorm --swiglu --position-embedding-type rope --rotary-base 1000000
    --untie-embeddings-and-output-weights --disable-bias-linear
    --hidden-dropout 0.0 --attention-dropout 0.0
    --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 176 --expert-model-parallel-size 4
    --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --moe-z-loss-coeff 1e-3
    --micro-batch-size 4 --global-batch-size 16 --distributed-backend gloo
    --train-iters "$TRAIN_ITERS" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine
    --lr-warmup-iters "$(( TRAIN_ITERS < 200 ? TRAIN_ITERS / 10 : 20 ))"  # (2 for a TRAIN_ITERS=20 try)
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95
    --log-interval 10 --eval-interval 100 --eval-iters 4
    --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 100
    --log-jsonl "$RUN_DIR/metrics.jsonl"
    --wandb-project megatron_lite_demo --wandb-exp-name mixtral_cpu --wandb-save-dir "$RUN_DIR"
)

if [[ -n "${DRY_RUN:-}" && "$DRY_RUN" != 0 ]]; then
    WORLD_SIZE=$NPROC exec python pretrain/pretrain_gpt.py "${ARGS[@]}" "$@" --dry-run
fi
mkdir -p "$RUN_DIR"
exec torchrun --standalone --nproc-per-node "$NPROC" pretrain/pretrain_gpt.py "${ARGS[@]}" "$@"
