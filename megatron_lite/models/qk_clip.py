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
other paths (SDPA, attention dropout, --softmax-type offsets) compute the logits a second time, beside the
attention (no_grad, fp32, `MAX_LOGIT_ELEMENTS` logits at a time, so the [seq, seq] scores of all heads are never
held at once): one more q.k^T matmul per layer forward, about a seventh of attention's training FLOPs (forward
q.k^T and p.v, backward about five such products), and up to 64 MiB of scratch.
"""

from __future__ import annotations

import math
import warnings

import torch

from megatron_lite.config import ConfigError, ModelConfig

MAX_LOGIT_ELEMENTS = 1 << 24  # fp32 logits held at once while taking the max (64 MiB)


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
    norm = "--qk-layernorm" if c.qk_layernorm else "--qk-l2-norm" if c.qk_l2_norm else None
    if c.qk_clip and norm and not c.multi_latent_attention:
        # Accepted, as Megatron accepts it (Megatron users run the pair), but the per-head norm undoes any row
        # scale: the clipped rows shrink at every step over the threshold while the logits stay. (MLA's norms sit
        # on the latents, before the clipped up-projections: unaffected.)
        warnings.warn(
            f"--qk-clip with {norm}: the norm undoes the clip's row scale, so it bounds no logit (the query and key "
            "rows shrink at each clipped step instead); Megatron does the same",
            stacklevel=2,
        )


@torch.no_grad()
def max_attention_logits(q: torch.Tensor, k: torch.Tensor, scale: float, visible: torch.Tensor | None) -> torch.Tensor:
    """The largest q.k * scale per query head over the batch and the visible pairs: [heads] fp32 (-inf for a head
    that sees no key). q [batch, seq_q, heads, d]; k [batch, seq_k, kv_heads, d] (query head i reads key head
    i // (heads / kv_heads)); `visible` [seq_q, seq_k] or [batch, 1, seq_q, seq_k] (True = visible), or None for
    the causal square."""
    b, s, heads, d = q.shape
    sk, groups = k.shape[1], k.shape[2]
    rep = heads // groups
    keys = k.float()
    out = torch.full((heads,), -math.inf, dtype=torch.float32, device=q.device)
    rows = max(1, MAX_LOGIT_ELEMENTS // max(1, b * heads * sk))
    key_pos = torch.arange(sk, device=q.device)
    for i in range(0, s, rows):
        n = min(rows, s - i)
        qi = q[:, i : i + n].float().reshape(b, n, groups, rep, d)
        logits = torch.einsum("bqgrd,bkgd->bgrqk", qi, keys) * scale  # [b, groups, rep, n, sk]
        if visible is None:  # (bottom-right causal, as the attention's: here seq_q == seq_k)
            vis = key_pos.unsqueeze(0) <= torch.arange(i, i + n, device=q.device).unsqueeze(1) + (sk - s)
        else:
            vis = visible[..., i : i + n, :]
            vis = vis.unsqueeze(2) if vis.dim() == 4 else vis  # [b, 1, 1, n, sk] against [b, g, rep, n, sk]
        logits = logits.masked_fill(~vis, -math.inf)
        out = torch.maximum(out, logits.amax(dim=(0, 3, 4)).reshape(heads))
    return out


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
    per_head = [eta.pow(alpha)] * heads_per_group + [ones] * gates + [eta.pow(1.0 - alpha), ones]
    return torch.stack(per_head, dim=1).repeat_interleave(head_dim, dim=1).reshape(-1)
