"""--ckpt-fully-parallel-load (Megatron's FullyParallelLoadStrategyWrapper): the ranks that hold the same tensor
split its reading, then all-gather the parts, so at DP=64 a replicated weight's bytes leave the filesystem once,
not 64 times.

Who shares: for dense tensors the data-parallel group with context parallelism folded in (Megatron's
parallelization group, get_data_parallel_group(with_context_parallel=True)), for experts the expert-data-parallel
group: the groups whose members hold the same pieces (parameters.replica_group). Both are the LOADING layout's,
so a checkpoint saved under another layout splits as well: each rank reads, from whichever stored pieces cover
them, the boxes of its own tensor's share.

The split needs no communication: every member of a group holds the same replicated tensors in the same order,
and each tensor's flat range is cut into equal consecutive parts, the group's rank r reading the r-th (balanced
by bytes to within an element per tensor, where Megatron hands whole tensors out greedily). All reads happen
before load_checkpoint's agreement step, so a missing or corrupt file stops every rank before any exchange; the
exchange (all-gathers of byte buckets on the training device) comes after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lite.checkpoint.reader import Reader
from megatron_lite.optimizer.optimizer import any_rank
from megatron_lite.parallel_context import Group, ParallelContext
from megatron_lite.parameters import ParamMeta
from megatron_lite.tensor_parallel.mappings import all_gather_tensor

# Bytes one all-gather brings to each rank at most (a tensor larger than that goes alone): the exchange's
# temporary device memory, whatever the model's size.
BUCKET_BYTES = 1 << 30


@dataclass
class _Share:
    target: torch.Tensor  # the whole tensor this rank ends up holding (a parameter, an optimizer-state range)
    part: torch.Tensor  # the flat part of it this rank read, in the target's dtype
    then: Callable[[torch.Tensor], None] | None  # run once the target is whole


def _span(n: int, group: Group, rank: int) -> tuple[int, int]:
    return n * rank // group.size, n * (rank + 1) // group.size


class SplitLoad:
    """The replicated tensors of one load: `fill` and `read_flat` read this rank's part (or the whole tensor when
    off, or alone in its group) and `exchange`, after the load's agreement, makes each whole on every rank."""

    def __init__(self, ctx: ParallelContext, enabled: bool) -> None:
        self.ctx = ctx
        self.groups: dict[bool, Group] = {False: ctx.dp_cp, True: ctx.edp} if enabled else {}
        self._shares: dict[bool, list[_Share]] = {False: [], True: []}

    def _group(self, meta: ParamMeta) -> Group | None:
        group = self.groups.get(meta.expert)
        return group if group is not None and group.size > 1 else None

    def fill(self, reader: Reader, name: str, target: torch.Tensor, meta: ParamMeta, then=None) -> None:
        """Reader.fill of a tensor every member of its replica group holds whole (`then(target)` once it is)."""
        group = self._group(meta)
        if group is None:
            reader.fill(name, target, meta)
            if then is not None:
                then(target)
            return
        lo, hi = _span(target.numel(), group, group.rank)
        part = reader.read_flat(name, tuple(target.shape), meta, lo, hi, dtype=target.dtype)
        self._shares[meta.expert].append(_Share(target, part, then))

    def read_flat(
        self, reader: Reader, name: str, shape: tuple[int, ...], meta: ParamMeta, lo: int, hi: int, replicated: bool
    ) -> torch.Tensor:
        """Reader.read_flat, the range split when `replicated` (an optimizer every data-parallel rank keeps whole);
        the returned tensor holds its values once `exchange` has run."""
        group = self._group(meta) if replicated else None
        if group is None:
            return reader.read_flat(name, shape, meta, lo, hi)
        out = torch.zeros(hi - lo, dtype=torch.float32)
        a, b = _span(hi - lo, group, group.rank)
        self._shares[meta.expert].append(_Share(out, reader.read_flat(name, shape, meta, lo + a, lo + b), None))
        return out

    def exchange(self) -> None:
        """All-gather the parts within each group (every rank calls it, after the load's agreement). The groups'
        members first compare how many tensors and bytes they hold to exchange: a difference (a bug: the members
        of a group hold the same tensors) stops every rank, where mismatched all-gathers would hang or mix bytes."""
        active = [(expert, g) for expert, g in self.groups.items() if g.size > 1]
        if not active:  # (the flag off, or no replicas: no collective, as before the flag)
            return
        mismatch = False
        for expert, group in active:
            shares = self._shares[expert]
            count, size = len(shares), sum(s.target.numel() * s.target.element_size() for s in shares)
            t = torch.tensor([count, size, -count, -size], dtype=torch.int64, device=self.ctx.device)
            with group.blocked():
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.pg)
            mismatch |= t[0].item() != -t[2].item() or t[1].item() != -t[3].item()
        if any_rank(mismatch, self.ctx):
            raise RuntimeError(
                "--ckpt-fully-parallel-load: the ranks of a data-parallel group hold different tensors to load (a "
                "bug: load without the flag)"
            )
        for expert, group in active:
            for bucket in _buckets(self._shares[expert], group.size):
                self._gather(bucket, group)
            self._shares[expert] = []

    def _gather(self, bucket: list[_Share], group: Group) -> None:
        slots = [_slot_bytes(s, group.size) for s in bucket]
        mine = torch.zeros(sum(slots), dtype=torch.uint8)
        at = 0
        for s, slot in zip(bucket, slots):
            data = s.part.reshape(-1).view(torch.uint8)
            mine[at : at + data.numel()] = data
            at += slot
        mine = mine.to(self.ctx.device)
        every = torch.empty(group.size * mine.numel(), dtype=torch.uint8, device=self.ctx.device)
        with group.blocked():
            all_gather_tensor(every, mine, group=group.pg)
        every = every.view(group.size, -1)
        at = 0
        for s, slot in zip(bucket, slots):
            n, size = s.target.numel(), s.target.element_size()
            rows = []
            for r in range(group.size):
                lo, hi = _span(n, group, r)
                rows.append(every[r, at : at + (hi - lo) * size])
            with torch.no_grad():
                s.target.copy_(torch.cat(rows).view(s.target.dtype).view(s.target.shape))
            if s.then is not None:
                s.then(s.target)
            at += slot


def _slot_bytes(share: _Share, ranks: int) -> int:
    """Room for the largest rank's part: every rank packs the same slots, so the all-gather's sizes agree."""
    return -(-share.target.numel() // ranks) * share.target.element_size()


def _buckets(shares: list[_Share], ranks: int) -> list[list[_Share]]:
    """Consecutive shares, each bucket's gathered bytes at most BUCKET_BYTES (or one share)."""
    out: list[list[_Share]] = []
    room = 0
    for s in shares:
        need = _slot_bytes(s, ranks) * ranks
        if not out or room < need:
            out.append([])
            room = BUCKET_BYTES
        out[-1].append(s)
        room -= need
    return out
