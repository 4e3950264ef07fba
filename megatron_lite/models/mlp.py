"""The feed-forward block: fc1 (column-parallel) -> activation -> fc2 (row-parallel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite import kernels as K
from megatron_lite.config import ModelConfig
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


class _SquaredReLU(torch.autograd.Function):
    """relu(h)^2 keeping only h for the backward. Autograd's relu-then-square keeps relu's output instead, so an
    activation regenerated from h (--recompute-modules moe_act) would hold h beside it and free nothing."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h)
        return F.relu(h).square()

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors
        return dy * (2.0 * F.relu(h))  # what autograd's square then relu backward give, bit for bit


def activate(h: torch.Tensor, activation: str, triton: bool = False, config: ModelConfig | None = None) -> torch.Tensor:
    """The MLP activation on fc1's output: SwiGLU or quick-GEGLU on its [gate; up] halves, squared ReLU, or
    (tanh-)GELU. `config` gives quick-GEGLU (gpt-oss) its --glu-linear-offset and --activation-func-clamp-value;
    `triton`: the gated units' kernels, which read the halves in place, save only h and return h's gradient whole."""
    if activation == "quick_geglu":
        fn = K.quick_geglu if triton else K.quick_geglu_reference
        return fn(h, config.glu_linear_offset, config.activation_func_clamp_value)
    if activation == "swiglu":
        if triton:
            return K.swiglu_stacked(h)  # reads the halves in place and returns h's gradient whole
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    if activation == "squared_relu":
        return _SquaredReLU.apply(h)
    return F.gelu(h, approximate="tanh" if activation == "gelu_tanh" else "none")


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ctx: ParallelContext, device=None, dtype=torch.float32) -> None:
        super().__init__()
        ffn = config.ffn_size
        self.config = config
        self.activation = config.activation
        self.triton = config.kernel_impl == "triton"
        # A gated unit's fc1 (SwiGLU, quick-GEGLU) stacks two logical blocks, gate then up; each is split across TP
        # on its own so a rank holds [gate_r; up_r] and the pairing of gate and up columns never crosses ranks.
        fc1_out = [ffn, ffn] if config.gated_linear_unit else ffn
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            fc1_out,
            ctx.tp,
            bias=config.add_bias_linear,
            sequence_parallel=ctx.sequence_parallel,
            comm_overlap=ctx.parallel.tp_comm_overlap and ctx.parallel.tp_comm_overlap_ag,
            triton_gemm=config.kernel_impl == "triton",
            init_std=config.init_method_std,
            device=device,
            dtype=dtype,
        )
        self.linear_fc2 = RowParallelLinear(
            ffn,
            config.hidden_size,
            ctx.tp,
            bias=config.add_bias_linear,
            sequence_parallel=ctx.sequence_parallel,
            comm_overlap=ctx.parallel.tp_comm_overlap and ctx.parallel.tp_comm_overlap_rs,
            triton_gemm=config.kernel_impl == "triton",
            init_std=config.output_layer_init_std,
            device=device,
            dtype=dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(activate(self.linear_fc1(x), self.activation, self.triton, self.config))
