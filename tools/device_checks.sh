#!/usr/bin/env bash
# Every check that needs a GPU, in one run, for a lent accelerator (or any CUDA machine). Writes logs and
# JSON under $OUT (default ./device_out); prints one status line per check.
#   OUT=/tmp/out bash tools/device_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MEGATRON_LITE_CACHE=${MEGATRON_LITE_CACHE:-/tmp/megatron_lite_cache}
nvidia-smi -L > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1

# 1a. The kernel tests on the GPU: fp32 against the references (tl.dot in ieee fp32, conftest.py) and bf16
#     (issue 6), every kernel compiled for this device.
KERNEL_TESTS=(tests/test_kernels_attention.py tests/test_kernels_cross_entropy.py tests/test_kernels_elementwise.py
              tests/test_kernels_gemm.py tests/test_kernels_moe.py tests/test_nf4.py tests/test_kernel_impl.py)
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs --junitxml="$OUT/junit_kernels.xml" "${KERNEL_TESTS[@]}" \
    > "$OUT/pytest_kernels.log" 2>&1
echo "pytest (kernels on the GPU): rc=$? $(tail -n 1 "$OUT/pytest_kernels.log")"

# 1b. The rest of the suite (fast part) on this machine's torch: CUDA variants run, gloo tests on the CPU.
timeout 300 python3 -m pytest -q -p no:cacheprovider -m "not slow" --junitxml="$OUT/junit_fast.xml" tests \
    $(printf -- '--ignore=%s ' "${KERNEL_TESTS[@]}") > "$OUT/pytest_fast.log" 2>&1
echo "pytest (not slow): rc=$? $(tail -n 1 "$OUT/pytest_fast.log")"

# 2. Whole jobs under torchrun (gloo): exact resume, dry runs of the shipped scripts.
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_pretrain_torchrun.py -k "resume or dry_run" \
    > "$OUT/pytest_torchrun.log" 2>&1
echo "pytest (torchrun): rc=$? $(tail -n 1 "$OUT/pytest_torchrun.log")"

# 3. A real bf16 training job on the GPU (NCCL, fused AdamW, MFU against the datasheet peak), saved at
#    iteration 20 and resumed to 30.
ARGS=(--num-layers 8 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --group-query-attention
      --num-query-groups 8 --seq-length 2048 --normalization RMSNorm --swiglu --position-embedding-type rope
      --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0
      --micro-batch-size 4 --global-batch-size 16 --train-iters 30 --lr 3e-4 --lr-warmup-iters 5
      --lr-decay-style cosine --bf16 --mock-data --vocab-size 32000 --log-interval 5 --eval-iters 0
      --recompute-granularity selective --overlap-grad-reduce)
rm -rf /tmp/gpu_ckpt
timeout 180 torchrun --standalone --nproc-per-node 1 pretrain/pretrain_gpt.py "${ARGS[@]}" --exit-interval 20 \
    --save /tmp/gpu_ckpt --log-jsonl "$OUT/gpu_train.jsonl" > "$OUT/gpu_train.log" 2>&1
echo "gpu train: rc=$? $(grep -c lm_loss "$OUT/gpu_train.jsonl" 2>/dev/null) records"
timeout 120 torchrun --standalone --nproc-per-node 1 pretrain/pretrain_gpt.py "${ARGS[@]}" --load /tmp/gpu_ckpt \
    --log-jsonl "$OUT/gpu_train.jsonl" > "$OUT/gpu_resume.log" 2>&1
echo "gpu resume: rc=$? $(grep -o 'loaded [^,]*' "$OUT/gpu_resume.log")"

# 4. Training step against transformers + torch AdamW, bf16, side by side.
timeout 180 python3 tools/bench_train_step.py --device cuda --bf16 --num-layers 8 --hidden-size 2048 \
    --num-attention-heads 16 --num-query-groups 8 --vocab-size 32000 --seq-length 2048 --micro-batch-size 4 \
    --warmup 3 --iters 10 --json "$OUT/bench_train_step.json" > "$OUT/bench_train_step.log" 2>&1
echo "bench: rc=$? $(tail -n 1 "$OUT/bench_train_step.log")"

# 5. Kernels at Llama-3-8B shapes in bf16 beside eager / torch.compile (targets: issue 6); the table goes to
#    $OUT/bench/kernels.md, to be committed under docs/ with the device named.
timeout 480 python3 tools/bench_kernels.py --size llama8b --out-dir "$OUT/bench" > "$OUT/bench_kernels.log" 2>&1
echo "bench kernels: rc=$? $(grep -c '"kernel"' "$OUT/bench_kernels.log") rows"

# 6. The cost of decomposing a GEMM for --tp-comm-overlap (issue 9): per-chunk GEMMs (TP=8 chunks of an 8k
#    sequence, Llama-3-8B fc1 shard) against one GEMM, bf16; target >= 0.90x. One GPU suffices.
timeout 120 python3 tools/bench_comm_overlap.py --device cuda --skip-layer --gemm --tp 8 --seq-length 8192 \
    --gemm-iters 50 --json "$OUT/bench_comm_overlap.json" > "$OUT/bench_comm_overlap.log" 2>&1
echo "bench gemm decomposition: rc=$? $(tail -n 1 "$OUT/bench_comm_overlap.log")"
