"""SwiGLU: silu(gate) * up. The forward saves only gate and up; the backward recomputes the sigmoid."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_lite.kernels._common import HAVE_TRITON, launched, triton_usable

BLOCK = 1024

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _swiglu_fwd(G, U, Y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # tokens x ffn may pass 2^31
        mask = offs < n
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        y = g * tl.sigmoid(g) * u
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # tokens x ffn may pass 2^31
        mask = offs < n
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        tl.store(DU + offs, (dy * silu).to(DU.dtype.element_ty), mask=mask)
        tl.store(DG + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        n = gate.numel()
        _swiglu_fwd[(triton.cdiv(n, BLOCK),)](gate, up, y, n, BLOCK=BLOCK)
        launched("swiglu_fwd")
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        _swiglu_bwd[(triton.cdiv(n, BLOCK),)](dy, gate, up, dg, du, n, BLOCK=BLOCK)
        launched("swiglu_bwd")
        return dg, du


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if triton_usable(gate, up):
        return _SwiGLU.apply(gate, up)
    return swiglu_reference(gate, up)


COMPILE_CASES = (
    [
        (
            f"swiglu_fwd_{t}",
            _swiglu_fwd,
            {**{n: f"*{t}" for n in "G U Y".split()}, "n": "i32", "BLOCK": "constexpr"},
            {"BLOCK": BLOCK},
        )
        for t in ("bf16", "fp32")
    ]
    + [
        (
            f"swiglu_bwd_{t}",
            _swiglu_bwd,
            {**{n: f"*{t}" for n in "DY G U DG DU".split()}, "n": "i32", "BLOCK": "constexpr"},
            {"BLOCK": BLOCK},
        )
        for t in ("bf16", "fp32")
    ]
    if HAVE_TRITON
    else []
)
