"""Model FLOPs per token and MFU.

Per token and layer, the forward pass multiplies by every weight once (2 FLOPs per multiply-add):
    QKV           2 * h * (heads + 2 * groups) * d    (2 * heads with --attention-output-gate: its gate rows,
                                                     as Megatron's num_floating_point_operations counts them)
    attention     2 * 2 * s * heads * d / 2    (q.k^T and p.v; causal: half the scores are masked out,
                                                as Megatron's num_floating_point_operations counts them)
    projection    2 * heads * d * h
    MLP           2 * h * f * (3 if SwiGLU else 2)
and once per token the output layer, 2 * h * V. A MoE layer counts its router (2 * h * E, which Megatron's count
leaves out), its top-k experts and its shared expert (a hybrid model's Mamba layer Megatron's in_proj + 7 d N scan +
out_proj, its attention and MLP layers each their own half; a heterogeneous layer its own query groups and FFN size,
a linear in place of its attention or MLP 2 h^2, a no-op nothing); multi-latent attention its down- and
up-projections and q.k^T over (qk + RoPE) dims, p.v over v dims; multi-token prediction its layers, projections and
output-layer passes. Training is 3x the forward (backward = 2x forward); recomputation is not counted (model FLOPs,
as MFU requires). For a GPT with f = 4h and heads * d = h this is 72 B s L h^2 (1 + s / (12h) + V / (12 L h)) per
batch, and in general 6 N + 6 L s heads d per token with N the matmul parameters. With causal=False, attention over
the full sequence: Megatron's earlier 72 B s L h^2 (1 + s / (6h) + V / (12 L h)) and torchtitan's 6 N + 12 L s heads
d, the convention of the throughput figures they published.
All are checked in tests/test_flops.py. (Megatron counts the padded vocabulary's logits too; padding is no real
work, so it is not counted here.)
"""

from __future__ import annotations

import torch

from megatron_lite.config import ModelConfig

# Dense peak tensor FLOP/s by datasheet: (bf16/fp16, fp32). Matched against torch.cuda.get_device_name().
# More specific names first: the PCIe and NVL cards share a prefix with the SXM parts but not their clocks.
PEAKS = [
    ("H100 PCIe", 756e12, 51e12),
    ("H100 NVL", 835e12, 60e12),
    ("H200 NVL", 835e12, 60e12),
    ("H100", 989.4e12, 67e12),
    ("H200", 989.4e12, 67e12),
    ("H800", 989.4e12, 67e12),
    ("B200", 2250e12, 80e12),
    ("A100", 312e12, 19.5e12),
    ("L40S", 362e12, 91.6e12),
]


def _core_attention_flops(c: ModelConfig, s: float) -> float:
    """The part of _attention_flops with no weight: q.k^T and p.v over `s` keys."""
    if not c.multi_latent_attention:
        return 4 * s * c.num_attention_heads * c.head_dim
    return 2 * s * c.num_attention_heads * (c.mla_q_head_dim + c.v_head_dim)


def _attention_flops(c: ModelConfig, s: float) -> float:
    """Forward FLOPs of one token's attention in one layer: projections, q.k^T and p.v over `s` keys."""
    h, heads = c.hidden_size, c.num_attention_heads
    if not c.multi_latent_attention:
        d = c.head_dim
        q = heads * (2 if c.attention_output_gate else 1)  # (--attention-output-gate: linear_qkv's gate rows too)
        return 2 * h * (q + 2 * c.query_groups) * d + 4 * s * heads * d + 2 * heads * d * h
    qd, v, r = c.mla_q_head_dim, c.v_head_dim, c.q_lora_rank
    q = 2 * h * heads * qd if r is None else 2 * h * r + 2 * r * heads * qd
    kv = 2 * h * (c.kv_lora_rank + c.qk_pos_emb_head_dim) + 2 * c.kv_lora_rank * heads * (c.qk_head_dim + v)
    return q + kv + 2 * s * heads * (qd + v) + 2 * heads * v * h


def _mlp_flops(c: ModelConfig, layer: int) -> float:
    """Forward FLOPs of one token's MLP: a MoE layer runs the router, its top-k experts and the shared expert."""
    h, mult = c.hidden_size, 3 if c.gated_linear_unit else 2
    if not c.is_moe_layer(layer):
        return 2 * h * c.ffn_size * mult
    shared = c.moe_shared_expert_intermediate_size or 0
    return (
        2 * h * (c.num_experts + int(c.moe_shared_expert_gate))
        + 2 * h * (c.moe_router_topk * c.moe_ffn_size + shared) * mult
    )


def mamba_scan_flops(c: ModelConfig) -> float:
    """The part of _mamba_flops with no weight: Megatron's 7 d N for the scan (the counter's and MFU's; the planner
    times the FLOPs models/mamba.py's chunked scan executes instead: planner/hybrid.py's scan_flops)."""
    return 7 * c.mamba_heads * c.mamba_head_dim * c.mamba_state_dim


def _mamba_flops(c: ModelConfig) -> float:
    """Forward FLOPs of one token's Mamba-2 mixer, Megatron's estimate: in_proj 2 h (2 d + 2 G N + heads), the scan
    7 d N, out_proj 2 d h (d = heads x head dim: Megatron's formula takes 2 h, the same unless --mamba-num-heads
    says otherwise)."""
    h, d, gn = c.hidden_size, c.mamba_heads * c.mamba_head_dim, c.mamba_num_groups * c.mamba_state_dim
    return 2 * h * (2 * d + 2 * gn + c.mamba_heads) + mamba_scan_flops(c) + 2 * d * h


def _heterogeneous_layer_flops(c: ModelConfig, layer: int, keys: float) -> float:
    """A heterogeneous layer (--heterogeneous-layers-config-path): its attention and MLP of its own sizes, a linear
    replacement's one [hidden, hidden] GEMM (2 h^2), a no-op nothing."""
    block, own, h = c.heterogeneous_blocks[layer], c.layer_config(layer), c.hidden_size
    other = {"linear": 2.0 * h * h, "no_op": 0.0}
    attention = _attention_flops(own, keys) if block.attention == "normal" else other[block.attention]
    return attention + (_mlp_flops(own, layer) if block.mlp == "normal" else other[block.mlp])


def _layer_flops(c: ModelConfig, layer: int, keys: float) -> float:
    """A layer's forward FLOPs per token: attention and MLP, or in a hybrid model its one kind."""
    if c.heterogeneous_blocks is not None:
        return _heterogeneous_layer_flops(c, layer, keys)
    kind = c.layer_types[layer] if c.hybrid and layer < c.num_layers else None
    if kind == "M":
        return _mamba_flops(c)
    attention = _attention_flops(c, keys) if kind in (None, "*") else 0.0
    return attention + (_mlp_flops(c, layer) if kind != "*" else 0.0)


def _keys_per_query(s: int, window: int | None, chunk: int | None = None) -> float:
    """Keys a query's scores are computed over, on average, under the causal convention: s / 2, and with a
    sliding window w < s, w - w^2 / (2s) (the first w queries see up to w keys, the rest w each; Megatron's
    formula ignores the window and counted a Mistral-7B step at sequence 32768, window 4096, 40% over the work
    done). Llama 4's chunked attention (`chunk` < s) is the causal count within each chunk of the sequence."""
    if chunk is not None and chunk < s:
        lengths = [chunk] * (s // chunk) + ([s % chunk] if s % chunk else [])
        return sum(n * _keys_per_query(n, window) for n in lengths) / s
    if window is None or window >= s:
        return s / 2
    return window - window * window / (2 * s)


def _chunk(config: ModelConfig, layer: int) -> int | None:
    """Layer `layer`'s attention chunk (Llama 4's: the RoPE layers'; the MTP layers follow the last layer's)."""
    return None if config.skips_rope(min(layer, config.num_layers - 1)) else config.attention_chunk_size


def flops_per_token(config: ModelConfig, seq_length: int, causal: bool = True, frozen: bool = False) -> float:
    """Training FLOPs per token; each multi-token-prediction depth adds its projection of [embedding, hidden]
    (2 * 2h * h), its three norms (Megatron's 2 * 3h), its transformer layer and another pass through the output
    layer. `causal`: a token's attention
    counts half the sequence (Megatron's current convention; within a sliding window, what the window leaves);
    False: twice that, the whole sequence without a window (see the module's docstring). `frozen` (LoRA): the
    weights get no gradient, so their backward is the input gradient alone (2x the forward, not 3x); attention's
    q.k^T and p.v, which have no weights, stay 3x (the adapters' own few FLOPs are not counted)."""
    h, depths = config.hidden_size, config.mtp_num_layers
    n = config.num_layers + depths
    # (each layer's own window and chunk: --window-attn-skip-freq leaves some layers attending to the whole
    # sequence, and Llama 4's NoPE layers are not chunked)
    keys = [_keys_per_query(seq_length, config.layer_window(i), _chunk(config, i)) * (1 if causal else 2)
            for i in range(n)]  # fmt: skip
    layers = sum(_layer_flops(config, i, keys[i]) for i in range(n))
    # (a depth's eh_proj, 2 x 2h x h, and Megatron's "MTP eh norm + final norm" term, 2 x 3h)
    forward = layers + depths * (4 * h * h + 6 * h) + (1 + depths) * 2 * h * config.vocab_size
    if config.hybrid:  # (the core attention of the attention layers only)
        keys = [x for i, x in enumerate(keys) if i >= config.num_layers or config.layer_types[i] == "*"]
    if config.heterogeneous_blocks is not None:  # (the layers with attention, not a linear or nothing in its place)
        keys = [x for x, b in zip(keys, config.heterogeneous_blocks) if b.attention == "normal"]
    return 2.0 * forward + sum(_core_attention_flops(config, x) for x in keys) if frozen else 3.0 * forward


def peak_flops(device: torch.device, low_precision: bool) -> float | None:
    """Datasheet peak of this accelerator, or None where unknown (a CPU, an unlisted GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, lp, fp32 in PEAKS:
        if key in name:
            return lp if low_precision else fp32
    return None
