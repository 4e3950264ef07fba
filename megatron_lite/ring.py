"""Ring exchange on a process group: every rank sends to the next and receives from the previous in one
batch of isend/irecv, so a ring of transfers can run while the caller computes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.parallel_context import Group


def ring_exchange(tensors: list[torch.Tensor], group: Group) -> tuple[list[torch.Tensor], list]:
    """Post the sends of `tensors` to the next rank and receives of as many (same shapes) from the previous
    one; returns the receive buffers and the works to wait on."""
    nxt = group.ranks[(group.rank + 1) % group.size]
    prv = group.ranks[(group.rank - 1) % group.size]
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]  # contiguous
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group.pg) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prv, group.pg) for t in received]
    return received, dist.batch_isend_irecv(ops)  # one work per op (gloo) or one for the batch (NCCL): wait all


def wait(works, group: Group) -> None:
    """Wait for posted transfers, the time counted as exposed communication."""
    if works:
        with group.blocked():
            for w in works:
                w.wait()
