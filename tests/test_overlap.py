"""--overlap-grad-reduce: the first bucket's all-reduce is launched while the backward is still running,
and DP=2 with overlap still equals one process."""

from __future__ import annotations

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
