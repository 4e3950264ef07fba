"""Nemotron-H (transformers' NemotronHForCausalLM, model_type nemotron_h): its config.json in our flags and back, and
its weights. hf.py and hf_weights.py dispatch here whole: no part of it is the Llama family's.

Each of its layers is one residual block, a norm and a mixer, of the kind its hybrid_override_pattern (transformers
5: layers_block_type) gives: M a Mamba-2 mixer (the same tensors as Megatron's MambaMixer: in_proj [z x B C dt],
conv1d, dt_bias, A_log, D, the gated norm, out_proj), * attention without positions (q/k/v_proj, o_proj), - an MLP
(up_proj, squared ReLU, down_proj), E a MoE (DeepSeek-V3's sigmoid router with its score-correction bias and group
limit, squared-ReLU experts without a gate, one shared expert of moe_shared_expert_intermediate_size). Refused: what
changes the math and has no Megatron form (another conv kernel or activation, biases, a dt clamp, a gated-norm eps
other than Megatron's 1e-5, MoE latent projections, MTP layers).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_lite.config import ConfigError, ModelConfig
from megatron_lite.models.hybrid_pattern import ATTENTION, MAMBA, MLP, MOE

NEMOTRON_H = "NemotronHForCausalLM"
_KINDS = {"linear_attention": MAMBA, "mamba": MAMBA, "full_attention": ATTENTION, "attention": ATTENTION, "mlp": MLP}
_KINDS["moe"] = MOE


def _pattern(c: Any) -> str:
    types = getattr(c, "layers_block_type", None)
    if types:
        return "".join(_KINDS[t] for t in types)
    return c.hybrid_override_pattern


def config_kwargs(c: Any) -> dict:
    """The ModelConfig fields of a NemotronHConfig beyond hf._gqa_fields'; what changes the math and has no form
    here is refused."""
    pattern = _pattern(c)
    eps = float(c.layer_norm_epsilon)
    limit = tuple(float(x) for x in (getattr(c, "time_step_limit", None) or (0.0, float("inf"))))
    for bad, what in (
        (c.conv_kernel != 4, f"conv_kernel={c.conv_kernel} (Megatron's mixer: 4)"),
        (not c.use_conv_bias, "use_conv_bias=false"),
        (c.mamba_hidden_act != "silu", f"mamba_hidden_act={c.mamba_hidden_act}"),
        (c.mlp_hidden_act != "relu2", f"mlp_hidden_act={c.mlp_hidden_act}"),
        (c.mamba_proj_bias or c.use_bias or c.mlp_bias or c.attention_bias, "biases (mamba_proj_bias, use_bias, ...)"),
        (limit != (0.0, float("inf")), f"time_step_limit={list(limit)} (Megatron's mixer does not clamp dt)"),
        (eps != 1e-5 and MAMBA in pattern, f"layer_norm_epsilon={eps:g} (Megatron's gated norm is fixed at 1e-5)"),
        (getattr(c, "moe_latent_size", None), "moe_latent_size (MoE latent projections)"),
        (getattr(c, "num_nextn_predict_layers", 0), "num_nextn_predict_layers (its MTP layers)"),
        (getattr(c, "sliding_window", None), "sliding_window"),
    ):
        if bad:
            raise ConfigError(f"config.json {what} is not supported for {NEMOTRON_H}")
    kwargs: dict[str, Any] = dict(  # (beside hf._gqa_fields: sizes, heads, RMSNorm, the output layer, dropout)
        num_layers=len(pattern),
        activation="squared_relu",
        position_embedding_type="none",
        add_bias_linear=False,
        is_hybrid_model=True,
        hybrid_override_pattern=pattern,
        mamba_state_dim=c.ssm_state_size,
        mamba_head_dim=c.mamba_head_dim,
        mamba_num_groups=c.n_groups,
        mamba_num_heads=c.mamba_num_heads,
    )
    if MOE not in pattern:
        return kwargs
    k = c.num_experts_per_tok
    if bool(c.norm_topk_prob) != (k > 1):  # (Megatron's sigmoid router renormalises a top-k of more than one only)
        raise ConfigError(
            f"config.json norm_topk_prob={c.norm_topk_prob} with num_experts_per_tok={k} is not supported"
        )
    groups = c.n_group if (c.n_group or 1) > 1 else None
    return kwargs | dict(
        num_experts=c.n_routed_experts,
        moe_router_topk=k,
        moe_ffn_hidden_size=c.moe_intermediate_size,
        moe_shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(c.routed_scaling_factor) if c.routed_scaling_factor != 1 else None,
        moe_router_num_groups=groups,
        moe_router_group_topk=c.topk_group if groups else None,
        moe_router_group_score_topn=(None if k // c.topk_group == 2 else 2) if groups else None,  # (top-2 sums)
        moe_aux_loss_coeff=0.0,
    )


def export_problems(c: ModelConfig) -> list[str]:
    """What NemotronHForCausalLM cannot express."""
    problems = []
    for bad, what in (
        (not c.hybrid, "a model without Mamba layers' pattern (--is-hybrid-model / --hybrid-override-pattern)"),
        (c.normalization != "RMSNorm", "LayerNorm (Nemotron-H is RMSNorm)"),
        (c.apply_layernorm_1p, "zero-centred norms (--apply-layernorm-1p)"),
        (c.activation != "squared_relu", f"activation {c.activation} (Nemotron-H's MLPs are squared ReLU)"),
        (c.position_embedding_type != "none", f"--position-embedding-type {c.position_embedding_type} (none)"),
        (c.add_bias_linear or c.add_qkv_bias, "biases"),
        (c.qk_layernorm or c.qk_l2_norm or c.sliding_window, "q/k norms or a sliding window"),
        (c.hybrid and MAMBA in c.layer_types and c.norm_epsilon != 1e-5, "--norm-epsilon other than 1e-5"),
        (c.num_experts and c.moe_router_score_function != "sigmoid", "a softmax router (Nemotron-H's is sigmoid)"),
        (c.num_experts and not c.moe_shared_expert_intermediate_size, "MoE without a shared expert"),
        (c.num_experts and c.moe_shared_expert_gate, "a gated shared expert"),
    ):
        if bad:
            problems.append(what)
    return problems


def config_fields(c: ModelConfig) -> dict:
    """config.json's Nemotron-H fields."""
    names = {MAMBA: "mamba", ATTENTION: "attention", MLP: "mlp", MOE: "moe"}
    out = dict(
        hidden_size=c.hidden_size,
        layers_block_type=[
            {"mamba": "linear_attention", "attention": "full_attention"}.get(names[s], names[s]) for s in c.layer_types
        ],
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.query_groups,
        head_dim=c.head_dim,
        intermediate_size=c.ffn_size,
        max_position_embeddings=c.max_position_embeddings,
        layer_norm_epsilon=c.norm_epsilon,
        mlp_hidden_act="relu2",
        mamba_hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        use_bias=False,
        mamba_proj_bias=False,
        use_conv_bias=True,
        conv_kernel=4,
        ssm_state_size=c.mamba_state_dim,
        mamba_head_dim=c.mamba_head_dim,
        mamba_num_heads=c.mamba_heads,
        n_groups=c.mamba_num_groups,
        tie_word_embeddings=c.tied_embeddings,
        attention_dropout=c.attention_dropout,
        num_nextn_predict_layers=0,
        moe_latent_size=None,
    )
    for legacy in ("num_hidden_layers", "hybrid_override_pattern", "rms_norm_eps", "rope_parameters", "rope_theta"):
        out[legacy] = None
    if c.num_experts:
        out.update(
            n_routed_experts=c.num_experts,
            num_experts_per_tok=c.moe_router_topk,
            moe_intermediate_size=c.moe_ffn_size,
            moe_shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size,
            n_shared_experts=1,
            norm_topk_prob=c.moe_router_topk > 1,
            routed_scaling_factor=c.moe_router_topk_scaling_factor or 1.0,
            n_group=c.moe_router_num_groups or 1,
            topk_group=c.moe_router_group_topk or 1,
        )
    return out


def _pairs(c: ModelConfig, i: int) -> list[tuple[str, str]]:
    """(our name, theirs) of layer i's tensors, after `decoder.layers.{i}.` and `model.layers.{i}.`."""
    kind = c.layer_types[i]
    if kind == MAMBA:
        mixer = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight")
        return [("norm.weight", "norm.weight")] + [(f"mixer.{n}", f"mixer.{n}") for n in (*mixer, "out_proj.weight")]
    if kind == ATTENTION:
        return [
            ("input_layernorm.weight", "norm.weight"),
            ("self_attention.linear_proj.weight", "mixer.o_proj.weight"),
        ]  # (q/k/v: grouped, below)
    out = [("pre_mlp_layernorm.weight", "norm.weight")]
    if kind == MLP:
        return out + [
            ("mlp.linear_fc1.weight", "mixer.up_proj.weight"),
            ("mlp.linear_fc2.weight", "mixer.down_proj.weight"),
        ]
    return out + [
        ("mlp.router.weight", "mixer.gate.weight"),
        ("mlp.router.expert_bias", "mixer.gate.e_score_correction_bias"),
        ("mlp.shared_expert.linear_fc1.weight", "mixer.shared_experts.up_proj.weight"),
        ("mlp.shared_expert.linear_fc2.weight", "mixer.shared_experts.down_proj.weight"),
    ]


def state_dict_from_hf(hf: dict[str, torch.Tensor], c: ModelConfig) -> dict[str, torch.Tensor]:
    """From transformers' module names (model., experts fused [E, out, in]) or a checkpoint file's (backbone.,
    experts.{e}.up_proj / down_proj)."""
    from megatron_lite.models.hf_weights import _group_qkv

    if "backbone.embeddings.weight" in hf:
        hf = {("model." + k[len("backbone.") :] if k.startswith("backbone.") else k): v for k, v in hf.items()}
    out = {"embedding.word_embeddings.weight": hf["model.embeddings.weight"]}
    for i in range(c.num_layers):
        o, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        for ours, theirs in _pairs(c, i):
            if p + theirs in hf:  # (a gradient has no score-correction bias)
                out[o + ours] = hf[p + theirs]
        if c.layer_types[i] == ATTENTION:
            q, k, v = (hf[f"{p}mixer.{n}_proj.weight"] for n in "qkv")
            out[o + "self_attention.linear_qkv.weight"] = _group_qkv(q, k, v, c.query_groups)
        if c.layer_types[i] == MOE:
            fused = p + "mixer.experts.up_proj" in hf
            for e in range(c.num_experts):
                for fc, proj in (("linear_fc1", "up_proj"), ("linear_fc2", "down_proj")):
                    w = hf[f"{p}mixer.experts.{proj}"][e] if fused else hf[f"{p}mixer.experts.{e}.{proj}.weight"]
                    out[f"{o}mlp.experts.{e}.{fc}.weight"] = w
    out["decoder.final_layernorm.weight"] = hf["model.norm_f.weight"]
    if not c.tied_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def state_dict_to_hf(ours: dict[str, torch.Tensor], c: ModelConfig, on_disk: bool = False) -> dict[str, torch.Tensor]:
    """transformers' module names, or with `on_disk` those save_pretrained writes (backbone., experts one by one)."""
    from megatron_lite.models.hf_weights import _ungroup_qkv

    hf = {"model.embeddings.weight": ours["embedding.word_embeddings.weight"]}
    for i in range(c.num_layers):
        o, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        for mine, theirs in _pairs(c, i):
            if o + mine in ours:
                hf[p + theirs] = ours[o + mine]
            elif mine == "mlp.router.expert_bias":  # (a model trained without it: transformers' zeros)
                hf[p + theirs] = torch.zeros(c.num_experts)
        if c.layer_types[i] == ATTENTION:
            q, k, v = _ungroup_qkv(ours[o + "self_attention.linear_qkv.weight"], c)
            hf[p + "mixer.q_proj.weight"], hf[p + "mixer.k_proj.weight"], hf[p + "mixer.v_proj.weight"] = q, k, v
        if c.layer_types[i] == MOE:
            for fc, proj in (("linear_fc1", "up_proj"), ("linear_fc2", "down_proj")):
                w = [ours[f"{o}mlp.experts.{e}.{fc}.weight"] for e in range(c.num_experts)]
                if on_disk:
                    hf.update({f"{p}mixer.experts.{e}.{proj}.weight": x for e, x in enumerate(w)})
                else:
                    hf[f"{p}mixer.experts.{proj}"] = torch.stack(w)
    hf["model.norm_f.weight"] = ours["decoder.final_layernorm.weight"]
    # (lm_head.weight tied or not: transformers 5's NemotronHForCausalLM ties nothing, and an export of a tied model
    # without it loaded a random output layer, an exploratory run found)
    head = ours.get("output_layer.weight")
    hf["lm_head.weight"] = head if head is not None else ours["embedding.word_embeddings.weight"].clone()  # (a file
    # holds no two names of one tensor)
    if on_disk:
        hf = {("backbone." + k[len("model.") :] if k.startswith("model.") else k): v for k, v in hf.items()}
    return {k: v.contiguous() for k, v in hf.items()}
