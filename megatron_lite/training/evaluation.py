"""Evaluation on the validation and test sets, as Megatron's evaluate() / evaluate_and_print_results().

By default an evaluation is --eval-iters global batches: the validation set goes on where the last evaluation
stopped (its count is saved in checkpoints), from its start under --skip-train; the test set, evaluated once,
from its start. --full-validation: every evaluation reads the whole validation split once, from its first
sample, whatever the layout (the last global batch filled with samples that count no token); with
--multiple-validation-sets each set is evaluated so and logged on its own ("validation-0", "validation-1", ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from megatron_lite.checkpoint.checkpointing import TrainState
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.training.batches import Batches
from megatron_lite.training.configs import JobConfig
from megatron_lite.training.step import eval_step


class _Padded:
    """`dataset` made a whole number of global batches long: the samples past its end repeat its first with a
    zero loss mask, so they run through the model (every rank's step has its micro-batches) and count nothing."""

    def __init__(self, dataset, length: int) -> None:
        self.dataset, self.n, self.length = dataset, len(dataset), length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < self.n:
            return self.dataset[index]
        sample = dict(self.dataset[0])
        sample["loss_mask"] = torch.zeros_like(sample["loss_mask"])
        return sample


class Evaluator:
    """`evaluate(state, dataset, kind, final)`; `over_time()`: whether --exit-duration-in-mins has passed (a
    collective: every rank asks at the same point)."""

    def __init__(
        self, job: JobConfig, ctx: ParallelContext, model, ddp, optimizer, log, over_time: Callable[[], bool]
    ) -> None:
        self.job, self.ctx, self.model, self.ddp, self.optimizer, self.log = job, ctx, model, ddp, optimizer, log
        self.over_time = over_time
        self.described: set[str] = set()  # the sets whose full pass was described once

    def __call__(self, state: TrainState, dataset, kind: str, final: bool = False) -> bool:
        """Evaluates `dataset` (a list: --multiple-validation-sets, each logged apart) and logs its loss and
        perplexity. False: a time limit ended it (unlogged, as Megatron's)."""
        if hasattr(self.optimizer, "finish_param_sync"):
            self.optimizer.finish_param_sync()
        sets = [(f"{kind}-{i}", ds) for i, ds in enumerate(dataset)] if isinstance(dataset, list) else [(kind, dataset)]
        self.model.eval()
        try:
            for name, ds in sets:
                full = kind == "validation" and self.job.data.full_validation
                sums = self._full(ds, name) if full else self._batches(state, ds, kind)
                if sums is None:
                    self.log.info(f"exiting during the {name} evaluation: --exit-duration-in-mins reached")
                    return False
                # per token over the whole evaluation (Megatron's evaluate()), not a mean of the batches' means
                loss = sum(s for s, _ in sums) / max(sum(n for _, n in sums), 1.0)
                # (Megatron's "lm loss PPL"; capped as Megatron does, so a diverged run still logs a number)
                # (--skip-train's evaluation, of a draw from the set's start, is kept out of the training run's W&B
                # and TensorBoard curves: Megatron's write_to_tensorboard=not args.skip_train)
                self.log.log(state.iteration, {"lm_loss": loss, "ppl": math.exp(min(20.0, loss))}, kind=name,
                             final=final, samples=state.consumed_samples,
                             trackers=not self.job.training.skip_train)  # fmt: skip
        finally:
            self.model.train()
        return True

    def _batches(self, state: TrainState, dataset, kind: str) -> list | None:
        t, gbs = self.job.training, self.job.training.global_batch(self.ctx.dp.size)
        batches = Batches(dataset, self.job, self.ctx)
        start = state.consumed_valid_samples if kind == "validation" and not t.skip_train else 0
        sums = []
        for i in range(t.eval_iters):
            sums.append(eval_step(self.ddp, batches.get(start + i * gbs), self.ctx))
            if kind == "validation":
                state.consumed_valid_samples += gbs
            # (Megatron's evaluate(): a time limit reached during it ends it, unlogged; the loop then exits)
            if self.over_time():
                return None
        return sums

    def _full(self, dataset, name: str) -> list | None:
        """Every sample of `dataset` once, from its first, in global batches (the validation count is left
        alone: each full evaluation starts over)."""
        gbs = self.job.training.global_batch(self.ctx.dp.size)
        steps = -(-len(dataset) // gbs)
        if name not in self.described:
            self.described.add(name)
            last = len(dataset) - (steps - 1) * gbs
            filled = f" (the last one {last} and {gbs - last} that count no token)" if last < gbs else ""
            self.log.info(f"--full-validation: the {name} set's {len(dataset)} samples in {steps} global batches "
                          f"of {gbs}{filled}")  # fmt: skip
        batches = Batches(_Padded(dataset, steps * gbs), self.job, self.ctx)
        sums = []
        for i in range(steps):
            sums.append(eval_step(self.ddp, batches.get(i * gbs), self.ctx))
            if self.over_time():
                return None
        return sums
