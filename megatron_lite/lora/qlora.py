"""QLoRA: the frozen base weights of the adapted layers and experts stored in NF4 (kernels/nf4.py, 4.127 bits
per parameter), dequantised on every use and again in the backward (only the layer's input is saved), so a
layer's dense weight exists only while its GEMM runs.

A tensor-parallel shard is quantised as its part of the full weight, so the model computes the same at any TP
size: its 64-value blocks are blocks of the full weight (each lies in one row of one shard when the shards' row
widths are multiples of 64), and the double quantisation's statistics (the mean of the block maxima, the maximum
of each 256 blocks) are the full weight's, from its block maxima summed over the TP group (each block is one
rank's, the others add zeros). Where blocks would straddle shards, a shard is quantised on its own (as
tensor-parallel QLoRA elsewhere does) and start-up says so: its NF4 rounding then depends on the TP size."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.kernels.nf4 import BLOCKSIZE, NF4Weight, double_quantize, quantize_nf4
from megatron_lite.moe.experts import ExpertWeight
from megatron_lite.parameters import param_meta
from megatron_lite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


class NF4Storage(nn.Module):
    """An NF4Weight whose tensors are buffers (they move with the module and are counted as its memory)."""

    def __init__(self, q: NF4Weight) -> None:
        super().__init__()
        for name in ("packed", "qabsmax", "stats_absmax", "code8", "absmax", "block_rows", "block_cols"):
            self.register_buffer(name, getattr(q, name))
        self.shape, self.dtype, self.blocksize, self.offset = q.shape, q.dtype, q.blocksize, q.offset
        self.blocks_per_row = q.blocks_per_row

    def weight(self) -> NF4Weight:
        return NF4Weight(self.packed, self.shape, self.dtype, self.blocksize, self.absmax, self.qabsmax,
                         self.stats_absmax, self.offset, self.code8, self.block_rows, self.block_cols,
                         self.blocks_per_row)  # fmt: skip

    def nbytes(self) -> int:
        return self.weight().nbytes()


def _full_indices(w: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None:
    """(the full weight's row of each of this shard's rows, its column of each column, its shape), or None when
    the weight is whole or its blocks would not be whole blocks of the full weight."""
    spec = meta.shard
    if spec is None or spec.tp_size == 1 or w.dim() != 2 or spec.sizes != spec.padded_sizes:
        return None
    full = torch.arange(spec.full_size, device=w.device)
    local = spec.shard(full.view(-1, 1) if spec.dim == 0 else full.view(1, -1), meta.shard_rank).reshape(-1)
    rows = local if spec.dim == 0 else torch.arange(w.shape[0], device=w.device)
    cols = local if spec.dim == 1 else torch.arange(w.shape[1], device=w.device)
    full_rows, width = spec.full_shape(w.shape)
    if w.shape[1] % BLOCKSIZE or width % BLOCKSIZE:
        return None
    starts = cols.view(-1, BLOCKSIZE)
    if (starts[:, 0] % BLOCKSIZE).any() or (starts != starts[:, :1] + torch.arange(BLOCKSIZE, device=w.device)).any():
        return None
    return rows, cols, (full_rows, width)


def quantize_shard(w: torch.Tensor, meta, group) -> NF4Weight | None:
    """This rank's shard of a tensor-parallel weight in NF4, quantised as part of the full weight (the same
    codes and block scales the full weight's quantisation gives these values); None where that cannot be."""
    found = _full_indices(w, meta)
    if found is None:
        return None
    rows, cols, (full_rows, width) = found
    q = quantize_nf4(w, double_quant=False)  # codes and maxima of blocks that are the full weight's blocks
    per_row = width // BLOCKSIZE
    block_cols = cols[::BLOCKSIZE] // BLOCKSIZE
    index = (rows[:, None] * per_row + block_cols[None, :]).reshape(-1)
    absmax = torch.zeros(full_rows * per_row, device=w.device)
    absmax[index] = q.absmax
    dist.all_reduce(absmax, group=group.pg)  # every block is one rank's: the full weight's maxima, exactly
    qabsmax, stats, offset, code8 = double_quantize(absmax)
    same_rows = meta.shard.dim == 1  # (a row-parallel shard keeps every row: no map to store)
    return NF4Weight(q.packed, w.shape, w.dtype, BLOCKSIZE, None, qabsmax[index], stats, offset, code8,
                     None if same_rows else rows.int(), block_cols.int(), per_row)  # fmt: skip


def quantize_base(model: nn.Module, ctx) -> tuple[int, list[str]]:
    """Replace the frozen weight of every layer that carries LoRA adapters with its NF4 form. Returns the
    number of parameters quantised on this rank and the weights quantised per shard (whose rounding depends on
    the TP size). Collective over the (expert-)tensor-parallel group: every rank of it calls this."""
    count, per_shard = 0, []
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear, ExpertWeight)) or module.lora is None:
            continue
        w, meta = module.weight.detach(), param_meta(module, "weight")
        q = None
        if meta.tensor_parallel:
            q = quantize_shard(w, meta, ctx.etp if meta.expert else ctx.tp)
            if q is None:
                per_shard.append(f"{name}.weight")
        module.nf4 = NF4Storage(q if q is not None else quantize_nf4(w))
        count += w.numel()
        del module._parameters["weight"]
        module.weight = None
    return count, per_shard


def nf4_bytes(model: nn.Module) -> int:
    return sum(m.nbytes() for m in model.modules() if isinstance(m, NF4Storage))
