"""The Triton kernels of flash attention (flash_attention.py launches them): the forward, and the backward's dK/dV
and dQ kernels, with the block helpers they share. Each kernel visits only the key (or query) blocks its block
can see, and applies the visibility mask only on the blocks at an edge of that span.

Documents (DOCS): row i also sees only keys j >= START[i] (the first key of its document, in key indices), and
END[j] is the first row that no longer sees key j (START[row] > j). Both never decrease (contiguous documents in
position order), so a block's rows see a contiguous run of key blocks and the spans below stay exact."""

from __future__ import annotations

from megatron_lite.kernels._common import HAVE_TRITON

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
    def _visible(rows, cols, seq_q, seq_k, offset, WINDOW, starts, CAUSAL: tl.constexpr, DOCS: tl.constexpr):
        """[rows, cols] pairs inside both sequences and, when causal, 0 <= query + offset - key < WINDOW: the key
        is at or before the query (bottom right) and among its last WINDOW keys (WINDOW >= seq_k: no window).
        DOCS: also at or after the first key of the row's own document (`starts`, one per row)."""
        valid = (rows[:, None] < seq_q) & (cols[None, :] < seq_k)
        if CAUSAL:
            dist = rows[:, None] + offset - cols[None, :]
            valid = valid & (dist >= 0) & (dist < WINDOW)
        if DOCS:
            valid = valid & (cols[None, :] >= starts[:, None])
        return valid

    @triton.jit
    def _doc_key_spans(STARTS, start_m, seq_q, lo, full_lo, full_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Document masks (documents contiguous, so starts never decrease along the sequence): keys before the first
        row's document are hidden from the whole query block, and only keys from the last row's document start on
        are seen whole by every row."""
        first_start = tl.load(STARTS + start_m)
        last_start = tl.load(STARTS + tl.minimum(start_m + BLOCK_M, seq_q) - 1)
        lo = tl.maximum(lo, first_start // BLOCK_N * BLOCK_N)
        full_hi = tl.maximum(full_hi, lo)
        full_lo = tl.minimum(tl.maximum(tl.maximum(full_lo, lo), tl.cdiv(last_start, BLOCK_N) * BLOCK_N), full_hi)
        return lo, full_lo, full_hi

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
        vdims,
        vmask,
        m,
        lsum,
        acc,
        starts,
        CAUSAL: tl.constexpr,
        DOCS: tl.constexpr,
        MASKED: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One key block of the online softmax; MASKED: apply the visibility mask (blocks on an edge)."""
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _load_block(K, kv[0], cols, sks, seq_k, dims, dmask)
        v = _load_block(V, kv[1], cols, svs, seq_k, vdims, vmask)
        s = tl.dot(q, tl.trans(k)) * scale
        if MASKED:  # no row bound here: padded query rows (never stored) keep the scores they get
            s = tl.where(_visible(rows, cols, rows_end, seq_k, offset, WINDOW, starts, CAUSAL, DOCS), s, float("-inf"))
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
        MAXL,
        START,
        END,
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
        ssb,
        seb,
        heads,
        group,
        seq_q,
        seq_k,
        scale,
        head_dim,
        v_dim,
        WINDOW,
        CAUSAL: tl.constexpr,
        DOCS: tl.constexpr,
        MAX_LOGIT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
    ):
        # Causal work grows with the query block, which sits on the grid's slow axis: every head's last (heaviest)
        # block goes first and the light ones fill the final wave.
        start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
        bh = tl.program_id(0).to(tl.int64)  # batch x seq x heads x head_dim may pass 2^31
        b, h = bh // heads, bh % heads
        kvh = h // group
        offset = seq_k - seq_q
        rows = start_m + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        dmask = dims < head_dim
        vdims = tl.arange(0, BLOCK_DV)  # values may be narrower than queries and keys (multi-latent attention)
        vmask = vdims < v_dim
        q = tl.load(
            Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :],
            mask=(rows[:, None] < seq_q) & dmask[None, :],
            other=0.0,
        )
        m = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        lsum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        lo, full_lo, full_hi, end = _key_spans(start_m, offset, seq_k, WINDOW, CAUSAL, BLOCK_M, BLOCK_N)
        starts = rows  # (unused without documents)
        if DOCS:
            lo, full_lo, full_hi = _doc_key_spans(
                START + b * ssb, start_m, seq_q, lo, full_lo, full_hi, BLOCK_M, BLOCK_N
            )
            starts = tl.load(START + b * ssb + rows, mask=rows < seq_q, other=0)
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
                    vdims,
                    vmask,
                    m,
                    lsum,
                    acc,
                    starts,
                    CAUSAL,
                    DOCS,
                    part != 1,
                    BLOCK_N,
                )
        # A row that sees no key (padded rows, never stored; a ring block wholly before a query's document) has
        # lsum 0: its output is 0 and its log-sum-exp -inf, so merging it changes nothing.
        lsum = tl.where(lsum > 0.0, lsum, 1.0)
        o = acc / lsum[:, None]
        tl.store(
            O + b * sob + h * soh + rows[:, None] * sos + vdims[None, :],
            o.to(O.dtype.element_ty),
            mask=(rows[:, None] < seq_q) & vmask[None, :],
        )
        tl.store(LSE + bh * seq_q + rows, m + tl.log(lsum), mask=rows < seq_q)
        if MAX_LOGIT:  # QK-clip: each row's largest visible logit, the online softmax's running max (-inf: none)
            tl.store(MAXL + bh * seq_q + rows, m, mask=rows < seq_q)

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
        vdims,
        vmask,
        dk,
        dv,
        START,
        sb,
        CAUSAL: tl.constexpr,
        DOCS: tl.constexpr,
        MASKED: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """One query block's share of a key block's dK and dV; MASKED: apply the visibility mask."""
        rows = start_m + tl.arange(0, BLOCK_M)
        starts = rows  # (unused without documents)
        if DOCS:
            starts = tl.load(START + sb + rows, mask=rows < seq_q, other=0)
        q = _load_block(Q, qo[0], rows, sqs, seq_q, dims, dmask)
        do = _load_block(DO, qo[1], rows, sds, seq_q, vdims, vmask)
        lse = tl.load(LSE + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
        delta = tl.load(DELTA + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        p = tl.exp(s - lse[:, None])
        if MASKED:
            p = tl.where(_visible(rows, cols, seq_q, seq_k, offset, WINDOW, starts, CAUSAL, DOCS), p, 0.0)
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
        vdims,
        vmask,
        dq,
        starts,
        CAUSAL: tl.constexpr,
        DOCS: tl.constexpr,
        MASKED: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One key block's share of a query block's dQ; MASKED: apply the visibility mask."""
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _load_block(K, kv[0], cols, sks, seq_k, dims, dmask)
        v = _load_block(V, kv[1], cols, svs, seq_k, vdims, vmask)
        s = tl.dot(q, tl.trans(k)) * scale
        p = tl.exp(s - lse[:, None])
        if MASKED:
            p = tl.where(_visible(rows, cols, seq_q, seq_k, offset, WINDOW, starts, CAUSAL, DOCS), p, 0.0)
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
        START,
        END,
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
        ssb,
        seb,
        heads,
        group,
        seq_q,
        seq_k,
        scale,
        head_dim,
        v_dim,
        WINDOW,
        CAUSAL: tl.constexpr,
        DOCS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
    ):
        # Key block on the grid's slow axis: every head's first (heaviest, under causal masking) block goes first.
        start_n = tl.program_id(1) * BLOCK_N
        bkv = tl.program_id(0).to(tl.int64)  # batch x seq x heads x head_dim may pass 2^31
        kv_heads = heads // group
        b, kvh = bkv // kv_heads, bkv % kv_heads
        offset = seq_k - seq_q
        cols = start_n + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, BLOCK_D)
        dmask = dims < head_dim
        vdims = tl.arange(0, BLOCK_DV)  # values may be narrower than queries and keys (multi-latent attention)
        vmask = vdims < v_dim
        k = _load_block(K, b * skb + kvh * skh, cols, sks, seq_k, dims, dmask)
        v = _load_block(V, b * svb + kvh * svh, cols, svs, seq_k, vdims, vmask)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
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
        if DOCS:  # queries past the last key's document see none of the block; before the first key's end, all
            last = tl.minimum(last, tl.load(END + b * seb + tl.minimum(start_n + BLOCK_N, seq_k) - 1))
            full_hi = tl.minimum(full_hi, tl.load(END + b * seb + start_n) // BLOCK_M * BLOCK_M)
            full_hi = tl.maximum(full_hi, full_lo)
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
                        vdims,
                        vmask,
                        dk,
                        dv,
                        START,
                        b * ssb,
                        CAUSAL,
                        DOCS,
                        part != 1,
                        BLOCK_M,
                    )
        rows_in = cols[:, None] < seq_k
        dk_ptr = DK + b * skb + kvh * skh + cols[:, None] * sks + dims[None, :]
        tl.store(dk_ptr, dk.to(DK.dtype.element_ty), mask=rows_in & dmask[None, :])
        dv_ptr = DV + b * svb + kvh * svh + cols[:, None] * svs + vdims[None, :]
        tl.store(dv_ptr, dv.to(DV.dtype.element_ty), mask=rows_in & vmask[None, :])

    @triton.jit(do_not_specialize=["WINDOW"])  # one kernel for every window, 1 and multiples of 16 too
    def _bwd_dq(
        Q,
        K,
        V,
        DO,
        LSE,
        DELTA,
        DQ,
        START,
        END,
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
        ssb,
        seb,
        heads,
        group,
        seq_q,
        seq_k,
        scale,
        head_dim,
        v_dim,
        WINDOW,
        CAUSAL: tl.constexpr,
        DOCS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
    ):
        # Causal work grows with the query block, which sits on the grid's slow axis: every head's last (heaviest)
        # block goes first and the light ones fill the final wave.
        start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
        bh = tl.program_id(0).to(tl.int64)  # batch x seq x heads x head_dim may pass 2^31
        b, h = bh // heads, bh % heads
        kvh = h // group
        offset = seq_k - seq_q
        rows = start_m + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        dmask = dims < head_dim
        vdims = tl.arange(0, BLOCK_DV)  # values may be narrower than queries and keys (multi-latent attention)
        vmask = vdims < v_dim
        q_mask = (rows[:, None] < seq_q) & dmask[None, :]
        q = _load_block(Q, b * sqb + h * sqh, rows, sqs, seq_q, dims, dmask)
        do = _load_block(DO, b * sdb + h * sdh, rows, sds, seq_q, vdims, vmask)
        lse = tl.load(LSE + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
        delta = tl.load(DELTA + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        lo, full_lo, full_hi, end = _key_spans(start_m, offset, seq_k, WINDOW, CAUSAL, BLOCK_M, BLOCK_N)
        starts = rows  # (unused without documents)
        if DOCS:
            lo, full_lo, full_hi = _doc_key_spans(
                START + b * ssb, start_m, seq_q, lo, full_lo, full_hi, BLOCK_M, BLOCK_N
            )
            starts = tl.load(START + b * ssb + rows, mask=rows < seq_q, other=0)
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
                    vdims,
                    vmask,
                    dq,
                    starts,
                    CAUSAL,
                    DOCS,
                    part != 1,
                    BLOCK_N,
                )
        tl.store(DQ + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], dq.to(DQ.dtype.element_ty), mask=q_mask)

    @triton.jit
    def _bwd_delta(O, DO, DELTA, sob, sos, soh, heads, seq_q, v_dim, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
        """DELTA [batch, heads, seq_q] (fp32) = the sum over the value dimension of O * DO (O and DO of one
        layout), FlashAttention-2's preprocessing: one read of each, where PyTorch wrote fp32 copies of both."""
        # one grid axis (up to 2^31 programs): the second is capped at 65535 blocks
        pid = tl.program_id(0).to(tl.int64)
        blocks = tl.cdiv(seq_q, BLOCK_M)
        bh = pid // blocks
        b, h = bh // heads, bh % heads
        rows = (pid % blocks).to(tl.int32) * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_DV)
        mask = (rows[:, None] < seq_q) & (dims[None, :] < v_dim)
        at = b * sob + h * soh + rows[:, None] * sos + dims[None, :]
        o = tl.load(O + at, mask=mask, other=0.0).to(tl.float32)
        do = tl.load(DO + at, mask=mask, other=0.0).to(tl.float32)
        tl.store(DELTA + bh * seq_q + rows, tl.sum(o * do, axis=1), mask=rows < seq_q)
