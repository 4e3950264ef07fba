"""Flash attention (forward and backward) with grouped-query heads and the log-sum-exp.

q [batch, seq_q, heads, head_dim]; k, v [batch, seq_k, kv_heads, head_dim]; heads % kv_heads == 0. Causal
masking is aligned to the bottom right (query i sees keys j <= i + seq_k - seq_q), as decoding with a KV
cache needs; seq_q <= seq_k then. The forward keeps only O and the log-sum-exp per query (fp32); the
backward recomputes the probabilities block by block (FlashAttention-2): one kernel per key block
accumulates dK and dV over every query head of its group (no atomics), another per query block
accumulates dQ. `flash_attention_backward` is exposed so ring attention can merge blocks exactly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_lite.kernels._common import HAVE_TRITON, interpreting, launched, next_pow2, triton_usable

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _load_block(PTR, base, idx, stride, limit, dims, dmask):
        """Rows `idx` (< limit) of a [seq, head_dim] slice starting at PTR + base; zeros elsewhere."""
        return tl.load(
            PTR + base + idx[:, None] * stride + dims[None, :], mask=(idx[:, None] < limit) & dmask[None, :], other=0.0
        )

    @triton.jit
    def _visible(rows, cols, seq_q, seq_k, offset, CAUSAL: tl.constexpr):
        """[rows, cols] pairs inside both sequences and, when causal, key <= query + offset (bottom right)."""
        valid = (rows[:, None] < seq_q) & (cols[None, :] < seq_k)
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None] + offset)
        return valid

    @triton.jit
    def _fwd(
        Q,
        K,
        V,
        O,
        LSE,
        sqb,
        sqs,
        sqh,
        skb,
        sks,
        skh,
        svb,
        svs,
        svh,
        sob,
        sos,
        soh,
        heads,
        group,
        seq_q,
        seq_k,
        scale,
        head_dim,
        CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        start_m = tl.program_id(0) * BLOCK_M
        bh = tl.program_id(1)
        b, h = bh // heads, bh % heads
        kvh = h // group
        offset = seq_k - seq_q
        rows = start_m + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        dmask = dims < head_dim
        q = tl.load(
            Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :],
            mask=(rows[:, None] < seq_q) & dmask[None, :],
            other=0.0,
        )
        m = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        lsum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        end = seq_k
        if CAUSAL:
            end = tl.minimum(seq_k, start_m + BLOCK_M + offset)
        for start_n in range(0, end, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            k = _load_block(K, b * skb + kvh * skh, cols, sks, seq_k, dims, dmask)
            v = _load_block(V, b * svb + kvh * svh, cols, svs, seq_k, dims, dmask)
            s = tl.dot(q, tl.trans(k)) * scale
            # No row bound here: padded query rows keep finite scores (they are never stored), so no inf - inf.
            s = tl.where(_visible(rows, cols, start_m + BLOCK_M, seq_k, offset, CAUSAL), s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            lsum = lsum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        o = acc / lsum[:, None]
        tl.store(
            O + b * sob + h * soh + rows[:, None] * sos + dims[None, :],
            o.to(O.dtype.element_ty),
            mask=(rows[:, None] < seq_q) & dmask[None, :],
        )
        tl.store(LSE + bh * seq_q + rows, m + tl.log(lsum), mask=rows < seq_q)

    @triton.jit
    def _bwd_dkdv(
        Q,
        K,
        V,
        DO,
        LSE,
        DELTA,
        DK,
        DV,
        sqb,
        sqs,
        sqh,
        skb,
        sks,
        skh,
        svb,
        svs,
        svh,
        sdb,
        sds,
        sdh,
        heads,
        group,
        seq_q,
        seq_k,
        scale,
        head_dim,
        CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        start_n = tl.program_id(0) * BLOCK_N
        bkv = tl.program_id(1)
        kv_heads = heads // group
        b, kvh = bkv // kv_heads, bkv % kv_heads
        offset = seq_k - seq_q
        cols = start_n + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, BLOCK_D)
        dmask = dims < head_dim
        kv_mask = (cols[:, None] < seq_k) & dmask[None, :]
        k = _load_block(K, b * skb + kvh * skh, cols, sks, seq_k, dims, dmask)
        v = _load_block(V, b * svb + kvh * svh, cols, svs, seq_k, dims, dmask)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        first = 0
        if CAUSAL:  # earlier queries cannot see this key block
            first = tl.maximum(start_n - offset, 0) // BLOCK_M * BLOCK_M
        for j in range(0, group):
            h = kvh * group + j
            for start_m in range(first, seq_q, BLOCK_M):
                rows = start_m + tl.arange(0, BLOCK_M)
                q = _load_block(Q, b * sqb + h * sqh, rows, sqs, seq_q, dims, dmask)
                do = _load_block(DO, b * sdb + h * sdh, rows, sds, seq_q, dims, dmask)
                lse = tl.load(LSE + (b * heads + h) * seq_q + rows, mask=rows < seq_q, other=0.0)
                delta = tl.load(DELTA + (b * heads + h) * seq_q + rows, mask=rows < seq_q, other=0.0)
                s = tl.dot(q, tl.trans(k)) * scale
                p = tl.where(_visible(rows, cols, seq_q, seq_k, offset, CAUSAL), tl.exp(s - lse[:, None]), 0.0)
                dv += tl.dot(tl.trans(p.to(do.dtype)), do)
                dp = tl.dot(do, tl.trans(v))
                ds = p * (dp - delta[:, None]) * scale
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
        tl.store(
            DK + b * skb + kvh * skh + cols[:, None] * sks + dims[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask
        )
        tl.store(
            DV + b * svb + kvh * svh + cols[:, None] * svs + dims[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask
        )

    @triton.jit
    def _bwd_dq(
        Q,
        K,
        V,
        DO,
        LSE,
        DELTA,
        DQ,
        sqb,
        sqs,
        sqh,
        skb,
        sks,
        skh,
        svb,
        svs,
        svh,
        sdb,
        sds,
        sdh,
        heads,
        group,
        seq_q,
        seq_k,
        scale,
        head_dim,
        CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        start_m = tl.program_id(0) * BLOCK_M
        bh = tl.program_id(1)
        b, h = bh // heads, bh % heads
        kvh = h // group
        offset = seq_k - seq_q
        rows = start_m + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        dmask = dims < head_dim
        q_mask = (rows[:, None] < seq_q) & dmask[None, :]
        q = _load_block(Q, b * sqb + h * sqh, rows, sqs, seq_q, dims, dmask)
        do = _load_block(DO, b * sdb + h * sdh, rows, sds, seq_q, dims, dmask)
        lse = tl.load(LSE + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
        delta = tl.load(DELTA + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        end = seq_k
        if CAUSAL:
            end = tl.minimum(seq_k, start_m + BLOCK_M + offset)
        for start_n in range(0, end, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            k = _load_block(K, b * skb + kvh * skh, cols, sks, seq_k, dims, dmask)
            v = _load_block(V, b * svb + kvh * svh, cols, svs, seq_k, dims, dmask)
            s = tl.dot(q, tl.trans(k)) * scale
            p = tl.where(_visible(rows, cols, seq_q, seq_k, offset, CAUSAL), tl.exp(s - lse[:, None]), 0.0)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None]) * scale
            dq += tl.dot(ds.to(k.dtype), k)
        tl.store(DQ + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], dq.to(DQ.dtype.element_ty), mask=q_mask)


def _blocks(head_dim: int) -> dict:
    if interpreting():
        return {"BLOCK_M": 16, "BLOCK_N": 16}
    return {"BLOCK_M": 64, "BLOCK_N": 64} if head_dim <= 128 else {"BLOCK_M": 32, "BLOCK_N": 32}


def _check(q, k, v, causal):
    b, sq, h, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or v.shape != k.shape or h % k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} / v {tuple(v.shape)} do not fit together")
    if causal and sq > k.shape[1]:
        raise ValueError(f"causal attention with bottom-right alignment needs seq_q {sq} <= seq_k {k.shape[1]}")


def _forward(q, k, v, causal, scale):
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
    cfg = _blocks(d)
    grid = (triton.cdiv(sq, cfg["BLOCK_M"]), b * h)
    _fwd[grid](
        q,
        k,
        v,
        o,
        lse,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *o.stride()[:3],
        h,
        h // hkv,
        sq,
        sk,
        scale,
        d,
        CAUSAL=causal,
        BLOCK_D=next_pow2(max(d, 16)),
        **cfg,
    )
    launched("flash_attention_fwd")
    return o, lse


def flash_attention_backward(q, k, v, o, lse, do, causal: bool = True, softmax_scale: float | None = None):
    """dq, dk, dv of attention, given its output o and log-sum-exp lse [batch, heads, seq_q] (fp32)."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    q, k, v, o, do = (t.contiguous() for t in (q, k, v, o, do))
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    delta = (o.float() * do.float()).sum(-1).transpose(1, 2).contiguous()  # [b, h, sq]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    cfg = _blocks(d)
    common = dict(CAUSAL=causal, BLOCK_D=next_pow2(max(d, 16)), **cfg)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    _bwd_dkdv[(triton.cdiv(sk, cfg["BLOCK_N"]), b * hkv)](
        q, k, v, do, lse, delta, dk, dv, *strides, h, h // hkv, sq, sk, scale, d, **common
    )
    _bwd_dq[(triton.cdiv(sq, cfg["BLOCK_M"]), b * h)](
        q, k, v, do, lse, delta, dq, *strides, h, h // hkv, sq, sk, scale, d, **common
    )
    launched("flash_attention_bwd")
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o, lse = _forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        return (*flash_attention_backward(q, k, v, o, lse, do, ctx.causal, ctx.scale), None, None)


def flash_attention_reference(q, k, v, causal=True, softmax_scale=None, return_lse=False):
    """Plain PyTorch, fp32 math: the oracle and the fallback."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    kk = k.repeat_interleave(h // hkv, dim=2)
    vv = v.repeat_interleave(h // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk.float()) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), vv.float()).to(q.dtype)
    return (o, lse) if return_lse else o


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
):
    _check(q, k, v, causal)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if not triton_usable(q, k, v):
        return flash_attention_reference(q, k, v, causal, scale, return_lse)
    o, lse = _FlashAttention.apply(q, k, v, causal, scale)
    return (o, lse) if return_lse else o


def sdpa_reference(q, k, v, causal=True):
    """PyTorch's scaled_dot_product_attention on our layout (for benchmarks)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=q.shape[2] != k.shape[2]
    )
    return out.transpose(1, 2)


def _cases() -> list[tuple]:
    out = []
    for t in ("bf16", "fp32"):
        for causal in (True, False):
            base = {
                "heads": "i32",
                "group": "i32",
                "seq_q": "i32",
                "seq_k": "i32",
                "scale": "fp32",
                "head_dim": "i32",
                "CAUSAL": "constexpr",
                "BLOCK_M": "constexpr",
                "BLOCK_N": "constexpr",
                "BLOCK_D": "constexpr",
            }
            consts = {"CAUSAL": causal, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 128}
            strides = lambda names: dict.fromkeys(names, "i32")  # noqa: E731
            sig = {
                **{n: f"*{t}" for n in "Q K V O".split()},
                "LSE": "*fp32",
                **strides("sqb sqs sqh skb sks skh svb svs svh sob sos soh".split()),
                **base,
            }
            out.append((f"flash_fwd_{t}_causal{causal}", _fwd, sig, consts))
            sig = {
                **{n: f"*{t}" for n in "Q K V DO".split()},
                "LSE": "*fp32",
                "DELTA": "*fp32",
                "DK": f"*{t}",
                "DV": f"*{t}",
                **strides("sqb sqs sqh skb sks skh svb svs svh sdb sds sdh".split()),
                **base,
            }
            out.append((f"flash_bwd_dkdv_{t}_causal{causal}", _bwd_dkdv, sig, consts))
            sig = {
                **{n: f"*{t}" for n in "Q K V DO".split()},
                "LSE": "*fp32",
                "DELTA": "*fp32",
                "DQ": f"*{t}",
                **strides("sqb sqs sqh skb sks skh svb svs svh sdb sds sdh".split()),
                **base,
            }
            out.append((f"flash_bwd_dq_{t}_causal{causal}", _bwd_dq, sig, consts))
    return out


COMPILE_CASES = _cases() if HAVE_TRITON else []
