"""This rank's experts: feed-forward blocks whose weights are split over the expert-tensor-parallel group
like a column/row-parallel MLP, but with no communication inside. The MoE layer gathers the tokens of the
TP group before the experts and reduces after combining, so one reduction serves every expert."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite import kernels as K
from megatron_lite.config import ModelConfig
from megatron_lite.kernels.nf4 import nf4_linear
from megatron_lite.models.mlp import activate
from megatron_lite.parallel_context import Group
from megatron_lite.parameters import ParamMeta, set_param_meta
from megatron_lite.tensor_parallel.fp8 import fp8_linear
from megatron_lite.tensor_parallel.random import Regenerated
from megatron_lite.tensor_parallel.sharding import ShardSpec


class ExpertWeight(nn.Module):
    """Holds one weight, and its bias with --add-bias-linear, so experts read like Megatron's (`linear_fc1.weight`,
    `linear_fc1.bias`) in names and checkpoints. `bias_meta`: the bias's, None for no bias. `bias_scale` 0: this
    rank adds the bias times zero (fc2's bias on expert-TP ranks past the first: the outputs are summed over the
    group, so one rank adds it; the others still use it, so its gradient hook fires, and the bias's gradient,
    whole on the first rank, is summed over expert-TP as its meta says)."""

    def __init__(self, shape, meta: ParamMeta, device, dtype, bias_meta: ParamMeta | None = None,
                 bias_scale: float = 1.0) -> None:  # fmt: skip
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        set_param_meta(self, "weight", meta)
        self.bias = None
        if bias_meta is not None:  # (Megatron's expert biases start at zero, as its grouped linear's)
            self.bias = nn.Parameter(torch.empty(shape[0], device=device, dtype=dtype))
            set_param_meta(self, "bias", bias_meta)
        self.bias_scale = bias_scale
        self.lora = None  # LoRA adapters (megatron_lite/lora), when fine-tuning experts with them
        self.nf4 = None  # QLoRA: the frozen weight stored in NF4 instead of `weight`
        self.fp8 = self.fp8_state = None  # --fp8-recipe delayed: the GEMM in fp8 (tensor_parallel/fp8.py)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T (W dequantised as it is used under QLoRA, in fp8 under --fp8-format), plus the adapters' output
        when there are any."""
        if self.fp8 is not None:  # (delayed scaling: the state's scales, no amax reduced here)
            y = fp8_linear(x, self.weight, self.fp8, state=self.fp8_state)
        else:
            y = F.linear(x, self.weight) if self.nf4 is None else nf4_linear(x, self.nf4.weight())
        if self.bias is not None:  # (after the GEMM, in the compute dtype, under fp8 and NF4 too)
            y = y + self.added_bias()
        return self.adapted(x, y)

    def added_bias(self) -> torch.Tensor:
        """The bias as this rank adds it: times zero on expert-TP ranks past the first for fc2 (see above)."""
        return self.bias if self.bias_scale == 1.0 else self.bias * self.bias_scale

    def adapted(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y if self.lora is None else y + self.lora(x)


def regenerated(make, fn) -> torch.Tensor:
    """fn(make()), with make()'s output, which fn saves, dropped and made again in its backward."""
    regen = Regenerated()
    a = regen.first(make)
    with regen.hooks():
        return fn(a)


class ExpertMLP(nn.Module):
    def __init__(self, config: ModelConfig, etp: Group, device=None, dtype=torch.float32) -> None:
        super().__init__()
        f, h = config.moe_ffn_size, config.hidden_size
        self.config = config
        self.gated = config.gated_linear_unit
        self.activation = config.activation
        # (one by one under --kernel-impl triton: NF4 and fp8 experts; the activation's kernel all the same)
        self.triton = config.kernel_impl == "triton"
        fc1 = ShardSpec.even(0, (f, f) if self.gated else (f,), etp.size)
        fc2 = ShardSpec.even(1, f, etp.size)
        std, out_std = config.init_method_std, config.output_layer_init_std
        bias = config.add_bias_linear
        # (fc1's bias is split like its rows; fc2's is whole, added once over the expert-TP group: see ExpertWeight)
        b1 = ParamMeta(("zeros",), fc1, etp.rank, expert=True) if bias else None
        b2 = ParamMeta(("zeros",), sequence_parallel=etp.size > 1, expert=True) if bias else None
        self.linear_fc1 = ExpertWeight(
            (fc1.shard_size, h), ParamMeta(("normal", std), fc1, etp.rank, expert=True), device, dtype, b1
        )
        fc2_meta = ParamMeta(("normal", out_std), fc2, etp.rank, expert=True)
        scale = 1.0 if etp.rank == 0 else 0.0
        self.linear_fc2 = ExpertWeight((h, fc2.shard_size), fc2_meta, device, dtype, b2, bias_scale=scale)

    def forward(self, x: torch.Tensor, regenerate_act: bool = False) -> torch.Tensor:
        """Partial over the expert-TP group. `regenerate_act` (--recompute-modules moe_act, as Megatron's): the
        activation's output, which fc2 saves, is dropped and computed again from fc1's output in the backward."""
        y = self.linear_fc1.linear(x)
        make = functools.partial(activate, y, self.activation, self.triton, self.config)
        return regenerated(make, self.linear_fc2.linear) if regenerate_act else self.linear_fc2.linear(make())


class LocalExperts(nn.Module):
    """Experts [ep_rank * n, (ep_rank + 1) * n) of the model's experts."""

    def __init__(
        self,
        config: ModelConfig,
        ep: Group,
        etp: Group,
        device=None,
        dtype=torch.float32,
    ) -> None:
        super().__init__()
        self.num_local = config.num_experts // ep.size
        self.first = ep.rank * self.num_local
        self.triton = config.kernel_impl == "triton"
        modules = config.recompute_modules if config.recompute_granularity == "selective" else ()
        # (with "moe" the whole layer is recomputed: the activation is not checkpointed again inside)
        self.recompute_act = "moe_act" in modules and "moe" not in modules
        self.pad_to_capacity = config.moe_pad_expert_input_to_capacity
        self.local_experts = nn.ModuleList(ExpertMLP(config, etp, device, dtype) for _ in range(self.num_local))

    def forward(self, x: torch.Tensor, counts: list[int], capacity: int | None = None) -> torch.Tensor:
        """x: tokens grouped by local expert, `counts[j]` rows for expert j. `capacity` (with
        --moe-pad-expert-input-to-capacity): the rows each expert may receive; its input is padded with zero rows to
        that many (Megatron pads with tokens of weight zero) and the padding's outputs are dropped, so each expert
        computes on a fixed-size input and the result is the unpadded one. Only the experts' input is padded: the
        exchange carries the kept rows alone (its counts go to the host anyway, so fixed sizes would save nothing
        there)."""
        if capacity is None or not self.pad_to_capacity or not counts:
            return self._forward(x, counts)
        rows = max(capacity, *counts)  # (never fewer than an expert got: a rank with a longer micro-batch)
        pieces = x.split(counts)
        padded = torch.cat([t for p in pieces for t in (p, p.new_zeros(rows - p.shape[0], p.shape[1]))])
        out = self._forward(padded, [rows] * len(counts))
        return torch.cat([o[:n] for o, n in zip(out.split(rows), counts)])

    def _forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # (NF4 experts run one by one: stacking them for the grouped GEMM would hold every dense weight at once;
        # fp8 ones too, each expert's GEMMs with its own scales)
        first = self.local_experts[0] if self.num_local else None
        gated = first is not None and first.gated
        if self.triton and gated and first.linear_fc1.nf4 is None and first.linear_fc1.fp8 is None:
            return self._grouped(x, counts)
        regenerate = self.recompute_act and self.training
        outs = [expert(chunk, regenerate) for expert, chunk in zip(self.local_experts, x.split(counts))]
        return torch.cat(outs) if outs else x[:0]

    def _grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """All local experts in two grouped GEMMs (Triton). The kernel stacks the experts' weights while it runs
        (a copy a grouped parameter layout would avoid) and saves only the parameters for the backward. Biases
        (gpt-oss's) are added after each GEMM, each row its expert's."""
        c = torch.tensor(counts, dtype=torch.int64, device=x.device)
        w1 = [e.linear_fc1.weight for e in self.local_experts]
        w2 = [e.linear_fc2.weight for e in self.local_experts]
        rows = torch.repeat_interleave(torch.arange(len(counts), device=x.device), c, output_size=x.shape[0])
        h = self._adapted("linear_fc1", x, counts, self._biased("linear_fc1", K.grouped_gemm(x, w1, c), rows))

        def fc2(a: torch.Tensor) -> torch.Tensor:
            y = self._biased("linear_fc2", K.grouped_gemm(a, w2, c), rows)
            return self._adapted("linear_fc2", a, counts, y)

        # (the SwiGLU and quick-GEGLU kernels save fc1's output h itself: regenerating from h keeps nothing more alive)
        first = self.local_experts[0]
        make = functools.partial(activate, h, first.activation, True, first.config)
        return regenerated(make, fc2) if self.recompute_act and self.training else fc2(make())

    def _biased(self, which: str, y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """y plus each row's expert's bias (times fc2's bias scale: once over the expert-TP group), if any."""
        layers = [getattr(e, which) for e in self.local_experts]
        if layers[0].bias is None:
            return y
        return y + torch.stack([layer.added_bias() for layer in layers]).index_select(0, rows)

    def _adapted(self, which: str, x: torch.Tensor, counts: list[int], y: torch.Tensor) -> torch.Tensor:
        """Each expert's adapters on its own rows (small GEMMs of rank r, one pair per expert)."""
        if getattr(self.local_experts[0], which).lora is None:
            return y
        return y + torch.cat([getattr(e, which).lora(part) for e, part in zip(self.local_experts, x.split(counts))])
