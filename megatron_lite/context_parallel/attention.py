"""Attention over a sequence split across the context-parallel group (zigzag order, see zigzag.py).
q, k, v are this rank's part: [batch, local seq, heads, head_dim]; k, v may have fewer (grouped) heads, and v
another head size (multi-latent attention), which the output takes.

- `p2p` (ring): key/value blocks travel the ring with batched isend/irecv, each exchange posted before the
  block in hand is computed; partial outputs merge exactly through their log-sum-exp. The backward recomputes
  each block from the final output and log-sum-exp, and the key/value gradients travel the ring with their
  block until they reach its owner.
- `a2a` (all-to-all, DeepSpeed-Ulysses): sequence-sharded -> head-sharded before attention and back after.
- `allgather`: every rank gathers all keys and values; their gradients are reduce-scattered back.
- `a2a+p2p` (hierarchical, sizes A x P): all-to-all over heads inside groups of A adjacent CP ranks, whose
  parts sorted by position are again a zigzag pair (of chunks A times longer) of a CP group of P; the ring runs
  over the P groups' ranks that hold the same heads.

Block attention runs through our flash kernel (`triton`) or its PyTorch reference. Document masks
(--reset-attention-mask: `document_ids` [batch, whole sequence], natural order, on every rank) work with all
three: `a2a` and `allgather` see the whole sequence in order; each ring block gets its queries' first visible
keys and its keys' last viewers from the global positions of both sides (`_block_spans`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite import kernels as K
from megatron_lite.context_parallel.zigzag import gathered_positions, zigzag_positions
from megatron_lite.models.attention_variants import with_offset
from megatron_lite.parallel_context import Group
from megatron_lite.ring import ring_exchange, wait
from megatron_lite.tensor_parallel.mappings import all_gather_dim0, reduce_scatter_dim0


def _block_forward(q, k, v, causal: bool, scale: float, triton: bool, spans=None, max_logits=None):
    """`max_logits`: a list that takes the block's largest visible logit per head (QK-clip), when given."""
    fn = K.flash_attention if triton else K.flash_attention_reference
    o, lse, *found = fn(q, k, v, causal, scale, True, document_spans=spans, return_max_logit=max_logits is not None)
    if max_logits is not None:
        max_logits.append(found[0])
    return o.float(), lse.float()


def _block_backward(q, k, v, o, lse, do, causal: bool, scale: float, triton: bool, spans=None):
    fn = K.flash_attention_backward if triton else K.flash_attention_backward_reference
    return fn(q, k, v, o, lse, do, causal, scale, document_spans=spans)


def _block_spans(bounds, q_pos: torch.Tensor, k_pos: torch.Tensor):
    """Document spans of a ring block, from global positions (each side ascending): per query the index of
    the first key at or after its document's start, per key the index of the first query at or after its
    document's end (the kernels' START and END). None without documents."""
    if bounds is None:
        return None
    start, end = bounds  # [batch, whole sequence]: each position's document as [start, end)
    first_key = torch.searchsorted(k_pos, start[:, q_pos].contiguous())
    first_past = torch.searchsorted(q_pos, end[:, k_pos].contiguous())
    return first_key.to(torch.int32), first_past.to(torch.int32)


class _ReferenceAttention(torch.autograd.Function):
    """The PyTorch block attention with the flash kernel's memory behaviour: only q, k, v, o and the
    log-sum-exp are kept for the backward (the probabilities are recomputed there)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, documents, window, max_logits=None):
        record = max_logits is not None
        o, lse, *found = K.flash_attention_reference(
            q, k, v, causal, scale, True, window_size=window, document_ids=documents, return_max_logit=record
        )
        if max_logits is not None:
            max_logits.append(found[0])
        ctx.save_for_backward(q, k, v, o, lse, documents)
        ctx.causal, ctx.scale, ctx.window = causal, scale, window
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, documents = ctx.saved_tensors
        grads = K.flash_attention_backward_reference(
            q, k, v, o, lse, do.contiguous(), ctx.causal, ctx.scale, window_size=ctx.window, document_ids=documents
        )
        return (*grads, None, None, None, None, None)


def _attention(
    q, k, v, causal: bool, scale: float, triton: bool, documents=None, window=None, offset=None, max_logits=None
):
    """Differentiable attention on one rank: the flash kernel, or the PyTorch reference without stored
    probabilities. `documents` [batch, seq_k]: document ids of the keys (the queries are the last positions);
    `window`: a sliding window over the keys before each query (bottom-right aligned, as the causal mask);
    `offset` [heads]: --softmax-type's extra logit per head (the PyTorch reference then keeps its probabilities);
    `max_logits`: a list that takes the largest visible logit per head (QK-clip), when given."""
    record = max_logits is not None
    if offset is not None or triton:
        fn = K.flash_attention if triton else K.flash_attention_reference
        o, lse, *found = fn(q, k, v, causal, scale, True, window_size=window, document_ids=documents,
                            return_max_logit=record)  # fmt: skip
        if record:
            max_logits.append(found[0])
        return with_offset(o, lse, offset) if offset is not None else o
    return _ReferenceAttention.apply(q, k, v, causal, scale, documents, window, max_logits)


def _merge(o, lse, o_new, lse_new):
    """Two partial softmax results over disjoint key sets -> the result over their union (fp32)."""
    lse_out = torch.logaddexp(lse, lse_new)
    w_old = torch.exp(lse - lse_out).transpose(1, 2).unsqueeze(-1)  # [b, s, h, 1]
    w_new = torch.exp(lse_new - lse_out).transpose(1, 2).unsqueeze(-1)
    return o * w_old + o_new * w_new, lse_out


def _ring_block(i: int, rank: int, causal: bool) -> str:
    """Which part of the step-i block rank `rank` computes: the kv block comes from rank (rank - i) % cp.
    'causal': all local queries vs all local keys under the causal mask (step 0); 'all': everything;
    'first_keys': all queries vs the block's first chunk (an earlier rank's: its late chunk is in the
    future); 'last_queries': the local late chunk vs the whole block (a later rank's chunks are both in the
    local early chunk's future and the late chunk's past)."""
    if not causal:
        return "all"
    if i == 0:
        return "causal"
    return "first_keys" if i <= rank else "last_queries"  # i <= rank: the block's owner rank - i is earlier


def _ring_spans(document_ids, group: Group, s: int, causal: bool) -> list:
    """Each ring step's document spans on this rank (None without documents), for the part it computes."""
    cp, r, c = group.size, group.rank, s // 2
    if document_ids is None:
        return [None] * cp
    bounds = K.document_bounds(document_ids)
    q_pos = zigzag_positions(s * cp, cp, r, document_ids.device)
    out = []
    for i in range(cp):
        k_pos = zigzag_positions(s * cp, cp, (r - i) % cp, document_ids.device)
        part = _ring_block(i, r, causal)
        qp = q_pos[c:] if part == "last_queries" else q_pos  # the local late chunk
        kp = k_pos[:c] if part == "first_keys" else k_pos  # the block's early chunk
        out.append(_block_spans(bounds, qp, kp))
    return out


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group: Group, causal: bool, scale: float, triton: bool, document_ids, offset, sink):
        cp, r = group.size, group.rank
        c = q.shape[1] // 2
        b, s, h, _ = q.shape
        spans = _ring_spans(document_ids, group, s, causal)
        o = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
        kb, vb = k, v
        for i in range(cp):
            works = []
            if i < cp - 1:
                (kn, vn), works = ring_exchange([kb, vb], group)
            part = _ring_block(i, r, causal)
            if part in ("all", "causal"):
                o, lse = _merge(o, lse, *_block_forward(q, kb, vb, part == "causal", scale, triton, spans[i], sink))
            elif part == "first_keys":
                block = _block_forward(q, kb[:, :c], vb[:, :c], False, scale, triton, spans[i], sink)
                o, lse = _merge(o, lse, *block)
            else:
                block = _block_forward(q[:, c:], kb, vb, False, scale, triton, spans[i], sink)
                o2, lse2 = _merge(o[:, c:], lse[:, :, c:], *block)
                o = torch.cat([o[:, :c], o2], 1)
                lse = torch.cat([lse[:, :, :c], lse2], 2)
            wait(works, group)
            if i < cp - 1:
                kb, vb = kn, vn
        if offset is not None:  # --softmax-type: the offset's column joins each whole row's softmax
            merged = torch.logaddexp(lse, offset.float().view(1, -1, 1))
            o, lse = o * torch.exp(lse - merged).transpose(1, 2).unsqueeze(-1), merged
        out = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, offset)
        ctx.group, ctx.causal, ctx.scale, ctx.triton, ctx.spans = group, causal, scale, triton, spans
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, offset = ctx.saved_tensors
        group, causal, scale, triton, spans = ctx.group, ctx.causal, ctx.scale, ctx.triton, ctx.spans
        cp, r = group.size, group.rank
        c = q.shape[1] // 2
        do = do.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        kb, vb = k, v
        for i in range(cp):
            kv_works = []
            if i < cp - 1:  # the keys and values are needed unchanged downstream: send them right away
                (kn, vn), kv_works = ring_exchange([kb, vb], group)
            part = _ring_block(i, r, causal)
            if part in ("all", "causal"):
                gq, gk, gv = _block_backward(q, kb, vb, o, lse, do, part == "causal", scale, triton, spans[i])
                dq += gq
                dk += gk
                dv += gv
            elif part == "first_keys":
                gq, gk, gv = _block_backward(q, kb[:, :c], vb[:, :c], o, lse, do, False, scale, triton, spans[i])
                dq += gq
                dk[:, :c] += gk
                dv[:, :c] += gv
            else:
                gq, gk, gv = _block_backward(
                    q[:, c:], kb, vb, o[:, c:], lse[:, :, c:].contiguous(), do[:, c:], False, scale, triton, spans[i]
                )
                dq[:, c:] += gq
                dk += gk
                dv += gv
            # This block's key/value gradients follow it round the ring; after the last step, to its owner.
            (dk, dv), g_works = ring_exchange([dk, dv], group)
            wait(kv_works + g_works, group)
            if i < cp - 1:
                kb, vb = kn, vn
        # (the blocks' gradients above used the output and log-sum-exp with the offset's column, which is all
        # it changes for q, k, v; the column's own: -sum of its probability times rowsum(dO * O), this rank's rows)
        doffset = None
        if offset is not None:
            delta = (do.float() * o.float()).sum(-1)  # [b, s, h]
            column = torch.exp(offset.float().view(1, 1, -1) - lse.transpose(1, 2))
            doffset = -(column * delta).sum((0, 1)).to(offset.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, doffset, None


def ring_attention(
    q,
    k,
    v,
    group: Group,
    causal: bool = True,
    scale: float | None = None,
    triton: bool = False,
    document_ids=None,
    offset=None,
    max_logits=None,
):
    """Causal (zigzag-split) or full attention of the local queries over the whole sequence's keys
    (`document_ids`: the whole sequence's, natural order; causal only; `offset`: --softmax-type's logit per head,
    applied once the ring has merged each row; `max_logits`: a list that takes each block's largest visible logit
    per head, QK-clip's)."""
    if document_ids is not None and not causal:
        raise ValueError("document masks are causal")
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    if group.size == 1 and (offset is not None or max_logits is not None):
        return _attention(q, k, v, causal, scale, triton, document_ids, offset=offset, max_logits=max_logits)
    if group.size == 1:
        fn = K.flash_attention if triton else K.flash_attention_reference
        return fn(q, k, v, causal, scale, document_ids=document_ids)
    return _RingAttention.apply(q, k, v, group, causal, scale, triton, document_ids, offset, max_logits)


# All-to-all (Ulysses) -----------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """Split `scatter_dim` into the group's ranks, exchange, concatenate the received parts (in rank
    order) along `gather_dim`. Its backward is the same exchange with the dimensions swapped."""

    @staticmethod
    def forward(ctx, x, group: Group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, g):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(g.contiguous(), ctx.group, gather_dim, scatter_dim), None, None, None


def _all_to_all(x: torch.Tensor, group: Group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    if group.size == 1:  # (a2a+p2p with groups of one: the ring alone)
        return x
    send = torch.stack(x.chunk(group.size, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    with group.blocked():
        dist.all_to_all_single(recv, send, group=group.pg)
    return torch.cat(recv.unbind(0), dim=gather_dim)


def _to_head_shards(q, k, v, group: Group):
    """Sequence-sharded -> head-sharded over `group` (the parts in rank order). Key/value heads that do not
    divide by the group size are repeated to one per query head first."""
    if k.shape[2] % group.size:
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    return tuple(_AllToAll.apply(t, group, 2, 1) for t in (q, k, v))


def a2a_attention(
    q,
    k,
    v,
    group: Group,
    causal: bool = True,
    scale: float | None = None,
    triton: bool = False,
    document_ids=None,
    window_size: int | None = None,
    offset=None,
    max_logits=None,
):
    """Sequence-sharded -> head-sharded, attention over the whole sequence (put back in natural order), and
    back. Query heads must divide by the group size; key/value heads that do not are repeated to one per
    query head first. `document_ids`: the whole sequence's, in natural order; `window_size`: a sliding window
    (the whole sequence is in order, so it is the one-device window); `offset`: the local heads' softmax
    offsets (each rank takes those of the heads it attends for)."""
    cp = group.size
    b, s, h, d = q.shape
    q, k, v = _to_head_shards(q, k, v, group)  # [b, s * cp, heads / cp, d]
    pos = gathered_positions(s * cp, cp, q.device)
    order = torch.argsort(pos)
    q, k, v = (t.index_select(1, order) for t in (q, k, v))
    offset = offset.view(cp, -1)[group.rank] if offset is not None else None
    found = [] if max_logits is not None else None
    scale = scale if scale is not None else d**-0.5
    o = _attention(q, k, v, causal, scale, triton, document_ids, window_size, offset, found)
    _heads_max_logits(max_logits, found, h, cp, group.rank)
    return _AllToAll.apply(o.index_select(1, pos), group, 1, 2)  # back to zigzag order, then to our part


def _heads_max_logits(max_logits, found, heads: int, parts: int, part: int) -> None:
    """QK-clip under head sharding: this rank's heads' max logits (over the whole sequence) in their places
    among the local heads, -inf at the others (the training step's max over context-parallel ranks fills them)."""
    if max_logits is None:
        return
    out = torch.full((heads,), float("-inf"), device=found[0].device)
    n = heads // parts
    out[part * n : (part + 1) * n] = torch.stack(found).amax(0)
    max_logits.append(out)


# All-gather --------------------------------------------------------------------------------------
class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence (dim 1); the backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, group: Group):
        ctx.group = group
        return all_gather_dim0(x.transpose(0, 1).contiguous(), group).transpose(0, 1)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_dim0(g.transpose(0, 1).contiguous(), ctx.group).transpose(0, 1), None


def allgather_attention(
    q,
    k,
    v,
    group: Group,
    causal: bool = True,
    scale: float | None = None,
    triton: bool = False,
    document_ids=None,
    window_size: int | None = None,
    offset=None,
    max_logits=None,
):
    """Every rank gathers the whole sequence's keys and values; each local query chunk attends to the keys
    up to its own end (bottom-right-aligned causal mask and `window_size`; with `document_ids`, the whole
    sequence's in natural order, within its own documents; `offset`: the softmax offsets of the heads)."""
    cp, s = group.size, q.shape[1]
    c = s // 2
    pos = gathered_positions(s * cp, cp, q.device)
    order = torch.argsort(pos)
    k, v = (_GatherSeq.apply(t, group).index_select(1, order) for t in (k, v))
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    if not causal:
        if document_ids is not None or window_size is not None:
            raise ValueError("document masks and sliding windows are causal")
        return _attention(q, k, v, False, scale, triton, offset=offset, max_logits=max_logits)
    r = group.rank
    ends = ((r + 1) * c, (2 * cp - r) * c)  # each local chunk sees the keys up to its own last position
    docs = (None, None) if document_ids is None else tuple(document_ids[:, :end] for end in ends)
    outs = [
        _attention(
            q[:, i * c : (i + 1) * c], k[:, :end], v[:, :end], True, scale, triton, docs[i], window_size, offset,
            max_logits,
        )
        for i, end in enumerate(ends)
    ]  # fmt: skip
    return torch.cat(outs, 1)


# Hierarchical (a2a+p2p) ----------------------------------------------------------------------------
def hierarchical_attention(
    q,
    k,
    v,
    group: Group,
    causal: bool = True,
    scale: float | None = None,
    triton: bool = False,
    document_ids=None,
    offset=None,
    max_logits=None,
    *,
    inner: Group,
    outer: Group,
):
    """`group`: the whole CP group (zigzag over its ranks); `inner`: this rank's A adjacent CP ranks; `outer`:
    the ranks at the same place in the other groups. Adjacent ranks g*A..g*A+A-1 hold chunks g*A..(g+1)*A-1
    early and their mirror images late: together, super-chunks g and 2P-1-g of the sequence cut in 2P."""
    a = inner.size
    b, s, h, d = q.shape
    q, k, v = _to_head_shards(q, k, v, inner)  # [b, s * A, heads / A, d]
    first = group.rank - inner.rank  # the CP rank of the group's first member
    pos = torch.cat([zigzag_positions(s * group.size, group.size, first + i, q.device) for i in range(a)])
    order = torch.argsort(pos)  # the group's parts by position: an early and a late super-chunk
    q, k, v = (t.index_select(1, order) for t in (q, k, v))
    offset = offset.view(a, -1)[inner.rank] if offset is not None else None  # (this rank's heads after the a2a)
    found = [] if max_logits is not None else None
    o = ring_attention(q, k, v, outer, causal, scale, triton, document_ids, offset, found)
    _heads_max_logits(max_logits, found, h, a, inner.rank)
    return _AllToAll.apply(o.index_select(1, torch.argsort(order)), inner, 1, 2)


IMPLEMENTATIONS = {
    "p2p": ring_attention,
    "a2a": a2a_attention,
    "allgather": allgather_attention,
    "a2a+p2p": hierarchical_attention,
}
