"""Boxes: how a rank's part of a tensor maps onto the full tensor a checkpoint stores.

A checkpoint piece is a box of the full, unpadded tensor: a start and a length along every dimension. A
rank's tensor-parallel slice maps onto one box per shard block (fused tensors such as QKV or SwiGLU's fc1
have several blocks; vocabulary padding maps to none). A flat range of that slice (what the distributed
optimizer, ZeRO-1, owns of a parameter: its bucket's equal part, which cuts rows anywhere) is a partial first
row, whole rows and a partial last row (recursively, for more dimensions): a handful of boxes. So each rank
writes only what it owns and reads only what it needs, and the stored pieces stay the full tensor's, readable
under any other layout.
"""

from __future__ import annotations

import math

import torch

from megatron_lite.checkpoint.format import local_pieces
from megatron_lite.parameters import ParamMeta

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (starts, lengths), one of each per dimension


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """The boxes of a tensor of `shape` whose elements are the flat (row-major) range [lo, hi), in flat order:
    each box is itself a contiguous flat range."""
    if hi <= lo:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    first, last = lo // inner, (hi - 1) // inner  # the rows the range touches
    out: list[Box] = []

    def row_part(row: int, a: int, b: int) -> None:  # [a, b) within one row
        if a == 0 and b == inner:
            out.append(((row, *[0] * (len(shape) - 1)), (1, *shape[1:])))
            return
        for starts, lengths in flat_boxes(shape[1:], a, b):
            out.append(((row, *starts), (1, *lengths)))

    if first == last:
        row_part(first, lo - first * inner, hi - first * inner)
        return out
    whole_from, whole_to = first, last + 1  # the rows wholly inside [lo, hi)
    if lo > first * inner:
        row_part(first, lo - first * inner, inner)
        whole_from = first + 1
    if hi < (last + 1) * inner:
        whole_to = last
    if whole_to > whole_from:
        out.append(((whole_from, *[0] * (len(shape) - 1)), (whole_to - whole_from, *shape[1:])))
    if whole_to == last:
        row_part(last, 0, hi - last * inner)
    return out


def flat_start(shape: tuple[int, ...], starts: tuple[int, ...]) -> int:
    """The flat (row-major) index of the element at `starts`."""
    at = 0
    for size, s in zip(shape, starts):
        at = at * size + s
    return at


def to_full(shape: tuple[int, ...], meta: ParamMeta, box: Box) -> list[tuple[Box, tuple[int, ...]]]:
    """The parts of a box of this rank's tensor (its local `shape`) that hold real elements of the full tensor,
    each as (its box within the local one, relative starts; and its starts in the full tensor). Padding
    (vocabulary rows past the real ones) falls in none."""
    starts, lengths = box
    out = []
    for pc in local_pieces(shape, meta):
        d = pc.dim
        a = max(starts[d], pc.local_start)
        b = min(starts[d] + lengths[d], pc.local_start + pc.length)
        if b <= a:
            continue
        rel = tuple(a - starts[d] if i == d else 0 for i in range(len(shape)))
        lens = tuple(b - a if i == d else n for i, n in enumerate(lengths))
        full = tuple(pc.full_start + a - pc.local_start if i == d else s for i, s in enumerate(starts))
        out.append(((rel, lens), full))
    return out


def flat_parts(flat: torch.Tensor, shape: tuple[int, ...], meta: ParamMeta, lo: int):
    """The parts of `flat` (the flat range [lo, lo + len) of this rank's tensor of `shape`) that hold real elements
    of the full tensor: (a view of `flat` shaped as the part, its starts in the full tensor). The views write
    through, so a reader fills `flat` through them and a writer copies them out."""
    for starts, lengths in flat_boxes(shape, lo, lo + flat.numel()):
        at = flat_start(shape, starts) - lo
        box = flat[at : at + math.prod(lengths)].view(lengths)
        for (rel, lens), full in to_full(shape, meta, (starts, lengths)):
            yield box[box_slices(rel, lens)], full


def box_slices(starts: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(s, s + n) for s, n in zip(starts, lengths))


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None."""
    starts, lengths = [], []
    for sa, la, sb, lb in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(sa, sb), min(sa + la, sb + lb)
        if hi <= lo:
            return None
        starts.append(lo)
        lengths.append(hi - lo)
    return tuple(starts), tuple(lengths)
