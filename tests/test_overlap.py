"""--overlap-grad-reduce: the first bucket's all-reduce is launched while the backward is still running,
and DP=2 with overlap still equals one process."""

from __future__ import annotations

import pytest
import torch
from test_train_equivalence import _compare, train_run

from megatron_lite.config import ParallelConfig
from megatron_lite.data.mock import MockGPTDataset, collate
from megatron_lite.distributed.ddp import DistributedDataParallel
from megatron_lite.models.gpt_model import GPTModel
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.optimizer.lr_scheduler import LRScheduler
from megatron_lite.optimizer.optimizer import MixedPrecisionOptimizer
from megatron_lite.training.step import train_step

from dist_pool import get_context
from models import llama_config


def overlap_events():
    ctx = get_context(ParallelConfig())
    ctx.seed(0)
    model = GPTModel(llama_config(), ctx, seed=0)
    ddp = DistributedDataParallel(model, ctx, overlap_grad_reduce=True, bucket_size=20_000, record_events=True)
    optim = OptimizerConfig(lr=1e-3)
    opt = MixedPrecisionOptimizer(model, ddp.main_grad, optim, ctx)
    data = MockGPTDataset(250, 16, seed=1)
    batches = [collate([data[ctx.dp.rank * 4 + i + 2 * m] for i in range(2)]) for m in range(2)]
    train_step(ddp, opt, LRScheduler(optim, 10), batches, ctx)
    return list(ddp.events), len(ddp.buffer.buckets)


def test_first_bucket_launches_before_backward_ends(dist):
    for events, n_buckets in dist(2, overlap_events):
        assert n_buckets >= 3
        kinds = [k for k, _ in events]
        first_launch = events.index(("launch", 0))
        last_ready = len(kinds) - 1 - kinds[::-1].index("ready")
        assert first_launch < last_ready, events  # launched while gradients were still arriving
        launches = [i for k, i in events if k == "launch"]
        assert launches == list(range(n_buckets))  # every bucket, in order, exactly once
        # No gradient was reported during the no_sync micro-batch: one "ready" per parameter.
        assert kinds.count("ready") == len({name for k, name in events if k == "ready"})


def test_dp2_with_overlap_equals_single_process(dist):
    ref = train_run("llama", ParallelConfig(), 4, 4)
    for history in dist(2, train_run, "llama", ParallelConfig(), 4, 1, True, 20_000):
        _compare(history, ref)
    assert torch.tensor([h[0] for h in ref]).isfinite().all()


def pipeline_overlap_events(vp):
    """GPT-2 (tied embeddings) at PP=2 x DP=2 with --overlap-grad-reduce: this rank's bucket events of one
    step of 4 micro-batches."""
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.training.wrap import wrap_for_training

    from models import gpt2_config

    ctx = get_context(ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vp))
    ctx.seed(0)
    model = build_model(gpt2_config(num_layers=4), ctx, seed=0)
    optim = OptimizerConfig(lr=1e-3, use_distributed_optimizer=True)
    ddp, opt = wrap_for_training(model, ctx, optim, overlap_grad_reduce=True, bucket_size=5_000)
    ddp.events = []
    data = MockGPTDataset(250, 16, seed=1)
    batches = [collate([data[ctx.dp.rank * 8 + i + 2 * m] for i in range(2)]) for m in range(4)]
    train_step(ddp, opt, LRScheduler(optim, 10), batches, ctx)
    held = [b.index for b in ddp.buffer.buckets if b.held]
    return ctx.pp.rank, list(ddp.events), len(ddp.buffer.buckets), held


@pytest.mark.parametrize("vp", [None, 2])
def test_pipeline_reduces_buckets_under_the_last_backward(dist, vp):
    """Under pipelining the buckets of a chunk are reduced during its last backward, not after the schedule;
    the tied embedding's bucket (first and last stage) waits for the end of the step."""
    for stage, events, n_buckets, held in dist(4, pipeline_overlap_events, vp):
        assert n_buckets >= 3
        kinds = [k for k, _ in events]
        last_ready = len(kinds) - 1 - kinds[::-1].index("ready")
        assert events.index(("launch", 0)) < last_ready, events  # launched while gradients still arrived
        assert [i for k, i in events if k == "launch"] == list(range(n_buckets))
        # gradients count as final only in each chunk's last backward: one "ready" per parameter
        assert kinds.count("ready") == len({name for k, name in events if k == "ready"})
        assert len(held) == 1 and held[0] == n_buckets - 1, (stage, held)  # both stages hold the tied copy
        assert events.index(("launch", held[0])) > last_ready  # after the embedding all-reduce


def test_zero2_buffer_keeps_gradients_queued_behind_an_unused_parameter():
    """ZeRO-2 reduces buckets strictly in order, every micro-batch. A parameter without a gradient in the last
    micro-batches holds its bucket open; the gradients that later buckets, and earlier ones refilled after it,
    receive meanwhile are reduced at the end of the step, none dropped (one rank, so reduced = summed)."""
    from torch import nn

    from megatron_lite.distributed.ddp import GradBuffer
    from megatron_lite.parallel_context import Group

    params = [nn.Parameter(torch.zeros(2)) for _ in range(3)]
    buffer = GradBuffer(params, Group(ranks=(0,), rank=0), 2, sharded=True, zero_stage=2)
    buffer.zero()
    expected = [0.0, 0.0, 0.0]
    for mb in range(4):
        for i, p in enumerate(params):
            if i == 1 and mb >= 2:  # e.g. an expert no token reached
                continue
            buffer.grad_view(p).add_(float(mb + 1))
            expected[i] += mb + 1
            buffer.mark_ready(p, False, None)
    buffer.finish(None)
    assert [b.shard_grad.tolist() for b in buffer.buckets] == [[e, e] for e in expected]
