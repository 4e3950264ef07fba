"""--tp-comm-overlap: the ring-decomposed all-gather + GEMM and GEMM + reduce-scatter equal their plain
references (all-gather then matmul; matmul then reduce-scatter), forward and backward, on 2 and 4 gloo ranks
to 1e-6 relative in fp32; whole-model training with the overlap flags on equals one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_lite.config import ParallelConfig

from dist_pool import get_context
from models import needs_triton_on_cpu

P = ParallelConfig


def overlap_vs_reference(kind: str, triton: bool = False) -> list[float]:
    from megatron_lite.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )
    from megatron_lite.tensor_parallel.overlap import column_parallel_overlapped, row_parallel_overlapped

    tp = dist.get_world_size()
    ctx = get_context(P(tensor_model_parallel_size=tp, sequence_parallel=True))
    g = torch.Generator().manual_seed(10 + ctx.tp.rank)  # every rank its own shard
    c, b, k, n = 3, 2, 16, 12
    if kind == "column":
        x = torch.randn(c, b, k, generator=g, requires_grad=True)
        dy = torch.randn(tp * c, b, n, generator=g)
    else:
        x = torch.randn(tp * c, b, k, generator=g, requires_grad=True)
        dy = torch.randn(c, b, n, generator=g)
    w = torch.randn(n, k, generator=g, requires_grad=True)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    if kind == "column":
        y = column_parallel_overlapped(x, w, ctx.tp, triton)
        ref = gather_from_sequence_parallel_region(x2, ctx.tp) @ w2.t()
    else:
        y = row_parallel_overlapped(x, w, ctx.tp, triton)
        ref = reduce_scatter_to_sequence_parallel_region(x2 @ w2.t(), ctx.tp)
    y.backward(dy)
    ref.backward(dy)
    return [float((a - b).norm() / b.norm()) for a, b in ((y, ref), (x.grad, x2.grad), (w.grad, w2.grad))]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_overlapped_gemm_equals_reference(dist, tp, kind):
    for errs in dist(tp, overlap_vs_reference, kind):
        assert max(errs) < 1e-6, errs


@needs_triton_on_cpu
@pytest.mark.parametrize("kind", ["column", "row"])
def test_overlapped_gemm_through_the_triton_kernel(dist, kind):
    """The per-chunk GEMMs by our Triton kernel (the CUDA path; here under the interpreter)."""
    for errs in dist(2, overlap_vs_reference, kind, True):
        assert max(errs) < 1e-6, errs


def tp_switches_and_uneven_shapes() -> list[tuple[str, bool]]:
    """From a TP review: --disable-tp-comm-overlap-ag / -rs were accepted and did nothing; the ring's GEMM +
    reduce-scatter dropped the rows of an input TP does not divide (the plain reduce-scatter raises), and a model
    under SP said only "dim 0 of size 15 does not split over 2 ranks"."""
    import dataclasses

    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron_lite.tensor_parallel.overlap import matmul_reduce_scatter

    from models import llama_config

    base = P(tensor_model_parallel_size=2, sequence_parallel=True, tp_comm_overlap=True)
    seen = []
    for off in ("ag", "rs"):
        ctx = get_context(dataclasses.replace(base, **{f"tp_comm_overlap_{off}": False}))
        model = build_model(llama_config(), ctx, seed=0)
        for name, m in model.named_modules():  # (the output layer's logits are gathered by the loss, not SP)
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and "output_layer" not in name:
                seen.append((f"{off} off: {type(m).__name__}", m.comm_overlap))
    with pytest.raises(ValueError, match="dim 0 of size 7 does not split over 2 ranks"):
        matmul_reduce_scatter(torch.randn(7, 1, 4), torch.randn(3, 4), ctx.tp)
    with pytest.raises(ValueError, match="a sequence of 15 tokens does not split over --tensor-model-parallel-size 2"):
        model(torch.zeros(1, 15, dtype=torch.long))
    return sorted(set(seen))


def test_per_collective_overlap_switches_and_shapes_the_ring_cannot_split(dist):
    from megatron_lite.arguments import parse_args

    flags = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --train-iters 1 --mock-data"
    flags += " --vocab-size 100 --tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap"
    parallel = parse_args([*flags.split(), "--disable-tp-comm-overlap-rs"])[1].parallel
    assert (parallel.tp_comm_overlap_ag, parallel.tp_comm_overlap_rs) == (True, False)
    for seen in dist(2, tp_switches_and_uneven_shapes):
        assert seen == [("ag off: ColumnParallelLinear", False), ("ag off: RowParallelLinear", True),
                        ("rs off: ColumnParallelLinear", True), ("rs off: RowParallelLinear", False)], seen  # fmt: skip


LAYOUTS = {
    "tp2-sp": (2, P(tensor_model_parallel_size=2, sequence_parallel=True, tp_comm_overlap=True), 4, 2),
    "tp2-sp-pp2": (
        4,
        P(
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            tp_comm_overlap=True,
            pipeline_model_parallel_size=2,
            overlap_p2p_comm=True,
        ),
        4,
        1,
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_with_overlap_equals_single_process(dist, layout):
    from test_train_equivalence import _compare, train_run

    world, parallel, gbs, mbs = LAYOUTS[layout]
    ref = train_run("llama", P(), gbs, gbs)
    for history in dist(world, train_run, "llama", parallel, gbs, mbs):
        _compare(history, ref)


def moe_dispatch_overlap_vs_plain(num_chunks: int, skewed: bool = False) -> list[float]:
    """The chunked, overlapped all-to-all dispatch against the plain one, forward and backward. `skewed`: rank
    0's tokens all alike, so capacity drops every pair of its second chunk while the other ranks still send
    theirs to its experts (its combine of nothing had left the graph, and its backward skipped the chunk's
    all-to-alls the others posted: a collective mismatch)."""
    from test_moe import moe_config

    from megatron_lite.moe.dispatcher import alltoall_dispatch, alltoall_dispatch_overlapped
    from megatron_lite.moe.experts import LocalExperts
    from megatron_lite.moe.router import TopKRouter

    ep = dist.get_world_size()
    ctx = get_context(P(expert_model_parallel_size=ep))
    config = moe_config(moe_expert_capacity_factor=1.0)  # some pairs dropped: the split must not change that
    if skewed:
        config = moe_config(moe_expert_capacity_factor=1.0, moe_token_drop_policy="position")
    torch.manual_seed(0)
    router = TopKRouter(config, 1)
    experts = LocalExperts(config, ctx.ep, ctx.etp)
    with torch.no_grad():
        for p in [*router.parameters(), *experts.parameters()]:
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(ctx.ep.rank + p.numel()))
    g = torch.Generator().manual_seed(100 + ctx.ep.rank)
    t = 8 if skewed else 37
    x = torch.randn(t, config.hidden_size, generator=g)
    dy = torch.randn(t, config.hidden_size, generator=g)
    if skewed and ctx.ep.rank == 0:
        x[:] = x[0]
    results = []
    for fn in (alltoall_dispatch, alltoall_dispatch_overlapped):
        xi = x.clone().requires_grad_()
        routing = router(xi, (t, 1))
        if skewed and ctx.ep.rank == 0:
            assert not routing.keep[t // 2 :].any()  # (the case this is about)
        kwargs = {"num_chunks": num_chunks} if fn is alltoall_dispatch_overlapped else {}
        y = fn(xi, routing, experts, ctx.ep, config.num_experts, **kwargs)
        y.backward(dy)
        grads = [p.grad.clone() for p in experts.parameters()]
        for p in [*router.parameters(), *experts.parameters()]:
            p.grad = None
        results.append((y.detach(), xi.grad, grads, bool((~routing.keep).any())))
    (y0, gx0, gw0, dropped), (y1, gx1, gw1, _) = results
    assert dropped
    errs = [float((y1 - y0).norm() / y0.norm()), float((gx1 - gx0).norm() / gx0.norm())]
    errs += [float((a - b).norm() / b.norm()) for a, b in zip(gw1, gw0) if b.norm() > 0]
    return errs


def moe_layer_recomputed_vs_plain() -> list[float]:
    """--overlap-moe-expert-parallel-comm with --recompute-modules moe, PyTorch kernels, no aux or z loss: rank
    0's second chunk is wholly dropped. Its combine of nothing saved no tensor, so its backward ran the chunk's
    gradient all-to-all before the recomputation, while the other rank recomputed first (starting with the
    counts exchange): the collectives paired wrongly (gloo: a connection reset, or a split of 7e16 bytes)."""
    from test_moe import moe_config

    from megatron_lite.moe.layer import MoELayer
    from megatron_lite.tensor_parallel.random import checkpoint

    ctx = get_context(P(expert_model_parallel_size=2, overlap_moe_expert_parallel_comm=True))
    ctx.seed(0)
    config = moe_config(moe_expert_capacity_factor=1.0, moe_token_drop_policy="position", moe_aux_loss_coeff=0.0,
                        moe_z_loss_coeff=None, kernel_impl="torch")  # fmt: skip
    layer = MoELayer(config, ctx).train()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(ctx.ep.rank * 7 + p.numel()))
    g = torch.Generator().manual_seed(100 + ctx.ep.rank)
    x = torch.randn(8, 1, config.hidden_size, generator=g)
    if ctx.ep.rank == 0:
        x[:] = x[0]
    dy = torch.randn(8, 1, config.hidden_size, generator=g)
    out = []
    for recompute in (False, True):
        layer.reset_stats()
        xi = x.clone().requires_grad_()
        y = checkpoint(layer, ctx.rng, xi) if recompute else layer(xi)
        if ctx.ep.rank == 0:  # 8 alike tokens x top-2 to 2 experts of capacity 4: the second chunk's 8 pairs dropped
            assert layer.stats["dropped"] == 8, layer.stats
        y.backward(dy)
        out.append([y.detach(), xi.grad, *[p.grad.clone() for p in layer.parameters()]])
        layer.zero_grad(set_to_none=True)
    return [float((a - b).norm() / b.norm()) for a, b in zip(*out) if b.norm() > 0]


def test_overlapped_moe_dispatch_recomputed_with_a_wholly_dropped_chunk(dist):
    for errs in dist(2, moe_layer_recomputed_vs_plain):
        assert errs and max(errs) < 1e-6, errs


@pytest.mark.parametrize("ep", [2, 4])
def test_overlapped_moe_dispatch_equals_plain(dist, ep):
    for chunks in (2, 3):
        for errs in dist(ep, moe_dispatch_overlap_vs_plain, chunks):
            assert max(errs) < 1e-6, errs
    if ep == 2:  # a chunk whose every pair is dropped on one rank
        for errs in dist(ep, moe_dispatch_overlap_vs_plain, 2, True):
            assert max(errs) < 1e-6, errs


def test_moe_training_with_every_overlap_flag_equals_single_process(dist):
    from test_moe import _compare, moe_config, moe_run

    config = moe_config()
    ref = moe_run(config, P(), 8, 2)
    parallel = P(expert_model_parallel_size=2, overlap_moe_expert_parallel_comm=True)
    for history in dist(2, moe_run, config, parallel, 8, 2):
        _compare(history, ref)
    parallel = P(
        expert_model_parallel_size=2,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        tp_comm_overlap=True,
        overlap_moe_expert_parallel_comm=True,
    )
    for history in dist(4, moe_run, config, parallel, 8, 2):
        _compare(history, ref)
