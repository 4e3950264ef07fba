"""One training iteration: micro-batches with gradient accumulation, gradient finalisation, optimizer step.

The loss of a global batch is the mean over every loss-bearing token in it. Each rank divides its token
losses by that global count (one small all-reduce before the forward), so the data-parallel reduction
is a plain sum and the result does not depend on how the batch was split over ranks or micro-batches.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lite.context_parallel.zigzag import slice_batch
from megatron_lite.distributed.ddp import DistributedDataParallel, tied_embedding_copies
from megatron_lite.models.gpt_model import ModelChunks, stream_dtype
from megatron_lite.models.mtp import MultiTokenPredictionBlock, mtp_inputs
from megatron_lite.moe import stats as moe_stats
from megatron_lite.optimizer.lr_scheduler import LRScheduler
from megatron_lite.optimizer.optimizer import MixedPrecisionOptimizer
from megatron_lite.optimizer.qk_clip import clip_qk
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.pipeline_parallel.executor import documents, run_pipeline
from megatron_lite.tensor_parallel.cross_entropy import counted_labels
from megatron_lite.tensor_parallel.fp8 import update_fp8_scales
from megatron_lite.tensor_parallel.grads import allreduce_sequence_parallel_grads
from megatron_lite.tensor_parallel.mappings import all_reduce
from megatron_lite.training import memory

# tokens, labels, loss_mask: [micro_batch, seq]; position_ids and document_ids (--reset-attention-mask) optional
MicroBatch = dict[str, torch.Tensor]


@dataclass
class StepMetrics:
    lm_loss: float
    grad_norm: float | None
    lr: float
    loss_scale: float
    updated: bool
    num_tokens: int
    moe: dict | None = None  # routing metrics of MoE models (moe/stats.py)
    # --mtp-num-layers: each depth's loss (the mean over its tokens; None for a depth without any)
    mtp_losses: list[float | None] | None = None
    step_seconds: float = 0.0
    comm_exposed_seconds: float = 0.0  # time blocked in communication (megatron_lite/comm_timer.py)
    activation_bytes: int | None = None  # peak of saved activations, when measured (training/memory.py)
    params_norm: float | None = None  # --log-params-norm: after the update
    num_zeros_in_grad: int | None = None  # --log-num-zeros-in-grad
    decoupled_lr: float | None = None  # --decoupled-lr: the embeddings' and output layer's rate, as `lr` the step's
    max_attention_logit: float | None = None  # --qk-clip / --log-max-attention-logit: the step's, over the model

    @property
    def comm_exposed_fraction(self) -> float:
        return self.comm_exposed_seconds / self.step_seconds if self.step_seconds > 0 else 0.0


def context_parallel_part(micro_batches: list[MicroBatch], ctx: ParallelContext) -> list[MicroBatch]:
    """Under context parallelism every CP rank loads the same micro-batches and keeps its zigzag part."""
    if ctx.cp.size == 1:
        return micro_batches
    return [slice_batch(mb, ctx.cp.size, ctx.cp.rank) for mb in micro_batches]


def with_mtp_inputs(micro_batches: list[MicroBatch], config) -> list[MicroBatch]:
    """--mtp-num-layers: each depth's shifted tokens, labels and mask, cut from the whole sequences (before the
    context-parallel split)."""
    if not config.mtp_num_layers:
        return micro_batches
    return [mtp_inputs(mb, config.mtp_num_layers) for mb in micro_batches]


def global_token_count(micro_batches: list[MicroBatch], ctx: ParallelContext) -> torch.Tensor:
    """The loss-bearing tokens of the global batch: [main loss, then each multi-token-prediction depth]."""
    local = torch.stack(
        [
            torch.cat([mb["loss_mask"].sum().reshape(1), mb["mtp_loss_mask"].sum((0, 2))])
            if "mtp_loss_mask" in mb
            else mb["loss_mask"].sum().reshape(1)
            for mb in micro_batches
        ]
    ).sum(0)
    return all_reduce(local.to(torch.float64), ctx.dp_cp)


def _mtp_blocks(model: DistributedDataParallel) -> list[MultiTokenPredictionBlock]:
    return [m for m in model.module.modules() if isinstance(m, MultiTokenPredictionBlock)]


def _prepare_mtp(model: DistributedDataParallel, counts: torch.Tensor, loss_scale: float) -> None:
    """Each depth's loss is the mean over its tokens, weighted by mtp_loss_scaling_factor / depths."""
    for block in _mtp_blocks(model):
        block.take_loss_sums()
        block.loss_scales = [loss_scale * block.weight / float(n) if n > 0 else 0.0 for n in counts.tolist()]


def _mtp_losses(model: DistributedDataParallel, counts: torch.Tensor, ctx: ParallelContext) -> list[float] | None:
    """Each depth's mean token loss over the global batch (the last stage's sums, reduced over DP x CP and PP)."""
    if counts.numel() == 0:
        return None
    sums = torch.zeros(counts.numel(), dtype=torch.float64, device=ctx.device)
    for block in _mtp_blocks(model):
        taken = block.take_loss_sums()
        if taken is not None:
            sums += taken.to(ctx.device)
    sums = all_reduce(all_reduce(sums, ctx.dp_cp), ctx.pp)
    return [float(s / n) if n > 0 else None for s, n in zip(sums.tolist(), counts.tolist())]  # (None: no tokens)


def forward_backward(
    model: DistributedDataParallel, micro_batches: list[MicroBatch], num_tokens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Forward and backward of every micro-batch (no pipelining), each loss sum times `scale`; returns this
    rank's summed token loss."""
    total = torch.zeros((), dtype=torch.float64, device=num_tokens.device)
    last = len(micro_batches) - 1
    for i, mb in enumerate(micro_batches):
        with model.no_sync() if i < last else contextlib.nullcontext():
            labels = counted_labels(mb["labels"], mb["loss_mask"])
            # (the losses are summed with one scale below: the fused loss may make its gradients in the forward)
            token_loss = model(
                mb["tokens"], mb.get("position_ids"), labels=labels, grads_in_forward=True, **documents(mb)
            )
            loss_sum = (token_loss.float() * mb["loss_mask"]).sum()
            (loss_sum * scale).backward()
        total += loss_sum.detach().double()
    return total


def _chunks(model: DistributedDataParallel) -> list:
    return list(model.module) if isinstance(model.module, ModelChunks) else [model.module]


def _pipelined(model: DistributedDataParallel, ctx: ParallelContext) -> bool:
    return ctx.pp.size > 1 or len(_chunks(model)) > 1


def _run_pipeline(model, micro_batches, ctx, scale: float, forward_only: bool) -> torch.Tensor:
    chunks = _chunks(model)
    b, s = micro_batches[0]["tokens"].shape
    seq = s // ctx.tp.size if ctx.sequence_parallel else s
    shape = (seq, b, chunks[0].config.hidden_size)
    # the dtype the chunks compute in (FSDP2 keeps fp32 parameters and computes in its param_dtype)
    # (the build dtype: a stage of no-op layers, or a virtual stage "Ett||tt|L", holds no parameter)
    dtype = getattr(model, "compute_dtype", None) or chunks[0].params_dtype
    dtype = stream_dtype(chunks[0].config, dtype)  # (fp32 under --fp32-residual-connection)
    final = None if forward_only else model.final_grads  # each chunk's buckets reduce under the rest
    return run_pipeline(chunks, ctx, micro_batches, shape, dtype, scale, forward_only, final_grads=final)


def allreduce_embedding_grads(model: DistributedDataParallel, ctx: ParallelContext) -> None:
    """Tied embeddings under pipelining: the first stage's word embeddings and the last stage's copy get
    the sum of both gradients, so the two stay equal."""
    for g in [model.main_grad(p) for p in tied_embedding_copies(model.module, ctx)]:
        with ctx.embedding.blocked():
            dist.all_reduce(g, group=ctx.embedding.pg)


def finalize_grads(model: DistributedDataParallel, ctx: ParallelContext) -> None:
    """Every reduction the layout needs before the optimizer sees the gradients.

    With the distributed optimizer a rank holds the data-parallel sum of only its part of each bucket. The
    tied embedding's two copies sit at different places in their stages' buffers, so their gradients are
    summed first, on the full local gradients. (TP ranks share one buffer layout, so the sequence-parallel
    sums over TP, experts' over expert-TP, stay correct on the owned parts after the reduce-scatter.)"""
    model.note_tied_local()  # the NaN check sees this rank's own tied gradient, before any reduction mixes it
    if model.use_distributed_optimizer:
        allreduce_embedding_grads(model, ctx)
        model.finish_grad_sync()
        model.sequence_parallel_shard_sum(ctx.tp, ctx.etp)
        return
    model.finish_grad_sync()
    allreduce_sequence_parallel_grads(model.module, ctx.tp, model.main_grad, etp=ctx.etp)
    allreduce_embedding_grads(model, ctx)


def train_step(
    model: DistributedDataParallel,
    optimizer: MixedPrecisionOptimizer,
    scheduler: LRScheduler,
    micro_batches: list[MicroBatch],
    ctx: ParallelContext,
    measure_activations: bool = False,
    log_params_norm: bool = False,
    log_num_zeros_in_grad: bool = False,
) -> StepMetrics:
    start = time.perf_counter()
    measuring, meter = memory.measure(model.module if measure_activations else None)
    timer = ctx.comm_timer
    if timer is not None:
        timer.take()
    model.zero_grad_buffer()
    samples = sum(int(mb["tokens"].shape[0]) for mb in micro_batches) * ctx.dp.size  # this step's global batch
    config = _chunks(model)[0].config
    micro_batches = context_parallel_part(with_mtp_inputs(micro_batches, config), ctx)
    num_tokens, mtp_counts = global_token_count(micro_batches, ctx).split([1, config.mtp_num_layers])
    num_tokens = num_tokens[0]
    _prepare_mtp(model, mtp_counts, optimizer.loss_scale)
    layers = moe_stats.moe_layers(model.module) if config.num_experts else {}
    if config.num_experts:
        moe_stats.prepare_step(layers, len(micro_batches), optimizer.loss_scale, ctx)
    # (no loss-bearing token: the MoE auxiliary losses' gradients alone, as Megatron)
    scale = optimizer.loss_scale / max(float(num_tokens), 1.0)
    if _pipelined(model, ctx):
        with model.no_sync(), measuring:  # a chunk's buckets are reduced once its last backward runs
            loss_sum = _run_pipeline(model, micro_batches, ctx, scale, False)
        loss_sum = all_reduce(loss_sum.reshape(1), ctx.pp)[0]  # the loss lives on the last stage
    else:
        with measuring:
            loss_sum = forward_backward(model, micro_batches, num_tokens, scale)
    finalize_grads(model, ctx)
    if config.fp8 is not None and config.fp8_recipe == "delayed":  # (the next iteration's scales)
        update_fp8_scales(model.module, ctx.tp_cp_dp, (ctx.etp, ctx.edp))
    moe = moe_stats.finish_step(layers, config, len(micro_batches), ctx) if config.num_experts else None
    mtp_losses = _mtp_losses(model, mtp_counts, ctx)
    lr, decoupled_lr = scheduler.lr, scheduler.decoupled_lr
    result = optimizer.step(lr, decoupled_lr, scheduler.weight_decay)
    if result.updated:
        scheduler.step(samples)
    max_logit = clip_qk(_chunks(model), optimizer, config, ctx)  # (after every step, as Megatron's train_step)
    # the reduced gradients, still in buffers; none for a skipped step (Megatron's step returns no count: an
    # overflowed fp16 step logged the zeros of its inf/NaN gradients)
    zeros = optimizer.grad_zeros() if log_num_zeros_in_grad and result.updated else None
    params_norm = optimizer.params_norm() if log_params_norm else None
    lm_loss = float(all_reduce(loss_sum.reshape(1), ctx.dp_cp)[0] / num_tokens) if num_tokens > 0 else math.nan
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    return StepMetrics(
        lm_loss,
        result.grad_norm,
        lr,
        result.loss_scale,
        result.updated,
        int(num_tokens),
        moe,
        mtp_losses,
        step_seconds=time.perf_counter() - start,
        comm_exposed_seconds=timer.take() if timer is not None else 0.0,
        activation_bytes=meter.peak if meter is not None else None,
        params_norm=params_norm,
        num_zeros_in_grad=zeros,
        decoupled_lr=decoupled_lr,
        max_attention_logit=max_logit,
    )


@torch.no_grad()
def eval_step(
    model: DistributedDataParallel, micro_batches: list[MicroBatch], ctx: ParallelContext
) -> tuple[float, float]:
    """(summed loss, counted tokens) of one global batch: an evaluation divides its totals once, as Megatron's
    evaluate() does, so batches that count more tokens weigh more (and one that counts none adds nothing)."""
    micro_batches = context_parallel_part(micro_batches, ctx)
    num_tokens = global_token_count(micro_batches, ctx)[0]
    if _pipelined(model, ctx):
        total = all_reduce(_run_pipeline(model, micro_batches, ctx, 1.0, True).reshape(1), ctx.pp)[0]
    else:
        total = torch.zeros((), dtype=torch.float64, device=num_tokens.device)
        for mb in micro_batches:
            token_loss = model(mb["tokens"], mb.get("position_ids"), labels=mb["labels"], **documents(mb))
            total += (token_loss.float() * mb["loss_mask"]).sum().double()
    if hasattr(model, "reshard"):  # (FSDP2: no backward follows to reshard what the forward gathered)
        model.reshard()
    return float(all_reduce(total.reshape(1), ctx.dp_cp)[0]), float(num_tokens)
