"""DeepSeek-V2/V3 (and Kimi-K2) Hugging Face configs: config.json to ModelConfig fields, what a ModelConfig must
be to export to them, and their config.json fields. hf.py dispatches here; the weights are in hf_weights.py."""

from __future__ import annotations

from typing import Any

from megatron_lite.config import ConfigError, ModelConfig

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
DEEPSEEK_V2 = "DeepseekV2ForCausalLM"  # (and V2-Lite): softmax routing, RoPE always on interleaved pairs
DEEPSEEK = (DEEPSEEK_V3, DEEPSEEK_V2)


def check_activation(c: Any, arch: str, act: str = "silu") -> None:
    """config.json's hidden_act must be `act` (hf.py's families too): "swish" is transformers' other name of silu
    (its ACT2FN: one function)."""
    given = getattr(c, "hidden_act", act)
    if {"swish": "silu"}.get(given, given) != act:
        raise ConfigError(f"config.json hidden_act {given!r} is not supported for {arch}; only {act}")


def config_kwargs(c: Any, arch: str, rope: tuple[float, Any]) -> dict:
    """ModelConfig fields of DeepSeek-V2/V3's config.json: multi-latent attention, then MoE layers after
    first_k_dense_replace dense ones. `rope`: its (base, RopeScaling) as hf.py reads them."""
    check_activation(c, arch)
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ConfigError(f"config.json attention_bias / mlp_bias=true is not supported for {arch}")
    if arch == DEEPSEEK_V2:
        return _base(c, rope, arch) | _v2_moe(c)
    wanted = (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"))
    bad = [f"{k}={getattr(c, k)!r}" for k, v in wanted if getattr(c, k, v) != v]  # (only the fields it has)
    if bad:
        raise ConfigError(
            f"config.json {' / '.join(bad)} is not supported: DeepSeek-V3's noaux_tc with sigmoid scores only"
        )
    norm, k = getattr(c, "norm_topk_prob", True), getattr(c, "num_experts_per_tok", 2) or 2
    if norm != (k > 1):  # (Megatron's sigmoid router renormalises a top-k of more than one, never a top-1)
        raise ConfigError(
            f"config.json norm_topk_prob={str(norm).lower()} with num_experts_per_tok={k} is not supported: the "
            "sigmoid router renormalises its top-k exactly when k > 1 (Megatron's)"
        )
    # (multi-token prediction: the converter reads num_nextn_predict_layers with the weights)
    kwargs = _base(c, rope, arch)
    n, first_dense = c.num_hidden_layers, int(c.first_k_dense_replace or 0)
    if c.n_routed_experts and first_dense < n:
        groups = c.n_group if (c.n_group or 1) > 1 else None
        kwargs.update(
            _moe_common(c),
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,  # e_score_correction_bias: it picks the experts, not their weights
            moe_router_num_groups=groups,
            moe_router_group_topk=c.topk_group if groups else None,
            # transformers' DeepSeek-V3 ranks groups by their top 2 scores
            moe_router_group_score_topn=_group_score_topn(c.num_experts_per_tok, c.topk_group, 2) if groups else None,
        )
    return kwargs


def _moe_common(c: Any) -> dict:
    n, first_dense = c.num_hidden_layers, int(c.first_k_dense_replace or 0)
    return dict(
        num_experts=c.n_routed_experts,
        moe_router_topk=c.num_experts_per_tok,
        moe_ffn_hidden_size=c.moe_intermediate_size,
        moe_router_topk_scaling_factor=float(c.routed_scaling_factor) if c.routed_scaling_factor != 1 else None,
        moe_shared_expert_intermediate_size=(c.moe_intermediate_size * c.n_shared_experts) or None,
        moe_layer_freq=1 if first_dense == 0 else tuple(int(i >= first_dense) for i in range(n)),
        moe_aux_loss_coeff=0.0,
    )


def _v2_moe(c: Any) -> dict:
    """DeepSeek-V2's router (transformers' DeepseekV2TopkRouter): the top-k of the softmax over all experts, not
    renormalised, times routed_scaling_factor; group_limited_greedy keeps the topk_group groups with the best
    single score."""
    n, first_dense = c.num_hidden_layers, int(c.first_k_dense_replace or 0)
    if not c.n_routed_experts or first_dense >= n:
        return {}
    method, k = getattr(c, "topk_method", "greedy"), c.num_experts_per_tok
    groups = None
    if method == "group_limited_greedy" and (c.n_group or 1) > 1:
        groups = c.n_group
    elif method not in ("greedy", "group_limited_greedy"):
        raise ConfigError(f"config.json topk_method={method!r} is not supported for {DEEPSEEK_V2}")
    return _moe_common(c) | dict(
        moe_router_score_function="softmax",
        moe_router_pre_softmax=True,  # softmax over all experts, top-k of it, no renormalisation
        moe_router_num_groups=groups,
        moe_router_group_topk=c.topk_group if groups else None,
        moe_router_group_score_topn=_group_score_topn(k, c.topk_group, 1) if groups else None,  # a group's best
    )


def _group_score_topn(k: int, group_topk: int, hf_rule: int) -> int | None:
    """The config's group-score rule: None where it is Megatron's (top k // group_topk), else transformers'."""
    return None if k // group_topk == hf_rule else hf_rule


# transformers builds DeepSeek's q/kv latent norms with their class default eps, not rms_norm_eps; Megatron (and we)
# use --norm-epsilon for every norm, so the two agree only at this value (that of every DeepSeek release)
LATENT_NORM_EPS = 1e-6


def _base(c: Any, rope: tuple[float, Any], arch: str) -> dict:
    base, scaling = rope
    if c.rms_norm_eps != LATENT_NORM_EPS:
        raise ConfigError(
            f"config.json rms_norm_eps={c.rms_norm_eps:g} is not supported: transformers runs DeepSeek's attention "
            f"latent norms at {LATENT_NORM_EPS:g} whatever rms_norm_eps says, and megatron_lite (as Megatron) uses "
            "one --norm-epsilon for every norm"
        )
    params = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    m_all = params.get("mscale_all_dim")
    if scaling is not None and scaling.rope_type != "yarn" and m_all and scaling.factor > 1:
        # (transformers scales the softmax by mscale(factor, mscale_all_dim)^2 under any scaled RoPE; Megatron's MLA
        # and ours under YaRN only)
        raise ConfigError(
            f"config.json mscale_all_dim={m_all:g} with rope_type {scaling.rope_type!r} is not supported for "
            f"{arch}; supported: mscale_all_dim with rope_type 'yarn' only"
        )
    n = c.num_hidden_layers
    kwargs: dict[str, Any] = dict(
        num_layers=n,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        kv_channels=c.qk_nope_head_dim,  # (as Megatron's DeepSeek scripts pass --kv-channels; MLA does not read it)
        ffn_hidden_size=c.intermediate_size,
        vocab_size=c.vocab_size,
        max_position_embeddings=c.max_position_embeddings,
        normalization="RMSNorm",
        norm_epsilon=c.rms_norm_eps,
        activation="swiglu",
        position_embedding_type="rope",
        rotary_base=base,
        rope_scaling=scaling,
        add_bias_linear=False,
        qk_layernorm=True,  # transformers normalises both latents (q's when there is one)
        multi_latent_attention=True,
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        qk_head_dim=c.qk_nope_head_dim,
        qk_pos_emb_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        mla_mscale_all_dim=float(params.get("mscale_all_dim") or 0.0) if scaling is not None else 0.0,
        untie_embeddings_and_output_weights=not c.tie_word_embeddings,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(c, "attention_dropout", 0.0)),
    )
    return kwargs


def _group_topn(c: ModelConfig) -> int:
    return c.moe_router_group_score_topn or c.moe_router_topk // c.moe_router_group_topk


def export_problems(c: ModelConfig, arch: str) -> list[str]:
    problems = []
    if arch == DEEPSEEK_V2 and c.num_experts:
        if c.moe_router_score_function != "softmax" or not c.moe_router_pre_softmax or c.moe_router_enable_expert_bias:
            problems.append("DeepSeek-V2 routes by the top-k of a softmax, not renormalised (--moe-router-pre-softmax)")
        if c.moe_router_num_groups and _group_topn(c) != 1:
            problems.append("group scores other than a group's best (DeepSeek-V2's group_limited_greedy)")
    if arch == DEEPSEEK_V3 and c.num_experts and c.moe_router_num_groups and _group_topn(c) != 2:
        problems.append(f"groups ranked by their top {_group_topn(c)} scores (transformers' DeepSeek-V3: top 2)")
    if not c.multi_latent_attention:
        problems.append("DeepSeek-V3 attention is multi-latent (--multi-latent-attention)")
    if not c.qk_layernorm:
        problems.append("DeepSeek-V3 normalises its attention latents (--qk-layernorm)")
    elif c.norm_epsilon != LATENT_NORM_EPS:
        problems.append(
            f"--norm-epsilon {c.norm_epsilon:g} on the attention latents (transformers' DeepSeek runs them at "
            f"{LATENT_NORM_EPS:g} whatever rms_norm_eps says)"
        )
    if c.normalization != "RMSNorm" or c.activation != "swiglu" or c.add_bias_linear:
        problems.append("DeepSeek-V3 is RMSNorm, SwiGLU, no biases")
    if c.num_experts:
        if c.moe_router_score_function != "sigmoid" and arch == DEEPSEEK_V3:
            problems.append("DeepSeek-V3 routes by sigmoid scores (--moe-router-score-function sigmoid)")
        dense = [not m for m in c.moe_layers]
        k = dense.index(False) if False in dense else len(dense)
        if any(dense[k:]):
            problems.append("dense layers after the first MoE layer (DeepSeek-V3 has first_k_dense_replace only)")
        shared = c.moe_shared_expert_intermediate_size
        if shared and shared % c.moe_ffn_size:
            problems.append(f"a shared expert of {shared} (a multiple of --moe-ffn-hidden-size {c.moe_ffn_size})")
    return problems


def rope_interleave_of(arch: str, base: dict | None) -> bool:
    """Whether `arch`'s weights hold DeepSeek's interleaved RoPE rows: V3 as `base` (the config.json the weights
    came with) says, interleaved without one, as DeepSeek's checkpoints are; V2 always (it has no flag)."""
    return arch != DEEPSEEK_V3 or bool((base or {}).get("rope_interleave", True))


def config_fields(c: ModelConfig, arch: str, interleave: bool = True) -> dict:
    """config.json fields of DeepSeek-V2/V3 for `c` (its RoPE parameters aside), with RoPE rows `interleave`d."""
    first_dense = c.moe_layers.index(True) if c.num_experts and any(c.moe_layers) else c.num_layers
    shared = c.moe_shared_expert_intermediate_size
    out = dict(
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_head_dim,
        qk_rope_head_dim=c.qk_pos_emb_head_dim,
        head_dim=c.qk_pos_emb_head_dim,  # (transformers' rotary dim for DeepSeek-V3)
        v_head_dim=c.v_head_dim,
        rope_interleave=interleave,  # (how the weights are written: DeepSeek's interleaved rows, or ours)
        attention_bias=False,
        first_k_dense_replace=first_dense,
        n_routed_experts=c.num_experts or 1,
        num_experts_per_tok=c.moe_router_topk if c.num_experts else 1,
        moe_intermediate_size=c.moe_ffn_size,
        n_shared_experts=shared // c.moe_ffn_size if shared else 0,
        routed_scaling_factor=c.moe_router_topk_scaling_factor or 1.0,
        n_group=c.moe_router_num_groups or 1,
        topk_group=c.moe_router_group_topk or 1,
        norm_topk_prob=bool(c.num_experts) and c.moe_router_topk > 1,  # (a top-1 is not renormalised here)
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        num_nextn_predict_layers=c.mtp_num_layers,
    )
    if arch == DEEPSEEK_V2:  # (always interleaved RoPE rows; softmax top-k routing)
        for k in ("rope_interleave", "scoring_func", "num_nextn_predict_layers"):
            out.pop(k)
        groups = c.moe_router_num_groups
        out.update(
            topk_method="group_limited_greedy" if groups else "greedy",
            n_group=groups,
            topk_group=c.moe_router_group_topk,
            norm_topk_prob=False,
        )
    return out
