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


def test_a_ramp_is_checked_on_the_batches_its_steps_run():
    """Megatron checks the batch of each step it runs (RampupBatchsizeNumMicroBatchesCalculator.update), not START
    and INCREMENT: a ramp of few samples jumps past some of START + k x INCREMENT, so those need not split into
    micro-batches. We refused such ramps, which Megatron runs."""
    from megatron_lite.config import ConfigError, TrainingConfig

    # 8 -> 16 by 2 over 8 samples: a level every 2 samples, so the step after the first 8 samples is at 16
    t = TrainingConfig(micro_batch_size=8, global_batch_size=16, rampup_batch_size=(8, 2, 8), train_samples=64)
    t.validate_rampup(1)
    assert t.rampup_batches(1) == [(0, 8)]
    assert t.resolve_train_iters(1).train_iters == 1 + (64 - 8) // 16
    # over 20 samples (a level every 5): the second step runs 8 + 1 x 2 = 10 samples, not 8 micro-batches
    t = TrainingConfig(micro_batch_size=8, global_batch_size=16, rampup_batch_size=(8, 2, 20))
    assert t.rampup_batches(1) == [(0, 8), (8, 10), (18, 14)]
    with pytest.raises(ConfigError, match=r"the ramp's global batch of 10 samples \(after 8 samples\) is not a "):
        t.validate_rampup(1)

    def stepped(start: int, inc: int, ramp: int, final: int) -> list[tuple[int, int]]:
        """Megatron's calculator asked at every step, one step at a time."""
        out, consumed, per = [], 0, ramp / ((final - start) // inc)
        while True:
            batch = final if consumed > ramp else start + int(consumed / per) * inc
            if batch == final:
                return out
            if not out or out[-1][1] != batch:
                out.append((consumed, batch))
            consumed += batch

    cases = 0
    for start, inc, final in ((1, 1, 9), (3, 2, 17), (16, 16, 1536), (5, 7, 68), (2, 3, 512)):
        for ramp in (1, 2, 7, 50, 999, 12345, 300000):
            t = TrainingConfig(micro_batch_size=1, global_batch_size=final, rampup_batch_size=(start, inc, ramp))
            assert t.rampup_batches(1) == stepped(start, inc, ramp, final), (start, inc, ramp, final)
            cases += 1
    assert cases == 35


def _megatron_linear(lr: float, warmup: float, decay: float, samples: float) -> float:
    """Megatron's OptimizerParamScheduler.get_lr, linear decay to 0, at `samples` consumed (its num_steps)."""
    if warmup > 0 and samples <= warmup:
        return lr * samples / warmup
    return lr * max(0.0, 1 - (samples - warmup) / (decay - warmup))


def test_a_run_resumed_in_the_other_unit_goes_on_where_it_was():
    """The position is kept in samples whichever unit the run counts in (Megatron's num_steps), so a run saved
    by --train-samples and resumed by --train-iters (or the other way) continues its schedule; before, the
    position kept its own unit and the resumed schedule was read at the wrong place (LR 0 at once)."""
    lr, gbs = 1e-3, 4
    cfg = OptimizerConfig(lr=lr, lr_decay_style="linear")
    by_samples = LRScheduler(cfg, 2, train_samples=8, samples_per_step=gbs)
    for _ in range(2):
        by_samples.step(gbs)
    by_iters = LRScheduler(cfg, 6, samples_per_step=gbs)  # --train-iters 6: decay over 24 samples
    by_iters.load_state_dict(by_samples.state_dict())
    assert by_iters.lr == pytest.approx(_megatron_linear(lr, 0, 24, 8))
    back = LRScheduler(cfg, 0, train_samples=40, samples_per_step=gbs)
    back.load_state_dict(by_iters.state_dict())
    assert back.lr == pytest.approx(_megatron_linear(lr, 0, 40, 8))
    # a checkpoint from before the position was always in samples: an iteration-based run counted steps
    old = LRScheduler(cfg, 6, samples_per_step=gbs)
    old.load_state_dict({"num_steps": 2, "position": 2})
    assert old.lr == pytest.approx(_megatron_linear(lr, 0, 24, 8))


def test_warmup_fraction_and_inverse_square_root_count_samples():
    """--lr-warmup-fraction is a share of the decay's samples, not rounded down to whole iterations (0.075 of 20
    iterations of 8 is 12 samples, 1.5 iterations); inverse-square-root without warmup decays by the samples
    consumed (Megatron's max_lr * sqrt(max(warmup, 1) / max(samples, 1)))."""
    lr, gbs = 1e-3, 8
    frac = LRScheduler(OptimizerConfig(lr=lr, lr_warmup_fraction=0.075), 20, samples_per_step=gbs)
    assert [frac.lr_at(i) for i in range(3)] == pytest.approx(
        [_megatron_linear(lr, 12, 160, i * gbs) for i in range(3)]
    )
    tiny = LRScheduler(OptimizerConfig(lr=lr, lr_warmup_fraction=0.001), 500, samples_per_step=gbs)
    assert tiny.lr_at(0) == 0.0  # a warmup of 4 samples still starts at --lr-warmup-init
    rsqrt = LRScheduler(OptimizerConfig(lr=lr, lr_decay_style="inverse-square-root"), 20, samples_per_step=gbs)
    assert [rsqrt.lr_at(i) for i in (1, 4)] == pytest.approx([lr / math.sqrt(8), lr / math.sqrt(32)])


def test_a_constant_loss_scale_given_on_resume_is_the_scale():
    """Megatron's constant scaler loads nothing: --loss-scale given on resume wins over the checkpoint's scale;
    a dynamic scaler takes a constant one's scale and starts its trackers afresh."""
    from megatron_lite.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    dynamic = DynamicGradScaler(2.0**32, 1.0, 1000, 2)
    constant = ConstantGradScaler(1024)
    constant.load_state_dict(dynamic.state_dict())
    assert constant.scale == 1024
    fresh = DynamicGradScaler(2.0**16, 1.0, 1000, 2)
    fresh.load_state_dict(ConstantGradScaler(128).state_dict())
    assert fresh.scale == 128 and fresh.state_dict() == {"scale": 128, "growth_tracker": 0, "hysteresis_tracker": 2}


@pytest.mark.parametrize(
    "flags, iters, samples, message",
    [
        # (an exploratory run's: the decay's length was named as a flag never given, and 0 suggested where 1 and 2 work)
        (
            dict(lr_warmup_iters=3),
            3,
            None,
            "--lr-warmup-iters 3 must be below the decay's 3 iters (--train-iters: no "
            "--lr-decay-iters); use --lr-warmup-iters 1",
        ),  # fmt: skip
        (
            dict(lr_warmup_iters=30, lr_decay_iters=20),
            40,
            None,
            "--lr-warmup-iters 30 must be below --lr-decay-iters 20; use --lr-warmup-iters 2",
        ),  # fmt: skip
        (
            dict(lr_warmup_samples=64),
            None,
            64,
            "--lr-warmup-samples 64 must be below the decay's 64 samples "
            "(--train-samples: no --lr-decay-samples); use --lr-warmup-samples 6",
        ),  # fmt: skip
    ],
)
@pytest.mark.parametrize("style", ["cosine", "constant"])
def test_a_warmup_as_long_as_the_decay_is_refused_naming_what_was_given(flags, iters, samples, message, style):
    """Megatron asserts warmup < decay steps, for every style; the line names the decay's length as the flags give
    it. (An exploratory run's: under constant a warmup past the run was taken, the rate never reaching --lr.)"""
    from megatron_lite.config import ConfigError

    with pytest.raises(ConfigError) as e:
        OptimizerConfig(lr=1e-3, lr_decay_style=style, **flags).validate_schedule(iters or 1, samples)
    assert message in str(e.value), str(e.value)
