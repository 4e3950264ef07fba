"""Context parallelism. Unit level: the zigzag split round-trips, and ring / all-to-all / all-gather
attention (causal and not, grouped-query) give the output and q, k, v gradients of full attention on the
gathered sequence. Training level: CP layouts equal one process per iteration (lm_loss, grad_norm)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_lite import kernels as K
from megatron_lite.config import ParallelConfig
from megatron_lite.context_parallel.zigzag import (
    gathered_positions,
    slice_batch,
    split_sequence,
    unsplit_sequence,
    zigzag_positions,
)

from dist_pool import get_context
from models import needs_triton_on_cpu, triton_on_cpu_tensors

P = ParallelConfig


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_split_round_trips(cp):
    s = 8 * cp
    x = torch.arange(2 * s).reshape(2, s) * 10
    parts = [split_sequence(x, 1, cp, r) for r in range(cp)]
    assert torch.equal(unsplit_sequence(parts, 1), x)
    assert sorted(gathered_positions(s, cp).tolist()) == list(range(s))
    c = s // (2 * cp)
    for r in range(cp):  # rank r: chunks r and 2cp-1-r
        assert zigzag_positions(s, cp, r).tolist() == [
            *range(r * c, (r + 1) * c),
            *range((2 * cp - 1 - r) * c, (2 * cp - r) * c),
        ]
    mb = {"tokens": x, "labels": x + 1, "loss_mask": torch.ones_like(x)}
    sliced = [slice_batch(mb, cp, r) for r in range(cp)]
    assert torch.equal(unsplit_sequence([m["position_ids"] for m in sliced], 1), torch.arange(s).expand(2, s))
    assert torch.equal(unsplit_sequence([m["labels"] for m in sliced], 1), x + 1)
    with pytest.raises(ValueError, match="not divisible"):
        zigzag_positions(s + 1, cp, 0)


def attention_vs_full(
    comm: str,
    causal: bool,
    kv_heads: int,
    seq: int = 16,
    triton: bool = False,
    documents=None,
    sizes=None,
    v_dim: int = 8,
    window: int | None = None,
):
    """Relative errors of this rank's output and q/k/v gradients against full attention (fp64 oracle).
    `documents`: per batch row, document lengths (--reset-attention-mask; the oracle masks by document);
    `sizes`: a2a+p2p's hierarchical sizes; `v_dim`: the values' head size (the queries' and keys' is 8);
    `window`: a sliding window (each query sees itself and the window - 1 keys before it)."""
    import functools

    from megatron_lite.context_parallel.attention import IMPLEMENTATIONS

    cp = dist.get_world_size()
    ctx = get_context(P(context_parallel_size=cp, hierarchical_context_parallel_sizes=sizes))
    attend = IMPLEMENTATIONS[comm]
    if sizes is not None:
        attend = functools.partial(attend, inner=ctx.cp_inner, outer=ctx.cp_outer)
    g = torch.Generator().manual_seed(0)
    b, h, d = 2, 4, 8
    q = torch.randn(b, seq, h, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, seq, kv_heads, dim, generator=g, dtype=torch.float64) for dim in (d, v_dim))
    do = torch.randn(b, seq, h, v_dim, generator=g, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    kk, vv = (t.repeat_interleave(h // kv_heads, dim=2) for t in full[1:])
    scores = torch.einsum("bqhd,bkhd->bhqk", full[0], kk) * d**-0.5
    if causal:
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    extra = {}
    if window is not None:
        i = torch.arange(seq)
        scores = scores.masked_fill((i[:, None] - i[None, :]) >= window, float("-inf"))
        extra["window_size"] = window
    if documents is not None:
        ids = torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in documents])
        other = ids[:, :, None] != ids[:, None, :]  # a key of another document
        scores = scores.masked_fill(other.unsqueeze(1), float("-inf"))
        extra["document_ids"] = ids
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), vv)
    out.backward(do)
    mine = [split_sequence(t, 1, cp, ctx.cp.rank).float().requires_grad_() for t in (q, k, v)]
    o = attend(*mine, ctx.cp, causal, triton=triton, **extra)
    o.backward(split_sequence(do, 1, cp, ctx.cp.rank).float())
    pairs = [(o, out)] + [(m.grad, f.grad) for m, f in zip(mine, full)]
    errs = []
    for a, ref in pairs:
        ref = split_sequence(ref.detach(), 1, cp, ctx.cp.rank)
        errs.append(float((a.double() - ref).norm() / ref.norm()))
    return errs


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm", ["p2p", "a2a", "allgather"])
def test_attention_equals_full_attention(dist, cp, comm):
    for causal in (True, False):
        for kv_heads in (4, 2, 1):
            for errs in dist(cp, attention_vs_full, comm, causal, kv_heads):
                assert max(errs) < 1e-5, (comm, cp, causal, kv_heads, errs)


@pytest.mark.parametrize("sizes", [(2, 2), (4, 1), (1, 4)])
def test_hierarchical_attention_equals_full_attention(dist, sizes):
    """--cp-comm-type a2a+p2p with --hierarchical-context-parallel-sizes A P at CP=4: all-to-all inside the
    adjacent pairs, a ring over them (and the two degenerate splits), with and without documents."""
    for causal in (True, False):
        for kv_heads in (4, 2, 1):
            for errs in dist(4, attention_vs_full, "a2a+p2p", causal, kv_heads, 16, False, None, sizes):
                assert max(errs) < 1e-5, (sizes, causal, kv_heads, errs)
    for errs in dist(4, attention_vs_full, "a2a+p2p", True, 2, 16, False, DOCUMENTS, sizes):
        assert max(errs) < 1e-5, (sizes, "documents", errs)


@needs_triton_on_cpu
@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_attention_through_the_flash_kernel(dist, comm):
    """The same with our Triton flash kernel doing the blocks (the GPU path; here under the interpreter)."""
    for causal in (True, False):
        for errs in dist(2, attention_vs_full, comm, causal, 2, 32, True):
            assert max(errs) < 1e-4, (comm, causal, errs)


@pytest.mark.parametrize("comm", ["p2p", "a2a", "allgather", "a2a+p2p"])
def test_values_of_another_head_size(dist, comm):
    """Multi-latent attention's values (v_head_dim other than the query/key head) travel unpadded through each
    kind of context parallelism, on the PyTorch blocks and, for the ring, the flash kernel's."""
    sizes = (1, 2) if comm == "a2a+p2p" else None
    for v_dim in (5, 12):
        for errs in dist(2, attention_vs_full, comm, True, 2, 16, False, None, sizes, v_dim):
            assert max(errs) < 1e-5, (comm, v_dim, errs)
    if comm == "p2p" and triton_on_cpu_tensors():  # (gloo ranks: the interpreter, or a GPU run)
        for errs in dist(2, attention_vs_full, comm, True, 2, 32, True, None, None, 5):
            assert max(errs) < 1e-4, (comm, "triton", errs)


# documents across the zigzag chunks (16 positions: chunks of 4 at CP=2, of 2 at CP=4), a row that is one document
DOCUMENTS = [[3, 6, 1, 6], [16]]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm", ["p2p", "a2a", "allgather"])
def test_document_masks_equal_full_attention(dist, cp, comm):
    """--reset-attention-mask under each kind of context parallelism: every rank holds the whole sequence's
    document ids; the ring's blocks (own, an earlier rank's early chunk, the late chunk) get their spans from the
    positions on both sides, queries that see none of a block included."""
    for kv_heads in (4, 1):
        for errs in dist(cp, attention_vs_full, comm, True, kv_heads, 16, False, DOCUMENTS):
            assert max(errs) < 1e-5, (comm, cp, kv_heads, errs)


@pytest.mark.parametrize("comm", ["a2a", "allgather"])
def test_sliding_window_equals_full_attention(dist, comm):
    """--window-size under the two kinds of context parallelism that see the whole sequence in order (Transformer
    Engine's for a window): windows inside one zigzag chunk, across chunks and ranks, on the PyTorch blocks and
    the flash kernel's."""
    for cp in (2, 4):
        for window in (2, 3, 6):
            for errs in dist(cp, attention_vs_full, comm, True, 2, 16, False, None, None, 8, window):
                assert max(errs) < 1e-5, (comm, cp, window, errs)
    if triton_on_cpu_tensors():
        for errs in dist(2, attention_vs_full, comm, True, 2, 32, True, None, None, 8, 5):
            assert max(errs) < 1e-4, (comm, "triton", errs)


@needs_triton_on_cpu
def test_hierarchical_attention_through_the_flash_kernel(dist):
    """a2a+p2p (2 x 2) with the flash kernel doing the ring's blocks, with and without documents."""
    for documents in (None, [[5, 13, 1, 13], [32]]):
        for errs in dist(4, attention_vs_full, "a2a+p2p", True, 2, 32, True, documents, (2, 2)):
            assert max(errs) < 1e-4, (documents, errs)


@needs_triton_on_cpu
@pytest.mark.parametrize("comm", ["p2p", "allgather"])
def test_document_masks_through_the_flash_kernel(dist, comm):
    """The same with the flash kernel's document spans doing the blocks (CP=4: chunks of 4 over 32 positions)."""
    documents = [[5, 13, 1, 13], [32]]
    for errs in dist(4, attention_vs_full, comm, True, 2, 32, True, documents):
        assert max(errs) < 1e-4, (comm, errs)


def test_block_backward_reference_matches_autograd():
    """The PyTorch block backward (the ring's CPU path) against autograd through the reference forward."""
    g = torch.Generator().manual_seed(1)
    for causal in (True, False):
        q = torch.randn(2, 7, 4, 8, generator=g, requires_grad=True)
        k, v = (torch.randn(2, 11, 2, 8, generator=g, requires_grad=True) for _ in range(2))
        o, lse = K.flash_attention_reference(q, k, v, causal, None, True)
        do = torch.randn_like(o)
        o.backward(do)
        grads = K.flash_attention_backward_reference(q.detach(), k.detach(), v.detach(), o.detach(), lse, do, causal)
        for mine, t in zip(grads, (q, k, v)):
            assert torch.allclose(mine, t.grad, atol=1e-5), causal


# Training equivalence ------------------------------------------------------------------------------
CP_LAYOUTS = {
    "cp2-p2p": (2, P(context_parallel_size=2), 4, 2),
    "cp4-p2p": (4, P(context_parallel_size=4), 4, 2),
    "cp2-a2a": (2, P(context_parallel_size=2, cp_comm_type="a2a"), 4, 2),
    "cp2-allgather": (2, P(context_parallel_size=2, cp_comm_type="allgather"), 4, 2),
    "cp4-a2a+p2p": (
        4,
        P(context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=(2, 2)),
        4,
        2,
    ),
    "cp2-tp2-sp": (4, P(context_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True), 4, 2),
    "cp2-pp2": (4, P(context_parallel_size=2, pipeline_model_parallel_size=2), 4, 1),
    "cp2-dp2": (4, P(context_parallel_size=2), 4, 1),
}


@pytest.mark.parametrize("layout", list(CP_LAYOUTS))
def test_training_with_context_parallelism_equals_single_process(dist, layout):
    from test_train_equivalence import _compare, train_run

    world, parallel, gbs, mbs = CP_LAYOUTS[layout]
    # (the schedule counts the samples each step reports, as a --train-samples run's: a CP rank holds part of
    # each of its data-parallel rank's sequences, which count once)
    ref = train_run("llama", P(), gbs, gbs, count_samples=True)
    for history in dist(world, train_run, "llama", parallel, gbs, mbs, count_samples=True):
        _compare(history, ref)


def test_learned_positions_follow_the_split(dist):
    """GPT-2's learned position embeddings (and tied embeddings) under CP=2: positions are global."""
    from test_train_equivalence import _compare, train_run

    ref = train_run("gpt2", P(), 4, 4)
    for history in dist(2, train_run, "gpt2", P(context_parallel_size=2), 4, 2):
        _compare(history, ref)


def _ring_bytes_sent(cp_width: int, k_dim: int, v_dim: int, kv_heads: int, dtype=torch.float32) -> int:
    """Bytes this rank's ring sends in one attention forward and backward (k, v shaped as the model makes them)."""
    sent = []
    real = dist.batch_isend_irecv

    def spy(ops):
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return real(ops)

    from megatron_lite.context_parallel.attention import ring_attention

    ctx = get_context(P(context_parallel_size=cp_width))
    g = torch.Generator().manual_seed(0)
    b, s, h = 2, 8, 4  # this rank's part of the sequence
    q = torch.randn(b, s, h, k_dim, generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, s, kv_heads, k_dim, generator=g).to(dtype).requires_grad_()
    v = torch.randn(b, s, kv_heads, v_dim, generator=g).to(dtype).requires_grad_()
    dist.batch_isend_irecv = spy
    try:
        ring_attention(q, k, v, ctx.cp, True).sum().backward()
    finally:
        dist.batch_isend_irecv = real
    return sum(sent)


def test_the_planner_counts_the_bytes_the_ring_sends(dist):
    """The planner's context-parallel cost sends what the ring sends: grouped-query keys and values, and
    multi-latent attention's up-projected ones (every head; query/key head 12 = 8 + 4 RoPE, values 6)."""
    from megatron_lite.config import ModelConfig
    from megatron_lite.planner.cost import ring_blocks

    gqa = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=64)
    mla = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, multi_latent_attention=True,
                      position_embedding_type="rope", add_bias_linear=False,
                      qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)  # fmt: skip
    for model, shapes in ((gqa, (8, 8, 2)), (mla, (12, 6, 4))):
        for dtype, a in ((torch.float32, 4), (torch.bfloat16, 2)):  # (the gradients travel in fp32 either way)
            expected = sum(block * n for block, n in ring_blocks(model, tokens=2 * 8, tp=1, cp=2, a=a))
            for measured in dist(2, _ring_bytes_sent, 2, *shapes, dtype):
                assert measured == expected, (model.multi_latent_attention, dtype, measured, expected)


def _collectives_called(comm_type: str, k_dim: int, v_dim: int, kv_heads: int) -> list[tuple[str, int]]:
    """(kind, bytes) of each collective one a2a or allgather attention forward and backward calls on this rank,
    bytes as the planner counts them: an all-to-all's tensor, an all-gather's output, a reduce-scatter's input."""
    from megatron_lite.context_parallel import attention
    from megatron_lite.tensor_parallel import mappings

    calls = []
    real = (dist.all_to_all_single, mappings.all_gather_tensor, mappings.reduce_scatter_tensor)

    def spy(kind, fn, which):
        def call(output, input, *args, **kwargs):
            t = (output, input)[which]
            calls.append((kind, t.numel() * t.element_size()))
            return fn(output, input, *args, **kwargs)

        return call

    ctx = get_context(P(context_parallel_size=2, cp_comm_type=comm_type))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 4, k_dim, generator=g, requires_grad=True)
    k = torch.randn(2, 8, kv_heads, k_dim, generator=g, requires_grad=True)
    v = torch.randn(2, 8, kv_heads, v_dim, generator=g, requires_grad=True)
    dist.all_to_all_single = spy("all_to_all", real[0], 1)
    mappings.all_gather_tensor = spy("all_gather", real[1], 0)
    mappings.reduce_scatter_tensor = spy("reduce_scatter", real[2], 1)
    try:
        attention.IMPLEMENTATIONS[comm_type](q, k, v, ctx.cp, True).sum().backward()
    finally:
        dist.all_to_all_single, mappings.all_gather_tensor, mappings.reduce_scatter_tensor = real
    return calls


@pytest.mark.parametrize("comm_type", ["a2a", "allgather"])
def test_the_planner_counts_the_collectives_a2a_and_allgather_call(dist, comm_type):
    """The planner's a2a and allgather costs price the collectives the attention calls: GQA keys and values (one
    kv head, repeated per query head for a2a as it does not divide over CP; two, which do) and multi-latent
    attention's up-projected heads (query/key head 12, values 6)."""
    from megatron_lite.config import ModelConfig
    from megatron_lite.planner.cost import cp_collectives
    from megatron_lite.planner.layout import Layout

    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64)
    mla = ModelConfig(**base, multi_latent_attention=True, position_embedding_type="rope", add_bias_linear=False,
                      qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)  # fmt: skip
    for model, shapes in (
        (ModelConfig(**base, num_query_groups=1), (8, 8, 1)),
        (ModelConfig(**base, num_query_groups=2), (8, 8, 2)),
        (mla, (12, 6, 4)),
    ):
        layout = Layout(cp=2, cp_comm_type=comm_type)
        expected = sorted(cp_collectives(model, layout, tokens=2 * 8, a=4))
        for called in dist(2, _collectives_called, comm_type, *shapes):
            assert sorted(called) == expected, (model.num_query_groups, model.multi_latent_attention)


def _ring_grads_with_regenerated_inputs(regenerate: bool):
    """Latents -> q, k, v (as multi-latent attention's up-projection makes them) -> the ring; with `regenerate`,
    the q, k, v the ring saves are dropped and made again in its backward (--recompute-modules mla_up_proj)."""
    from megatron_lite.context_parallel.attention import ring_attention
    from megatron_lite.tensor_parallel.random import Regenerated

    ctx = get_context(P(context_parallel_size=2))
    g = torch.Generator().manual_seed(ctx.cp.rank)
    latent = torch.randn(2, 8, 16, generator=g, requires_grad=True)
    w_q, w_k, w_v = (torch.randn(16, 4 * n, generator=g, requires_grad=True) for n in (12, 12, 6))

    def make():
        return tuple((latent @ w).view(2, 8, 4, -1) for w in (w_q, w_k, w_v))

    if regenerate:
        regen = Regenerated()
        q, k, v = regen.first(make)
        with regen.hooks():
            o = ring_attention(q, k, v, ctx.cp, True)
    else:
        q, k, v = make()
        o = ring_attention(q, k, v, ctx.cp, True)
    del q, k, v
    o.backward(torch.randn(o.shape, generator=g))
    return [t.grad for t in (latent, w_q, w_k, w_v)]


def test_the_ring_takes_regenerated_queries_keys_and_values(dist):
    for kept, regenerated in zip(dist(2, _ring_grads_with_regenerated_inputs, False),
                                 dist(2, _ring_grads_with_regenerated_inputs, True)):  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(kept, regenerated))
