"""Sample-based runs (Megatron's --train-samples, --lr-decay-samples, --lr-warmup-samples,
--lr-wsd-decay-samples): the schedule is evaluated at the samples consumed, one global batch per step."""

from __future__ import annotations

import math

import pytest

from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.optimizer.lr_scheduler import LRScheduler


@pytest.mark.parametrize("style", ["linear", "cosine", "WSD", "inverse-square-root"])
def test_whole_batch_lengths_give_the_iteration_schedule(style):
    gbs, iters = 8, 25
    wsd = dict(lr_wsd_decay_iters=5) if style == "WSD" else {}
    wsd_samples = dict(lr_wsd_decay_samples=5 * gbs) if style == "WSD" else {}
    by_iters = OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_decay_style=style, lr_warmup_iters=3, lr_decay_iters=20,
                               **wsd)  # fmt: skip
    by_samples = OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_decay_style=style, lr_warmup_samples=3 * gbs,
                                 lr_decay_samples=20 * gbs, **wsd_samples)  # fmt: skip
    a = LRScheduler(by_iters, iters)
    b = LRScheduler(by_samples, iters, train_samples=iters * gbs, samples_per_step=gbs)
    assert [b.lr_at(s) for s in range(iters + 1)] == pytest.approx([a.lr_at(s) for s in range(iters + 1)])


def test_warmup_and_decay_are_counted_in_samples():
    """Warmup over 10 samples at 4 per step ends inside the third step; the decay runs over all 100 samples
    (--lr-decay-samples defaults to --train-samples, not to whole iterations)."""
    lr = 1e-3
    sched = LRScheduler(OptimizerConfig(lr=lr, lr_decay_style="linear", lr_warmup_samples=10), 25, 100, 4)
    assert sched.lr_at(1) == pytest.approx(lr * 4 / 10) and sched.lr_at(2) == pytest.approx(lr * 8 / 10)
    assert sched.lr_at(3) == pytest.approx(lr * (1 - (12 - 10) / (100 - 10)))
    assert sched.lr_at(25) == pytest.approx(0.0)
    cosine = LRScheduler(OptimizerConfig(lr=lr, lr_decay_style="cosine", lr_decay_samples=90), 25, 100, 4)
    assert cosine.lr_at(10) == pytest.approx(lr * 0.5 * (math.cos(math.pi * 40 / 90) + 1))
    assert cosine.lr_at(23) == 0.0  # past the decay's 90 samples: min_lr


def test_rampup_iterations_and_refusals():
    """--train-samples with a ramp counts the ramp's iterations one by one, then whole final batches (Megatron);
    a ramp whose batches cannot be split into micro-batches, or never reach the final batch, is refused."""
    from megatron_lite.config import ConfigError, TrainingConfig

    t = TrainingConfig(micro_batch_size=2, global_batch_size=8, rampup_batch_size=(4, 4, 16), train_samples=50)
    assert [t.batch_size_at(c, 1) for c in (0, 12, 16, 17)] == [4, 4, 8, 8]
    assert t.resolve_train_iters(1).train_iters == 5 + (50 - 24) // 8  # 4, 4, 4, 4, 8 then three of 8
    t.validate_rampup(1)
    with pytest.raises(ConfigError, match="multiple of micro-batch x data-parallel size"):
        TrainingConfig(micro_batch_size=4, global_batch_size=8, rampup_batch_size=(2, 2, 16)).validate_rampup(1)
    with pytest.raises(ConfigError, match="START \\+ k x INCREMENT must reach"):
        TrainingConfig(micro_batch_size=2, global_batch_size=8, rampup_batch_size=(2, 4, 16)).validate_rampup(1)
