"""GLM-4.5-style MoE (transformers' Glm4MoeForCausalLM, model_type glm4_moe: GLM-4.5, GLM-4.5-Air, GLM-4.6): what
its config.json means in our flags, what a ModelConfig must be to export to it, and its config.json fields. hf.py
dispatches here; the weights are the Llama family's attention (q/k/v_proj, o_proj) and DeepSeek-V3's MoE names
(mlp.gate with e_score_correction_bias, mlp.shared_experts, mlp.experts.{e}), mapped in hf_weights.py.

In Megatron's flags: grouped-query attention with head_dim (--kv-channels); attention_bias=true is a bias on
q/k/v_proj only, o_proj never has one (--add-qkv-bias with --disable-bias-linear); use_qk_norm is per-head RMSNorm
of queries and keys before RoPE (--qk-layernorm); partial_rotary_factor rotates the first int(head_dim x factor)
dims of each head, rotate-half within them (--rotary-percent; transformers' class default is 0.5, written always).
The router is DeepSeek-V3's (Glm4MoeTopkRouter): sigmoid scores, e_score_correction_bias added for the selection
only (--moe-router-enable-expert-bias), n_group / topk_group groups ranked by their top-2 scores, the selected
scores renormalised with norm_topk_prob, times routed_scaling_factor (--moe-router-topk-scaling-factor). Every
MoE layer has n_shared_experts x moe_intermediate_size of ungated shared expert; the first first_k_dense_replace
layers are dense MLPs of intermediate_size (a --moe-layer-freq pattern). num_nextn_predict_layers multi-token-
prediction layers follow the last layer in the checkpoints (transformers builds none and skips them on load):
DeepSeek-V3's layout (enorm, hnorm, eh_proj over [embedding; hidden], shared_head.norm, a full decoder layer),
converted as DeepSeek-V3's are (--mtp-num-layers).
"""

from __future__ import annotations

from typing import Any

from megatron_lite.config import ConfigError, ModelConfig
from megatron_lite.models.hf_deepseek import _group_score_topn, _moe_common, check_activation

GLM4_MOE = "Glm4MoeForCausalLM"


def config_kwargs(c: Any, partial: float) -> dict:
    """ModelConfig fields of a Glm4MoeConfig beyond those every grouped-query class reads alike (hf.py's), each
    that changes the math honoured, or refused. `partial`: its partial_rotary_factor, as hf.py reads it."""
    check_activation(c, GLM4_MOE)
    if getattr(c, "mlp_bias", False):
        raise ConfigError(f"config.json mlp_bias=true is not supported for {GLM4_MOE} (its MLPs have no bias)")
    kwargs: dict[str, Any] = dict(
        rotary_percent=partial,
        add_bias_linear=False,
        add_qkv_bias=bool(getattr(c, "attention_bias", False)),  # (q/k/v_proj only: o_proj has none)
        qk_layernorm=bool(getattr(c, "use_qk_norm", False)),
    )
    n, first_dense = c.num_hidden_layers, int(c.first_k_dense_replace or 0)
    if not c.n_routed_experts or first_dense >= n:  # (a dense model: no MoE layer to route)
        return kwargs
    norm, k = bool(getattr(c, "norm_topk_prob", True)), c.num_experts_per_tok
    if norm != (k > 1):  # (Megatron's sigmoid router renormalises a top-k of more than one, never a top-1)
        raise ConfigError(
            f"config.json norm_topk_prob={str(norm).lower()} with num_experts_per_tok={k} is not supported: the "
            "sigmoid router renormalises its top-k exactly when k > 1 (Megatron's)"
        )
    if not c.n_shared_experts:
        raise ConfigError(
            f"config.json n_shared_experts={c.n_shared_experts} is not supported for {GLM4_MOE}: transformers still "
            "builds and saves a shared expert of width 0, which has no Megatron form"
        )
    groups = c.n_group if (c.n_group or 1) > 1 else None
    kwargs.update(_moe_common(c))
    return kwargs | dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,  # e_score_correction_bias: it picks the experts, not their weights
        moe_router_num_groups=groups,
        moe_router_group_topk=c.topk_group if groups else None,
        moe_router_group_score_topn=_group_score_topn(k, c.topk_group, 2) if groups else None,  # (top-2 sums)
    )


def export_problems(c: ModelConfig) -> list[str]:
    """What Glm4MoeForCausalLM cannot express, beyond what hf.py checks for every class."""
    problems = []
    for bad, what in (
        (c.multi_latent_attention, "multi-latent attention (DeepSeek's)"),
        (c.normalization != "RMSNorm" or c.activation != "swiglu", "GLM-4-MoE is RMSNorm and SwiGLU"),
        (c.add_bias_linear, "biases on every linear layer (GLM-4-MoE has them on q/k/v_proj only: --add-qkv-bias)"),
        (c.sliding_window, "a sliding window (--window-size)"),
    ):
        if bad:
            problems.append(what)
    if not c.num_experts:
        return problems
    if c.moe_router_score_function != "sigmoid":
        problems.append("softmax routing (GLM-4-MoE routes by sigmoid scores: --moe-router-score-function sigmoid)")
    if c.moe_router_num_groups and (c.moe_router_group_score_topn or c.moe_router_topk // c.moe_router_group_topk) != 2:
        problems.append("groups ranked by other than their top 2 scores (transformers' GLM-4-MoE: top 2)")
    dense = [not m for m in c.moe_layers]
    k = dense.index(False) if False in dense else len(dense)
    if any(dense[k:]):
        problems.append("dense layers after the first MoE layer (GLM-4-MoE has first_k_dense_replace only)")
    shared = c.moe_shared_expert_intermediate_size
    if not shared or shared % c.moe_ffn_size:
        problems.append(f"a shared expert of {shared or 0} (GLM-4-MoE's: a positive multiple of --moe-ffn-hidden-size "
                        f"{c.moe_ffn_size})")  # fmt: skip
    if c.moe_shared_expert_gate:
        problems.append("a gated shared expert (--moe-shared-expert-gate; Qwen2-MoE's)")
    return problems


def config_fields(c: ModelConfig) -> dict:
    """config.json's GLM-4-MoE fields for `c` (its RoPE and partial_rotary_factor written by hf.py)."""
    first_dense = c.moe_layers.index(True) if c.num_experts and any(c.moe_layers) else c.num_layers
    shared = c.moe_shared_expert_intermediate_size
    return dict(
        attention_bias=c.add_qkv_bias,
        use_qk_norm=c.qk_layernorm,
        first_k_dense_replace=first_dense,
        n_routed_experts=c.num_experts or 1,
        num_experts_per_tok=c.moe_router_topk if c.num_experts else 1,
        moe_intermediate_size=c.moe_ffn_size,
        n_shared_experts=shared // c.moe_ffn_size if shared else 1,
        routed_scaling_factor=c.moe_router_topk_scaling_factor or 1.0,
        n_group=c.moe_router_num_groups or 1,
        topk_group=c.moe_router_group_topk or 1,
        norm_topk_prob=bool(c.num_experts) and c.moe_router_topk > 1,  # (a top-1 is not renormalised here)
        num_nextn_predict_layers=c.mtp_num_layers,
        output_router_logits=False,
    )
