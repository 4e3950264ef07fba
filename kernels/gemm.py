"""A plain GEMM that writes into a strided output: Y = X W^T for X [M, K], W [N, K], Y [M, N] any strides
(a slice of a larger tensor included). It serves the decomposed tensor-parallel GEMMs of --tp-comm-overlap:
each ring step's chunk lands straight in its rows of the output, with no copy. fp32 accumulation.

Three layers: the kernel and its launcher (`matmul_into`), an autograd Function and the functional entry
(`linear`), beside the PyTorch reference (`linear_reference`, torch.matmul) that is the fallback and oracle.
"""

from __future__ import annotations

import torch

from megatron_lite.kernels._common import (
    HAVE_TRITON,
    interpreting,
    launched,
    no_interpreted_bf16_dot,
    offsets_fit_int32,
    on_tensor_device,
    overlaps,
    triton_usable,
)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _mm(
        X,
        W,
        Y,
        M,
        N,
        K,
        s_xm,
        s_xk,
        s_wn,
        s_wk,
        s_ym,
        s_yn,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """One [BLOCK_M, BLOCK_N] tile of Y = X W^T. Tiles are visited in groups of GROUP_M rows of tiles so
        neighbouring programs share the W columns they load (L2 reuse)."""
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        group = pid // per_group
        first_m = group * GROUP_M
        size_m = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                X + rows[:, None] * s_xm + ks[None, :] * s_xk, mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0
            )
            w = tl.load(
                W + cols[None, :] * s_wn + ks[:, None] * s_wk, mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0
            )
            acc += tl.dot(x, w)
        tl.store(
            Y + rows[:, None] * s_ym + cols[None, :] * s_yn,
            acc.to(Y.dtype.element_ty),
            mask=(rows[:, None] < M) & (cols[None, :] < N),
        )


def _config() -> dict:
    if interpreting():  # one small fixed tile: the interpreter is slow
        return {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}


@on_tensor_device
def matmul_into(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out[:] = x @ w^T for x [M, K], w [N, K], out [M, N] (any strides); the Triton kernel where it can
    run, torch.matmul(out=...) elsewhere (which needs `out` contiguous)."""
    _check(out, x, w)
    if not triton_usable(x, w, out) or not offsets_fit_int32(x, w, out):
        # (past 2^31 elements the kernel's int32 offsets would wrap; out= needs a contiguous output)
        if out.is_contiguous():
            return torch.matmul(x, w.t(), out=out)
        return out.copy_(x @ w.t())
    no_interpreted_bf16_dot("matmul_into", x, w)
    m, k = x.shape
    n = w.shape[0]
    cfg = _config()
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _mm[grid](x, w, out, m, n, k, *x.stride(), *w.stride(), *out.stride(), **cfg)
    launched("gemm")
    return out


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    # (the kernel walks w with x's width and writes out as [M, N] by its strides: another K gave a plausible wrong
    # product, a smaller out was written past its end, an out over x or w read values it had already written)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or out.shape != (x.shape[0], w.shape[0]):
        raise ValueError(
            f"matmul_into: out {tuple(out.shape)}, x {tuple(x.shape)} and w {tuple(w.shape)} must be [M, N], [M, K] "
            "and [N, K]"
        )
    if not out.dtype == x.dtype == w.dtype:
        raise ValueError(f"matmul_into: out, x and w must share a dtype, got {out.dtype}, {x.dtype}, {w.dtype}")
    if overlaps(out, x) or overlaps(out, w):
        raise ValueError("matmul_into: out must not overlap x or w (the product reads what it has written)")


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return matmul_into(x.new_empty(x.shape[0], w.shape[0]), x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = matmul_into(dy.new_empty(x.shape), dy, w.t())  # dY W = dY (W^T)^T
        dw = matmul_into(w.new_empty(w.shape), dy.t(), x.t())  # dY^T X
        return dx, dw


def linear_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.t()


@on_tensor_device
def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T, differentiable."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} and w {tuple(w.shape)} must be [M, K] and [N, K]")
    if triton_usable(x, w):
        return _Linear.apply(x, w)
    return linear_reference(x, w)


def _cases() -> list[tuple]:
    out = []
    for t in ("bf16", "fp32"):
        strides = dict.fromkeys("M N K s_xm s_xk s_wn s_wk s_ym s_yn".split(), "i32")
        out.append(
            (
                f"gemm_{t}",
                _mm,
                {
                    "X": f"*{t}",
                    "W": f"*{t}",
                    "Y": f"*{t}",
                    **strides,
                    "BLOCK_M": "constexpr",
                    "BLOCK_N": "constexpr",
                    "BLOCK_K": "constexpr",
                    "GROUP_M": "constexpr",
                },
                {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8},
            )
        )
    return out


COMPILE_CASES = _cases() if HAVE_TRITON else []
