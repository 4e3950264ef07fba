"""Llama 4's text model (transformers' Llama4ForCausalLM, model_type llama4_text; the text part of
Llama4ForConditionalGeneration, its tensors under language_model.): what its config.json means in our flags, what a
ModelConfig must be to export to it, its config.json fields and its feed-forward weights. hf.py dispatches here;
attention (q/k/v/o_proj, no bias) and the norms are the Llama family's names.

In Megatron's flags: RoPE on interleaved pairs (transformers multiplies (x0, x1), (x2, x3), ... as complex numbers:
--rotary-interleaved), with llama3 scaling; no_rope_layers lists 1 for a RoPE layer and 0 for a NoPE one (default:
every no_rope_layer_interval-th, 1-based), the opposite of --no-rope-freq's 0/1, which is its complement; use_qk_norm
is a weightless RMS norm (eps rms_norm_eps) of each query and key head on the RoPE layers only (--qk-l2-norm, with
our qk_l2_norm_rope_only: Megatron's flag normalises every layer); MoE on the layers moe_layers lists (default:
every interleave_moe_layer_step-th, 1-based: a --moe-layer-freq pattern, Megatron's integer counts from layer 0),
the others dense SwiGLU MLPs of intermediate_size_mlp (--ffn-hidden-size). The router (Llama4Router) keeps the top-1
logit and takes its sigmoid (sigmoid is monotonic: Megatron's sigmoid top-1, not renormalised), which multiplies the
expert's input (--moe-apply-probs-on-input); a shared expert of intermediate_size, ungated, is added
(--moe-shared-expert-intermediate-size). The experts are fused: gate_up_proj [E, hidden, 2I] ([gate | up] along its
last dim, input first: ours transposed) and down_proj [E, I, hidden].

attention_chunk_size (block-diagonal causal attention on the chunked_attention layers, which must be the RoPE ones,
transformers' default) is --attention-chunk-size, and attn_temperature_tuning (NoPE layers' queries times
log1p(floor((pos + 1) / floor_scale)) x attn_scale + 1) --attn-temperature-floor-scale / -scale
(models/attention_variants.py).
router_aux_loss_coef is transformers' training loss, left to the training flags as for the other MoE classes.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_lite.config import ConfigError, ModelConfig
from megatron_lite.models.hf_deepseek import check_activation
from megatron_lite.models.hf_rope import rope_fields

LLAMA4 = "Llama4ForCausalLM"
LLAMA4_VLM = "Llama4ForConditionalGeneration"  # (its text model converts; the vision tower is not ours)
VLM_PREFIX = "language_model."


def text_config(c: Any) -> Any:
    """A Llama4ForConditionalGeneration config's text_config (a dict when read without transformers)."""
    text = getattr(c, "text_config", None)
    if text is None:
        raise ConfigError(f"config.json of {LLAMA4_VLM} has no text_config")
    if isinstance(text, dict):
        from megatron_lite.checkpoint.hf_defaults import fallback_config

        return fallback_config({**text, "model_type": "llama4_text"})
    return text


def rope_layers(c: Any) -> list[int]:
    """no_rope_layers as transformers derives it: 1 = RoPE; every no_rope_layer_interval-th layer 0 by default."""
    n = c.num_hidden_layers
    given = list(getattr(c, "no_rope_layers", None) or [])
    if given:
        if len(given) < n or not set(given[:n]) <= {0, 1}:
            raise ConfigError(f"config.json no_rope_layers {given} must hold a 0 or 1 for each of {n} layers")
        return [int(x) for x in given[:n]]
    interval = int(getattr(c, "no_rope_layer_interval", 4) or 4)
    return [int((i + 1) % interval != 0) for i in range(n)]


def moe_layers(c: Any) -> list[int]:
    listed = getattr(c, "moe_layers", None)
    if listed is None:
        step = int(getattr(c, "interleave_moe_layer_step", 1) or 1)
        listed = range(step - 1, c.num_hidden_layers, step)
    return sorted(set(int(i) for i in listed))


def config_kwargs(c: Any) -> dict:
    """ModelConfig fields of a Llama4TextConfig beyond those every grouped-query class reads alike (hf.py's), each
    that changes the math honoured, or refused."""
    check_activation(c, LLAMA4)
    n = c.num_hidden_layers
    if getattr(c, "attention_bias", False):
        raise ConfigError(f"config.json attention_bias=true is not supported for {LLAMA4} (biases on q/k/v and o_proj)")
    rope = rope_layers(c)
    nope = tuple(1 - r for r in rope)
    interval = int(getattr(c, "no_rope_layer_interval", 4) or 4)
    every = n % interval == 0 and nope == tuple(int((i + 1) % interval == 0) for i in range(n))
    qk_norm = bool(getattr(c, "use_qk_norm", True))
    scaling = rope_fields(c)[1]
    if qk_norm and scaling is not None and scaling.rope_type == "yarn" and scaling.attention_factor != 1.0:
        # (transformers normalises q and k after RoPE, which undoes the factor YaRN scales cos and sin by; ours
        # keeps it: logits 22% apart)
        raise ConfigError(
            f"config.json YaRN RoPE scaling (attention_factor {scaling.attention_factor:.4g}) with use_qk_norm=true "
            f"is not supported for {LLAMA4}: its q/k norm after RoPE cancels the factor; use llama3 scaling, or "
            "YaRN with attention_factor 1.0"
        )
    types = list(getattr(c, "layer_types", None) or [])
    chunk = getattr(c, "attention_chunk_size", None)
    if not types:  # (transformers' rule: the RoPE layers chunked when there is a chunk size)
        types = ["chunked_attention" if r and chunk is not None else "full_attention" for r in rope]
    if set(types) - {"chunked_attention", "full_attention"}:
        raise ConfigError(f"config.json layer_types {sorted(set(types))} are not supported for {LLAMA4}")
    chunked = [int(t == "chunked_attention") for t in types[:n]]
    if chunk is not None and "chunked_attention" in types and chunked != rope:  # (ours chunks the RoPE layers)
        raise ConfigError(
            f"config.json layer_types chunk the layers {chunked}, not the RoPE layers {rope}: not supported for "
            f"{LLAMA4} (chunked attention here is on the RoPE layers)"
        )
    tuning = bool(getattr(c, "attn_temperature_tuning", True)) and any(nope)
    kwargs: dict[str, Any] = dict(
        ffn_hidden_size=int(getattr(c, "intermediate_size_mlp", c.intermediate_size)),
        add_bias_linear=False,
        rotary_interleaved=True,
        no_rope_freq=(interval if every else nope) if any(nope) else None,
        qk_l2_norm=qk_norm,
        qk_l2_norm_rope_only=qk_norm and any(nope),
        attention_chunk_size=int(chunk) if "chunked_attention" in types else None,
        attn_temperature_floor_scale=int(getattr(c, "floor_scale", 8192)) if tuning else None,
        attn_temperature_scale=float(getattr(c, "attn_scale", 0.1)),
    )
    moe = [i for i in moe_layers(c) if i < n]
    experts = int(getattr(c, "num_local_experts", 0) or 0)
    if not moe or not experts:
        return kwargs
    k = int(getattr(c, "num_experts_per_tok", 1))
    if k != 1:
        raise ConfigError(
            f"config.json num_experts_per_tok={k} is not supported for {LLAMA4}: its sigmoid scores weigh the "
            "experts' inputs (--moe-apply-probs-on-input), which Megatron allows for a top-1 only"
        )
    pattern = tuple(int(i in moe) for i in range(n))
    return kwargs | dict(
        num_experts=experts,
        moe_router_topk=1,
        moe_ffn_hidden_size=c.intermediate_size,
        moe_shared_expert_intermediate_size=c.intermediate_size,
        moe_router_score_function="sigmoid",
        moe_apply_probs_on_input=True,
        moe_layer_freq=1 if all(pattern) else pattern,
        moe_aux_loss_coeff=0.0,
    )


def export_problems(c: ModelConfig) -> list[str]:
    """What Llama4ForCausalLM cannot express, beyond what hf.py checks for every class."""
    problems = []
    nope = any(c.skips_rope(i) for i in range(c.num_layers))
    for bad, what in (
        (not c.rotary_interleaved, "RoPE rotating halves (Llama 4 rotates interleaved pairs: --rotary-interleaved)"),
        (
            c.qk_l2_norm and nope and not c.qk_l2_norm_rope_only,
            "--qk-l2-norm on the NoPE layers (Megatron's; Llama 4 normalises the RoPE layers' queries and keys only)",
        ),  # fmt: skip
        (c.qk_layernorm, "q/k norms with weights (--qk-layernorm; Llama 4's are weightless: --qk-l2-norm)"),
        (c.add_bias_linear or c.add_qkv_bias, "biases (Llama 4 has none)"),
        (c.sliding_window, "a sliding window (--window-size)"),
        (
            c.rope_scaling is not None and c.rope_scaling.rope_type not in ("llama3", "yarn"),
            "RoPE scaling other than llama3 or YaRN",
        ),
        (  # (as on import: transformers' q/k norm after RoPE cancels the factor YaRN scales cos and sin by)
            c.qk_l2_norm
            and c.rope_scaling is not None
            and c.rope_scaling.rope_type == "yarn"
            and c.rope_scaling.attention_factor != 1.0,
            "YaRN with an attention factor other than 1 under --qk-l2-norm (Llama 4's q/k norm after RoPE cancels it)",
        ),
    ):
        if bad:
            problems.append(what)
    if not c.num_experts:
        return problems
    for bad, what in (
        (c.moe_router_score_function != "sigmoid" or c.moe_router_topk != 1, "routing other than sigmoid top-1"),
        (not c.moe_apply_probs_on_input, "routing weights on the experts' outputs (Llama 4 weighs their inputs: "
         "--moe-apply-probs-on-input)"),  # fmt: skip
        (c.moe_shared_expert_intermediate_size != c.moe_ffn_size, f"a shared expert of "
         f"{c.moe_shared_expert_intermediate_size or 0} (Llama 4's: --moe-ffn-hidden-size {c.moe_ffn_size})"),
        (c.moe_shared_expert_gate, "a gated shared expert (--moe-shared-expert-gate)"),
        (c.moe_router_enable_expert_bias, "an expert bias (--moe-router-enable-expert-bias)"),
        ((c.moe_router_topk_scaling_factor or 1.0) != 1.0, "--moe-router-topk-scaling-factor"),
        ((c.moe_router_num_groups or 1) > 1, "group-limited routing (--moe-router-num-groups)"),
    ):  # fmt: skip
        if bad:
            problems.append(what)
    return problems


def config_fields(c: ModelConfig) -> dict:
    """config.json's Llama 4 fields for `c` (its RoPE written by hf.py): moe_layers, no_rope_layers and layer_types
    listed, so no interval or step is read."""
    rope = [int(not c.skips_rope(i)) for i in range(c.num_layers)]
    chunk = c.attention_chunk_size
    floor = c.attn_temperature_floor_scale
    return dict(
        head_dim=c.head_dim,  # (the class default is 128 whatever the hidden size)
        intermediate_size=c.moe_ffn_size if c.num_experts else c.ffn_size,
        intermediate_size_mlp=c.ffn_size,
        num_local_experts=c.num_experts or 1,
        num_experts_per_tok=1,
        moe_layers=[i for i in range(c.num_layers) if c.is_moe_layer(i)],
        interleave_moe_layer_step=1,
        no_rope_layers=rope,
        use_qk_norm=c.qk_l2_norm,
        attention_chunk_size=chunk,
        layer_types=["chunked_attention" if r and chunk is not None else "full_attention" for r in rope],
        attn_temperature_tuning=floor is not None,
        floor_scale=floor if floor is not None else 8192,
        attn_scale=c.attn_temperature_scale,
        attention_bias=False,
        router_jitter_noise=0.0,
        output_router_logits=False,
    )


def layer_from_hf(hf: dict, p: str, o: str, c: ModelConfig, layer: int) -> dict:
    """Layer prefix `p`'s feed_forward: a MoE layer's router, fused experts and shared expert, or a dense MLP."""
    f = p + "feed_forward."
    if not (c.num_experts and c.is_moe_layer(layer)):
        return {
            f"{o}.mlp.linear_fc1.weight": torch.cat([hf[f + "gate_proj.weight"], hf[f + "up_proj.weight"]]),
            f"{o}.mlp.linear_fc2.weight": hf[f + "down_proj.weight"],
        }
    m, s = f"{o}.mlp", f + "shared_expert."
    out = {
        f"{m}.router.weight": hf[f + "router.weight"],
        f"{m}.shared_expert.linear_fc1.weight": torch.cat([hf[s + "gate_proj.weight"], hf[s + "up_proj.weight"]]),
        f"{m}.shared_expert.linear_fc2.weight": hf[s + "down_proj.weight"],
    }
    gate_up, down = hf[f + "experts.gate_up_proj"], hf[f + "experts.down_proj"]  # [E, H, 2I], [E, I, H]
    for e in range(c.num_experts):
        out[f"{m}.experts.{e}.linear_fc1.weight"] = gate_up[e].t()  # [2I, H]: [gate; up], as ours
        out[f"{m}.experts.{e}.linear_fc2.weight"] = down[e].t()
    return out


def layer_to_hf(ours: dict, o: str, p: str, c: ModelConfig, layer: int) -> dict:
    """The inverse of layer_from_hf."""
    f = p + "feed_forward."
    if not (c.num_experts and c.is_moe_layer(layer)):
        gate, up = ours[f"{o}.mlp.linear_fc1.weight"].chunk(2, dim=0)
        return {f + "gate_proj.weight": gate, f + "up_proj.weight": up,
                f + "down_proj.weight": ours[f"{o}.mlp.linear_fc2.weight"]}  # fmt: skip
    m, s = f"{o}.mlp", f + "shared_expert."
    gate, up = ours[f"{m}.shared_expert.linear_fc1.weight"].chunk(2, dim=0)
    n = c.num_experts
    return {
        f + "router.weight": ours[f"{m}.router.weight"],
        s + "gate_proj.weight": gate,
        s + "up_proj.weight": up,
        s + "down_proj.weight": ours[f"{m}.shared_expert.linear_fc2.weight"],
        f + "experts.gate_up_proj": torch.stack([ours[f"{m}.experts.{e}.linear_fc1.weight"].t() for e in range(n)]),
        f + "experts.down_proj": torch.stack([ours[f"{m}.experts.{e}.linear_fc2.weight"].t() for e in range(n)]),
    }


def text_tensors(hf: dict[str, torch.Tensor], log=print) -> dict[str, torch.Tensor]:
    """A Llama4ForConditionalGeneration checkpoint's text model: its language_model. tensors without the prefix;
    the vision tower and projector are left out (noted)."""
    text = {k.removeprefix(VLM_PREFIX): v for k, v in hf.items() if k.startswith(VLM_PREFIX)}
    if not text:
        raise ConfigError(f"{LLAMA4_VLM} checkpoint holds no {VLM_PREFIX}* tensors (its text model)")
    if len(text) < len(hf):
        log(f"note: {len(hf) - len(text)} vision tensors (vision_model, multi_modal_projector) are not converted; "
            f"the text model is, and exports as {LLAMA4}")  # fmt: skip
    return text
