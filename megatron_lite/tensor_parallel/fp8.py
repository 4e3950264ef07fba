"""fp8 GEMMs for the transformer layers' tensor-parallel linears (`--fp8-format`, `--fp8-recipe tensorwise`).

Each GEMM operand is quantized per tensor from its own amax ("current scaling", Transformer Engine's
Float8CurrentScaling): scale = fp8_max / amax / 2^margin, the input and weight to e4m3, the output gradient to
e5m2 (`hybrid`) or e4m3 (`e4m3`); the product accumulates in fp32 and comes out in the input's dtype. The fp8
copies of the input and weight are what the backward keeps.

The amax is the whole logical tensor's, as one process computes it: where a layout splits a tensor, its pieces'
amaxes are reduced (max) over the group that splits it. A column-parallel weight and output gradient are split
over TP, a row-parallel input and weight too, and under context parallelism every activation is split along the
sequence over CP. So every layout quantizes with the one-process scales; only the micro-batch must be the same
(a tensor's amax is that of the micro-batch it holds).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lite.parallel_context import Group

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise",)  # (Megatron's delayed, mxfp8 and blockwise are refused at start-up)


@dataclass(frozen=True)
class Fp8Setting:
    """What a linear needs to run in fp8: the format, the scale's margin, and the context-parallel group
    (None without CP) over which activations are split along the sequence."""

    format: str = "hybrid"
    margin: int = 0
    cp: Group | None = None
    wgrad: bool = True  # False (--no-fp8-wgrad): the weight gradient from the unquantized input and gradient

    @property
    def grad_dtype(self) -> torch.dtype:
        return E5M2 if self.format == "hybrid" else E4M3


def _max_over(amax: torch.Tensor, groups: tuple[Group | None, ...]) -> torch.Tensor:
    for group in groups:
        if group is not None and group.size > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group.pg)
    return amax


def quantize(t: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor, margin: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(t in fp8, the inverse of its scale), the scale from `amax`: fp8_max / amax / 2^margin, 1 where the amax is
    0 or not finite, fp32's largest where it overflows (as Transformer Engine's compute_scale_from_amax)."""
    amax = amax.float()
    scale = (FP8_MAX[dtype] / amax) / 2.0**margin
    scale = torch.where(torch.isinf(scale), torch.finfo(torch.float32).max, scale)  # (a subnormal amax)
    scale = torch.where((amax > 0) & torch.isfinite(amax), scale, torch.ones_like(scale))
    q = (t.float() * scale).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return q, scale.reciprocal()


@functools.cache
def _scaled_mm_runs(device_type: str) -> bool:
    """Whether torch._scaled_mm computes on this kind of device (CPU builds have it from PyTorch 2.5 or so; on a
    GPU it needs Hopper or newer). Asked once: a run never mixes the two paths."""
    try:
        a = torch.ones(16, 16, device=device_type).to(E4M3)
        one = torch.ones((), device=device_type)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return True
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return False


def fp8_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, out_dtype) -> torch.Tensor:
    """a @ b^T for fp8 a [M, K] and b [N, K], each times its inverse scale, accumulated in fp32. torch._scaled_mm
    where it runs and the shapes suit it (a GPU's needs multiples of 16); else the same product of the fp8
    values in fp32."""
    fits = a.device.type == "cpu" or all(n % 16 == 0 for n in (*a.shape, b.shape[0]))
    if fits and _scaled_mm_runs(a.device.type):
        return torch._scaled_mm(a, b.t(), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)
    return ((a.float() @ b.float().t()) * (a_inv * b_inv)).to(out_dtype)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, setting: Fp8Setting, x_groups, w_groups, g_groups):
        x2 = x.reshape(-1, x.shape[-1])
        margin = setting.margin
        xq, x_inv = quantize(x2, E4M3, _max_over(x2.detach().abs().amax().float(), x_groups), margin)
        wq, w_inv = quantize(weight, E4M3, _max_over(weight.detach().abs().amax().float(), w_groups), margin)
        y = fp8_mm(xq, x_inv, wq, w_inv, x.dtype)
        ctx.save_for_backward(xq, x_inv, wq, w_inv, None if setting.wgrad else x2)
        ctx.setting, ctx.g_groups, ctx.x_shape, ctx.dtypes = setting, g_groups, x.shape, (x.dtype, weight.dtype)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        xq, x_inv, wq, w_inv, x2 = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        amax = _max_over(g2.detach().abs().amax().float(), ctx.g_groups)
        gq, g_inv = quantize(g2, ctx.setting.grad_dtype, amax, ctx.setting.margin)
        dx = dw = None
        if ctx.needs_input_grad[0]:  # (dgrad: [M, N] @ [N, K])
            dx = fp8_mm(gq, g_inv, wq.t().contiguous(), w_inv, ctx.dtypes[0]).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1] and x2 is not None:  # (--no-fp8-wgrad)
            dw = (g2.t() @ x2).to(ctx.dtypes[1])
        elif ctx.needs_input_grad[1]:  # (wgrad: [N, M] @ [M, K])
            dw = fp8_mm(gq.t().contiguous(), g_inv, xq.t().contiguous(), x_inv, torch.float32).to(ctx.dtypes[1])
        return dx, dw, None, None, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    setting: Fp8Setting,
    *,
    x_split: Group | None = None,
    w_split: Group | None = None,
    g_split: Group | None = None,
) -> torch.Tensor:
    """x @ weight^T with fp8 operands. `x_split`, `w_split`, `g_split`: the TP group where the input, the weight
    or the output gradient is this rank's piece of the whole tensor (None where each rank holds all of it)."""
    cp = setting.cp
    return _Fp8Linear.apply(x, weight, setting, (x_split, cp), (w_split,), (g_split, cp))


def enable_fp8(model: torch.nn.Module, setting: Fp8Setting, num_layers: int, bf16_start: int, bf16_end: int) -> int:
    """Run the tensor-parallel linears of the decoder's transformer layers in fp8, but for the first `bf16_start`
    and last `bf16_end` of its `num_layers` (Megatron's --first-last-layers-bf16). The embedding, the output layer
    and multi-token prediction's layers stay in the compute dtype. Returns how many linears were switched."""
    from megatron_lite.models.transformer import TransformerLayer
    from megatron_lite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    count = 0
    for layer in model.modules():
        if not isinstance(layer, TransformerLayer) or not bf16_start <= layer.layer_number < num_layers - bf16_end:
            continue
        for module in layer.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.fp8 = setting
                count += 1
    return count


def validate_fp8(config) -> None:
    """The model settings fp8 runs with (a ModelConfig with `fp8` set), each refusal one line."""
    from megatron_lite.config import ConfigError

    if config.fp8 not in FORMATS:
        raise ConfigError(f"--fp8-format {config.fp8}: choose e4m3 or hybrid")
    if config.fp8_recipe not in RECIPES:
        default = " (Megatron's default)" if config.fp8_recipe == "delayed" else ""
        raise ConfigError(
            f"--fp8-recipe {config.fp8_recipe}{default} is not implemented; give --fp8-recipe tensorwise: each "
            "tensor scaled from its own amax (Transformer Engine's Float8CurrentScaling)"
        )
    if config.num_experts:
        raise ConfigError(
            f"--fp8-format {config.fp8} with --num-experts {config.num_experts}: the experts' fp8 GEMMs are not "
            "implemented; drop --fp8-format for MoE models"
        )
    start, end = config.fp8_bf16_layers
    if start < 0 or end < 0:
        raise ConfigError(f"--num-layers-at-start-in-bf16 {start} and --num-layers-at-end-in-bf16 {end} must be >= 0")


def describe_fp8(model: torch.nn.Module, config, ctx) -> str:
    """Switch this rank's transformer layers to fp8 as `config` says (enable_fp8); the start-up line saying so."""
    start, end = config.fp8_bf16_layers
    setting = Fp8Setting(config.fp8, cp=ctx.cp if ctx.cp.size > 1 else None, wgrad=config.fp8_wgrad)
    count = enable_fp8(model, setting, config.num_layers, start, end)
    first, last = start, config.num_layers - end - 1
    where = f"layers {first}-{last}" if first <= last else "no layer (all are kept in the compute dtype)"
    grads = "e5m2" if config.fp8 == "hybrid" else "e4m3"
    return (
        f"fp8 ({config.fp8}, {config.fp8_recipe}): the linears of {where}, {count} on this rank, with e4m3 inputs and "
        f"weights and {grads} gradients{'' if config.fp8_wgrad else ', weight gradients in the compute dtype'}; the "
        "embedding, the output layer and the attention itself in the compute dtype"
    )
