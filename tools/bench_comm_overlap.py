#!/usr/bin/env python
"""Communication overlap, measured: one Llama-3-8B-shaped transformer layer (hidden 4096, 32 heads on 8
query groups, SwiGLU 14336) under tensor + sequence parallelism, forward + backward, with and without
--tp-comm-overlap, side by side in one run: step time and the exposed-communication fraction (time blocked
in communication / step time, megatron_lite/comm_timer.py). gloo on CPU by default; NCCL with --device cuda.

With --gemm (one GPU is enough), the cost of decomposing: the per-chunk GEMM sequence the ring runs (TP
chunks of the sequence, each written into its slice of the output) against one monolithic GEMM at the same
shapes. (Torch's fused all-gather-matmul, torch.distributed._symmetric_memory, needs several GPUs: not
compared yet.)

    python tools/bench_comm_overlap.py                       # TP=2 on CPU, sequence 256
    torchrun-free on a GPU box:  python tools/bench_comm_overlap.py --device cuda --tp 8 --seq-length 8192 --gemm
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from _world import check_device, check_outputs, check_sizes, spawn, usage_error  # tools/_world.py, beside this script

from megatron_lite.flag_parser import OneLineErrorParser

LLAMA3_8B = dict(hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336)


def _config(args):
    from megatron_lite.config import LLAMA_ARCHITECTURE, ModelConfig

    shape = {**LLAMA3_8B, **({"hidden_size": args.hidden_size} if args.hidden_size else {})}
    return ModelConfig(
        num_layers=1,
        vocab_size=128,
        kernel_impl="triton" if args.device == "cuda" else "torch",
        **LLAMA_ARCHITECTURE,
        **shape,
    )


def _check(args) -> None:
    """The flags, before any work: a bad one fails every worker, deep in the layer."""
    from megatron_lite.config import ConfigError, ParallelConfig, _nearest_multiples, divisors
    from megatron_lite.layout_validation import validate_layout

    check_sizes(tp=args.tp, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, iters=args.iters)
    check_sizes(gemm_iters=args.gemm_iters)
    check_sizes(0, warmup=args.warmup)
    check_device(args.device, 1 if args.skip_layer else args.tp, "--tp")
    heads, groups = LLAMA3_8B["num_attention_heads"], LLAMA3_8B["num_query_groups"]
    if not args.skip_layer and (args.tp < 2 or groups % args.tp):
        usage_error(
            f"--tp {args.tp}: the layer is timed under tensor parallelism over its {groups} query groups "
            f"({heads} heads); use --tp in {divisors(groups)[1:]} (or --skip-layer for the GEMMs alone)"
        )
    if args.seq_length % args.tp:  # (sequence parallelism splits it over the TP ranks, the GEMMs into TP chunks)
        usage_error(
            f"--seq-length {args.seq_length} is not divisible by --tp {args.tp}; use --seq-length "
            f"{_nearest_multiples(args.seq_length, args.tp)}"
        )
    if args.skip_layer:
        return
    if args.hidden_size is not None and (args.hidden_size < 1 or args.hidden_size % (2 * heads)):
        usage_error(
            f"--hidden-size {args.hidden_size}: the layer's {heads} heads need an even size each (RoPE); use "
            f"--hidden-size {_nearest_multiples(max(args.hidden_size, 1), 2 * heads)}"
        )
    parallel = ParallelConfig(tensor_model_parallel_size=args.tp, sequence_parallel=True, tp_comm_overlap=True)
    try:  # what else the layer's own checks would refuse, in the trainer's flag names
        validate_layout(_config(args), parallel, args.tp)
    except ConfigError as e:
        usage_error(str(e))


def _worker(rank: int, world: int, args) -> list[dict]:
    from megatron_lite.config import ParallelConfig
    from megatron_lite.models.transformer import TransformerLayer
    from megatron_lite.parallel_context import ParallelContext

    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    config = _config(args)
    rows = []
    s_local = args.seq_length // world
    x0 = torch.randn(s_local, args.micro_batch_size, config.hidden_size, generator=torch.Generator().manual_seed(rank))
    for overlap in (False, True):
        parallel = ParallelConfig(tensor_model_parallel_size=world, sequence_parallel=True, tp_comm_overlap=overlap)
        ctx = ParallelContext.build(parallel, device=device)
        torch.manual_seed(0)
        layer = TransformerLayer(config, ctx, 0, device=device, dtype=dtype)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.02)
        from megatron_lite.models.rope import RotaryEmbedding

        rope = RotaryEmbedding(config.head_dim, config.rotary_base, device=device)
        cos_sin = rope(torch.arange(args.seq_length, device=device).unsqueeze(0))
        x = x0.to(device, dtype)
        times, fractions = [], []
        for i in range(args.warmup + args.iters):
            inp = x.clone().requires_grad_(True)
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ctx.comm_timer.take()
            t0 = time.perf_counter()
            layer(inp, cos_sin).float().square().mean().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step = time.perf_counter() - t0
            comm = ctx.comm_timer.take()
            dist.barrier()
            if i >= args.warmup:
                times.append(step)
                fractions.append(comm / step)
        rows.append(
            {
                "tp_comm_overlap": overlap,
                "tp": world,
                "step_s": statistics.median(times),
                "comm_exposed_fraction": statistics.median(fractions),
            }
        )
        del layer
    return rows


def gemm_decomposition(args) -> dict:
    """Per-chunk GEMMs (TP chunks of the gathered sequence into output slices) vs one GEMM, on one device."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = args.seq_length * args.micro_batch_size
    h, n = LLAMA3_8B["hidden_size"], 2 * LLAMA3_8B["ffn_hidden_size"] // args.tp  # the fc1 shard: gate + up
    x = torch.randn(tokens, h, device=device, dtype=dtype)
    w = torch.randn(n, h, device=device, dtype=dtype)
    out = torch.empty(tokens, n, device=device, dtype=dtype)
    c = tokens // args.tp

    def mono():
        torch.matmul(x, w.t(), out=out)

    def chunked():
        for j in range(args.tp):
            torch.matmul(x[j * c : (j + 1) * c], w.t(), out=out[j * c : (j + 1) * c])

    def timeit(fn):
        for _ in range(3):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(args.gemm_iters):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / args.gemm_iters

    def triton_chunked():  # what --tp-comm-overlap runs with --kernel-impl triton
        from megatron_lite import kernels as K

        for j in range(args.tp):
            K.matmul_into(out[j * c : (j + 1) * c], x[j * c : (j + 1) * c], w)

    flops = 2 * tokens * h * n
    # the same product before any time: each chunked form against the one GEMM
    mono()
    expected = out.clone()
    forms = [chunked] + ([triton_chunked] if device.type == "cuda" else [])
    for fn in forms:
        out.zero_()
        fn()
        err = float((out.float() - expected.float()).norm() / expected.float().norm())
        if not err < (1e-2 if out.dtype != torch.float32 else 1e-5):
            raise SystemExit(f"{fn.__name__} differs from the one GEMM by {err:.1e}; not timing it")
    # rounds alternating between the forms, so drift in the machine's speed hits each alike; each its median
    rounds = {fn.__name__: [] for fn in (mono, *forms)}
    for _ in range(3):
        for fn in (mono, *forms):
            rounds[fn.__name__].append(timeit(fn))
    t_mono, t_chunk = statistics.median(rounds["mono"]), statistics.median(rounds["chunked"])
    t_triton = statistics.median(rounds["triton_chunked"]) if "triton_chunked" in rounds else None
    result = {
        "shape": [tokens, h, n],
        "chunks": args.tp,
        "monolithic_tflops": flops / t_mono / 1e12,
        "chunked_tflops": flops / t_chunk / 1e12,
        "chunked_over_monolithic": t_mono / t_chunk,
        "triton_chunked_tflops": flops / t_triton / 1e12 if t_triton else None,
        "triton_chunked_over_monolithic": t_mono / t_triton if t_triton else None,
        # torch's fused all-gather-matmul needs a multi-GPU process group; this comparison runs on one device.
        "symmetric_memory_fused": "not measured (needs >= 2 GPUs and torch.distributed._symmetric_memory)",
    }
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument(
        "--hidden-size",
        type=int,
        help="override Llama-3-8B's 4096 in the timed layer (smaller for quick runs; --gemm keeps Llama-3-8B's GEMM "
        "shapes)",
    )
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--gemm", action="store_true", help="also time the per-chunk GEMMs against one GEMM")
    ap.add_argument("--gemm-iters", type=int, default=20)
    ap.add_argument("--skip-layer", action="store_true", help="only the GEMM comparison (one device)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    check_outputs(args)
    _check(args)
    result: dict = {}
    if not args.skip_layer:
        rows = spawn(_worker, args.tp, args)
        result["layer"] = rows
        plain, ovl = rows
        shape = "Llama-3-8B-shaped" if not args.hidden_size else f"Llama-3-8B-shaped (hidden {args.hidden_size})"
        print(f"{shape} layer, TP={args.tp} + SP, seq {args.seq_length}, {args.device}, fwd+bwd")
        print(f"{'':>22} {'step (s)':>10} {'comm_exposed_fraction':>22}")
        for r in rows:
            name = "--tp-comm-overlap" if r["tp_comm_overlap"] else "plain"
            print(f"{name:>22} {r['step_s']:>10.3f} {r['comm_exposed_fraction']:>22.3f}")
        print(f"overlapped / plain step time: {ovl['step_s'] / plain['step_s']:.3f}")
        result["overlapped_over_plain"] = ovl["step_s"] / plain["step_s"]
    if args.gemm:
        g = gemm_decomposition(args)
        result["gemm"] = g
        print(
            f"GEMM {g['shape']} in {g['chunks']} chunks: {g['chunked_tflops']:.3g} vs monolithic "
            f"{g['monolithic_tflops']:.3g} TFLOP/s ({g['chunked_over_monolithic']:.3f}x); fused AG-matmul: "
            f"{g['symmetric_memory_fused']}"
        )
        if g["triton_chunked_tflops"]:
            print(
                f"  our Triton GEMM, chunked: {g['triton_chunked_tflops']:.3g} TFLOP/s "
                f"({g['triton_chunked_over_monolithic']:.3f}x of the monolithic cuBLAS GEMM)"
            )
    if args.json:
        json.dump(result, open(args.json, "w"), indent=1)
    return result


if __name__ == "__main__":
    main()
