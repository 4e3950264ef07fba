"""Exposed communication: time the compute path spends blocked in communication — inside a blocking
collective, or waiting on an asynchronous one or on a receive. Time a transfer spends in flight while
compute goes on is hidden and not counted. A step's `comm_exposed_fraction` is this time over the step time.

Every Group of a ParallelContext shares the context's timer, so the layers that communicate time their own
waits through the group they were given (`with group.blocked(): ...`).

On CPU (gloo) every wait blocks the host, so the host's clock is exact. On CUDA, NCCL calls and waits return
as soon as they are queued, so the host's clock would read about zero: there the timer records a CUDA event
on the current stream before and after each region instead. The first completes when the compute queued
before the region has run, the second when the stream may go on past the communication; the time between is
what the stream was held back."""

from __future__ import annotations

import contextlib
import time

import torch


class CommTimer:
    def __init__(self, cuda: bool = False) -> None:
        self.seconds = 0.0
        self.cuda = cuda
        self._depth = 0  # nested timed regions (a wait inside a timed collective) count once
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def blocked(self):
        self._depth += 1
        outer = self._depth == 1
        if outer and self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        elif outer:
            t0 = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            if outer and self.cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._events.append((start, end))
                if len(self._events) >= 256:  # outside a measured step (generation, evaluation) nobody takes
                    self._fold_finished()
            elif outer:
                self.seconds += time.perf_counter() - t0

    def _fold_finished(self) -> None:
        """Adds the regions the GPU has finished to the total and drops their events, without waiting."""
        done = 0
        while done < len(self._events) and self._events[done][1].query():
            s, e = self._events[done]
            self.seconds += s.elapsed_time(e) / 1e3
            done += 1
        del self._events[:done]

    def take(self) -> float:
        """Seconds counted since the last call (on CUDA, waits for the last region's end event)."""
        if self._events:
            self._events[-1][1].synchronize()
            self.seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1e3
            self._events.clear()
        seconds, self.seconds = self.seconds, 0.0
        return seconds
