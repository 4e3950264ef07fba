"""Rotary position embeddings, Hugging Face's rotate-half convention: for x = [x1, x2] (halves of
head_dim), y = x * cos + [-x2, x1] * sin. x is [batch, seq, heads, head_dim]; cos and sin are
[seq, head_dim] (or [batch, seq, head_dim] for per-sample positions). The backward is the transposed
rotation; nothing but cos and sin is saved."""

from __future__ import annotations

import torch

from megatron_lite.kernels._common import (
    HAVE_TRITON,
    launched,
    next_pow2,
    on_tensor_device,
    rows_per_program,
    triton_usable,
)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rope(
        X,
        COS,
        SIN,
        Y,
        stride_xb,
        stride_xs,
        stride_xh,
        stride_cb,
        stride_cs,
        stride_yb,
        stride_ys,
        stride_yh,
        seq,
        heads,
        positions,
        HALF: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BACKWARD: tl.constexpr,
        POS: tl.constexpr,
    ):
        # POS (batch, position) pairs per program (1 on a GPU, more under the interpreter), all their heads at
        # once: cos and sin are read once per position, and each program moves heads x head_dim elements rather
        # than one head's row. Tiles are [POS, heads, half of head_dim].
        p = tl.program_id(0).to(tl.int64) * POS + tl.arange(0, POS)[:, None, None]  # may pass 2^31 elements
        s = p % seq
        b = p // seq
        hh = tl.arange(0, BLOCK_H)[None, :, None]
        d = tl.arange(0, BLOCK)[None, None, :]
        dmask = (d < HALF) & (p < positions)
        mask = (hh < heads) & dmask
        x_row = X + b * stride_xb + s * stride_xs + hh * stride_xh
        c_row = b * stride_cb + s * stride_cs
        x1 = tl.load(x_row + d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + HALF + d, mask=mask, other=0.0).to(tl.float32)
        c1 = tl.load(COS + c_row + d, mask=dmask, other=0.0).to(tl.float32)
        c2 = tl.load(COS + c_row + HALF + d, mask=dmask, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + c_row + d, mask=dmask, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + c_row + HALF + d, mask=dmask, other=0.0).to(tl.float32)
        if BACKWARD:  # the transpose of the rotation
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        y_row = Y + b * stride_yb + s * stride_ys + hh * stride_yh
        tl.store(y_row + d, y1.to(Y.dtype.element_ty), mask=mask)
        tl.store(y_row + HALF + d, y2.to(Y.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    b, s, h, d = x.shape
    cos3 = cos if cos.dim() == 3 else cos.unsqueeze(0)
    sin3 = sin if sin.dim() == 3 else sin.unsqueeze(0)
    cos3, sin3 = cos3.contiguous(), sin3.contiguous()
    stride_cb = cos3.stride(0) if cos3.shape[0] > 1 else 0
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    block, block_h = next_pow2(d // 2), next_pow2(h)
    pos = rows_per_program(block * block_h, b * s)
    _rope[(triton.cdiv(b * s, pos),)](
        x,
        cos3,
        sin3,
        y,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        stride_cb,
        cos3.stride(1),
        y.stride(0),
        y.stride(1),
        y.stride(2),
        s,
        h,
        b * s,
        HALF=d // 2,
        BLOCK=block,
        BLOCK_H=block_h,
        BACKWARD=backward,
        POS=pos,
    )
    launched("rope_bwd" if backward else "rope_fwd")
    return y


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        # the kernel steps the last dimension by 1: a gradient that does not (y.sum()'s expanded one, a
        # permuted view's) is read from a copy, as the forward only takes such an x
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        return _launch(dy, cos, sin, backward=True), None, None


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _check_tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    # (the kernel indexes the tables by position: a shorter one was read past its end)
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(
            f"apply_rope: x {tuple(x.shape)} must be [batch, seq, heads, head_dim] with an even head_dim (rotate-half "
            f"rotates the two halves against each other)"
        )
    b, s, _, d = x.shape
    for name, t in (("cos", cos), ("sin", sin)):
        if not (
            (t.dim() == 2 and tuple(t.shape) == (s, d))
            or (t.dim() == 3 and t.shape[0] in (1, b) and t.shape[1:] == (s, d))
        ):
            raise ValueError(
                f"apply_rope: {name} {tuple(t.shape)} for x {tuple(x.shape)} [batch, seq, heads, head_dim]: it must "
                f"be [seq, head_dim] = {(s, d)} or [batch or 1, seq, head_dim]"
            )


@on_tensor_device
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    _check_tables(x, cos, sin)
    # (tables that need a gradient take the reference: the kernel's backward gives x's alone)
    tables_learn = torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)
    if triton_usable(x) and x.shape[-1] % 2 == 0 and x.stride(-1) == 1 and not tables_learn:
        return _RoPE.apply(x, cos, sin)
    return apply_rope_reference(x, cos, sin)


COMPILE_CASES = (
    [
        (
            f"rope_{t}_bwd{bwd}",
            _rope,
            {
                "X": f"*{t}",
                "COS": "*fp32",
                "SIN": "*fp32",
                "Y": f"*{t}",
                **dict.fromkeys(
                    [
                        "stride_xb",
                        "stride_xs",
                        "stride_xh",
                        "stride_cb",
                        "stride_cs",
                        "stride_yb",
                        "stride_ys",
                        "stride_yh",
                        "seq",
                        "heads",
                        "positions",
                    ],
                    "i32",
                ),
                "HALF": "constexpr",
                "BLOCK": "constexpr",
                "BLOCK_H": "constexpr",
                "BACKWARD": "constexpr",
                "POS": "constexpr",
            },
            {"HALF": 64, "BLOCK": 64, "BLOCK_H": 32, "BACKWARD": bwd, "POS": 1},
        )
        for t in ("bf16", "fp32")
        for bwd in (False, True)
    ]
    if HAVE_TRITON
    else []
)
