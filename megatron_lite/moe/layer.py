"""The mixture-of-experts feed-forward block: gather the TP group's tokens, route, dispatch to the experts
(wherever they live), combine, reduce over TP; plus an optional shared expert (a dense MLP every token
passes through).

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
from megatron_lite.models.mlp import MLP
from megatron_lite.moe.dispatcher import allgather_dispatch, alltoall_dispatch, alltoall_dispatch_overlapped
from megatron_lite.moe.experts import LocalExperts
from megatron_lite.moe.router import TopKRouter
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
        self.overlap_comm = ctx.parallel.overlap_moe_expert_parallel_comm
        self.sequence_parallel = ctx.sequence_parallel
        self.router = TopKRouter(config, ctx.tp.size, device, dtype, cp=ctx.cp)
        modules = config.recompute_modules if config.recompute_granularity == "selective" else ()
        self.rng = ctx.rng
        # (with "moe" the whole layer is recomputed by the transformer layer: nothing inside is checkpointed again)
        self.recompute_shared = "shared_experts" in modules and "moe" not in modules
        self.experts = LocalExperts(config, ctx.ep, ctx.etp, device, dtype)
        shared = config.moe_shared_expert_intermediate_size
        self.shared_expert = (
            MLP(dataclasses.replace(config, ffn_hidden_size=shared, num_experts=None), ctx, device, dtype)
            if shared
            else None
        )
        self.aux_loss_scale = 0.0  # set by the training step before each forward-backward
        self.reset_stats()

    def reset_stats(self) -> None:
        e = self.config.num_experts
        self.stats = {
            "counts": torch.zeros(e, dtype=torch.float64),  # tokens routed to each expert
            "kept": torch.zeros(e, dtype=torch.float64),  # of those, the ones its capacity kept
            "routed": 0.0,
            "dropped": 0.0,
            "aux_loss": 0.0,
            "z_loss": 0.0,
            "micro_batches": 0,
        }

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
        triton = self.config.kernel_impl == "triton"
        if self.config.moe_token_dispatcher_type == "alltoall" and self.overlap_comm and self.ep.size > 1:
            y = alltoall_dispatch_overlapped(tokens, routing, self.experts, self.ep, self.config.num_experts, triton)
        elif self.config.moe_token_dispatcher_type == "alltoall":
            y = alltoall_dispatch(tokens, routing, self.experts, self.ep, self.config.num_experts, triton)
        else:
            y = allgather_dispatch(tokens, routing, self.experts, self.ep, self.config.num_experts)
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
            st = self.stats
            st["counts"] += routing.counts.detach().double().cpu()
            kept = torch.bincount(routing.indices[routing.keep], minlength=self.config.num_experts)
            st["kept"] += kept.detach().double().cpu()
            st["routed"] += float(routing.keep.numel())
            st["dropped"] += float((~routing.keep).sum())
            st["aux_loss"] += float(routing.aux_loss.detach()) if routing.aux_loss is not None else 0.0
            st["z_loss"] += float(routing.z_loss.detach()) if routing.z_loss is not None else 0.0
            st["micro_batches"] += 1
        return y
