"""Document boundaries inside a packed sample (Megatron's --reset-position-ids / --reset-attention-mask).

A sample is seq_length tokens cut from a stream of documents, each ending with the end-of-document token. As
in Megatron (`_get_ltor_masks_and_position_ids`), the EOD token belongs to the document it ends, and the next
document starts right after it: its positions count from 0 again, and its tokens attend only to its own."""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """The document each token belongs to, numbered from 0 within the sample, shaped like `tokens` [..., seq]:
    the number of EOD tokens before it."""
    return ids_from_starts(_starts(tokens, eod))


def document_position_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Each token's position inside its own document (0 at every document's first token)."""
    return positions_from_starts(_starts(tokens, eod))


def _starts(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """True where a document starts after an EOD (one past each EOD)."""
    ends = tokens == eod
    return torch.cat([torch.zeros_like(ends[..., :1]), ends[..., :-1]], dim=-1)


def ids_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """Each token's document, from a mask of where documents start [..., seq] (the first token opens one in any
    case): the starts up to it after the first. (--sft marks the conversations a line packs so: an EOD may
    stand inside one, as a Llama-2 chat's reply ends.)"""
    return torch.cumsum(starts.long(), dim=-1) - starts[..., :1].long()


def positions_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its own document, from the mask of where documents start."""
    pos = torch.arange(starts.shape[-1], device=starts.device).expand_as(starts)
    # the first position of each token's document: the latest start up to it (0 when there is none)
    return pos - torch.cummax(torch.where(starts, pos, torch.zeros_like(pos)), dim=-1).values
