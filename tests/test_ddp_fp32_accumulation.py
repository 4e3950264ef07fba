"""--ddp-reduce-scatter-with-fp32-accumulation (Megatron's flag): the distributed optimizer's reduce-scatter of
bf16 gradients (--grad-reduce-in-bf16) sends bf16 but sums in fp32, rounding once.

- At DP=4 each rank's reduced part equals the sum of the four ranks' bf16 gradients formed exactly (in float64:
  four bf16 values in [1, 2) of either sign sum exactly in fp32 too) and rounded once to bf16; the plain bf16
  reduce-scatter rounds its partial sums and differs. ZeRO-1 (overlapped launches) and ZeRO-2 (launched under
  the backward, and blocking).
- A DP=2 bf16 run with the flag equals the one-process run (per-iteration lm_loss and grad_norm).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_grad_reduce_bf16 import BF16_GRADS, SAME_SUM_TOL, _compare
from test_train_equivalence import train_run

from megatron_lite.config import ParallelConfig
from megatron_lite.distributed.ddp import GradBuffer

SIZES = (40, 24, 36)  # three parameters, in two buckets (each padded to a multiple of the group size)


def _gradient(rank: int, i: int) -> torch.Tensor:
    """Rank `rank`'s bf16 gradient of parameter i: magnitudes in [1, 2), random signs."""
    g = torch.Generator().manual_seed(100 * rank + i)
    sign = torch.randint(0, 2, (SIZES[i],), generator=g) * 2 - 1
    return ((1 + torch.rand(SIZES[i], generator=g)) * sign).bfloat16()


def reduced_parts(fp32_accumulation: bool, zero_stage: int, overlap: bool):
    """(this rank's reduced parts, the parts the exact sum rounded once gives) for one backward's buffer."""
    from dist_pool import get_context

    ctx = get_context(ParallelConfig())
    group = ctx.dp_cp
    params = [torch.nn.Parameter(torch.zeros(n)) for n in SIZES]
    buffer = GradBuffer(params, group, 50, sharded=True, zero_stage=zero_stage, dtype=torch.bfloat16,
                        fp32_accumulation=fp32_accumulation)  # fmt: skip
    assert len(buffer.buckets) == 2
    buffer.zero()
    for i, p in enumerate(params):
        buffer.grad_view(p).copy_(_gradient(group.rank, i))
        buffer.mark_ready(p, overlap, None)
    buffer.finish(None)
    got, expected = [], []
    for b in buffer.buckets:
        got.append(b.shard_grad.clone())
        exact = torch.zeros(b.hi - b.lo, dtype=torch.float64)
        for i, p in enumerate(params):
            if buffer.bucket_of[id(p)] is b:
                start = buffer.offset[id(p)] - b.lo
                exact[start : start + p.numel()] = sum(_gradient(r, i).double() for r in range(group.size))
        expected.append(exact.view(group.size, -1)[group.rank].bfloat16())
    return got, expected


@pytest.mark.parametrize("zero_stage,overlap", [(1, True), (2, True), (2, False)])
def test_reduce_scatter_sums_bf16_in_fp32_and_rounds_once(dist, zero_stage, overlap):
    for got, expected in dist(4, reduced_parts, True, zero_stage, overlap):
        for g, e in zip(got, expected):
            assert g.dtype == torch.bfloat16 and torch.equal(g, e)
    # the plain bf16 reduce-scatter rounds its partial sums: the test tells the two apart
    plain = dist(4, reduced_parts, False, zero_stage, overlap)
    assert any(not torch.equal(g, e) for got, expected in plain for g, e in zip(got, expected))


def test_data_parallel_run_with_fp32_accumulation_equals_one_process(dist):
    """ZeRO-1 with overlapped bucket reductions (ZeRO-2's reduce-scatters are the ones above)."""
    ref = train_run("llama", ParallelConfig(), 4, 2, optim=BF16_GRADS, bf16=True, iters=6)
    optim = dataclasses.replace(BF16_GRADS, ddp_reduce_scatter_with_fp32_accumulation=True)
    kw = dict(distributed_optimizer=True, overlap=True, bucket_size=3000, iters=6)
    for history in dist(2, train_run, "llama", ParallelConfig(), 4, 2, optim=optim, bf16=True, **kw):
        _compare(history, ref, SAME_SUM_TOL)


def live_receives() -> tuple[int, int]:
    """ZeRO-1 overlapped, eight buckets: (the bytes of receive buffers still alive when the backward ends, one
    bucket's bytes)."""
    from dist_pool import get_context

    ctx = get_context(ParallelConfig())
    params = [torch.nn.Parameter(torch.zeros(40)) for _ in range(8)]
    buffer = GradBuffer(params, ctx.dp_cp, 40, sharded=True, dtype=torch.bfloat16, fp32_accumulation=True)
    assert len(buffer.buckets) == 8
    buffer.zero()
    for i, p in enumerate(params):
        buffer.grad_view(p).fill_(i)
        buffer.mark_ready(p, True, None)
    live = sum(b.handle.received.nbytes for b in buffer.buckets if b.handle is not None)
    buffer.finish(None)
    assert all(torch.equal(b.shard_grad, torch.full_like(b.shard_grad, 2 * i)) for i, b in enumerate(buffer.buckets))
    return live, buffer.buckets[0].data.nbytes


def test_overlapped_zero1_keeps_two_receive_buffers_at_most(dist):
    """(From a review: every bucket's all-to-all receive buffer lived until finish(), the whole gradient buffer
    again at the end of the backward.)"""
    for live, bucket in dist(2, live_receives):
        assert live <= 2 * bucket, (live, bucket)


def test_the_flag_reaches_the_gradient_buffers():
    """(From a review: at DP=2 one rounding equals the ring's, so the run above passes with the flag dropped on
    its way to the buffers.)"""
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.training.wrap import wrap_for_training

    from models import llama_config

    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    optim = dataclasses.replace(BF16_GRADS, use_distributed_optimizer=True)
    for flag in (True, False):
        optim = dataclasses.replace(optim, ddp_reduce_scatter_with_fp32_accumulation=flag)
        ddp, _ = wrap_for_training(build_model(llama_config(), ctx, seed=1), ctx, optim)
        assert ddp.buffers and all(b.fp32_accumulation is flag for b in ddp.buffers)


def test_where_the_flag_changes_nothing_a_start_up_line_says_so():
    from megatron_lite.arguments import parse_args
    from megatron_lite.megatron_flags import accepted_no_ops

    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-iters 4 --mock-data "
    base += "--vocab-size 100 --ddp-reduce-scatter-with-fp32-accumulation"
    for extra, note in (
        ("--bf16 --grad-reduce-in-bf16", "has no effect without --use-distributed-optimizer"),
        ("--use-torch-fsdp2 --bf16", "has no effect with --use-torch-fsdp2"),
        ("--use-distributed-optimizer", "fp32 gradients (no --bf16 --grad-reduce-in-bf16) are summed in fp32"),
        ("--use-distributed-optimizer --bf16 --grad-reduce-in-bf16", None),
        ("--use-distributed-optimizer --bf16 --use-precision-aware-optimizer --main-grads-dtype bf16", None),
    ):
        ns, job = parse_args(f"{base} {extra}".split())
        notes = [n for n in accepted_no_ops(ns) if "fp32-accumulation" in n]
        assert job.optimizer.ddp_reduce_scatter_with_fp32_accumulation
        assert notes == ([] if note is None else [n for n in notes if note in n]) and len(notes) == (note is not None)
