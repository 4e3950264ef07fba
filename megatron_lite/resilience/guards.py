"""Per-iteration guards of the training loop: non-finite loss or gradients (--check-for-nan-in-loss-and-grad),
loss spikes (--check-for-spiky-loss), unexpectedly large local gradients (--check-for-large-grads) and the exit
signal (--exit-signal-handler). Every decision is taken by all ranks together (an all-reduce of a flag), so no
rank ever proceeds alone."""

from __future__ import annotations

import math
import signal
import statistics
import time
from collections import deque

from megatron_lite.optimizer.optimizer import any_rank


def non_finite(loss: float, grad_norm: float | None) -> bool:
    """A non-finite loss or gradient norm. Both are already reduced over every rank (the loss over data and
    context parallelism and the pipeline, the norm over every parameter), so every rank sees the same."""
    return not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm))


class SpikeDetector:
    """A loss whose z-score against the previous `window` losses exceeds `threshold` (after `window` // 2
    iterations of history). Spikes are not added to the history, so one does not hide the next; but as many
    spikes in a row as that history needs are a new level, not a spike (a lasting shift would otherwise be
    flagged at every later iteration): they become the history (`rebased` is set, until read)."""

    def __init__(self, window: int = 50, threshold: float = 6.0) -> None:
        self.window, self.threshold = window, threshold
        self.losses: deque[float] = deque(maxlen=window)
        self.in_a_row: list[float] = []  # the spikes since the last loss that was not one
        self.rebased = False

    @property
    def min_history(self) -> int:
        return max(self.window // 2, 5)

    def zscore(self, loss: float) -> float | None:
        if len(self.losses) < self.min_history:
            return None
        mean = statistics.fmean(self.losses)
        std = statistics.pstdev(self.losses)
        return (loss - mean) / max(std, 1e-6 * max(abs(mean), 1.0))

    def observe(self, loss: float) -> float | None:
        """The loss's z-score when it is a spike, else None (the loss joins the history). A non-finite loss is
        the NaN check's (--check-for-nan-in-loss-and-grad): it neither counts as a spike nor joins the history,
        where it would make every later statistic NaN (or raise)."""
        if not math.isfinite(loss):
            return None
        z = self.zscore(loss)
        if z is not None and z > self.threshold:
            self.in_a_row.append(loss)
            if len(self.in_a_row) < self.min_history:
                return z
            self.losses = deque(self.in_a_row, maxlen=self.window)  # (this one included: not a spike of its own)
            self.rebased = True
        else:
            self.losses.append(loss)
        self.in_a_row = []
        return None

    def reset(self) -> None:
        self.losses.clear()
        self.in_a_row = []


class LargeValueDetector:
    """Megatron's RerunStateMachine.is_unexpectedly_large for one context (--check-for-large-grads: "grads",
    threshold 10): the first `num_samples` finite values only set the largest seen; from then on a value is
    unexpectedly large when it is at least `threshold` times that largest. The largest is not updated after the
    sampling (a value below the bound, however large, is not added), and a NaN or Inf is neither a sample nor
    large (the NaN check's)."""

    def __init__(self, threshold: float = 10.0, num_samples: int = 100) -> None:
        self.threshold, self.num_samples = threshold, num_samples
        self.count = 0
        self.max_value = 0.0

    @property
    def sampled(self) -> bool:
        return self.count >= self.num_samples

    def is_unexpectedly_large(self, value: float) -> bool:
        value = math.fabs(value)
        if not math.isfinite(value):
            return False
        if self.count < self.num_samples:
            self.count += 1
            self.max_value = max(self.max_value, value)
            return False
        return value >= self.max_value * self.threshold


class ExitSignal:
    """--exit-signal-handler: the signal only sets a flag; the loop checks it at each iteration boundary,
    all ranks together, then saves and exits."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signum
        self.received = False
        self._previous = signal.signal(signum, self._handle)

    @classmethod
    def from_config(cls, config) -> ExitSignal | None:
        """Installed when --exit-signal-handler asks for it (at start-up, as Megatron's initialize: a signal while
        the checkpoint or data load is kept, and acted on at the first iteration)."""
        return cls(getattr(signal, config.exit_signal)) if config.exit_signal_handler else None

    def _handle(self, signum, frame) -> None:
        self.received = True

    def should_exit(self, ctx) -> bool:
        return any_rank(self.received, ctx)

    def restore(self) -> None:
        signal.signal(self.signum, self._previous)


def should_exit(t, iteration: int, job_start: float, ctx) -> bool:
    """--exit-interval and --exit-duration-in-mins (`t`: the TrainingConfig), decided by all ranks together."""
    if t.exit_interval and iteration % t.exit_interval == 0:
        return True
    return bool(t.exit_duration_in_mins) and over_time(t, job_start, ctx)  # (0 sets no limit, as in Megatron)


def over_time(t, job_start: float, ctx) -> bool:
    # Every rank must take the same decision, or some would wait in the next step's collectives.
    return any_rank((time.time() - job_start) / 60 > t.exit_duration_in_mins, ctx)
