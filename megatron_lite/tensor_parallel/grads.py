"""Gradient reductions the tensor-parallel layout itself requires.

Under sequence parallelism, parameters that are replicated across TP (norm weights and biases, the
row-parallel output biases, learned position embeddings) see only their rank's sequence shard, so each
rank holds a partial gradient that must be summed over TP. Their ParamMeta says `sequence_parallel`; the
training step calls `allreduce_sequence_parallel_grads` after the backward (Megatron does the same in
finalize_model_grads). Without it, norm weights drift apart across TP ranks.

An expert's parameter marked so (an expert LoRA adapter's replicated half, fc2's bias under expert-TP) is
partial over the expert-TP group alone: at an expert-TP size below TP the other expert-TP groups of the TP
group computed other slices of the tokens, and the expert-data-parallel reduction, which spans those groups,
already adds them (summing over TP as well counted each slice twice).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.parallel_context import Group
from megatron_lite.parameters import ParamMeta, named_param_meta


def sum_groups(tp: Group, etp: Group | None) -> list[tuple[Group, Callable[[ParamMeta], bool]]]:
    """(group, which sequence-parallel parameters it sums) for each reduction: one over TP when the expert-TP
    group is the TP group (`etp` None: the caller's experts are split like TP), else the dense parameters over
    TP and the experts' over expert-TP. Groups of one rank are left out."""
    if etp is None or etp.size == tp.size:  # (Megatron's grid: expert-TP groups lie inside TP groups)
        pairs = [(tp, lambda meta: True)]
    else:
        pairs = [(tp, lambda meta: not meta.expert), (etp, lambda meta: meta.expert)]
    return [(group, which) for group, which in pairs if group.size > 1]


def allreduce_sequence_parallel_grads(
    model: nn.Module,
    tp: Group,
    grad_of: Callable[[nn.Parameter], torch.Tensor | None] = lambda p: p.grad,
    *,
    etp: Group | None,
) -> None:
    """Sum the gradients of sequence-parallel parameters over TP (experts' over `etp`, see above), coalesced into
    one all-reduce per group. `grad_of` finds a parameter's gradient (`.grad`, or the data-parallel wrapper's main
    gradient)."""
    for group, which in sum_groups(tp, etp):
        grads = [grad_of(p) for _, p, meta in named_param_meta(model)
                 if meta.sequence_parallel and which(meta) and p.requires_grad]  # fmt: skip
        allreduce_coalesced([g for g in grads if g is not None], group)


def allreduce_coalesced(grads: list[torch.Tensor], group: Group) -> None:
    """Sum `grads` (tensors or views) over `group` in place, in one all-reduce of their concatenation."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    with group.blocked():
        dist.all_reduce(flat, group=group.pg)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
