"""Weights that do not depend on the layout: initialisation and full (layout-free) state dicts.

Every parameter is initialised from its own generator, seeded by (seed, global parameter name), by
building the full, unpadded tensor and cutting this rank's shard out of it. The same seed therefore
gives the same full weights at any TP size (and, with global layer numbers in the names, at any
pipeline split); vocabulary padding rows are zero and never touch the generator of real rows.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable

import torch
from torch import nn

from megatron_lite.parameters import ParamMeta, named_param_meta, set_param_meta

NameFn = Callable[[str], str]


def param_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}/{name}".encode())


def full_shape(p: torch.Tensor, meta: ParamMeta) -> tuple[int, ...]:
    return tuple(p.shape) if meta.shard is None else meta.shard.full_shape(p.shape)


def to_shard(full: torch.Tensor, meta: ParamMeta) -> torch.Tensor:
    """This rank's piece of a full tensor."""
    return full if meta.shard is None else meta.shard.shard(full, meta.shard_rank)


def _full_init(p: torch.Tensor, meta: ParamMeta, name: str, seed: int) -> torch.Tensor:
    kind, *args = meta.init
    shape = full_shape(p, meta)
    if kind == "zeros":
        return torch.zeros(shape, device=p.device, dtype=torch.float32)
    if kind == "ones":
        return torch.ones(shape, device=p.device, dtype=torch.float32)
    if kind == "normal":
        gen = torch.Generator(device=p.device)
        gen.manual_seed(param_seed(seed, name))
        return torch.empty(shape, device=p.device, dtype=torch.float32).normal_(0.0, args[0], generator=gen)
    if kind == "mamba_A_log":  # a Mamba head's A = -exp(A_log) with -A uniform in [lo, hi] (Megatron's (1, 16))
        gen = torch.Generator(device=p.device)
        gen.manual_seed(param_seed(seed, name))
        return torch.empty(shape, device=p.device, dtype=torch.float32).uniform_(*args, generator=gen).log()
    if kind == "mamba_dt_bias":  # softplus(dt_bias) log-uniform in [dt_min, dt_max], floored (Megatron's mixer)
        dt_min, dt_max, floor = args
        gen = torch.Generator(device=p.device)
        gen.manual_seed(param_seed(seed, name))
        u = torch.rand(shape, device=p.device, dtype=torch.float32, generator=gen)
        dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
        return dt + torch.log(-torch.expm1(-dt))  # (softplus's inverse)
    if kind == "xavier":  # --init-method-xavier-uniform: U(±sqrt(6 / (fan_in + fan_out))) of the full tensor
        fan_out, fan_in = shape[0], math.prod(shape[1:])
        args = [math.sqrt(6.0 / (fan_in + fan_out))]
        kind = "uniform"
    if kind == "uniform":  # U(-bound, bound): LoRA's A, as PEFT's kaiming_uniform(a=sqrt(5)) draws it
        gen = torch.Generator(device=p.device)
        gen.manual_seed(param_seed(seed, name))
        return torch.empty(shape, device=p.device, dtype=torch.float32).uniform_(-args[0], args[0], generator=gen)
    raise ValueError(f"unknown init method {kind!r} for {name}")


def xavier_instead_of_normal(module: nn.Module, keep_embeddings: bool = False) -> None:
    """Megatron's --init-method-xavier-uniform: every weight that would be drawn normal(0, std), embeddings and
    output layers included, is drawn from Xavier's uniform instead (its bound from the full tensor's fans);
    `keep_embeddings`: not the embeddings (and a tied copy of them), as Megatron keeps them normal when
    --embedding-init-method-std differs from --init-method-std."""
    for name, _, meta in named_param_meta(module):
        if keep_embeddings and ("embedding" in name or meta.embedding_copy):
            continue
        if meta.init[0] == "normal":
            owner, _, attr = name.rpartition(".")
            set_param_meta(module.get_submodule(owner), attr, dataclasses.replace(meta, init=("xavier",)))


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, global_name: NameFn = lambda n: n) -> None:
    for name, p, meta in named_param_meta(module):
        if not p.is_meta:
            p.copy_(to_shard(_full_init(p, meta, global_name(name), seed), meta))


@torch.no_grad()
def load_full_state_dict(module: nn.Module, state: dict[str, torch.Tensor], global_name: NameFn = lambda n: n) -> None:
    """Load full, unpadded tensors (keyed by global names) into a module sharded any way."""
    params = {global_name(n): (p, meta) for n, p, meta in named_param_meta(module)}
    missing = sorted(set(params) - set(state))
    if missing:
        raise KeyError(f"state dict lacks {len(missing)} parameters, e.g. {missing[:3]}")
    for name, (p, meta) in params.items():
        full = state[name]
        if tuple(full.shape) != full_shape(p, meta):
            raise ValueError(f"{name}: expected full shape {full_shape(p, meta)}, got {tuple(full.shape)}")
        p.copy_(to_shard(full.to(device=p.device, dtype=torch.float32), meta))


def local_full_state_dict(module: nn.Module, global_name: NameFn = lambda n: n) -> dict[str, torch.Tensor]:
    """Full tensors from a module that is not sharded across ranks (TP = 1): padding trimmed."""
    out = {}
    for name, p, meta in named_param_meta(module):
        if meta.tensor_parallel:
            raise ValueError(f"{name} is sharded over {meta.shard.tp_size} ranks; gather the shards instead")
        out[global_name(name)] = (p if meta.shard is None else meta.shard.unshard([p])).detach()
    return out
