"""Mixed precision: bf16 weights with fp32 main weights track the fp32 run; under fp16 an overflowing
gradient skips exactly that step (weights, moments and schedule untouched) and halves the loss scale; fp16 at
DP=2 (DDP and the distributed optimizer) equals one process, its loss scale and skipped steps included."""

from __future__ import annotations

import pytest
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


def fp16_run(iters: int, gbs: int, mbs: int, zero: bool, overflow_at: int | None = None):
    """fp16 weights with the dynamic loss scale (window 2: it grows during the run), under this process's world
    (one process, or the pool's ranks as DP); `overflow_at`: an inf in that iteration's gradient on the last
    rank only. Returns (lm_loss, grad_norm, loss_scale, updated) per iteration."""
    import torch.distributed as dist

    from megatron_lite.data.samplers import micro_batch_indices
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.training.wrap import wrap_for_training

    from dist_pool import get_context

    ctx = get_context(ParallelConfig()) if dist.is_initialized() else ParallelContext.virtual(ParallelConfig())
    ctx.seed(1234)
    model = build_model(llama_config(num_layers=2), ctx, seed=1234, dtype=torch.float16)
    optim = OptimizerConfig(lr=3e-3, clip_grad=1.0, fp16=True, initial_loss_scale=2.0**14, hysteresis=1,
                            loss_scale_window=2, use_distributed_optimizer=zero)  # fmt: skip
    ddp, opt = wrap_for_training(model, ctx, optim, overlap_grad_reduce=zero, bucket_size=3000 if zero else None)
    sched = LRScheduler(optim, iters)
    data = MockGPTDataset(250, 16, seed=7)
    # (a small parameter, held whole in one rank's shard under the distributed optimizer: only its owner sees the
    # inf after the reduce-scatter, so the ranks must agree on the skip; a large one spans both shards)
    last = [p for p in model.parameters() if p.requires_grad and p.dim() == 1][-1]
    history = []
    for it in range(iters):
        poison = it == overflow_at and ctx.dp.rank == ctx.dp.size - 1
        hook = last.register_hook(lambda g: g * float("inf")) if poison else None
        idx = micro_batch_indices(it * gbs, gbs, mbs, ctx.dp.rank, ctx.dp.size)
        m = train_step(ddp, opt, sched, [collate([data[i] for i in ix]) for ix in idx], ctx)
        if hook is not None:
            hook.remove()
        history.append((m.lm_loss, m.grad_norm, m.loss_scale, m.updated))
    return history


def test_fp16_at_dp2_equals_one_process(dist):
    """fp16 with the dynamic loss scale at DP=2 (plain DDP, and the distributed optimizer with overlapped
    reduction) equals one process per iteration: lm_loss, grad_norm, loss scale and whether it stepped. An
    overflow on one rank only skips the step on every rank and halves the scale as one process's overflow (under the
    distributed optimizer too, where only the inf parameter's owner sees it)."""
    ref = fp16_run(5, 4, 1, zero=False)  # (micro-batches of one everywhere: the same fp16 arithmetic per sample)
    assert [h[2] for h in ref] != [ref[0][2]] * 5  # (the scale does move in this run)
    for zero in (False, True):
        for history in dist(2, fp16_run, 5, 4, 1, zero):
            for a, b in zip(history, ref):
                assert a[3] == b[3] and a[2] == b[2], (zero, history, ref)
                # (fp16 weights: a main weight 1e-7 apart, from the sharded norm's summation order, can round to
                # the neighbouring fp16 value, 1e-3 away; the DDP run agrees to 1e-6, the distributed one to 2e-5)
                tol = 1e-4 if zero else 1e-5
                assert abs(a[0] - b[0]) <= tol * abs(b[0]) and abs(a[1] - b[1]) <= tol * abs(b[1]), (zero, a, b)
    for zero in (False, True):
        for history in dist(2, fp16_run, 4, 4, 1, zero, 2):
            assert [h[3] for h in history] == [True, True, False, True], (zero, history)
            assert history[2][2] == history[1][2] / 2, (zero, history)


@pytest.mark.parametrize("zero", [False, True], ids=["optimizer", "distributed_optimizer"])
def test_loss_scaling_adds_as_many_host_reads_to_a_step_whatever_the_parameter_count(zero):
    """The overflow check read each gradient's isfinite().all() on the host, one read per parameter (on a GPU the
    step then waited on each check before queueing the next); it is one fused unscale-and-check and one read. So
    a constant loss scale adds as many reads to the step of a model with twice the layers (the inner optimizer's
    own reads of its step counters aside), and the step still unscales: the same gradient norm as unscaled."""
    from host_reads import HostReads

    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.training.step import finalize_grads, forward_backward, global_token_count
    from megatron_lite.training.wrap import wrap_for_training

    reads, norms, scaled = {}, {}, []
    for layers in (2, 4):
        for scale in (None, 2.0**10):
            ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
            ctx.seed(0)
            # (bf16: Megatron takes a constant --loss-scale under fp16, bf16 or the distributed optimizer only)
            model = build_model(llama_config(num_layers=layers), ctx, seed=0, dtype=torch.bfloat16)
            optim = OptimizerConfig(lr=1e-3, clip_grad=1.0, bf16=True, use_distributed_optimizer=zero, loss_scale=scale)
            ddp, opt = wrap_for_training(model, ctx, optim, overlap_grad_reduce=zero, bucket_size=3000)
            mb = _batch(0)
            ddp.zero_grad_buffer()
            n = global_token_count(mb, ctx)[0]
            forward_backward(ddp, mb, n, opt.loss_scale / float(n))
            finalize_grads(ddp, ctx)
            with HostReads() as meter:
                result = opt.step(1e-3)
            assert result.updated
            reads[layers, scale], norms[layers, scale] = meter.reads, result.grad_norm
            scaled += [opt] if scale else []
    added = {layers: reads[layers, 2.0**10] - reads[layers, None] for layers in (2, 4)}
    assert added[2] == added[4] <= 1 and all(opt.scaler is not None for opt in scaled), (added, reads)
    for layers in (2, 4):
        assert norms[layers, 2.0**10] == pytest.approx(norms[layers, None], rel=1e-6)
