"""Exposed communication: wall time the compute path spends blocked in communication — inside a blocking
collective, or waiting on an asynchronous one or on a receive. Time a transfer spends in flight while
compute goes on is hidden and not counted. A step's `comm_exposed_fraction` is this time over the step time.

Every Group of a ParallelContext shares the context's timer, so the layers that communicate time their own
waits through the group they were given (`with group.blocked(): ...`). On CUDA, NCCL calls return as
soon as they are queued on a stream: the host-side time measured there is a lower bound of what the GPU
waits, and the figure is exact on CPU (gloo), where every wait blocks the host.
"""

from __future__ import annotations

import contextlib
import time


class CommTimer:
    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0  # nested timed regions (a wait inside a timed collective) count once

    @contextlib.contextmanager
    def blocked(self):
        self._depth += 1
        start = time.perf_counter() if self._depth == 1 else None
        try:
            yield
        finally:
            self._depth -= 1
            if start is not None:
                self.seconds += time.perf_counter() - start

    def take(self) -> float:
        """Seconds counted since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
