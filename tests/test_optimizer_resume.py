"""The optimizer's state through a checkpoint for optimizers that keep it their own way: apex's FusedAdam counts
Adam's steps per parameter group, not per parameter."""

from __future__ import annotations

import sys
import types

import torch

from megatron_lite.checkpoint.checkpointing import TrainState, load_checkpoint, save_checkpoint
from megatron_lite.config import ParallelConfig
from megatron_lite.models.gpt_model import build_model
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.optimizer.lr_scheduler import LRScheduler
from megatron_lite.optimizer.optimizer import MixedPrecisionOptimizer
from megatron_lite.parallel_context import ParallelContext

from models import CONFIGS


class FusedAdam(torch.optim.Optimizer):
    """apex.optimizers.FusedAdam's bookkeeping in plain PyTorch (apex is a CUDA build, not installable here): the
    step counter lives in the parameter group (apex: "assume same step across group"), the moments per
    parameter, no per-parameter step. The update is AdamW's."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, **_):  # fmt: skip
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            (b1, b2), t = group["betas"], group["step"]
            for p in group["params"]:
                st = self.state[p]
                if "exp_avg" not in st:
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = st["exp_avg"], st["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (v / (1 - b2**t)).sqrt_().add_(group["eps"])
                p.addcdiv_(m / (1 - b1**t), denom, value=-group["lr"])


def test_apex_fused_adam_resumes_its_step_count(tmp_path, monkeypatch):
    """--use-apex-adam: 3 steps, save, load into a fresh model, 2 more equal 5 straight. The checkpoint recorded
    step 0 (it read per-parameter steps only) and the loaded optimizer restarted its bias correction at 1."""
    apex = types.ModuleType("apex")
    apex.optimizers = types.ModuleType("apex.optimizers")
    apex.optimizers.FusedAdam = FusedAdam
    monkeypatch.setitem(sys.modules, "apex", apex)
    monkeypatch.setitem(sys.modules, "apex.optimizers", apex.optimizers)
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    config = OptimizerConfig(lr=1e-3, use_apex_adam=True, clip_grad=0.0)

    def make():
        model = build_model(CONFIGS["llama"](num_layers=1), ctx, seed=1, dtype=torch.float32)
        opt = MixedPrecisionOptimizer(model, lambda p: p.grad, config, ctx)
        assert type(opt.inner) is FusedAdam
        return model, opt

    def steps(model, opt, ks):
        for k in ks:
            gen = torch.Generator().manual_seed(k)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen) * 1e-2
            opt.step(1e-3)

    straight, opt = make()
    steps(straight, opt, range(7))
    first, opt = make()
    steps(first, opt, range(3))
    save_checkpoint(str(tmp_path), TrainState(3, 3), first, opt, LRScheduler(config, 7), ctx, {})
    resumed, opt = make()  # and again from the resumed run's own checkpoint (a stale step came back there)
    load_checkpoint(str(tmp_path / "iter_0000003"), resumed, opt, LRScheduler(config, 7), ctx)
    assert {g["step"] for g in opt.inner.param_groups if g["params"]} == {3}
    steps(resumed, opt, range(3, 5))
    save_checkpoint(str(tmp_path), TrainState(5, 5), resumed, opt, LRScheduler(config, 7), ctx, {})
    again, opt = make()
    load_checkpoint(str(tmp_path / "iter_0000005"), again, opt, LRScheduler(config, 7), ctx)
    assert {g["step"] for g in opt.inner.param_groups if g["params"]} == {5}
    steps(again, opt, range(5, 7))
    for (name, a), b in zip(straight.named_parameters(), again.parameters()):
        assert torch.equal(a, b), name
