"""Megatron's attention variants beyond the plain causal softmax: windows on some layers only
(--window-attn-skip-freq), a softmax with an extra logit per head (--softmax-type), and Llama 4's and Qwen3-Next's
changes around it: L2-normalised queries and keys (--qk-l2-norm), layers without RoPE (--no-rope-freq) and a
sigmoid gate on the attention output (--attention-output-gate); Hugging Face's Llama 4 adds chunked attention on the
RoPE layers and temperature tuning on the NoPE ones (--attention-chunk-size, --attn-temperature-floor-scale).

The softmax offset (Megatron-Core's softmax_offset, gpt-oss's attention sinks) is one more column beside each
query's scores: p_j = exp(s_j) / (exp(offset) + sum_i exp(s_i)). It takes probability and adds no value, so a
query may attend to nothing. off-by-one fixes the offset at 0 (softmax_1); learnable learns one per head.

Through the flash kernel it costs nothing extra: with lse = log sum_i exp(s_i), the output with the offset is the
plain output times exp(lse) / (exp(lse) + exp(offset)) = sigmoid(lse - offset), and autograd carries the gradient
through lse into the kernel's backward (its dlse input) and into the offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def validate_attention_variants(config) -> None:
    """The ModelConfig settings of --window-attn-skip-freq and --softmax-type, each refusal one line."""
    from megatron_lite.config import ConfigError

    if config.softmax_type not in SOFTMAX_TYPES:
        raise ConfigError(f"--softmax-type {config.softmax_type} is not one of {', '.join(SOFTMAX_TYPES)}")
    _validate_llama4_qwen3next(config)
    freq = config.window_attn_skip_freq
    if freq is None:
        return
    if isinstance(freq, int):
        if freq < 1:
            raise ConfigError(f"--window-attn-skip-freq {freq} must be >= 1 (every Nth layer attends fully)")
        return
    if not set(freq) <= {0, 1}:
        raise ConfigError(f"--window-attn-skip-freq pattern {list(freq)} may hold only 0 (full) and 1 (window)")
    if len(freq) != config.num_layers:
        raise ConfigError(
            f"--window-attn-skip-freq pattern has {len(freq)} entries for --num-layers {config.num_layers}; give "
            "one per layer"
        )
    if config.mtp_num_layers:
        raise ConfigError(
            "--window-attn-skip-freq as a pattern with --mtp-num-layers is not supported (the pattern covers the "
            "decoder's layers, not the prediction layers after them; Megatron fails on it too); give an integer"
        )


def _validate_llama4_qwen3next(config) -> None:
    """--qk-l2-norm, --no-rope-freq and --attention-output-gate, each refusal one line."""
    from megatron_lite.config import ConfigError

    mla = config.multi_latent_attention
    if config.qk_l2_norm and config.qk_layernorm:
        raise ConfigError(
            "--qk-l2-norm with --qk-layernorm: Megatron's layer spec takes the L2 norm and drops the layernorm "
            "silently; give one of them"
        )
    for flag, on in (("--qk-l2-norm", config.qk_l2_norm), ("--attention-output-gate", config.attention_output_gate)):
        if on and mla:
            raise ConfigError(f"{flag} with --multi-latent-attention is not supported (nor in Megatron); drop one")
    _validate_llama4_extras(config)
    freq = config.no_rope_freq
    if not freq:  # (Megatron: a falsy no_rope_freq is unset)
        return
    if config.position_embedding_type != "rope" or mla:
        what = "--multi-latent-attention" if mla else f"--position-embedding-type {config.position_embedding_type}"
        raise ConfigError(f"--no-rope-freq with {what} picks nothing to skip (it skips RoPE); drop --no-rope-freq")
    if isinstance(freq, int):
        if freq < 1 or config.num_layers % freq:
            raise ConfigError(
                f"--no-rope-freq {freq} must be >= 1 and divide --num-layers {config.num_layers} (Megatron's check); "
                "or give a 0/1 pattern"
            )
    elif not set(freq) <= {0, 1} or len(freq) != config.num_layers:
        raise ConfigError(
            f"--no-rope-freq pattern {list(freq)} must hold one 0 (RoPE) or 1 (no RoPE) per layer of --num-layers "
            f"{config.num_layers}"
        )
    if config.mtp_num_layers:
        raise ConfigError(
            "--no-rope-freq with --mtp-num-layers is not supported (Megatron indexes the pattern past its end for the "
            "prediction layers); drop one"
        )


def _validate_llama4_extras(config) -> None:
    """Hugging Face's Llama 4 beyond Megatron's flags (ModelConfig's qk_l2_norm_rope_only, attention_chunk_size,
    attn_temperature_floor_scale / _scale; set by the converter, carried by checkpoints): --qk-l2-norm on the RoPE
    layers only (Megatron's normalises every layer); chunked attention (block-diagonal causal, chunks of
    attention_chunk_size absolute positions) on the RoPE layers, and on the NoPE layers queries scaled by
    log1p(floor((pos + 1) / floor_scale)) x attn_temperature_scale + 1 (chunked_documents and temperature_scaled
    below)."""
    from megatron_lite.config import ConfigError

    if config.qk_l2_norm_rope_only and not config.qk_l2_norm:
        raise ConfigError("--qk-l2-norm-rope-only (Llama 4's) limits --qk-l2-norm to the RoPE layers: add --qk-l2-norm")
    for name, value in (
        ("--attention-chunk-size", config.attention_chunk_size),
        ("--attn-temperature-floor-scale", config.attn_temperature_floor_scale),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"{name} {value} must be a positive number of tokens (or unset: none)")
    if config.attention_chunk_size is not None and config.multi_latent_attention:
        # (its decoding path attends through absorbed weights, outside the masks here)
        raise ConfigError(
            f"--attention-chunk-size {config.attention_chunk_size} with --multi-latent-attention is not supported "
            "(Llama 4's chunked attention is for grouped-query attention); drop one"
        )


def chunked_documents(
    chunk: int, batch: int, seq: int, device, documents: torch.Tensor | None = None, first: int = 0
) -> torch.Tensor:
    """Llama 4's chunked attention as document ids [batch, seq] of the keys at absolute positions first, first + 1,
    ...: a new id at each multiple of `chunk` and, with --reset-attention-mask's `documents` [batch, seq], at each
    document's start too, so that a query sees only earlier keys of both its chunk and its document (the
    intersection). A chunk is a document whose positions go on (RoPE and the temperature read absolute ones; the
    ids only mask), so the flash kernel's document spans, SDPA's document mask and every context-parallel type
    (which take the whole sequence's ids, as for --reset-attention-mask) serve as they are."""
    pos = torch.arange(first, first + seq, device=device)
    new = (pos % chunk == 0).expand(batch, seq).clone()
    new[:, :1] = True
    if documents is not None:
        new[:, 1:] |= documents[:, 1:] != documents[:, :-1]
    return new.cumsum(1) - 1


def temperature_scaled(q: torch.Tensor, positions: torch.Tensor, floor_scale: int, scale: float) -> torch.Tensor:
    """Llama 4's attention temperature tuning on the NoPE layers (transformers' Llama4TextAttention): queries
    [b, s, heads, d] times log1p(floor((pos + 1) / floor_scale)) x scale + 1, `positions` [s] the queries' absolute
    positions (transformers' arange from the cached tokens' count, whatever the position ids), the factor in fp32
    and the product cast back, as there."""
    factor = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * scale + 1.0
    return (q * factor.view(1, -1, 1, 1)).to(q.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """--qk-l2-norm: x scaled to unit RMS over its last dim, in fp32, no weight (Megatron-Core's L2Norm, with
    eps = --norm-epsilon as its attention builds it)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def output_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """--attention-output-gate: attention's output [b, s, heads * dv] times sigmoid(gate) (gate [b, s, heads, dv]),
    the sigmoid in fp32 as Megatron-Core's _apply_output_gate."""
    return (out * torch.sigmoid(gate.reshape(out.shape).float())).to(out.dtype)


def flash_attention_with_offset(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offset: torch.Tensor,
    scale: float | None,
    window: int | None,
    documents: torch.Tensor | None,
) -> torch.Tensor:
    """Causal attention with a softmax offset per head through our flash kernel. q [b, s, heads, d], k and v
    [b, sk, kv_heads, d(v)], offset [heads] -> [b, s, heads, dv]."""
    from megatron_lite import kernels as K

    o, lse = K.flash_attention(
        q, k, v, causal=True, softmax_scale=scale, return_lse=True, window_size=window, document_ids=documents
    )
    return with_offset(o, lse, offset)


def with_offset(o: torch.Tensor, lse: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Attention's output o [b, s, heads, dv] over the keys alone, with its log-sum-exp lse [b, heads, s] -> the
    output with the offset column in the softmax too."""
    keep = torch.sigmoid(lse - offset.float().view(1, -1, 1))  # exp(lse) / (exp(lse) + exp(offset))
    return o * keep.transpose(1, 2).unsqueeze(-1).to(o.dtype)


def attention_with_offset(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offset: torch.Tensor,
    scale: float | None,
    visible: torch.Tensor,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """The same in plain PyTorch (--kernel-impl torch, and attention dropout), as Megatron-Core's unfused
    SoftmaxOne: the scores in fp32 with the offset column appended, softmax, the column dropped, dropout on the
    probabilities. `visible` [seq_q, seq_k] or [b, 1, seq_q, seq_k]: True where a query sees a key. Memory is
    O(seq^2) per head, as any unfused attention's. Dropout draws from the current generator (the caller forks
    the per-rank one)."""
    b, s, heads, d = q.shape
    kv_heads = k.shape[2]
    rep = heads // kv_heads
    qh = q.transpose(1, 2).float()
    kh = k.transpose(1, 2).float().repeat_interleave(rep, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(rep, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * (scale if scale is not None else d**-0.5)
    scores = scores.masked_fill(~visible, float("-inf"))
    column = offset.float().view(1, heads, 1, 1).expand(b, heads, s, 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p, training=True)
    return torch.matmul(probs.to(v.dtype), vh).transpose(1, 2)
