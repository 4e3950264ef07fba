"""Megatron's learning-rate schedule: linear warmup from --lr-warmup-init, then constant, linear, cosine,
inverse-square-root or WSD (warmup-stable-decay) down to --min-lr, held at --min-lr after the decay. And its
weight-decay increment (--weight-decay-incr-style linear|cosine): from --start-weight-decay to
--end-weight-decay over the whole run (--train-iters or --train-samples).

Like Megatron's OptimizerParamScheduler, the schedule is evaluated at the samples consumed by the completed
steps, so with warmup the first iteration runs at --lr-warmup-init (0 by default). An iteration-based run's
lengths (--train-iters, --lr-*-iters) become samples of the global batch, a sample-based run's (--train-samples,
--lr-*-samples) are samples already: warmup and decay need not be whole iterations, and a run resumed in the
other unit goes on where it was."""

from __future__ import annotations

import math

from megatron_lite.optimizer.config import OptimizerConfig


def schedule_lengths(config, train_iters: int | None, train_samples: int | None, samples_per_step: int) -> dict:
    """The warmup, decay, WSD decay and weight-decay ramp in samples, as a checkpoint's scheduler state keeps them
    (Megatron's OptimizerParamScheduler counts them so): an iteration-based run's lengths are iterations of the
    (final) global batch `samples_per_step`. `config`: an OptimizerConfig, or the parsed flags (the same names)."""
    _, warmup, decay, wsd = OptimizerConfig.schedule(config, train_iters, train_samples)
    if train_samples is not None:
        return dict(warmup=warmup, decay=decay, wsd=wsd, weight_decay=train_samples)
    return dict(warmup=warmup * samples_per_step, decay=decay * samples_per_step,
                wsd=wsd * samples_per_step if wsd else wsd, weight_decay=train_iters * samples_per_step)  # fmt: skip


class LRScheduler:
    def __init__(
        self,
        config: OptimizerConfig,
        train_iters: int,
        train_samples: int | None = None,
        samples_per_step: int = 1,
        rampup: bool = False,
        keep_saved_lengths: bool = False,
    ) -> None:
        """`samples_per_step`: the (final) global batch, which turns iteration lengths into samples. A
        sample-based run, or one whose batch ramps up (--rampup-batch-size), counts the batch each step took;
        another counts `samples_per_step` a step. `keep_saved_lengths` (--use-checkpoint-opt_param-scheduler):
        a loaded state's warmup, decay and weight-decay lengths replace these, in samples as Megatron keeps them
        (so a new global batch or run length leaves them as they were)."""
        config.validate_schedule(train_iters, train_samples)
        self.config = config
        lengths = schedule_lengths(config, train_iters, train_samples, samples_per_step)
        self.warmup, self.decay_steps, self.wsd_steps = lengths["warmup"], lengths["decay"], lengths["wsd"]
        self.wd_steps = lengths["weight_decay"]
        self.unit = samples_per_step  # schedule positions per (full) step
        self.count_batches = train_samples is not None or rampup
        self.keep_saved_lengths = keep_saved_lengths
        self.num_steps = 0
        self.position = 0  # samples consumed

    def lr_at(self, step: int, max_lr: float | None = None, min_lr: float | None = None) -> float:
        """The schedule after `step` full steps, peaking at --lr and settling at --min-lr (or the given
        peak and floor)."""
        return self._lr_at_position(step * self.unit, max_lr, min_lr)

    def _lr_at_position(self, step: float, max_lr: float | None = None, min_lr: float | None = None) -> float:
        c = self.config
        max_lr = c.lr if max_lr is None else max_lr
        min_lr = c.min_lr if min_lr is None else min_lr
        warmup = self.warmup
        if warmup > 0 and step <= warmup:
            return c.lr_warmup_init + (max_lr - c.lr_warmup_init) * step / warmup
        if c.lr_decay_style == "constant":
            return max_lr
        if step > self.decay_steps:
            return min_lr
        if c.lr_decay_style == "inverse-square-root":
            return max(min_lr, max_lr * max(warmup, 1) ** 0.5 / max(step, 1) ** 0.5)
        ratio = (step - warmup) / (self.decay_steps - warmup)
        if c.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif c.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: stable at max_lr, then the last lr_wsd_decay_iters steps decay
            anneal_start = self.decay_steps - self.wsd_steps
            if step <= anneal_start:
                coeff = 1.0
            else:
                r = (step - anneal_start) / self.wsd_steps
                coeff = {
                    "linear": 1.0 - r,
                    "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                    "exponential": 2.0 * 0.5**r - 1.0,
                    "minus_sqrt": 1.0 - math.sqrt(r),
                }[c.lr_wsd_decay_style]
        return min_lr + coeff * (max_lr - min_lr)

    @property
    def lr(self) -> float:
        return self._lr_at_position(self.position)

    @property
    def decoupled_lr(self) -> float | None:
        """The embeddings' and output layer's rate (--decoupled-lr), on the same schedule; None when unset. Its
        floor is --decoupled-min-lr, or --min-lr when that is not given (as in Megatron)."""
        c = self.config
        if c.decoupled_lr is None:
            return None
        floor = c.min_lr if c.decoupled_min_lr is None else c.decoupled_min_lr
        return self._lr_at_position(self.position, c.decoupled_lr, floor)

    @property
    def weight_decay(self) -> float | None:
        """The decaying groups' weight decay now (Megatron's get_wd); None when constant (--weight-decay)."""
        c = self.config
        if c.weight_decay_incr_style == "constant":
            return None
        start, end = c.start_weight_decay, c.end_weight_decay
        if self.position > self.wd_steps:
            return end
        ratio = self.position / self.wd_steps
        coeff = ratio if c.weight_decay_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return start + coeff * (end - start)

    def step(self, samples: int | None = None) -> None:
        """One optimizer step; `samples`: the global batch it took (counted in sample mode)."""
        self.num_steps += 1
        self.position += samples if self.count_batches and samples is not None else self.unit

    def state_dict(self) -> dict:
        lengths = dict(warmup=self.warmup, decay=self.decay_steps, wsd=self.wsd_steps, weight_decay=self.wd_steps)
        return {"num_steps": self.num_steps, "position": self.position, "position_unit": "samples", "lengths": lengths}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
        if self.keep_saved_lengths and "lengths" in state:  # (older checkpoints: the flags' lengths)
            saved = state["lengths"]
            # (the WSD decay stays the flags', as Megatron's: its scheduler state has no such length)
            self.warmup, self.decay_steps = saved["warmup"], saved["decay"]
            self.wd_steps = saved["weight_decay"]
        position = int(state.get("position", self.num_steps))
        if state.get("position_unit") != "samples" and position == self.num_steps:
            # an older iteration-based run counted steps (a sample-based one counted samples, which equal the
            # steps only at one sample a step, where the two agree)
            position = self.num_steps * self.unit
        self.position = position
