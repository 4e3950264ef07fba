"""Megatron's --optimizer dist_muon: --optimizer muon under Megatron-Core's LayerWiseDistributedOptimizer.

Each data-parallel rank owns whole parameters (the dense ones over the DP x CP group, experts over the
expert-data-parallel group): it keeps the fp32 main weights and the optimizer state (Muon's momentum, Adam's
moments) only for those, and steps only those. Gradients are all-reduced as for plain muon (Megatron's DDP
does the same: every rank holds every reduced gradient), and after the step each rank's updated weights are
all-gathered into every rank's model. So the Muon update of a matrix, its tensor-parallel collectives included,
is the one process's, and optimizer-state memory per rank falls to about 1/DP.

The split: Megatron sorts the parameters by size and deals them out ping-pong; here each parameter, largest
first, goes to the rank holding the fewest bytes of state so far (its state's bytes: Adam keeps two moments,
Muon one momentum, plus an fp32 main copy of low-precision weights), which balances the state better. Only
memory depends on the split: the update of a parameter is the same on whichever rank steps it. The split is a
function of the parameters' order and sizes, alike on every tensor-parallel rank, so the ranks that
orthogonalize one matrix together (--muon-tp-mode duplicated|distributed) own it together.

The grad norm is exact: each rank sums the squares of its owned gradients (the same counting rules as
without sharding), summed over the data-parallel group, then the model-parallel one. Checkpoints hold full
tensors as plain muon's do, each written by its owner alone (no gather) and read at load by its new owner alone,
so one saved under dist_muon loads under muon, under another DP size, and the other way round.
"""

from __future__ import annotations

import heapq

import torch
from torch import nn

from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.optimizer.optimizer import (
    GradOf,
    MixedPrecisionOptimizer,
    StepResult,
    group_name,
    runs_muon,
)
from megatron_lite.parallel_context import Group, ParallelContext
from megatron_lite.parameters import named_param_meta
from megatron_lite.tensor_parallel.mappings import all_gather_tensor


def layer_wise_split(sizes: list[int], ranks: int) -> list[int]:
    """The owner of each item of `sizes` (bytes of state): largest first (ties: the earlier first), each to
    the rank with the fewest bytes so far (ties: the lowest rank). (A heap of (bytes, rank): the planner splits
    a large MoE's tens of thousands of expert matrices over hundreds of ranks, layout after layout.)"""
    heap, owner = [(0, r) for r in range(ranks)], [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, r = heap[0]
        owner[i] = r
        heapq.heapreplace(heap, (load + sizes[i], r))
    return owner


def state_bytes(numel: int, muon: bool, low: bool) -> int:
    """Bytes a rank keeps for a parameter it owns: Muon's momentum or Adam's two moments, plus an fp32 main copy
    of low-precision (`low`) weights."""
    return numel * 4 * ((1 if muon else 2) + low)


def busiest_state_bytes(trained, ctx: ParallelContext, low: bool) -> int:
    """The most bytes of optimizer state any rank of this rank's data-parallel groups owns under the split (the dry
    run's, on a model built on meta): `trained` as (group name, parameter, meta), `low`: 16-bit weights. The
    busiest dense share and the busiest expert share, which may be two ranks'."""
    total = 0
    for expert, group in ((False, ctx.dp_cp), (True, ctx.edp)):
        sizes = [state_bytes(p.numel(), runs_muon(name, p.ndim), low) for name, p, m in trained if m.expert == expert]
        load = [0] * group.size
        for size, r in zip(sizes, layer_wise_split(sizes, group.size)):
            load[r] += size
        total += max(load)
    return total


class LayerWiseDistributedOptimizer(MixedPrecisionOptimizer):
    """MixedPrecisionOptimizer over the parameters this rank owns (its muon optimizer, main weights, state and
    sums see those alone), with the updated weights all-gathered after each step."""

    sharded = True  # (each rank writes the main weights and state of the parameters it owns: no gather)

    def __init__(self, model: nn.Module, grad_of: GradOf, config: OptimizerConfig, ctx: ParallelContext) -> None:
        self.config, self.ctx = config, ctx
        trained = [(name, p, meta) for name, p, meta in named_param_meta(model) if p.requires_grad]
        # (group, each of its ranks' owned parameters in model order): dense over DP x CP, experts over EDP
        self._owned_by: list[tuple[Group, list[list[nn.Parameter]]]] = []
        self._muon: dict[int, bool] = {}  # id(p) -> whether Muon steps it (else Adam)
        mine = set()
        for expert, group in ((False, ctx.dp_cp), (True, ctx.edp)):
            members = [(name, p, meta) for name, p, meta in trained if meta.expert == expert]
            if not members:
                continue
            sizes = []
            for name, p, meta in members:
                muon = self._muon[id(p)] = runs_muon(group_name(name, meta), p.ndim)
                sizes.append(state_bytes(p.numel(), muon, p.dtype != torch.float32))
            owner = layer_wise_split(sizes, group.size)
            lists: list[list[nn.Parameter]] = [[] for _ in range(group.size)]
            for (_, p, _), r in zip(members, owner):
                lists[r].append(p)
            mine |= {id(p) for p in lists[group.rank]}
            self._owned_by.append((group, lists))
        self._mine = mine
        super().__init__(model, grad_of, config, ctx)

    def _stepped(self, model: nn.Module) -> list:
        return [(name, p, meta) for name, p, meta in named_param_meta(model) if id(p) in self._mine]

    def _sum_groups(self, expert: bool) -> tuple:
        """Each rank counts its owned parameters: summed over the group they are split over, then as before."""
        return (self.ctx.edp, self.ctx.emp) if expert else (self.ctx.dp_cp, self.ctx.mp)

    @torch.no_grad()
    def step(self, lr: float, decoupled_lr: float | None = None, weight_decay: float | None = None) -> StepResult:
        result = super().step(lr, decoupled_lr, weight_decay)  # (skipped alike on every rank: a global norm)
        if result.updated:
            self._gather_params()
        return result

    @torch.no_grad()
    def _gather_params(self) -> None:
        """Every rank's updated weights into every rank's model: one all-gather per group and dtype of this
        rank's flattened parameters, padded to the largest rank's (gloo's all-gather takes equal sizes), in place
        (this rank's part of the output is its input). One buffer serves every group and dtype, so past the
        activations, freed by then, the step holds width x group size elements of the largest, whatever a
        collective's work still references (planner/memory.py prices that; a flat input, a torch.cat copy and the
        previous group's buffer held on added up to about a stage's weights again)."""
        gathers = []  # (group, each rank's parameters of one dtype, the dtype, the largest rank's elements)
        for group, lists in self._owned_by:
            if group.size == 1:
                continue
            for dtype in sorted({p.dtype for ps in lists for p in ps}, key=str):
                of = [[p for p in ps if p.dtype == dtype] for ps in lists]
                gathers.append((group, of, dtype, max(sum(p.numel() for p in ps) for ps in of)))
        if not gathers:
            return
        size = max(width * group.size * dtype.itemsize for group, _, dtype, width in gathers)
        buffer = torch.empty(size, dtype=torch.uint8, device=self.ctx.device)
        for group, of, dtype, width in gathers:
            gathered = buffer[: width * group.size * dtype.itemsize].view(dtype)
            at = group.rank * width
            for p in of[group.rank]:
                gathered[at : at + p.numel()].copy_(p.detach().reshape(-1))
                at += p.numel()
            with group.blocked():
                all_gather_tensor(gathered, gathered[group.rank * width : (group.rank + 1) * width], group=group.pg)
            for r, ps in enumerate(of):
                if r == group.rank:
                    continue
                at = r * width
                for p in ps:
                    p.detach().copy_(gathered[at : at + p.numel()].view(p.shape))
                    at += p.numel()
