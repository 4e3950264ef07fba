"""The zigzag split of a sequence over CP ranks: cut into 2 x CP equal chunks, rank r holds chunks r and
2·CP−1−r, so under a causal mask every rank has the same amount of attention work (an early chunk, little
to look at, paired with a late one, much to look at)."""

from __future__ import annotations

import torch


def zigzag_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions rank `rank` holds, in its local order."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context-parallel size {2 * cp}")
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def gathered_positions(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """Global positions of the sequence concatenated from every rank's local part, in rank order."""
    return torch.cat([zigzag_positions(seq_len, cp, r, device) for r in range(cp)])


def split_sequence(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This rank's zigzag part of `x` along `dim` (the full sequence)."""
    return x.index_select(dim, zigzag_positions(x.shape[dim], cp, rank, x.device))


def unsplit_sequence(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The inverse: every rank's part (in rank order) back to the sequence in natural order."""
    cp = len(parts)
    gathered = torch.cat(parts, dim)
    order = torch.argsort(gathered_positions(gathered.shape[dim], cp, gathered.device))
    return gathered.index_select(dim, order)


def slice_batch(mb: dict[str, torch.Tensor], cp: int, rank: int) -> dict[str, torch.Tensor]:
    """A micro-batch ([batch, seq] tensors) cut to this CP rank's part, with its global position ids (RoPE
    and learned positions must see where each token really is). Document ids stay whole: attention needs every
    key's document."""
    out = dict(mb)
    b, s = mb["tokens"].shape
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(s, device=mb["tokens"].device).unsqueeze(0).expand(b, s)
    for key in out:  # (the multi-token-prediction inputs, mtp_*, are [batch, depths, seq])
        if key in ("tokens", "labels", "loss_mask", "position_ids") or key.startswith("mtp_"):
            out[key] = split_sequence(out[key], out[key].dim() - 1, cp, rank)
    return out
