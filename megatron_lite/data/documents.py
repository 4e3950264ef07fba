"""Document boundaries inside a packed sample (Megatron's --reset-position-ids / --reset-attention-mask).

A sample is seq_length tokens cut from a stream of documents, each ending with the end-of-document token. As
in Megatron (`_get_ltor_masks_and_position_ids`), the EOD token belongs to the document it ends, and the next
document starts right after it: its positions count from 0 again, and its tokens attend only to its own."""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """The document each token belongs to, numbered from 0 within the sample, shaped like `tokens` [..., seq]:
    the number of EOD tokens before it."""
    ends = (tokens == eod).long()
    return torch.cumsum(ends, dim=-1) - ends


def document_position_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Each token's position inside its own document (0 at every document's first token)."""
    seq = tokens.shape[-1]
    pos = torch.arange(seq, device=tokens.device).expand_as(tokens)
    ends = tokens == eod
    # the first position of each token's document: one past the latest EOD before it (0 when there is none)
    start = torch.where(ends, pos + 1, torch.zeros_like(pos))
    start = torch.cummax(start, dim=-1).values
    start = torch.cat([torch.zeros_like(start[..., :1]), start[..., :-1]], dim=-1)
    return pos - start
