"""Flash attention kernels against the plain-PyTorch reference and transformers' SDPA path: forward, log-sum-exp
and backward, grouped-query heads, causal (bottom-right aligned when seq_q < seq_k) and not, odd sizes; each
test proves the Triton kernels ran. Sliding-window attention (Mistral's `sliding_window`) against an oracle with
a mask built from the definition. CPU: Triton interpreter, fp32."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_lite import kernels as K

from models import DEVICE, rel

TOL = 1e-5


def _qkv(b, sq, sk, h, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, sq, h, d, generator=g).to(DEVICE),
        torch.randn(b, sk, hkv, d, generator=g).to(DEVICE),
        torch.randn(b, sk, hkv, d, generator=g).to(DEVICE),
    )


CASES = [  # batch, seq_q, seq_k, heads, kv_heads, head_dim, causal
    (1, 1, 1, 1, 1, 8, True),
    (2, 19, 19, 4, 2, 16, True),
    (1, 33, 33, 3, 3, 20, False),
    (2, 7, 40, 4, 1, 16, True),  # decoding-style: fewer queries than keys, bottom-right causal mask
    (1, 40, 24, 2, 2, 32, False),
]


@pytest.mark.parametrize("b,sq,sk,h,hkv,d,causal", CASES)
@pytest.mark.parametrize("lse_in_loss", [False, True])
def test_forward_backward_and_lse(b, sq, sk, h, hkv, d, causal, lse_in_loss):
    """With `lse_in_loss` the loss also reads the returned log-sum-exp: its gradient reaches q and k (it was
    dropped, dq and dk wrong by 100%)."""
    q, k, v = _qkv(b, sq, sk, h, hkv, d)
    g = torch.Generator().manual_seed(5)
    do = torch.randn(b, sq, h, d, generator=g).to(DEVICE)
    dlse = torch.randn(b, h, sq, generator=g).to(DEVICE)
    before = K.LAUNCHES["flash_attention_fwd"], K.LAUNCHES["flash_attention_bwd"]

    def run(fn):
        ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
        o, lse = fn(*ins, causal=causal, return_lse=True)
        ((o * do).sum() + ((lse * dlse).sum() if lse_in_loss else 0.0)).backward()
        return [o.detach(), lse.detach()] + [t.grad for t in ins]

    ours, ref = run(K.flash_attention), run(K.flash_attention_reference)
    assert K.LAUNCHES["flash_attention_fwd"] > before[0] and K.LAUNCHES["flash_attention_bwd"] > before[1]
    for name, a, r in zip(["o", "lse", "dq", "dk", "dv"], ours, ref):
        assert rel(a, r) < TOL, (name, rel(a, r))


def test_exposed_backward_reads_any_lse_layout_and_an_empty_batch():
    """flash_attention_backward given a strided lse (a slice of a longer one, as a caller holding several
    blocks passes) equals the contiguous one (the kernels had read it as contiguous); an empty batch runs."""
    q, k, v = _qkv(2, 12, 12, 2, 2, 16)
    o, lse = K.flash_attention(q, k, v, causal=True, return_lse=True)
    do = torch.randn_like(o)
    wide = torch.cat([torch.zeros_like(lse), lse], dim=2)[:, :, 12:]  # the same values, not contiguous
    assert not wide.is_contiguous()
    for a, b in zip(K.flash_attention_backward(q, k, v, o, wide, do), K.flash_attention_backward(q, k, v, o, lse, do)):
        assert torch.equal(a, b)
    empty = [t[:0].clone().requires_grad_(True) for t in (q, k, v)]
    out = K.flash_attention(*empty, causal=True)
    out.sum().backward()
    assert out.shape == (0, 12, 2, 16) and empty[0].grad.shape == (0, 12, 2, 16)


@pytest.mark.parametrize("bad", ["lse heads", "lse transposed", "o shorter", "do shorter", "dlse"])
def test_exposed_backward_refuses_inputs_that_do_not_fit(bad):
    """o, do, lse and dlse are checked against q, k and v (an exploratory run: an lse of other heads or a shorter o
    was read past its end, giving gradients 17.6 off or NaN, without a word)."""
    q, k, v = _qkv(1, 8, 8, 4, 2, 16)
    o, lse = K.flash_attention(q, k, v, causal=True, return_lse=True)
    do, dlse = torch.randn_like(o), None
    if bad == "lse heads":
        lse = lse[:, :2]
    elif bad == "lse transposed":  # (as many values: only its shape tells)
        lse = lse.transpose(1, 2).contiguous()
    elif bad == "o shorter":
        o = o[:, :4]
    elif bad == "do shorter":
        do = do[:, :4]
    else:
        dlse = torch.ones(1, 4, 4)
    with pytest.raises(ValueError, match=r"flash_attention_backward: .* must be \[batch, "):
        K.flash_attention_backward(q, k, v, o, lse, do, dlse=dlse)


def test_equals_torch_sdpa():
    q, k, v = _qkv(2, 24, 24, 4, 2, 16)
    ours = K.flash_attention(q, k, v, causal=True)
    sdpa = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(2, 2).transpose(1, 2),
        v.repeat_interleave(2, 2).transpose(1, 2),
        is_causal=True,
    ).transpose(1, 2)
    assert rel(ours, sdpa) < TOL


@pytest.mark.parametrize(
    "sq,sk,h,hkv,d,dv,causal,documents",
    [
        (19, 19, 4, 2, 24, 16, True, None),  # multi-latent attention: values narrower than queries and keys
        (7, 30, 2, 1, 24, 10, True, [[12, 18]]),  # fewer queries than keys, documents
        (21, 13, 3, 3, 16, 20, False, None),  # values wider
    ],
)
def test_values_of_another_head_size(sq, sk, h, hkv, d, dv, causal, documents):
    """v [batch, seq_k, kv_heads, v_head_dim] with v_head_dim != head_dim (DeepSeek's MLA: 192 and 128) runs
    without padding: output, log-sum-exp and every gradient against the reference, and the reference's output
    against PyTorch's SDPA, which takes such values too."""
    q, k, _ = _qkv(1, sq, sk, h, hkv, d, seed=6)
    v = torch.randn(1, sk, hkv, dv, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    do = torch.randn(1, sq, h, dv, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    docs = _document_ids(documents) if documents else None
    before = K.LAUNCHES["flash_attention_fwd"], K.LAUNCHES["flash_attention_bwd"]

    def run(fn):
        ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
        o, lse = fn(*ins, causal=causal, return_lse=True, document_ids=docs)
        o.backward(do)
        return [o.detach(), lse.detach()] + [t.grad for t in ins]

    ours, ref = run(K.flash_attention), run(K.flash_attention_reference)
    assert K.LAUNCHES["flash_attention_fwd"] > before[0] and K.LAUNCHES["flash_attention_bwd"] > before[1]
    assert ours[0].shape == (1, sq, h, dv) and ours[4].shape == v.shape
    for name, a, r in zip(["o", "lse", "dq", "dk", "dv"], ours, ref):
        assert rel(a, r) < TOL, (name, rel(a, r))
    mask = None
    if causal:  # bottom right; documents by id
        i, j = torch.arange(sq)[:, None] + sk - sq, torch.arange(sk)[None, :]
        mask = (j <= i).to(DEVICE)
        if docs is not None:
            mask = mask & (docs[0, sk - sq :, None] == docs[0, None, :])
    rep = h // hkv
    sdpa = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(rep, 2).transpose(1, 2),
        v.repeat_interleave(rep, 2).transpose(1, 2),
        attn_mask=mask,
    ).transpose(1, 2)
    assert rel(ref[0], sdpa) < TOL


def test_exposed_backward_merges_blocks_exactly():
    """Attention over keys split in two blocks, merged with the log-sum-exps, equals attention over all
    keys; the exposed backward of each block gives the full gradient pieces (what ring attention does)."""
    q, k, v = _qkv(1, 16, 32, 2, 2, 16)
    o1, l1 = K.flash_attention(q, k[:, :16], v[:, :16], causal=False, return_lse=True)
    o2, l2 = K.flash_attention(q, k[:, 16:], v[:, 16:], causal=False, return_lse=True)
    lse = torch.logaddexp(l1, l2)
    w1 = torch.exp(l1 - lse).transpose(1, 2).unsqueeze(-1)
    w2 = torch.exp(l2 - lse).transpose(1, 2).unsqueeze(-1)
    merged = o1 * w1 + o2 * w2
    full, full_lse = K.flash_attention_reference(q, k, v, causal=False, return_lse=True)
    assert rel(merged, full) < TOL and rel(lse, full_lse) < TOL
    do = torch.randn_like(q)
    dq1, dk1, dv1 = K.flash_attention_backward(q, k[:, :16], v[:, :16], merged, lse, do, causal=False)
    dq2, dk2, dv2 = K.flash_attention_backward(q, k[:, 16:], v[:, 16:], merged, lse, do, causal=False)
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    K.flash_attention_reference(*ins, causal=False).backward(do)
    assert rel(dq1 + dq2, ins[0].grad) < TOL
    assert rel(torch.cat([dk1, dk2], 1), ins[1].grad) < TOL and rel(torch.cat([dv1, dv2], 1), ins[2].grad) < TOL


def _window_oracle(q, k, v, window):
    """Plain softmax attention, independent of our reference: query i sits at position P = i + seq_k - seq_q and
    sees key j iff j <= P and P - j < window (the last `window` keys, itself included). Returns o, lse."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    off = sk - sq
    seen = [[j <= i + off and i + off - j < window for j in range(sk)] for i in range(sq)]
    mask = torch.tensor(seen, device=q.device)
    kk = k.repeat_interleave(h // hkv, dim=2).transpose(1, 2)  # [b, h, sk, d]
    vv = v.repeat_interleave(h // hkv, dim=2).transpose(1, 2)
    s = (q.transpose(1, 2) @ kk.transpose(-1, -2)) / math.sqrt(d)  # [b, h, sq, sk]
    s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, dim=-1) @ vv).transpose(1, 2), torch.logsumexp(s, dim=-1)


WINDOW_CASES = [  # batch, seq_q, seq_k, heads, kv_heads, head_dim, window
    (2, 24, 24, 4, 2, 16, 5),
    (1, 40, 40, 4, 2, 16, 5),  # 3 blocks of 16 (interpreter): whole key blocks skipped before the window
    (2, 7, 40, 4, 2, 16, 5),  # seq_q < seq_k: bottom-right positions 33..39; keys 0..28 are seen by no query
    (1, 13, 37, 2, 1, 20, 20),  # window wider than a block, odd head_dim
    (1, 19, 19, 2, 2, 8, 1),  # every query sees only itself
    (1, 100, 100, 2, 1, 16, 40),  # window of several blocks: unmasked key blocks between the two masked edges
]


def _run_windowed(fn, q, k, v, do, window):
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    if fn is _window_oracle:
        o, lse = fn(*ins, window)
    else:
        o, lse = fn(*ins, causal=True, return_lse=True, window_size=window)
    o.backward(do)
    return [o.detach(), lse.detach()] + [t.grad for t in ins]


@pytest.mark.parametrize("b,sq,sk,h,hkv,d,window", WINDOW_CASES)
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_sliding_window_equals_masked_oracle(impl, b, sq, sk, h, hkv, d, window):
    q, k, v = _qkv(b, sq, sk, h, hkv, d, seed=1)
    do = torch.randn(b, sq, h, d, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    fn = K.flash_attention if impl == "triton" else K.flash_attention_reference
    before = K.LAUNCHES["flash_attention_fwd"], K.LAUNCHES["flash_attention_bwd"]
    ours = _run_windowed(fn, q, k, v, do, window)
    launched = K.LAUNCHES["flash_attention_fwd"] > before[0] and K.LAUNCHES["flash_attention_bwd"] > before[1]
    assert launched == (impl == "triton")
    oracle = _run_windowed(_window_oracle, q, k, v, do, window)
    for name, a, r in zip(["o", "lse", "dq", "dk", "dv"], ours, oracle):
        assert torch.isfinite(a).all(), name
        assert rel(a, r) < TOL, (name, rel(a, r))
    # the window really restricts: plain causal attention differs
    assert rel(ours[0], K.flash_attention_reference(q, k, v, causal=True)) > 1e-2


@pytest.mark.parametrize("sq,sk", [(24, 24), (7, 40)])
def test_window_at_least_seq_k_is_no_window(sq, sk):
    q, k, v = _qkv(1, sq, sk, 4, 2, 16, seed=2)
    do = torch.randn(1, sq, 4, 16, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    for fn in (K.flash_attention, K.flash_attention_reference):
        plain = _run_windowed(fn, q, k, v, do, None)
        for window in (sk, sk + 100):
            for name, a, r in zip(["o", "lse", "dq", "dk", "dv"], _run_windowed(fn, q, k, v, do, window), plain):
                assert torch.equal(a, r), (fn.__name__, window, name)


def test_window_needs_causal_and_a_positive_size():
    q, k, v = _qkv(1, 8, 8, 2, 2, 8)
    for fn in (K.flash_attention, K.flash_attention_reference):
        with pytest.raises(ValueError, match="causal"):
            fn(q, k, v, causal=False, window_size=4)
        with pytest.raises(ValueError, match=">= 1"):
            fn(q, k, v, causal=True, window_size=0)
    o, lse = K.flash_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="causal"):
        K.flash_attention_backward(q, k, v, o, lse, torch.ones_like(o), causal=False, window_size=4)


def _document_oracle(q, k, v, lengths):
    """Each document of `lengths` (per batch row) run alone through plain causal softmax attention, the
    results laid side by side: the definition of document masking, independent of our mask code. o, lse."""
    outs, lses = [], []
    for row, row_lengths in enumerate(lengths):
        o_parts, l_parts, start = [], [], 0
        for n in row_lengths:
            sl = slice(start, start + n)
            o, lse = _window_oracle(q[row : row + 1, sl], k[row : row + 1, sl], v[row : row + 1, sl], n)
            o_parts.append(o)
            l_parts.append(lse)
            start += n
        outs.append(torch.cat(o_parts, 1))
        lses.append(torch.cat(l_parts, -1))
    return torch.cat(outs), torch.cat(lses)


DOCUMENT_CASES = [  # heads, kv_heads, head_dim, documents per batch row (lengths; each row sums to seq)
    (2, 1, 16, [[5, 1, 13], [19]]),  # a one-token document; a row that is one document
    (4, 2, 16, [[40, 9, 2, 1, 20], [3, 3, 3, 63]]),  # documents across and inside blocks of 16; seq 72
    (2, 2, 20, [[16, 16, 16, 1]]),  # documents on block boundaries, odd head_dim
]


def _document_ids(lengths) -> torch.Tensor:
    """Per batch row, the document lengths -> each position's document id."""
    return torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in lengths], device=DEVICE)


def _run_documents(fn, q, k, v, do, docs, oracle_arg=None):
    """o, lse, dq, dk, dv of `fn` with document masks: our kernel or reference (given the ids), or an oracle (given
    `oracle_arg`)."""
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    if oracle_arg is not None:
        o, lse = fn(*ins, oracle_arg)
    else:
        o, lse = fn(*ins, causal=True, return_lse=True, document_ids=docs)
    o.backward(do)
    return [o.detach(), lse.detach()] + [t.grad for t in ins]


@pytest.mark.parametrize("h,hkv,d,lengths", DOCUMENT_CASES)
def test_document_masks_equal_each_document_alone(h, hkv, d, lengths):
    """--reset-attention-mask in the kernel: forward, log-sum-exp and backward equal attention run on each
    document separately; the reference's mask agrees; blocks outside a block's documents are skipped."""
    b, seq = len(lengths), sum(lengths[0])
    q, k, v = _qkv(b, seq, seq, h, hkv, d, seed=3)
    do = torch.randn(b, seq, h, d, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    docs = _document_ids(lengths)
    before = K.LAUNCHES["flash_attention_fwd"], K.LAUNCHES["flash_attention_bwd"]
    ours, ref = (_run_documents(fn, q, k, v, do, docs) for fn in (K.flash_attention, K.flash_attention_reference))
    oracle = _run_documents(_document_oracle, q, k, v, do, docs, lengths)
    assert K.LAUNCHES["flash_attention_fwd"] > before[0] and K.LAUNCHES["flash_attention_bwd"] > before[1]
    for name, a, r, o in zip(["o", "lse", "dq", "dk", "dv"], ours, ref, oracle):
        assert rel(a, o) < TOL and rel(r, o) < TOL, (name, rel(a, o), rel(r, o))
    if any(len(row) > 1 for row in lengths):  # the documents really restrict
        assert rel(ours[0], K.flash_attention_reference(q, k, v, causal=True)) > 1e-2


def _documents_oracle_bottom_right(q, k, v, docs):
    """Plain softmax with the mask from the definition: query i sits at position P = i + seq_k - seq_q and sees
    key j iff j <= P and docs[j] == docs[P]. o, lse."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    off = sk - sq
    mask = torch.tensor(
        [[[j <= i + off and docs[r, j] == docs[r, i + off] for j in range(sk)] for i in range(sq)] for r in range(b)],
        device=q.device,
    ).unsqueeze(1)
    kk = k.repeat_interleave(h // hkv, dim=2).transpose(1, 2)
    vv = v.repeat_interleave(h // hkv, dim=2).transpose(1, 2)
    s = (q.transpose(1, 2) @ kk.transpose(-1, -2)) / math.sqrt(d)
    s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, dim=-1) @ vv).transpose(1, 2), torch.logsumexp(s, dim=-1)


@pytest.mark.parametrize("sq,lengths", [(7, [[30, 10], [5, 5, 30]]), (20, [[16, 3, 53], [72]]), (40, [[1, 38, 1]])])
def test_document_masks_with_fewer_queries_than_keys(sq, lengths):
    """The queries are the last seq_q positions (what context parallelism's all-gather form computes, one query
    chunk over the keys up to its end): documents, causality and the skipped blocks line up at that offset."""
    b, sk = len(lengths), sum(lengths[0])
    q, k, v = _qkv(b, sq, sk, 4, 2, 16, seed=4)
    do = torch.randn(b, sq, 4, 16, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    docs = _document_ids(lengths)
    ours, ref = (_run_documents(fn, q, k, v, do, docs) for fn in (K.flash_attention, K.flash_attention_reference))
    oracle = _run_documents(_documents_oracle_bottom_right, q, k, v, do, docs, docs)
    for name, a, r, o in zip(["o", "lse", "dq", "dk", "dv"], ours, ref, oracle):
        assert torch.isfinite(a).all(), name
        assert rel(a, o) < TOL and rel(r, o) < TOL, (name, rel(a, o), rel(r, o))


def test_document_bounds():
    docs = torch.tensor([[0, 0, 0, 1, 2, 2, 3], [5, 5, 5, 5, 5, 5, 5]])
    start, end = K.document_bounds(docs)
    assert start.tolist() == [[0, 0, 0, 3, 4, 4, 6], [0] * 7]
    assert end.tolist() == [[3, 3, 3, 4, 6, 6, 7], [7] * 7]
    q, k, v = _qkv(2, 7, 7, 2, 2, 8)
    with pytest.raises(ValueError, match="document_ids"):
        K.flash_attention(q, k, v, causal=False, document_ids=docs)
    with pytest.raises(ValueError, match="document_ids"):
        K.flash_attention(q, k, v, causal=True, document_ids=docs[:, :5])  # not [batch, seq_k]


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="bf16 needs a GPU: the Triton interpreter has no bf16 arithmetic"
)
def test_bf16_on_gpu():
    # Llama-3-8B's heads (32 query, 8 key-value, head_dim 128): the same compiled kernels as the benchmark's.
    q, k, v = (t.cuda().bfloat16() for t in _qkv(1, 512, 512, 32, 8, 128))
    ref = K.flash_attention_reference(q, k, v).float()
    assert rel(K.flash_attention(q, k, v).float(), ref) < 2e-2
    ref = K.flash_attention_reference(q, k, v, window_size=100).float()
    assert rel(K.flash_attention(q, k, v, window_size=100).float(), ref) < 2e-2
    docs = torch.tensor([[0] * 100 + [1] * 300 + [2] * 112], device="cuda")  # --reset-attention-mask's spans
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_ins = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    do = torch.randn_like(q)
    K.flash_attention(*ins, document_ids=docs).backward(do)
    ref = K.flash_attention_reference(*ref_ins, document_ids=docs)
    ref.backward(do.float())
    assert rel(ins[0].grad.float(), ref_ins[0].grad) < 2e-2 and rel(ins[1].grad.float(), ref_ins[1].grad) < 2e-2


def test_a_sequence_past_the_kernels_offsets_is_refused_with_the_fix():
    """Positions inside one sequence are int32 in the kernels: a sequence of more than 2^31 values (here an
    expanded view, nothing allocated) is refused before any copy or launch, naming the way to split it."""
    q = torch.zeros(1, 1, 1, 64, device=DEVICE).expand(1, 2**25 + 1, 1, 64)
    if not K.triton_usable(q):
        pytest.skip("Triton cannot run on these tensors (the reference path has no such limit)")
    with pytest.raises(ValueError, match="past the kernels' 32-bit offsets.*--context-parallel-size"):
        K.flash_attention(q, q, q, causal=True)


@pytest.mark.parametrize(
    "sq,sk,h,hkv,window,lengths",
    [(19, 19, 4, 2, None, None), (7, 40, 4, 1, None, None), (24, 24, 2, 2, 5, None), (24, 24, 4, 2, None, [5, 19])],
)
def test_max_logit_is_the_largest_visible_logit(sq, sk, h, hkv, window, lengths):
    """QK-clip's return_max_logit: the kernel's running row max, per head over the batch and the queries, is the
    largest q.k * scale over the visible pairs worked out from the definition (GQA, bottom-right causal, a window,
    documents); the output is unchanged. Scores are made larger where hidden, so a leak would show."""
    q, k, v = _qkv(2, sq, sk, h, hkv, 16, seed=5)
    k = k + torch.linspace(0, 3, sk, device=DEVICE)[None, :, None, None]  # (later keys: larger, mostly hidden)
    docs = _document_ids([lengths, lengths]) if lengths else None
    before = K.LAUNCHES["flash_attention_fwd"]
    o, found = K.flash_attention(q, k, v, True, 0.3, window_size=window, document_ids=docs, return_max_logit=True)
    assert K.LAUNCHES["flash_attention_fwd"] > before
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.repeat_interleave(h // hkv, dim=2).double()).cpu() * 0.3
    visible = torch.tensor(
        [[[j <= i + sk - sq and (window is None or i + sk - sq - j < window)
           and (docs is None or docs[r, j] == docs[r, i + sk - sq]) for j in range(sk)] for i in range(sq)]
         for r in range(2)]
    )  # fmt: skip
    want = s.masked_fill(~visible[:, None], -math.inf).amax(dim=(0, 2, 3)).float()
    assert rel(found.cpu(), want) < TOL and rel(o, K.flash_attention(q, k, v, True, 0.3, window_size=window,
                                                                    document_ids=docs)) == 0  # fmt: skip
    ref = K.flash_attention_reference(q, k, v, True, 0.3, window_size=window, document_ids=docs, return_max_logit=True)
    assert rel(ref[1].cpu(), want) < TOL
