"""Flash attention (forward and backward) with grouped-query heads and the log-sum-exp.

q [batch, seq_q, heads, head_dim]; k [batch, seq_k, kv_heads, head_dim]; v [batch, seq_k, kv_heads, v_head_dim]
(v_head_dim may differ, as in multi-latent attention; the output has it); heads % kv_heads == 0. Causal
masking is aligned to the bottom right (query i sees keys j <= i + seq_k - seq_q), as decoding with a KV
cache needs; seq_q <= seq_k then. A sliding window (Mistral / Hugging Face `sliding_window`, causal only)
further limits query i to the last `window_size` keys up to its position P = i + seq_k - seq_q, itself
included: P - window_size < j <= P. The window is a runtime kernel argument, so one compiled kernel serves
every window; key blocks wholly outside it are skipped. The forward keeps only O and the log-sum-exp per
query (fp32); the backward recomputes the probabilities block by block (FlashAttention-2): one kernel per
key block accumulates dK and dV over every query head of its group (no atomics), another per query block
accumulates dQ. `flash_attention_backward` is exposed so ring attention can merge blocks exactly.

Document masks (`document_ids` [batch, seq_k], causal only: Megatron's --reset-attention-mask): a query sees only
earlier keys of its own document, the queries being the last seq_q positions (bottom right, as above).
Documents must be contiguous (ids never decrease along the sequence, as packing produces), so each key's
document is the span [start, end) of positions: the kernels read those two numbers per position and skip the key
(or query) blocks outside a block's documents, so the work falls with the documents' lengths squared instead of
the sequence's.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import torch
import torch.nn.functional as F

from megatron_lite.kernels import _common
from megatron_lite.kernels._common import (
    HAVE_TRITON,
    interpreting,
    launched,
    next_pow2,
    on_tensor_device,
    require,
    triton_usable,
)
from megatron_lite.kernels.flash_attention_checks import _window, check_backward, check_offsets
from megatron_lite.kernels.flash_attention_checks import check as _check

if HAVE_TRITON:
    import triton

    from megatron_lite.kernels.flash_attention_kernels import _bwd_delta, _bwd_dkdv, _bwd_dq, _fwd

    # On a GPU each kernel picks its tiles by timing these once per head_dim, causality and sequence lengths
    # (Triton's autotuner; bf16/fp16 only, see _kernel); the interpreter runs one fixed small config. Tiles too
    # large for shared memory are skipped by the autotuner.
    def _configs(shapes):
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in shapes]

    # (a training run has one or two sequence lengths)
    _TUNE_KEY = ["head_dim", "v_dim", "CAUSAL", "DOCS", "seq_q", "seq_k"]
    # The chosen tiles are cached on disk (Triton's cache), so later runs on this machine, a resumed job among
    # them, pick the same tiles and round the same way. Triton before 3.3 has no such option.
    _TUNE_OPTS = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    # (BLOCK_M queries, BLOCK_N keys, warps, stages)
    _FWD_TILES = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 32, 4, 4), (64, 64, 4, 3), (64, 32, 4, 4)]
    # dK/dV: one program per key block, so wide BLOCK_N and narrow query steps; dQ the other way round.
    # Not (32, 128, 8, 3), (16, 64, 4, 4) nor any (32, 64, 4, stages): on an H200 (Triton 3.6) each gave a dK that
    # differed from run to run of the same inputs (4-8% off for the first two; a race in the generated code, as
    # the kernel has no atomics; dV, from the same loop, was right), and the autotuner had picked some of them.
    # On 2026-12-04 (tools/bench_attention_tiles.py) (64, 64, 4, 2) and (64, 32, 4, 3) gave the same bits over 8
    # runs at three shapes and were the fastest: the whole backward at Llama-3-8B's shapes in 1.27 and 1.65 ms,
    # against 1.72 ms at (64, 64, 4, 3) (why two stages help so much was not measured: less shared memory, so
    # perhaps a second program per SM). tests/test_kernels_attention_tiles.py runs every tile on a GPU, repeated.
    _DKDV_TILES = [(32, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3)]
    _DQ_TILES = [(128, 32, 8, 3), (128, 32, 4, 4), (128, 64, 8, 3), (64, 32, 4, 4), (64, 64, 4, 3), (64, 16, 4, 4)]
    _fwd_tuned = triton.autotune(_configs(_FWD_TILES), key=_TUNE_KEY, **_TUNE_OPTS)(_fwd)
    _bwd_dkdv_tuned = triton.autotune(_configs(_DKDV_TILES), key=_TUNE_KEY, **_TUNE_OPTS)(_bwd_dkdv)
    _bwd_dq_tuned = triton.autotune(_configs(_DQ_TILES), key=_TUNE_KEY, **_TUNE_OPTS)(_bwd_dq)
    # --deterministic-mode (torch.use_deterministic_algorithms): the autotuner picks by timing, so two runs could
    # pick two tilings, which add in two orders; instead one tile per kernel from the lists above (each gave the
    # same bits run after run), small ones: compiled for sm_90 (Triton 3.9, on a CPU machine, 2026-12-05) they take
    # at most 105 KB of shared memory (dK/dV at MLA's 192 / 128 head dims) of the 227 KB a program may have; their
    # speed and bits on a GPU: tests/test_determinism.py -k gpu (run by tools/device_checks.sh)
    DETERMINISTIC_TILES = {_fwd: (64, 64, 4, 3), _bwd_dkdv: (64, 64, 4, 2), _bwd_dq: (64, 32, 4, 4)}


# One query against the cache: the fewest rows tl.dot takes, and a long stride through the keys it reads
DECODE_TILE = {"BLOCK_M": 16, "BLOCK_N": 64}


_FORCED: dict = {}  # plain kernel -> its forced tile (the launch's constants); "others" -> the other kernels' tile


@contextlib.contextmanager
def forced_tile(kernel: str, tile: tuple[int, int, int, int], others: dict | None = None):
    """Within the block, `kernel` ("fwd", "dkdv" or "dq") runs on `tile` (BLOCK_M, BLOCK_N, warps, stages; the
    warps and stages on a GPU only) instead of the autotuner's pick, and the other two kernels on the fixed tile
    `others` ({"BLOCK_M": .., "BLOCK_N": ..}) or, when None, their usual choice. For checking and timing one
    candidate tile at a time (tests/test_kernels_attention_tiles.py, tools/bench_attention_tiles.py)."""
    if not HAVE_TRITON:
        raise RuntimeError("forced_tile needs Triton (Linux): there are no tiles without it")
    plain = {"fwd": _fwd, "dkdv": _bwd_dkdv, "dq": _bwd_dq}[kernel]
    m, n, warps, stages = tile
    gpu = not interpreting()
    saved = dict(_FORCED)
    _FORCED.clear()
    _FORCED[plain] = {"BLOCK_M": m, "BLOCK_N": n, **({"num_warps": warps, "num_stages": stages} if gpu else {})}
    if others is not None:
        _FORCED["others"] = dict(others)
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(saved)


def _kernel(plain, tuned, dtype: torch.dtype):
    """The kernel to launch and its fixed tiles: fixed small tiles when interpreting; on a GPU, fp32 (tests, not
    training) takes one fixed tile, other dtypes the autotuned kernel (unless forced_tile says otherwise) or, under
    torch's deterministic algorithms (--deterministic-mode), DETERMINISTIC_TILES."""
    if _FORCED:
        if plain in _FORCED:
            return plain, _FORCED[plain]
        if "others" in _FORCED:
            return plain, _FORCED["others"]
    if interpreting():
        return plain, {"BLOCK_M": _common.INTERPRETER_TILE, "BLOCK_N": _common.INTERPRETER_TILE}
    if dtype == torch.float32:
        return plain, {"BLOCK_M": 32, "BLOCK_N": 32}
    if torch.are_deterministic_algorithms_enabled():
        m, n, warps, stages = DETERMINISTIC_TILES[plain]
        return plain, {"BLOCK_M": m, "BLOCK_N": n, "num_warps": warps, "num_stages": stages}
    return tuned, {}


def document_bounds(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's document as positions [start, end), int32 [batch, seq], for contiguous documents."""
    b, s = document_ids.shape
    pos = torch.arange(s, device=document_ids.device).expand(b, s)
    new = torch.ones_like(document_ids, dtype=torch.bool)
    new[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]  # a document starts here
    # (an id that comes back, e.g. padding reusing document 0, would be taken for a document of its own)
    ids = document_ids.sort(dim=1).values
    distinct = (ids[:, 1:] != ids[:, :-1]).sum(1) + 1 if s else new.sum(1)
    require(
        new.sum(1) == distinct,
        lambda: "document_ids must keep each document's tokens together (an id may not come back after another)",
    )
    start = torch.cummax(torch.where(new, pos, 0), dim=1).values
    last = torch.ones_like(new)
    last[:, :-1] = new[:, 1:]  # a document ends here
    end = torch.where(last, pos + 1, s).flip(1).cummin(dim=1).values.flip(1)
    return start.to(torch.int32).contiguous(), end.to(torch.int32).contiguous()


def query_key_spans(document_ids: torch.Tensor, seq_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' document arguments for queries that are the last seq_q of the keys' positions: per query its
    first visible key index, int32 [batch, seq_q]; per key the first query index that no longer sees it,
    int32 [batch, seq_k]."""
    start, end = document_bounds(document_ids)
    offset = document_ids.shape[1] - seq_q
    return start[:, offset:].contiguous(), (end - offset).clamp(min=0).to(torch.int32).contiguous()


_NO_SPANS: dict[torch.device, torch.Tensor] = {}


def _spans(spans, device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The kernels' START and END arguments and DOCS flag (placeholders when there are no documents)."""
    if spans is not None:
        return spans[0].to(torch.int32).contiguous(), spans[1].to(torch.int32).contiguous(), True
    none = _NO_SPANS.get(device)
    if none is None:  # one placeholder per device, not an allocation per call
        none = _NO_SPANS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return none, none, False


def _forward(q, k, v, causal, scale, window_size=None, spans=None, max_logit=False):
    """o, lse, and (max_logit) each query's largest visible logit [batch, heads, seq_q] fp32, else an empty one."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    o = q.new_empty(b, sq, h, v.shape[-1])
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
    maxl = torch.full((b, h, sq) if max_logit else (0,), -math.inf, device=q.device)
    if b == 0:  # an empty batch: nothing to launch
        return o, lse, maxl
    start, end, docs = _spans(spans, q.device)
    kernel, cfg = _kernel(_fwd, _fwd_tuned, q.dtype)
    if sq == 1 and not cfg:  # a decoding step: seq_k grows by one a token, and the autotuner (keyed on it, so a
        kernel, cfg = _fwd, DECODE_TILE  # new key each time) would time every tile again at every token
    kernel[lambda meta: (b * h, triton.cdiv(sq, meta["BLOCK_M"]))](
        q,
        k,
        v,
        o,
        lse,
        maxl if max_logit else lse,
        start,
        end,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *o.stride()[:3],
        start.stride(0),
        end.stride(0),
        h,
        h // hkv,
        sq,
        sk,
        scale,
        d,
        v.shape[-1],
        _window(window_size, causal, sk),
        CAUSAL=causal,
        DOCS=docs,
        MAX_LOGIT=max_logit,
        BLOCK_D=next_pow2(max(d, 16)),
        BLOCK_DV=next_pow2(max(v.shape[-1], 16)),
        **cfg,
    )
    launched("flash_attention_fwd")
    return o, lse, maxl


@on_tensor_device
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
    document_ids: torch.Tensor | None = None,
    document_spans: tuple[torch.Tensor, torch.Tensor] | None = None,
    dlse: torch.Tensor | None = None,
):
    """dq, dk, dv of attention, given its output o and log-sum-exp lse [batch, heads, seq_q] (fp32). `dlse`: the
    gradient reaching lse itself, when a loss uses it (d lse / d score = the probability)."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    _check(q, k, v, causal, window_size, document_ids, document_spans)
    check_backward(q, k, v, o, lse, do, dlse)
    q, k, v, o, do, lse = (t.contiguous() for t in (q, k, v, o, do, lse))  # (the kernels index lse as [b, h, sq])
    check_offsets(q, k, v)
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if b == 0:  # an empty batch: nothing to launch
        return dq, dk, dv
    window = _window(window_size, causal, sk)
    delta = _delta(o, do)  # [b, h, sq]
    if dlse is not None:  # dS = P (dP - delta) + P dlse
        delta = delta - dlse.float()
    if document_ids is not None:
        document_spans = query_key_spans(document_ids, sq)
    start, end, docs = _spans(document_spans, q.device)
    dv_dim = v.shape[-1]
    common = dict(CAUSAL=causal, DOCS=docs, BLOCK_D=next_pow2(max(d, 16)), BLOCK_DV=next_pow2(max(dv_dim, 16)))
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], start.stride(0), end.stride(0))
    sizes = (h, h // hkv, sq, sk, scale, d, dv_dim, window)
    kernel, cfg = _kernel(_bwd_dkdv, _bwd_dkdv_tuned, q.dtype)
    kernel[lambda meta: (b * hkv, triton.cdiv(sk, meta["BLOCK_N"]))](
        q, k, v, do, lse, delta, dk, dv, start, end, *strides, *sizes, **common, **cfg
    )
    kernel, cfg = _kernel(_bwd_dq, _bwd_dq_tuned, q.dtype)
    kernel[lambda meta: (b * h, triton.cdiv(sq, meta["BLOCK_M"]))](
        q, k, v, do, lse, delta, dq, start, end, *strides, *sizes, **common, **cfg
    )
    launched("flash_attention_bwd")
    return dq, dk, dv


def _delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """sum(o * do) over the value dimension, in fp32, [batch, heads, seq_q]; o and do contiguous, one shape."""
    b, sq, h, dv = o.shape
    delta = torch.empty(b, h, sq, dtype=torch.float32, device=o.device)
    block_dv = next_pow2(max(dv, 16))
    block_m = min(64, max(16, 4096 // block_dv))  # about 4096 values of each per program
    if delta.numel():
        _bwd_delta[(b * h * triton.cdiv(sq, block_m),)](
            o, do, delta, *o.stride()[:3], h, sq, dv, BLOCK_M=block_m, BLOCK_DV=block_dv
        )
    return delta


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, window_size, query_starts, key_ends, max_logit=False):
        """`query_starts`, `key_ends`: the document spans, computed once for the forward and the backward."""
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        spans = (query_starts, key_ends) if query_starts is not None else None
        o, lse, maxl = _forward(q, k, v, causal, scale, window_size, spans, max_logit)
        ctx.save_for_backward(q, k, v, o, lse, query_starts, key_ends)
        ctx.causal, ctx.scale, ctx.window_size = causal, scale, window_size
        ctx.set_materialize_grads(False)  # (an unused lse gets no gradient pass of its own)
        ctx.mark_non_differentiable(maxl)
        return o, lse, maxl

    @staticmethod
    def backward(ctx, do, dlse, _):
        q, k, v, o, lse, starts, ends = ctx.saved_tensors
        spans = (starts, ends) if starts is not None else None
        do = do if do is not None else torch.zeros_like(o)
        grads = flash_attention_backward(
            q, k, v, o, lse, do, ctx.causal, ctx.scale, window_size=ctx.window_size, document_spans=spans, dlse=dlse
        )
        return (*grads, None, None, None, None, None, None)


def _reference_mask(sq, sk, causal, window, document_ids, device, spans=None) -> torch.Tensor | None:
    """Hidden (query, key) pairs, [sq, sk] or [batch, 1, sq, sk] with documents; None when none is hidden."""
    j = torch.arange(sk, device=device)[None, :]
    hidden = None
    if causal:
        i = torch.arange(sq, device=device)[:, None]
        dist = i + (sk - sq) - j  # query position minus key position
        hidden = (dist < 0) | (dist >= window)
    if document_ids is not None:  # a key of another document (the queries are the last sq positions)
        other = (document_ids[:, sk - sq :, None] != document_ids[:, None, :]).unsqueeze(1)
        hidden = other if hidden is None else hidden | other
    if spans is not None:  # keys before each query's first visible key
        before = (j.unsqueeze(0) < spans[0][:, :, None]).unsqueeze(1)
        hidden = before if hidden is None else hidden | before
    return hidden


def flash_attention_reference(
    q,
    k,
    v,
    causal=True,
    softmax_scale=None,
    return_lse=False,
    *,
    window_size=None,
    document_ids=None,
    document_spans=None,
    return_max_logit=False,
):
    """Plain PyTorch, fp32 math: the oracle and the fallback."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    window = _window(window_size, causal, sk)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    kk = k.repeat_interleave(h // hkv, dim=2)
    vv = v.repeat_interleave(h // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk.float()) * scale
    hidden = _reference_mask(sq, sk, causal, window, document_ids, q.device, document_spans)
    if hidden is not None:
        s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    # a query that sees no key at all (a ring block wholly before its document) gets o = 0 and lse = -inf, as
    # in the kernel, so merging it changes nothing
    p = torch.where(torch.isinf(lse).unsqueeze(-1), 0.0, torch.exp(s - lse.unsqueeze(-1)))
    o = torch.einsum("bhqk,bkhd->bqhd", p, vv.float()).to(q.dtype)
    extra = (s.amax(dim=(0, 2, 3)),) if return_max_logit else ()  # (the largest visible logit per head)
    return (o, lse, *extra) if return_lse else ((o, *extra) if extra else o)


def flash_attention_backward_reference(
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
    document_ids: torch.Tensor | None = None,
    document_spans: tuple[torch.Tensor, torch.Tensor] | None = None,
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
    hidden = _reference_mask(sq, sk, causal, window, document_ids, q.device, document_spans)
    if hidden is not None:
        s = s.masked_fill(hidden, float("-inf"))
    lse = lse.float().unsqueeze(-1)
    p = torch.where(torch.isinf(lse), 0.0, torch.exp(s - lse))  # (a query that sees no key: see the forward)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dof)
    dp = torch.einsum("bqhd,bkhd->bhqk", dof, vv)
    delta = (of * dof).sum(-1).transpose(1, 2).unsqueeze(-1)  # [b, h, sq, 1]
    ds = p * (dp - delta) * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qf)
    if rep > 1:  # the query heads of a group share one key/value head: sum their gradients
        dk = dk.reshape(b, sk, hkv, rep, d).sum(3)
        dv = dv.reshape(b, sk, hkv, rep, v.shape[-1]).sum(3)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@on_tensor_device
def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    *,
    window_size: int | None = None,
    document_ids: torch.Tensor | None = None,
    document_spans: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_max_logit: bool = False,
):
    """Attention of q over k, v (layouts in the module docstring); window_size: Mistral-style sliding window
    (causal only; None: none); document_ids [batch, seq_k]: contiguous documents that attend only to themselves
    (causal only). document_spans: the kernels' own form, (first visible key of each query [batch, seq_q], first
    query that no longer sees each key [batch, seq_k]), both non-decreasing, for blocks of a sequence split up
    (ring attention; also without causal masking, for blocks whose keys all precede their queries).
    Returns o, the log-sum-exp [batch, heads, seq_q] (fp32) if return_lse, then (return_max_logit, QK-clip) the
    largest visible logit q.k * scale per head over the batch and queries [heads] (fp32; the kernel's running max)."""
    _check(q, k, v, causal, window_size, document_ids, document_spans)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if not triton_usable(q, k, v):
        return flash_attention_reference(
            q,
            k,
            v,
            causal,
            scale,
            return_lse,
            window_size=window_size,
            document_ids=document_ids,
            document_spans=document_spans,
            return_max_logit=return_max_logit,
        )
    check_offsets(q, k, v)  # (before the autograd Function copies them contiguous)
    if document_ids is not None:
        document_spans = query_key_spans(document_ids, q.shape[1])
    starts, ends = document_spans if document_spans is not None else (None, None)
    o, lse, maxl = _FlashAttention.apply(q, k, v, causal, scale, window_size, starts, ends, return_max_logit)
    extra = (maxl.amax(dim=(0, 2)),) if return_max_logit else ()
    return (o, lse, *extra) if return_lse else ((o, *extra) if extra else o)


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
                "v_dim": "i32",
                "WINDOW": "i32",
                "CAUSAL": "constexpr",
                "DOCS": "constexpr",
                "BLOCK_M": "constexpr",
                "BLOCK_N": "constexpr",
                "BLOCK_D": "constexpr",
                "BLOCK_DV": "constexpr",
            }
            consts = {"CAUSAL": causal, "DOCS": False, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 128, "BLOCK_DV": 128}
            strides = lambda names: dict.fromkeys(names, "i32")  # noqa: E731
            sig = {
                **{n: f"*{t}" for n in "Q K V O".split()},
                "LSE": "*fp32",
                "MAXL": "*fp32",
                "START": "*i32",
                "END": "*i32",
                **strides("sqb sqs sqh skb sks skh svb svs svh sob sos soh ssb seb".split()),
                **{k: v for k, v in base.items() if not k.startswith("BLOCK")},
                "MAX_LOGIT": "constexpr",  # (the forward's QK-clip output, built with causal masking)
                **{k: v for k, v in base.items() if k.startswith("BLOCK")},
            }
            fwd = {**consts, "MAX_LOGIT": causal}
            out.append((f"flash_fwd_{t}_causal{causal}", _fwd, sig, fwd))
            if causal:  # (the decoding step's fixed tile)
                out.append((f"flash_fwd_decode_{t}", _fwd, sig, {**fwd, **DECODE_TILE}))
            sig = {
                **{n: f"*{t}" for n in "Q K V DO".split()},
                "LSE": "*fp32",
                "DELTA": "*fp32",
                "DK": f"*{t}",
                "DV": f"*{t}",
                "START": "*i32",
                "END": "*i32",
                **strides("sqb sqs sqh skb sks skh svb svs svh sdb sds sdh ssb seb".split()),
                **base,
            }
            out.append((f"flash_bwd_dkdv_{t}_causal{causal}", _bwd_dkdv, sig, consts))
            sig = {
                **{n: f"*{t}" for n in "Q K V DO".split()},
                "LSE": "*fp32",
                "DELTA": "*fp32",
                "DQ": f"*{t}",
                "START": "*i32",
                "END": "*i32",
                **strides("sqb sqs sqh skb sks skh svb svs svh sdb sds sdh ssb seb".split()),
                **base,
            }
            out.append((f"flash_bwd_dq_{t}_causal{causal}", _bwd_dq, sig, consts))
    # Document masks as the GPU builds them: causal, and without causal masking (ring blocks in the past)
    for name in ("fwd", "bwd_dkdv", "bwd_dq"):
        for t, causal in (("bf16", True), ("fp32", True), ("bf16", False)):
            case = next(c for c in out if c[0] == f"flash_{name}_{t}_causal{causal}")
            out.append((f"flash_{name}_{t}_documents_causal{causal}", case[1], case[2], {**case[3], "DOCS": True}))
    # The largest tiles each kernel's autotuner may pick, as a GPU would build them (bf16, head_dim 128).
    for name, kernel, (m, n, w, st) in (
        ("fwd", _fwd, max(_FWD_TILES, key=_area)),
        ("bwd_dkdv", _bwd_dkdv, max(_DKDV_TILES, key=_area)),
        ("bwd_dq", _bwd_dq, max(_DQ_TILES, key=_area)),
    ):
        case = next(c for c in out if c[0] == f"flash_{name}_bf16_causalTrue")
        consts = {**case[3], "BLOCK_M": m, "BLOCK_N": n}
        out.append(
            (f"flash_{name}_bf16_tiles{m}x{n}_w{w}_s{st}", kernel, case[2], consts, {"num_warps": w, "num_stages": st})
        )
    for t in ("bf16", "fp32"):
        sig = {"O": f"*{t}", "DO": f"*{t}", "DELTA": "*fp32"}
        sig.update({**dict.fromkeys("sob sos soh heads seq_q v_dim".split(), "i32"), "BLOCK_M": "constexpr"})
        for block_m, block_dv in ((32, 128), (16, 256)):
            consts = {"BLOCK_M": block_m, "BLOCK_DV": block_dv}
            out.append((f"flash_bwd_delta_{t}_dv{block_dv}", _bwd_delta, {**sig, "BLOCK_DV": "constexpr"}, consts))
    # Multi-latent attention (DeepSeek-V3): query/key heads of 192 (a block of 256) and values of 128
    for name in ("fwd", "bwd_dkdv", "bwd_dq"):
        case = next(c for c in out if c[0] == f"flash_{name}_bf16_causalTrue")
        consts = {**case[3], "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_D": 256, "BLOCK_DV": 128}
        out.append((f"flash_{name}_bf16_mla_d192_dv128", case[1], case[2], consts))
    return out


def _area(tile: tuple) -> int:
    return tile[0] * tile[1]


COMPILE_CASES = _cases() if HAVE_TRITON else []
