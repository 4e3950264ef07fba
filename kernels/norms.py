"""RMSNorm and LayerNorm, each optionally fused with the residual add before it.

Layers: Triton kernels (one row per program forward on a GPU; backward programs each own a run of rows and write a
partial weight gradient), launchers, autograd Functions, functional entries, and plain-PyTorch references.
The forward saves only its input (the summed residual stream when fused), the weights and one fp32
statistic per row; the normalised rows are recomputed in the backward. Statistics in fp32; the weight is
applied to the normalised value cast to the input dtype, as transformers does.

    y = rms_norm(x, w, eps)                     y, s = rms_norm(x, w, eps, residual=r)   # s = x + r
    y = layer_norm(x, w, b, eps)                y, s = layer_norm(x, w, b, eps, residual=r)

An fp32 residual r beside a lower-precision x (--fp32-residual-connection) is summed in fp32: s and y are fp32,
and x's gradient is the fp32 one, which autograd rounds to x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_lite.kernels._common import (
    HAVE_TRITON,
    interpreting,
    launched,
    next_pow2,
    on_tensor_device,
    rows_per_program,
    triton_usable,
    warps_for,
)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _norm_fwd(
        X,
        R,
        W,
        B,
        Y,
        S,
        STAT1,
        STAT2,
        stride_x,
        stride_r,
        stride_y,
        stride_s,
        rows,
        N,
        eps,
        HAS_RES: tl.constexpr,
        IS_RMS: tl.constexpr,
        BLOCK: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        # ROWS rows per program as one [ROWS, BLOCK] tile: 1 on a GPU, more under the interpreter
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]  # tokens x hidden may pass 2^31
        rmask = row < rows
        cols = tl.arange(0, BLOCK)[None, :]
        cmask = cols < N
        mask = rmask & cmask
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            x += tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            x = x.to(S.dtype.element_ty)  # the sum returned is the one normalised (and the backward's)
            tl.store(S + row * stride_s + cols, x, mask=mask)
            x = x.to(tl.float32)
        if IS_RMS:
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1)[:, None] / N + eps)
            xhat = x * rstd
        else:
            mean = tl.sum(x, axis=1)[:, None] / N
            diff = tl.where(mask, x - mean, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=1)[:, None] / N + eps)
            xhat = diff * rstd
            tl.store(STAT2 + row, mean, mask=rmask)
        tl.store(STAT1 + row, rstd, mask=rmask)
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        if IS_RMS:  # (the normalised x rounded to the input's dtype before the weight, as HF's LlamaRMSNorm; with
            # a residual, the sum's dtype: S is X without one)
            y = xhat.to(S.dtype.element_ty).to(tl.float32) * w
        else:  # (LayerNorm rounds once, at the end, as F.layer_norm: rounding xhat too moved 1/4 of bf16 outputs)
            y = xhat * w + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_bwd(
        DY,
        X,
        W,
        STAT1,
        STAT2,
        DS,
        DX,
        DW,
        DB,
        stride_dy,
        stride_x,
        stride_ds,
        stride_dx,
        rows,
        N,
        rows_per_prog,
        IS_RMS: tl.constexpr,
        HAS_DS: tl.constexpr,
        BLOCK: tl.constexpr,
        ROWS: tl.constexpr,
        STAGES: tl.constexpr,
    ):
        # HAS_DS: the gradient of the summed residual stream (the fused add's second output) is added to dx here,
        # not in a pass of its own over three tensors.
        # ROWS rows per step as one [ROWS, BLOCK] tile: their loads are in flight together (one row at a time, each
        # program waits on a load, a reduction and a store per row; the H200 ran the backward at half a copy's rate).
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)[None, :]
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        db = tl.zeros([BLOCK], dtype=tl.float32)
        r = tl.arange(0, ROWS)[:, None]
        # STAGES > 1: the compiler prefetches the next steps' rows into shared memory (cp.async) while this one
        # reduces, so a program's loads no longer wait behind its reduction and store
        for i in tl.range(0, rows_per_prog, ROWS, num_stages=STAGES):
            row = pid * rows_per_prog + i + r  # [ROWS, 1]; the last step may run past this program's share
            rmask = (row < rows) & (i + r < rows_per_prog)
            m2 = rmask & mask[None, :]
            row64 = row.to(tl.int64)  # tokens x hidden may pass 2^31
            dy = tl.load(DY + row64 * stride_dy + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            x = tl.load(X + row64 * stride_x + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            rstd = tl.load(STAT1 + row, mask=rmask, other=0.0)
            if IS_RMS:
                xhat = x * rstd
            else:
                xhat = tl.where(m2, x - tl.load(STAT2 + row, mask=rmask, other=0.0), 0.0) * rstd
            wdy = w * dy
            c1 = tl.sum(xhat * wdy, axis=1)[:, None] / N
            if IS_RMS:
                dx = (wdy - xhat * c1) * rstd
            else:
                dx = (wdy - xhat * c1 - tl.sum(wdy, axis=1)[:, None] / N) * rstd
            if HAS_DS:
                dx += tl.load(DS + row64 * stride_ds + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            tl.store(DX + row64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=m2)
            dw += tl.sum(dy * xhat, axis=0)
            db += tl.sum(dy, axis=0)
        tl.store(DW + pid * N + cols, dw, mask=mask)
        if not IS_RMS:
            tl.store(DB + pid * N + cols, db, mask=mask)

    @triton.jit
    def _wide_chunk(DY, X, W, row64, stride_dy, stride_x, cols, N, m2, rstd, mean, IS_RMS: tl.constexpr):
        """A chunk of the rows' dy, normalised x and weight x dy, in fp32 (both of _norm_bwd_wide's passes)."""
        dy = tl.load(DY + row64 * stride_dy + cols, mask=m2, other=0.0).to(tl.float32)
        x = tl.load(X + row64 * stride_x + cols, mask=m2, other=0.0).to(tl.float32)
        wdy = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32) * dy
        xhat = x * rstd if IS_RMS else tl.where(m2, x - mean, 0.0) * rstd
        return dy, xhat, wdy

    @triton.jit
    def _norm_bwd_wide(
        DY, X, W, STAT1, STAT2, DS, DX, DW, DB, stride_dy, stride_x, stride_ds, stride_dx, rows, N, rows_per_prog,
        IS_RMS: tl.constexpr, HAS_DS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr,
    ):  # fmt: skip
        """_norm_bwd for rows too wide for one register tile: at 16384 columns the one-pass kernel holds the row,
        the weight and the partial weight (and bias) gradients in registers and spilled (LayerNorm on an H200:
        0.16 of a same-size copy's rate; 0.49 here). Here a row is walked in BLOCK-column chunks twice: first
        for its two sums, then for dx, re-reading the row (from L2: a step's rows are a few hundred KB a
        program); the partial weight and bias gradients accumulate in the program's own rows of DW and DB (in
        L2), in a fixed order."""
        pid = tl.program_id(0)
        r = tl.arange(0, ROWS)[:, None]
        c = tl.arange(0, BLOCK)[None, :]
        for i in range(0, rows_per_prog, ROWS):
            row = pid * rows_per_prog + i + r  # [ROWS, 1]; the last step may run past this program's share
            rmask = (row < rows) & (i + r < rows_per_prog)
            row64 = row.to(tl.int64)  # tokens x hidden may pass 2^31
            rstd = tl.load(STAT1 + row, mask=rmask, other=0.0)
            mean = tl.load(STAT2 + row, mask=rmask, other=0.0)  # (LayerNorm's; unused by RMSNorm)
            a1 = tl.zeros([ROWS, BLOCK], dtype=tl.float32)  # sum of xhat * w * dy, per lane until the end
            a2 = tl.zeros([ROWS, BLOCK], dtype=tl.float32)  # sum of w * dy (LayerNorm)
            for c0 in tl.range(0, N, BLOCK, num_stages=STAGES):
                cols = c0 + c
                m2 = rmask & (cols < N)
                dy, xhat, wdy = _wide_chunk(DY, X, W, row64, stride_dy, stride_x, cols, N, m2, rstd, mean, IS_RMS)
                a1 += xhat * wdy
                if not IS_RMS:
                    a2 += wdy
            c1 = tl.sum(a1, axis=1)[:, None] / N
            c2 = tl.sum(a2, axis=1)[:, None] / N
            tl.debug_barrier()  # the last step's partial-gradient stores, by any thread, before this step's loads
            for c0 in tl.range(0, N, BLOCK, num_stages=STAGES):
                cols = c0 + c
                cmask = cols < N
                m2 = rmask & cmask
                dy, xhat, wdy = _wide_chunk(DY, X, W, row64, stride_dy, stride_x, cols, N, m2, rstd, mean, IS_RMS)
                dx = (wdy - xhat * c1) * rstd if IS_RMS else (wdy - xhat * c1 - c2) * rstd
                if HAS_DS:
                    dx += tl.load(DS + row64 * stride_ds + cols, mask=m2, other=0.0).to(tl.float32)
                tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=m2)
                first = cmask & (i > 0)  # (the first step writes the partial sums, the later ones add to them)
                part = tl.load(DW + pid * N + cols, mask=first, other=0.0) + tl.sum(dy * xhat, axis=0)[None, :]
                tl.store(DW + pid * N + cols, part, mask=cmask)
                if not IS_RMS:
                    part = tl.load(DB + pid * N + cols, mask=first, other=0.0) + tl.sum(dy, axis=0)[None, :]
                    tl.store(DB + pid * N + cols, part, mask=cmask)

    @triton.jit
    def _partials_sum(P, Q, OUT_P, OUT_Q, g, N, HAS_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
        """OUT_P[n] = sum over i of P[i, n] in fp32, stored in OUT_P's dtype (and OUT_Q from Q when HAS_Q): the
        backward programs' partial weight (and bias) gradients in one launch, where PyTorch took a sum and a cast
        per tensor (two launches for RMSNorm, four for LayerNorm, each a few microseconds at Llama's sizes).
        A fixed order of addition: the same bits on every run."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        acc_p = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_q = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, g, BLOCK_G):
            r = (start + tl.arange(0, BLOCK_G)[:, None]).to(tl.int64)
            m = (r < g) & cmask[None, :]
            acc_p += tl.sum(tl.load(P + r * N + cols[None, :], mask=m, other=0.0), axis=0)
            if HAS_Q:
                acc_q += tl.sum(tl.load(Q + r * N + cols[None, :], mask=m, other=0.0), axis=0)
        tl.store(OUT_P + cols, acc_p.to(OUT_P.dtype.element_ty), mask=cmask)
        if HAS_Q:
            tl.store(OUT_Q + cols, acc_q.to(OUT_Q.dtype.element_ty), mask=cmask)


# The backward's settings, from tools/bench_norm_tiles.py on an H200 (bf16, 4096 x 4096, 2026-12-04): of 54
# settings, 1 program per SM taking 2 rows a step with a 3-stage software-pipelined row loop was the fastest for
# RMSNorm (55.9 us forward+backward against 63.3 at the old 2 programs, 1 row, 1 stage), its residual form and
# LayerNorm (59.6 against 77.0 us). Each program walks its share of the rows and keeps one partial weight gradient.
# At 8192 columns (2048 rows) 1 row a step was the faster (RMSNorm 57.2 against 66.4 us, LayerNorm 63.5 against
# 88.0), so a step takes at most BWD_STEP_ELEMENTS columns' worth of rows, and at most BWD_ROWS_PER_STEP rows.
# BWD_WARPS: warps per program (0: warps_for the step's elements, as the forward).
BWD_PROGRAMS_PER_SM = 1
BWD_ROWS_PER_STEP = 2
BWD_STEP_ELEMENTS = 8192
BWD_STAGES = 3
BWD_WARPS = 0
# The pipelined loop may buffer its coming steps' rows in shared memory (Triton 3.9 does for fp32 rows: 192 KB at
# 4096 columns, 2 rows and 3 stages; Hopper allows 227 KB a program), so the rows a step, then the stages, are
# lowered until rows x stages x the tensors read x the row's bytes fits this budget (an estimate on the safe side).
BWD_SMEM_BUDGET = 200 << 10
# LayerNorm rows of at least BWD_WIDE_FROM columns (rounded up to a power of two) take _norm_bwd_wide, in chunks
# of BWD_WIDE_CHUNK columns: at 16384 its one-pass kernel spilled registers (ptxas: 480 bytes a thread) and ran
# forward+backward at 0.16 of a same-size copy on an H200 (1003.6 us at 4096 x 16384 bf16; 434.2 at 1 row and 1
# stage); the wide kernel took 328.4 us (964.6 -> 254.4 at 12288 columns, GPT-3's width). Chunks of 1024 and 2048
# columns were slower (407.6, 346.6). RMSNorm's one-pass kernel spills less (288 bytes) and stayed the faster
# (243.1 against 255.7 us at 16384; 198.1 against 203.5 at 12288), so RMSNorm takes the wide kernel only from
# BWD_WIDE_FROM_RMS columns.
BWD_WIDE_FROM = 16384
BWD_WIDE_FROM_RMS = 1 << 20
BWD_WIDE_CHUNK = 4096
# The partial sums' reduction: columns per program (at 4096 columns, 128 programs) and partial rows per step.
SUM_BLOCK_N = 32
SUM_BLOCK_G = 128


def _fit(step: int, stages: int, row_bytes: int) -> tuple[int, int]:
    """(rows per step, stages) lowered, the rows first, until step x stages rows fit in BWD_SMEM_BUDGET."""
    while step > 1 and step * stages * row_bytes > BWD_SMEM_BUDGET:
        step //= 2
    while stages > 1 and step * stages * row_bytes > BWD_SMEM_BUDGET:
        stages -= 1
    return step, stages


def _bounds(block: int, row_bytes: int) -> tuple[int, int]:
    """(rows per step, stages) on a GPU: BWD_ROWS_PER_STEP up to BWD_STEP_ELEMENTS columns' worth, BWD_STAGES,
    both lowered by _fit to the shared-memory budget."""
    return _fit(min(BWD_ROWS_PER_STEP, max(1, BWD_STEP_ELEMENTS // block)), BWD_STAGES, row_bytes)


def _tiling(rows: int, block: int, device: torch.device, row_bytes: int) -> tuple[int, int, int]:
    """(programs, rows per step, stages) of the backward; `row_bytes`: the bytes of one row of every tensor the
    loop reads (dy, x, and the residual stream's gradient when fused)."""
    if device.type == "cuda" and not interpreting():
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return min(rows, sms * BWD_PROGRAMS_PER_SM), *_bounds(block, row_bytes)
    step = max(BWD_ROWS_PER_STEP, rows_per_program(block, rows))  # (under the interpreter: many rows at once)
    return min(8, triton.cdiv(rows, step)), step, BWD_STAGES


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, is_rms):
        shape = x.shape
        n = shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        rows = x2.shape[0]
        r2 = residual.reshape(-1, n).contiguous() if residual is not None else x2
        # the sum in the wider dtype of the two (an fp32 residual stream beside a bf16 branch output stays fp32)
        sum_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
        # RMSNorm's output takes the weight's dtype where it is wider (weight * xhat.to(x.dtype), as transformers)
        y = torch.empty_like(x2, dtype=torch.promote_types(sum_dtype, weight.dtype) if is_rms else sum_dtype)
        s = torch.empty_like(x2, dtype=sum_dtype) if residual is not None else x2
        stat1 = torch.empty(rows, dtype=torch.float32, device=x.device)
        stat2 = torch.empty(rows, dtype=torch.float32, device=x.device)
        weight = weight.contiguous()  # (the kernels read them by column index alone)
        if is_rms:
            b = weight  # (a placeholder: RMSNorm reads no bias)
        else:  # a LayerNorm without bias adds zeros
            b = bias.contiguous() if bias is not None else torch.zeros_like(weight)
        per = rows_per_program(next_pow2(n), rows)
        _norm_fwd[(triton.cdiv(rows, per),)](
            x2,
            r2,
            weight,
            b,
            y,
            s,
            stat1,
            stat2,
            x2.stride(0),
            r2.stride(0),
            y.stride(0),
            s.stride(0),
            rows,
            n,
            eps,
            HAS_RES=residual is not None,
            IS_RMS=is_rms,
            BLOCK=next_pow2(n),
            ROWS=per,
            num_warps=warps_for(next_pow2(n)),
        )
        launched("rms_norm_fwd" if is_rms else "layer_norm_fwd")
        ctx.save_for_backward(s, weight, stat1, stat2)
        ctx.is_rms, ctx.has_bias, ctx.has_res, ctx.shape = is_rms, bias is not None, residual is not None, shape
        y = y.view(shape)
        return (y, s.view(shape)) if residual is not None else y

    @staticmethod
    def backward(ctx, dy, ds=None):
        s, weight, stat1, stat2 = ctx.saved_tensors
        n = s.shape[-1]
        dy2 = dy.reshape(-1, n).contiguous()
        rows = s.shape[0]
        dx = torch.empty_like(s)
        ds2 = ds.reshape(-1, n).contiguous() if ds is not None else dy2  # (a placeholder when there is none)
        reads = 2 + (ds is not None)
        wide = next_pow2(n) >= (BWD_WIDE_FROM_RMS if ctx.is_rms else BWD_WIDE_FROM)
        block = min(next_pow2(n), BWD_WIDE_CHUNK) if wide else next_pow2(n)  # (the wide kernel's chunk)
        g, step, stages = _tiling(rows, block, s.device, reads * block * s.element_size())
        g = max(g, 1)  # no rows (an empty micro-batch): one program that writes zero partial sums,
        per = max(1, (rows + g - 1) // g)  # in one step of masked rows (the wide kernel writes them in its row loop)
        dw = torch.empty(g, n, dtype=torch.float32, device=s.device)
        db = torch.empty(g, n, dtype=torch.float32, device=s.device)
        (_norm_bwd_wide if wide else _norm_bwd)[(g,)](
            dy2,
            s,
            weight,
            stat1,
            stat2,
            ds2,
            dx,
            dw,
            db,
            dy2.stride(0),
            s.stride(0),
            ds2.stride(0),
            dx.stride(0),
            rows,
            n,
            per,
            IS_RMS=ctx.is_rms,
            HAS_DS=ds is not None,
            BLOCK=block,
            ROWS=step,
            STAGES=stages,
            num_warps=BWD_WARPS or warps_for(block * step),
        )
        launched("rms_norm_bwd" if ctx.is_rms else "layer_norm_bwd")
        if wide:
            launched("norm_bwd_wide")
        dx = dx.view(ctx.shape)  # (with ds: the summed residual stream's own gradient included)
        dweight = torch.empty_like(weight)
        dbias = torch.empty_like(weight) if ctx.has_bias else None
        _partials_sum[(triton.cdiv(n, SUM_BLOCK_N),)](
            dw, db, dweight, dweight if dbias is None else dbias, g, n,
            HAS_Q=dbias is not None, BLOCK_G=min(SUM_BLOCK_G, next_pow2(g)), BLOCK_N=SUM_BLOCK_N,
        )  # fmt: skip
        launched("norm_partials_sum")
        return dx, dweight, dbias, (dx if ctx.has_res else None), None, None


# References (the oracle and the fallback) ------------------------------------------------------------
def rms_norm_reference(x, weight, eps, residual=None):
    s = x + residual if residual is not None else x
    sf = s.float()
    y = weight * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype)
    return (y, s) if residual is not None else y


def layer_norm_reference(x, weight, bias, eps, residual=None):
    s = x + residual if residual is not None else x
    b = bias.float() if bias is not None else None
    y = F.layer_norm(s.float(), (s.shape[-1],), weight.float(), b, eps).to(s.dtype)
    return (y, s) if residual is not None else y


# Functional entries ----------------------------------------------------------------------------------
def _check_shapes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual) -> None:
    # (the kernel reads weight[:N] whatever its length: a shorter one was read past its end)
    if x.dim() == 0:
        raise ValueError("norm x must be [..., hidden], got a 0-dim tensor")
    n = x.shape[-1]
    if weight is None:  # (an AttributeError deep in the launcher)
        raise ValueError(f"norm weight is None: pass a ({n},) weight (ones for a norm without an affine scale)")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (n,):
            raise ValueError(f"norm {name} of shape {tuple(t.shape)} for rows of {n}: it must be ({n},)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"norm residual {tuple(residual.shape)} is not the shape of x {tuple(x.shape)}")


def _kernel_residual(x: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether the kernel sums this residual: none, one of x's dtype, or an fp32 stream (--fp32-residual-connection)."""
    return residual is None or residual.dtype in (x.dtype, torch.float32)


@on_tensor_device
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of x (or of x + residual, also returned). Triton when usable, else the reference. A residual of
    another dtype is summed in their promoted dtype, as torch adds them (the kernel: an fp32 residual only)."""
    _check_shapes(x, weight, None, residual)
    if triton_usable(x) and _kernel_residual(x, residual):
        return _NormFunction.apply(x, weight, None, residual, eps, True)
    return rms_norm_reference(x, weight, eps, residual)


@on_tensor_device
def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None
):
    _check_shapes(x, weight, bias, residual)
    if triton_usable(x) and _kernel_residual(x, residual):
        return _NormFunction.apply(x, weight, bias, residual, eps, False)
    return layer_norm_reference(x, weight, bias, eps, residual)


def _cases() -> list[tuple]:
    out = []
    for t in ("bf16", "fp32"):
        for rms in (True, False):
            for res in (True, False):
                sig = {
                    **{n: f"*{t}" for n in "X R W B Y S".split()},
                    "STAT1": "*fp32",
                    "STAT2": "*fp32",
                    **dict.fromkeys(["stride_x", "stride_r", "stride_y", "stride_s", "rows", "N"], "i32"),
                    "eps": "fp32",
                    "HAS_RES": "constexpr",
                    "IS_RMS": "constexpr",
                    "BLOCK": "constexpr",
                    "ROWS": "constexpr",
                }
                consts = {"HAS_RES": res, "IS_RMS": rms, "BLOCK": 4096, "ROWS": 1}
                out.append((f"norm_fwd_{t}_rms{rms}_res{res}", _norm_fwd, sig, consts))
            sig = {
                **{n: f"*{t}" for n in "DY X W".split()},
                "STAT1": "*fp32",
                "STAT2": "*fp32",
                "DS": f"*{t}",
                "DX": f"*{t}",
                "DW": "*fp32",
                "DB": "*fp32",
                **dict.fromkeys("stride_dy stride_x stride_ds stride_dx rows N rows_per_prog".split(), "i32"),
                "IS_RMS": "constexpr",
                "HAS_DS": "constexpr",
                "BLOCK": "constexpr",
                "ROWS": "constexpr",
                "STAGES": "constexpr",
            }
            for rows in (1, 2, 4):  # the default and the settings the benchmark times
                for has_ds in (True, False):
                    consts = {"IS_RMS": rms, "HAS_DS": has_ds, "BLOCK": 4096, "ROWS": rows, "STAGES": 1}
                    opts = {"num_warps": warps_for(4096 * rows)}
                    out.append((f"norm_bwd_{t}_rms{rms}_ds{has_ds}_rows{rows}", _norm_bwd, sig, consts, opts))
            # the launcher's defaults: at 4096 columns, and the wide rows' kernel at its chunk (16384 and more)
            for has_ds in (True, False):
                for kernel, block, tag in ((_norm_bwd, 4096, ""), (_norm_bwd_wide, BWD_WIDE_CHUNK, "wide_")):
                    step, stages = _bounds(block, (2 + has_ds) * block * (2 if t == "bf16" else 4))
                    consts = {"IS_RMS": rms, "HAS_DS": has_ds, "BLOCK": block, "ROWS": step, "STAGES": stages}
                    name = f"norm_bwd_{tag}{t}_rms{rms}_ds{has_ds}_default"
                    out.append((name, kernel, sig, consts, {"num_warps": warps_for(block * step)}))
            if t == "bf16":  # other pipelined row loops (tools/bench_norm_tiles.py times them; with ds: the model's)
                for stages in (2, 3):
                    consts = {"IS_RMS": rms, "HAS_DS": True, "BLOCK": 4096, "ROWS": 1, "STAGES": stages}
                    name = f"norm_bwd_{t}_rms{rms}_dsTrue_rows1_stages{stages}"
                    out.append((name, _norm_bwd, sig, consts, {"num_warps": warps_for(4096)}))
        if t == "bf16":  # an fp32 weight on bf16 rows: --apply-layernorm-1p's 1 + weight, summed in fp32
            for rms in (True, False):
                sig = {**out[0][2], "W": "*fp32", "B": "*fp32" if rms else "*bf16", "Y": "*fp32" if rms else "*bf16"}
                consts = {"HAS_RES": True, "IS_RMS": rms, "BLOCK": 4096, "ROWS": 1}
                out.append((f"norm_fwd_bf16_w32_rms{rms}", _norm_fwd, sig, consts))
                bwd = f"norm_bwd_bf16_rms{rms}_dsTrue_default"
                name, kernel, sig, consts, opts = next(c for c in out if c[0] == bwd)
                out.append((name.replace("bf16", "bf16_w32"), kernel, {**sig, "W": "*fp32"}, consts, opts))
        sig = {"P": "*fp32", "Q": "*fp32", "OUT_P": f"*{t}", "OUT_Q": f"*{t}", "g": "i32", "N": "i32"}
        sig.update(dict.fromkeys(["HAS_Q", "BLOCK_G", "BLOCK_N"], "constexpr"))
        for has_q in (True, False):
            consts = {"HAS_Q": has_q, "BLOCK_G": SUM_BLOCK_G, "BLOCK_N": SUM_BLOCK_N}
            out.append((f"norm_partials_sum_{t}_q{has_q}", _partials_sum, sig, consts))
    return out


COMPILE_CASES = _cases() if HAVE_TRITON else []
