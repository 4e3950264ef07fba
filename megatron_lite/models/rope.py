"""Rotary position embeddings in Hugging Face's rotate-half convention (first half / second half of
head_dim), with optional Llama-3 frequency scaling: the cos/sin tables. Applying them is
kernels.apply_rope (Triton) or kernels.apply_rope_reference (PyTorch)."""

from __future__ import annotations

import math

import torch
from torch import nn

from megatron_lite.config import RopeScaling


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, base: float, s: RopeScaling) -> torch.Tensor:
    """YaRN (Peng et al. 2023): dims that turn more than beta_fast times over the original context keep their
    frequency, those that turn fewer than beta_slow times are interpolated by `factor`, a linear ramp between."""

    def dim_of(rotations: float) -> float:  # the dim that completes `rotations` turns over the original length
        return (
            head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))
        )

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / s.factor * ramp + inv_freq * (1 - ramp)


def rope_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, base, scaling)
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float, scaling: RopeScaling | None = None, device=None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.base = base
        self.scaling = scaling
        # Not a checkpointed tensor: derived from the config, recomputed on load (and after meta init).
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, base, scaling).to(device), persistent=False)

    def reset_parameters(self) -> None:
        self.inv_freq = rope_inv_freq(self.head_dim, self.base, self.scaling).to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [*positions.shape, head_dim] in fp32, for integer `positions`."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        scale = self.scaling.attention_factor if self.scaling is not None and self.scaling.rope_type == "yarn" else 1.0
        if scale != 1.0:  # YaRN: q.k grows by attention_factor^2, sharpening attention at long range
            return emb.cos() * scale, emb.sin() * scale
        return emb.cos(), emb.sin()
