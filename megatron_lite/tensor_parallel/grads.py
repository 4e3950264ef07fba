"""Gradient reductions the tensor-parallel layout itself requires.

Under sequence parallelism, parameters that are replicated across TP (norm weights and biases, the
row-parallel output biases, learned position embeddings) see only their rank's sequence shard, so each
rank holds a partial gradient that must be summed over TP. Their ParamMeta says `sequence_parallel`; the
training step calls `allreduce_sequence_parallel_grads` after the backward (Megatron does the same in
finalize_model_grads). Without it, norm weights drift apart across TP ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.parallel_context import Group
from megatron_lite.parameters import named_param_meta


def allreduce_sequence_parallel_grads(model: nn.Module, tp: Group) -> None:
    """Sum the gradients of sequence-parallel parameters over TP, coalesced into one all-reduce."""
    if tp.size == 1:
        return
    params = [p for _, p, meta in named_param_meta(model) if meta.sequence_parallel and p.grad is not None]
    if not params:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=tp.pg)
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n
