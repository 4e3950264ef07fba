"""Adding LoRA adapters to a built model: which layers, in which layout, frozen base, layout-free init."""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.lora.adapters import LoRA
from megatron_lite.lora.config import (  # noqa: F401 - LoraConfig re-exported
    MLA_TARGETS,
    PARTS,
    TARGETS,
    LoraConfig,
    has_dense_mlp,
    layer_parts,
    lora_for_model,
)
from megatron_lite.models.weights import _full_init, full_shape, to_shard
from megatron_lite.moe.experts import ExpertMLP
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.parameters import named_param_meta, param_meta
from megatron_lite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


def _qkv_layout(config: ModelConfig, tp_size: int):
    groups = config.query_groups // tp_size
    per_group_q = config.num_attention_heads // config.query_groups * config.head_dim

    widths = {"q": per_group_q, "k": config.head_dim, "v": config.head_dim}

    def layout(outs: dict[str, torch.Tensor]) -> torch.Tensor:
        some = next(iter(outs.values()))
        lead = some.shape[:-1]
        # (a part not adapted adds zeros: --lora-target-modules q_proj v_proj leaves k alone)
        parts = [
            outs[n].view(*lead, groups, -1) if n in outs else some.new_zeros(*lead, groups, widths[n]) for n in "qkv"
        ]
        return torch.cat(parts, dim=-1).reshape(*lead, -1)  # per local group: its q heads, then k, then v

    return layout


def _fc1_layout(outs: dict[str, torch.Tensor]) -> torch.Tensor:
    some = next(iter(outs.values()))  # (gate and up are as wide; one not adapted adds zeros)
    return torch.cat([outs.get("gate", torch.zeros_like(some)), outs.get("up", torch.zeros_like(some))], dim=-1)


def _full_shape(module: nn.Module) -> tuple[int, ...]:
    """The full (unsharded) shape of a layer's weight: a shared expert's MLP is narrower than the dense one."""
    return full_shape(module.weight, param_meta(module, "weight"))


def _adapter(leaf: str, module: nn.Module, config: ModelConfig, lora: LoraConfig, tp, rng) -> LoRA:
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.query_groups * d
    out_full, in_full = _full_shape(module)  # the MLP's own width (dense or shared expert)
    kw = dict(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, tp=tp, rng=rng,
              device=module.weight.device, dtype=module.weight.dtype)  # fmt: skip
    if leaf == "linear_qkv":
        widths = {"q": q, "k": kv, "v": kv}
        outs = {n: widths[n] for n in layer_parts(lora, leaf)}
        return LoRA(h, outs, split="out", layout=_qkv_layout(config, tp.size), **kw)
    if leaf == "linear_fc1":
        if config.gated_linear_unit:
            f = out_full // 2
            return LoRA(h, dict.fromkeys(layer_parts(lora, leaf), f), split="out", layout=_fc1_layout, **kw)
        return LoRA(h, {"fc1": out_full}, split="out", **kw)
    if leaf == "linear_proj":
        return LoRA(in_full, {"proj": h}, split="in", **kw)  # (heads x head dim, or x v_head_dim under MLA)
    if leaf in MLA_TARGETS:  # one projection each, column-parallel (the down-projections' outputs gathered after)
        return LoRA(in_full, {leaf.removeprefix("linear_").removesuffix("_proj"): out_full}, split="out", **kw)
    return LoRA(in_full, {"fc2": h}, split="in", **kw)


def _expert_adapters(expert: ExpertMLP, config: ModelConfig, lora: LoraConfig, etp, rng, parts) -> None:
    """`parts`: "fc1" and/or "fc2", the expert's projections adapted."""
    h, f = config.hidden_size, config.moe_ffn_size
    w = expert.linear_fc1.weight
    kw = dict(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, tp=etp, device=w.device, dtype=w.dtype,
              expert=True, rng=rng)  # fmt: skip
    if "fc1" in parts:
        expert.linear_fc1.lora = LoRA(h, {"fc1": (f, f) if expert.gated else f}, split="out", **kw)
    if "fc2" in parts:
        expert.linear_fc2.lora = LoRA(f, {"fc2": h}, split="in", **kw)


def apply_lora(model: nn.Module, config: ModelConfig, lora: LoraConfig, ctx: ParallelContext, seed: int) -> int:
    """Freeze every weight of `model` (a GPTModel or its pipeline chunks) and add adapters to the target
    layers (not the multi-token-prediction depths'), initialised layout-free from `seed`. Returns the number of
    adapter parameters on this rank."""
    lora = lora_for_model(lora, config)
    mla = config.multi_latent_attention
    lora.validate(config.num_experts, ctx.parallel.tp_comm_overlap, mla, config.q_lora_rank is not None,
                  dense_mlp=has_dense_mlp(config))  # fmt: skip
    for p in model.parameters():
        p.requires_grad_(False)
    for name, module in list(model.named_modules()):
        if ".mtp." in f".{name}.":  # the MTP depths stay frozen: transformers' DeepSeek-V3 (PEFT's base) has none
            continue
        if isinstance(module, ExpertMLP) and (parts := layer_parts(lora, "experts")):
            _expert_adapters(module, config, lora, ctx.etp, ctx.rng, parts)
            continue
        leaf = name.rsplit(".", 1)[-1]
        targeted = leaf in lora.target_modules or (leaf in PARTS and layer_parts(lora, leaf) is not None)
        if not targeted or not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        module.lora = _adapter(leaf, module, config, lora, ctx.tp, ctx.rng)
    count = 0
    global_name = getattr(model, "global_name", lambda n: n)
    with torch.no_grad():
        for name, p, meta in named_param_meta(model):
            if ".lora." in name and not p.is_meta:
                p.copy_(to_shard(_full_init(p, meta, global_name(name), seed), meta))
                count += p.numel()
    return count
