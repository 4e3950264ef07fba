"""Terms of the planner's cost and memory models held against what the runtime does: the collectives a step
issues (counted here on gloo), the group each gradient is reduced over, the rank that needs the most memory,
the link between pipeline stages, and the peak MFU is reported against."""

from __future__ import annotations

import collections
import dataclasses
import json

import pytest
import torch

from megatron_lite.config import LLAMA_ARCHITECTURE, ModelConfig
from megatron_lite.planner import cost
from megatron_lite.planner.hardware import ACCELERATORS, cluster
from megatron_lite.planner.layout import Layout
from megatron_lite.planner.memory import peak_rank_memory, rank_memory
from megatron_lite.planner.params import stage_params
from megatron_lite.planner.search import uneven_stages
from megatron_lite.training.flops import flops_per_token

from dist_pool import get_context
from models import hetero_config, llama_config, nemotron_h_config

SEQ = 32


def _llama(layers: int = 32, **kw) -> ModelConfig:
    return ModelConfig(
        num_layers=layers,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        vocab_size=32000,
        max_position_embeddings=8192,
        untie_embeddings_and_output_weights=True,
        kernel_impl="triton",
        **LLAMA_ARCHITECTURE,
        **kw,
    )


def _record_collectives(monkeypatch) -> tuple[list, object]:
    """(the (kind, bytes, group size) of every collective the cost model prices from now on, the real pricer)."""
    calls, real = [], cost._collective

    def record(kind, bytes_, size, span, cl_, eff):
        calls.append((kind, bytes_, size))
        return real(kind, bytes_, size, span, cl_, eff)

    monkeypatch.setattr(cost, "_collective", record)
    return calls, real


def test_peak_memory_is_that_of_the_heaviest_pipeline_rank():
    """An uneven split (3, 3, 4, ..., 4, 3 layers) makes rank 2 heavier than ranks 0, 1 and the last, the only
    ones looked at before: a layout that ran out of memory there was listed as fitting."""
    model = _llama(61)
    layout = Layout(pp=16, micro_batch_size=1, stages=uneven_stages(61, 16))
    every = [rank_memory(model, layout, 8192, 64, True, r).total for r in range(16)]
    rank, mem = peak_rank_memory(model, layout, 8192, 64, True)
    assert mem.total == max(every) and rank not in (0, 1, 15), (rank, every)


def test_expert_gradients_and_state_go_over_the_expert_data_parallel_group(monkeypatch):
    """At EP = DP = 8 each expert lives on one rank: its gradients need no reduction and its optimizer state is
    all local. The model had reduced them over all 8 ranks and stepped 1/8 of them."""
    model = _llama(32, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336)
    layout = Layout(pp=4, dp=8, ep=8, sharding="dist-opt", micro_batch_size=1)
    cl = cluster("H100", 8, 4, None, None)
    st = stage_params(model, layout, 3)  # the busiest stage: the last, with the output layer
    calls, real = _record_collectives(monkeypatch)
    t = cost.step_time(model, layout, 4096, 256, cl)
    reduced = {(b, size) for kind, b, size in calls if kind == "reduce_scatter"}
    assert reduced == {(4 * st.dense, 8), (4 * st.expert, 1)}, reduced
    local = st.dense / 8 + st.expert
    expected = 28 * local / (cl.gpu.memory_bandwidth * cost.EFF.memory) + 10 * cl.gpu.launch_seconds
    assert t.optimizer == pytest.approx(expected, rel=1e-12)


def _count(layout_kw: dict, moe: bool, hetero: bool = False, hybrid: bool = False) -> dict:
    """Collectives one step issues on this rank: TP all-gathers and reduce-scatters, EP all-to-all bytes
    (`hetero`: of models.hetero_config's layers; `hybrid`: of a hybrid Mamba model, MM*-M)."""
    import torch.distributed as dist

    from megatron_lite.planner.measure import measure_layout

    layout = Layout(**layout_kw)
    extra = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48) if moe else {}
    config = (hetero_config if hetero else llama_config)(num_layers=2 + 2 * hetero, kernel_impl="torch", **extra)
    if hybrid:
        config = nemotron_h_config(num_layers=5, hybrid_override_pattern="MM*-M", kernel_impl="torch", num_experts=None)
    ctx = get_context(layout.parallel_config())
    counts = collections.Counter()
    names = [n for n in ("all_gather_single", "reduce_scatter_single") if hasattr(dist, n)]
    names += ["all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_reduce"]
    real = {n: getattr(dist, n) for n in names}

    def wrap(name):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            if name == "all_to_all_single" and group is not None and group is ctx.ep.handle:
                t = args[1] if len(args) > 1 else kwargs["input"]
                if t.is_floating_point():
                    counts["ep_bytes"] += t.numel() * t.element_size()
            elif ctx.tp.size > 1 and group is ctx.tp.handle:
                counts["tp_reduce" if name == "all_reduce" else "tp"] += 1
            return real[name](*args, **kwargs)

        return call

    for n in names:
        setattr(dist, n, wrap(n))
    try:
        torch.set_num_threads(1)
        measure_layout(config, layout, SEQ, 2 * layout.dp, iters=0, ctx=ctx)
    finally:
        for n, f in real.items():
            setattr(dist, n, f)
    return dict(counts)


def _latency_only(cl):
    """A cluster where a collective costs its ring steps (one second each), whatever its size."""
    return dataclasses.replace(cl, link_latency=1.0, nvlink_bandwidth=float("inf"), network_bandwidth=float("inf"))


def test_recomputation_and_sequence_parallel_moe_cost_what_the_runtime_sends(dist):
    """Full recomputation runs each layer's TP collectives again, up to the last one its backward needs: the
    model charged none of them. Under SP every TP rank still routes the whole gathered sequence through the EP
    all-to-all: the model divided those bytes by TP."""
    cl = cluster("H100", 8, 1, None, None)
    llama = llama_config(num_layers=2, kernel_impl="torch")
    runtime, model = {}, {}
    # (and a script's --recompute-method: a uniform run of both layers is one checkpoint, whose last reduction
    # is not run again; block 1 reruns the first layer only. The planner took each as uniform 1.)
    recomputes = {
        "none": dict(recompute="none"),
        "full": dict(recompute="full"),
        "uniform2": dict(recompute="full", recompute_num_layers=2),
        "block1": dict(recompute="full", recompute_method="block"),
    }
    for rec, how in recomputes.items():
        kw = dict(tp=2, micro_batch_size=2, **how)
        runtime[rec] = dist(2, _count, kw, False)[0]["tp"]
        layout = Layout(**kw)
        model[rec] = cost.step_time(layout.model_config(llama), layout, SEQ, 2, _latency_only(cl), bf16=False).tp_comm
    assert runtime["uniform2"] > runtime["full"] > runtime["block1"] > runtime["none"], runtime
    # (at TP = 2 an all-gather or a reduce-scatter is one ring step)
    for rec in recomputes:
        assert model[rec] - model["none"] == runtime[rec] - runtime["none"], (rec, model, runtime)
    # and the forward that runs again is the recomputed layers' only: block 1 reruns one of the two
    seconds = {}
    for rec, how in recomputes.items():
        layout = Layout(micro_batch_size=2, **how)
        seconds[rec] = cost.step_time(layout.model_config(llama), layout, SEQ, 2, cl, bf16=False).compute
    assert seconds["full"] - seconds["none"] == pytest.approx(2 * (seconds["block1"] - seconds["none"]))

    moe = llama_config(num_layers=2, kernel_impl="torch", num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)
    sent, charged = {}, {}
    bandwidth_only = dataclasses.replace(cl, link_latency=0.0)
    # (and --expert-tensor-parallel-size 1 under TP 2: each TP rank sends its half of the gathered tokens, to EP
    # ranks one apart; the planner priced every layout at expert TP = TP)
    for case, kw in {
        "tp1": dict(tp=1, dp=4, ep=2),
        "tp2": dict(tp=2, dp=2, ep=2),
        "tp2-etp1": dict(tp=2, dp=2, ep=2, etp=1),
    }.items():
        kw = dict(kw, micro_batch_size=2)
        sent[case] = sum(r["ep_bytes"] for r in dist(4, _count, kw, True)) / 4
        layout = Layout(**kw)
        charged[case] = cost.step_time(
            layout.model_config(moe), layout, SEQ, 2 * kw["dp"], bandwidth_only, bf16=False
        ).ep_comm
    for case in ("tp2", "tp2-etp1"):
        assert charged[case] / charged["tp1"] == pytest.approx(sent[case] / sent["tp1"], rel=0.02), (charged, sent)


def test_pipeline_stages_inside_one_node_talk_over_nvlink():
    """TP2 x PP2 x DP2 on one node of 8: both stages' ranks share the node; the model priced the p2p over the
    network whatever the layout. Over two nodes a stage boundary crosses them."""
    layout = Layout(tp=2, pp=2, dp=2, micro_batch_size=1)
    model = _llama(32)
    one, two = cluster("H100", 8, 1, None, None), cluster("H100", 8, 2, None, None)
    send = 8192 * 4096 * 2 / 2  # a micro-batch's activations, their SP share
    micro = layout.micro_batches(64)
    nvlink = 2 * micro * (send / (one.nvlink_bandwidth * cost.EFF.comm) + one.link_latency)
    assert cost.step_time(model, layout, 8192, 64, one).pp_comm == pytest.approx(nvlink, rel=1e-9)
    wide = Layout(tp=2, pp=2, dp=4, micro_batch_size=1)
    network = 2 * wide.micro_batches(64) * (send / (two.network_bandwidth * cost.EFF.comm) + two.link_latency)
    assert cost.step_time(model, wide, 8192, 64, two).pp_comm == pytest.approx(network, rel=1e-9)


def test_mfu_on_the_96gb_h100_is_against_the_sxm_peak():
    """Timing takes the 500 W part's midpoint peak; MFU is reported against the SXM peak, as torchtitan does."""
    cl = cluster("H100-96GB", 8, 1, None, None)
    model = _llama(32)
    layout = Layout(dp=8, micro_batch_size=1)
    t = cost.step_time(model, layout, 8192, 64, cl)
    tps, tflops, mfu = cost.throughput(model, layout, 8192, 64, t, cl)
    assert mfu == pytest.approx(tflops * 1e12 / 989.4e12, rel=1e-12)
    assert ACCELERATORS["H100-96GB"].peak_flops < 989.4e12
    assert tflops * 1e12 == pytest.approx(flops_per_token(model, 8192, causal=False) * tps, rel=1e-12)


def test_selective_recomputation_costs_what_its_modules_run_again():
    """--recompute-modules mlp runs each dense MLP's forward again: one MLP forward a layer more (the GEMMs of
    fc1 and fc2 at the model's sizes); without core_attn the attention is not run again."""
    cl = cluster("H100", 8, 1, None, None)
    layout = Layout(dp=8, micro_batch_size=1, recompute="selective")

    def compute(*modules: str) -> float:
        return cost.step_time(_llama(32, recompute_modules=modules), layout, 4096, 64, cl).compute

    none = cost.step_time(_llama(32), dataclasses.replace(layout, recompute="none"), 4096, 64, cl).compute
    m = 4096  # tokens of a micro-batch
    mlp = cost._gemm(m, 4096, 2 * 14336, 2, cl, cost.EFF) + cost._gemm(m, 14336, 4096, 2, cl, cost.EFF)
    micro = 64 // 8
    assert compute("layernorm") == pytest.approx(none, rel=1e-12)
    assert compute("core_attn", "mlp") - compute("core_attn") == pytest.approx(32 * micro * mlp, rel=1e-9)


def test_experts_are_reduced_over_expert_data_parallelism_without_dp():
    """(From a review: at TP 4, DP 1, EP 2 and expert TP 1 the experts' gradients are all-reduced over an
    expert-data-parallel group of 2, and the planner priced no data-parallel communication at DP x CP = 1.)"""
    moe = _llama(2, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=1024)
    cl = cluster("H100", 8, 1, None, None)
    layout = Layout(tp=4, ep=2, etp=1, overlap_grad_reduce=False)
    assert layout.edp == 2
    expert = stage_params(moe, layout, 0).expert
    want = cost._collective("all_reduce", 4 * expert, 2, 4, cl, cost.EFF)
    assert cost.step_time(moe, layout, 4096, 16, cl, bf16=True).dp_comm == pytest.approx(want)


def test_expert_parallelism_moves_fewer_expert_weights():
    """A rank's grouped GEMM reads the weights of each of its experts: E / EP of them. The model charged one
    expert's weights whatever EP, so EP never sped the experts' GEMMs up. The saving is the bytes of the expert
    weights this rank no longer holds (counted by the memory model, held against the built model elsewhere),
    read once in the forward and twice in the backward, each micro-batch."""
    moe = _llama(2, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336)
    cl = cluster("H100", 8, 1, None, None)
    no_flops = dataclasses.replace(cl, gpu=dataclasses.replace(cl.gpu, peak_flops=float("inf")))
    compute, weights = {}, {}
    for ep in (1, 4):
        layout = Layout(dp=8, ep=ep)
        compute[ep] = cost.step_time(moe, layout, 4096, 16, no_flops).compute
        weights[ep] = stage_params(moe, layout, 0).expert
    micro, eff = 2, cost.EFF
    saved = 3 * micro * 2 * (weights[1] - weights[4]) / (cl.gpu.memory_bandwidth * eff.memory)
    assert compute[1] - compute[4] == pytest.approx(saved, rel=1e-9), (compute, saved)


def test_a_reduction_the_job_does_not_overlap_is_all_exposed():
    """From the planner review: a script without --overlap-grad-reduce (Megatron's default) reduces its gradients
    after the backward and, without --overlap-param-gather, gathers the updated weights after the step; the
    planner priced every job as overlapped."""
    cl = cluster("H100", 8, 2, None, None)
    model = _llama(8)
    st = stage_params(model, Layout(dp=16), 0)
    reduce = cost._collective("all_reduce", 4 * st.total, 16, 16, cl, cost.EFF)
    on, off = (cost.step_time(model, Layout(dp=16, overlap_grad_reduce=o), 4096, 32, cl) for o in (None, False))
    assert on.dp_comm < 0.5 * reduce and off.dp_comm == pytest.approx(reduce, rel=1e-12)
    gather = cost._collective("all_gather", 2 * st.total, 16, 16, cl, cost.EFF)
    zero1 = [
        cost.step_time(model, Layout(dp=16, sharding="dist-opt", overlap_param_gather=o), 4096, 32, cl).dp_comm
        for o in (None, False)
    ]
    # (the search's ZeRO-1 hides most of its gather under the first forward)
    assert zero1[1] - zero1[0] > 0.5 * gather


def _priced_flops(model: ModelConfig, layout: Layout, seq: int) -> float:
    """The cost model's compute of one micro-batch of one sequence on an accelerator of 1 TFLOP/s with memory and
    launches free: its FLOPs."""
    gpu = dataclasses.replace(ACCELERATORS["H100"], peak_flops=1e12, memory_bandwidth=1e30, launch_seconds=0.0)
    cl = dataclasses.replace(cluster("H100", 8, 1, None, None), gpu=dataclasses.replace(gpu, measured=True))
    return cost.step_time(model, layout, seq, layout.dp, cl, bf16=False).compute * 1e12


def test_a_heterogeneous_models_flops_are_the_training_loops():
    """Each heterogeneous layer is timed at its own query groups and FFN size, a linear replacement as its one
    [hidden, hidden] GEMM, a no-op as nothing: the cost model's FLOPs of a step are the training loop's counter
    (flops_per_token), but for the flash backward's 2.5x the causal attention forward (the counter's 2x), which is
    attention's 2 s q per token in each attending layer, worked out by hand. The busiest pipeline stage sets the
    pace: with the attending layers all on the first stage, the first's FLOPs are those of a model of its layers
    alone, less the output layer."""
    from megatron_lite.models.heterogeneous import NORMAL

    from models import hetero_json

    seq = 64
    model = hetero_config(num_layers=8, vocab_size=256)
    q = model.num_attention_heads * model.head_dim
    attending = sum(b.attention == NORMAL for b in model.heterogeneous_blocks)
    flash_extra = 0.5 * attending * 2 * seq * q * seq
    assert _priced_flops(model, Layout(), seq) == pytest.approx(flops_per_token(model, seq) * seq + flash_extra)

    full = json.loads(model.heterogeneous_layers_config_encoded_json)["block_configs"]
    identity = {"attention": {"no_op": True}, "ffn": {"no_op": True}}
    first = [b for b in full if b["attention"].get("replace_with_linear") is not True][:4]
    staged = llama_config(num_layers=8, vocab_size=256, heterogeneous_layers_config_encoded_json=hetero_json(
        first + [identity] * 4))  # fmt: skip
    alone = llama_config(num_layers=4, vocab_size=256, heterogeneous_layers_config_encoded_json=hetero_json(first))
    h = model.hidden_size
    attending = sum(b.attention == NORMAL for b in alone.heterogeneous_blocks)
    expected = (flops_per_token(alone, seq) - 3 * 2 * h * 256) * seq + 0.5 * attending * 2 * seq * q * seq
    assert _priced_flops(staged, Layout(pp=2), seq) == pytest.approx(expected)


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_heterogeneous_layers_cost_the_tp_collectives_they_send(dist, sp):
    """A heterogeneous layer's TP collectives are its parts': a normal part's gather and reduce-scatter (under SP)
    and their backward twins, a linear replacement's gathers of its input and output, a no-op none; full
    recomputation runs the forward's again. Counted on gloo against a plain model's (the same edges): the model
    charged every layer a full layer's."""
    cl = _latency_only(cluster("H100", 8, 1, None, None))
    for how in (dict(recompute="none"), dict(recompute="full")):
        kw = dict(tp=2, micro_batch_size=2, sequence_parallel=sp, **how)
        counts = [dist(2, _count, kw, False, hetero)[0] for hetero in (False, True)]
        # (at TP = 2 an all-gather or a reduce-scatter is one ring step, an all-reduce two)
        runtime = [c.get("tp", 0) + 2 * c.get("tp_reduce", 0) for c in counts]
        layout = Layout(**kw)
        models = (llama_config(num_layers=2), hetero_config(num_layers=4))
        charged = [cost.step_time(layout.model_config(m), layout, SEQ, 2, cl, bf16=False).tp_comm for m in models]
        assert charged[1] - charged[0] == runtime[1] - runtime[0], (how, charged, runtime)


def _dist_muon_gathers(dp: int) -> list[int]:
    """Bytes of each all-gather (its output) one --optimizer dist_muon step issues over the data-parallel group."""
    import torch.distributed as dist

    from megatron_lite.planner.measure import measure_layout

    layout = Layout(dp=dp, sharding="layer-wise", micro_batch_size=2)
    ctx = get_context(layout.parallel_config())
    gathered = []
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    real = getattr(dist, name)

    def call(output, input, group=None, async_op=False):
        if group is ctx.dp_cp.handle:
            gathered.append(output.numel() * output.element_size())
        return real(output, input, group=group, async_op=async_op)

    setattr(dist, name, call)
    try:
        torch.set_num_threads(1)
        measure_layout(llama_config(num_layers=4, vocab_size=2048, kernel_impl="torch"), layout, SEQ, 2 * dp,
                       iters=0, ctx=ctx, optimizer="dist_muon")  # fmt: skip
    finally:
        setattr(dist, name, real)
    return gathered


@pytest.mark.parametrize("dp", [2, 4])
def test_dist_muon_costs_the_gradient_all_reduce_and_the_weights_all_gather(dist, monkeypatch, dp):
    """dist_muon all-reduces the gradients whole (as DDP does) and after the step all-gathers each rank's updated
    tensors, flattened and padded to the largest rank's: the cost model prices that all-reduce and the gathers of
    the bytes the runtime sends (counted on gloo; the output layer alone is the largest rank's at DP=4), exposed
    after the step, and steps the busiest rank's tensors. It priced dist_muon's layouts as DDP's, with neither
    the gather nor the split step."""
    model = llama_config(num_layers=4, vocab_size=2048, kernel_impl="torch")
    layout = Layout(dp=dp, sharding="layer-wise", micro_batch_size=2)
    calls, real = _record_collectives(monkeypatch)
    cl = cluster("H100", 8, 1, None, None)
    t = cost.step_time(model, layout, SEQ, 2 * dp, cl, bf16=False)
    monkeypatch.setattr(cost, "_collective", real)
    st = stage_params(model, layout, 0)
    assert [(b, size) for kind, b, size in calls if kind == "all_reduce" and size == dp and b] == [(4 * st.dense, dp)]
    priced = [b for kind, b, size in calls if kind == "all_gather" and size == dp and b]
    assert priced == dist(dp, _dist_muon_gathers, dp)[0]
    ddp = cost.step_time(model, dataclasses.replace(layout, sharding="none"), SEQ, 2 * dp, cl, bf16=False)
    gather = cost._collective("all_gather", priced[0], dp, dp, cl, cost.EFF)
    assert t.dp_comm - ddp.dp_comm == pytest.approx(gather)  # (all of it exposed: the next forward waits)
    assert t.optimizer < ddp.optimizer


def test_heterogeneous_layers_gather_their_own_keys_and_values_over_cp(monkeypatch):
    """Under --cp-comm-type allgather each attending layer gathers its own keys and values: by hand, models'
    HETERO_BLOCKS (head dim 8) gather 4 query groups (32 values a token) in layer 0 and 2 (16) in layer 3, of K and V
    each, over the 2 x 16 tokens of a micro-batch, fp32; the linear and no-op attentions of layers 1 and 2 gather
    none. (Every layer gathered the model's 4 groups.)"""
    model = hetero_config(num_layers=4)
    layout = Layout(cp=2, cp_comm_type="allgather", micro_batch_size=1)
    calls, real = _record_collectives(monkeypatch)
    cost.step_time(model, layout, SEQ, 1, cluster("H100", 8, 1, None, None), bf16=False)
    gathered = sorted(b for kind, b, size in calls if kind == "all_gather" and size == 2 and b)
    assert gathered == sorted([2 * 16 * 32 * 4] * 2 + [2 * 16 * 16 * 4] * 2), gathered
