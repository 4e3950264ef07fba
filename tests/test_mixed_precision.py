"""Mixed precision: bf16 weights with fp32 main weights track the fp32 run; under fp16 an overflowing
gradient skips exactly that step (weights, moments and schedule untouched) and halves the loss scale."""

from __future__ import annotations

import torch

from megatron_lite.config import ParallelConfig
from megatron_lite.data.mock import MockGPTDataset, collate
from megatron_lite.distributed.ddp import DistributedDataParallel
from megatron_lite.models.gpt_model import GPTModel
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.optimizer.lr_scheduler import LRScheduler
from megatron_lite.optimizer.optimizer import MixedPrecisionOptimizer
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.training.step import train_step

from models import llama_config


def _setup(dtype, optim):
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    ctx.seed(0)
    model = GPTModel(llama_config(), ctx, seed=0, dtype=dtype)
    ddp = DistributedDataParallel(model, ctx)
    return ctx, model, ddp, MixedPrecisionOptimizer(model, ddp.main_grad, optim, ctx), LRScheduler(optim, 20)


def _batch(it):
    data = MockGPTDataset(250, 32, seed=5)
    return [collate([data[it * 4 + i] for i in range(4)])]


def test_bf16_tracks_fp32_over_20_iterations():
    base = dict(lr=2e-3, lr_warmup_iters=2, lr_decay_style="cosine", clip_grad=1.0)
    runs = {}
    for dtype, flags in ((torch.float32, {}), (torch.bfloat16, {"bf16": True})):
        ctx, model, ddp, opt, sched = _setup(dtype, OptimizerConfig(**base, **flags))
        assert all(p.dtype == dtype for p in model.parameters())
        runs[dtype] = [train_step(ddp, opt, sched, _batch(it), ctx).lm_loss for it in range(20)]
        if dtype == torch.bfloat16:  # fp32 main weights really are kept apart from the bf16 weights
            assert all(m.dtype == torch.float32 and m is not p for p, m in zip(opt.params, opt.main_params))
    for it, (a, b) in enumerate(zip(runs[torch.bfloat16], runs[torch.float32])):
        assert abs(a - b) <= 2e-2 * abs(b), (it, a, b)
    assert runs[torch.float32][-1] < runs[torch.float32][0]


def test_fp16_overflow_skips_exactly_that_step_and_halves_the_scale():
    optim = OptimizerConfig(lr=1e-3, fp16=True, initial_loss_scale=2.0**16, hysteresis=1, loss_scale_window=1000)
    ctx, model, ddp, opt, sched = _setup(torch.float16, optim)
    results = [train_step(ddp, opt, sched, _batch(0), ctx)]
    assert results[0].updated and results[0].loss_scale == 2.0**16
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {id(k): v["exp_avg"].clone() for k, v in opt.inner.state.items()}
    steps = sched.num_steps
    victim = model.decoder.layers[0].mlp.linear_fc1.weight
    handle = victim.register_hook(lambda g: g * float("inf"))  # an overflow inside the backward
    skipped = train_step(ddp, opt, sched, _batch(1), ctx)
    handle.remove()
    assert not skipped.updated and skipped.grad_norm is None
    assert skipped.loss_scale == 2.0**15  # halved
    assert sched.num_steps == steps  # the schedule did not advance
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert all(torch.equal(v["exp_avg"], moments[id(k)]) for k, v in opt.inner.state.items())
    after = train_step(ddp, opt, sched, _batch(1), ctx)  # the next step runs normally
    assert after.updated and after.loss_scale == 2.0**15 and sched.num_steps == steps + 1


def test_fp16_default_hysteresis_halves_on_the_second_overflow():
    """Megatron's default --hysteresis 2: the first overflow only skips, the second in a row also halves."""
    optim = OptimizerConfig(lr=1e-3, fp16=True, initial_loss_scale=2.0**16)
    ctx, model, ddp, opt, sched = _setup(torch.float16, optim)
    handle = model.decoder.layers[0].mlp.linear_fc1.weight.register_hook(lambda g: g * float("inf"))
    first = train_step(ddp, opt, sched, _batch(0), ctx)
    second = train_step(ddp, opt, sched, _batch(1), ctx)
    handle.remove()
    assert not first.updated and first.loss_scale == 2.0**16
    assert not second.updated and second.loss_scale == 2.0**15
    assert sched.num_steps == 0
