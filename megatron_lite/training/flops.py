"""Model FLOPs per token and MFU.

Per token and layer, the forward pass multiplies by every weight once (2 FLOPs per multiply-add):
    QKV           2 * h * (heads + 2 * groups) * d
    attention     2 * 2 * s * heads * d        (q.k^T and p.v over the full sequence: Megatron's
                                                convention counts full, not causally halved, attention)
    projection    2 * heads * d * h
    MLP           2 * h * f * (3 if SwiGLU else 2)
and once per token the output layer, 2 * h * V. Training is 3x the forward (backward = 2x forward);
recomputation is not counted (model FLOPs, as MFU requires). For a GPT with f = 4h and heads * d = h this
is Megatron's 72 B s L h^2 (1 + s / (6h) + V / (12 L h)) per batch, and in general 6 N + 12 L s heads d
per token with N the matmul parameters (torchtitan's form); both are checked in tests/test_flops.py.
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


def flops_per_token(config: ModelConfig, seq_length: int) -> float:
    h, d, heads, groups, f = (
        config.hidden_size,
        config.head_dim,
        config.num_attention_heads,
        config.query_groups,
        config.ffn_size,
    )
    mlp = 3 if config.activation == "swiglu" else 2
    per_layer = 2 * h * (heads + 2 * groups) * d + 4 * seq_length * heads * d + 2 * heads * d * h + 2 * h * f * mlp
    forward = config.num_layers * per_layer + 2 * h * config.vocab_size
    return 3.0 * forward


def peak_flops(device: torch.device, low_precision: bool) -> float | None:
    """Datasheet peak of this accelerator, or None where unknown (a CPU, an unlisted GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, lp, fp32 in PEAKS:
        if key in name:
            return lp if low_precision else fp32
    return None
