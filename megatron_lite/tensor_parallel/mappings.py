"""Autograd-aware communication between the tensor-parallel and sequence-parallel regions.

Megatron's vocabulary, in pairs whose backward is the other's forward:

    copy_to_tensor_model_parallel_region        forward: identity        backward: all-reduce
    reduce_from_tensor_model_parallel_region    forward: all-reduce      backward: identity
    scatter_to_tensor_model_parallel_region     forward: split last dim  backward: all-gather last dim
    gather_from_tensor_model_parallel_region    forward: all-gather last backward: split last dim
    scatter_to_sequence_parallel_region         forward: split dim 0     backward: all-gather dim 0
    gather_from_sequence_parallel_region        forward: all-gather 0    backward: reduce-scatter dim 0
    reduce_scatter_to_sequence_parallel_region  forward: reduce-scatter  backward: all-gather dim 0

Activations are [sequence, batch, hidden], so the sequence dimension is dim 0 and its collectives work
on contiguous memory. Every function takes the `Group` explicitly and is the identity on one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.parallel_context import Group


# torch 2.13 renamed the single-tensor collectives; older releases (the GPU image has 2.11) have only the old
# names. Looked up on torch.distributed at each call, not bound at import: the flight recorder (and the fault
# injector) wrap them there after this module is loaded.
def all_gather_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


# Raw collectives --------------------------------------------------------------------------------
def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group, in place on `x` (callers pass tensors nobody else reads)."""
    if group.size == 1:
        return x
    x = x.contiguous()
    with group.blocked():
        dist.all_reduce(x, group=group.pg)
    return x


def all_gather_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((group.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    with group.blocked():
        all_gather_tensor(out, x, group=group.pg)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    if x.shape[0] % group.size:
        raise ValueError(f"dim 0 of size {x.shape[0]} does not split over {group.size} ranks")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // group.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    with group.blocked():
        try:
            reduce_scatter_tensor(out, x, group=group.pg)
        except RuntimeError:  # gloo in older torch releases lacks reduce_scatter: same result, more traffic
            if dist.get_backend(group.pg) != "gloo":
                raise
            dist.all_reduce(x, group=group.pg)
            out.copy_(split_dim0(x, group))
    return out


def split_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    if x.shape[0] % group.size:
        raise ValueError(f"dim 0 of size {x.shape[0]} does not split over {group.size} ranks")
    return x.chunk(group.size, dim=0)[group.rank].contiguous()


def split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    if x.shape[-1] % group.size:
        raise ValueError(f"last dim of size {x.shape[-1]} does not split over {group.size} ranks")
    return x.chunk(group.size, dim=-1)[group.rank].contiguous()


def all_gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    gathered = all_gather_dim0(x.movedim(-1, 0), group)
    return torch.cat(gathered.chunk(group.size, dim=0), dim=0).movedim(0, -1).contiguous()


# Autograd functions -----------------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_last(g, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return split_last(g, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim0(g, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        # Each rank's downstream (a column-parallel GEMM) produced a partial gradient of the full
        # sequence: sum them and keep this rank's sequence shard.
        return reduce_scatter_dim0(g, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim0(g, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ScatterToTP.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherFromTP.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ScatterToSP.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherFromSP.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceScatterToSP.apply(x, group)
