"""The RoPE fields of a Hugging Face config.json (rope_parameters in transformers 5, rope_theta / rope_scaling in
4.x), read alike by every class with rotary positions (models/hf.py and its per-family modules)."""

from __future__ import annotations

from typing import Any

from megatron_lite.config import ConfigError, RopeScaling, yarn_mscale


def partial_rotary(hf_config: Any) -> float:
    """partial_rotary_factor: in rope_parameters (transformers 5) or at the top level (4.x, config.json)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0))


def rope_fields(hf_config: Any) -> tuple[float, RopeScaling | None]:
    """(rope_theta, its scaling) of a config.json."""
    # transformers 5 keeps RoPE settings in `rope_parameters`; 4.x in rope_theta / rope_scaling.
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    base = float(params.get("rope_theta", 10000.0))
    if kind == "default":
        return base, None
    # (transformers 5 moves a missing original length in from max_position_embeddings; its absence from the
    # config object, without transformers, means the same. One at the top level of config.json wins over the
    # RoPE dict's, as transformers 5's standardize_rope_params gives it priority (Phi-3's rule): the dict's had
    # been read, logits 22% off)
    original = getattr(hf_config, "original_max_position_embeddings", None) or params.get(
        "original_max_position_embeddings"
    )
    original = int(original or hf_config.max_position_embeddings)
    if kind == "llama3":
        return base, RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=original,
        )
    if kind == "yarn":
        factor = params.get("factor") or hf_config.max_position_embeddings / original  # (DeepSeek-V3's rule)

        attention_factor = params.get("attention_factor")
        if attention_factor is None:  # as transformers: the paper's 0.1 ln(s) + 1, or DeepSeek's mscale ratio
            m, m_all = params.get("mscale"), params.get("mscale_all_dim")
            attention_factor = (
                yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
            )
        return base, RopeScaling(
            factor=float(factor),
            original_max_position_embeddings=original,
            rope_type="yarn",
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            attention_factor=float(attention_factor),
            truncate=bool(params.get("truncate", True)),
        )
    raise ConfigError(f"config.json rope type {kind!r} is not supported; supported: default, llama3, yarn")
