#!/usr/bin/env python
"""Context parallelism at a long sequence: activation memory per rank and step time against the CP size,
for the ring (p2p), all-to-all (a2a) and all-gather attention, side by side in one run (gloo on CPU by
default; NCCL with --device cuda and enough GPUs).

Activation memory is counted from the tensors autograd saves for the backward during one forward (distinct
storages, parameters excluded): what a step must hold at its peak, on CPU as on GPU, without the
allocator's caching in the way.

    python tools/bench_context_parallel.py                       # seq 8192, CP 1/2/4, p2p and a2a
    python tools/bench_context_parallel.py --seq-length 16384 --cp 1 2 4 8 --heads 8 --comm p2p a2a allgather
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
from _world import check_device, check_outputs, check_sizes, spawn, usage_error  # tools/_world.py, beside this script

from megatron_lite.flag_parser import OneLineErrorParser


def _saved_bytes(params: set[int]):
    """A saved_tensors_hooks pair that records the distinct non-parameter storages autograd keeps."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    return seen, pack, lambda t: t


def _config(args):
    from megatron_lite.config import LLAMA_ARCHITECTURE, ModelConfig

    return ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.seq_length,
        kernel_impl="triton" if args.device == "cuda" else "torch",
        **LLAMA_ARCHITECTURE,
    )


def _check(args) -> None:
    """The flags, before any process starts: a bad one fails every worker, deep in the model or the split."""
    from megatron_lite.config import ConfigError, ParallelConfig, _nearest_multiples
    from megatron_lite.layout_validation import validate_layout

    check_sizes(cp=args.cp, seq_length=args.seq_length, hidden_size=args.hidden_size, heads=args.heads)
    check_sizes(num_layers=args.num_layers, vocab_size=args.vocab_size, iters=args.iters)
    check_sizes(0, warmup=args.warmup)
    check_device(args.device, max(args.cp), "--cp")
    for cp in args.cp:
        if cp > 1 and args.seq_length % (2 * cp):  # (the zigzag split: 2 x CP equal chunks)
            step = math.lcm(*(2 * c for c in args.cp if c > 1))
            usage_error(
                f"--seq-length {args.seq_length} with --cp {cp}: the sequence is cut into 2 x CP = {2 * cp} equal "
                f"chunks; use --seq-length {_nearest_multiples(args.seq_length, step)} (a multiple of 2 x every --cp)"
            )
    if args.hidden_size % args.heads or args.hidden_size // args.heads % 2:
        usage_error(
            f"--hidden-size {args.hidden_size} with --heads {args.heads}: each head needs an even size (RoPE); "
            f"use --hidden-size {_nearest_multiples(args.hidden_size, 2 * args.heads)}"
        )
    for cp in args.cp:
        if cp > 1 and "a2a" in args.comm and args.heads % cp:
            usage_error(
                f"--comm a2a with --cp {cp}: the all-to-all splits --heads {args.heads} over the CP ranks; use "
                f"--heads a multiple of {cp} or leave a2a out of --comm"
            )
    try:  # what else the model's own checks would refuse, in the trainer's flag names
        for cp in args.cp:
            for comm in args.comm if cp > 1 else ["p2p"]:
                validate_layout(_config(args), ParallelConfig(context_parallel_size=cp, cp_comm_type=comm), cp)
    except ConfigError as e:
        usage_error(str(e))


def _worker(rank: int, world: int, args, comm: str) -> dict:
    from megatron_lite.config import ParallelConfig
    from megatron_lite.context_parallel.zigzag import slice_batch
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    ctx = ParallelContext.build(ParallelConfig(context_parallel_size=world, cp_comm_type=comm), device=device)
    config = _config(args)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(config, ctx, seed=1, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (1, args.seq_length + 1), generator=gen)
    mb = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(1, args.seq_length)}
    mb = slice_batch(mb, world, rank) if world > 1 else mb
    mb = {k: v.to(device) for k, v in mb.items()}  # (at CP=1 too: the model is on the device)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    times, activation = [], 0
    for i in range(args.warmup + args.iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        seen, pack, unpack = _saved_bytes(params)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = (model(mb["tokens"], mb.get("position_ids"), labels=mb["labels"]).float() * mb["loss_mask"]).sum()
        activation = sum(seen.values())
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    peak = torch.tensor([float(activation)], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"cp": world, "comm": comm, "activation_bytes": int(peak.item()), "step_s": statistics.median(times)}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--comm", nargs="+", default=["p2p", "a2a"], choices=["p2p", "a2a", "allgather"])
    ap.add_argument("--seq-length", type=int, default=8192)
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    check_outputs(args)
    _check(args)
    rows = []
    for cp in args.cp:
        for comm in args.comm if cp > 1 else ["none"]:
            row = spawn(_worker, cp, args, comm if cp > 1 else "p2p")
            row["comm"] = comm
            rows.append(row)
    base = next((r for r in rows if r["cp"] == 1), rows[0])
    print(f"sequence {args.seq_length}, hidden {args.hidden_size}, {args.num_layers} layers, {args.device}")
    vs, ideal = f"vs CP={base['cp']}", f"ideal {base['cp']}/CP"  # (the first row's when CP=1 was not run)
    print(f"{'CP':>3}  {'comm':>9}  {'activations/rank':>17}  {vs:>8}  {ideal:>10}  {'step (s)':>9}")
    for r in rows:
        print(
            f"{r['cp']:>3}  {r['comm']:>9}  {r['activation_bytes'] / 2**20:>13.1f} MiB  "
            f"{r['activation_bytes'] / base['activation_bytes']:>8.3f}  {base['cp'] / r['cp']:>10.3f}  "
            f"{r['step_s']:>9.3f}"
        )
    for cp in sorted({r["cp"] for r in rows if r["cp"] > 1}):
        by = {r["comm"]: r for r in rows if r["cp"] == cp}
        if "p2p" in by and "a2a" in by:
            print(f"CP={cp}: ring / all-to-all step time {by['p2p']['step_s'] / by['a2a']['step_s']:.2f}")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)
    return rows


if __name__ == "__main__":
    main()
