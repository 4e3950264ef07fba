"""SwiGLU: silu(gate) * up. The forward saves only gate and up; the backward recomputes the sigmoid.

Two entries: `swiglu(gate, up)` on any two tensors, and `swiglu_stacked(h)` on fc1's output [..., 2f] = [gate; up]
(the MLP's layout, as Megatron's fused bias_swiglu takes it). The kernels address rows through their strides,
so the halves of fc1's output are read in place: no contiguous copies of gate and up in the forward, and the
stacked entry writes its gradient straight into one [..., 2f] tensor, with no concatenation in the backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_lite.kernels._common import (
    HAVE_TRITON,
    launched,
    next_pow2,
    on_tensor_device,
    rows_per_program,
    triton_usable,
)

BLOCK = 1024  # columns per program at most; a program handles one row on a GPU

if HAVE_TRITON:
    import triton
    import triton.language as tl

    # ROWS rows per program (1 on a GPU, more under the interpreter), BLOCK columns: [ROWS, BLOCK] tiles
    @triton.jit
    def _swiglu_fwd(G, U, Y, rows, cols, s_g, s_u, BLOCK: tl.constexpr, ROWS: tl.constexpr):  # Y: contiguous
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]  # rows x stride may pass 2^31
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = (row < rows) & (c < cols)
        g = tl.load(G + row * s_g + c, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * s_u + c, mask=mask, other=0.0).to(tl.float32)
        y = g * tl.sigmoid(g) * u
        tl.store(Y + row * cols + c, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd(
        DY, G, U, DG, DU, rows, cols, s_dy, s_g, s_u, s_d, BLOCK: tl.constexpr, ROWS: tl.constexpr
    ):  # DG, DU: stride s_d
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = (row < rows) & (c < cols)
        dy = tl.load(DY + row * s_dy + c, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + row * s_g + c, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * s_u + c, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        tl.store(DU + row * s_d + c, (dy * silu).to(DU.dtype.element_ty), mask=mask)
        tl.store(DG + row * s_d + c, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, cols: int) -> torch.Tensor:
    """t as [rows, cols] with unit column stride: a view where one exists (a half of fc1's output, a row
    broadcast), a copy otherwise."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, cols)
    except RuntimeError:
        return t.contiguous().view(-1, cols)


def _grid(rows: int, cols: int) -> tuple[tuple[int, int], dict]:
    block = min(BLOCK, next_pow2(max(cols, 16)))
    per = rows_per_program(block, rows)
    return (triton.cdiv(rows, per), triton.cdiv(cols, block)), {"BLOCK": block, "ROWS": per}


def _forward(g: torch.Tensor, u: torch.Tensor, y: torch.Tensor) -> None:
    """[rows, cols] views with unit column stride; y contiguous."""
    if y.numel():
        grid, tiles = _grid(*y.shape)
        _swiglu_fwd[grid](g, u, y, *y.shape, g.stride(0), u.stride(0), **tiles)
    launched("swiglu_fwd")


def _backward(dy, g, u, dg, du) -> None:
    """dg and du share one row stride (separate tensors, or the halves of h's gradient)."""
    if dy.numel():
        grid, tiles = _grid(*dy.shape)
        strides = (dy.stride(0), g.stride(0), u.stride(0), dg.stride(0))
        _swiglu_bwd[grid](dy, g, u, dg, du, *dy.shape, *strides, **tiles)
    launched("swiglu_bwd")


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        cols = gate.shape[-1]
        g, u = _rows(gate, cols), _rows(up, cols)
        y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        _forward(g, u, y.view(-1, cols))
        ctx.save_for_backward(g, u)  # views where the inputs allowed: no bytes beyond the inputs' own
        ctx.shape = gate.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        dg, du = (torch.empty(g.shape, dtype=g.dtype, device=g.device) for _ in range(2))
        _backward(_rows(dy, g.shape[1]), g, u, dg, du)
        return dg.view(ctx.shape), du.view(ctx.shape)


class _SwiGLUStacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        f = h.shape[-1] // 2
        h2 = _rows(h, 2 * f)
        y = torch.empty(*h.shape[:-1], f, dtype=h.dtype, device=h.device)
        _forward(h2[:, :f], h2[:, f:], y.view(-1, f))
        ctx.save_for_backward(h2)
        ctx.shape = h.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        (h2,) = ctx.saved_tensors
        f = h2.shape[1] // 2
        dh = torch.empty(h2.shape, dtype=h2.dtype, device=h2.device)
        _backward(_rows(dy, f), h2[:, :f], h2[:, f:], dh[:, :f], dh[:, f:])
        return dh.view(ctx.shape)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_stacked_reference(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


@on_tensor_device
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate and up of one shape (either may be a strided view, read in place)."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    # (no rows of width 0 to address; gate and up of two dtypes: the reference's promoted product)
    if triton_usable(gate, up) and gate.dim() and gate.shape[-1] and gate.dtype == up.dtype:
        return _SwiGLU.apply(gate, up)
    return swiglu_reference(gate, up)


@on_tensor_device
def swiglu_stacked(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for h = [gate; up] along its last dimension (fc1's output in a SwiGLU MLP)."""
    if h.shape[-1] % 2:
        raise ValueError(f"swiglu_stacked: the last dimension of {tuple(h.shape)} is odd; it stacks [gate; up]")
    if triton_usable(h) and h.dim() and h.shape[-1]:
        return _SwiGLUStacked.apply(h)
    return swiglu_stacked_reference(h)


_STRIDES = {"rows": "i32", "cols": "i32", "s_g": "i32", "s_u": "i32"}
_BWD_STRIDES = {"rows": "i32", "cols": "i32", **{f"s_{n}": "i32" for n in ("dy", "g", "u", "d")}}
COMPILE_CASES = (
    [
        (
            f"swiglu_fwd_{t}",
            _swiglu_fwd,
            {**{n: f"*{t}" for n in "G U Y".split()}, **_STRIDES, "BLOCK": "constexpr", "ROWS": "constexpr"},
            {"BLOCK": BLOCK, "ROWS": 1},
        )
        for t in ("bf16", "fp32")
    ]
    + [
        (
            f"swiglu_bwd_{t}",
            _swiglu_bwd,
            {**{n: f"*{t}" for n in "DY G U DG DU".split()}, **_BWD_STRIDES, "BLOCK": "constexpr", "ROWS": "constexpr"},
            {"BLOCK": BLOCK, "ROWS": 1},
        )
        for t in ("bf16", "fp32")
    ]
    if HAVE_TRITON
    else []
)
