#!/usr/bin/env python
"""Pipeline schedules measured: bubble fraction against theory, and step time against PyTorch's own
torch.distributed.pipelining schedules on the same stages and micro-batches, in one run.

Every stage costs a fixed, known time per micro-batch (a sleep: forward F ms, backward 2F ms, split evenly
over a rank's virtual stages), so P processes on a small CPU measure the schedule, not contention for
cores. With m micro-batches and v virtual stages per rank, a rank's ideal busy time is m * 3F and the
bubble, relative to it, is (p - 1) / (v * m) in theory.

    python tools/bench_pipeline.py                  # p = 4, m = 8, F = 100 ms, 1F1B and interleaved (v = 2)
    python tools/bench_pipeline.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _world import check_outputs, check_sizes, usage_error  # tools/_world.py, beside this script
from torch import nn

from megatron_lite.flag_parser import OneLineErrorParser

HIDDEN, SEQ, MICRO = 32, 8, 1


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.backward_s)
        return g, None, None


class OurStage(nn.Module):
    """A stage with the call signature of megatron_lite's model chunks and a fixed cost."""

    def __init__(self, first: bool, forward_s: float) -> None:
        super().__init__()
        self.first, self.forward_s = first, forward_s
        self.w = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, tokens, position_ids=None, labels=None, hidden_states=None, grads_in_forward=False):
        x = torch.ones(SEQ, tokens.shape[0], HIDDEN) if self.first else hidden_states
        x = _Sleep.apply(x * self.w, self.forward_s, 2 * self.forward_s)
        return x.mean(-1).t() if labels is not None else x


class TorchStage(nn.Module):
    def __init__(self, forward_s: float) -> None:
        super().__init__()
        self.forward_s = forward_s
        self.w = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x):
        return _Sleep.apply(x * self.w, self.forward_s, 2 * self.forward_s)


def _time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first run warms up


def _measure(rank: int, p: int, v: int, args) -> dict:
    """One schedule (1F1B for v = 1, interleaved otherwise), ours and torch's, on identical stages."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    from megatron_lite.config import ParallelConfig
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.pipeline_parallel.executor import run_pipeline

    m, f = args.microbatches, args.forward_ms / 1000
    chunk_s = f / v  # a rank's work is the same at any v: each of its v stages costs 1/v of it
    ctx = ParallelContext.build(ParallelConfig(pipeline_model_parallel_size=p))
    chunks = [OurStage(c * p + rank == 0, chunk_s) for c in range(v)]
    batch = {
        "tokens": torch.zeros(MICRO, SEQ, dtype=torch.long),
        "labels": torch.zeros(MICRO, SEQ, dtype=torch.long),
        "loss_mask": torch.ones(MICRO, SEQ),
    }
    ours = _time(lambda: run_pipeline(chunks, ctx, [batch] * m, (SEQ, MICRO, HIDDEN), torch.float32), args.repeats)

    stages = [PipelineStage(TorchStage(chunk_s), c * p + rank, p * v, torch.device("cpu")) for c in range(v)]
    loss_fn = lambda out, target: out.mean()  # noqa: E731
    sched = Schedule1F1B(stages[0], m, loss_fn=loss_fn) if v == 1 else ScheduleInterleaved1F1B(stages, m, loss_fn)
    x = torch.ones(m * MICRO, SEQ, HIDDEN)

    def torch_step():
        if rank == 0:
            sched.step(x)
        elif rank == p - 1:
            sched.step(target=x, losses=[])
        else:
            sched.step()

    theirs = _time(torch_step, args.repeats)
    ideal = m * 3 * f
    return {
        "schedule": "1F1B" if v == 1 else "interleaved 1F1B",
        "p": p,
        "v": v,
        "m": m,
        "theory_bubble": (p - 1) / (v * m),
        "measured_bubble": (ours - ideal) / ideal,
        "megatron_lite_step_s": ours,
        "torch_pipelining_step_s": theirs,
        "torch_over_ours": theirs / ours,
    }


def _worker(rank: int, world: int, init: str, args, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    rows = [_measure(rank, world, v, args) for v in (1, args.vp)]
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(rows, fh)
    dist.barrier()  # gloo aborts at exit ("terminate called ...") if a rank leaves while a peer still talks
    dist.destroy_process_group()


def _check(args) -> None:
    """The flags, before any process starts: a schedule that cannot run fails every worker with a traceback
    (and --pp 0 starts none)."""
    from megatron_lite.config import _nearest_multiples
    from megatron_lite.pipeline_parallel.schedules import ScheduleError, validate

    if args.pp < 2:  # (at 1, torch's stage is first and last at once: its step here fails without a target)
        usage_error(f"--pp {args.pp}: a pipeline needs 2 ranks or more; use --pp 2 or more")
    check_sizes(vp=args.vp, microbatches=args.microbatches, repeats=args.repeats)
    if not args.forward_ms > 0:
        usage_error(f"--forward-ms {args.forward_ms}: must be more than 0 (the bubble is relative to it)")
    m, pp = args.microbatches, args.pp
    if m < pp:  # (torch's Schedule1F1B refuses fewer)
        usage_error(f"--microbatches {m}: fewer than --pp {pp}, which 1F1B needs; use --microbatches {pp} or more")
    for v in (1, args.vp):
        try:
            validate(pp, v, m)
        except ScheduleError:  # (its message names the trainer's flags: --global-batch-size sets the micro-batches)
            usage_error(
                f"--microbatches {m} with --pp {pp} --vp {v}: the interleaved schedule needs a multiple of --pp; "
                f"use --microbatches {_nearest_multiples(m, pp)}"
            )


def main(argv: list[str] | None = None) -> list[dict]:
    ap = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--vp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--forward-ms", type=float, default=100.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    check_outputs(args)
    _check(args)
    with tempfile.TemporaryDirectory() as tmp:
        init, out = os.path.join(tmp, "init"), os.path.join(tmp, "rows.json")
        mp.start_processes(_worker, args=(args.pp, init, args, out), nprocs=args.pp, start_method="spawn")
        rows = json.load(open(out))
    print(
        f"{'schedule':18}{'p':>3}{'v':>3}{'m':>4}{'bubble theory':>15}{'measured':>10}"
        f"{'ours (s)':>10}{'torch (s)':>11}{'torch/ours':>12}"
    )
    for r in rows:
        print(
            f"{r['schedule']:18}{r['p']:>3}{r['v']:>3}{r['m']:>4}{r['theory_bubble']:>15.3f}"
            f"{r['measured_bubble']:>10.3f}{r['megatron_lite_step_s']:>10.3f}{r['torch_pipelining_step_s']:>11.3f}"
            f"{r['torch_over_ours']:>12.2f}"
        )
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)
    return rows


if __name__ == "__main__":
    main()
