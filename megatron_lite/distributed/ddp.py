"""Data parallelism with a contiguous fp32 gradient buffer and bucketed all-reduce.

Gradients accumulate into one flat fp32 buffer (per process group), laid out in reverse registration
order, which is roughly the order the backward produces them. The buffer is cut into buckets; with
`overlap_grad_reduce`, a bucket's all-reduce is launched as soon as every gradient in it is final, while
the backward continues. Buckets are launched strictly in order on every rank, so all ranks issue the
same collectives in the same sequence. Inside `no_sync()` (all but the last micro-batch of gradient
accumulation) gradients only accumulate.

The loss is normalised by the number of tokens in the whole global batch before the backward, so
gradients are summed (not averaged) across data-parallel ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.parallel_context import Group, ParallelContext
from megatron_lite.parameters import named_param_meta
from megatron_lite.tensor_parallel.mappings import reduce_scatter_tensor


@dataclass
class _Bucket:
    index: int
    params: list[nn.Parameter]
    data: torch.Tensor
    pending: set[int] = field(default_factory=set)
    handle: dist.Work | None = None
    launched: bool = False
    shard_out: torch.Tensor | None = None  # sharded buffers: where the reduce-scatter writes


class GradBuffer:
    """A flat fp32 buffer holding the main gradient of each parameter, cut into buckets.

    `sharded` (the distributed optimizer): each bucket is padded to a multiple of the group size and
    reduce-scattered instead of all-reduced; group rank d then holds the summed gradient of the d-th equal
    part of every bucket (`shard_range`), the only part its optimizer steps."""

    def __init__(
        self, params: list[nn.Parameter], group: Group, bucket_numel: int | None, sharded: bool = False
    ) -> None:
        self.group = group
        self.sharded = sharded
        device = params[0].device
        self.offset: dict[int, int] = {}  # id(param) -> its start in the flat buffer
        layout: list[tuple[list[nn.Parameter], int, int]] = []
        start = offset = 0
        current: list[nn.Parameter] = []
        for p in params:
            self.offset[id(p)] = offset
            offset += p.numel()
            current.append(p)
            if bucket_numel is not None and offset - start >= bucket_numel:
                offset = self._pad(offset, start)
                layout.append((current, start, offset))
                start, current = offset, []
        if current:
            offset = self._pad(offset, start)
            layout.append((current, start, offset))
        self.data = torch.zeros(offset, dtype=torch.float32, device=device)
        self.main_grad = {
            id(p): self.data[self.offset[id(p)] : self.offset[id(p)] + p.numel()].view(p.shape) for p in params
        }
        self.buckets: list[_Bucket] = []
        self.bucket_bounds: list[tuple[int, int]] = []
        for ps, lo, hi in layout:
            self.buckets.append(_Bucket(len(self.buckets), list(ps), self.data[lo:hi]))
            self.bucket_bounds.append((lo, hi))
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0

    def _pad(self, end: int, start: int) -> int:
        """A sharded bucket's length is a multiple of the group size, so it splits into equal parts."""
        if not self.sharded:
            return end
        n = self.group.size
        return start + -(-(end - start) // n) * n

    def grad_bytes(self) -> int:
        """Bytes of gradient storage this buffer holds on this rank."""
        return self.data.numel() * self.data.element_size()

    def shard_ranges(self) -> list[tuple[int, int]]:
        """The flat ranges this rank owns: its part of every bucket (sharded buffers)."""
        n, d = self.group.size, self.group.rank
        return [(lo + d * (hi - lo) // n, lo + (d + 1) * (hi - lo) // n) for lo, hi in self.bucket_bounds]

    def reset(self) -> None:
        for b in self.buckets:
            b.pending = {id(p) for p in b.params}
            b.handle, b.launched = None, False
        self._next = 0

    def mark_ready(self, p: nn.Parameter, overlap: bool, events: list | None) -> None:
        bucket = self.bucket_of[id(p)]
        bucket.pending.discard(id(p))
        if overlap:
            self._launch_ready(events, async_op=True)

    def _launch_ready(self, events: list | None, async_op: bool, force: bool = False) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if b.pending and not force:
                return
            if self.group.size > 1:
                with self.group.blocked() if not async_op else contextlib.nullcontext():
                    if self.sharded:  # the summed gradient of this rank's part lands in its own slot
                        n = self.group.size
                        b.shard_out = torch.empty(b.data.numel() // n, dtype=b.data.dtype, device=b.data.device)
                        b.handle = reduce_scatter_tensor(b.shard_out, b.data, group=self.group.pg, async_op=async_op)
                    else:
                        b.handle = dist.all_reduce(b.data, group=self.group.pg, async_op=async_op)
            b.launched = True
            if events is not None:
                events.append(("launch", b.index))
            self._next += 1

    def finish(self, events: list | None) -> None:
        self._launch_ready(events, async_op=True, force=True)
        with self.group.blocked() if self.group.size > 1 else contextlib.nullcontext():
            for b in self.buckets:
                if b.handle is not None:
                    b.handle.wait()
        if self.sharded and self.group.size > 1:
            n, d = self.group.size, self.group.rank
            for b in self.buckets:
                b.data.view(n, -1)[d].copy_(b.shard_out)
                b.shard_out = None
        self.reset()


class DistributedDataParallel(nn.Module):
    def __init__(
        self,
        module: nn.Module,
        ctx: ParallelContext,
        *,
        overlap_grad_reduce: bool = False,
        bucket_size: int | None = None,
        record_events: bool = False,
        use_distributed_optimizer: bool = False,
    ) -> None:
        super().__init__()
        self.module = module
        self.overlap_grad_reduce = overlap_grad_reduce
        expert = {id(p): meta.expert for _, p, meta in named_param_meta(module)}
        params = [p for p in module.parameters() if p.requires_grad]
        if overlap_grad_reduce and bucket_size is None:
            bucket_size = max(40_000_000, 1_000_000 * ctx.dp_cp.size)  # Megatron's default
        size = bucket_size if overlap_grad_reduce else None
        # Dense gradients are summed over data x context parallelism; an expert's over the ranks holding
        # the same expert (expert-data-parallel).
        groups = (
            ([p for p in params if not expert[id(p)]], ctx.dp_cp),
            ([p for p in params if expert[id(p)]], ctx.edp),
        )
        self.use_distributed_optimizer = use_distributed_optimizer
        configs = [m.config for m in module.modules() if hasattr(getattr(m, "config", None), "tied_embeddings")]
        tied_across_stages = ctx.pp.size > 1 and any(c.tied_embeddings for c in configs)
        if use_distributed_optimizer and overlap_grad_reduce and tied_across_stages:
            # The embedding copies must be summed before their buckets are reduce-scattered (step.py).
            raise ValueError(
                "--use-distributed-optimizer with --overlap-grad-reduce and embeddings tied across pipeline "
                "stages is not supported yet; drop --overlap-grad-reduce or use --untie-embeddings-and-output-weights"
            )
        self.buffers = [
            GradBuffer(list(reversed(ps)), group, size, sharded=use_distributed_optimizer) for ps, group in groups if ps
        ]
        self.buffer_of = {pid: b for b in self.buffers for pid in b.main_grad}
        for b in self.buffers:
            b.reset()
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._sync = True
        self.events: list | None = [] if record_events else None
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def buffer(self) -> GradBuffer:
        """The dense gradient buffer."""
        return self.buffers[0]

    def main_grad(self, p: nn.Parameter) -> torch.Tensor:
        return self.buffer_of[id(p)].main_grad[id(p)]

    def _on_grad(self, p: nn.Parameter) -> None:
        buffer = self.buffer_of[id(p)]
        buffer.main_grad[id(p)].add_(p.grad)
        p.grad = None
        if self._sync:
            if self.events is not None:
                self.events.append(("ready", self._names[id(p)]))
            buffer.mark_ready(p, self.overlap_grad_reduce, self.events)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (all but the last micro-batch)."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def finish_grad_sync(self) -> None:
        """Launch whatever buckets are left and wait for every reduction."""
        for b in self.buffers:
            b.finish(self.events)

    def zero_grad_buffer(self) -> None:
        for b in self.buffers:
            b.data.zero_()
            b.reset()
        if self.events is not None:
            self.events.clear()
