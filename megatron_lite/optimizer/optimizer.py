"""AdamW on fp32 main weights, with global grad-norm clipping and fp16 loss scaling.

Model weights may be bf16/fp16; the optimizer then keeps fp32 main copies, steps them with fp32 gradients
(the data-parallel wrapper accumulates main gradients in fp32) and copies them back. With fp32 model
weights the main weights are the model weights.

The global grad norm counts every parameter exactly once: tensor-parallel shards on every TP rank,
replicated parameters on TP rank 0 only, summed over the model-parallel group (TP x PP). After the
data-parallel reduction all DP ranks hold the same gradients, so no DP reduction is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.config import ConfigError
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.parameters import named_param_meta

GradOf = Callable[[nn.Parameter], torch.Tensor]


@dataclass
class StepResult:
    updated: bool  # False when fp16 gradients overflowed and the step was skipped
    grad_norm: float | None  # before clipping; None on a skipped step
    loss_scale: float


def _adamw(groups, config: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    kw = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
    if config.use_apex_adam:
        try:
            from apex.optimizers import FusedAdam  # NVIDIA apex, optional
        except ImportError as e:
            raise ConfigError("--use-apex-adam needs NVIDIA apex installed (github.com/NVIDIA/apex)") from e
        return FusedAdam(groups, adam_w_mode=True, **kw)
    if device.type == "cuda":
        kw["fused"] = True
    return torch.optim.AdamW(groups, **kw)


class MixedPrecisionOptimizer:
    def __init__(self, model: nn.Module, grad_of: GradOf, config: OptimizerConfig, ctx: ParallelContext) -> None:
        self.config = config
        self.ctx = ctx
        self.grad_of = grad_of
        self.names, self.params, self.main_params, counted = [], [], [], []
        decay, no_decay = [], []
        for name, p, meta in named_param_meta(model):
            if not p.requires_grad:
                continue
            main = p if p.dtype == torch.float32 else p.detach().float().clone()
            self.names.append(name)
            self.params.append(p)
            self.main_params.append(main)
            counted.append((meta.tensor_parallel or ctx.tp.rank == 0) and not meta.embedding_copy)
            # No weight decay on norms and biases (the one-dimensional parameters), as in Megatron.
            (no_decay if p.ndim == 1 else decay).append(main)
        self._counted = counted
        groups = [
            {"params": decay, "weight_decay": config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        self.inner = _adamw([g for g in groups if g["params"]], config, self.params[0].device)
        if config.fp16:
            self.scaler = (
                ConstantGradScaler(config.loss_scale)
                if config.loss_scale
                else DynamicGradScaler(
                    config.initial_loss_scale,
                    config.min_loss_scale,
                    config.loss_scale_window,
                    config.hysteresis,
                )
            )
        else:
            self.scaler = None

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def _all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.ctx.mp.size > 1:
            dist.all_reduce(t, op=op, group=self.ctx.mp.pg)
        return t

    def grad_norm(self, grads: list[torch.Tensor]) -> float:
        mine = [g for g, c in zip(grads, self._counted) if c]
        if mine:
            sq = torch.stack([g.float().norm() for g in mine]).pow(2).sum()
        else:
            sq = torch.zeros((), device=grads[0].device)
        return float(self._all_reduce(sq.double()).sqrt())

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        grads = [self.grad_of(p) for p in self.params]
        if self.scaler is not None:
            inv = 1.0 / self.scaler.scale
            torch._foreach_mul_(grads, inv)
            found = torch.tensor(
                [0.0 if all(bool(torch.isfinite(g).all()) for g in grads) else 1.0], device=grads[0].device
            )
            if self._all_reduce(found, dist.ReduceOp.MAX).item() > 0:
                self.scaler.update(True)
                return StepResult(False, None, self.scaler.scale)
        norm = self.grad_norm(grads)
        if self.config.clip_grad > 0:
            coeff = self.config.clip_grad / (norm + 1e-6)
            if coeff < 1.0:
                torch._foreach_mul_(grads, coeff)
        for main, g in zip(self.main_params, grads):
            main.grad = g
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        for p, main in zip(self.params, self.main_params):
            main.grad = None  # the gradient is a view of the DP buffer; never let autograd accumulate into it
            if main is not p:
                p.copy_(main)
        if self.scaler is not None:
            self.scaler.update(False)
        return StepResult(True, norm, self.loss_scale)
