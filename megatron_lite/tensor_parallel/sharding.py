"""How a tensor-parallel parameter relates to the full, layout-free tensor.

A sharded parameter is the concatenation, along one dimension, of one or more logical blocks (QKV grouped
per query group is one block; SwiGLU's fc1 is two, gate then up; a vocabulary is one block padded so TP
divides it). Each block is split evenly across the TP ranks and a rank holds its slice of every block.
The same description serves initialisation (every rank cuts its shard out of the full tensor, so the
same seed gives the same model at any TP), tests (reassemble the full gradient from the shards) and
checkpoints (store the full, unpadded form).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    dim: int  # the dimension split across TP ranks
    sizes: tuple[int, ...]  # logical size of each block along `dim` (unpadded)
    padded_sizes: tuple[int, ...]  # size of each block after padding; each divisible by the TP size
    tp_size: int

    def __post_init__(self) -> None:
        for s, p in zip(self.sizes, self.padded_sizes):
            if p < s or p % self.tp_size:
                raise ValueError(f"block of {s} padded to {p} cannot be split over {self.tp_size} ranks")

    @staticmethod
    def even(dim: int, sizes: tuple[int, ...] | int, tp_size: int) -> ShardSpec:
        sizes = (sizes,) if isinstance(sizes, int) else tuple(sizes)
        return ShardSpec(dim, sizes, sizes, tp_size)

    @property
    def full_size(self) -> int:
        return sum(self.sizes)

    @property
    def shard_size(self) -> int:
        return sum(self.padded_sizes) // self.tp_size

    def full_shape(self, shard_shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
        shape = list(shard_shape)
        shape[self.dim] = self.full_size
        return tuple(shape)

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's shard of the full (unpadded) tensor; padding rows are zero."""
        if full.shape[self.dim] != self.full_size:
            raise ValueError(f"expected size {self.full_size} along dim {self.dim}, got {tuple(full.shape)}")
        pieces = []
        for block, size, padded in zip(full.split(list(self.sizes), dim=self.dim), self.sizes, self.padded_sizes):
            step = padded // self.tp_size
            lo, hi = rank * step, (rank + 1) * step
            real = block.narrow(self.dim, min(lo, size), max(0, min(hi, size) - lo))
            pad = hi - lo - real.shape[self.dim]
            if pad:
                pad_shape = list(block.shape)
                pad_shape[self.dim] = pad
                real = torch.cat([real, block.new_zeros(pad_shape)], dim=self.dim)
            pieces.append(real)
        return torch.cat(pieces, dim=self.dim) if len(pieces) > 1 else pieces[0].clone()

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full (unpadded) tensor from every rank's shard, in TP rank order."""
        if len(shards) != self.tp_size:
            raise ValueError(f"expected {self.tp_size} shards, got {len(shards)}")
        steps = [p // self.tp_size for p in self.padded_sizes]
        per_rank = [s.split(steps, dim=self.dim) for s in shards]
        blocks = []
        for b, size in enumerate(self.sizes):
            padded = torch.cat([pieces[b] for pieces in per_rank], dim=self.dim)
            blocks.append(padded.narrow(self.dim, 0, size))
        return torch.cat(blocks, dim=self.dim)

    def padding_mask(self, rank: int) -> torch.Tensor:
        """True at the positions along `dim` of this rank's shard that hold real (not padding) data."""
        parts = []
        for size, padded in zip(self.sizes, self.padded_sizes):
            step = padded // self.tp_size
            parts.append(torch.arange(rank * step, (rank + 1) * step) < size)
        return torch.cat(parts)
