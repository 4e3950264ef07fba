"""QK-clip (MuonClip, as Kimi K2 trains with Muon; Megatron's --qk-clip, --qk-clip-alpha, --qk-clip-threshold and
--log-max-attention-logit): the model side.

Each attention layer records, per query head of this rank, the largest attention logit q.k * softmax_scale its
forwards of the step saw (over the batch and the visible query/key pairs, max-accumulated over the step's
micro-batches), as Transformer Engine's return_max_logit gives Megatron. After the optimizer step the training
step (optimizer/qk_clip.py) takes the maximum over data- and context-parallel replicas and, per query group g,
eta_g = min(threshold / max logit of g's heads, 1); the group's query rows of the fused QKV weight are scaled by
eta_g^alpha and its key rows by eta_g^(1 - alpha), so every logit of the group is scaled by eta_g (Megatron-Core
0.16.1's Attention.clip_qk; multi-latent attention per head, models/mla.py). Model code calls no collective: under
context parallelism each rank records its queries' (or, all-to-all, its heads') maxima over the blocks it
attends (context_parallel/attention.py), and the step's max over DP x CP completes them.

Under --kernel-impl triton the flash kernel returns each query's largest visible logit, its online softmax's
running row max (kernels/flash_attention.py, return_max_logit): one fp32 store per query row, nearly free. The
other paths (SDPA, attention dropout, --softmax-type offsets) compute q.k^T a second time beside the attention
(max_attention_logits: the causal half only, tiled, in the inputs' dtype; not again in an activation
recompute): half the FLOPs of the attention's forward, but unfused. Measured on one CPU thread
(tools/bench_max_logit.py 1024 4096: batch 1, 8 query heads over 2 key heads, head dim 64) it took 0.4-0.6x
SDPA's causal forward in fp32 and 0.8-0.9x in bf16 (CPU bf16 reductions are slow), where the first version (fp32
logits of every pair, masked after, 64 MiB tiles) took 7x and 14-16x.
"""

from __future__ import annotations

import math

import torch

from megatron_lite.config import ConfigError, ModelConfig

# logits held at once while taking the max: 64 MiB of fp32 on a GPU (few, large matmuls); on a CPU a tile that
# stays in cache (2 MiB of fp32: 64 MiB tiles ran the max 2-3x slower, tools/bench_max_logit.py)
MAX_LOGIT_ELEMENTS = 1 << 24
CPU_LOGIT_ELEMENTS = 1 << 19


def records_max_logit(c: ModelConfig) -> bool:
    return c.qk_clip or c.log_max_attention_logit


def validate_qk_clip(c: ModelConfig) -> None:
    """Megatron's checks (arguments.py: alpha in (0, 1), threshold > 0, with --qk-clip) and what is not built."""
    if c.qk_clip and not 0.0 < c.qk_clip_alpha < 1.0:
        raise ConfigError(
            f"--qk-clip-alpha {c.qk_clip_alpha} must be in (0, 1) (query rows are scaled by eta^alpha, key rows by "
            "eta^(1 - alpha)); Megatron's default is 0.5"
        )
    if c.qk_clip and not c.qk_clip_threshold > 0:
        raise ConfigError(f"--qk-clip-threshold {c.qk_clip_threshold} must be > 0 (Megatron's default is 100)")
    # (with --qk-layernorm or --qk-l2-norm it is accepted, as Megatron accepts it, and said once at start-up:
    # megatron_flags.accepted_no_ops)


@torch.no_grad()
def max_attention_logits(q: torch.Tensor, k: torch.Tensor, scale: float, visible: torch.Tensor | None) -> torch.Tensor:
    """The largest q.k * scale per query head over the batch and the visible pairs: [heads] fp32 (-inf for a head
    that sees no key). q [batch, seq_q, heads, d]; k [batch, seq_k, kv_heads, d] (query head i reads key head
    i // (heads / kv_heads)); `visible` [seq_q, seq_k] or [batch, 1, seq_q, seq_k] (True = visible), or None for
    the causal square (bottom-right aligned, as the attention's).

    q.k in the inputs' dtype (as the attention's own matmul; the max of bf16 products is within the flash kernel's
    tolerance of the fp32 one), fp16's in fp32 (its unscaled products overflow where the scaled logit passes
    65504 / sqrt(d): +inf, which clips nothing), over square tiles of queries x keys of about MAX_LOGIT_ELEMENTS logits
    (CPU_LOGIT_ELEMENTS on a CPU), only the tiles holding a visible pair (causal: those up to the diagonal, the
    diagonal's alone masked; a mask: the tiles it leaves any pair in), the scale applied to the [heads] maxima
    (it is > 0). No autograd, no [seq, seq] scores of all heads at once."""
    b, s, heads, d = q.shape
    sk, groups = k.shape[1], k.shape[2]
    rep = heads // groups
    qt = q.reshape(b, s, groups, rep, d).permute(0, 2, 3, 1, 4)  # [b, g, rep, s, d]
    kt = k.permute(0, 2, 3, 1)  # [b, g, d, sk]
    out = torch.full((groups, rep), -math.inf, dtype=torch.float32, device=q.device)
    budget = CPU_LOGIT_ELEMENTS if q.device.type == "cpu" else MAX_LOGIT_ELEMENTS
    tile = max(16, math.isqrt(budget // max(1, b * heads)))
    shift = sk - s  # (query i sits at key position i + shift)
    if visible is not None:  # which tiles hold a visible pair: one small host copy
        pad = (0, -sk % tile, 0, -s % tile)
        blocks = torch.nn.functional.pad(visible, pad).reshape(
            -1, (s + pad[3]) // tile, tile, (sk + pad[1]) // tile, tile
        )
        live = blocks.any(dim=(0, 2, 4)).cpu()
    for qi in range(0, s, tile):
        n = min(tile, s - qi)
        q_tile = qt[:, :, :, qi : qi + n].reshape(b, groups, rep * n, d)
        last = sk if visible is not None else min(sk, qi + n + shift)  # (causal: no key past the tile's last query)
        for ki in range(0, last, tile):
            m = min(tile, last - ki)
            if visible is not None and not live[qi // tile, ki // tile]:
                continue
            k_tile = kt[..., ki : ki + m]
            if q.dtype == torch.float16:  # (unscaled fp16 products overflow past 65504: SDPA scales q first)
                q_tile, k_tile = q_tile.float(), k_tile.float()
            logits = torch.matmul(q_tile, k_tile).view(b, groups, rep, n, m)
            if visible is not None:
                vis = visible[..., qi : qi + n, ki : ki + m]
                logits.masked_fill_(~(vis.unsqueeze(2) if vis.dim() == 4 else vis), -math.inf)
            elif ki + m - 1 > qi + shift:  # (a tile across the diagonal)
                rows = torch.arange(qi + shift, qi + n + shift, device=q.device).unsqueeze(1)
                logits.masked_fill_(torch.arange(ki, ki + m, device=q.device) > rows, -math.inf)
            torch.maximum(out, logits.amax(dim=(0, 3, 4)).float(), out=out)
    return out.reshape(heads) * scale


def group_eta(max_logits: torch.Tensor, groups: int, threshold: float) -> torch.Tensor:
    """eta per query group: threshold / (the max logit of its heads) where that exceeds the threshold, else 1.
    (Megatron's clamp(threshold / max, max=1) is the same for a finite positive max; a group whose max is
    negative, NaN or infinite here keeps eta 1, where the clamp gave a negative or NaN scale once another group
    was clipped, and eta 0 for +inf: every query and key row of the group zeroed.)"""
    grouped = max_logits.float().view(groups, -1).amax(dim=1)
    clipped = torch.isfinite(grouped) & (grouped > threshold)
    return torch.where(clipped, threshold / grouped, torch.ones_like(grouped))


def qkv_row_scale_parts(eta: torch.Tensor, parts: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """A weight's factor per row where each of eta's groups (or heads) owns consecutive rows, parts of them: (rows,
    that part's factor per group) in order."""
    return torch.cat([f.unsqueeze(1).expand(-1, n) for n, f in parts], dim=1).reshape(-1)


def qkv_row_scale(eta: torch.Tensor, heads_per_group: int, gates: int, head_dim: int, alpha: float) -> torch.Tensor:
    """The per-row factor of this rank's fused QKV weight (rows grouped per query group: its query heads, its gate
    heads, its key head, its value head; models/attention.py): query rows eta^alpha, key rows eta^(1 - alpha),
    gates and values 1."""
    ones = torch.ones_like(eta)
    parts = [(heads_per_group, eta.pow(alpha)), (gates, ones), (1, eta.pow(1.0 - alpha)), (1, ones)]
    return qkv_row_scale_parts(eta, [(heads * head_dim, f) for heads, f in parts])
