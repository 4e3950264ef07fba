"""Process-group layout: Megatron's rank order as pure data, and real groups that communicate among the
right members."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_lite.config import ParallelConfig
from megatron_lite.parallel_context import (
    ParallelContext,
    all_groups,
    chunk_layers,
    decoder_grid,
    expert_grid,
)

from dist_pool import get_context


def test_megatron_documented_example():
    # Megatron-LM's initialize_model_parallel docstring: 16 GPUs, TP=2, PP=4 -> DP=2.
    g = decoder_grid(ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=4), 16)
    assert g.groups(("tp",)) == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13), (14, 15)]
    assert g.groups(("dp",)) == [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)]
    assert g.groups(("pp",)) == [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]


def test_order_tp_cp_dp_pp_and_partitions():
    parallel = ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=2, pipeline_model_parallel_size=2)
    g = decoder_grid(parallel, 16)
    assert g.sizes == (2, 2, 2, 2)
    assert g.coords(13) == {"tp": 1, "cp": 0, "dp": 1, "pp": 1}
    assert g.groups(("cp",))[0] == (0, 2)
    assert g.groups(("dp",))[0] == (0, 4)
    assert g.groups(("cp", "dp"))[0] == (0, 2, 4, 6)
    for dims in [("tp",), ("cp",), ("dp",), ("pp",), ("cp", "dp"), ("tp", "pp")]:
        groups = g.groups(dims)
        assert sorted(r for grp in groups for r in grp) == list(range(16)), dims


def test_expert_grid_decoupled_and_pipeline_groups_coincide():
    parallel = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=4,
        expert_tensor_parallel_size=1,
    )
    e = expert_grid(parallel, 16)
    assert e.sizes == (1, 4, 2, 2)  # expert-TP, EP, expert-DP, PP
    assert e.groups(("ep",))[:2] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert e.groups(("edp",))[0] == (0, 4)
    assert e.groups(("pp",)) == decoder_grid(parallel, 16).groups(("pp",))
    ctx = ParallelContext.virtual(parallel, 16, 13)
    assert (ctx.tp.rank, ctx.pp.rank, ctx.ep.rank, ctx.edp.rank) == (
        1,
        1,
        1,
        1,
    )  # 13 = 0 + 1*(1 + 4*(1 + 2*1))
    assert ctx.embedding.ranks == (5, 13)  # first and last stage of rank 13's pipeline


def sums_over_groups(parallel):
    ctx = get_context(parallel)
    out = {}
    for kind in ("tp", "dp", "pp", "dp_cp", "mp", "ep", "edp", "embedding"):
        group = ctx.groups[kind]
        t = torch.tensor([float(dist.get_rank())])
        if group.size > 1:
            dist.all_reduce(t, group=group.pg)
        out[kind] = (float(t), group.ranks)
    return out


@pytest.mark.parametrize(
    "parallel",
    [
        ParallelConfig(tensor_model_parallel_size=2),
        ParallelConfig(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
        ),
    ],
    ids=["tp2-dp2", "tp2-pp2-ep2"],
)
def test_real_groups_reduce_over_their_members(dist, parallel):
    results = dist(4, sums_over_groups, parallel)
    for rank, res in enumerate(results):
        for kind, (total, ranks) in res.items():
            assert rank in ranks
            assert total == sum(ranks), (rank, kind, ranks)


def test_virtual_pipeline_chunks_interleave_across_ranks():
    # 8 layers, PP=2, 2 chunks per rank: stages of 2 layers, stage s on rank s % 2.
    got = {(r, c): list(chunk_layers(8, 2, 2, r, c)) for r in range(2) for c in range(2)}
    assert got == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}
    # Without virtual stages it is plain contiguous stages; every layer is placed exactly once.
    assert [list(chunk_layers(8, 4, 1, r, 0)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    placed = sorted(n for r in range(4) for c in range(3) for n in chunk_layers(24, 4, 3, r, c))
    assert placed == list(range(24))


def test_embedding_groups_pair_first_and_last_stage():
    groups = all_groups(ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=4), 16)
    assert groups["embedding"] == [(0, 12), (1, 13), (2, 14), (3, 15)]
    assert all_groups(ParallelConfig(), 2)["embedding"] == [(0,), (1,)]


def test_hierarchical_context_parallel_groups():
    """Megatron's --hierarchical-context-parallel-sizes 2 4 (CP=8): every two adjacent CP ranks form the
    all-to-all level, and the CP ranks of the same parity the ring; with TP=2 the CP ranks are 2 apart."""
    parallel = ParallelConfig(
        tensor_model_parallel_size=2,
        context_parallel_size=8,
        cp_comm_type="a2a+p2p",
        hierarchical_context_parallel_sizes=(2, 4),
    )
    groups = all_groups(parallel, 16)
    assert groups["cp"] == [tuple(range(0, 16, 2)), tuple(range(1, 16, 2))]
    assert (0, 2) in groups["cp_inner"] and (12, 14) in groups["cp_inner"] and len(groups["cp_inner"]) == 8
    assert groups["cp_outer"] == [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]
    assert "cp_inner" not in all_groups(ParallelConfig(context_parallel_size=8), 8)
