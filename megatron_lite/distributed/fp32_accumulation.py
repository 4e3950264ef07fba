"""Megatron's --ddp-reduce-scatter-with-fp32-accumulation: the distributed optimizer's gradient reduce-scatter
sends the buffer's (bf16) values but sums them in fp32.

A ring reduce-scatter adds the ranks' parts one hop at a time in the buffer's dtype, so a bf16 sum over N ranks
is rounded N - 1 times. Here an all-to-all hands each rank every rank's copy of its own part (the same bytes on
the wire as the ring), and the rank adds them up locally in fp32 and rounds once, to the output's dtype
(Megatron-Core's distributed/reduce_scatter_with_fp32_accumulation.py). The all-to-all needs a receive buffer
the size of the input: one more bucket of gradient memory while a reduction is in flight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _Pending:
    """An asynchronous reduce-scatter in flight: wait() lands the all-to-all, then sums in fp32 into `output`."""

    def __init__(self, handle: dist.Work | None, received: torch.Tensor, output: torch.Tensor, size: int) -> None:
        self.handle, self.received, self.output, self.size = handle, received, output, size

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        # (rank order, in fp32: the one rounding is the copy into the output's dtype)
        self.output.copy_(self.received.view(self.size, -1).sum(dim=0, dtype=torch.float32))


def reduce_scatter_with_fp32_accumulation(
    output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False
) -> _Pending | None:
    """Sum `input` over the group's ranks; this rank's equal part (`output`) in fp32, rounded once. With
    `async_op`, a handle whose wait() completes it (as a torch.distributed Work's)."""
    size = dist.get_world_size(group)
    if input.numel() % size:
        raise ValueError(f"a reduce-scatter of {input.numel()} elements over {size} ranks needs equal parts")
    received = torch.empty_like(input)
    handle = dist.all_to_all_single(received, input, group=group, async_op=async_op)
    pending = _Pending(handle, received, output, size)
    if async_op:
        return pending
    pending.wait()
    return None
