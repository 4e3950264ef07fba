"""The data-parallel wrapper and optimizer a job trains with, chosen by the optimizer flags: plain DDP +
mixed-precision AdamW, the distributed optimizer (ZeRO-1/2), FSDP2 (ZeRO-3), or dist_muon's layer-wise one."""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.distributed.ddp import DistributedDataParallel
from megatron_lite.distributed.fsdp import FSDP2Model, FSDP2Optimizer
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.optimizer.distributed_optimizer import DistributedOptimizer
from megatron_lite.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
from megatron_lite.optimizer.optimizer import MixedPrecisionOptimizer
from megatron_lite.parallel_context import ParallelContext


def build_training_model(config, ctx: ParallelContext, seed: int, dtype: torch.dtype, fsdp2: bool) -> nn.Module:
    """The model a run trains, in `dtype` (--bf16: bf16 weights, fp32 main weights beside them). FSDP2 keeps fp32
    sharded weights, its main weights, and computes in bf16 through its policy: they start as the other layouts'
    main weights do, from the bf16 weights built (from the unrounded initial ones, FSDP2 trained apart from every
    other bf16 layout, by more than bf16 from fp32 does)."""
    from megatron_lite.models.gpt_model import build_model

    model = build_model(config, ctx, seed=seed, dtype=dtype)
    if fsdp2 and dtype != torch.float32:
        with torch.no_grad():
            for p in model.parameters():
                if p.dtype == dtype:  # (those kept in fp32, gpt-oss's sinks, are as built)
                    p.data = p.data.float()
    return model


def wrap_for_training(
    model: nn.Module,
    ctx: ParallelContext,
    optim: OptimizerConfig,
    *,
    overlap_grad_reduce: bool = False,
    bucket_size: int | None = None,
    compute_dtype: torch.dtype | None = None,
):
    """(data-parallel wrapper, optimizer). `compute_dtype`: FSDP2's compute dtype (its weights stay fp32)."""
    if optim.use_torch_fsdp2:
        ddp = FSDP2Model(
            model,
            ctx,
            compute_dtype,
            reduce_dtype=optim.grad_dtype,
            reshard_after_forward=optim.torch_fsdp2_reshard_after_forward,
        )
        return ddp, FSDP2Optimizer(ddp, optim, ctx)
    ddp = DistributedDataParallel(
        model,
        ctx,
        overlap_grad_reduce=overlap_grad_reduce,
        bucket_size=bucket_size,
        use_distributed_optimizer=optim.use_distributed_optimizer,
        zero_stage=optim.zero_stage,
        grad_dtype=optim.grad_dtype,
        reduce_scatter_with_fp32_accumulation=optim.ddp_reduce_scatter_with_fp32_accumulation,
    )
    ddp.check_finite(optim.check_for_nan_in_loss_and_grad)
    if optim.use_distributed_optimizer:
        return ddp, DistributedOptimizer(model, ddp, optim, ctx, overlap_param_gather=optim.overlap_param_gather)
    if optim.optimizer == "dist_muon":
        return ddp, LayerWiseDistributedOptimizer(model, ddp.main_grad, optim, ctx)
    return ddp, MixedPrecisionOptimizer(model, ddp.main_grad, optim, ctx)
