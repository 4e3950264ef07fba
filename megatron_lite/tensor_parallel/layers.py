"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Each layer registers a ParamMeta per parameter (megatron_lite/parameters.py): how the local tensor is cut
from the full one (ShardSpec), how the full tensor is initialised, and whether its gradient is partial
under sequence parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.kernels.nf4 import nf4_linear
from megatron_lite.parallel_context import Group
from megatron_lite.parameters import ParamMeta, set_param_meta
from megatron_lite.tensor_parallel.fp8 import fp8_linear
from megatron_lite.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_lite.tensor_parallel.overlap import column_parallel_overlapped, row_parallel_overlapped
from megatron_lite.tensor_parallel.sharding import ShardSpec


def _add_param(module: nn.Module, name: str, shape: tuple[int, ...], device, dtype, meta: ParamMeta) -> None:
    setattr(module, name, nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))
    set_param_meta(module, name, meta)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by rows (output features) across TP: each rank computes its slice
    of the output features. Under sequence parallelism the input arrives sharded along the sequence
    and is all-gathered first (its gradient reduce-scattered back).

    `output_size` may be a list of logical blocks stacked along the output dimension (SwiGLU's gate
    and up): each block is split across ranks separately, so a rank holds [gate_r; up_r].
    `padded_output_size` pads a single block (the vocabulary) so TP divides it."""

    def __init__(
        self,
        input_size: int,
        output_size: int | Sequence[int],
        tp: Group,
        *,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        padded_output_size: int | None = None,
        skip_weight_param_allocation: bool = False,
        comm_overlap: bool = False,
        triton_gemm: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        sizes = (output_size,) if isinstance(output_size, int) else tuple(output_size)
        padded = (padded_output_size,) if padded_output_size is not None else sizes
        if padded_output_size is not None and len(sizes) != 1:
            raise ValueError("padded_output_size applies to a single output block")
        self.tp = tp
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and tp.size > 1
        # --tp-comm-overlap: the input's all-gather runs as a ring, chunk by chunk under the GEMM.
        self.comm_overlap = comm_overlap and self.sequence_parallel
        self.triton_gemm = triton_gemm  # the overlapped ring's per-chunk GEMMs through our Triton kernel
        self.spec = ShardSpec(0, sizes, padded, tp.size)
        self.lora = None  # LoRA adapters (megatron_lite/lora), when fine-tuning with them
        self.nf4 = None  # QLoRA: the frozen weight stored in NF4 instead of `weight`
        self.fp8 = None  # an Fp8Setting: the GEMM in fp8 (tensor_parallel/fp8.py enable_fp8)
        self.fp8_state = None  # and its Fp8State under delayed scaling
        out_local = self.spec.shard_size
        if skip_weight_param_allocation:
            self.weight = None
        else:
            meta = ParamMeta(init=("normal", init_std), shard=self.spec, shard_rank=tp.rank)
            _add_param(self, "weight", (out_local, input_size), device, dtype, meta)
        if bias:
            _add_param(self, "bias", (out_local,), device, dtype, ParamMeta(("zeros",), self.spec, tp.rank))
        else:
            self.bias = None

    def gather_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input as every TP rank needs it: all-gathered along the sequence under sequence parallelism
        (gradient reduce-scattered back), else as is (gradient all-reduced)."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(x, self.tp)
        return copy_to_tensor_model_parallel_region(x, self.tp)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        if weight is None and self.nf4 is None:
            raise ValueError("ColumnParallelLinear built with skip_weight_param_allocation needs `weight`")
        if self.comm_overlap:
            y = column_parallel_overlapped(x, weight, self.tp, self.triton_gemm)
            y = y if self.bias is None else y + self.bias
        else:
            x_full = self.gather_input(x)
            if self.nf4 is not None:  # QLoRA: the frozen weight in NF4, dequantised as it is used
                y = nf4_linear(x_full, self.nf4.weight()) + (0 if self.bias is None else self.bias)
            elif self.fp8 is not None:  # (the input is whole on every TP rank; weight and output are split)
                split = self.tp if self.tp.size > 1 else None
                y = fp8_linear(x_full, weight, self.fp8, w_split=split, g_split=split, state=self.fp8_state)
                y = y if self.bias is None else y + self.bias
            else:
                y = F.linear(x_full, weight, self.bias)
            if self.lora is not None:  # the adapters read the same (gathered) input: one reduction of its grad
                y = y + self.lora(x_full)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.tp)
            if len(self.spec.sizes) > 1 and self.tp.size > 1:  # ranks' [a_r; b_r] pieces back to [a; b]
                out = ShardSpec(y.dim() - 1, self.spec.sizes, self.spec.padded_sizes, self.tp.size)
                y = out.unshard(list(y.chunk(self.tp.size, dim=-1)))
        return y


class ColumnParallelLinearGathered(ColumnParallelLinear):
    """Megatron's linear replacement of a heterogeneous layer's attention or MLP (heterogeneous/
    linear_replacements.py): a [hidden -> hidden] column-parallel linear whose output is gathered whole on each TP
    rank; under sequence parallelism each rank then keeps its own sequence shard (Megatron pads and
    reduce-scatters, which gives the same). It takes the attention's extra arguments and ignores them."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        y = gather_from_tensor_model_parallel_region(super().forward(x), self.tp)
        return scatter_to_sequence_parallel_region(y, self.tp) if self.sequence_parallel else y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by columns (input features) across TP: each rank multiplies its
    slice of the input features and the partial outputs are summed (all-reduce), or, under sequence
    parallelism, summed and scattered along the sequence (reduce-scatter). The bias is added once,
    after the reduction."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp: Group,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        comm_overlap: bool = False,
        triton_gemm: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence parallelism needs input_is_parallel=True")
        self.tp = tp
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and tp.size > 1
        # --tp-comm-overlap: the output's reduce-scatter runs as a ring, chunk by chunk under the GEMM.
        self.comm_overlap = comm_overlap and self.sequence_parallel
        self.triton_gemm = triton_gemm
        self.spec = ShardSpec.even(1, input_size, tp.size)
        self.lora = None  # LoRA adapters (megatron_lite/lora), when fine-tuning with them
        self.nf4 = None  # QLoRA: the frozen weight stored in NF4 instead of `weight`
        self.fp8 = None  # an Fp8Setting: the GEMM in fp8 (tensor_parallel/fp8.py enable_fp8)
        self.fp8_state = None  # and its Fp8State under delayed scaling
        meta = ParamMeta(init=("normal", init_std), shard=self.spec, shard_rank=tp.rank)
        _add_param(self, "weight", (output_size, self.spec.shard_size), device, dtype, meta)
        if bias:
            meta = ParamMeta(init=("zeros",), sequence_parallel=self.sequence_parallel)
            _add_param(self, "bias", (output_size,), device, dtype, meta)
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp)
        if self.comm_overlap:
            y = row_parallel_overlapped(x, self.weight, self.tp, self.triton_gemm)
        else:
            if self.nf4 is not None:  # QLoRA: the frozen weight in NF4, dequantised as it is used
                partial = nf4_linear(x, self.nf4.weight())
            elif self.fp8 is not None:  # (the input and weight are split; the output's gradient is whole)
                split = self.tp if self.tp.size > 1 else None
                partial = fp8_linear(x, self.weight, self.fp8, x_split=split, w_split=split, state=self.fp8_state)
            else:
                partial = F.linear(x, self.weight)
            if self.lora is not None:  # summed by the layer's own reduction
                partial = partial + self.lora(x)
            if self.sequence_parallel:
                y = reduce_scatter_to_sequence_parallel_region(partial, self.tp)
            else:
                y = reduce_from_tensor_model_parallel_region(partial, self.tp)
        return y if self.bias is None else y + self.bias


def _indexed(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight[ids]


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows across TP. Each rank looks up the ids in its range
    (zeros elsewhere) and the partial results are summed across TP; with `reduce_scatter_embeddings`
    the sum is also scattered along the sequence (sequence parallelism).

    Input ids are [batch, seq]; output is [seq, batch, hidden] (the layout of the residual stream).
    The table is padded to `padded_vocab_size` (a multiple of TP); padded rows are zero and never
    looked up."""

    def __init__(
        self,
        vocab_size: int,
        padded_vocab_size: int,
        hidden_size: int,
        tp: Group,
        *,
        reduce_scatter_embeddings: bool = False,
        init_std: float = 0.02,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.spec = ShardSpec(0, (vocab_size,), (padded_vocab_size,), tp.size)
        self.vocab_start = tp.rank * self.spec.shard_size
        self.vocab_end = self.vocab_start + self.spec.shard_size
        self.reduce_scatter_embeddings = reduce_scatter_embeddings and tp.size > 1
        meta = ParamMeta(init=("normal", init_std), shard=self.spec, shard_rank=tp.rank)
        _add_param(self, "weight", (self.spec.shard_size, hidden_size), device, dtype, meta)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.t()
        # --deterministic-mode (torch's deterministic algorithms): indexing, as Megatron-Core's deterministic_mode
        # does ("F.embedding currently has a non-deterministic backward"): its backward is index_put_ with
        # accumulation, which torch then sums in a fixed order
        lookup = _indexed if torch.are_deterministic_algorithms_enabled() else F.embedding
        if self.tp.size > 1:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            out = lookup(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = lookup(ids, self.weight)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp)
        return reduce_from_tensor_model_parallel_region(out, self.tp)
