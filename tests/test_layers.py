"""Every mapping and tensor-parallel layer, forward and backward, against the unsharded operation.

Each rank regenerates every rank's inputs from seeded generators, so it can compute the unsharded
reference itself and return only relative errors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config import ParallelConfig
from megatron_lite.parameters import named_param_meta
from megatron_lite.tensor_parallel import mappings as M
from megatron_lite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lite.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

from dist_pool import get_context
from models import rel

TOL = 1e-6


def _rand(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def check_mappings():
    ctx = get_context(ParallelConfig(tensor_model_parallel_size=torch.distributed.get_world_size()))
    tp = ctx.tp
    n, r = tp.size, tp.rank
    S, B, H = 4 * n, 2, 3 * n
    errs = {}

    def run(fn, x_of, gout_of):
        """Forward fn on this rank's input; backward with this rank's output gradient."""
        x = x_of(r).clone().requires_grad_(True)
        y = fn(x, tp)
        y.backward(gout_of(r))
        return y.detach(), x.grad

    full = lambda k: _rand(100 + k, S, B, H)  # noqa: E731 - per-rank tensors of the full shape
    shard_last = lambda t, k: t.chunk(n, dim=-1)[k]  # noqa: E731
    shard_seq = lambda t, k: t.chunk(n, dim=0)[k]  # noqa: E731

    # copy_to: identity forward; backward sums every rank's gradient.
    y, gx = run(M.copy_to_tensor_model_parallel_region, lambda k: full(0), full)
    errs["copy_to fwd"] = rel(y, full(0))
    errs["copy_to bwd"] = rel(gx, sum(full(k) for k in range(n)))
    # reduce_from: forward sums; backward identity.
    y, gx = run(M.reduce_from_tensor_model_parallel_region, full, lambda k: full(50 + k))
    errs["reduce_from fwd"] = rel(y, sum(full(k) for k in range(n)))
    errs["reduce_from bwd"] = rel(gx, full(50 + r))
    # scatter_to_tp: keeps this rank's slice of the last dim; backward gathers the slices' gradients.
    gfull = lambda k: _rand(200 + k, S, B, H // n)  # noqa: E731
    y, gx = run(M.scatter_to_tensor_model_parallel_region, lambda k: full(0), gfull)
    errs["scatter_to_tp fwd"] = rel(y, shard_last(full(0), r))
    errs["scatter_to_tp bwd"] = rel(gx, torch.cat([gfull(k) for k in range(n)], dim=-1))
    # gather_from_tp: concatenates every rank's slice; backward keeps this rank's slice.
    y, gx = run(M.gather_from_tensor_model_parallel_region, lambda k: shard_last(full(k), k), lambda k: full(50))
    errs["gather_from_tp fwd"] = rel(y, torch.cat([shard_last(full(k), k) for k in range(n)], dim=-1))
    errs["gather_from_tp bwd"] = rel(gx, shard_last(full(50), r))
    # scatter_to_sp: keeps this rank's sequence shard; backward gathers.
    gseq = lambda k: _rand(300 + k, S // n, B, H)  # noqa: E731
    y, gx = run(M.scatter_to_sequence_parallel_region, lambda k: full(0), gseq)
    errs["scatter_to_sp fwd"] = rel(y, shard_seq(full(0), r))
    errs["scatter_to_sp bwd"] = rel(gx, torch.cat([gseq(k) for k in range(n)], dim=0))
    # gather_from_sp: concatenates sequence shards; backward reduce-scatters (sum, then own shard).
    y, gx = run(M.gather_from_sequence_parallel_region, lambda k: shard_seq(full(k), k), full)
    errs["gather_from_sp fwd"] = rel(y, torch.cat([shard_seq(full(k), k) for k in range(n)], dim=0))
    errs["gather_from_sp bwd"] = rel(gx, shard_seq(sum(full(k) for k in range(n)), r))
    # reduce_scatter_to_sp: sums and keeps own sequence shard; backward gathers.
    y, gx = run(M.reduce_scatter_to_sequence_parallel_region, full, gseq)
    errs["reduce_scatter_to_sp fwd"] = rel(y, shard_seq(sum(full(k) for k in range(n)), r))
    errs["reduce_scatter_to_sp bwd"] = rel(gx, torch.cat([gseq(k) for k in range(n)], dim=0))
    return errs


def check_column_parallel(sequence_parallel: bool, gather_output: bool, blocks: tuple[int, ...]):
    n = torch.distributed.get_world_size()
    ctx = get_context(ParallelConfig(tensor_model_parallel_size=n))
    tp = ctx.tp
    S, B, H = 4 * n, 2, 6
    out_full = sum(blocks)
    layer = ColumnParallelLinear(
        H, list(blocks), tp, bias=True, gather_output=gather_output, sequence_parallel=sequence_parallel
    )
    w, b = _rand(1, out_full, H), _rand(2, out_full)
    with torch.no_grad():
        layer.weight.copy_(layer.spec.shard(w, tp.rank))
        layer.bias.copy_(layer.spec.shard(b, tp.rank))
    x = _rand(3, S, B, H)
    gy = _rand(4, S, B, out_full)  # the same full output gradient on every rank
    # Reference on full tensors.
    xr, wr, br = (t.clone().requires_grad_(True) for t in (x, w, b))
    yr = F.linear(xr, wr, br)
    yr.backward(gy)
    # Sharded.
    xin = (x.chunk(n, 0)[tp.rank] if sequence_parallel else x).clone().requires_grad_(True)
    y = layer(xin)
    my_gy = gy if gather_output else layer.spec.shard(gy.movedim(-1, 0), tp.rank).movedim(0, -1)
    y.backward(my_gy)
    want_y = yr.detach() if gather_output else layer.spec.shard(yr.detach().movedim(-1, 0), tp.rank).movedim(0, -1)
    want_gx = xr.grad.chunk(n, 0)[tp.rank] if sequence_parallel else xr.grad
    return {
        "fwd": rel(y, want_y),
        "grad x": rel(xin.grad, want_gx),
        "grad w": rel(layer.weight.grad, layer.spec.shard(wr.grad, tp.rank)),
        "grad b": rel(layer.bias.grad, layer.spec.shard(br.grad, tp.rank)),
    }


def check_row_parallel(sequence_parallel: bool, input_is_parallel: bool):
    n = torch.distributed.get_world_size()
    ctx = get_context(ParallelConfig(tensor_model_parallel_size=n))
    tp = ctx.tp
    S, B, IN, OUT = 4 * n, 2, 3 * n, 5
    layer = RowParallelLinear(
        IN, OUT, tp, bias=True, input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel
    )
    w, b = _rand(1, OUT, IN), _rand(2, OUT)
    with torch.no_grad():
        layer.weight.copy_(layer.spec.shard(w, tp.rank))
        layer.bias.copy_(b)
    x, gy = _rand(3, S, B, IN), _rand(4, S, B, OUT)
    xr, wr, br = (t.clone().requires_grad_(True) for t in (x, w, b))
    yr = F.linear(xr, wr, br)
    yr.backward(gy)
    xin = (x.chunk(n, -1)[tp.rank] if input_is_parallel else x).clone().requires_grad_(True)
    y = layer(xin)
    y.backward(gy.chunk(n, 0)[tp.rank] if sequence_parallel else gy)
    meta = {n: m for n, _, m in named_param_meta(layer)}
    bias_grad = layer.bias.grad.clone()
    if sequence_parallel:  # each rank saw its sequence shard: the bias gradient is partial
        torch.distributed.all_reduce(bias_grad, group=tp.pg)
    return {
        "fwd": rel(y, yr.detach().chunk(n, 0)[tp.rank] if sequence_parallel else yr.detach()),
        "grad x": rel(xin.grad, xr.grad.chunk(n, -1)[tp.rank] if input_is_parallel else xr.grad),
        "grad w": rel(layer.weight.grad, layer.spec.shard(wr.grad, tp.rank)),
        "grad b": rel(bias_grad, br.grad),
        "bias marked sequence_parallel": float(meta["bias"].sequence_parallel != sequence_parallel),
    }


def check_vocab_embedding(reduce_scatter: bool):
    n = torch.distributed.get_world_size()
    ctx = get_context(ParallelConfig(tensor_model_parallel_size=n))
    tp = ctx.tp
    V, Vp, H, B, S = 13, 16, 4, 2, 4 * n  # 13 real rows padded to 16
    emb = VocabParallelEmbedding(V, Vp, H, tp, reduce_scatter_embeddings=reduce_scatter)
    w = _rand(1, V, H)
    with torch.no_grad():
        emb.weight.copy_(emb.spec.shard(w, tp.rank))
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(2))
    gy = _rand(3, S, B, H)
    wr = w.clone().requires_grad_(True)
    yr = F.embedding(ids.t(), wr)
    yr.backward(gy)
    y = emb(ids)
    y.backward(gy.chunk(n, 0)[tp.rank] if reduce_scatter else gy)
    spec = emb.spec
    pad_rows = emb.weight.grad[~spec.padding_mask(tp.rank)]
    return {
        "fwd": rel(y, yr.detach().chunk(n, 0)[tp.rank] if reduce_scatter else yr.detach()),
        "grad w": rel(emb.weight.grad, spec.shard(wr.grad, tp.rank)),
        "padding rows zero": float(pad_rows.abs().sum()) + float(emb.weight[~spec.padding_mask(tp.rank)].abs().sum()),
    }


def check_cross_entropy():
    n = torch.distributed.get_world_size()
    ctx = get_context(ParallelConfig(tensor_model_parallel_size=n))
    tp = ctx.tp
    V, Vp, T = 13, 16, 10
    logits = _rand(1, T, V) * 3
    target = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(2))
    target[3] = -100  # ignored
    gl = _rand(3, T)
    lr = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(lr, target, reduction="none", ignore_index=-100)
    ref.backward(gl)
    padded = torch.cat([logits, 1e4 * torch.ones(T, Vp - V)], dim=-1)  # huge padding logits must not leak
    shard = padded.chunk(n, -1)[tp.rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(shard, target, tp, V)
    loss.backward(gl)
    want = torch.cat([lr.grad, torch.zeros(T, Vp - V)], dim=-1).chunk(n, -1)[tp.rank]
    return {
        "fwd": rel(loss, ref.detach()),
        "bwd": rel(shard.grad, want),
        "input untouched": rel(shard.detach(), padded.chunk(n, -1)[tp.rank]),
    }


def _assert_small(results, tol=TOL):
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if not v <= tol}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("world", [2, 4])
def test_mappings(dist, world):
    _assert_small(dist(world, check_mappings))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "sp,gather,blocks",
    [
        (False, False, (8,)),
        (True, False, (8,)),
        (False, True, (8,)),
        (False, False, (4, 8)),
        (True, False, (4, 8)),
        (False, True, (4, 8)),  # (from a review: gathered as [a_0; b_0; a_1; b_1], not [a; b])
    ],
)
def test_column_parallel_linear(dist, world, sp, gather, blocks):
    _assert_small(dist(world, check_column_parallel, sp, gather, blocks))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp,parallel_input", [(False, True), (True, True), (False, False)])
def test_row_parallel_linear(dist, world, sp, parallel_input):
    _assert_small(dist(world, check_row_parallel, sp, parallel_input))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("reduce_scatter", [False, True])
def test_vocab_parallel_embedding(dist, world, reduce_scatter):
    _assert_small(dist(world, check_vocab_embedding, reduce_scatter))


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_cross_entropy(dist, world):
    _assert_small(dist(world, check_cross_entropy), tol=1e-6)
