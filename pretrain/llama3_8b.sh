#!/usr/bin/env bash
# Llama-3-8B on one node of 8 GPUs: TP=4 with sequence parallelism, DP=2, bf16, selective recomputation.
# The schedule is Llama 2's paper's for its 7B (lr 3e-4 cosine to 10%, 2000 warm-up steps, beta2 0.95, weight
# decay 0.1, clipping 1.0); Meta has not published Llama 3's for the 8B.
#   TOKENIZER=/path/to/llama3/tokenizer.json DATA_PATH=/data/llama3_text_document bash pretrain/llama3_8b.sh
#   DRY_RUN=1 bash pretrain/llama3_8b.sh   # validate and print memory per rank on any machine
#   bash pretrain/llama3_8b.sh --train-iters 100   # more flags: the last given wins
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CKPT=${CKPT:-checkpoints/llama3_8b}
TOKENIZER=${TOKENIZER:-tokenizer.json}
DATA_PATH=${DATA_PATH:-data/llama3_text_document}

ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --kv-channels 128
    --seq-length 8192 --max-position-embeddings 8192
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
    --position-embedding-type rope --rotary-base 500000
    --untie-embeddings-and-output-weights --disable-bias-linear
    --hidden-dropout 0.0 --attention-dropout 0.0 --init-method-std 0.01
    --tensor-model-parallel-size 4 --sequence-parallel
    --recompute-granularity selective
    --micro-batch-size 1 --global-batch-size 128
    --train-iters 100000 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8
    --bf16 --overlap-grad-reduce
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" --vocab-size 128256
    --data-path $DATA_PATH --split 99,1,0
    --save "$CKPT" --load "$CKPT" --save-interval 1000
    --log-interval 10 --eval-interval 1000 --eval-iters 10
    --wandb-project llama3_8b --wandb-exp-name "llama3_8b_tp4"
)

if [[ -n "${DRY_RUN:-}" && "$DRY_RUN" != 0 ]]; then
    WORLD_SIZE=$GPUS_PER_NODE exec python pretrain/pretrain_gpt.py "${ARGS[@]}" "$@" --dry-run
fi
exec torchrun --standalone --nproc-per-node "$GPUS_PER_NODE" pretrain/pretrain_gpt.py "${ARGS[@]}" "$@"
