"""transformers' config classes by model type, and their defaults for the fields models/hf.py reads: a
config.json read without transformers installed (a field equal to its class default may be absent from it)."""

from __future__ import annotations

import types
from typing import Any

MODEL_TYPES_CLASSES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "qwen3_moe": "Qwen3MoeConfig",
    "qwen2_moe": "Qwen2MoeConfig",
    "nemotron": "NemotronConfig",
    "phi3": "Phi3Config",
    "mixtral": "MixtralConfig",
    "deepseek_v3": "DeepseekV3Config",
    "deepseek_v2": "DeepseekV2Config",
    "gpt_oss": "GptOssConfig",
    "glm4_moe": "Glm4MoeConfig",
    "llama4_text": "Llama4TextConfig",
    "gpt2": "GPT2Config",
}

# (tests/test_convert.py checks them against transformers)
_QWEN = dict(  # the Qwen family's shared defaults
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    hidden_act="silu",
    use_sliding_window=False,
    attention_dropout=0.0,
    max_position_embeddings=32768,
)
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        max_position_embeddings=2048,
    ),
    "mistral": dict(
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        sliding_window=4096,
        attention_dropout=0.0,
        max_position_embeddings=4096 * 32,
    ),
    "qwen2": _QWEN,
    "qwen3": dict(_QWEN, attention_bias=False, head_dim=128),
    "qwen3_moe": dict(
        _QWEN,
        attention_bias=False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    "qwen2_moe": dict(
        _QWEN,
        qkv_bias=True,
        num_experts=60,
        num_experts_per_tok=4,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_window_layers=28,
    ),
    "nemotron": dict(
        tie_word_embeddings=False,
        norm_eps=1e-5,
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        hidden_act="relu2",
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        max_position_embeddings=4096,
    ),
    "phi3": dict(
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        partial_rotary_factor=1.0,
        hidden_act="silu",
        sliding_window=None,
        attention_dropout=0.0,
        max_position_embeddings=4096,
    ),
    "mixtral": dict(
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        hidden_act="silu",
        sliding_window=None,
        attention_dropout=0.0,
        router_jitter_noise=0.0,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096 * 32,
    ),
    "deepseek_v3": dict(
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
        max_position_embeddings=4096,
        rope_interleave=True,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=3,
        norm_topk_prob=True,
    ),
    "deepseek_v2": dict(
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        max_position_embeddings=2048,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        moe_intermediate_size=1407,
        n_shared_experts=2,
        routed_scaling_factor=1.0,
        n_group=None,
        topk_group=None,
        topk_method="greedy",
        first_k_dense_replace=0,
    ),
    "gpt_oss": dict(
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
            "rope_theta": 150000.0,
        },  # fmt: skip
        attention_bias=True,
        attention_dropout=0.0,
        max_position_embeddings=131072,
        head_dim=64,
        sliding_window=128,
        num_local_experts=128,
        num_experts_per_tok=4,
        swiglu_limit=7.0,
        swiglu_alpha=1.702,
    ),
    "glm4_moe": dict(
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
        max_position_embeddings=131072,
        use_qk_norm=False,
        n_routed_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=1408,
        n_shared_experts=1,
        routed_scaling_factor=1.0,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        num_nextn_predict_layers=1,
    ),
    "llama4_text": dict(  # (no_rope_layers and moe_layers derived as transformers does: models/hf_llama4.py)
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
        max_position_embeddings=131072,
        head_dim=128,
        intermediate_size=8192,
        intermediate_size_mlp=16384,
        num_local_experts=16,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        no_rope_layer_interval=4,
        use_qk_norm=True,
        attention_chunk_size=8192,
        attn_temperature_tuning=True,
        floor_scale=8192,
        attn_scale=0.1,
    ),
    "gpt2": dict(
        tie_word_embeddings=True,
        n_inner=None,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        resid_pdrop=0.1,
        attn_pdrop=0.1,
        n_positions=1024,
    ),
}


def fallback_model_type(raw: dict) -> str | None:
    if raw.get("model_type") in HF_DEFAULTS:
        return raw["model_type"]
    from megatron_lite.models.hf import MODEL_TYPES

    archs = raw.get("architectures") or []
    return MODEL_TYPES.get(archs[0]) if archs else None


# config.json names transformers' classes write in place of the attribute (their `attribute_map`): 5.x saves
# Qwen3-MoE's expert count as num_local_experts
FALLBACK_ALIASES = {
    "qwen3_moe": {"num_local_experts": "num_experts"},
    "glm4_moe": {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"},
}


def fallback_config(raw: dict) -> Any:
    kind = fallback_model_type(raw) or ""
    aliased = {FALLBACK_ALIASES.get(kind, {}).get(k, k): v for k, v in raw.items()}
    return types.SimpleNamespace(**{**HF_DEFAULTS.get(kind, {}), **aliased})
