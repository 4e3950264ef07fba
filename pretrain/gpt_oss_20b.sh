#!/usr/bin/env bash
# gpt-oss-20b-shaped MoE across nodes: 24 layers, hidden 2880, 32 experts (top-4, 2880 wide, with biases) on every
# layer, GQA 64/8 with head_dim 64 and biases, learned attention sinks (--softmax-type learnable), a 128-token
# sliding window on every other layer (Hugging Face's sliding_window 128: --window-size 127,0, the first layer
# windowed: --window-attn-skip-freq 2), experts running gpt-oss's clamped quick-GEGLU (--quick-geglu
# --glu-linear-offset 1 --activation-func-clamp-value 7). EP=8, TP=1, PP=1, data parallel over the rest (DP=16 on
# 2 nodes of 8 GPUs, two copies of each expert), distributed optimizer, bf16.
# The architecture flags follow gpt-oss-20b's published config.json, at its original 4096-token context with plain
# RoPE (theta 150000); the released model extends that with YaRN (factor 32), which its converted checkpoint
# (tools/checkpoint/convert.py --loader hf, its MXFP4 experts dequantised) carries: `--load CKPT` with this script
# continues it with its own RoPE. The schedule (lr 3e-4 to 3e-5, batch 512) is ours: OpenAI has not published its.
#   NNODES=2 RDZV_HOST=node0 TOKENIZER=... DATA_PATH=... bash pretrain/gpt_oss_20b.sh   (on every node)
#   DRY_RUN=1 bash pretrain/gpt_oss_20b.sh
#   bash pretrain/gpt_oss_20b.sh --train-iters 100   # more flags: the last given wins
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RDZV_GIVEN=${RDZV_HOST:-${MASTER_ADDR:-}}
RDZV_HOST=${RDZV_GIVEN:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
CKPT=${CKPT:-checkpoints/gpt_oss_20b}
TOKENIZER=${TOKENIZER:-tokenizer.json}
DATA_PATH=${DATA_PATH:-data/gpt_oss_text_document}

ARGS=(
    --num-layers 24 --hidden-size 2880 --ffn-hidden-size 2880 --num-attention-heads 64
    --group-query-attention --num-query-groups 8 --kv-channels 64
    --seq-length 4096 --max-position-embeddings 131072
    --normalization RMSNorm --norm-epsilon 1e-5
    --quick-geglu --glu-linear-offset 1 --activation-func-clamp-value 7
    --position-embedding-type rope --rotary-base 150000
    --softmax-type learnable --window-size 127,0 --window-attn-skip-freq 2
    --untie-embeddings-and-output-weights
    --hidden-dropout 0.0 --attention-dropout 0.0 --init-method-std 0.02
    --num-experts 32 --moe-router-topk 4 --moe-ffn-hidden-size 2880 --expert-model-parallel-size 8
    --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
    --moe-grouped-gemm --moe-router-dtype fp32
    --recompute-granularity selective
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --micro-batch-size 1 --global-batch-size 512
    --train-iters 200000 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
    --bf16 --distributed-timeout-minutes 30
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" --vocab-size 201088
    --make-vocab-size-divisible-by 128
    --data-path $DATA_PATH --split 99,1,0
    --save "$CKPT" --load "$CKPT" --save-interval 1000
    --log-interval 10 --eval-interval 1000 --eval-iters 10
    --wandb-project gpt_oss --wandb-exp-name "gpt_oss_20b_ep8_n${NNODES}"
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
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$MASTER_PORT" --rdzv-id "${RDZV_ID:-gpt_oss_20b}" \
    pretrain/pretrain_gpt.py "${ARGS[@]}" "$@"
