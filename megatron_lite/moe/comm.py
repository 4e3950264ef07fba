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
