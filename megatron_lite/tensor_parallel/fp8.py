"""fp8 GEMMs for the transformer layers' tensor-parallel linears (`--fp8-format`, `--fp8-recipe`).

Each GEMM operand is quantized per tensor, the input and weight to e4m3, the output gradient to e5m2 (`hybrid`)
or e4m3 (`e4m3`); the product accumulates in fp32 and comes out in the input's dtype. The fp8 copies of the
input and weight are what the backward keeps. `tensorwise` (Transformer Engine's Float8CurrentScaling) scales a
tensor from its own amax, fp8_max / amax; `delayed` (DelayedScaling, Megatron's default) from the amax history
of the iterations before (Fp8State, update_fp8_scales).

The amax is the whole logical tensor's, as one process computes it (delayed: the iteration's, over all its
micro-batches and replicas): where a layout splits a tensor, its pieces'
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
RECIPES = ("tensorwise", "delayed")  # (Megatron's mxfp8 and blockwise are refused at start-up)


@dataclass(frozen=True)
class Fp8Setting:
    """What a linear needs to run in fp8: the format, the scale's margin, and the context-parallel group
    (None without CP) over which activations are split along the sequence."""

    format: str = "hybrid"
    margin: int = 0
    cp: Group | None = None
    wgrad: bool = True  # False (--no-fp8-wgrad): the weight gradient from the unquantized input and gradient
    recipe: str = "tensorwise"
    history_len: int = 1  # delayed: --fp8-amax-history-len, --fp8-amax-compute-algo
    algo: str = "most_recent"
    # delayed: each weight quantized once an iteration, its fp8 copy shared by the micro-batches (Transformer
    # Engine's is_first_microbatch caching); not under FSDP2, whose unsharded weights would stay alive in fp8
    cache_weights: bool = True

    @property
    def grad_dtype(self) -> torch.dtype:
        return E5M2 if self.format == "hybrid" else E4M3


def _max_over(amax: torch.Tensor, groups: tuple[Group | None, ...]) -> torch.Tensor:
    for group in groups:
        if group is not None and group.size > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group.pg)
    return amax


def scale_from_amax(amax: torch.Tensor, fp8_max, margin: int, keep: torch.Tensor) -> torch.Tensor:
    """fp8_max / amax / 2^margin; `keep` where the amax is 0 or not finite, fp32's largest where the scale
    overflows (a subnormal amax), as Transformer Engine computes it."""
    amax = amax.float()
    scale = (fp8_max / amax) / 2.0**margin
    scale = torch.where(torch.isinf(scale), torch.finfo(torch.float32).max, scale)
    return torch.where((amax > 0) & torch.isfinite(amax), scale, keep)


def quantize(t: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor, margin: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(t in fp8, the inverse of its scale), the scale from `amax` (1 where it is 0 or not finite)."""
    amax = amax.float()
    return quantize_scaled(t, dtype, scale_from_amax(amax, FP8_MAX[dtype], margin, torch.ones_like(amax)))


def quantize_scaled(t: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t times `scale` in fp8, saturated at fp8's largest value, and the inverse of the scale)."""
    q = (t.float() * scale).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return q, scale.reciprocal()


class Fp8State:
    """Delayed scaling's state of one linear (--fp8-recipe delayed): for its input, weight and output gradient
    (columns 0, 1, 2), the scale the GEMMs quantize with, the last `history_len` iterations' amaxes (newest in
    row 0) it came from, and this iteration's amax so far on this rank. update_fp8_scales moves the iteration's
    amax into the history once its backward is done, reduced over every replica of the stage."""

    def __init__(self, history_len: int, device, expert: bool = False) -> None:
        self.expert = expert  # (an expert's: reduced over its own replicas, expert-TP x expert-DP)
        self.history = torch.zeros(history_len, 3, device=device)
        self.scale = torch.ones(3, device=device)  # (Transformer Engine's first scale: 1)
        self.pending = torch.zeros(3, device=device)
        # (the weight, its version, its fp8 copy, inverse scale and amax) until the scales' update, which comes
        # before the optimizer step: the weight and its scale are then those of the iteration's every micro-batch
        self.weight_cache: tuple | None = None

    def record(self, column: int, amax: torch.Tensor) -> None:
        self.pending[column] = torch.maximum(self.pending[column], amax)


@functools.cache
def _scaled_mm_runs(device_type: str) -> bool:
    """Whether torch._scaled_mm computes on this kind of device (on a GPU it needs Hopper or newer). Asked once:
    a run never mixes the two paths."""
    try:
        a = torch.ones(16, 16, device=device_type).to(E4M3)
        one = torch.ones((), device=device_type)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return True
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return False


def scaled_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, out_dtype) -> torch.Tensor:
    """fp8_mm's product through torch._scaled_mm (the GPU's fp8 GEMM; b is [N, K], so it goes in transposed)."""
    return torch._scaled_mm(a, b.t(), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)


def emulated_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, out_dtype) -> torch.Tensor:
    """fp8_mm's product of the fp8 values in fp32 (each fp8 value, and the product of two, is exact there)."""
    return ((a.float() @ b.float().t()) * (a_inv * b_inv)).to(out_dtype)


def fp8_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, out_dtype) -> torch.Tensor:
    """a @ b^T for fp8 a [M, K] and b [N, K], each times its inverse scale, accumulated in fp32. On a GPU
    torch._scaled_mm where it runs and the shapes suit it (multiples of 16); else the same product of the fp8
    values in fp32. Never _scaled_mm on a CPU: its CPU kernel is a plain loop, 100-200x slower than the fp32
    GEMM at a small model's shapes and no more exact (tests/test_fp8.py checks the two agree there)."""
    fits = a.device.type != "cpu" and all(n % 16 == 0 for n in (*a.shape, b.shape[0]))
    fits = fits and a.numel() > 0 and b.numel() > 0  # (an expert sent no tokens: the empty product in fp32)
    if fits and _scaled_mm_runs(a.device.type):
        return scaled_mm(a, a_inv, b, b_inv, out_dtype)
    return emulated_mm(a, a_inv, b, b_inv, out_dtype)


def _amax(t: torch.Tensor) -> torch.Tensor:
    # (an expert sent no tokens holds an empty input and gradient: their amax is 0, as Transformer Engine's)
    return t.detach().abs().amax().float() if t.numel() else t.new_zeros((), dtype=torch.float32)


def _quantize(t, dtype, column: int, groups, setting: Fp8Setting, state: Fp8State | None, record: bool):
    """Tensorwise: from the whole tensor's amax now. Delayed: with the state's scale (its amax recorded, unreduced,
    for the update at the iteration's end; not by forwards without gradients, evaluation's)."""
    amax = _amax(t)
    if state is None:
        return quantize(t, dtype, _max_over(amax, groups), setting.margin)
    if record:
        state.record(column, amax)
    return quantize_scaled(t, dtype, state.scale[column])


def _quantize_weight(weight, groups, setting: Fp8Setting, state: Fp8State | None, record: bool):
    """The weight in e4m3; under delayed scaling quantized by the iteration's first micro-batch and reused by the
    others (the same weight with the same scale; its amax, the same too, recorded again)."""
    if state is None or not setting.cache_weights:
        return _quantize(weight, E4M3, 1, groups, setting, state, record)
    cached = state.weight_cache
    if cached is None or cached[0] is not weight or cached[1] != weight._version:
        amax = _amax(weight)
        cached = state.weight_cache = (weight, weight._version, *quantize_scaled(weight, E4M3, state.scale[1]), amax)
    if record:
        state.record(1, cached[4])
    return cached[2], cached[3]


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, setting: Fp8Setting, x_groups, w_groups, g_groups, state, record):
        x2 = x.reshape(-1, x.shape[-1])
        xq, x_inv = _quantize(x2, E4M3, 0, x_groups, setting, state, record)
        wq, w_inv = _quantize_weight(weight, w_groups, setting, state, record)
        y = fp8_mm(xq, x_inv, wq, w_inv, x.dtype)
        ctx.save_for_backward(xq, x_inv, wq, w_inv, None if setting.wgrad else x2)
        ctx.setting, ctx.g_groups, ctx.x_shape, ctx.dtypes = setting, g_groups, x.shape, (x.dtype, weight.dtype)
        ctx.state = state
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        xq, x_inv, wq, w_inv, x2 = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        gq, g_inv = _quantize(g2, ctx.setting.grad_dtype, 2, ctx.g_groups, ctx.setting, ctx.state, True)
        dx = dw = None
        if ctx.needs_input_grad[0]:  # (dgrad: [M, N] @ [N, K])
            dx = fp8_mm(gq, g_inv, wq.t().contiguous(), w_inv, ctx.dtypes[0]).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1] and x2 is not None:  # (--no-fp8-wgrad)
            dw = (g2.t() @ x2).to(ctx.dtypes[1])
        elif ctx.needs_input_grad[1]:  # (wgrad: [N, M] @ [M, K])
            dw = fp8_mm(gq.t().contiguous(), g_inv, xq.t().contiguous(), x_inv, torch.float32).to(ctx.dtypes[1])
        return dx, dw, None, None, None, None, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    setting: Fp8Setting,
    *,
    x_split: Group | None = None,
    w_split: Group | None = None,
    g_split: Group | None = None,
    state: Fp8State | None = None,
) -> torch.Tensor:
    """x @ weight^T with fp8 operands. `x_split`, `w_split`, `g_split`: the TP group where the input, the weight
    or the output gradient is this rank's piece of the whole tensor (None where each rank holds all of it);
    `state`: delayed scaling's (the recipe's)."""
    cp = setting.cp
    record = torch.is_grad_enabled()
    return _Fp8Linear.apply(x, weight, setting, (x_split, cp), (w_split,), (g_split, cp), state, record)


def fp8_state_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """Delayed scaling's state as a checkpoint holds it: (global name, tensor, whether an expert's) of each
    linear's history and scale, the same on every replica (after update_fp8_scales), named by the global layer
    and expert numbers."""
    out = []
    for name, module in model.named_modules():
        if (state := getattr(module, "fp8_state", None)) is not None:
            for part in ("history", "scale"):
                out.append((model.global_name(f"{name}.fp8_{part}"), getattr(state, part), state.expert))
    return out


def update_fp8_scales(
    model: torch.nn.Module, replicas: Group | None, expert_replicas: tuple[Group | None, ...] = ()
) -> None:
    """Delayed scaling, once an iteration's backward is done: each linear's amaxes of the iteration, the largest
    over its micro-batches and over every replica of the stage (`replicas`: TP x CP x DP, where a tensor is split
    or holds other data; an expert's: `expert_replicas`, expert-TP and expert-DP), go into its history, and the
    scales of the next iteration follow from the history (its largest with --fp8-amax-compute-algo max, else the
    newest). One all-reduce for the dense linears, one per expert group for the experts."""
    holders = [m for m in model.modules() if getattr(m, "fp8_state", None) is not None]
    for expert, groups in ((False, (replicas,)), (True, expert_replicas)):
        states = [m.fp8_state for m in holders if m.fp8_state.expert == expert]
        if states:
            _update(states, holders[0].fp8, _max_over(torch.stack([s.pending for s in states]), groups))


def _update(states: list[Fp8State], setting: Fp8Setting, amax: torch.Tensor) -> None:
    fp8_max = torch.tensor([FP8_MAX[E4M3], FP8_MAX[E4M3], FP8_MAX[setting.grad_dtype]], device=amax.device)
    for s, a in zip(states, amax):
        s.history.copy_(torch.cat([a[None], s.history[:-1]]))
        used = s.history.amax(0) if setting.algo == "max" else s.history[0]
        s.scale.copy_(scale_from_amax(used, fp8_max, setting.margin, s.scale))
        s.pending.zero_()
        s.weight_cache = None  # (the optimizer step comes next, and the weight's gather may not bump its version)


def enable_fp8(model: torch.nn.Module, setting: Fp8Setting, num_layers: int, bf16_start: int, bf16_end: int) -> int:
    """Run the tensor-parallel linears of the decoder's transformer layers in fp8, but for the first `bf16_start`
    and last `bf16_end` of its `num_layers` (Megatron's --first-last-layers-bf16), and those of the multi-token
    prediction layers (their projection and transformer layer: Megatron runs them under its global fp8 context,
    whatever --first-last-layers-bf16 says). The embedding and the output layer stay in the compute dtype.
    Returns how many linears were switched."""
    from megatron_lite.models.mtp import MultiTokenPredictionLayer
    from megatron_lite.models.transformer import TransformerLayer
    from megatron_lite.moe.experts import ExpertWeight
    from megatron_lite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    count = 0
    for layer in model.modules():
        mtp = isinstance(layer, MultiTokenPredictionLayer)
        decoder = isinstance(layer, TransformerLayer) and bf16_start <= layer.layer_number < num_layers - bf16_end
        if not mtp and not decoder:  # (an MTP depth's transformer layer is numbered past the decoder's: not here)
            continue
        for module in layer.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ExpertWeight)):
                module.fp8 = setting
                if setting.recipe == "delayed":
                    expert = isinstance(module, ExpertWeight)
                    module.fp8_state = Fp8State(setting.history_len, module.weight.device, expert)
                count += 1
    return count


def validate_fp8(config) -> None:
    """The model settings fp8 runs with (a ModelConfig with `fp8` set), each refusal one line."""
    from megatron_lite.config import ConfigError

    if config.fp8 not in FORMATS:
        raise ConfigError(f"--fp8-format {config.fp8}: choose e4m3 or hybrid")
    if config.fp8_recipe not in RECIPES:
        raise ConfigError(
            f"--fp8-recipe {config.fp8_recipe} is not implemented; give --fp8-recipe delayed (Megatron's default: "
            "scales from the amax history) or tensorwise (each tensor scaled from its own amax)"
        )
    if config.num_experts and config.fp8_recipe == "tensorwise":
        raise ConfigError(
            f"--fp8-recipe tensorwise with --num-experts {config.num_experts}: an expert's input scale would depend on "
            "which micro-batches a layout sends it together; use --fp8-recipe delayed (the iteration's amax)"
        )
    if config.fp8_amax_history_len < 1:
        raise ConfigError(f"--fp8-amax-history-len {config.fp8_amax_history_len} must be >= 1")
    if config.fp8_amax_compute_algo not in ("most_recent", "max"):
        raise ConfigError(f"--fp8-amax-compute-algo {config.fp8_amax_compute_algo}: choose most_recent or max")
    start, end = config.fp8_bf16_layers
    if start < 0 or end < 0:
        raise ConfigError(f"--num-layers-at-start-in-bf16 {start} and --num-layers-at-end-in-bf16 {end} must be >= 0")


def describe_fp8(model: torch.nn.Module, config, ctx, fsdp2: bool = False) -> str:
    """Switch this rank's transformer layers to fp8 as `config` says (enable_fp8); the start-up line saying so."""
    start, end = config.fp8_bf16_layers
    setting = Fp8Setting(
        config.fp8,
        config.fp8_margin if config.fp8_recipe == "delayed" else 0,  # (Megatron reads it for delayed scaling)
        cp=ctx.cp if ctx.cp.size > 1 else None,
        wgrad=config.fp8_wgrad,
        recipe=config.fp8_recipe,
        history_len=config.fp8_amax_history_len,
        algo=config.fp8_amax_compute_algo,
        cache_weights=not fsdp2,
    )
    count = enable_fp8(model, setting, config.num_layers, start, end)
    first, last = start, config.num_layers - end - 1
    where = f"layers {first}-{last}" if first <= last else "no layer (all are kept in the compute dtype)"
    where += " and of the multi-token prediction layers" if config.mtp_num_layers else ""
    grads = "e5m2" if config.fp8 == "hybrid" else "e4m3"
    return (
        f"fp8 ({config.fp8}, {config.fp8_recipe}): the linears of {where}, {count} on this rank, with e4m3 inputs and "
        f"weights and {grads} gradients{'' if config.fp8_wgrad else ', weight gradients in the compute dtype'}; the "
        "embedding, the output layer and the attention itself in the compute dtype"
    )
