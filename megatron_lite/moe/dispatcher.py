"""Moving tokens to their experts and back.

alltoall: sort this rank's (token, expert) pairs by expert, exchange the counts, send each expert-parallel
rank the tokens of its experts (all_to_all_single with uneven splits), regroup by local expert, run the
experts, and reverse every step; outputs are combined with the routing weights by a scatter-add.
allgather: all-gather the tokens and routing of the expert-parallel group, run the local experts on the
tokens routed to them, combine, and reduce-scatter the partial outputs back to their ranks.
"""

from __future__ import annotations

import torch

from megatron_lite import kernels as K
from megatron_lite.moe.comm import all_to_all, all_to_all_start, all_to_all_wait, exchange_counts
from megatron_lite.moe.experts import LocalExperts
from megatron_lite.moe.router import Routing
from megatron_lite.parallel_context import Group
from megatron_lite.tensor_parallel.mappings import all_gather_dim0, gather_from_sequence_parallel_region
from megatron_lite.tensor_parallel.mappings import reduce_scatter_to_sequence_parallel_region as reduce_scatter_dim0


def _pairs(routing: Routing):
    """(token, expert, weight) of every kept pair."""
    t, k = routing.indices.shape
    keep = routing.keep.reshape(-1)
    tokens = torch.arange(t, device=routing.indices.device).repeat_interleave(k)[keep]
    return tokens, routing.indices.reshape(-1)[keep], routing.probs.reshape(-1)[keep]


def _rows(routing: Routing, t: int, ep: Group) -> int | None:
    """The rows one expert may receive from `t` tokens of each EP rank: its capacity from each (None: dropless)."""
    return None if routing.capacity is None else min(routing.capacity, t) * ep.size


def alltoall_dispatch(
    x: torch.Tensor, routing: Routing, experts: LocalExperts, ep: Group, num_experts: int, triton: bool = False
):
    n_local = num_experts // ep.size
    t = x.shape[0]
    kept = routing.indices[routing.keep]
    send = torch.bincount(kept, minlength=num_experts).view(ep.size, n_local)
    recv = exchange_counts(send, ep)  # recv[r, j]: tokens rank r sends to my expert j
    in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
    permute = K.moe_permute if triton else K.moe_permute_reference
    permuted, row_map = permute(x, routing.indices, routing.keep)  # kept pairs, sorted by expert
    received = all_to_all(permuted, ep, out_splits, in_splits)  # grouped by (source rank, local expert)
    sizes = recv.reshape(-1).tolist()
    chunks = received.split(sizes)
    by_expert = [chunks[r * n_local + j] for j in range(n_local) for r in range(ep.size)]
    out = experts(torch.cat(by_expert) if by_expert else received, recv.sum(0).tolist(), _rows(routing, t, ep))
    out_chunks = out.split([sizes[r * n_local + j] for j in range(n_local) for r in range(ep.size)])
    back = [out_chunks[j * ep.size + r] for r in range(ep.size) for j in range(n_local)]
    returned = all_to_all(torch.cat(back) if back else out, ep, in_splits, out_splits)
    unpermute = K.moe_unpermute if triton else K.moe_unpermute_reference
    return unpermute(returned, row_map, routing.probs.to(returned.dtype))


def alltoall_dispatch_overlapped(
    x: torch.Tensor,
    routing: Routing,
    experts: LocalExperts,
    ep: Group,
    num_experts: int,
    triton: bool = False,
    num_chunks: int = 2,
):
    """The all-to-all dispatch in chunks of tokens (--overlap-moe-expert-parallel-comm): every chunk's
    exchange is posted up front; while the experts run chunk i, chunk i+1's tokens arrive and chunk i-1's
    outputs travel back. The backward posts each gradient exchange as soon as it is known and waits for it
    only where it is used, so it overlaps the other chunks' expert backward. Routing (and any capacity
    dropping) was decided on all tokens before the split, so the result equals the unchunked dispatch."""
    n_local = num_experts // ep.size
    t = x.shape[0]
    bounds = [t * i // num_chunks for i in range(num_chunks + 1)]
    permute = K.moe_permute if triton else K.moe_permute_reference
    unpermute = K.moe_unpermute if triton else K.moe_unpermute_reference
    plans = []
    for a, b in zip(bounds, bounds[1:]):
        indices, keep = routing.indices[a:b], routing.keep[a:b]
        send = torch.bincount(indices[keep], minlength=num_experts).view(ep.size, n_local)
        recv = exchange_counts(send, ep)
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        permuted, row_map = permute(x[a:b], indices, keep)
        buf, handle = all_to_all_start(permuted, ep, out_splits, in_splits)
        plans.append((a, b, recv, in_splits, out_splits, row_map, buf, handle))
    started = []
    for a, b, recv, in_splits, out_splits, _, buf, handle in plans:
        received = all_to_all_wait(buf, ep, out_splits, in_splits, handle)
        sizes = recv.reshape(-1).tolist()
        chunks = received.split(sizes)
        by_expert = [chunks[r * n_local + j] for j in range(n_local) for r in range(ep.size)]
        rows = _rows(routing, b - a, ep)
        out = experts(torch.cat(by_expert) if by_expert else received, recv.sum(0).tolist(), rows)
        out_chunks = out.split([sizes[r * n_local + j] for j in range(n_local) for r in range(ep.size)])
        back = [out_chunks[j * ep.size + r] for r in range(ep.size) for j in range(n_local)]
        started.append(all_to_all_start(torch.cat(back) if back else out, ep, in_splits, out_splits))
    ys = []
    for (a, b, _, in_splits, out_splits, row_map, _, _), (buf, handle) in zip(plans, started):
        returned = all_to_all_wait(buf, ep, in_splits, out_splits, handle)
        ys.append(unpermute(returned, row_map, routing.probs[a:b].to(returned.dtype)))
    return torch.cat(ys)


def allgather_dispatch(x: torch.Tensor, routing: Routing, experts: LocalExperts, ep: Group, num_experts: int):
    xs = gather_from_sequence_parallel_region(x, ep)  # backward: reduce-scatter over EP
    probs = gather_from_sequence_parallel_region(routing.probs, ep)
    indices = all_gather_dim0(routing.indices, ep)
    keep = all_gather_dim0(routing.keep.to(torch.uint8), ep).bool()  # gloo gathers no bools
    token, expert, weight = _pairs(Routing(probs, indices, keep, routing.counts, None, None))
    local = (expert >= experts.first) & (expert < experts.first + experts.num_local)
    token, expert, weight = token[local], expert[local] - experts.first, weight[local]
    order = torch.argsort(expert, stable=True)
    token, expert, weight = token[order], expert[order], weight[order]
    counts = torch.bincount(expert, minlength=experts.num_local).tolist()
    out = experts(xs[token], counts, _rows(routing, x.shape[0], ep))
    y = torch.zeros_like(xs, dtype=out.dtype).index_add(0, token, out * weight.unsqueeze(-1).to(out.dtype))
    return reduce_scatter_dim0(y, ep)
