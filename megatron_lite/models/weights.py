"""Weights that do not depend on the layout: initialisation and full (layout-free) state dicts.

Every parameter is initialised from its own generator, seeded by (seed, global parameter name), by
building the full, unpadded tensor and cutting this rank's shard out of it. The same seed therefore
gives the same full weights at any TP size (and, with global layer numbers in the names, at any
pipeline split); vocabulary padding rows are zero and never touch the generator of real rows.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn

NameFn = Callable[[str], str]


def param_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}/{name}".encode())


def full_shape(p: nn.Parameter) -> tuple[int, ...]:
    spec = getattr(p, "shard_spec", None)
    return tuple(p.shape) if spec is None else spec.full_shape(p.shape)


def _full_init(p: nn.Parameter, name: str, seed: int) -> torch.Tensor:
    kind, *args = getattr(p, "init_method", ("normal", 0.02))
    shape = full_shape(p)
    if kind == "zeros":
        return torch.zeros(shape, device=p.device, dtype=torch.float32)
    if kind == "ones":
        return torch.ones(shape, device=p.device, dtype=torch.float32)
    if kind == "normal":
        gen = torch.Generator(device=p.device)
        gen.manual_seed(param_seed(seed, name))
        return torch.empty(shape, device=p.device, dtype=torch.float32).normal_(0.0, args[0], generator=gen)
    raise ValueError(f"unknown init method {kind!r} for {name}")


def to_shard(p: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of the full tensor `full` for parameter `p`."""
    spec = getattr(p, "shard_spec", None)
    return full if spec is None else spec.shard(full, p.shard_rank)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, global_name: NameFn = lambda n: n) -> None:
    for name, p in module.named_parameters():
        if p.is_meta:
            continue
        p.copy_(to_shard(p, _full_init(p, global_name(name), seed)))


@torch.no_grad()
def load_full_state_dict(
    module: nn.Module, state: dict[str, torch.Tensor], global_name: NameFn = lambda n: n
) -> None:
    """Load full, unpadded tensors (keyed by global names) into a module sharded any way."""
    params = {global_name(n): p for n, p in module.named_parameters()}
    missing = sorted(set(params) - set(state))
    if missing:
        raise KeyError(f"state dict lacks {len(missing)} parameters, e.g. {missing[:3]}")
    for name, p in params.items():
        full = state[name]
        if tuple(full.shape) != full_shape(p):
            raise ValueError(f"{name}: expected full shape {full_shape(p)}, got {tuple(full.shape)}")
        p.copy_(to_shard(p, full.to(device=p.device, dtype=torch.float32)))


def local_full_state_dict(module: nn.Module, global_name: NameFn = lambda n: n) -> dict[str, torch.Tensor]:
    """Full tensors from a module that is not sharded across ranks (TP = 1): padding trimmed."""
    out = {}
    for name, p in module.named_parameters():
        spec = getattr(p, "shard_spec", None)
        if spec is not None and spec.tp_size != 1:
            raise ValueError(f"{name} is sharded over {spec.tp_size} ranks; gather the shards instead")
        out[global_name(name)] = (p if spec is None else spec.unshard([p])).detach()
    return out
