"""Megatron's --optimizer muon: Muon (momentum orthogonalized by Newton-Schulz) on the 2-D weights of the hidden
layers, AdamW on everything else (norms, biases, the word embeddings and the output layer), with the usual
Adam flags, as Megatron-Core's get_megatron_muon_optimizer chains them.

The update is Megatron-Core's TensorParallelMuon over NVIDIA's emerging_optimizers OrthogonalizedOptimizer:
decoupled weight decay p -= lr * wd * p, the momentum buffer an EMA of the gradient (buf.lerp_(g, 1 - beta)),
with --muon-use-nesterov the update g.lerp(buf, beta) else buf, orthogonalized by Newton-Schulz with the
"quintic" coefficient sets (Frobenius-normalized first, the shorter side whitened), times the shape's scale
(--muon-scale-mode) and --muon-extra-scale-factor, then p -= lr * update.

Tensor parallelism (--muon-tp-mode): blockwise orthogonalizes each rank's shard alone (scaled by the shard's
shape); duplicated all-gathers the matrix, orthogonalizes it on every rank and keeps this rank's part;
distributed runs Newton-Schulz on the shards with the Gram matrix summed over TP. Duplicated and distributed
give the one-process update (a row or column permutation of the matrix, which is how our fused SwiGLU shards
concatenate, commutes with the orthogonalization). Expert weights use the expert tensor-parallel group.

With --muon-no-split-qkv unset (Megatron's default), the fused QKV weight is orthogonalized per part: our
layout is Megatron's (per query group: its query heads, with --attention-output-gate its gate heads, its key
head, its value head), so each part's rows of every group form one matrix.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lite.parallel_context import Group

# emerging_optimizers' Newton-Schulz coefficient sets (muon_utils._COEFFICIENT_SETS): "quintic" is the one
# Megatron-Core's TensorParallelMuon uses (its default; Megatron passes none); "simple" is Keller Jordan's,
# the set torch.optim.Muon uses, repeated every step.
COEFFICIENTS = {
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "simple": ((3.4445, -4.7750, 2.0315),),
}
MUON_FIELDS = (  # the flags' OptimizerConfig fields, named as Megatron's
    "muon_momentum",
    "muon_split_qkv",
    "muon_use_nesterov",
    "muon_scale_mode",
    "muon_fp32_matmul_prec",
    "muon_num_ns_steps",
    "muon_tp_mode",
    "muon_extra_scale_factor",
)
NS_EPS = 1e-7


def muon_scale_factor(rows: int, cols: int, mode: str) -> float:
    """emerging_optimizers' get_muon_scale_factor: the orthogonalized update's scale for a [rows, cols] matrix."""
    if mode == "shape_scaling":  # Keller Jordan's
        return max(1.0, rows / cols) ** 0.5
    if mode == "spectral":  # Kimi's (with an extra scale of 0.2 it matches AdamW's update RMS)
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":  # Scion's
        return (rows / cols) ** 0.5
    raise ValueError(f"unknown Muon scale mode {mode}")


@contextlib.contextmanager
def _matmul_precision(prec: str):
    """emerging_optimizers' fp32_matmul_precision. Megatron offers low|medium|high; torch knows no "low" (it warns
    and keeps the process's precision, fp32 by default), so low runs at the process's precision."""
    if prec == "low":
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(prec)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def newton_schulz(
    x: torch.Tensor, steps: int, coefficients: str = "quintic", tp: Group | None = None, transpose: bool = False
) -> torch.Tensor:
    """emerging_optimizers' newton_schulz on fp32 `x`: the shorter side whitened, X normalized by its Frobenius
    norm, `steps` iterations X <- a X + (b A + c A A) X with A = X X^T. Given `tp`, x is this rank's shard of the
    matrix, split along its columns after `transpose`: the norm and A are summed over `tp` (newton_schulz_tp's
    distributed mode). Under matmul precision "medium" X is taken to bf16 for the iterations, as
    emerging_optimizers does."""
    sets = COEFFICIENTS[coefficients]
    if steps % len(sets):
        raise ValueError(f"{steps} Newton-Schulz steps are not a multiple of the {len(sets)} {coefficients} sets")
    if tp is None:
        transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    if tp is None:
        X = torch.nn.functional.normalize(x, p=2, dim=(-2, -1), eps=NS_EPS)
    else:
        sq = (x * x).sum()
        with tp.blocked():
            dist.all_reduce(sq, group=tp.pg)
        X = x / sq.sqrt().clamp_min(NS_EPS)
    if torch.get_float32_matmul_precision() == "medium":
        X = X.to(torch.bfloat16)
    for i in range(steps):
        a, b, c = sets[i % len(sets)]
        A = X @ X.mT
        if tp is not None:
            with tp.blocked():
                dist.all_reduce(A, group=tp.pg)
        B = torch.addmm(A, A, A, alpha=c, beta=b)
        X = torch.addmm(X, B, X, alpha=1.0, beta=a)
    X = X.to(torch.float32)
    return X.mT if transpose else X


@dataclass(frozen=True)
class MuonParam:
    """What the Muon update needs to know of one (main) parameter."""

    name: str
    partition_dim: int | None = None  # the dimension tensor parallelism splits; None: whole on every rank
    tp: Group | None = None  # the group splitting it (the expert TP group for experts)
    qkv_split: tuple[int, ...] | None = None  # rows per query group of each fused QKV part, when split


class MuonWithAdam(torch.optim.Optimizer):
    """One optimizer over every group: those with "muon" set step as Muon, the rest through `adam` (AdamW over
    those same group dicts, sharing this optimizer's state), so learning rates, weight decay, state and
    checkpoints go through one param_groups / state as for Adam or SGD alone."""

    def __init__(
        self,
        groups: list[dict],
        adam_factory,
        info: dict[int, MuonParam],
        *,
        momentum: float,
        nesterov: bool,
        num_ns_steps: int,
        scale_mode: str,
        extra_scale_factor: float,
        fp32_matmul_prec: str,
        tp_mode: str,
        coefficients: str = "quintic",
    ) -> None:
        adam_groups = [g for g in groups if not g.get("muon")]
        self._adam = adam_factory(adam_groups) if adam_groups else None
        super().__init__(groups, {"lr": 0.0, "weight_decay": 0.0})
        if self._adam is not None:
            self._adam.state = self.state
        self.info = info  # by id(main parameter)
        self.momentum, self.nesterov, self.num_ns_steps = momentum, nesterov, num_ns_steps
        self.scale_mode, self.extra_scale_factor = scale_mode, extra_scale_factor
        self.fp32_matmul_prec, self.tp_mode, self.coefficients = fp32_matmul_prec, tp_mode, coefficients

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # (new group dicts and a new state: AdamW follows them)
        if self._adam is not None:
            self._adam.param_groups = [g for g in self.param_groups if not g.get("muon")]
            self._adam.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group.get("muon"):
                continue
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                if wd > 0.0:  # decoupled, before the update (emerging_optimizers' order)
                    p.add_(p, alpha=-wd * lr)
                buf.lerp_(p.grad, 1 - self.momentum)
                update = p.grad.lerp(buf, self.momentum) if self.nesterov else buf
                with _matmul_precision(self.fp32_matmul_prec):
                    update = self.orthogonalize(p, update)
                p.add_(update, alpha=-lr)
        if self._adam is not None:
            self._adam.step()
        return None

    def orthogonalize(self, p: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """Megatron's TensorParallelMuon.orthogonalize: the fused QKV weight part by part (each part's rows of
        every query group), any other matrix whole."""
        info = self.info[id(p)]
        if info.qkv_split is None:
            return self.scaled_orthogonalize(update, info)
        shape = update.shape
        groups = shape[0] // sum(info.qkv_split)
        parts = update.view(groups, sum(info.qkv_split), -1).split(list(info.qkv_split), dim=1)
        out = [self.scaled_orthogonalize(g.reshape(-1, shape[-1]), info).view(groups, -1, shape[-1]) for g in parts]
        return torch.cat(out, dim=1).view(shape)

    def scaled_orthogonalize(self, x: torch.Tensor, info: MuonParam) -> torch.Tensor:
        """x orthogonalized and scaled; under TP as --muon-tp-mode says (blockwise: the shard alone, scaled by
        its own shape, as Megatron passes no partition dimension then)."""
        dim = info.partition_dim if self.tp_mode != "blockwise" and info.tp is not None and info.tp.size > 1 else None
        size = list(x.shape)
        if dim is None:
            out = newton_schulz(x, self.num_ns_steps, self.coefficients)
        elif self.tp_mode == "duplicated":
            size[dim] *= info.tp.size
            shards = [torch.empty_like(x) for _ in range(info.tp.size)]
            with info.tp.blocked():
                dist.all_gather(shards, x.contiguous(), group=info.tp.pg)
            full = newton_schulz(torch.cat(shards, dim=dim), self.num_ns_steps, self.coefficients)
            out = full.chunk(info.tp.size, dim=dim)[info.tp.rank]
        else:  # distributed: the sharded side is the one X X^T sums over
            size[dim] *= info.tp.size
            out = newton_schulz(x, self.num_ns_steps, self.coefficients, tp=info.tp, transpose=dim == 0)
        return out * (muon_scale_factor(size[0], size[1], self.scale_mode) * self.extra_scale_factor)


def qkv_split_rows(heads_per_group: int, head_dim: int, gated: bool) -> tuple[int, ...]:
    """Rows per query group of each part of the fused QKV weight: queries, (--attention-output-gate) gates, key,
    value (models/attention.py's layout). Megatron splits [queries, key, value] and has no gated case."""
    q = heads_per_group * head_dim
    return (q, q, head_dim, head_dim) if gated else (q, head_dim, head_dim)
