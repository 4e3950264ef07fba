"""Quick-GEGLU (gpt-oss's activation, Megatron's --quick-geglu with --glu-linear-offset and
--activation-func-clamp-value) on fc1's output h = [gate; up]:

    gate' = min(gate, C), up' = clamp(up, -C, C)   (no clamp without C)
    y = gate' * sigmoid(1.702 gate') * (up' + offset)

The forward saves only h and recomputes the sigmoid in the backward (PyTorch's ops keep the clamped halves, the
sigmoid and the products: several [tokens, f] tensors per layer). The halves are read in place through their row
stride, and h's gradient is written as one [..., 2f] tensor, as in the stacked SwiGLU kernel. The clamps' gradient
is autograd's: a clamped entry passes none, and an entry exactly at a bound passes all of it (torch.clamp's
backward keeps min <= x <= max); a NaN passes none and comes out NaN, as torch.clamp gives it."""

from __future__ import annotations

import torch

from megatron_lite.kernels._common import HAVE_TRITON, launched, on_tensor_device, triton_usable
from megatron_lite.kernels.swiglu import BLOCK, _grid, _rows

ALPHA = 1.702  # quick-GELU's x * sigmoid(1.702 x) (Megatron-Core's quick_gelu, gpt-oss's alpha)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _clamped(g, u, limit, CLAMP: tl.constexpr):
        """gate <= limit and -limit <= up <= limit; a NaN stays NaN (tl.minimum may drop it on a GPU)."""
        if CLAMP:
            g = tl.where(g > limit, limit, g)
            u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
        return g, u

    # ROWS rows per program (1 on a GPU, more under the interpreter), BLOCK columns: [ROWS, BLOCK] tiles
    @triton.jit
    def _quick_geglu_fwd(
        G, U, Y, rows, cols, s_h, offset, limit, CLAMP: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr
    ):  # G, U: the halves of h, row stride s_h; Y: contiguous
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]  # rows x stride may pass 2^31
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = (row < rows) & (c < cols)
        g = tl.load(G + row * s_h + c, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * s_h + c, mask=mask, other=0.0).to(tl.float32)
        g, u = _clamped(g, u, limit, CLAMP)
        y = g * tl.sigmoid(1.702 * g) * (u + offset)
        tl.store(Y + row * cols + c, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _quick_geglu_bwd(
        DY, G, U, DG, DU, rows, cols, s_dy, s_h, s_d, offset, limit, CLAMP: tl.constexpr, BLOCK: tl.constexpr,
        ROWS: tl.constexpr,
    ):  # fmt: skip
        # DG, DU: the halves of dh, row stride s_d
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = (row < rows) & (c < cols)
        dy = tl.load(DY + row * s_dy + c, mask=mask, other=0.0).to(tl.float32)
        g0 = tl.load(G + row * s_h + c, mask=mask, other=0.0).to(tl.float32)
        u0 = tl.load(U + row * s_h + c, mask=mask, other=0.0).to(tl.float32)
        g, u = _clamped(g0, u0, limit, CLAMP)
        sig = tl.sigmoid(1.702 * g)
        dg = dy * (u + offset) * sig * (1.0 + 1.702 * g * (1.0 - sig))
        du = dy * g * sig
        if CLAMP:  # torch.clamp's backward: the gradient where min <= x <= max, bounds included; none for a NaN
            dg = tl.where(g0 <= limit, dg, 0.0)
            du = tl.where((u0 >= -limit) & (u0 <= limit), du, 0.0)
        tl.store(DG + row * s_d + c, dg.to(DG.dtype.element_ty), mask=mask)
        tl.store(DU + row * s_d + c, du.to(DU.dtype.element_ty), mask=mask)


def _scalars(h: torch.Tensor, offset: float, clamp: float | None) -> dict:
    """The offset, and the clamp as torch.clamp applies it to h: rounded to h's dtype first (a bf16 h is clamped
    to bf16(C), and compared with it in the backward), then passed in fp32, which holds it exactly."""
    limit = 0.0 if clamp is None else float(torch.tensor(clamp, dtype=h.dtype))
    return {"offset": float(offset), "limit": limit, "CLAMP": clamp is not None}


class _QuickGEGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, offset, clamp):
        f = h.shape[-1] // 2
        h2 = _rows(h, 2 * f)
        y = torch.empty(*h.shape[:-1], f, dtype=h.dtype, device=h.device)
        scalars = _scalars(h, offset, clamp)
        if y.numel():
            grid, tiles = _grid(h2.shape[0], f)
            _quick_geglu_fwd[grid](h2[:, :f], h2[:, f:], y, h2.shape[0], f, h2.stride(0), **scalars, **tiles)
        launched("quick_geglu_fwd")
        ctx.save_for_backward(h2)  # h alone (a view where h allowed one): the rest is recomputed
        ctx.shape, ctx.scalars = h.shape, scalars
        return y

    @staticmethod
    def backward(ctx, dy):
        (h2,) = ctx.saved_tensors
        rows, f = h2.shape[0], h2.shape[1] // 2
        dy = _rows(dy, f)
        dh = torch.empty(h2.shape, dtype=h2.dtype, device=h2.device)
        if dh.numel():
            grid, tiles = _grid(rows, f)
            strides = (dy.stride(0), h2.stride(0), dh.stride(0))
            halves = (h2[:, :f], h2[:, f:], dh[:, :f], dh[:, f:])
            _quick_geglu_bwd[grid](dy, *halves, rows, f, *strides, **ctx.scalars, **tiles)
        launched("quick_geglu_bwd")
        return dh.view(ctx.shape), None, None


def quick_geglu_reference(h: torch.Tensor, offset: float = 0.0, clamp: float | None = None) -> torch.Tensor:
    """Megatron-Core's unfused GLU with quick_gelu (transformer/mlp.py), in PyTorch's ops: the fallback, the
    --kernel-impl torch path and the tests' oracle (autograd gives the clamps' gradient)."""
    gate, up = h.chunk(2, dim=-1)
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    return gate * torch.sigmoid(ALPHA * gate) * (up + offset)


@on_tensor_device
def quick_geglu(h: torch.Tensor, offset: float = 0.0, clamp: float | None = None) -> torch.Tensor:
    """min(gate, C) * sigmoid(1.702 min(gate, C)) * (clamp(up, -C, C) + offset) for h = [gate; up] along its last
    dimension (fc1's output in gpt-oss's MLP); `clamp` None: no clamp."""
    if h.shape[-1] % 2:
        raise ValueError(f"quick_geglu: the last dimension of {tuple(h.shape)} is odd; it stacks [gate; up]")
    if clamp is not None and not 0 < clamp < float("inf"):  # (torch.clamp with min > max differs from the kernel)
        raise ValueError(f"quick_geglu: clamp {clamp} must be a finite number > 0 (None: no clamp)")
    if triton_usable(h) and h.dim() and h.shape[-1]:
        return _QuickGEGLU.apply(h, offset, clamp)
    return quick_geglu_reference(h, offset, clamp)


def _signature(t: str, pointers: str, strides: str) -> dict:
    ints = {n: "i32" for n in ("rows", "cols", *strides.split())}
    consts = {n: "constexpr" for n in ("CLAMP", "BLOCK", "ROWS")}
    return {**{n: f"*{t}" for n in pointers.split()}, **ints, "offset": "fp32", "limit": "fp32", **consts}


COMPILE_CASES = (
    [
        (
            f"quick_geglu_{kind}_{t}_clamp{clamp}",
            kernel,
            _signature(t, pointers, strides),
            {"CLAMP": clamp, "BLOCK": BLOCK, "ROWS": 1},
        )
        for kind, kernel, pointers, strides in (
            ("fwd", _quick_geglu_fwd, "G U Y", "s_h"),
            ("bwd", _quick_geglu_bwd, "DY G U DG DU", "s_dy s_h s_d"),
        )
        for t in ("bf16", "fp32")
        for clamp in (True, False)
    ]
    if HAVE_TRITON
    else []
)
