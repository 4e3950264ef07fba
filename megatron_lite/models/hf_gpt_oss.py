"""Hugging Face's GptOssForCausalLM (OpenAI's gpt-oss) <-> megatron_lite: its config.json fields and the weights
that differ from the Llama family's.

gpt-oss is, in Megatron's flags: --softmax-type learnable (the attention sinks), --window-size with
--window-attn-skip-freq 2 (layer_types alternating sliding and full, sliding first), biases on every linear layer
(QKV, output projection, router, experts), MoE on every layer with softmax top-k routing renormalised over the k
(transformers' router: top-k of the logits, softmax over them), and experts computing --quick-geglu with
--glu-linear-offset 1 and --activation-func-clamp-value swiglu_limit: (clamp(up) + 1) * glu(min(gate, limit)).

Pitfalls: the experts' gate_up_proj is [E, hidden, 2 x ffn] (input first, transposed against nn.Linear) with gate
and up interleaved column by column (gate at even columns), where ours is [gate; up] stacked by rows; down_proj is
[E, ffn, hidden]. The Hub's checkpoints store them in MXFP4 (gate_up_proj_blocks / _scales: 32 values a block,
two 4-bit e2m1 values a byte, low nibble first, one power-of-two e8m0 scale a block), dequantised here exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_lite.config import ConfigError, ModelConfig

GPT_OSS = "GptOssForCausalLM"
QUICK_GELU_ALPHA = 1.702  # (Megatron's quick_gelu constant; gpt-oss's swiglu_alpha)
# e2m1 codes 0..15: sign bit 3, exponent bits 2-1, mantissa bit 0
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 [..., rows, groups, 16] uint8 blocks and [..., rows, groups] uint8 e8m0 scales -> [..., rows,
    groups x 32] values (each exact in bf16: two mantissa bits times a power of two)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ConfigError(
            f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} {scales.dtype} do not "
            "match: uint8 [..., groups, 16] and [..., groups]"
        )
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., groups, 32]
    values = table[codes] * torch.exp2(scales.float() - 127.0).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def dequantize_experts(hf: dict[str, torch.Tensor], log=print) -> dict[str, torch.Tensor]:
    """The Hub checkpoint's MXFP4 expert weights -> the dense tensors transformers' GptOssExperts holds
    (gate_up_proj [E, hidden, 2 x ffn], down_proj [E, ffn, hidden]); the other tensors as they are."""
    packed = sorted(k for k in hf if k.endswith("_blocks"))
    if not packed:
        return hf
    out = dict(hf)
    for name in packed:
        base = name.removesuffix("_blocks")
        if base + "_scales" not in hf:
            raise ConfigError(f"{name} has no {base}_scales beside it: the MXFP4 checkpoint is incomplete")
        dense = dequantize_mxfp4(out.pop(name), out.pop(base + "_scales"))  # [E, out, in]
        out[base] = dense.transpose(-1, -2).contiguous()
    log(f"dequantised {len(packed)} MXFP4 expert tensors to bf16")
    return out


def config_kwargs(c: Any) -> dict:
    """ModelConfig fields of a GptOssConfig beyond those every grouped-query class reads alike (hf.py's), each
    that changes the math honoured, or refused."""
    alpha = float(getattr(c, "swiglu_alpha", QUICK_GELU_ALPHA))
    if abs(alpha - QUICK_GELU_ALPHA) > 1e-9:
        raise ConfigError(f"config.json swiglu_alpha {alpha} is not supported: --quick-geglu's gain is 1.702")
    if not getattr(c, "attention_bias", True):
        raise ConfigError("config.json attention_bias=false is not supported for GptOssForCausalLM")
    layers = c.num_hidden_layers
    types = list(getattr(c, "layer_types", None) or [])
    types = types or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if set(types) - {"sliding_attention", "full_attention"} or len(types) != layers:
        raise ConfigError(f"config.json layer_types {sorted(set(types))} ({len(types)} for {layers} layers) are "
                          "not supported: sliding_attention or full_attention per layer")  # fmt: skip
    pattern = tuple(int(t == "sliding_attention") for t in types)
    window = getattr(c, "sliding_window", None) if any(pattern) else None
    if any(pattern) and not window:
        raise ConfigError("config.json has sliding_attention layers but no sliding_window")
    alternate = tuple(int((i + 1) % 2 != 0) for i in range(layers))  # (Megatron's --window-attn-skip-freq 2)
    skip = None if all(pattern) or not window else 2 if pattern == alternate else pattern
    limit = getattr(c, "swiglu_limit", 7.0)
    return dict(
        activation="quick_geglu",
        glu_linear_offset=1.0,
        activation_func_clamp_value=float(limit) if limit is not None else None,
        sliding_window=int(window) if window else None,
        window_attn_skip_freq=skip,
        softmax_type="learnable",
        add_bias_linear=True,
        num_experts=c.num_local_experts,
        moe_router_topk=c.num_experts_per_tok,
        moe_ffn_hidden_size=c.intermediate_size,
        moe_aux_loss_coeff=0.0,  # (as the other converters: the weights' math is the router and the experts)
    )


def export_problems(c: ModelConfig) -> list[str]:
    """What GptOssForCausalLM cannot express of `c`."""
    problems = []
    for bad, what in (
        (c.softmax_type != "learnable", f"--softmax-type {c.softmax_type} (gpt-oss learns its sinks)"),
        (c.activation != "quick_geglu", f"activation {c.activation} (gpt-oss's experts run --quick-geglu)"),
        (c.glu_linear_offset != 1.0, f"--glu-linear-offset {c.glu_linear_offset:g} (gpt-oss adds 1)"),
        (c.activation_func_clamp_value is None, "no --activation-func-clamp-value (gpt-oss clamps: swiglu_limit)"),
        (not c.add_bias_linear, "no biases (--disable-bias-linear; gpt-oss has them on every linear layer)"),
        (c.add_qkv_bias and not c.add_bias_linear, "QKV bias alone"),
        (not c.num_experts or not all(c.moe_layers), "dense layers (gpt-oss has experts on every layer)"),
        (c.qk_layernorm, "q/k norms"),
        (c.normalization != "RMSNorm", f"{c.normalization} (gpt-oss uses RMSNorm)"),
        (c.multi_latent_attention, "multi-latent attention"),
        (c.rotary_percent != 1.0, "partial RoPE (--rotary-percent)"),
        (c.rope_scaling is not None and c.rope_scaling.rope_type != "yarn", "RoPE scaling other than YaRN"),
        (c.mtp_num_layers, "multi-token prediction"),
    ):
        if bad:
            problems.append(what)
    if c.num_experts:
        if c.moe_router_score_function != "softmax" or c.moe_router_enable_expert_bias or c.moe_router_pre_softmax:
            problems.append("routing other than softmax over the top-k logits")
        if c.moe_shared_expert_intermediate_size:
            problems.append("shared experts")
        scale = c.moe_router_topk_scaling_factor
        if (scale is not None and scale != 1.0) or c.moe_router_num_groups:
            problems.append("scaled or group-limited top-k")
        if c.moe_ffn_size != c.ffn_size:
            problems.append(f"--moe-ffn-hidden-size {c.moe_ffn_size} != --ffn-hidden-size {c.ffn_size}")
    return problems


def config_fields(c: ModelConfig) -> dict:
    """config.json fields of GptOssForCausalLM beyond the Llama family's. (Not router_aux_loss_coef: a training
    setting of transformers', kept from the weights' own config.json as the other MoE exports keep it; the import
    zeroes ours, and an exploratory run found the export writing that 0 over the original's 0.001.)"""
    layers = ["sliding_attention" if c.layer_window(i) is not None else "full_attention" for i in range(c.num_layers)]
    # (no windowed layer: the original's window, or transformers' default, stays; a null one stopped its forward)
    window = {} if c.sliding_window is None else dict(sliding_window=c.sliding_window)
    return dict(
        head_dim=c.head_dim,
        intermediate_size=c.moe_ffn_size,
        num_local_experts=c.num_experts,
        num_experts_per_tok=c.moe_router_topk,
        **window,
        layer_types=layers,
        attention_bias=True,
        swiglu_limit=c.activation_func_clamp_value,
        swiglu_alpha=QUICK_GELU_ALPHA,
        output_router_logits=False,
    )


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[..., ffn] gate and up -> [..., 2 ffn] with gate at even places, up at odd (gpt-oss's order)."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


def layer_from_hf(hf: dict[str, torch.Tensor], p: str, o: str, c: ModelConfig) -> dict[str, torch.Tensor]:
    """One layer's sinks, router and experts (HF prefix `p` = model.layers.{i}., ours `o`)."""
    out = {f"{o}.self_attention.core_attention.softmax_offset": hf[p + "self_attn.sinks"]}
    m, x = f"{o}.mlp", p + "mlp."
    out[f"{m}.router.weight"] = hf[x + "router.weight"]
    out[f"{m}.router.bias"] = hf[x + "router.bias"]
    gate_up, gate_up_bias = hf[x + "experts.gate_up_proj"], hf[x + "experts.gate_up_proj_bias"]
    for e in range(c.num_experts):
        w = gate_up[e].t()  # [2 ffn, hidden], rows interleaved gate, up, gate, ...
        out[f"{m}.experts.{e}.linear_fc1.weight"] = torch.cat([w[0::2], w[1::2]], dim=0)
        out[f"{m}.experts.{e}.linear_fc1.bias"] = torch.cat([gate_up_bias[e][0::2], gate_up_bias[e][1::2]])
        out[f"{m}.experts.{e}.linear_fc2.weight"] = hf[x + "experts.down_proj"][e].t()
        out[f"{m}.experts.{e}.linear_fc2.bias"] = hf[x + "experts.down_proj_bias"][e]
    return out


def layer_to_hf(ours: dict[str, torch.Tensor], o: str, p: str, c: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of `layer_from_hf` (transformers' module tensors, which save_pretrained writes as they are)."""
    m, x, n = f"{o}.mlp", p + "mlp.", c.num_experts
    hf = {p + "self_attn.sinks": ours[f"{o}.self_attention.core_attention.softmax_offset"]}
    hf[x + "router.weight"] = ours[f"{m}.router.weight"]
    hf[x + "router.bias"] = ours[f"{m}.router.bias"]
    fc1 = [ours[f"{m}.experts.{e}.linear_fc1.weight"].chunk(2, dim=0) for e in range(n)]
    hf[x + "experts.gate_up_proj"] = torch.stack([_interleave(g.t(), u.t()) for g, u in fc1])
    b1 = [ours[f"{m}.experts.{e}.linear_fc1.bias"].chunk(2) for e in range(n)]
    hf[x + "experts.gate_up_proj_bias"] = torch.stack([_interleave(g, u) for g, u in b1])
    hf[x + "experts.down_proj"] = torch.stack([ours[f"{m}.experts.{e}.linear_fc2.weight"].t() for e in range(n)])
    hf[x + "experts.down_proj_bias"] = torch.stack([ours[f"{m}.experts.{e}.linear_fc2.bias"] for e in range(n)])
    return hf
