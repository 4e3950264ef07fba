"""All-to-all with uneven splits over the expert-parallel group, differentiable: the backward is the same
exchange with the splits swapped."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.parallel_context import Group


def _all_to_all(x: torch.Tensor, group: Group, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with group.blocked():
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group.pg)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return _all_to_all(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


def all_to_all(x: torch.Tensor, group: Group, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Rows [sum(in_splits[:r]), +in_splits[r]) go to rank r; rows from rank r land in order of rank."""
    if group.size == 1:
        return x
    return _AllToAll.apply(x, group, out_splits, in_splits)


def exchange_counts(counts: torch.Tensor, group: Group) -> torch.Tensor:
    """counts [ep, local_experts]: row r is what this rank sends to rank r; returns what each rank sends
    here, in the same shape."""
    if group.size == 1:
        return counts
    out = torch.empty_like(counts)
    with group.blocked():
        dist.all_to_all_single(out.view(-1), counts.contiguous().view(-1), group=group.pg)
    return out


# Asynchronous all-to-all, for overlapping the exchange of one chunk of tokens with another's experts ------
class AsyncHandle:
    """Links a started all-to-all with the point where its result is waited for (forward and backward)."""

    def __init__(self) -> None:
        self.work = None
        self.grad_work = None
        self.grad_in = None


class _AllToAllStart(torch.autograd.Function):
    """Posts the exchange and returns its (not yet filled) output buffer; only `_AllToAllWait` reads it."""

    @staticmethod
    def forward(ctx, x, group: Group, out_splits, in_splits, handle: AsyncHandle):
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        handle.work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group.pg, async_op=True)
        ctx.group, ctx.handle = group, handle
        return out

    @staticmethod
    def backward(ctx, g):
        # `g` is the gradient _AllToAllWait.backward passed through; it already posted its exchange.
        with ctx.group.blocked():
            ctx.handle.grad_work.wait()
        return ctx.handle.grad_in, None, None, None, None


class _AllToAllWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, group: Group, out_splits, in_splits, handle: AsyncHandle):
        with group.blocked():
            handle.work.wait()
        ctx.group, ctx.splits, ctx.handle = group, (out_splits, in_splits), handle
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        g = g.contiguous()
        ctx.handle.grad_in = g.new_empty((sum(in_splits), *g.shape[1:]))
        ctx.handle.grad_work = dist.all_to_all_single(
            ctx.handle.grad_in, g, in_splits, out_splits, group=ctx.group.pg, async_op=True
        )
        # The exchange runs while autograd goes on with other work; _AllToAllStart.backward waits for it.
        return g, None, None, None, None


def all_to_all_start(x: torch.Tensor, group: Group, out_splits: list[int], in_splits: list[int]):
    """Start the exchange `all_to_all` does; returns (buffer, handle) for `all_to_all_wait`."""
    handle = AsyncHandle()
    return _AllToAllStart.apply(x, group, out_splits, in_splits, handle), handle


def all_to_all_wait(buffer: torch.Tensor, group: Group, out_splits, in_splits, handle: AsyncHandle):
    return _AllToAllWait.apply(buffer, group, out_splits, in_splits, handle)
