"""--use-precision-aware-optimizer (Megatron's flag) with --exp-avg-dtype / --exp-avg-sq-dtype: Adam's moments
stored in bf16 or fp16, the update in fp32. Checked against torch.optim.AdamW, under the distributed optimizer and
FSDP2 against one process, for memory, and through a checkpoint."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_train_equivalence import OPTIM, _compare, train_run

from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.optimizer.adam import PrecisionAwareAdamW
from megatron_lite.optimizer.config import OptimizerConfig

BF16 = dataclasses.replace(OPTIM, use_precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")


def _params(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(7, 5, generator=gen), torch.randn(11, generator=gen)]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(7, 5, generator=gen), torch.randn(11, generator=gen)]


def _groups(params):
    return [
        {"params": [params[0]], "weight_decay": 0.1, "lr": 3e-3},
        {"params": [params[1]], "weight_decay": 0.0, "lr": 1e-3},
    ]


def test_fp32_moments_compute_what_torch_adamw_computes():
    ours, ref = _params(0), _params(0)
    kw = dict(betas=(0.9, 0.95), eps=1e-8)
    opt = PrecisionAwareAdamW(_groups(ours), **kw)
    torch_opt = torch.optim.AdamW(_groups(ref), foreach=False, **kw)
    for step in range(6):
        for p, q, g in zip(ours, ref, _grads(step)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        torch_opt.step()
        for p, q in zip(ours, ref):
            assert torch.equal(p, q), step


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_low_precision_moments_are_torch_adamw_steps_from_the_stored_moments(dtype):
    """Each step equals torch.optim.AdamW's fp32 step taken from the stored moments read up to fp32, with the new
    moments then rounded to the storage dtype."""
    ours, ref = _params(1), _params(1)
    kw = dict(betas=(0.9, 0.95), eps=1e-8)
    opt = PrecisionAwareAdamW(_groups(ours), **kw, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
    moments = [(torch.zeros_like(p, dtype=dtype), torch.zeros_like(p, dtype=dtype)) for p in ref]
    for step in range(6):
        grads = _grads(step)
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        opt.step()
        torch_opt = torch.optim.AdamW(_groups(ref), foreach=False, **kw)
        for p, g, (m, v) in zip(ref, grads, moments):
            p.grad = g.clone()
            torch_opt.state[p] = {"step": torch.tensor(float(step)), "exp_avg": m.float(), "exp_avg_sq": v.float()}
        torch_opt.step()
        moments = [(torch_opt.state[p]["exp_avg"].to(dtype), torch_opt.state[p]["exp_avg_sq"].to(dtype)) for p in ref]
        for p, q, (m, v) in zip(ours, ref, moments):
            st = opt.state[p]
            assert st["exp_avg"].dtype == dtype and torch.equal(st["exp_avg"], m) and torch.equal(st["exp_avg_sq"], v)
            assert torch.equal(p, q), step


def test_moments_keep_their_dtype_through_load_state_dict():
    params = _params(2)
    opt = PrecisionAwareAdamW(_groups(params), exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    for p, g in zip(params, _grads(0)):
        p.grad = g
    opt.step()
    saved = opt.state_dict()
    fresh = PrecisionAwareAdamW(_groups(_params(2)), exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    fresh.load_state_dict(saved)
    for st, st0 in zip(fresh.state.values(), opt.state.values()):
        assert st["exp_avg"].dtype == torch.bfloat16 and torch.equal(st["exp_avg"], st0["exp_avg"])


LAYOUTS = {
    "dp2-distributed-optimizer": (2, ParallelConfig(), dict(distributed_optimizer=True)),
    "tp2-dp2-zero2": (4, ParallelConfig(tensor_model_parallel_size=2), dict(distributed_optimizer=True, zero_stage=2)),
    "dp2-fsdp2": (2, ParallelConfig(), dict(fsdp2=True)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_moments_train_like_one_process(dist, layout):
    world, parallel, kw = LAYOUTS[layout]
    ref = train_run("llama", ParallelConfig(), 8, 8, optim=BF16)
    fp32 = train_run("llama", ParallelConfig(), 8, 8)
    assert ref[-1][0] != fp32[-1][0]  # the bf16 moments are in effect
    for history in dist(world, train_run, "llama", parallel, 8, 2, optim=BF16, **kw):
        _compare(history, ref)


def test_bf16_moments_halve_adams_state():
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.training.wrap import wrap_for_training

    from models import llama_config

    sizes = {}
    for name, optim in (("fp32", OPTIM), ("bf16", BF16)):
        ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
        ctx.seed(0)
        model = build_model(llama_config(), ctx)
        ddp, opt = wrap_for_training(model, ctx, optim)
        for p in model.parameters():
            ddp.main_grad(p).normal_()
        opt.step(1e-3)
        n = sum(p.numel() for p in model.parameters())
        sizes[name] = opt.state_bytes()
        assert sizes[name] == n * (8 if name == "fp32" else 4)  # (fp32 weights: they are the main weights)


@pytest.mark.parametrize(
    "kw,fragment",
    [
        (dict(exp_avg_dtype="bf16"), "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
        (dict(use_precision_aware_optimizer=True, optimizer="sgd"), "drop it with --optimizer sgd"),
        (dict(use_precision_aware_optimizer=True, exp_avg_sq_dtype="fp8"), "--exp-avg-sq-dtype fp8 is not"),
        # g^2 (1 - beta2) underflows fp16 without Transformer Engine's per-tensor scale
        (dict(use_precision_aware_optimizer=True, exp_avg_sq_dtype="fp16"), "fp16 moments need per-tensor scaling"),
    ],
)
def test_bad_settings_are_one_line(kw, fragment):
    with pytest.raises(ConfigError, match=fragment):
        OptimizerConfig(**kw)


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--main-params-dtype", "fp16"], "--main-params-dtype fp16 is not supported"),
        (["--main-grads-dtype", "bf16"], "--main-grads-dtype bf16 needs --use-precision-aware-optimizer"),
        (["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"], "--main-grads-dtype bf16 needs --bf16"),
    ],
)
def test_megatron_main_dtype_flags(argv, fragment):
    from megatron_lite.arguments import parse_args

    base = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1".split()
    with pytest.raises(ConfigError, match=fragment):
        parse_args([*base, "--train-iters", "2", *argv])
    _, job = parse_args(
        [*base, "--train-iters", "2", "--bf16", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"]
    )
    assert job.optimizer.grad_reduce_in_bf16


def test_a_bf16_second_moment_with_a_slow_beta2_is_warned_about(capsys, monkeypatch):
    """v x 0.999 rounds back to v in bf16 (8 bits): the second moment would barely decay."""
    from megatron_lite.training.pretrain import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    argv = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
    argv += "--train-iters 2 --lr 1e-3 --mock-data --vocab-size 64 --use-precision-aware-optimizer "
    argv += "--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --adam-beta2 0.999"
    assert main(argv.split()) == 0
    assert "--adam-beta2 0.999 barely decays the second moment" in capsys.readouterr().out


def test_an_explicit_other_optimizer_on_resume_drops_the_checkpoints_bf16_moments(tmp_path, capsys, monkeypatch):
    from megatron_lite.arguments import parse_args
    from megatron_lite.training.pretrain import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    ckpt = str(tmp_path / "ckpt")
    argv = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
    argv += "--train-iters 2 --lr 1e-3 --mock-data --vocab-size 64 --use-precision-aware-optimizer "
    argv += f"--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --adam-beta2 0.95 --save {ckpt}"
    assert main(argv.split()) == 0
    _, job = parse_args(["--load", ckpt, "--train-iters", "4"])
    assert job.optimizer.use_precision_aware_optimizer and job.optimizer.exp_avg_dtype == "bf16"
    _, job = parse_args(["--load", ckpt, "--train-iters", "4", "--optimizer", "sgd"])
    assert job.optimizer.optimizer == "sgd" and not job.optimizer.use_precision_aware_optimizer
