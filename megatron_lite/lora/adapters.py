"""LoRA (Hu et al. 2021) inside the parallel linear layers: y = W x + (alpha / r) B A x, W frozen.

Column-parallel layer (output split over TP): A [r, in] is replicated and B [out / TP, r] split like the
output. Each rank's B sees only its output slice, so A's gradient is partial on each rank and summed over
TP (it is marked like a sequence-parallel weight). The input is the layer's own (all-gathered under SP),
so the input gradient of the LoRA path joins the layer's own reduction.
Row-parallel layer (input split over TP): A [r, in / TP] split like the input and B [out, r] replicated;
the LoRA output is added to this rank's partial output before the layer's reduction (all-reduce or
reduce-scatter), which therefore sums it too: B's gradient is partial and summed over TP.
That one all-reduce of the replicated matrix's gradient is the only communication LoRA adds.

Fused layers carry one adapter per projection, as PEFT has them per Hugging Face module: the QKV layer q, k
and v (their outputs placed into the grouped layout), SwiGLU's fc1 gate and up. A routed expert carries one
adapter on fc1 (gate and up together, as PEFT adapts Hugging Face's fused experts.gate_up_proj) and one on
fc2, split over expert-TP like a column/row-parallel layer (fc1's B in gate and up blocks, like its weight):
the MoE layer gathers the TP group's tokens before the experts and reduces after them, the same pattern. The
replicated matrices' gradients are partial over the expert-TP group alone and summed over it (an expert-TP size
below TP gives each expert-TP group its own slice of the tokens, and the other groups' slices, or other experts,
must not be added in: tensor_parallel/grads.py); they are expert parameters, reduced over expert-DP, which adds
the slices.

--lora-dropout drops each adapter's input with a mask of its own, as PEFT's per-module dropout does. A
column-parallel layer's input is the same on every TP rank and so is its mask (the default generator, the
same across TP); a row-parallel layer's input is this rank's slice of the features, dropped with the
model-parallel generator (the expert-parallel one in an expert), which differs per rank, as Megatron draws
dropout on activations split over TP. An expert's other adapters draw from a generator of their own, alike on
every rank, not the default one (see LoRA.__init__)."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.parameters import ParamMeta, set_param_meta
from megatron_lite.tensor_parallel.sharding import ShardSpec


class LoRAPair(nn.Module):
    """A [r, in (local)] and B [out (local), r], with their sharding and initialisation (A uniform with
    PEFT's bound 1/sqrt(in), B zero, so the adapted layer starts equal to the base)."""

    def __init__(
        self, in_full: int, out_full: int | tuple[int, ...], rank: int, tp, split: str, device, dtype, expert=False
    ) -> None:
        super().__init__()
        n = tp.size
        if split == "out":  # column-parallel: B split like the output, A replicated with a partial gradient
            a_spec, b_spec = None, ShardSpec.even(0, out_full, n)  # blocks (gate, up) split each, like the weight
            a_shape, b_shape = (rank, in_full), (b_spec.shard_size, rank)
        else:  # row-parallel: A split like the input, B replicated with a partial gradient
            a_spec, b_spec = ShardSpec.even(1, in_full, n), None
            a_shape, b_shape = (rank, in_full // n), (int(out_full), rank)
        self.A = nn.Parameter(torch.empty(a_shape, device=device, dtype=dtype))
        self.B = nn.Parameter(torch.empty(b_shape, device=device, dtype=dtype))
        bound = 1.0 / math.sqrt(in_full)
        a_meta = ParamMeta(("uniform", bound), a_spec, tp.rank, sequence_parallel=a_spec is None, expert=expert)
        b_meta = ParamMeta(("zeros",), b_spec, tp.rank, sequence_parallel=b_spec is None, expert=expert)
        set_param_meta(self, "A", a_meta)
        set_param_meta(self, "B", b_meta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.A), self.B)


class LoRA(nn.Module):
    """The adapters of one parallel linear layer; `forward(x)` returns the scaled LoRA output in the layer's
    local output layout."""

    def __init__(
        self,
        in_full: int,
        outputs: dict[str, int | tuple[int, ...]],
        rank: int,
        alpha: float,
        dropout: float,
        tp,
        split: str,
        layout=None,
        device=None,
        dtype=torch.float32,
        expert: bool = False,
        rng=None,
    ) -> None:
        super().__init__()
        self.scaling = alpha / rank
        self.dropout = dropout
        # (row-parallel: the per-rank generator; `rng`, the context's tracker, is only needed then)
        self.rng = rng if split == "in" and tp.size > 1 else None
        self.rng_name = "expert-parallel" if expert else "model-parallel"
        if expert and self.rng is None:  # (an expert's adapter never draws from the default generator: at an
            # expert-TP size below TP the TP ranks route different token counts to an expert, and on CUDA a
            # dropout advances its generator by the tensor's size, so the default one, which the column-parallel
            # adapters' masks need equal across TP, would part; this one is the same on every rank, as it was)
            self.rng, self.rng_name = rng, "expert-replicated"
        self.pairs = nn.ModuleDict(
            {name: LoRAPair(in_full, out, rank, tp, split, device, dtype, expert) for name, out in outputs.items()}
        )
        self.layout = layout  # local outputs by name -> the layer's local output (fused layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout > 0 and self.training:
            with self.rng.fork(self.rng_name) if self.rng is not None else contextlib.nullcontext():
                outs = {name: pair(F.dropout(x, self.dropout)) for name, pair in self.pairs.items()}
        else:
            outs = {name: pair(x) for name, pair in self.pairs.items()}
        y = self.layout(outs) if self.layout is not None else next(iter(outs.values()))
        return y * self.scaling
