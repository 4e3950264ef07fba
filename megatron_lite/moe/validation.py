"""The mixture-of-experts checks of ModelConfig (config.py calls them from validate()): routing, capacity,
layer pattern, and the expert MLP's biases and activation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_lite.config import ConfigError

if TYPE_CHECKING:
    from megatron_lite.config import ModelConfig


def validate_moe(c: ModelConfig) -> None:
    if c.moe_shared_expert_gate and not (c.num_experts and c.moe_shared_expert_intermediate_size):
        raise ConfigError(
            "--moe-shared-expert-gate gates the MoE layers' shared expert and this model has none: add "
            "--num-experts and --moe-shared-expert-intermediate-size, or drop the flag"
        )
    if c.num_experts is None:
        for flag, on in (
            ("--moe-input-jitter-eps", c.moe_input_jitter_eps is not None),
            ("--moe-router-force-load-balancing", c.moe_router_force_load_balancing),
            ("--moe-pad-expert-input-to-capacity", c.moe_pad_expert_input_to_capacity),
            ("--moe-apply-probs-on-input", c.moe_apply_probs_on_input),
        ):
            if on:
                raise ConfigError(
                    f"{flag} acts on the MoE layers and this model has none: add --num-experts or drop it"
                )
        return
    e, k = c.num_experts, c.moe_router_topk
    if e < 1:
        raise ConfigError(f"--num-experts {e} must be >= 1 (0, or no flag, is a dense model)")
    for flag, value, fix in (
        ("--moe-ffn-hidden-size", c.moe_ffn_hidden_size, ""),
        ("--moe-shared-expert-intermediate-size", c.moe_shared_expert_intermediate_size,
         " (drop it for no shared expert)"),
    ):  # fmt: skip
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value} must be a positive integer{fix}")
    if not 1 <= k <= e:
        raise ConfigError(f"--moe-router-topk {k} must be between 1 and --num-experts {e}")
    if c.moe_router_score_function not in ("softmax", "sigmoid"):
        raise ConfigError(f"--moe-router-score-function {c.moe_router_score_function} is not softmax|sigmoid")
    if c.add_bias_linear and c.moe_shared_expert_intermediate_size:  # (Megatron's SharedExpertMLP asserts the same)
        raise ConfigError(
            f"--moe-shared-expert-intermediate-size {c.moe_shared_expert_intermediate_size} with biases (the default) "
            "is not supported, as in Megatron: its shared expert has no biases; add --disable-bias-linear"
        )
    if c.moe_router_enable_expert_bias and c.moe_router_score_function != "sigmoid":
        raise ConfigError(
            "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as in Megatron and "
            "DeepSeek-V3); add it or drop the expert bias"
        )
    g, gk = c.moe_router_num_groups, c.moe_router_group_topk
    if g is None and c.moe_router_group_score_topn is not None:  # (it was ignored without a word)
        raise ConfigError(
            f"--moe-router-group-score-topn {c.moe_router_group_score_topn} scores groups: it needs "
            "--moe-router-num-groups and --moe-router-group-topk (group-limited routing); add them or drop it"
        )
    if (g is None) != (gk is None):
        raise ConfigError(
            "--moe-router-num-groups and --moe-router-group-topk go together (group-limited routing); give both"
        )
    if g is not None:
        if g < 1 or e % g:
            raise ConfigError(f"--moe-router-num-groups {g} must divide --num-experts {e}")
        if not 1 <= gk <= g:
            raise ConfigError(f"--moe-router-group-topk {gk} must be between 1 and --moe-router-num-groups {g}")
        n = c.moe_router_group_score_topn
        if n is not None and not 1 <= n <= e // g:
            raise ConfigError(f"moe_router_group_score_topn {n} must be between 1 and a group's {e // g} experts")
        # (Megatron's rule needs group_topk <= topk: a group's score sums its top topk // group_topk; but where
        # every group is chosen, their scores rank nothing and the routing is plain top-k, as Megatron's
        # deepseek-proxy test runs it: accepted, an exploratory port found it refused)
        if (gk < g and not (gk <= k or n is not None)) or k > gk * (e // g):
            raise ConfigError(
                f"--moe-router-topk {k} must be between --moe-router-group-topk {gk} and the experts of "
                f"those groups ({gk * (e // g)})"
            )
    if c.moe_router_dtype not in ("fp32", "fp64"):
        raise ConfigError(f"--moe-router-dtype {c.moe_router_dtype} is not supported; fp32 or fp64")
    if c.moe_router_topk_scaling_factor is not None and c.moe_router_topk_scaling_factor <= 0:
        raise ConfigError(f"--moe-router-topk-scaling-factor {c.moe_router_topk_scaling_factor} must be > 0")
    if c.moe_router_load_balancing_type not in ("aux_loss", "seq_aux_loss", "sinkhorn", "none"):
        raise ConfigError(
            f"--moe-router-load-balancing-type {c.moe_router_load_balancing_type} is not "
            "aux_loss|seq_aux_loss|sinkhorn|none"
        )
    if c.moe_router_load_balancing_type == "sinkhorn":
        _validate_sinkhorn(c)
    if c.moe_token_drop_policy not in ("probs", "position"):
        raise ConfigError(f"--moe-token-drop-policy {c.moe_token_drop_policy} is not probs|position")
    if c.moe_token_dispatcher_type not in ("alltoall", "allgather"):
        raise ConfigError(f"--moe-token-dispatcher-type {c.moe_token_dispatcher_type} is not alltoall|allgather")
    if c.moe_expert_capacity_factor is not None and c.moe_expert_capacity_factor <= 0:
        raise ConfigError(f"--moe-expert-capacity-factor {c.moe_expert_capacity_factor} must be > 0")
    if isinstance(c.moe_layer_freq, int) and c.moe_layer_freq < 1:
        raise ConfigError(f"--moe-layer-freq {c.moe_layer_freq} must be >= 1 (every Nth layer is MoE)")
    if not isinstance(c.moe_layer_freq, int) and not set(c.moe_layer_freq) <= {0, 1}:
        raise ConfigError(f"--moe-layer-freq pattern {list(c.moe_layer_freq)} may hold only 0 (dense) and 1 (MoE)")
    if not isinstance(c.moe_layer_freq, int) and len(c.moe_layer_freq) != c.num_layers:
        raise ConfigError(
            f"--moe-layer-freq pattern has {len(c.moe_layer_freq)} entries for --num-layers {c.num_layers}"
        )
    _validate_router_extras(c)


def _validate_sinkhorn(c: ModelConfig) -> None:
    """Sinkhorn routing picks the experts and weighs them itself: Megatron asserts no auxiliary loss, and ignores
    the score function, the expert bias, group-limited routing and the scaling factor, which are refused here
    rather than dropped without a word."""
    if c.moe_aux_loss_coeff:
        raise ConfigError(
            f"--moe-router-load-balancing-type sinkhorn with --moe-aux-loss-coeff {c.moe_aux_loss_coeff}: Sinkhorn "
            "routing balances the experts itself and has no auxiliary loss (Megatron asserts it); drop the coefficient"
        )
    if c.moe_expert_capacity_factor is not None:
        raise ConfigError(
            f"--moe-expert-capacity-factor {c.moe_expert_capacity_factor} with --moe-router-load-balancing-type "
            "sinkhorn: Megatron drops tokens only with aux_loss, seq_aux_loss, global_aux_loss or none balancing (its "
            "config asserts it); drop the capacity factor or pick one of those"
        )
    for flag, given in (
        ("--moe-router-score-function sigmoid", c.moe_router_score_function != "softmax"),
        ("--moe-router-enable-expert-bias", c.moe_router_enable_expert_bias),
        ("--moe-router-num-groups", c.moe_router_num_groups is not None),
        ("--moe-router-topk-scaling-factor", c.moe_router_topk_scaling_factor is not None),
        ("--moe-router-pre-softmax", c.moe_router_pre_softmax),
    ):
        if given:
            raise ConfigError(
                f"{flag} has no effect with --moe-router-load-balancing-type sinkhorn (Megatron's Sinkhorn routing "
                "weighs the experts by sigmoid scores at top-1, softmax ones otherwise, and ignores it): drop it"
            )


def _validate_router_extras(c: ModelConfig) -> None:
    """--moe-input-jitter-eps, --moe-pad-expert-input-to-capacity, --moe-apply-probs-on-input (Megatron's checks:
    its config's for padding, its experts' assertion for the probabilities; its uniform noise refuses eps <= 0 at
    the first forward, here at start-up)."""
    eps = c.moe_input_jitter_eps
    if eps is not None and not eps > 0:
        raise ConfigError(
            f"--moe-input-jitter-eps {eps} must be > 0 (the noise is uniform in [1 - eps, 1 + eps]); drop the flag "
            "for no jitter"
        )
    if c.moe_pad_expert_input_to_capacity and c.moe_expert_capacity_factor is None:
        raise ConfigError(
            "--moe-pad-expert-input-to-capacity pads each expert's input to its capacity, which needs "
            "--moe-expert-capacity-factor (as in Megatron; a negative factor means dropless): add it or drop the flag"
        )
    if c.moe_apply_probs_on_input and c.moe_router_topk != 1:
        raise ConfigError(
            f"--moe-apply-probs-on-input with --moe-router-topk {c.moe_router_topk}: the routing weight scales the "
            "one expert's input, so it needs --moe-router-topk 1 (as Megatron asserts)"
        )
