"""Flash attention (forward and backward) with grouped-query heads and the log-sum-exp.

q [batch, seq_q, heads, head_dim]; k, v [batch, seq_k, kv_heads, head_dim]; heads % kv_heads == 0. Causal
masking is aligned to the bottom right (query i sees keys j <= i + seq_k - seq_q), as decoding with a KV
cache needs; seq_q <= seq_k then. A sliding window (Mistral / Hugging Face `sliding_window`, causal only)
further limits query i to the last `window_size` keys up to its position P = i + seq_k - seq_q, itself
included: P - window_size < j <= P. The window is a runtime kernel argument, so one compiled kernel serves
every window; key blocks wholly outside it are skipped. The forward keeps only O and the log-sum-exp per
query (fp32); the backward recomputes the probabilities block by block (FlashAttention-2): one kernel per
key block accumulates dK and dV over every query head of its group (no atomics), another per query block
accumulates dQ. `flash_attention_backward` is exposed so ring attention can merge blocks exactly.
"""

from __future__ import annotations

import inspect
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
    def _visible(rows, cols, seq_q, seq_k, offset, WINDOW, CAUSAL: tl.constexpr):
        """[rows, cols] pairs inside both sequences and, when causal, 0 <= query + offset - key < WINDOW: the key
        is at or before the query (bottom right) and among its last WINDOW keys (WINDOW >= seq_k: no window)."""
        valid = (rows[:, None] < seq_q) & (cols[None, :] < seq_k)
        if CAUSAL:
            dist = rows[:, None] + offset - cols[None, :]
            valid = valid & (dist >= 0) & (dist < WINDOW)
        return valid

    @triton.jit
    def _key_spans(start_m, offset, seq_k, WINDOW, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The key blocks a query block visits, [lo, end), and among them those every row sees whole (inside
        seq_k, at or before the first row's position, inside the last row's window), [full_lo, full_hi): the mask
        is needed only in [lo, full_lo) and [full_hi, end)."""
        lo = 0
        end = seq_k
        full_hi = seq_k // BLOCK_N * BLOCK_N
        if CAUSAL:  # keys before the first row's window or after the last row's position are hidden from the block
            lo = tl.maximum(start_m + offset - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
            end = tl.minimum(seq_k, start_m + BLOCK_M + offset)
            full_hi = tl.minimum(full_hi, (start_m + offset + 1) // BLOCK_N * BLOCK_N)
        full_lo = lo
        if CAUSAL:
            full_lo = tl.maximum(lo, tl.cdiv(start_m + BLOCK_M + offset - WINDOW, BLOCK_N) * BLOCK_N)
        full_hi = tl.maximum(tl.minimum(full_hi, end), lo)
        full_lo = tl.minimum(full_lo, full_hi)
        return lo, full_lo, full_hi, end

    @triton.jit
    def _fwd_block(
        q,
        K,
        V,
        kv,
        sks,
        svs,
        rows,
        start_n,
        rows_end,
        seq_k,
        offset,
        WINDOW,
        scale,
        dims,
        dmask,
        m,
        lsum,
        acc,
        CAUSAL: tl.constexpr,
        MASKED: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One key block of the online softmax; MASKED: apply the visibility mask (blocks on an edge)."""
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _load_block(K, kv[0], cols, sks, seq_k, dims, dmask)
        v = _load_block(V, kv[1], cols, svs, seq_k, dims, dmask)
        s = tl.dot(q, tl.trans(k)) * scale
        if MASKED:  # no row bound here: padded query rows (never stored) keep the scores they get
            s = tl.where(_visible(rows, cols, rows_end, seq_k, offset, WINDOW, CAUSAL), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row may see no key of a block so far (its window starts further on, or a padded row's window lies
        # past seq_k): subtract 0 rather than -inf, so p and alpha are 0, never inf - inf = NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        lsum = lsum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, lsum, acc

    @triton.jit(do_not_specialize=["WINDOW"])  # one kernel for every window, 1 and multiples of 16 too
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
        WINDOW,
        CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # Causal work grows with the query block, which sits on the grid's slow axis: every head's last (heaviest)
        # block goes first and the light ones fill the final wave.
        start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
        bh = tl.program_id(0)
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
        lo, full_lo, full_hi, end = _key_spans(start_m, offset, seq_k, WINDOW, CAUSAL, BLOCK_M, BLOCK_N)
        kv = (b * skb + kvh * skh, b * svb + kvh * svh)
        for part in tl.static_range(3):  # edge blocks (masked), blocks every row sees whole, edge blocks again
            a = lo if part == 0 else (full_lo if part == 1 else full_hi)
            z = full_lo if part == 0 else (full_hi if part == 1 else end)
            for start_n in range(a, z, BLOCK_N):
                m, lsum, acc = _fwd_block(
                    q,
                    K,
                    V,
                    kv,
                    sks,
                    svs,
                    rows,
                    start_n,
                    start_m + BLOCK_M,
                    seq_k,
                    offset,
                    WINDOW,
                    scale,
                    dims,
                    dmask,
                    m,
                    lsum,
                    acc,
                    CAUSAL,
                    part != 1,
                    BLOCK_N,
                )
        # Every real row sees at least its own key (lsum >= 1); only padded rows, never stored, can have lsum 0.
        lsum = tl.where(lsum > 0.0, lsum, 1.0)
        o = acc / lsum[:, None]
        tl.store(
            O + b * sob + h * soh + rows[:, None] * sos + dims[None, :],
            o.to(O.dtype.element_ty),
            mask=(rows[:, None] < seq_q) & dmask[None, :],
        )
        tl.store(LSE + bh * seq_q + rows, m + tl.log(lsum), mask=rows < seq_q)

    @triton.jit
    def _dkdv_block(
        Q,
        DO,
        LSE,
        DELTA,
        qo,
        bh,
        sqs,
        sds,
        k,
        v,
        cols,
        start_m,
        seq_q,
        seq_k,
        offset,
        WINDOW,
        scale,
        dims,
        dmask,
        dk,
        dv,
        CAUSAL: tl.constexpr,
        MASKED: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """One query block's share of a key block's dK and dV; MASKED: apply the visibility mask."""
        rows = start_m + tl.arange(0, BLOCK_M)
        q = _load_block(Q, qo[0], rows, sqs, seq_q, dims, dmask)
        do = _load_block(DO, qo[1], rows, sds, seq_q, dims, dmask)
        lse = tl.load(LSE + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
        delta = tl.load(DELTA + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        p = tl.exp(s - lse[:, None])
        if MASKED:
            p = tl.where(_visible(rows, cols, seq_q, seq_k, offset, WINDOW, CAUSAL), p, 0.0)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None]) * scale
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
        return dk, dv

    @triton.jit
    def _dq_block(
        K,
        V,
        kv,
        sks,
        svs,
        q,
        do,
        lse,
        delta,
        rows,
        start_n,
        seq_q,
        seq_k,
        offset,
        WINDOW,
        scale,
        dims,
        dmask,
        dq,
        CAUSAL: tl.constexpr,
        MASKED: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One key block's share of a query block's dQ; MASKED: apply the visibility mask."""
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _load_block(K, kv[0], cols, sks, seq_k, dims, dmask)
        v = _load_block(V, kv[1], cols, svs, seq_k, dims, dmask)
        s = tl.dot(q, tl.trans(k)) * scale
        p = tl.exp(s - lse[:, None])
        if MASKED:
            p = tl.where(_visible(rows, cols, seq_q, seq_k, offset, WINDOW, CAUSAL), p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None]) * scale
        return dq + tl.dot(ds.to(k.dtype), k)

    @triton.jit(do_not_specialize=["WINDOW"])  # one kernel for every window, 1 and multiples of 16 too
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
        WINDOW,
        CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # Key block on the grid's slow axis: every head's first (heaviest, under causal masking) block goes first.
        start_n = tl.program_id(1) * BLOCK_N
        bkv = tl.program_id(0)
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
        last = seq_q
        if CAUSAL:  # earlier queries cannot see this key block, nor later ones whose window starts past it
            first = tl.maximum(start_n - offset, 0) // BLOCK_M * BLOCK_M
            last = tl.minimum(seq_q, start_n + BLOCK_N - 1 + WINDOW - offset)
        # Query blocks that see this whole key block (every row at or after its last key, inside the window of its
        # first key, rows and keys inside their sequences) skip the mask: [full_lo, full_hi); the edges keep it.
        full_lo = first
        full_hi = seq_q // BLOCK_M * BLOCK_M
        if CAUSAL:
            full_lo = tl.maximum(first, tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - offset, 0), BLOCK_M) * BLOCK_M)
            full_hi = tl.minimum(full_hi, tl.maximum(start_n + WINDOW - offset, 0) // BLOCK_M * BLOCK_M)
        if start_n + BLOCK_N > seq_k:
            full_hi = full_lo
        full_lo = tl.minimum(full_lo, last)
        full_hi = tl.maximum(tl.minimum(full_hi, last), full_lo)
        for j in range(0, group):
            bh = b * heads + kvh * group + j
            qo = (b * sqb + (kvh * group + j) * sqh, b * sdb + (kvh * group + j) * sdh)
            for part in tl.static_range(3):  # edge query blocks (masked), those that see it whole, edge again
                a = first if part == 0 else (full_lo if part == 1 else full_hi)
                z = full_lo if part == 0 else (full_hi if part == 1 else last)
                for start_m in range(a, z, BLOCK_M):
                    dk, dv = _dkdv_block(
                        Q,
                        DO,
                        LSE,
                        DELTA,
                        qo,
                        bh,
                        sqs,
                        sds,
                        k,
                        v,
                        cols,
                        start_m,
                        seq_q,
                        seq_k,
                        offset,
                        WINDOW,
                        scale,
                        dims,
                        dmask,
                        dk,
                        dv,
                        CAUSAL,
                        part != 1,
                        BLOCK_M,
                    )
        tl.store(
            DK + b * skb + kvh * skh + cols[:, None] * sks + dims[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask
        )
        tl.store(
            DV + b * svb + kvh * svh + cols[:, None] * svs + dims[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask
        )

    @triton.jit(do_not_specialize=["WINDOW"])  # one kernel for every window, 1 and multiples of 16 too
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
        WINDOW,
        CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # Causal work grows with the query block, which sits on the grid's slow axis: every head's last (heaviest)
        # block goes first and the light ones fill the final wave.
        start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
        bh = tl.program_id(0)
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
        lo, full_lo, full_hi, end = _key_spans(start_m, offset, seq_k, WINDOW, CAUSAL, BLOCK_M, BLOCK_N)
        kv = (b * skb + kvh * skh, b * svb + kvh * svh)
        for part in tl.static_range(3):  # as in the forward
            a = lo if part == 0 else (full_lo if part == 1 else full_hi)
            z = full_lo if part == 0 else (full_hi if part == 1 else end)
            for start_n in range(a, z, BLOCK_N):
                dq = _dq_block(
                    K,
                    V,
                    kv,
                    sks,
                    svs,
                    q,
                    do,
                    lse,
                    delta,
                    rows,
                    start_n,
                    seq_q,
                    seq_k,
                    offset,
                    WINDOW,
                    scale,
                    dims,
                    dmask,
                    dq,
                    CAUSAL,
                    part != 1,
                    BLOCK_N,
                )
        tl.store(DQ + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], dq.to(DQ.dtype.element_ty), mask=q_mask)


if HAVE_TRITON:
    # On a GPU each kernel picks its tiles by timing these once per head_dim, causality and sequence lengths
    # (Triton's autotuner; bf16/fp16 only, see _kernel); the interpreter runs one fixed small config. Tiles too
    # large for shared memory are skipped by the autotuner.
    def _configs(shapes):
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in shapes]

    _TUNE_KEY = ["head_dim", "CAUSAL", "seq_q", "seq_k"]  # a training run has one or two sequence lengths
    # The chosen tiles are cached on disk (Triton's cache), so later runs on this machine, a resumed job among
    # them, pick the same tiles and round the same way. Triton before 3.3 has no such option.
    _TUNE_OPTS = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    # (BLOCK_M queries, BLOCK_N keys, warps, stages)
    _FWD_TILES = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 32, 4, 4), (64, 64, 4, 3), (64, 32, 4, 4)]
    # dK/dV: one program per key block, so wide BLOCK_N and narrow query steps; dQ the other way round.
    _DKDV_TILES = [(32, 128, 8, 3), (32, 128, 4, 3), (64, 128, 8, 3), (32, 64, 4, 4), (64, 64, 4, 3), (16, 64, 4, 4)]
    _DQ_TILES = [(128, 32, 8, 3), (128, 32, 4, 4), (128, 64, 8, 3), (64, 32, 4, 4), (64, 64, 4, 3), (64, 16, 4, 4)]
    _fwd_tuned = triton.autotune(_configs(_FWD_TILES), key=_TUNE_KEY, **_TUNE_OPTS)(_fwd)
    _bwd_dkdv_tuned = triton.autotune(_configs(_DKDV_TILES), key=_TUNE_KEY, **_TUNE_OPTS)(_bwd_dkdv)
    _bwd_dq_tuned = triton.autotune(_configs(_DQ_TILES), key=_TUNE_KEY, **_TUNE_OPTS)(_bwd_dq)


def _kernel(plain, tuned, dtype: torch.dtype):
    """The kernel to launch and its fixed tiles: fixed small tiles when interpreting; on a GPU, fp32 (tests, not
    training) takes one fixed tile, other dtypes the autotuned kernel."""
    if interpreting():
        return plain, {"BLOCK_M": 16, "BLOCK_N": 16}
    if dtype == torch.float32:
        return plain, {"BLOCK_M": 32, "BLOCK_N": 32}
    return tuned, {}


def _window(window_size: int | None, causal: bool, seq_k: int) -> int:
    """The kernels' WINDOW argument: the window clamped to seq_k (a window of seq_k or more hides no key), seq_k
    when there is none. Raises on a window without causal masking or below 1."""
    if window_size is None:
        return seq_k
    if not causal:
        raise ValueError(f"window_size={window_size} needs causal=True (a sliding window looks back from the query)")
    if window_size < 1:
        raise ValueError(f"window_size must be >= 1 or None, got {window_size}")
    return min(int(window_size), seq_k)


def _check(q, k, v, causal, window_size=None):
    b, sq, h, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or v.shape != k.shape or h % k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} / v {tuple(v.shape)} do not fit together")
    if causal and sq > k.shape[1]:
        raise ValueError(f"causal attention with bottom-right alignment needs seq_q {sq} <= seq_k {k.shape[1]}")
    _window(window_size, causal, k.shape[1])


def _forward(q, k, v, causal, scale, window_size=None):
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
    kernel, cfg = _kernel(_fwd, _fwd_tuned, q.dtype)
    kernel[lambda meta: (b * h, triton.cdiv(sq, meta["BLOCK_M"]))](
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
        _window(window_size, causal, sk),
        CAUSAL=causal,
        BLOCK_D=next_pow2(max(d, 16)),
        **cfg,
    )
    launched("flash_attention_fwd")
    return o, lse


def flash_attention_backward(
    q,
    k,
    v,
    o,
    lse,
    do,
    causal: bool = True,
    softmax_scale: float | None = None,
    *,
    window_size: int | None = None,
):
    """dq, dk, dv of attention, given its output o and log-sum-exp lse [batch, heads, seq_q] (fp32)."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    q, k, v, o, do = (t.contiguous() for t in (q, k, v, o, do))
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    window = _window(window_size, causal, sk)
    delta = (o.float() * do.float()).sum(-1).transpose(1, 2).contiguous()  # [b, h, sq]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(CAUSAL=causal, BLOCK_D=next_pow2(max(d, 16)))
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    kernel, cfg = _kernel(_bwd_dkdv, _bwd_dkdv_tuned, q.dtype)
    kernel[lambda meta: (b * hkv, triton.cdiv(sk, meta["BLOCK_N"]))](
        q, k, v, do, lse, delta, dk, dv, *strides, h, h // hkv, sq, sk, scale, d, window, **common, **cfg
    )
    kernel, cfg = _kernel(_bwd_dq, _bwd_dq_tuned, q.dtype)
    kernel[lambda meta: (b * h, triton.cdiv(sq, meta["BLOCK_M"]))](
        q, k, v, do, lse, delta, dq, *strides, h, h // hkv, sq, sk, scale, d, window, **common, **cfg
    )
    launched("flash_attention_bwd")
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, window_size):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o, lse = _forward(q, k, v, causal, scale, window_size)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.window_size = causal, scale, window_size
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        grads = flash_attention_backward(q, k, v, o, lse, do, ctx.causal, ctx.scale, window_size=ctx.window_size)
        return (*grads, None, None, None)


def flash_attention_reference(q, k, v, causal=True, softmax_scale=None, return_lse=False, *, window_size=None):
    """Plain PyTorch, fp32 math: the oracle and the fallback."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    window = _window(window_size, causal, sk)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    kk = k.repeat_interleave(h // hkv, dim=2)
    vv = v.repeat_interleave(h // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk.float()) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        dist = i + (sk - sq) - j  # query position minus key position
        s = s.masked_fill((dist < 0) | (dist >= window), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), vv.float()).to(q.dtype)
    return (o, lse) if return_lse else o


def flash_attention_backward_reference(
    q, k, v, o, lse, do, causal: bool = True, softmax_scale: float | None = None, *, window_size: int | None = None
):
    """Plain PyTorch (fp32 math) dq, dk, dv given the output o and log-sum-exp lse [batch, heads, seq_q] of a
    forward: P = exp(S - lse), dS = P * (dP - rowsum(dO * O)). With the o and lse of a larger attention that
    this block is part of (ring attention), the results are this block's share of the exact gradients."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    window = _window(window_size, causal, sk)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    rep = h // hkv
    qf, of, dof = q.float(), o.float(), do.float()
    kk = k.float().repeat_interleave(rep, dim=2)
    vv = v.float().repeat_interleave(rep, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kk) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        dist = i + (sk - sq) - j
        s = s.masked_fill((dist < 0) | (dist >= window), float("-inf"))
    p = torch.exp(s - lse.float().unsqueeze(-1))
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dof)
    dp = torch.einsum("bqhd,bkhd->bhqk", dof, vv)
    delta = (of * dof).sum(-1).transpose(1, 2).unsqueeze(-1)  # [b, h, sq, 1]
    ds = p * (dp - delta) * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qf)
    if rep > 1:  # the query heads of a group share one key/value head: sum their gradients
        dk = dk.reshape(b, sk, hkv, rep, d).sum(3)
        dv = dv.reshape(b, sk, hkv, rep, d).sum(3)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    *,
    window_size: int | None = None,
):
    """Attention of q over k, v (layouts in the module docstring); window_size: Mistral-style sliding window
    (causal only; None: none). Returns o, and the log-sum-exp [batch, heads, seq_q] (fp32) if return_lse."""
    _check(q, k, v, causal, window_size)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if not triton_usable(q, k, v):
        return flash_attention_reference(q, k, v, causal, scale, return_lse, window_size=window_size)
    o, lse = _FlashAttention.apply(q, k, v, causal, scale, window_size)
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
                "WINDOW": "i32",
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
    # The largest tiles each kernel's autotuner may pick, as a GPU would build them (bf16, head_dim 128).
    for name, kernel, (m, n, w, st) in (
        ("fwd", _fwd, _FWD_TILES[1]),
        ("bwd_dkdv", _bwd_dkdv, _DKDV_TILES[2]),
        ("bwd_dq", _bwd_dq, _DQ_TILES[2]),
    ):
        case = next(c for c in out if c[0] == f"flash_{name}_bf16_causalTrue")
        consts = {**case[3], "BLOCK_M": m, "BLOCK_N": n}
        out.append(
            (f"flash_{name}_bf16_tiles{m}x{n}_w{w}_s{st}", kernel, case[2], consts, {"num_warps": w, "num_stages": st})
        )
    return out


COMPILE_CASES = _cases() if HAVE_TRITON else []
