"""QLoRA: the frozen base weights of the adapted layers and experts stored in NF4 (kernels/nf4.py, 4.127 bits
per parameter), dequantised on every use and again in the backward (only the layer's input is saved), so a
layer's dense weight exists only while its GEMM runs.

Each rank quantises its own shard (as tensor-parallel QLoRA does): the 64-element blocks are the same as the
full weight's wherever a shard's rows are whole multiples of 64, but the double-quantised statistics (mean
offset, 256-block maxima) are per shard."""

from __future__ import annotations

from torch import nn

from megatron_lite.kernels.nf4 import NF4Weight, quantize_nf4
from megatron_lite.moe.experts import ExpertWeight
from megatron_lite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


class NF4Storage(nn.Module):
    """An NF4Weight whose tensors are buffers (they move with the module and are counted as its memory)."""

    def __init__(self, q: NF4Weight) -> None:
        super().__init__()
        self.register_buffer("packed", q.packed)
        self.register_buffer("qabsmax", q.qabsmax)
        self.register_buffer("stats_absmax", q.stats_absmax)
        self.register_buffer("code8", q.code8)
        self.register_buffer("absmax", q.absmax)
        self.shape, self.dtype, self.blocksize, self.offset = q.shape, q.dtype, q.blocksize, q.offset

    def weight(self) -> NF4Weight:
        return NF4Weight(self.packed, self.shape, self.dtype, self.blocksize, self.absmax, self.qabsmax,
                         self.stats_absmax, self.offset, self.code8)  # fmt: skip

    def nbytes(self) -> int:
        return self.weight().nbytes()


def quantize_base(model: nn.Module) -> int:
    """Replace the frozen weight of every layer that carries LoRA adapters with its NF4 form. Returns the
    number of parameters quantised on this rank."""
    count = 0
    for module in model.modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear, ExpertWeight)) or module.lora is None:
            continue
        w = module.weight
        module.nf4 = NF4Storage(quantize_nf4(w.detach()))
        count += w.numel()
        del module._parameters["weight"]
        module.weight = None
    return count


def nf4_bytes(model: nn.Module) -> int:
    return sum(m.nbytes() for m in model.modules() if isinstance(m, NF4Storage))
