"""Megatron's --load-main-params-from-ckpt: with --no-load-optim, a --bf16 (or --fp16) run's fp32 main weights
come from the checkpoint's own main weights, not from the rounded model weights; the moments and the step count
start as a new run's. The oracle is the saving optimizer's main weights in memory, never read back through the
load being tested."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from megatron_lite.checkpoint.checkpointing import TrainState, load_checkpoint, save_checkpoint
from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.models.gpt_model import build_model
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.optimizer.lr_scheduler import LRScheduler
from megatron_lite.optimizer.optimizer import MixedPrecisionOptimizer
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.training.configs import CheckpointConfig

from models import CONFIGS

CONFIG = OptimizerConfig(lr=1e-2, clip_grad=0.0)


def _steps(model, opt, n: int) -> None:
    for k in range(n):  # (fixed gradients: the main weights move off the bf16 grid)
        gen = torch.Generator().manual_seed(k)
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
        opt.step(1e-2)


def _trained_and_saved(root):
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))

    def make(seed):
        model = build_model(CONFIGS["llama"](num_layers=1), ctx, seed=seed, dtype=torch.bfloat16)
        return model, MixedPrecisionOptimizer(model, lambda p: p.grad, CONFIG, ctx)

    model, opt = make(1)
    _steps(model, opt, 3)
    return ctx, make, model, opt


@pytest.mark.parametrize("flag", [True, False], ids=["flag", "without"])
def test_main_weights_come_from_the_checkpoint_not_the_bf16_weights(tmp_path, flag):
    ctx, make, model, opt = _trained_and_saved(tmp_path)
    path = save_checkpoint(str(tmp_path), TrainState(3, 3), model, opt, LRScheduler(CONFIG, 10), ctx, {})
    saved_main = [m.clone() for m in opt.main_params]
    model2, opt2 = make(2)
    load_checkpoint(path, model2, opt2, LRScheduler(CONFIG, 10), ctx, load_optim=False, load_main_params=flag)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)  # (the weights load either way)
    assert not opt2.inner.state and opt2.steps_taken == 0  # (no moments, a new run's step count, either way)
    rounded = [p.detach().float() for p in model2.parameters()]
    off = [not torch.equal(a, b) for a, b in zip(saved_main, rounded)]
    assert any(off)  # (the bf16 weights are not the main weights: the test can tell them apart)
    want = saved_main if flag else rounded
    for got, w in zip(opt2.main_params, want):
        assert torch.equal(got, w)


def test_a_checkpoint_without_main_weights_is_refused_in_one_line(tmp_path):
    ctx, make, model, opt = _trained_and_saved(tmp_path)
    path = save_checkpoint(
        str(tmp_path), TrainState(3, 3), model, opt, LRScheduler(CONFIG, 10), ctx, {}, save_optim=False
    )
    model2, opt2 = make(2)
    with pytest.raises(ConfigError, match=r"--load-main-params-from-ckpt: .* holds no fp32 main weights") as err:
        load_checkpoint(path, model2, opt2, None, ctx, load_optim=False, load_main_params=True)
    assert "\n" not in str(err.value)


def test_the_flag_needs_no_load_optim_as_in_megatron():
    with pytest.raises(ConfigError, match="--load-main-params-from-ckpt .* add --no-load-optim"):
        CheckpointConfig(load="ckpt", load_main_params_from_ckpt=True)
    assert CheckpointConfig(load="ckpt", load_main_params_from_ckpt=True, no_load_optim=True).no_load_optim


def _distributed(root: str, flag: bool, zero1: bool = True):
    """At DP=2 under the distributed optimizer (`zero1`: each rank's main-weight shards), or plain data
    parallelism with --ckpt-fully-parallel-load (the replicas each read half of the main weights, then exchange
    them): the main weights after the load against the saving optimizer's."""
    from test_train_equivalence import OPTIM

    from megatron_lite.data.mock import MockGPTDataset, collate
    from megatron_lite.data.samplers import micro_batch_indices
    from megatron_lite.training.step import train_step
    from megatron_lite.training.wrap import wrap_for_training

    from dist_pool import get_context
    from models import llama_config

    ctx = get_context(ParallelConfig())
    config = llama_config(num_layers=2)
    optim = dataclasses.replace(OPTIM, use_distributed_optimizer=zero1, lr=1e-2)

    def build(seed):
        model = build_model(config, ctx, seed=seed, dtype=torch.bfloat16)
        return (model, *wrap_for_training(model, ctx, optim))

    model, ddp, opt = build(1)
    data, sched = MockGPTDataset(config.vocab_size, 16, seed=1), LRScheduler(optim, 10)
    for it in range(3):  # (past the warmup's first, zero-LR step)
        idx = micro_batch_indices(it, 4, 1, ctx.dp.rank, ctx.dp.size)
        train_step(ddp, opt, sched, [collate([data[i] for i in ix]) for ix in idx], ctx)
    if hasattr(opt, "finish_param_sync"):
        opt.finish_param_sync()
    path = save_checkpoint(root, TrainState(2, 8), model, opt, LRScheduler(optim, 10), ctx, {})
    model2, _, opt2 = build(2)
    how, stats = dict(load_optim=False, load_main_params=flag, fully_parallel_load=not zero1), {}
    load_checkpoint(path, model2, opt2, LRScheduler(optim, 10), ctx, **how, stats=stats)
    if zero1:
        pairs = [(a.main, b.main, b.p.reshape(-1)[b.lo : b.hi]) for a, b in zip(opt.shards, opt2.shards)]
    else:
        pairs = list(zip(opt.main_params, opt2.main_params, opt2.params))
    same = all(torch.equal(a, b) for a, b, _ in pairs)
    rounded = all(torch.equal(b, p.float()) for _, b, p in pairs)
    stored = 0  # (the checkpoint's bytes of weights and main weights, as its indexes list them)
    for f in (f for f in os.listdir(path) if f.startswith("index_r")):
        for name, rec in json.load(open(os.path.join(path, f)))["tensors"].items():
            if name.startswith(("model/", "main/")):
                size = torch.empty(0, dtype=getattr(torch, rec["dtype"])).element_size()
                stored += sum(math.prod(pc["lengths"]) * size for pc in rec["pieces"])
    return same, rounded, opt2.steps_taken, stats["bytes_read"], stored


def test_distributed_optimizer_shards_take_the_checkpoints_main_weights(dist, tmp_path):
    flag = dist(2, _distributed, str(tmp_path / "flag"), True)
    without = dist(2, _distributed, str(tmp_path / "without"), False)
    assert all(same and not rounded and steps == 0 for same, rounded, steps, *_ in flag), flag
    assert all(rounded and not same for same, rounded, *_ in without), without


def test_replicated_main_weights_split_by_a_fully_parallel_load(dist, tmp_path):
    runs = dist(2, _distributed, str(tmp_path), True, False)
    assert all(same and not rounded and steps == 0 for same, rounded, steps, *_ in runs), runs
    assert sum(r[3] for r in runs) == runs[0][4], runs  # (the two replicas read the weights and main weights once)


def test_lora_adapters_on_a_base_checkpoint_and_an_fp32_run_load(tmp_path):
    """(From a review: a LoRA fine-tune's new adapters, which the base checkpoint lacks, stopped the load with a
    KeyError; an fp32 run, whose main weights are its weights and where Megatron ignores the flag, was refused on
    a checkpoint saved with --no-save-optim.)"""
    from megatron_lite.lora.apply import LoraConfig, apply_lora

    ctx, make, model, opt = _trained_and_saved(tmp_path)
    path = save_checkpoint(str(tmp_path), TrainState(3, 3), model, opt, None, ctx, {}, save_optim=False)
    config = CONFIGS["llama"](num_layers=1)
    lora = build_model(config, ctx, seed=2, dtype=torch.bfloat16)
    apply_lora(lora, config, LoraConfig(rank=4, alpha=8.0), ctx, seed=3)
    lora_opt = MixedPrecisionOptimizer(lora, lambda p: p.grad, CONFIG, ctx)
    load_checkpoint(path, lora, lora_opt, None, ctx, load_optim=False, finetune=True, load_main_params=True)
    trained = [p for p in lora.parameters() if p.requires_grad]
    assert trained and all(torch.equal(m, p.float()) for m, p in zip(lora_opt.main_params, lora_opt.params))
    fp32 = build_model(config, ctx, seed=2)
    fp32_opt = MixedPrecisionOptimizer(fp32, lambda p: p.grad, CONFIG, ctx)
    load_checkpoint(path, fp32, fp32_opt, None, ctx, load_optim=False, load_main_params=True)
    for p, q in zip(model.parameters(), fp32.parameters()):
        assert torch.equal(p.float(), q)
