"""Fault injection for the fault-tolerance tests (and for rehearsing an operations playbook):
MEGATRON_LITE_INJECT_FAULT="KIND,rank=R,iteration=I[,restart=K][,seconds=S]" (several separated by ';').

  kill            SIGKILL this worker as iteration I starts (only in torchrun restart K, default 0)
  nan             make one of this rank's gradients NaN in iteration I (before the data-parallel reduction)
  large           multiply that gradient by 1e6 in iteration I instead (finite: --check-for-large-grads finds it)
  skip_collective return from this rank's first all-reduce in iteration I without taking part in it, then
                  block in its next collective (as a rank that went ahead would wait there; without
                  sending, so no peer receives mismatched data)
  slow            sleep S seconds (default 0.5) in every iteration of this rank (a straggler), or only in
                  iteration I when given

Nothing happens unless the variable is set."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

ENV = "MEGATRON_LITE_INJECT_FAULT"
KINDS = ("kill", "nan", "large", "skip_collective", "slow")
LARGE = 1e6  # (the factor of a `large` fault)


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    iteration: int | None = None
    restart: int = 0
    seconds: float = 0.5


def parse(text: str | None) -> list[Fault]:
    """The faults the variable asks for; a malformed one is one line naming it (checked at start-up, before any
    process group: it was a TypeError traceback once the model was built)."""
    from megatron_lite.config import ConfigError

    faults = []
    for part in (text or "").split(";"):
        if not part.strip():
            continue
        kind, *fields = [x.strip() for x in part.split(",")]
        if kind not in KINDS:
            raise ConfigError(f"{ENV}: unknown fault {kind!r}; choose from {', '.join(KINDS)}")
        kw = {}
        for f in fields:
            key, _, value = f.partition("=")
            if key not in ("rank", "iteration", "restart", "seconds"):
                raise ConfigError(
                    f"{ENV}: {part.strip()!r}: unknown field {key!r}; use rank, iteration, restart, seconds"
                )
            try:
                kw[key] = float(value) if key == "seconds" else int(value)
            except ValueError:
                raise ConfigError(f"{ENV}: {part.strip()!r}: {key}={value!r} is not a number") from None
        if "rank" not in kw:
            raise ConfigError(f"{ENV}: {part.strip()!r} needs rank=R (e.g. {kind},rank=0,iteration=3)")
        faults.append(Fault(kind, **kw))
    return faults


class Injector:
    def __init__(self, rank: int, faults: list[Fault] | None = None) -> None:
        self.rank = rank
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        faults = parse(os.environ.get(ENV)) if faults is None else faults
        self.faults = [f for f in faults if f.rank == rank and (f.kind != "kill" or f.restart == restart)]

    def _due(self, kind: str, iteration: int) -> Fault | None:
        """The fault of this kind for this iteration; one-off faults fire once (a rollback replays the
        iteration with the same number, and must meet a healthy step)."""
        f = next((f for f in self.faults if f.kind == kind and (f.iteration is None or f.iteration == iteration)), None)
        if f is not None and f.iteration is not None:
            self.faults.remove(f)
        return f

    def before_iteration(self, iteration: int) -> None:
        if self._due("kill", iteration):
            os.kill(os.getpid(), signal.SIGKILL)
        if f := self._due("slow", iteration):
            time.sleep(f.seconds)
        if self._due("skip_collective", iteration):
            self._skip_next_all_reduce()

    def _skip_next_all_reduce(self) -> None:
        from megatron_lite.resilience.flight_recorder import WRAPPED, installed

        recorder = installed()
        table = recorder._originals if recorder is not None else None
        names = [n for n in WRAPPED if (n in table if table is not None else True)]
        put = table.__setitem__ if table is not None else (lambda n, f: setattr(dist, n, f))

        def block_forever(*args, **kwargs):
            while True:
                time.sleep(1.0)

        def skip(*args, **kwargs):
            for n in names:  # from now on this rank waits in whatever collective it reaches next
                put(n, block_forever)
            return None

        put("all_reduce", skip)

    @contextlib.contextmanager
    def during_step(self, iteration: int, model: torch.nn.Module):
        """Around the training step: a NaN into the gradient of the model's first parameter on this rank, or that
        gradient times LARGE."""
        nan, large = self._due("nan", iteration), self._due("large", iteration)
        if not (nan or large):
            yield
            return
        p = next(q for q in model.parameters() if q.requires_grad)
        handle = p.register_hook(lambda g: torch.full_like(g, float("nan")) if nan else g * LARGE)
        try:
            yield
        finally:
            handle.remove()
