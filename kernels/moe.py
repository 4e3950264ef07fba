"""MoE kernels: token permutation by expert, its weighted inverse, and a grouped GEMM over the experts.

    permuted, row_map = moe_permute(tokens [T, H], indices [T, k], keep [T, k] | None)
        permuted: the kept (token, expert) rows sorted by expert (stable), [N, H]
        row_map: [T, k] position of each pair in `permuted` (-1 where dropped)
    y = moe_unpermute(expert_out [N, H], row_map, probs [T, k])    # y[t] = sum_j probs[t, j] * out[row_map[t, j]]
    out = grouped_gemm(x [N, K], weights [E, N_out, K], counts [E])  # rows of expert e times weights[e]^T
    out = grouped_gemm(x, [w_0, ..., w_E-1], counts)  # per-expert weights (parameters): stacked only while used

The index bookkeeping (a stable sort of expert ids) runs in PyTorch; the row movement, the weighted combine
and the GEMMs are Triton kernels with their backward passes.
"""

from __future__ import annotations

import torch

from megatron_lite.kernels import _common
from megatron_lite.kernels._common import (
    HAVE_TRITON,
    interpreting,
    launched,
    next_pow2,
    no_interpreted_bf16_dot,
    on_tensor_device,
    require,
    triton_usable,
)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_rows(X, SRC, Y, H, BLOCK: tl.constexpr):
        """Y[n] = X[SRC[n]]."""
        n = tl.program_id(0).to(tl.int64)  # rows x hidden may pass 2^31
        src = tl.load(SRC + n)
        for start in range(0, H, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            m = cols < H
            tl.store(Y + n * H + cols, tl.load(X + src * H + cols, mask=m), mask=m)

    @triton.jit
    def _combine(OUT, MAP, W, Y, H, k, BLOCK: tl.constexpr):
        """Y[t] = sum_j W[t, j] * OUT[MAP[t, j]] over the kept pairs (MAP >= 0); also the permute backward."""
        t = tl.program_id(0).to(tl.int64)  # tokens x hidden may pass 2^31
        for start in range(0, H, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            m = cols < H
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for j in range(0, k):
                pos = tl.load(MAP + t * k + j)
                w = tl.where(pos >= 0, tl.load(W + t * k + j).to(tl.float32), 0.0)  # dropped pairs weigh 0
                # a dropped pair reads nothing (0 * a stand-in row would turn an inf there into NaN)
                live = cols < tl.where(pos >= 0, H, 0)
                row = tl.load(OUT + tl.maximum(pos, 0) * H + cols, mask=live, other=0.0).to(tl.float32)
                acc += w * row
            tl.store(Y + t * H + cols, acc.to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def _combine_bwd(DY, OUT, MAP, W, DOUT, DW, H, k, BLOCK: tl.constexpr):
        """DOUT[MAP[t, j]] = W[t, j] * DY[t];  DW[t, j] = <DY[t], OUT[MAP[t, j]]>."""
        t = tl.program_id(0).to(tl.int64)  # tokens x hidden may pass 2^31
        for j in range(0, k):
            pos = tl.load(MAP + t * k + j)
            if pos >= 0:
                w = tl.load(W + t * k + j).to(tl.float32)
                dot = tl.zeros([BLOCK], dtype=tl.float32)
                for start in range(0, H, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    m = cols < H
                    dy = tl.load(DY + t * H + cols, mask=m, other=0.0).to(tl.float32)
                    out = tl.load(OUT + pos * H + cols, mask=m, other=0.0).to(tl.float32)
                    tl.store(DOUT + pos * H + cols, (w * dy).to(DOUT.dtype.element_ty), mask=m)
                    dot += dy * out
                tl.store(DW + t * k + j, tl.sum(dot, axis=0))

    @triton.jit
    def _grouped_mm(
        X,
        W,
        Y,
        TILE_E,
        TILE_M,
        OFFS,
        N,
        K,
        s_xm,
        s_xk,
        s_we,
        s_wn,
        s_wk,
        s_ym,
        s_yn,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Y[rows of e] = X[rows of e] @ W[e]^T for the tile (e, m0) of this program, columns block pid(1)."""
        pid = tl.program_id(0)
        e = tl.load(TILE_E + pid)
        m0 = tl.load(TILE_M + pid)
        end = tl.load(OFFS + e + 1)
        rows = m0 + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                X + rows[:, None] * s_xm + ks[None, :] * s_xk, mask=(rows[:, None] < end) & (ks[None, :] < K), other=0.0
            )
            w = tl.load(
                W + e * s_we + cols[None, :] * s_wn + ks[:, None] * s_wk,
                mask=(cols[None, :] < N) & (ks[:, None] < K),
                other=0.0,
            )
            acc += tl.dot(x, w)
        tl.store(
            Y + rows[:, None] * s_ym + cols[None, :] * s_yn,
            acc.to(Y.dtype.element_ty),
            mask=(rows[:, None] < end) & (cols[None, :] < N),
        )

    @triton.jit
    def _grouped_mm_dw(
        X,
        DY,
        DW,
        OFFS,
        N,
        K,
        s_xm,
        s_xk,
        s_dm,
        s_dn,
        s_we,
        s_wn,
        s_wk,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """DW[e] = DY[rows of e]^T @ X[rows of e]; programs over (n block x k block, e): the blocks on the first
        grid axis, whose limit is 2^31 - 1 (the second's is 65535: one Mixtral-8x22B expert's fc1 has 98304)."""
        e = tl.program_id(1).to(tl.int64)  # experts x N x K may pass 2^31
        n_blocks = tl.cdiv(N, BLOCK_N)
        nb, kb = tl.program_id(0) % n_blocks, tl.program_id(0) // n_blocks
        start, end = tl.load(OFFS + e), tl.load(OFFS + e + 1)
        ns = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            dy = tl.load(
                DY + rows[:, None] * s_dm + ns[None, :] * s_dn,
                mask=(rows[:, None] < end) & (ns[None, :] < N),
                other=0.0,
            )
            x = tl.load(
                X + rows[:, None] * s_xm + ks[None, :] * s_xk, mask=(rows[:, None] < end) & (ks[None, :] < K), other=0.0
            )
            acc += tl.dot(tl.trans(dy), x)
        tl.store(
            DW + e * s_we + ns[:, None] * s_wn + ks[None, :] * s_wk,
            acc.to(DW.dtype.element_ty),
            mask=(ns[:, None] < N) & (ks[None, :] < K),
        )


def _block(h: int) -> int:
    return min(1024, next_pow2(h))


# Permutation -------------------------------------------------------------------------------------------
def _row_map(indices: torch.Tensor, keep: torch.Tensor | None):
    t, k = indices.shape
    flat = indices.reshape(-1)
    kept = keep.reshape(-1) if keep is not None else torch.ones_like(flat, dtype=torch.bool)
    pair = torch.arange(t * k, device=indices.device)[kept]
    order = torch.argsort(flat[kept], stable=True)
    sorted_pairs = pair[order]
    row_map = torch.full((t * k,), -1, dtype=torch.int64, device=indices.device)
    row_map[sorted_pairs] = torch.arange(len(sorted_pairs), device=indices.device)
    return sorted_pairs // k, row_map.view(t, k)  # source token of each permuted row, and the inverse map


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, row_map):
        x = x.contiguous()
        y = torch.empty(len(src), x.shape[1], dtype=x.dtype, device=x.device)
        if len(src):
            _gather_rows[(len(src),)](x, src, y, x.shape[1], BLOCK=_block(x.shape[1]))
        launched("moe_permute")
        ctx.save_for_backward(row_map)
        ctx.tokens = x.shape[0]
        return y

    @staticmethod
    def backward(ctx, dy):
        (row_map,) = ctx.saved_tensors
        if dy.shape[0] == 0:  # every pair was dropped
            return dy.new_zeros(ctx.tokens, dy.shape[1]), None, None
        ones = torch.ones(row_map.shape, dtype=torch.float32, device=dy.device)
        dx = torch.empty(ctx.tokens, dy.shape[1], dtype=dy.dtype, device=dy.device)
        _combine[(ctx.tokens,)](
            dy.contiguous(), row_map, ones, dx, dy.shape[1], row_map.shape[1], BLOCK=_block(dy.shape[1])
        )
        return dx, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, row_map, probs):
        out, probs = out.contiguous(), probs.contiguous()
        t, k = row_map.shape
        ctx.save_for_backward(out, row_map, probs)
        if out.shape[0] == 0:  # every pair was dropped: nothing to combine
            return out.new_zeros(t, out.shape[1])
        y = torch.empty(t, out.shape[1], dtype=out.dtype, device=out.device)
        _combine[(t,)](out, row_map, probs, y, out.shape[1], k, BLOCK=_block(out.shape[1]))
        launched("moe_unpermute")
        return y

    @staticmethod
    def backward(ctx, dy):
        out, row_map, probs = ctx.saved_tensors
        t, k = row_map.shape
        dout = torch.zeros_like(out)
        dprobs = torch.zeros(t, k, dtype=torch.float32, device=out.device)
        if out.shape[0] == 0:
            return dout, None, dprobs.to(probs.dtype)
        _combine_bwd[(t,)](
            dy.contiguous(), out, row_map, probs, dout, dprobs, out.shape[1], k, BLOCK=_block(out.shape[1])
        )
        return dout, None, dprobs.to(probs.dtype)


def moe_permute_reference(x, indices, keep=None):
    src, row_map = _row_map(indices, keep)
    return x[src], row_map


def moe_unpermute_reference(out, row_map, probs):
    t, k = row_map.shape
    valid = row_map >= 0
    if out.shape[0] == 0:  # every pair dropped (a chunk past the experts' capacity): nothing to gather, but
        # still a function of out and probs, so that the backward reaches what produced them (the expert
        # all-to-alls the other ranks run too), as the Triton combine and Megatron's scatter_add do; and it
        # saves tensors as a chunk with rows does, so that under recomputation every rank's backward
        # recomputes at the same point (before this chunk's gradient all-to-all: the collectives pair up)
        rows = out.new_zeros(t, k, out.shape[1]) + out.sum() * 0
    else:
        rows = out[row_map.clamp(min=0).reshape(-1)].view(t, k, -1)
    # dropped pairs read row 0 as a stand-in: zeroed, not multiplied by 0 (an inf there would give NaN)
    rows = rows.masked_fill(~valid.unsqueeze(-1), 0.0)
    w = (probs * valid).to(out.dtype).unsqueeze(-1)
    return (rows * w).sum(1)


@on_tensor_device
def moe_permute(x: torch.Tensor, indices: torch.Tensor, keep: torch.Tensor | None = None):
    if x.dim() != 2 or indices.dim() != 2 or indices.shape[0] != x.shape[0]:
        # (more tokens than x's rows gathered rows past x; fewer, and the backward walked the map past its end)
        raise ValueError(
            f"moe_permute: indices {tuple(indices.shape)} must be [tokens, k] for x's {tuple(x.shape)} [tokens, hidden]"
        )
    if keep is not None and (keep.dtype != torch.bool or keep.shape != indices.shape):
        # (an integer 0/1 mask indexed the pairs instead of masking them: other rows, without an error)
        raise ValueError(
            f"moe_permute: keep ({keep.dtype}, {tuple(keep.shape)}) must be a bool mask of indices' shape "
            f"{tuple(indices.shape)}"
        )
    src, row_map = _row_map(indices, keep)
    if triton_usable(x):
        return _Permute.apply(x, src, row_map), row_map
    return x[src], row_map


@on_tensor_device
def moe_unpermute(out: torch.Tensor, row_map: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    if out.dim() != 2:  # (a 3-D out was read with its second dimension as the row width: other elements)
        raise ValueError(f"moe_unpermute: out {tuple(out.shape)} must be the experts' rows [rows, hidden]")
    if probs.shape != row_map.shape:
        raise ValueError(
            f"moe_unpermute: probs {tuple(probs.shape)} must be row_map's [tokens, k] {tuple(row_map.shape)}"
        )
    if row_map.dtype.is_floating_point or row_map.dtype.is_complex or row_map.dtype == torch.bool:
        raise ValueError(f"moe_unpermute: row_map must be integer row numbers (moe_permute's), got {row_map.dtype}")
    if triton_usable(out):
        # The kernels read row_map as a contiguous [tokens, k] (a transposed view gave other rows) and gather the
        # rows it names (one past out's read beyond it; the reference raises an IndexError there)
        row_map = row_map.contiguous()
        if row_map.numel():
            lo, hi = torch.aminmax(row_map)
            require(
                (lo >= -1) & (hi < out.shape[0]),
                lambda: f"moe_unpermute: row_map names rows outside [-1, {out.shape[0]}) of out's {out.shape[0]} rows",
            )
            # (the backward stores each token's gradient to its row: of a row named twice, the last one won)
            named = torch.bincount(row_map.reshape(-1) + 1, minlength=out.shape[0] + 1)[1:]
            require(
                named.amax() <= 1 if named.numel() else torch.ones((), dtype=torch.bool, device=out.device),
                lambda: "moe_unpermute: row_map names a row twice (each row is one token's pair, as moe_permute maps)",
            )
        return _Unpermute.apply(out, row_map, probs)
    return moe_unpermute_reference(out, row_map, probs)


# Grouped GEMM ------------------------------------------------------------------------------------------
def _tiles(counts: torch.Tensor, block_m: int):
    offs = torch.zeros(len(counts) + 1, dtype=torch.int64, device=counts.device)
    offs[1:] = torch.cumsum(counts, 0)
    per = (counts + block_m - 1) // block_m
    tile_e = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), per)
    first = torch.cumsum(per, 0) - per
    tile_m = offs[tile_e] + (torch.arange(len(tile_e), device=counts.device) - first[tile_e]) * block_m
    return offs, tile_e, tile_m


def _cfg():
    t = _common.INTERPRETER_TILE
    return (t, t, t) if interpreting() else (64, 64, 32)


def _mm(x, w, offs, tile_e, tile_m, out_cols, transpose_w: bool):
    """Y = X @ W[e]^T per expert (transpose_w: Y = X @ W[e])."""
    bm, bn, bk = _cfg()
    y = torch.empty(x.shape[0], out_cols, dtype=x.dtype, device=x.device)
    if len(tile_e) == 0:
        return y
    k = x.shape[1]
    s_we, s_wn, s_wk = (w.stride(0), w.stride(2), w.stride(1)) if transpose_w else w.stride()
    _grouped_mm[(len(tile_e), triton.cdiv(out_cols, bn))](
        x,
        w,
        y,
        tile_e,
        tile_m,
        offs,
        out_cols,
        k,
        x.stride(0),
        x.stride(1),
        s_we,
        s_wn,
        s_wk,
        y.stride(0),
        y.stride(1),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
    )
    return y


def _grouped_forward(x, w, counts):
    """y and the tiles the backward reuses."""
    offs, tile_e, tile_m = _tiles(counts, _cfg()[0])
    y = _mm(x, w, offs, tile_e, tile_m, w.shape[1], transpose_w=False)
    launched("grouped_gemm_fwd")
    return y, (offs, tile_e, tile_m)


def _grouped_backward(x, w, dy, offs, tile_e, tile_m, want_dw: bool):
    """dx and dw (None unless wanted: frozen experts under LoRA) of y = grouped_gemm(x, w)."""
    dy = dy.contiguous()
    dx = _mm(dy, w, offs, tile_e, tile_m, w.shape[2], transpose_w=True)
    launched("grouped_gemm_bwd")
    if not want_dw:
        return dx, None
    bm, bn, bk = _cfg()
    e, n, k = w.shape
    dw = torch.zeros(e, n, k, dtype=torch.float32, device=w.device)
    _grouped_mm_dw[(triton.cdiv(n, bn) * triton.cdiv(k, bk), e)](
        x,
        dy,
        dw,
        offs,
        n,
        k,
        x.stride(0),
        x.stride(1),
        dy.stride(0),
        dy.stride(1),
        *dw.stride(),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
    )
    return dx, dw.to(w.dtype)


class _GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts):
        x, w = x.contiguous(), w.contiguous()
        y, tiles = _grouped_forward(x, w, counts)
        ctx.save_for_backward(x, w, *tiles)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, offs, tile_e, tile_m = ctx.saved_tensors
        return *_grouped_backward(x, w, dy, offs, tile_e, tile_m, ctx.needs_input_grad[1]), None


class _GroupedGemmPerExpert(torch.autograd.Function):
    """The grouped GEMM over per-expert weights: they are stacked for the kernels in the forward and again in the
    backward, and only the parameters themselves are saved, so no copy of every expert's weights waits for the
    backward (a stacked copy saved per MoE layer and micro-batch would hold as much again as the experts)."""

    @staticmethod
    def forward(ctx, x, counts, *ws):
        x = x.contiguous()
        y, tiles = _grouped_forward(x, torch.stack(ws), counts)
        ctx.save_for_backward(x, *tiles, *ws)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, offs, tile_e, tile_m, *ws = ctx.saved_tensors
        dx, dw = _grouped_backward(x, torch.stack(ws), dy, offs, tile_e, tile_m, any(ctx.needs_input_grad[2:]))
        return dx, None, *(dw.unbind(0) if dw is not None else [None] * len(ws))


def grouped_gemm_reference(x, w, counts):
    outs = [chunk @ w[e].t() for e, chunk in enumerate(x.split(counts.tolist()))]
    return torch.cat(outs) if outs else x.new_zeros(0, w[0].shape[0] if isinstance(w, (list, tuple)) else w.shape[1])


@on_tensor_device
def grouped_gemm(x: torch.Tensor, w: torch.Tensor | list[torch.Tensor], counts: torch.Tensor) -> torch.Tensor:
    """x [N, K] rows grouped by expert (counts[e] rows each), w [E, N_out, K] (or E weights [N_out, K], the
    experts' own parameters) -> [N, N_out]."""
    per_expert = isinstance(w, (list, tuple))
    experts = len(w) if per_expert else w.shape[0]
    if counts.shape != (experts,):
        raise ValueError(f"grouped_gemm: counts {tuple(counts.shape)} for {experts} experts' weights")
    # (the kernels walk each weight with x's width: another K read past a row, or dropped its last columns)
    shapes = {tuple(t.shape) for t in w} if per_expert else {tuple(w.shape[1:])} if w.dim() == 3 else {()}
    dtypes = {t.dtype for t in (w if per_expert else [w])}
    if x.dim() != 2 or len(shapes) != 1 or len(next(iter(shapes))) != 2 or next(iter(shapes))[1] != x.shape[1]:
        raise ValueError(
            f"grouped_gemm: x {tuple(x.shape)} and weights {sorted(shapes)} must be [rows, K] and [N_out, K] per "
            f"expert (w [E, N_out, K])"
        )
    if dtypes != {x.dtype}:
        raise ValueError(f"grouped_gemm: x is {x.dtype} and the weights {sorted(map(str, dtypes))}: one dtype")
    if triton_usable(x, *(w if per_expert else [w])):
        counts = counts.to(device=x.device, dtype=torch.int64)
        # (rows past the counts' sum were left unwritten; counts past x's rows read and wrote beyond it)
        require(
            counts.sum() == x.shape[0],
            lambda: f"grouped_gemm: counts sum to {int(counts.sum())}, not x's {x.shape[0]} rows",
        )
        # (negative ones summing to the rows started a tile before x)
        require((counts >= 0).all(), lambda: f"grouped_gemm: counts must be >= 0, got {counts.tolist()}")
        no_interpreted_bf16_dot("grouped_gemm", x, *(w if per_expert else [w]))
        if per_expert:
            return _GroupedGemmPerExpert.apply(x, counts, *w)
        return _GroupedGemm.apply(x, w, counts)
    return grouped_gemm_reference(x, w, counts)


def _cases() -> list[tuple]:
    out = []
    for t in ("bf16", "fp32"):
        out.append(
            (
                f"moe_gather_rows_{t}",
                _gather_rows,
                {"X": f"*{t}", "SRC": "*i64", "Y": f"*{t}", "H": "i32", "BLOCK": "constexpr"},
                {"BLOCK": 1024},
            )
        )
        out.append(
            (
                f"moe_combine_{t}",
                _combine,
                {
                    "OUT": f"*{t}",
                    "MAP": "*i64",
                    "W": "*fp32",
                    "Y": f"*{t}",
                    "H": "i32",
                    "k": "i32",
                    "BLOCK": "constexpr",
                },
                {"BLOCK": 1024},
            )
        )
        out.append(
            (
                f"moe_combine_bwd_{t}",
                _combine_bwd,
                {
                    "DY": f"*{t}",
                    "OUT": f"*{t}",
                    "MAP": "*i64",
                    "W": "*fp32",
                    "DOUT": f"*{t}",
                    "DW": "*fp32",
                    "H": "i32",
                    "k": "i32",
                    "BLOCK": "constexpr",
                },
                {"BLOCK": 1024},
            )
        )
        strides = dict.fromkeys("N K s_xm s_xk s_we s_wn s_wk s_ym s_yn".split(), "i32")
        out.append(
            (
                f"grouped_mm_{t}",
                _grouped_mm,
                {
                    "X": f"*{t}",
                    "W": f"*{t}",
                    "Y": f"*{t}",
                    "TILE_E": "*i64",
                    "TILE_M": "*i64",
                    "OFFS": "*i64",
                    **strides,
                    "BLOCK_M": "constexpr",
                    "BLOCK_N": "constexpr",
                    "BLOCK_K": "constexpr",
                },
                {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32},
            )
        )
        strides = dict.fromkeys("N K s_xm s_xk s_dm s_dn s_we s_wn s_wk".split(), "i32")
        out.append(
            (
                f"grouped_mm_dw_{t}",
                _grouped_mm_dw,
                {
                    "X": f"*{t}",
                    "DY": f"*{t}",
                    "DW": "*fp32",
                    "OFFS": "*i64",
                    **strides,
                    "BLOCK_M": "constexpr",
                    "BLOCK_N": "constexpr",
                    "BLOCK_K": "constexpr",
                },
                {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32},
            )
        )
    return out


COMPILE_CASES = _cases() if HAVE_TRITON else []
