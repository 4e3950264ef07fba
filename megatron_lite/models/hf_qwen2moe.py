"""Qwen2-MoE (transformers' Qwen2MoeForCausalLM, model_type qwen2_moe): what its config.json means in our flags,
what a ModelConfig must be to export to it, its config.json fields and its shared expert's weights. hf.py
dispatches here for the MoE parts; attention, norms and RoPE are the Llama family's (hf.py), with Qwen2's QKV
bias (qkv_bias, true unless said otherwise: transformers 4.x always had it).

Its MoE block: a softmax over all experts, the top-k of it, renormalised only with norm_topk_prob (false: our
--moe-router-pre-softmax; true: our default top-k softmax, the same numbers), plus one shared expert
(shared_expert_intermediate_size) gated by sigmoid(shared_expert_gate(x)) (--moe-shared-expert-gate). Layers
(i + 1) % decoder_sparse_step == 0 not in mlp_only_layers are MoE, the others dense MLPs of intermediate_size: a
--moe-layer-freq pattern. router_aux_loss_coef is transformers' training loss (added only with
output_router_logits, and k times Megatron's for the same coefficient), not the weights' math: as for Mixtral
and Qwen3-MoE, the auxiliary loss is left to the training flags.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_lite.config import ConfigError, ModelConfig

QWEN2_MOE = "Qwen2MoeForCausalLM"


def config_kwargs(c: Any) -> dict:
    """ModelConfig fields of the MoE block and the QKV bias (the rest is read as for Qwen2)."""
    layers = c.num_hidden_layers
    types = getattr(c, "layer_types", None)
    if types is None and getattr(c, "use_sliding_window", False):
        # (transformers' rule where config.json lists no layer_types: windows on the even layers below
        # max_window_layers)
        first = int(getattr(c, "max_window_layers", 28))
        types = ["sliding_attention" if i % 2 == 0 and i < first else "full_attention" for i in range(layers)]
    if types and any(t != "full_attention" for t in types):
        raise ConfigError(
            f"config.json use_sliding_window=true (layer_types {sorted(set(types))}) is not supported for "
            f"{QWEN2_MOE}: windows on some layers only; supported: use_sliding_window=false"
        )
    step, dense = int(getattr(c, "decoder_sparse_step", 1) or 1), set(getattr(c, "mlp_only_layers", None) or [])
    pattern = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))
    out = dict(add_qkv_bias=bool(getattr(c, "qkv_bias", True)))
    if not c.num_experts or not any(pattern):  # (a dense model: Qwen2 with or without the QKV bias)
        return out
    shared = int(getattr(c, "shared_expert_intermediate_size", 0) or 0)
    if shared < 1:
        raise ConfigError(
            f"config.json shared_expert_intermediate_size={shared} is not supported for {QWEN2_MOE}: a shared "
            "expert of width 0 (its gate still stored) has no Megatron form"
        )
    return out | dict(
        num_experts=c.num_experts,
        moe_router_topk=c.num_experts_per_tok,
        moe_ffn_hidden_size=c.moe_intermediate_size,
        moe_router_pre_softmax=not c.norm_topk_prob,
        moe_layer_freq=1 if all(pattern) else pattern,
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=True,
        moe_aux_loss_coeff=0.0,
    )


def export_problems(c: ModelConfig) -> list[str]:
    """What Qwen2-MoE cannot express, beyond what hf.py checks for every Llama-family class."""
    problems = []
    if not c.num_experts:
        problems.append("no experts (--num-experts)")
    elif not c.moe_shared_expert_intermediate_size or not c.moe_shared_expert_gate:
        problems.append("a MoE layer without a gated shared expert (Qwen2-MoE always has one)")
    for bad, what in (
        (c.qk_layernorm, "q/k norms (--qk-layernorm)"),
        (c.sliding_window, "a sliding window (--window-size)"),
    ):
        if bad:
            problems.append(what)
    return problems


def config_fields(c: ModelConfig) -> dict:
    """config.json's Qwen2-MoE fields: the MoE layers listed by mlp_only_layers, with decoder_sparse_step 1."""
    return dict(
        qkv_bias=c.add_qkv_bias,
        num_experts=c.num_experts,
        num_experts_per_tok=c.moe_router_topk,
        moe_intermediate_size=c.moe_ffn_size,
        shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size,
        norm_topk_prob=not c.moe_router_pre_softmax,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(c.num_layers) if not c.is_moe_layer(i)],
        output_router_logits=False,
    )


def shared_from_hf(hf: dict, p: str, ours: str) -> dict:
    """Layer prefix `p`'s shared expert (gate_proj, up_proj, down_proj) and its gate ([1, hidden], as ours)."""
    s = p + "mlp.shared_expert."
    return {
        f"{ours}.shared_expert.linear_fc1.weight": torch.cat([hf[s + "gate_proj.weight"], hf[s + "up_proj.weight"]]),
        f"{ours}.shared_expert.linear_fc2.weight": hf[s + "down_proj.weight"],
        f"{ours}.shared_expert.gate_weight": hf[p + "mlp.shared_expert_gate.weight"],
    }


def shared_to_hf(ours: dict, m: str, p: str) -> dict:
    """The inverse of shared_from_hf."""
    gate, up = ours[f"{m}.shared_expert.linear_fc1.weight"].chunk(2, dim=0)
    s = p + "mlp.shared_expert."
    return {
        s + "gate_proj.weight": gate,
        s + "up_proj.weight": up,
        s + "down_proj.weight": ours[f"{m}.shared_expert.linear_fc2.weight"],
        p + "mlp.shared_expert_gate.weight": ours[f"{m}.shared_expert.gate_weight"],
    }
