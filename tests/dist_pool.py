"""A persistent gloo world per world size, reused across tests.

Spawning a fresh world per test costs ~2 s of torch import per process on a 2-core machine, so each world
size gets one pool of worker processes for the whole session. A test sends a top-level function to every
rank and gets back each rank's return value, or the first failing rank's traceback. A rank that raises
while the others wait in a collective, or a task that outlives its timeout, tears the pool down (the
next test starts a fresh one), so a hang fails in seconds instead of at CI's limit.
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any

import numpy as np

GLOO_TIMEOUT_S = 60
TASK_TIMEOUT_S = 180
ORPHAN_CHECK_S = 2  # how often an idle worker checks that the pytest that started it is alive


@dataclasses.dataclass
class _Tensor:
    """A tensor sent by value across processes (numpy keeps the transfer free of shared-memory fds)."""

    array: np.ndarray
    dtype: str


def pack(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        if t.dtype == torch.bfloat16:
            return _Tensor(t.view(torch.int16).numpy().copy(), "bfloat16")
        return _Tensor(t.numpy().copy(), str(t.dtype).removeprefix("torch."))
    if isinstance(obj, dict):
        return {k: pack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(pack(v) for v in obj)
    return obj


def unpack(obj: Any) -> Any:
    import torch

    if isinstance(obj, _Tensor):
        if obj.dtype == "bfloat16":
            return torch.from_numpy(obj.array).view(torch.bfloat16)
        return torch.from_numpy(obj.array)
    if isinstance(obj, dict):
        return {k: unpack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(unpack(v) for v in obj)
    return obj


def _worker(rank: int, world: int, init_file: str | None, tasks: mp.Queue, results: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # eight ranks on two cores: one thread each, or they thrash into timeouts
    os.environ["WORLD_SIZE"], os.environ["RANK"] = str(world), str(rank)
    if init_file is None:  # a bare pool: each task joins (and leaves) a world of its own, as a job does
        os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world)
    else:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=GLOO_TIMEOUT_S),
        )
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=ORPHAN_CHECK_S)
        except queue.Empty:
            # a pytest killed by a signal runs no teardown, and daemon processes outlive such a parent: without
            # this, its ranks stayed for hours, their gloo threads taking CPU from every later run
            if os.getppid() != parent:
                os._exit(0)
            continue
        if task is None:
            break
        fn, args, kwargs = task
        try:
            out = fn(*unpack(args), **unpack(kwargs))
            results.put((rank, True, pack(out)))
        except BaseException:  # noqa: B036 - report everything, including assertion errors
            results.put((rank, False, traceback.format_exc()))
        # what is alive after a task is frozen out of later collections (as in pytest's process, conftest's
        # _frozen_heap): a job's main ends with a full collection, which walked the rank's 310 k objects each
        # time (0.1-0.3 s a job-rank); it now walks what the job made
        gc.collect()
        gc.freeze()
    # Leave without tearing the groups down (as tools/_world.py does): every rank is past its last collective,
    # and after a session's many subgroups gloo's teardown waits on its peers', about 10 s at the suite's end.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankError(AssertionError):
    pass


class WorkerPool:
    def __init__(self, world_size: int, init_group: bool = True) -> None:
        """`init_group=False`: the workers join no process group (their tasks start their own, as the
        ranks of a job under torchrun do: tests/pretrain_jobs.py)."""
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._init_file = None
        if init_group:
            fd, self._init_file = tempfile.mkstemp(prefix=f"ml_pool{world_size}_")
            os.close(fd)
            os.unlink(self._init_file)  # FileStore creates it
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, self._init_file, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(self, fn, *args, timeout: float = TASK_TIMEOUT_S, **kwargs) -> list[Any]:
        """Run fn(*args, **kwargs) on every rank; return the results in rank order."""
        if self.broken:
            raise RuntimeError("pool is broken")
        for q in self._tasks:
            q.put((fn, pack(args), pack(kwargs)))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        grace_end = None
        while len(results) + len(errors) < self.world_size:
            now = time.monotonic()
            # Once a rank has failed, the others may be blocked in a collective: give them a moment.
            end = min(deadline, grace_end) if grace_end is not None else deadline
            if now >= end:
                break
            try:
                rank, ok, payload = self._results.get(timeout=min(1.0, end - now))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in results]
                for r in dead:
                    errors.setdefault(r, f"worker process died (exit code {self._procs[r].exitcode})")
                if dead and grace_end is None:
                    grace_end = time.monotonic() + 5
                continue
            (results if ok else errors)[rank] = payload
            if not ok and grace_end is None:
                grace_end = time.monotonic() + 5
        missing = sorted(set(range(self.world_size)) - set(results) - set(errors))
        if errors or missing:
            self.close(force=True)
            msg = [f"{fn.__name__} on {self.world_size} ranks:"]
            for r, tb in sorted(errors.items()):
                msg.append(f"--- rank {r} raised:\n{tb}")
            if missing:
                msg.append(f"--- ranks {missing} did not finish (hang or waiting on a failed rank)")
            raise RankError("\n".join(msg))
        return [unpack(results[r]) for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        self.broken = True
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if self._init_file is not None and os.path.exists(self._init_file):
            os.unlink(self._init_file)


_CONTEXTS: dict[tuple, Any] = {}


def get_context(parallel):
    """Inside a worker: a ParallelContext for `parallel`, its process groups created once per layout
    (all ranks run the same tasks in the same order, so they create groups in the same order)."""
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.tensor_parallel.random import RNGStatesTracker

    hierarchical = parallel.hierarchical_context_parallel_sizes  # (its CP subgroups)
    key = (parallel.tp, parallel.pp, parallel.cp, parallel.ep, parallel.etp, hierarchical)
    if key not in _CONTEXTS:
        _CONTEXTS[key] = ParallelContext.build(parallel)
    return dataclasses.replace(_CONTEXTS[key], parallel=parallel, rng=RNGStatesTracker())
