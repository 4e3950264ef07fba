"""The mixture-of-experts feed-forward block: gather the TP group's tokens, route, dispatch to the experts
(wherever they live), combine, reduce over TP; plus an optional shared expert (a dense MLP every token
passes through), optionally gated (moe/shared_expert.py).

An expert-TP size below TP (--expert-tensor-parallel-size, dividing TP; Megatron's grid puts each expert-TP group
inside a TP group, tp rank // ETP naming it): every TP rank still routes the whole sequence (the same routing
and statistics as one process), and each expert-TP group dispatches its own 1 / (TP / ETP) of the tokens, rows
in order, its outputs zero elsewhere, so the TP reduction adds the slices (and each slice's ETP partial sums),
as Megatron's dispatcher sends each TP rank's sequence shard.

The auxiliary losses join the backward without changing the model's output: an autograd function passes
the output through and hands each loss a gradient of `aux_loss_scale`, which the training step sets to
the weight one micro-batch's loss has in the global batch (and divides by TP, since every TP rank of the
group computes the same routing and their gradients are summed).

Routing statistics (tokens per expert before dropping, dropped pairs, the losses) accumulate on the layer
during a step; the training step reads and resets them, and updates the aux-loss-free expert bias.
Recomputation does not count twice.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.models.attach_loss import attach_loss
from megatron_lite.moe.dispatcher import allgather_dispatch, alltoall_dispatch, alltoall_dispatch_overlapped
from megatron_lite.moe.experts import LocalExperts
from megatron_lite.moe.router import Routing, TopKRouter
from megatron_lite.moe.shared_expert import SharedExpertMLP
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron_lite.tensor_parallel.random import checkpoint, is_recomputing


class MoELayer(nn.Module):
    def __init__(self, config: ModelConfig, ctx: ParallelContext, device=None, dtype=torch.float32) -> None:
        super().__init__()
        self.config = config
        self.tp, self.ep = ctx.tp, ctx.ep
        self.slices, self.slice = ctx.tp.size // ctx.etp.size, ctx.tp.rank // ctx.etp.size
        self.overlap_comm = ctx.parallel.overlap_moe_expert_parallel_comm
        self.sequence_parallel = ctx.sequence_parallel
        self.router = TopKRouter(config, ctx.tp.size, device, dtype, cp=ctx.cp)
        modules = config.recompute_modules if config.recompute_granularity == "selective" else ()
        self.rng = ctx.rng
        # (with "moe" the whole layer is recomputed by the transformer layer: nothing inside is checkpointed again)
        self.recompute_shared = "shared_experts" in modules and "moe" not in modules
        self.experts = LocalExperts(config, ctx.ep, ctx.etp, device, dtype)
        shared = config.moe_shared_expert_intermediate_size
        self.shared_expert = SharedExpertMLP(config, ctx, device, dtype) if shared else None
        self.aux_loss_scale = 0.0  # set by the training step before each forward-backward
        self.reset_stats()

    def reset_stats(self) -> None:
        # The step's sums on the device, read once by moe/stats.finish_step (copying them to the host after every
        # micro-batch made each layer wait for its experts before the next layer could be queued):
        # [tokens routed to each expert (E), of those the ones its capacity kept (E), aux loss, z loss, routed
        # pairs, dropped pairs]
        self.stats_row: torch.Tensor | None = None

    @property
    def stats(self) -> dict:
        """The step's statistics so far, on the host (for tests and inspection)."""
        e = self.config.num_experts
        row = self.stats_row.cpu() if self.stats_row is not None else torch.zeros(2 * e + 4, dtype=torch.float64)
        aux, z, routed, dropped = row[2 * e :].tolist()
        return {"counts": row[:e], "kept": row[e : 2 * e], "aux_loss": aux, "z_loss": z, "routed": routed,
                "dropped": dropped}  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [seq (shard), batch, hidden] -> same."""
        full = (
            gather_from_sequence_parallel_region(x, self.tp)
            if self.sequence_parallel
            else copy_to_tensor_model_parallel_region(x, self.tp)
        )
        s, b, h = full.shape
        tokens = full.reshape(s * b, h)
        routing = self.router(tokens, (s, b))
        tokens, routed = self._apply_probs_on_input(tokens, routing)
        if self.slices > 1:  # (this expert-TP group's rows; the others' outputs come from the TP reduction)
            if tokens.shape[0] % self.slices:  # (layout validation asks for SP; a library caller may not)
                raise ValueError(f"{tokens.shape[0]} token rows do not split into {self.slices} expert-TP slices")
            n = tokens.shape[0] // self.slices
            rows = slice(self.slice * n, (self.slice + 1) * n)
            part = {f: getattr(routed, f)[rows] for f in ("probs", "indices", "keep")}
            y = self._dispatch(tokens[rows], dataclasses.replace(routed, **part))
            pad = (0, 0, self.slice * n, tokens.shape[0] - (self.slice + 1) * n)
            y = torch.nn.functional.pad(y, pad)
        else:
            y = self._dispatch(tokens, routed)
        y = y.to(x.dtype).reshape(s, b, h)
        y = (
            reduce_scatter_to_sequence_parallel_region(y, self.tp)
            if self.sequence_parallel
            else reduce_from_tensor_model_parallel_region(y, self.tp)
        )
        if self.shared_expert is not None:
            recompute = self.recompute_shared and self.training
            y = y + (checkpoint(self.shared_expert, self.rng, x) if recompute else self.shared_expert(x))
        losses = [v for v in (routing.aux_loss, routing.z_loss) if v is not None]
        if losses and self.training and torch.is_grad_enabled():
            y = attach_loss(y, sum(losses), self.aux_loss_scale / self.tp.size)
        if not is_recomputing():
            self._add_stats(routing)
        return y

    def _dispatch(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        triton, e = self.config.kernel_impl == "triton", self.config.num_experts
        if self.config.moe_token_dispatcher_type == "alltoall" and self.overlap_comm and self.ep.size > 1:
            return alltoall_dispatch_overlapped(tokens, routing, self.experts, self.ep, e, triton)
        if self.config.moe_token_dispatcher_type == "alltoall":
            return alltoall_dispatch(tokens, routing, self.experts, self.ep, e, triton)
        return allgather_dispatch(tokens, routing, self.experts, self.ep, e)

    def _apply_probs_on_input(self, tokens: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, Routing]:
        """--moe-apply-probs-on-input (top-k 1): each token times its routing weight, in fp32 and back to the
        tokens' dtype, before it is sent to its expert; the combine then weighs the outputs by one (zero for a pair
        its capacity dropped). As Megatron's experts do, on the permuted rows: the same rows, scaled before the
        permutation. The statistics and losses keep the router's own weights."""
        if not self.config.moe_apply_probs_on_input:
            return tokens, routing
        scaled = (tokens * routing.probs).to(tokens.dtype)  # (probs [T, 1]: one expert a token)
        return scaled, dataclasses.replace(routing, probs=routing.keep.to(routing.probs.dtype))

    @torch.no_grad()
    def _add_stats(self, routing) -> None:
        """This micro-batch's statistics added on the device, without a host sync."""
        e, keep = self.config.num_experts, routing.keep.reshape(-1)
        counts = routing.counts.double()
        kept = counts.new_zeros(e).scatter_add_(0, routing.indices.reshape(-1), keep.double())
        zero = counts.new_zeros(())
        aux, z = (v.detach().double() if v is not None else zero for v in (routing.aux_loss, routing.z_loss))
        routed = counts.new_full((), keep.numel())
        row = torch.cat([counts, kept, torch.stack([aux, z, routed, routed - keep.double().sum()])])
        self.stats_row = row if self.stats_row is None else self.stats_row + row
