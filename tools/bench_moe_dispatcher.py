#!/usr/bin/env python
"""MoE token dispatchers side by side: tokens per second through one MoE layer, forward and backward, for
the all-to-all dispatcher and the all-gather dispatcher at expert-parallel sizes 2 and 4, on the same
layer, weights and tokens, in one run (gloo on CPU by default; NCCL with --device cuda and enough GPUs).

    python tools/bench_moe_dispatcher.py
    python tools/bench_moe_dispatcher.py --tokens 8192 --hidden-size 1024 --num-experts 16 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from _world import check_device, check_outputs, check_sizes, spawn, usage_error  # tools/_world.py, beside this script

from megatron_lite.flag_parser import OneLineErrorParser


def _config(args):
    from megatron_lite.config import ModelConfig

    return ModelConfig(
        num_layers=1,
        hidden_size=args.hidden_size,
        num_attention_heads=8,
        vocab_size=128,
        activation="swiglu",
        normalization="RMSNorm",
        add_bias_linear=False,
        num_experts=args.num_experts,
        moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.ffn_hidden_size,
    )


def _check(args) -> None:
    """The flags, before any process starts: a bad one fails every worker, deep in the layer."""
    from megatron_lite.config import ConfigError, ParallelConfig, _nearest_multiples
    from megatron_lite.layout_validation import validate_layout

    check_sizes(ep=args.ep, tokens=args.tokens, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size)
    check_sizes(num_experts=args.num_experts, topk=args.topk, iters=args.iters)
    check_sizes(0, warmup=args.warmup)
    check_device(args.device, max(args.ep), "--ep")
    for ep in args.ep:
        if args.num_experts % ep:
            usage_error(
                f"--num-experts {args.num_experts} is not divisible by --ep {ep} (each rank holds the same number "
                f"of experts); use --num-experts {_nearest_multiples(args.num_experts, ep)}, or an --ep that divides it"
            )
    if args.topk > args.num_experts:
        usage_error(
            f"--topk {args.topk}: more than --num-experts {args.num_experts}; use --topk {args.num_experts} or less"
        )
    if args.hidden_size % 8:
        usage_error(
            f"--hidden-size {args.hidden_size}: the layer's config has 8 attention heads (unused by the MoE layer) "
            f"and needs a multiple of 8; use --hidden-size {_nearest_multiples(args.hidden_size, 8)}"
        )
    try:  # what else the layer's own checks would refuse, in the trainer's flag names
        for ep in args.ep:
            validate_layout(_config(args), ParallelConfig(expert_model_parallel_size=ep), ep)
    except ConfigError as e:
        usage_error(str(e))


def _worker(rank: int, world: int, args) -> list[dict]:
    from megatron_lite.config import ParallelConfig
    from megatron_lite.moe.layer import MoELayer
    from megatron_lite.parallel_context import ParallelContext

    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    ctx = ParallelContext.build(ParallelConfig(expert_model_parallel_size=world), device=device)
    base = _config(args)
    rows = []
    x = torch.randn(args.tokens, 1, args.hidden_size, generator=torch.Generator().manual_seed(rank)).to(device)
    kinds = ("alltoall", "allgather")
    layers = {}
    for kind in kinds:
        torch.manual_seed(0)
        layer = MoELayer(dataclasses.replace(base, moe_token_dispatcher_type=kind), ctx, device=device)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.02)
        layers[kind] = layer
    # the same work: both dispatchers give the same output from the same weights and tokens before any is timed
    with torch.no_grad():
        outs = [layers[k](x.clone()) for k in kinds]
    err = float((outs[0] - outs[1]).norm() / outs[1].norm())
    if not err < 1e-5:
        raise SystemExit(f"rank {rank}: the dispatchers' outputs differ by {err:.1e}; not timing them")
    times = {k: [] for k in kinds}
    for i in range(args.warmup + args.iters):
        for kind in kinds:  # alternating, so drift in the machine's speed hits both alike
            inp = x.clone().requires_grad_(True)
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            layers[kind](inp).sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            if i >= args.warmup:
                times[kind].append(time.perf_counter() - t0)
    for kind in kinds:
        step = statistics.median(times[kind])
        rows.append({"dispatcher": kind, "ep": world, "step_s": step, "tokens_per_s": args.tokens * world / step,
                     "output_rel_diff": err})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--ffn-hidden-size", type=int, default=512)
    ap.add_argument("--num-experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    check_outputs(args)
    _check(args)
    rows = []
    for ep in args.ep:
        rows += spawn(_worker, ep, args)
    print(f"{'EP':>3}  {'alltoall tok/s':>15}  {'allgather tok/s':>16}  {'alltoall / allgather':>21}")
    for ep in args.ep:
        a2a = next(r for r in rows if r["ep"] == ep and r["dispatcher"] == "alltoall")
        ag = next(r for r in rows if r["ep"] == ep and r["dispatcher"] == "allgather")
        print(
            f"{ep:>3}  {a2a['tokens_per_s']:>15.0f}  {ag['tokens_per_s']:>16.0f}  "
            f"{a2a['tokens_per_s'] / ag['tokens_per_s']:>21.2f}"
        )
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)
    return rows


if __name__ == "__main__":
    main()
