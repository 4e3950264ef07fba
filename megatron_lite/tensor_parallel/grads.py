"""Gradient reductions the tensor-parallel layout itself requires.

Under sequence parallelism, parameters that are replicated across TP (norm weights and biases, the
row-parallel output biases, learned position embeddings) see only their rank's sequence shard, so each
rank holds a partial gradient that must be summed over TP. Their ParamMeta says `sequence_parallel`; the
training step calls `allreduce_sequence_parallel_grads` after the backward (Megatron does the same in
finalize_model_grads). Without it, norm weights drift apart across TP ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.parallel_context import Group
from megatron_lite.parameters import named_param_meta


def allreduce_sequence_parallel_grads(
    model: nn.Module, tp: Group, grad_of: Callable[[nn.Parameter], torch.Tensor | None] = lambda p: p.grad
) -> None:
    """Sum the gradients of sequence-parallel parameters over TP, coalesced into one all-reduce.
    `grad_of` finds a parameter's gradient (`.grad`, or the data-parallel wrapper's main gradient)."""
    if tp.size == 1:
        return
    grads = [grad_of(p) for _, p, meta in named_param_meta(model) if meta.sequence_parallel and p.requires_grad]
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    with tp.blocked():
        dist.all_reduce(flat, group=tp.pg)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
