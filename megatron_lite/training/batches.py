"""The training loop's data: each step's micro-batches for this data-parallel rank, read in Megatron's order."""

from __future__ import annotations

import functools
import signal

import torch

from megatron_lite.data.mock import collate
from megatron_lite.data.samplers import micro_batch_indices
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.training.configs import JobConfig


class Batches:
    """Micro-batches of the global batch starting at `consumed` samples, for this data-parallel rank.

    With --num-workers > 0, worker processes load the micro-batches of the coming iterations ahead of time
    (torch DataLoader); the order is the same as without them, so the data stays layout-independent."""

    def __init__(
        self, dataset, job: JobConfig, ctx: ParallelContext, num_workers: int = 0, rampup: bool = False
    ) -> None:
        self.dataset = dataset
        self.training, self.rampup = job.training, rampup  # rampup: the batch grows (--rampup-batch-size)
        self.mbs = job.training.micro_batch_size
        self.ctx = ctx
        self.num_workers = num_workers
        res = job.resilience
        self.exit_signal = getattr(signal, res.exit_signal) if res.exit_signal_handler else None
        self._loader = None
        self._next = None

    def gbs(self, consumed: int) -> int:
        dp = self.ctx.dp.size
        return self.training.batch_size_at(consumed, dp) if self.rampup else self.training.global_batch(dp)

    def _indices(self, consumed: int) -> list[list[int]]:
        ix = micro_batch_indices(consumed, self.gbs(consumed), self.mbs, self.ctx.dp.rank, self.ctx.dp.size)
        n = len(self.dataset)  # (batches a rollback skipped read past the split's samples: its first ones again)
        return [[i % n for i in micro] for micro in ix]

    def get(self, consumed: int) -> list[dict[str, torch.Tensor]]:
        if self.num_workers == 0:
            return [collate([self.dataset[i] for i in ix], self.ctx.device) for ix in self._indices(consumed)]
        if self._loader is None or consumed != self._next:

            def order(start=consumed):
                while True:
                    yield from self._indices(start)
                    start += self.gbs(start)

            self.close()  # (a rollback's new position: the old loader's processes end now)
            # Its own generator: the loader must not draw its worker seeds from the global one dropout uses.
            loader = torch.utils.data.DataLoader(
                self.dataset,
                batch_sampler=order(),
                num_workers=self.num_workers,
                collate_fn=collate,
                pin_memory=self.ctx.device.type == "cuda",
                generator=torch.Generator().manual_seed(0),
                worker_init_fn=functools.partial(_ignore, self.exit_signal) if self.exit_signal else None,
            )
            self._loader = iter(loader)
        self._next = consumed + self.gbs(consumed)
        count = self.gbs(consumed) // (self.mbs * self.ctx.dp.size)
        return [
            {k: v.to(self.ctx.device, non_blocking=True) for k, v in next(self._loader).items()} for _ in range(count)
        ]

    def close(self) -> None:
        """Ends the data-loading processes now, however the run ends. Under --exit-signal-handler they ignore the
        signal (_ignore), which is also how multiprocessing ends them at exit before waiting for them: left to it,
        the job never exited."""
        loader, self._loader = self._loader, None
        if loader is None:
            return
        workers = list(getattr(loader, "_workers", ()))
        loader._shutdown_workers()  # (what the loader does once collected: an end marker to each, then a join)
        for w in workers:
            if w.is_alive():  # (stuck in a read past the join's timeout; the signal that ends it is ignored)
                w.kill()


def _ignore(signum: int, worker_id: int) -> None:
    """In each data-loading process under --exit-signal-handler: torchrun stops a worker by signalling its whole
    process group (and Slurm signals every process of the job), so these got the exit signal too, died of it, and
    the next batch failed before the job could save. They still end with the loader (or when the job is gone)."""
    signal.signal(signum, signal.SIG_IGN)
