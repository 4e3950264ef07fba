#!/usr/bin/env bash
# Every check that needs a GPU, in one run sized for a 15-minute lease (give the run 540 s; the steps stop at
# 150 + 270 + 30 + 2 x 50 + 2 x 25 s, the last ones first to go, leaving time for one rerun). Works on any CUDA machine.
# Logs go to $WORK and are packed after every step into $OUT/logs.tgz; the kernel table and its JSON are copied
# to $OUT/kernels.md and $OUT/kernels.json (the device tool brings back at most 8 files). Prints one status line
# per check, the benchmark's target verdicts last.
#   OUT=/tmp/out bash tools/device_checks.sh
# A rerun can narrow it: KERNEL_TESTS="tests/a.py tests/b.py", BENCH_ARGS="--profile fused_linear_cross_entropy",
# SKIP_GEMM=1, SKIP_TRAIN=1 (both training jobs), SKIP_FP8=1 (the fp8 one), SKIP_DECODE=1; TILES="32x64x4x3,..." (TILE_KERNEL=dkdv) first times those flash
# attention tiles and checks each for races (tools/bench_attention_tiles.py); NORM_TILES=grid (or "2x1x3x8,...")
# the norms' backward settings (tools/bench_norm_tiles.py); CE_ROWS=grid (or that tool's flags, e.g. "--stats
# 2048x3x4 --grad 4096x1x16 --in-turn 1") the fused cross-entropy's row kernels (tools/bench_ce_rows.py); SKIP_BENCH=1 skips
# tools/bench_kernels.py. The GPU's clocks, power and
# throttle reasons are logged every 250 ms to clocks.csv in the logs.
set -uo pipefail
if [ $# -gt 0 ]; then  # (it takes no arguments: --help or anything else prints this header)
    sed -n '2,/^set /p' "$0" | grep '^#' | cut -c3-
    exit 0
fi
cd "$(dirname "$0")/.."
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "error: no CUDA device here: tools/device_checks.sh runs the GPU checks (the CPU suite is the README's test command)" >&2
    exit 2
fi
OUT=${OUT:-device_out}
WORK=${WORK:-/tmp/device_checks}
mkdir -p "$OUT" "$WORK/bench"
# (a machine kept warm between runs still holds the last run's results: none of them may pass for this run's)
rm -f "$WORK"/summary.txt "$WORK"/*.log "$WORK"/*.json "$WORK"/*.xml "$WORK"/bench/*
export PYTHONUNBUFFERED=1 MEGATRON_LITE_CACHE=${MEGATRON_LITE_CACHE:-/tmp/megatron_lite_cache}
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$WORK/summary.txt"; }
pack() {  # what came back so far, even if a later step is cut short
    cp -f "$WORK"/bench/kernels.md "$WORK"/bench/kernels.json "$OUT"/ 2>/dev/null
    cp -f "$WORK/summary.txt" "$OUT"/ 2>/dev/null
    tar czf "$OUT/logs.tgz" -C "$WORK" . 2>/dev/null
}
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
    > "$WORK/gpu.txt" 2>&1
cat "$WORK/gpu.txt" | tee -a "$WORK/summary.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$WORK/install.log" 2>&1
stamp "install: rc=$? $(python3 -c 'import megatron_lite.kernels as K; print("kernels from", K.__file__)' 2>&1 | tail -n 1)"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 250 > "$WORK/clocks.csv" 2>&1 &
CLOCKS=$!
trap 'kill $CLOCKS 2>/dev/null' EXIT
pack

# 0. Only if asked (TILES): candidate flash-attention tiles, each timed beside SDPA and run repeatedly for races.
if [ -n "${TILES:-}" ]; then
    timeout ${TILES_TIMEOUT:-200} python3 tools/bench_attention_tiles.py --kernel ${TILE_KERNEL:-dkdv} --tiles "$TILES" \
        --repeats ${TILE_REPEATS:-10} --json "$WORK/bench/tiles.json" > "$WORK/bench_tiles.log" 2>&1
    stamp "bench tiles: rc=$? $(grep -c '"tile"' "$WORK/bench_tiles.log") tiles"
    grep -A 40 "tiles on" "$WORK/bench_tiles.log" | tee -a "$WORK/summary.txt"
    pack
fi

# 0b. Only if asked (NORM_TILES: "grid", or PxRxSxW settings): the norms' backward settings, each timed beside a
#     same-size copy and checked (tools/bench_norm_tiles.py).
if [ -n "${NORM_TILES:-}" ]; then
    NORM_SETTINGS=()
    [ "$NORM_TILES" = grid ] || NORM_SETTINGS=(--settings "$NORM_TILES")
    timeout ${NORM_TILES_TIMEOUT:-150} python3 tools/bench_norm_tiles.py ${NORM_SETTINGS[@]+"${NORM_SETTINGS[@]}"} \
        --json "$WORK/bench/norm_tiles.json" > "$WORK/bench_norm_tiles.log" 2>&1
    stamp "bench norm tiles: rc=$? $(grep -c '"setting"' "$WORK/bench_norm_tiles.log") settings"
    grep -A 10 "backward settings on" "$WORK/bench_norm_tiles.log" | tee -a "$WORK/summary.txt"
    pack
fi

# 0c. Only if asked (CE_ROWS: "grid", or tools/bench_ce_rows.py's flags): the fused cross-entropy's row-kernel
#     settings on one chunk, each checked and timed beside a same-size copy, then the op in turn with torch.compile.
if [ -n "${CE_ROWS:-}" ]; then
    CE_ARGS=()
    [ "$CE_ROWS" = grid ] || read -r -a CE_ARGS <<< "$CE_ROWS"
    timeout ${CE_ROWS_TIMEOUT:-300} python3 tools/bench_ce_rows.py ${CE_ARGS[@]+"${CE_ARGS[@]}"} \
        --json "$WORK/bench/ce_rows.json" > "$WORK/bench_ce_rows.log" 2>&1
    stamp "bench ce rows: rc=$? $(grep -c '"setting"' "$WORK/bench_ce_rows.log") settings"
    grep -E -A 14 "kernel on|timed in turn" "$WORK/bench_ce_rows.log" | tee -a "$WORK/summary.txt"
    pack
fi

# 1. The kernel tests on the GPU: every flash-attention autotuner tile forced and run twice (a race in two dK/dV
#    tiles showed there), fp32 against the references (tl.dot in ieee fp32, conftest.py) and bf16 (issue 6),
#    every kernel compiled and autotuned for this device. Parallel: compiling dominates.
DEFAULT_KERNEL_TESTS=(tests/test_kernels_attention_tiles.py tests/test_kernels_bf16.py tests/test_kernels_attention.py tests/test_kernels_cross_entropy.py tests/test_kernels_elementwise.py
              tests/test_kernels_gemm.py tests/test_kernels_moe.py tests/test_nf4.py tests/test_kernel_impl.py  # (+ bf16 greedy decoding)
              tests/test_kernels_large.py  # past 2^31 elements (~40 GB)
              tests/test_comm_timer.py  # and the exposed-communication timer's CUDA events
              # --deterministic-mode: flash attention's fixed tiles at three head sizes; two bf16 jobs, bit-equal
              tests/test_determinism.py::test_gpu_flash_attention_on_its_deterministic_tiles_repeats_and_is_right
              tests/test_determinism.py::test_gpu_bf16_jobs_under_deterministic_mode_repeat_bitwise
              tests/test_fp8.py::test_gpu_fp8_linear_in_bf16_is_the_product_of_the_quantized_operands  # _scaled_mm
              # gpt-oss's biased quick-GEGLU experts through the grouped GEMMs in bf16 (its sinks: test_kernels_bf16)
              tests/test_gpt_oss_mlp.py::test_gpu_gpt_oss_moe_layer_in_bf16_runs_grouped_and_matches_fp32
              tests/test_kernels_quick_geglu.py)  # its activation's kernel (bf16: here and test_kernels_bf16)
read -r -a KERNEL_TESTS <<< "${KERNEL_TESTS:-${DEFAULT_KERNEL_TESTS[*]}}"
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8 --dist loadgroup" || echo "")  # the >2^31 tests: one worker
# SIGINT first: pytest then may still print its summary and junit file (xdist's teardown can hang on it, so -v
# names each test as it ends: a cut run still says which passed)
timeout -s INT -k 15 ${KERNEL_TEST_TIMEOUT:-150} python3 -m pytest -v -p no:cacheprovider $XDIST -rs --durations=12 \
    --junitxml="$WORK/junit_kernels.xml" "${KERNEL_TESTS[@]}" > "$WORK/pytest_kernels.log" 2>&1
stamp "pytest (kernels on the GPU): rc=$? $(tail -n 1 "$WORK/pytest_kernels.log")"
grep -E "^(FAILED|ERROR)" "$WORK/pytest_kernels.log" | head -n 20 | tee -a "$WORK/summary.txt"
pack

# 2. Kernels at Llama-3-8B shapes in bf16 beside SDPA's flash backend / eager / torch.compile (targets: issue 6);
#    the table is $OUT/kernels.md, to be committed under docs/ with the device named.
if [ -n "${SKIP_BENCH:-}" ]; then
    stamp "bench kernels: skipped (SKIP_BENCH)"
else
    timeout ${BENCH_TIMEOUT:-270} python3 tools/bench_kernels.py --size ${BENCH_SIZE:-llama8b} --out-dir "$WORK/bench" \
        ${BENCH_ARGS:---profile fused_linear_cross_entropy} \
        > "$WORK/bench_kernels.log" 2>&1
    stamp "bench kernels: rc=$? $(grep -c '"kernel"' "$WORK/bench_kernels.log") rows"
fi
pack

# 3. The cost of decomposing a GEMM for --tp-comm-overlap (issue 9): per-chunk GEMMs (TP=8 chunks of an 8k
#    sequence, Llama-3-8B fc1 shard) against one GEMM, bf16; target >= 0.90x. One GPU suffices.
if [ -n "${SKIP_GEMM:-}" ]; then
    stamp "bench gemm decomposition: skipped (SKIP_GEMM)"
else
    timeout ${GEMM_TIMEOUT:-30} python3 tools/bench_comm_overlap.py --device cuda --skip-layer --gemm --tp 8 \
        --seq-length 8192 --gemm-iters 50 --json "$WORK/bench_comm_overlap.json" > "$WORK/bench_comm_overlap.log" 2>&1
    stamp "bench gemm decomposition: rc=$? $(tail -n 1 "$WORK/bench_comm_overlap.log")"
fi
pack

# 4. If time is left: a short bf16 training job on the GPU (NCCL, Triton kernels by default on CUDA, MFU against
#    the datasheet peak), the whole stack end to end.
if [ -n "${SKIP_TRAIN:-}" ]; then
    stamp "gpu train: skipped (SKIP_TRAIN)"
else
    timeout ${TRAIN_TIMEOUT:-50} torchrun --standalone --nproc-per-node 1 pretrain/pretrain_gpt.py \
        --num-layers 8 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --group-query-attention \
        --num-query-groups 8 --seq-length 2048 --normalization RMSNorm --swiglu --position-embedding-type rope \
        --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 \
        --micro-batch-size 4 --global-batch-size 16 --train-iters 15 --lr 3e-4 --lr-warmup-iters 5 --bf16 \
        --mock-data --vocab-size 32000 --log-interval 5 --eval-iters 0 --overlap-grad-reduce \
        --log-jsonl "$WORK/gpu_train.jsonl" > "$WORK/gpu_train.log" 2>&1
    stamp "gpu train: rc=$? $(grep -c lm_loss "$WORK/gpu_train.jsonl" 2>/dev/null) records; $(tail -n 1 "$WORK/gpu_train.jsonl" 2>/dev/null | cut -c1-300)"
    stamp "gpu train: Megatron's memory report: $(grep -m 1 'max allocated' "$WORK/gpu_train.log" | cut -c1-200)"
    # 4b. The same job with fp8 GEMMs (--fp8-format hybrid, Megatron's default delayed recipe): its iteration
    #     time beside the bf16 one's above, its loss beside theirs (torch._scaled_mm on Hopper).
    [ -z "${SKIP_FP8:-}" ] || stamp "gpu train fp8: skipped (SKIP_FP8)"
    [ -n "${SKIP_FP8:-}" ] || timeout ${TRAIN_TIMEOUT:-50} torchrun --standalone --nproc-per-node 1 \
        pretrain/pretrain_gpt.py --num-layers 8 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 \
        --group-query-attention --num-query-groups 8 --seq-length 2048 --normalization RMSNorm --swiglu \
        --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear \
        --hidden-dropout 0 --attention-dropout 0 --micro-batch-size 4 --global-batch-size 16 --train-iters 15 \
        --lr 3e-4 --lr-warmup-iters 5 --bf16 --mock-data --vocab-size 32000 --log-interval 5 --eval-iters 0 \
        --overlap-grad-reduce --fp8-format hybrid --fp8-amax-history-len 16 --fp8-amax-compute-algo max \
        --log-jsonl "$WORK/gpu_train_fp8.jsonl" > "$WORK/gpu_train_fp8.log" 2>&1 \
        && stamp "gpu train fp8: $(grep -m 1 'fp8 (' "$WORK/gpu_train_fp8.log" | cut -c1-160)"
    [ -n "${SKIP_FP8:-}" ] || stamp "gpu train fp8: rc=$? $(grep -c lm_loss "$WORK/gpu_train_fp8.jsonl" 2>/dev/null) records; $(tail -n 1 "$WORK/gpu_train_fp8.jsonl" 2>/dev/null | cut -c1-300)"
fi
pack
# 5. If time is still left: a decoding step on a 4096-token KV cache beside transformers, bf16 (DeepSeek-V3's
#    head sizes: the absorbed latents; then Llama's grouped-query heads).
[ -z "${SKIP_DECODE:-}" ] || stamp "bench decode: skipped (SKIP_DECODE)"
[ -n "${SKIP_DECODE:-}" ] || for model in deepseek_v3 llama; do
    timeout ${DECODE_TIMEOUT:-25} python3 tools/bench_decode.py --device cuda --bf16 --model $model --context 4096 \
        --json "$WORK/bench_decode_$model.json" > "$WORK/bench_decode_$model.log" 2>&1
    stamp "bench decode $model: rc=$? $(tail -n 1 "$WORK/bench_decode_$model.log" | cut -c1-300)"
done
pack
[ ! -f "$WORK/bench_kernels.log" ] || grep -vE '^\{"kernel"' "$WORK/bench_kernels.log" | grep -vE "Warning|warn" | tail -n 30
