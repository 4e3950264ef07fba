"""The planner's price of --optimizer muon's and dist_muon's Newton-Schulz (planner/muon_cost.py) held to the
optimizer's real step: its GEMM FLOPs counted by torch's FlopCounterMode on one process and on each rank of TP=2
(each --muon-tp-mode, experts over expert TP) and of dist_muon at DP=2, its TP collectives recorded on gloo, and
Llama-3-8B's FLOPs worked out by hand from its dimensions."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_lite.config import LLAMA_ARCHITECTURE, ModelConfig
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.planner import cost
from megatron_lite.planner.hardware import cluster
from megatron_lite.planner.layout import Layout
from megatron_lite.planner.muon_cost import MuonSettings, muon_seconds, rank_runs

from dist_pool import get_context
from models import deepseek_config, gpt2_config, hetero_config, llama_config, nemotron_h_config

MODELS = {
    "llama": llama_config,  # GQA: the fused QKV split into queries, keys and values
    "gated": lambda: llama_config(attention_output_gate=True),  # and its gates
    "gpt2": gpt2_config,  # learned positions (a 2-D embedding Muon steps), biases Adam steps
    "moe": lambda: llama_config(  # experts, the router and the shared expert's [1, hidden] gate
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=48,
        moe_shared_expert_intermediate_size=24,
        moe_shared_expert_gate=True,
    ),  # fmt: skip
    "deepseekmtp": lambda: deepseek_config(mtp_num_layers=1),  # multi-latent attention, an MTP depth's eh_proj
    "hetero": lambda: hetero_config(num_layers=4),  # own query groups, a linear replacement, a no-op
    # Mamba, attention and MoE layers (M*EM) whose matrices tie in size across shapes, an untrained expert_bias
    "hybrid": lambda: nemotron_h_config(num_layers=4),
}


def _counted(name: str, layout: Layout, muon: dict, ctx=None) -> tuple[int, list[tuple[str, int]]]:
    """(GEMM FLOPs, the (kind, bytes) of each all-reduce and all-gather) of one real optimizer step on this rank:
    the model built at `layout`, a random gradient on every parameter it steps."""
    import torch.distributed as dist

    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.training.wrap import wrap_for_training

    ctx = ctx or ParallelContext.virtual(layout.parallel_config())
    config = layout.model_config(MODELS[name]())
    net = build_model(config, ctx, seed=1)
    optimizer = "dist_muon" if layout.sharding == "layer-wise" else "muon"
    _, opt = wrap_for_training(net, ctx, OptimizerConfig(optimizer=optimizer, lr=1e-3, **muon))
    torch.manual_seed(ctx.dp.rank)
    for group in opt.inner.param_groups:
        for p in group["params"]:
            p.grad = torch.randn_like(p)
    calls, real = [], (dist.all_reduce, dist.all_gather)

    def all_reduce(tensor, *args, **kw):
        calls.append(("all_reduce", tensor.numel() * tensor.element_size()))
        return real[0](tensor, *args, **kw)

    def all_gather(outputs, tensor, *args, **kw):
        calls.append(("all_gather", sum(t.numel() * t.element_size() for t in outputs)))
        return real[1](outputs, tensor, *args, **kw)

    dist.all_reduce, dist.all_gather = all_reduce, all_gather
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (two threads of a busy machine took 1000x longer over these small GEMMs)
    try:
        with FlopCounterMode(display=False) as counter:
            opt.inner.step()
    finally:
        dist.all_reduce, dist.all_gather = real
        torch.set_num_threads(threads)
    return counter.get_total_flops(), calls


def _priced(name: str, layout: Layout, muon: dict) -> list[list[tuple[int, list[tuple[str, int]]]]]:
    """The planner's (FLOPs, collectives) of each rank of each data-parallel group (dense, then experts)."""
    settings = dataclasses.replace(MuonSettings(), **{k.removeprefix("muon_"): v for k, v in muon.items()})
    steps, a = settings.num_ns_steps, 2 if settings.fp32_matmul_prec == "medium" else 4
    return [
        [
            (
                sum(run.flops(steps) * k for run, k in rank),
                sorted(c for run, k in rank for c in run.collectives(steps, a) * k),
            )
            for rank in group
        ]
        for group in rank_runs(MODELS[name](), layout, 0, False, settings)
    ]


SPLIT = {"muon_split_qkv": False}
LOW = {"muon_fp32_matmul_prec": "low"}


@pytest.mark.parametrize("name", MODELS)
def test_newton_schulz_flops_are_the_optimizer_steps(name):
    """One process: the GEMM FLOPs priced are those the optimizer's step runs, with the fused QKV split (the
    default) and whole (--muon-no-split-qkv). The step was priced as memory traffic alone."""
    for muon in ({}, SPLIT):
        flops = sum(group[0][0] for group in _priced(name, Layout(), muon))  # (dense, experts: one rank each)
        assert flops == _counted(name, Layout(), muon)[0], muon


def _tp_ranks(name: str, layout: Layout, muon: dict):
    return _counted(name, layout, muon, get_context(layout.parallel_config()))


@pytest.mark.parametrize("mode", ["blockwise", "duplicated", "distributed"])
def test_each_tp_mode_is_priced_as_each_rank_runs_it(dist, mode):
    """TP=2: blockwise orthogonalizes each shard alone, duplicated the all-gathered matrix on every rank, distributed
    the shard with its norm and A all-reduced over TP: the FLOPs and the collectives (kinds and bytes: fp32 shards
    gathered, A in bf16 under the default medium precision, fp32 under low) of every rank, the experts' over
    expert TP."""
    # (and --expert-tensor-parallel-size 1: whole experts, orthogonalized alone on each rank)
    cases = [("llama", {"muon_tp_mode": mode}, None), ("moe", {"muon_tp_mode": mode, **LOW}, None)]
    for name, muon, etp in cases + [("moe", {"muon_tp_mode": mode}, 1)]:
        layout = Layout(tp=2, sequence_parallel=True, etp=etp)
        ((priced,), *experts) = _priced(name, layout, muon)
        flops = priced[0] + sum(group[0][0] for group in experts)
        collectives = sorted(priced[1] + [c for group in experts for c in group[0][1]])
        for got, calls in dist(2, _tp_ranks, name, layout, muon):
            assert (got, sorted(calls)) == (flops, collectives), (name, mode, etp)


def test_expert_newton_schulz_collectives_go_over_expert_tp():
    """(From a review: at TP 4 and expert TP 2, the experts' all-reduces under --muon-tp-mode distributed were priced
    over 4 ranks.) On a cluster where only a collective's ring steps cost (one second each) and nothing else does,
    the Newton-Schulz time is each run's all-reduces (the norm's and one an iteration), 2 (n - 1) steps each over
    its own group: 3 for the dense runs, 1 for the experts'."""
    cl = cluster("H100", 8, 1, None, None)
    free = dataclasses.replace(cl.gpu, peak_flops=float("inf"), memory_bandwidth=float("inf"), launch_seconds=0.0)
    cl = dataclasses.replace(
        cl, gpu=free, link_latency=1.0, nvlink_bandwidth=float("inf"), network_bandwidth=float("inf")
    )
    settings = MuonSettings(tp_mode="distributed")
    layout = Layout(tp=4, ep=2, etp=2, dp=2, sequence_parallel=True)
    model = MODELS["moe"]()
    dense, experts = rank_runs(model, layout, 0, False, settings)
    per_run = {False: 2 * (4 - 1), True: 2 * (2 - 1)}  # (one all-reduce's ring steps over TP and over expert TP)
    want = sum(
        (1 + settings.num_ns_steps) * per_run[expert] * k * (run.tp > 1)
        for expert, (rank,) in ((False, dense), (True, experts))
        for run, k in rank
    )
    assert {run.tp for run, _ in experts[0]} == {2}
    assert muon_seconds(model, layout, 0, False, settings, cl, cost.EFF, cost._collective) == pytest.approx(want)


def _dp_ranks(name: str, layout: Layout, muon: dict) -> tuple[int, int]:
    ctx = get_context(layout.parallel_config())
    return ctx.dp.rank, _counted(name, layout, muon, ctx)[0]


@pytest.mark.parametrize("tp", [1, 2])
def test_dist_muon_prices_each_ranks_owned_matrices(dist, tp):
    """dist_muon at DP=2: each rank orthogonalizes the whole tensors it owns (dense and expert ones split apart), as
    the planner splits them, in the runtime's order (ties of size broken by it: the hybrid's equal-sized matrices of
    other shapes; its router's expert_bias is not trained, so not split); the step time takes the busier rank's."""
    layout = Layout(tp=tp, dp=2, sharding="layer-wise", sequence_parallel=tp > 1)
    names = ("gpt2", "deepseekmtp", "hybrid") if tp == 1 else ("hybrid",)  # (experts split apart over expert-DP)
    for name in names:
        groups = _priced(name, layout, {})
        priced = [sum(group[r][0] for group in groups) for r in range(2)]
        for dp_rank, counted in dist(2 * tp, _dp_ranks, name, layout, {}):
            assert counted == priced[dp_rank], (name, dp_rank)
        assert priced[0] != priced[1], name  # (ranks that differ: the test tells them apart)


LLAMA3_8B = ModelConfig(
    num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
    vocab_size=128256, max_position_embeddings=8192, untie_embeddings_and_output_weights=True, **LLAMA_ARCHITECTURE,
)  # fmt: skip


def test_llama3_8b_newton_schulz_is_priced_in_the_step():
    """By hand: per layer, with the fused QKV split, queries [4096, 4096], keys and values [1024, 4096], the output
    projection [4096, 4096], fc1 [28672, 4096], fc2 [4096, 14336]; X [m, n] (m the shorter side) costs
    5 x (4 m^2 n + 2 m^3). At DP=8 every rank runs all 32 layers' (about 0.64 PFLOP, over a second on an H100), at
    bf16's peak; --muon-fp32-matmul-prec high at TF32's, low at fp32's. The optimizer step held the state's traffic
    alone."""

    def ns(m, n):
        return 5 * (4 * m * m * n + 2 * m**3)

    layer = 2 * ns(4096, 4096) + 2 * ns(1024, 4096) + ns(4096, 28672) + ns(4096, 14336)
    layout = Layout(dp=8)
    settings = MuonSettings()
    ((rank,),) = rank_runs(LLAMA3_8B, layout, 0, True, settings)
    assert sum(run.flops(5) * k for run, k in rank) == 32 * layer
    cl = cluster("H100", 8, 1, None, None)
    plain = cost.step_time(LLAMA3_8B, layout, 8192, 64, cl)
    t = cost.step_time(LLAMA3_8B, layout, 8192, 64, cl, muon=settings)
    gemms = 32 * layer / (cl.gpu.peak_flops * cost.EFF.gemm)  # (the FLOPs at EFF.gemm of the bf16 peak)
    added = t.optimizer - plain.optimizer
    assert added == pytest.approx(muon_seconds(LLAMA3_8B, layout, 0, True, settings, cl, cost.EFF, cost._collective))
    # (the rest: the GEMMs' operands and the passes around them at the memory bandwidth, the launches)
    assert gemms < added < 1.3 * gemms and gemms > 1.0
    # high: TF32 at half the bf16 peak, fp32 operands; low: plain fp32
    high, low = (cost.step_time(LLAMA3_8B, layout, 8192, 64, cl, muon=MuonSettings(fp32_matmul_prec=p)) for p in PRECS)
    assert 2 * gemms < high.optimizer - plain.optimizer < 1.3 * 2 * gemms
    assert low.optimizer - plain.optimizer > 32 * layer / (cl.gpu.fp32_flops * cost.EFF.gemm)


PRECS = ("high", "low")


def test_the_optimizer_step_is_the_slowest_stages():
    """Llama-3-8B at PP4 over 9/8/8/7 layers: the last stage has the most compute (7 layers and the 128K-vocabulary
    output layer), the first steps the most (9 layers and the embeddings, by hand 9 x 218,112,000 + 128,256 x 4,096
    parameters: 28 bytes each with Adam) and runs the most Newton-Schulz (9 layers'). The optimizer step ends with
    the slowest stage, so that is the one priced (the compute-busiest was: 18% under with Adam, 22% with muon)."""

    def ns(m, n):
        return 5 * (4 * m * m * n + 2 * m**3)

    layer = 2 * ns(4096, 4096) + 2 * ns(1024, 4096) + ns(4096, 28672) + ns(4096, 14336)
    layout = Layout(pp=4, stages=(9, 8, 8, 7))
    cl = cluster("H100", 4, 1, None, None)
    bandwidth, launches = cl.gpu.memory_bandwidth * cost.EFF.memory, 10 * cl.gpu.launch_seconds
    traffic = 28 * (9 * 218_112_000 + 128_256 * 4096) / bandwidth
    assert cost.step_time(LLAMA3_8B, layout, 8192, 64, cl).optimizer == pytest.approx(traffic + launches)
    newton_schulz = cost.step_time(LLAMA3_8B, layout, 8192, 64, cl, muon=MuonSettings()).optimizer - traffic - launches
    gemms = 9 * layer / (cl.gpu.peak_flops * cost.EFF.gemm)  # (as test_llama3_8b_newton_schulz_is_priced_in_the_step)
    assert gemms < newton_schulz < 1.3 * gemms
