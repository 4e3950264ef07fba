"""The start-up checks of a model's configuration alone (ModelConfig.validate and check_recompute_targets):
one-line ConfigErrors naming the flag, its value and the fix. Kept apart from the dataclass so that config.py
holds the fields and their derived values."""

from __future__ import annotations

import math

from megatron_lite.config import ACTIVATIONS, NORMALIZATIONS, POSITION_EMBEDDINGS, ConfigError, ModelConfig, divisors

MAX_LAYERS = 100_000  # the deepest models trained have a few hundred; a per-layer loop over 1e12 never ended
MAX_PARAMETERS = 10**14  # 100 trillion, fifty times the largest published models


def _check_size(c: ModelConfig) -> None:
    """A size no model has (a typo's extra digits): one line here, where it was a storage overflow's traceback
    in the build, or a loop over every layer that never ended (a flag fuzzer's finding). The count is rough (a
    layer's largest MLP, learned positions, input and output embeddings), a sanity bound, not the planner's."""
    if c.num_layers > MAX_LAYERS:
        raise ConfigError(f"--num-layers {c.num_layers} is beyond any model (at most {MAX_LAYERS}): check the flag")
    h, glu = c.hidden_size, 3 if c.activation in ("swiglu", "quick_geglu") else 2
    attention = 2 * h * c.head_dim * (c.num_attention_heads + c.query_groups)
    mlp = glu * h * c.ffn_size
    if c.num_experts:
        moe_ffn = c.moe_ffn_hidden_size if c.moe_ffn_hidden_size is not None else c.ffn_size
        mlp = max(mlp, glu * h * (c.num_experts * moe_ffn + (c.moe_shared_expert_intermediate_size or 0)))
    experts = f", --num-experts {c.num_experts}" if c.num_experts else ""
    layers = f"--num-layers {c.num_layers}, --hidden-size {h}, --ffn-hidden-size {c.ffn_size}{experts}"
    learned = c.position_embedding_type == "learned_absolute"
    parts = {  # (the flags each part's size comes from: the largest part's are named)
        layers: c.num_layers * (attention + mlp),
        f"--vocab-size {c.vocab_size} and --hidden-size {h}": 2 * c.vocab_size * h,
        f"--max-position-embeddings {c.max_position_embeddings} and --hidden-size {h}": learned
        * c.max_position_embeddings
        * h,
    }
    total = sum(parts.values())
    if total > MAX_PARAMETERS:
        flags = max(parts, key=parts.get)
        about = f"{total:.1e}" if total < 10**300 else f"1e+{len(str(total)) - 1}"  # (a float holds up to 1.8e308)
        raise ConfigError(
            f"{flags} make about {about} parameters, beyond any model (at most {MAX_PARAMETERS:.0e}): check the flags"
        )


def validate_model(c: ModelConfig) -> None:
    """Every start-up check of the model alone (ModelConfig.validate)."""
    for flag, value in (
        ("--num-layers", c.num_layers),
        ("--hidden-size", c.hidden_size),
        ("--num-attention-heads", c.num_attention_heads),
        ("--vocab-size", c.vocab_size),
        ("--ffn-hidden-size", c.ffn_size),
        ("--num-query-groups", c.query_groups),
        ("--max-position-embeddings", c.max_position_embeddings),
        ("--make-vocab-size-divisible-by", c.make_vocab_size_divisible_by),
        ("--kv-channels", 1 if c.kv_channels is None else c.kv_channels),
    ):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be a positive integer")
    _check_size(c)
    if not c.init_method_std >= 0:
        raise ConfigError(f"--init-method-std {c.init_method_std} must be >= 0")
    if c.embedding_init_method_std is not None and not c.embedding_init_method_std >= 0:  # (a traceback at init)
        raise ConfigError(f"--embedding-init-method-std {c.embedding_init_method_std} must be >= 0")
    # (an exploratory run's: both trained into a NaN loss at iteration 1, blamed on a gradient, not the flag)
    if not c.norm_epsilon >= 0:
        raise ConfigError(f"--norm-epsilon {c.norm_epsilon:g} must be >= 0 (Megatron's default: 1e-5)")
    if not c.rotary_base > 0:
        raise ConfigError(f"--rotary-base {c.rotary_base:g} must be positive (Megatron's default: 10000)")
    if c.kv_channels is None and c.hidden_size % c.num_attention_heads and not c.multi_latent_attention:
        raise ConfigError(
            f"--hidden-size {c.hidden_size} is not divisible by --num-attention-heads "
            f"{c.num_attention_heads}; pass --kv-channels explicitly or use heads in "
            f"{divisors(c.hidden_size)[-6:]}"
        )
    if c.num_attention_heads % c.query_groups:
        raise ConfigError(
            f"--num-attention-heads {c.num_attention_heads} is not divisible by --num-query-groups "
            f"{c.query_groups}; use --num-query-groups in {divisors(c.num_attention_heads)}"
        )
    if c.normalization not in NORMALIZATIONS:
        raise ConfigError(f"--normalization {c.normalization} is not supported; use one of {NORMALIZATIONS}")
    if c.activation not in ACTIVATIONS:
        raise ConfigError(f"activation {c.activation!r} is not supported; use one of {ACTIVATIONS}")
    _validate_glu(c)
    if c.position_embedding_type not in POSITION_EMBEDDINGS:
        raise ConfigError(
            f"--position-embedding-type {c.position_embedding_type} is not supported; use one of {POSITION_EMBEDDINGS}"
        )
    if c.position_embedding_type == "rope" and c.head_dim % 2 and not c.multi_latent_attention:
        raise ConfigError(f"rotary embeddings need an even head dim, got --kv-channels {c.head_dim}")
    in_range = 0.0 < c.rotary_percent <= 1.0  # (first: 1e308 overflowed the rotary dims' int, a bare OverflowError)
    odd_rotary = in_range and c.position_embedding_type == "rope" and c.rotary_dim % 2 and not c.multi_latent_attention
    if not in_range or odd_rotary:
        raise ConfigError(
            f"--rotary-percent {c.rotary_percent} must be in (0, 1] and rotate an even number of dims "
            f"(head dim {c.head_dim} x {c.rotary_percent} = {c.head_dim * c.rotary_percent:g})"
        )
    if c.rope_scaling is not None and c.rope_scaling.rope_type not in ("llama3", "yarn"):
        raise ConfigError(f"RoPE scaling type {c.rope_scaling.rope_type!r} is not supported; llama3 or yarn")
    if c.sliding_window is not None and c.sliding_window < 1:
        raise ConfigError(f"--window-size gives a sliding window of {c.sliding_window} tokens; it must be >= 1")
    from megatron_lite.models.attention_variants import validate_attention_variants

    validate_attention_variants(c)
    for flag, p in (
        ("--hidden-dropout", c.hidden_dropout),
        ("--attention-dropout", c.attention_dropout),
    ):
        if not 0.0 <= p < 1.0:
            raise ConfigError(f"{flag} {p} must be in [0, 1)")
    from megatron_lite.models.mla import validate_mla_config
    from megatron_lite.tensor_parallel.random import validate_recompute_config

    validate_recompute_config(c)
    from megatron_lite.moe.validation import validate_moe  # (the moe package imports config)

    validate_moe(c)
    validate_mla_config(c)
    from megatron_lite.models.qk_clip import validate_qk_clip

    validate_qk_clip(c)
    from megatron_lite.models.hybrid_pattern import validate_hybrid

    validate_hybrid(c)
    from megatron_lite.models.heterogeneous import validate_heterogeneous

    validate_heterogeneous(c)
    if c.mtp_num_layers < 0:
        raise ConfigError(f"--mtp-num-layers {c.mtp_num_layers} must be >= 0")
    if c.mtp_num_layers and c.position_embedding_type == "learned_absolute":  # (Megatron asserts the same; ours
        # fed a depth the shifted positions, 0 past the end: a rule no reference shares)
        raise ConfigError(
            f"--mtp-num-layers {c.mtp_num_layers} with learned absolute positions (Megatron's default "
            "--position-embedding-type, which it refuses with MTP): add --position-embedding-type rope"
        )
    if c.mtp_num_layers and c.mtp_loss_scaling_factor < 0:
        raise ConfigError(f"--mtp-loss-scaling-factor {c.mtp_loss_scaling_factor} must be >= 0")
    if c.kernel_impl not in ("torch", "triton"):
        raise ConfigError(f"--kernel-impl {c.kernel_impl} is not torch|triton")
    if c.fp8 is not None:
        from megatron_lite.tensor_parallel.fp8 import validate_fp8

        validate_fp8(c)


def _validate_glu(c: ModelConfig) -> None:
    # (Megatron applies both in its unfused GLU only, and its default fused SwiGLU ignores them: here they go
    # with --quick-geglu alone, where they mean one thing under either --kernel-impl)
    offset, clamp = c.glu_linear_offset, c.activation_func_clamp_value
    for flag, value, on in (("--glu-linear-offset", offset, offset != 0.0),
                            ("--activation-func-clamp-value", clamp, clamp is not None)):  # fmt: skip
        if on and c.activation != "quick_geglu":
            raise ConfigError(
                f"{flag} {value} applies to the quick-GELU gated unit only; add --quick-geglu or drop the flag "
                f"(the activation is {c.activation})"
            )
        if on and not math.isfinite(value):
            raise ConfigError(f"{flag} {value} must be a finite number")
    if clamp is not None and clamp <= 0:
        raise ConfigError(f"--activation-func-clamp-value {clamp} must be > 0 (gpt-oss: 7)")


def check_recompute_targets(c: ModelConfig) -> None:
    """--recompute-modules that name nothing in this model are refused (a start-up check of the user's
    flags: the model's own sub-configs, such as a shared expert's dense MLP, may carry them)."""
    if c.recompute_granularity != "selective":
        return
    dense = not c.num_experts or not all(c.is_moe_layer(i) for i in range(c.num_layers))
    if "mlp" in c.recompute_modules and not dense:
        raise ConfigError(
            "--recompute-modules mlp is a dense layer's MLP (as in Megatron) and every layer here is MoE; use moe"
        )
    for module, needs, what in (
        ("moe", c.num_experts, "--num-experts"),
        ("moe_act", c.num_experts, "--num-experts"),
        ("shared_experts", c.num_experts and c.moe_shared_expert_intermediate_size, "shared experts"),
        ("mla_up_proj", c.multi_latent_attention, "--multi-latent-attention"),
    ):
        if module in c.recompute_modules and not needs:
            raise ConfigError(f"--recompute-modules {module} has nothing to recompute without {what}; drop it")
