"""Run a layout for real on the current process group (gloo on CPU, NCCL on GPU): median step time and this
rank's memory breakdown, to hold the planner's estimates against (tools/plan_parallelism.py --check-cpu and
tests/test_planner.py)."""

from __future__ import annotations

import dataclasses
import statistics

import torch

from megatron_lite.config import ModelConfig
from megatron_lite.data.mock import MockGPTDataset, collate
from megatron_lite.data.samplers import micro_batch_indices
from megatron_lite.optimizer.lr_scheduler import LRScheduler
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.planner.layout import Layout
from megatron_lite.planner.muon_cost import MuonSettings
from megatron_lite.planner.search import optimizer_config
from megatron_lite.tensor_parallel.fp8 import describe_fp8
from megatron_lite.training import memory
from megatron_lite.training.step import train_step
from megatron_lite.training.wrap import build_training_model, wrap_for_training


def measure_layout(
    model: ModelConfig,
    layout: Layout,
    seq_length: int,
    global_batch_size: int,
    iters: int = 3,
    ctx: ParallelContext | None = None,
    bf16: bool = False,
    grads_bf16: bool = False,
    optimizer: str = "adam",
    muon: MuonSettings | None = None,
) -> dict:
    """{"step_seconds": median over `iters` steps after one warm-up, "comm_exposed_seconds": likewise,
    "memory": this rank's breakdown after the first step (activations measured in it)}. `muon`: the --muon-*
    flags of --optimizer muon or dist_muon (default: Megatron's)."""
    ctx = ctx or ParallelContext.build(layout.parallel_config())
    cfg = layout.model_config(model)
    dtype = torch.bfloat16 if bf16 else torch.float32
    fsdp2 = layout.sharding == "fsdp2"
    net = build_training_model(cfg, ctx, 1, dtype, fsdp2)
    if cfg.fp8 is not None:  # (as pretrain switches the linears: their fp8 copies are what the backward keeps)
        describe_fp8(net, cfg, ctx, fsdp2)
    optim = optimizer_config(layout, bf16, grads_bf16, optimizer)
    if muon is not None:
        optim = dataclasses.replace(optim, **{f"muon_{k}": v for k, v in dataclasses.asdict(muon).items()})
    ddp, opt = wrap_for_training(net, ctx, optim, overlap_grad_reduce=layout.overlaps_grad_reduce, compute_dtype=dtype)
    sched = LRScheduler(optim, iters + 1)
    data = MockGPTDataset(cfg.vocab_size, seq_length, seed=1)
    times, comm, breakdown = [], [], None
    for it in range(iters + 1):
        idx = micro_batch_indices(
            it * global_batch_size, global_batch_size, layout.micro_batch_size, ctx.dp.rank, ctx.dp.size
        )
        batches = [collate([data[i] for i in ix], ctx.device) for ix in idx]
        m = train_step(ddp, opt, sched, batches, ctx, measure_activations=it == 0)
        if it == 0:
            breakdown = memory.breakdown(net, ddp, opt, m.activation_bytes)
        else:
            times.append(m.step_seconds)
            comm.append(m.comm_exposed_seconds)
    return {  # (None with iters=0: the memory alone)
        "step_seconds": statistics.median(times) if times else None,
        "comm_exposed_seconds": statistics.median(comm) if comm else None,
        "memory": breakdown,
        "pp_rank": ctx.pp.rank,
    }
