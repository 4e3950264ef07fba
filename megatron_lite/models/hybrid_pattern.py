"""Which kind each layer of a hybrid Mamba model is (Megatron-Core's ssm/mamba_hybrid_layer_allocation.py), and the
start-up checks of a hybrid model's flags. No torch here: the config, the planner and the converters read it.

The symbols are Megatron's: M a Mamba-2 layer, * a self-attention layer, - an MLP layer, E a MoE layer. Each layer
is its own residual block with its own pre-norm (models/mamba.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_lite.config import ModelConfig

MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
SYMBOLS = (MAMBA, ATTENTION, MLP, MOE)


def allocate_auto(num_layers: int, attention_ratio: float, mlp_ratio: float) -> list[str]:
    """Megatron's rule: round(n x attention_ratio) attention layers spread evenly between Mamba sections (the
    stack starts and ends with Mamba), then round(n x mlp_ratio) of the Mamba layers turned MLP, spread evenly
    and right-justified."""
    attention = round(num_layers * attention_ratio)
    mamba = num_layers - attention
    section = mamba / (attention + 1)
    kinds = [MAMBA] * num_layers
    x = section
    for i in range(num_layers):
        if x < 0.5:
            kinds[i] = ATTENTION
            x += section
        else:
            x -= 1
    mlp = round(num_layers * mlp_ratio)
    if mlp > 0:
        per_mlp = (mamba - mlp) / mlp
        x = per_mlp
        for i in range(num_layers):
            if kinds[i] == MAMBA:
                if x < 0.5:
                    kinds[i] = MLP
                    x += per_mlp
                else:
                    x -= 1
    return kinds


def layer_types(c: ModelConfig) -> tuple[str, ...]:
    """Each decoder layer's symbol: --hybrid-override-pattern when given, else Megatron's allocation by
    --hybrid-attention-ratio and --hybrid-mlp-ratio (all Mamba when both are 0)."""
    if c.hybrid_override_pattern is not None:
        return tuple(c.hybrid_override_pattern)
    return tuple(allocate_auto(c.num_layers, c.hybrid_attention_ratio, c.hybrid_mlp_ratio))


def validate_hybrid(c: ModelConfig) -> None:
    """The start-up checks of a hybrid model's flags: one line naming the flag, its value and the fix."""
    from megatron_lite.config import ConfigError

    if not c.hybrid:
        return
    for flag, r in (("--hybrid-attention-ratio", c.hybrid_attention_ratio), ("--hybrid-mlp-ratio", c.hybrid_mlp_ratio)):
        if not 0.0 <= r <= 1.0:
            raise ConfigError(f"{flag} {r} must be in [0, 1]")
    if c.hybrid_attention_ratio + c.hybrid_mlp_ratio > 1.0:
        raise ConfigError(
            f"--hybrid-attention-ratio {c.hybrid_attention_ratio} + --hybrid-mlp-ratio {c.hybrid_mlp_ratio} exceeds "
            "1 (the rest are Mamba layers): lower one of them"
        )
    pattern = c.hybrid_override_pattern
    if pattern is not None:
        if len(pattern) != c.num_layers:
            raise ConfigError(
                f"--hybrid-override-pattern {pattern!r} has {len(pattern)} layers but --num-layers is {c.num_layers}: "
                f"give --num-layers {len(pattern)} or a pattern of {c.num_layers} symbols"
            )
        bad = sorted(set(pattern) - set(SYMBOLS))
        if bad:
            raise ConfigError(
                f"--hybrid-override-pattern {pattern!r} has {bad[0]!r}: use M (Mamba), * (attention), - (MLP), E (MoE)"
            )
        if c.hybrid_attention_ratio or c.hybrid_mlp_ratio:
            auto = allocate_auto(c.num_layers, c.hybrid_attention_ratio, c.hybrid_mlp_ratio)
            if any(auto.count(s) != pattern.count(s) for s in SYMBOLS):
                raise ConfigError(
                    f"--hybrid-override-pattern {pattern!r} does not have the layer counts of --hybrid-attention-ratio "
                    f"{c.hybrid_attention_ratio} --hybrid-mlp-ratio {c.hybrid_mlp_ratio} ({''.join(auto)}), as "
                    "Megatron requires: drop the ratios or match their counts"
                )
    kinds = c.layer_types
    if MOE in kinds and c.num_experts is None:
        raise ConfigError(f"--hybrid-override-pattern {pattern!r} has MoE layers (E): give --num-experts")
    for flag, value in (
        ("--mamba-state-dim", c.mamba_state_dim),
        ("--mamba-head-dim", c.mamba_head_dim),
        ("--mamba-num-groups", c.mamba_num_groups),
        ("--mamba-num-heads", 1 if c.mamba_num_heads is None else c.mamba_num_heads),
    ):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be a positive integer")
    if c.mamba_num_heads is None and (2 * c.hidden_size) % c.mamba_head_dim:
        raise ConfigError(
            f"--mamba-head-dim {c.mamba_head_dim} does not divide the Mamba inner size 2 x --hidden-size = "
            f"{2 * c.hidden_size}: give --mamba-num-heads or a head dim that divides it"
        )
    if c.mamba_heads % c.mamba_num_groups:
        raise ConfigError(
            f"--mamba-num-groups {c.mamba_num_groups} does not divide the {c.mamba_heads} Mamba heads "
            f"(--mamba-num-heads {c.mamba_num_heads}): use a number of groups that divides {c.mamba_heads}"
        )
    norm_regen = c.recompute_granularity == "selective" and "layernorm" in c.recompute_modules
    for flag, on in (
        ("--multi-latent-attention", c.multi_latent_attention),
        ("--mtp-num-layers", c.mtp_num_layers > 0),
        ("--apply-residual-connection-post-layernorm", c.apply_residual_connection_post_layernorm),
        ("--fp8-format", c.fp8 is not None),
        ("--recompute-modules layernorm", norm_regen),
    ):
        if on:
            raise ConfigError(f"{flag} is not supported with a hybrid Mamba model (--is-hybrid-model): drop {flag}")


def validate_hybrid_layout(c: ModelConfig, tp: int, cp: int) -> None:
    """Megatron's TP split of a Mamba mixer: whole heads and whole groups on each rank."""
    from megatron_lite.config import ConfigError

    if not c.hybrid or MAMBA not in c.layer_types:
        return
    if cp > 1:
        raise ConfigError(
            f"--context-parallel-size {cp} is not supported with Mamba layers (the scan is not split along the "
            "sequence here): use --context-parallel-size 1"
        )
    for flag, n in (("--mamba-num-groups", c.mamba_num_groups), ("Mamba heads (--mamba-num-heads)", c.mamba_heads)):
        if n % tp:
            raise ConfigError(
                f"{flag} {n} is not divisible by --tensor-model-parallel-size {tp}, as Megatron requires: use a "
                f"--tensor-model-parallel-size that divides {n}"
            )
