"""The planner and the dry run on hybrid Mamba models (--hybrid-override-pattern; planner/hybrid.py): parameters
equal to the built model's, memory per rank within 10% of the measured breakdown per component at TP=1, TP=2 with
and without SP and PP=2, FLOPs equal to the training loop's counter, TP collectives as the runtime sends them, the
dry run's activations and a NemotronH config.json planned. The planner refused these models, and the dry run
printed "activations not estimated"."""

from __future__ import annotations

import pytest
import torch
from test_cli_dry_run import _priced_and_measured
from test_planner_costs import _count, _latency_only, _priced_flops

from megatron_lite.planner import cost
from megatron_lite.planner.hardware import cluster
from megatron_lite.planner.layout import Layout
from megatron_lite.planner.memory import rank_memory
from megatron_lite.training.flops import flops_per_token

from dist_pool import get_context
from models import DEVICE, llama_config, nemotron_h_config

GBS = 4


def _hybrid(pattern: str = "M*-E", **kw):
    """Nemotron-H-shaped (tests/models.py): 16 Mamba heads of 8 in 2 groups of state 8, attention, a dense MLP and
    a MoE layer, each its own residual block."""
    return nemotron_h_config(num_layers=len(pattern), hybrid_override_pattern=pattern, **{"kernel_impl": "torch", **kw})


@pytest.mark.parametrize(
    "pattern,layout",
    [("M*-E", Layout(tp=2)), ("MM*-E-M*", Layout(pp=2, vp=2, ep=2, dp=2)), ("M*-EM*-E", Layout(pp=4))],
)
def test_parameter_counts_equal_the_built_model(pattern, layout):
    """Each layer its own kind: a Mamba layer's norm, in_proj, conv, dt_bias, A_log, D, gated norm and out_proj
    (heads and groups split over TP), an attention, MLP or MoE layer's one part with its norm (every layer was
    priced as a whole transformer layer: 1.3x the weights of M*-E, 0.9x on a pipeline stage of Mamba layers)."""
    from test_planner import assert_counts_of_the_built_model

    assert_counts_of_the_built_model(_hybrid(pattern, normalization="LayerNorm"), layout)  # (the norms' biases too)


def _measure(
    pattern: str, layout: Layout, seq: int, bf16: bool = False, kernels: str = "torch", optimizer: str = "adam"
) -> dict:
    import torch.distributed as dist

    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.planner.measure import measure_layout

    parallel = layout.parallel_config()
    if dist.is_initialized():
        ctx = get_context(parallel)
    else:  # the Triton kernels run on a GPU where there is one, else through the CPU's interpreter
        ctx = ParallelContext.virtual(parallel, device=DEVICE if kernels == "triton" else torch.device("cpu"))
    torch.set_num_threads(1)
    config = _hybrid(pattern, kernel_impl=kernels)
    return measure_layout(config, layout, seq, GBS, iters=0, ctx=ctx, bf16=bf16, optimizer=optimizer)


CASES = {
    "one": ("M*-E", Layout(micro_batch_size=2), 32),
    # (one sequence of one chunk: the scan's GEMM reads x in place)
    "one-mbs1": ("M*-E", Layout(micro_batch_size=1), 32),
    "one-bf16": ("MM*-", Layout(micro_batch_size=2), 32),
    # 160 tokens: two chunks of 128, the second padded, the state carried between them
    "one-seq160": ("M*-E", Layout(micro_batch_size=2), 160),
    "one-full": ("M*-E", Layout(micro_batch_size=2, recompute="full"), 32),
    # (the planner's default kernels: their norms keep their input and statistics; the mixer is PyTorch's still)
    "one-triton": ("M*-E", Layout(micro_batch_size=2), 32),
    "tp2-sp": ("M*-E", Layout(tp=2, micro_batch_size=2), 32),
    "tp2-no-sp": ("M*-E", Layout(tp=2, micro_batch_size=2, sequence_parallel=False), 32),
    "pp2": ("MM*-", Layout(pp=2, micro_batch_size=1), 32),  # (stages unequal: two Mamba layers, then * and -)
}


@pytest.mark.parametrize("case", list(CASES))
def test_memory_estimate_within_ten_percent(dist, case):
    """Weights, gradients, optimizer state and activations of every rank within 10% of --log-memory-breakdown's
    measured bytes: the mixer's saved in_proj output, conv output, scan intermediates (per padded step, per chunk)
    and gated norm, divided over TP by heads and groups, its in_proj input gathered under SP; full recomputation
    keeps each layer's input."""
    pattern, layout, seq = CASES[case]
    bf16, kernels = case.endswith("bf16"), "triton" if case.endswith("triton") else "torch"
    one = layout.world == 1
    results = [_measure(pattern, layout, seq, bf16, kernels)] if one else dist(layout.world, _measure, *CASES[case])
    config = layout.model_config(_hybrid(pattern, kernel_impl=kernels))
    for r in results:
        est = rank_memory(config, layout, seq, GBS, bf16, r["pp_rank"]).as_dict()
        for key, measured in r["memory"].items():
            assert abs(est[key] - measured) <= 0.10 * measured, (case, r["pp_rank"], key, est[key], measured)


def _executed_scan_flops(model, seq: int) -> float:
    """FLOPs per token that models/mamba.py's ssd_scan runs, forward and backward (PyTorch's FlopCounterMode, one
    sequence of `seq`, every head): the oracle of the planner's scan_flops."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_lite.models.mamba import ssd_scan

    heads, p, groups, n = model.mamba_heads, model.mamba_head_dim, model.mamba_num_groups, model.mamba_state_dim
    g = torch.Generator().manual_seed(0)
    x, B, C = (
        torch.randn(1, seq, k, d, generator=g).requires_grad_() for k, d in ((heads, p), (groups, n), (groups, n))
    )
    dt = torch.rand(1, seq, heads, generator=g).requires_grad_()
    with FlopCounterMode(display=False) as counter:
        ssd_scan(x, dt, -torch.rand(heads, generator=g), B, C).sum().backward()
    return counter.get_total_flops() / seq


@pytest.mark.parametrize("seq,n", [(64, 8), (160, 16), (128, 4)], ids=["one-chunk", "padded", "whole-chunk"])
def test_the_scans_priced_flops_are_what_it_executes(seq, n):
    """The chunked scan runs about 2 L N + 2 L P + 4 P N FLOPs per head and token (L steps a chunk, the padded steps
    too), not Megatron's 7 d N (3.4x at N = 16): the planner's forward figure times 3 is FlopCounterMode's count."""
    from megatron_lite.planner.hybrid import scan_flops

    model = _hybrid("M", mamba_state_dim=n)
    assert 3 * scan_flops(model, seq) == pytest.approx(_executed_scan_flops(model, seq), rel=1e-9)


def test_the_scan_is_timed_at_the_fp32_rate():
    """models/mamba.py scans in fp32 PyTorch: on an H100 the scan's executed FLOPs take their time at its fp32 rate
    (67 TFLOP/s, NVIDIA's H100 SXM datasheet; not its 989 TFLOP/s bf16 tensor peak), at the attention's efficiency,
    the rest of the mixer's compute its two projections' GEMMs. At TP=2 each rank scans half the heads."""
    seq, cl, impl = 256, cluster("H100", 8, 1, None, None), cost.IMPLEMENTATIONS["torch"]
    for tp in (1, 2):
        model, layout = Layout(tp=tp).model_config(_hybrid("M*")), Layout(tp=tp)
        compute = cost._mixer_terms(model, layout, seq, 2, cl, cost.EFF, impl)[0]
        h, d, gn, heads = model.hidden_size, 16 * 8 // tp, 2 * 8 // tp, 16 // tp
        gemms = cost._gemm(seq, h, 2 * d + 2 * gn + heads, 2, cl, cost.EFF) + cost._gemm(seq, d, h, 2, cl, cost.EFF)
        scan = seq * _executed_scan_flops(model, seq) / 3 / tp / (67e12 * cost.EFF.attention)
        assert compute - gemms == pytest.approx(scan, rel=1e-6)


def test_flops_are_the_training_loops():
    """A Mamba layer's in_proj and out_proj GEMMs are the training loop's FLOPs counter (flops_per_token), but for
    its scan, timed at the FLOPs the chunked scan executes (FlopCounterMode's) where the counter takes Megatron's
    7 d N, and the flash backward's 2.5x of the attention layers' causal forward (the counter's 2x: 2 s q per token
    each), worked out by hand; at TP=2 half of them, but the router's (every TP rank routes). At PP=2 the busiest
    stage sets the pace: here the first, whose FLOPs are a model's of its layers alone less the output layer."""
    from megatron_lite.training.flops import mamba_scan_flops

    seq = 64
    model = _hybrid("M*-EM*-E", vocab_size=256)
    q, h = model.num_attention_heads * model.head_dim, model.hidden_size
    flash_extra = 0.5 * 2 * 2 * seq * q * seq  # (two attention layers)
    scan_extra = (_executed_scan_flops(model, seq) - 3 * mamba_scan_flops(model)) * seq  # (a Mamba layer's)
    priced = _priced_flops(model, Layout(), seq)
    assert priced == pytest.approx(flops_per_token(model, seq) * seq + flash_extra + 2 * scan_extra)
    router = 3 * 2 * h * model.num_experts * seq * 2  # (two MoE layers)
    tp2 = _priced_flops(Layout(tp=2).model_config(model), Layout(tp=2), seq)
    assert tp2 == pytest.approx((priced - router) / 2 + router)

    staged, alone = _hybrid("MM*M----", vocab_size=256), _hybrid("MM*M", vocab_size=256)
    expected = (flops_per_token(alone, seq) - 3 * 2 * h * 256) * seq + 0.5 * 2 * seq * q * seq + 3 * scan_extra
    assert _priced_flops(staged, Layout(pp=2), seq) == pytest.approx(expected)


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_mamba_layers_cost_the_tp_collectives_they_send(dist, sp):
    """A Mamba layer's TP collectives are one part's: in_proj's gathered input (and its gradient's reduce-scatter)
    and out_proj's reduce-scatter (and its gradient's gather) under SP, an all-reduce forward and backward without;
    full recomputation runs the forward's again. Counted on gloo against a plain model's (the same edges): the
    model charged each layer a whole transformer layer's."""
    cl = _latency_only(cluster("H100", 8, 1, None, None))
    for how in (dict(recompute="none"), dict(recompute="full")):
        kw = dict(tp=2, micro_batch_size=2, sequence_parallel=sp, **how)
        counts = [dist(2, _count, kw, False, False, hybrid)[0] for hybrid in (False, True)]
        runtime = [c.get("tp", 0) + 2 * c.get("tp_reduce", 0) for c in counts]
        layout = Layout(**kw)
        models = (llama_config(num_layers=2), _hybrid("MM*-M", num_experts=None))
        charged = [cost.step_time(layout.model_config(m), layout, 32, 2, cl, bf16=False).tp_comm for m in models]
        assert charged[1] - charged[0] == runtime[1] - runtime[0], (how, charged, runtime)


HYBRID_FLAGS = (
    "--hybrid-override-pattern M*-M --num-layers 4 --mamba-state-dim 8 --mamba-head-dim 8 --mamba-num-groups 2 "
    "--position-embedding-type none --normalization RMSNorm --swiglu --disable-bias-linear --seq-length 160 "
    "--max-position-embeddings 160"
)


FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"


@pytest.mark.parametrize("flags", ["", FULL], ids=["none", "full-recompute"])
def test_the_dry_runs_activations_are_what_the_run_saves(tmp_path, capsys, monkeypatch, flags):
    """--dry-run prints a hybrid model's activations (it printed "activations not estimated"): within 5% of what
    the activation meter measures in a real iteration (hidden dropout on: a CPU's masks in the activations'
    dtype)."""
    argv = ["--hidden-size", "64", "--num-attention-heads", "4", "--mock-data", "--vocab-size", "512",
            "--attention-dropout", "0", *HYBRID_FLAGS.split(), *flags.split()]  # fmt: skip
    fixtures = (tmp_path, capsys, monkeypatch)
    predicted, mem = _priced_and_measured(argv, r"~(\d+) B activations at the schedule's peak", *fixtures)
    assert abs(predicted / mem["mem_activations_bytes"] - 1) < 0.05, (predicted, mem["mem_activations_bytes"])


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_muon_state_is_the_runtimes(bf16):
    """--optimizer muon steps the 2-D weights with Muon (4 bytes of momentum) and the rest with Adam (8): the
    runtime's rule (optimizer.runs_muon), so a Mamba mixer's 3-D conv weight, its conv bias, dt_bias, A_log, D and
    gated norm and every norm take Adam's, which the planner priced at Muon's 4. The optimizer bytes equal what
    --log-memory-breakdown measures after a step of MM*- (0.985x before)."""
    from megatron_lite.planner.memory import MuonStateBytes

    model, layout = _hybrid("MM*-"), Layout(micro_batch_size=1)
    measured = _measure("MM*-", layout, 32, bf16, optimizer="muon")["memory"]
    priced = rank_memory(model, layout, 32, GBS, bf16, 0, state_bytes=MuonStateBytes(model))
    assert priced.as_dict()["mem_optimizer_bytes"] == pytest.approx(measured["mem_optimizer_bytes"], rel=1e-9)


LORA = "--lora-rank 4 --position-embedding-type rope --lora-target-modules q_proj v_proj"


@pytest.mark.parametrize(
    "flags",
    [
        f"{LORA} --hybrid-override-pattern=*-*-",
        f"{LORA} --hybrid-override-pattern=--*- --lora-dropout 0.1",
        f"{LORA} up_proj --hybrid-override-pattern=-*-* --lora-dropout 0.1",
    ],
    ids=["*-*-", "--*-", "-*-*-fc1"],
)
def test_the_dry_run_prices_lora_on_layers_of_one_part(tmp_path, capsys, monkeypatch, flags):
    """LoRA on a hybrid model without Mamba layers: an attention layer (`*`) has no MLP linears to freeze or adapt,
    an MLP layer (`-`) no attention linears; the layers before the first adapted one save nothing (their input,
    the frozen embedding's, needs no gradient), and that one's norm nothing, nor the dropout mask of its first
    part's adapters (fc1's in `-*-*` with up_proj adapted too). Within 5% of the meter (0.83x and 1.37x before)."""
    argv = ["--hidden-size", "64", "--num-attention-heads", "4", "--mock-data", "--vocab-size", "512",
            "--attention-dropout", "0", *HYBRID_FLAGS.split(), *flags.split()]  # fmt: skip
    predicted, mem = _priced_and_measured(
        argv, r"~(\d+) B activations at the schedule's peak", tmp_path, capsys, monkeypatch
    )
    assert abs(predicted / mem["mem_activations_bytes"] - 1) < 0.05, (predicted, mem["mem_activations_bytes"])


def test_plan_of_a_nemotron_h_config(tmp_path, capsys):
    """A NemotronH config.json (models/hf_nemotron_h.py) is planned: the parameter count printed is the built
    model's, its pattern and mixer sizes are said, and the layouts are those its Mamba heads and groups allow (TP
    divides the 8 groups and 2 key-value groups: 1 or 2) without context parallelism (the scan is not split
    along the sequence). It was refused."""
    transformers = pytest.importorskip("transformers")
    from test_planner import _tool

    from megatron_lite.checkpoint.hf_convert import load_hf_config
    from megatron_lite.config import ParallelConfig
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.models.hf import config_from_hf
    from megatron_lite.parallel_context import ParallelContext

    transformers.NemotronHConfig(
        vocab_size=32000, hidden_size=1024, hybrid_override_pattern="M*-M*-ME", num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, intermediate_size=4096, ssm_state_size=128, mamba_num_heads=32,
        mamba_head_dim=64, n_groups=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=1024,
        moe_shared_expert_intermediate_size=1024, max_position_embeddings=4096,
    ).save_pretrained(tmp_path)  # fmt: skip
    argv = ["--hf-config", str(tmp_path / "config.json"), "--seq-length", "4096", "--global-batch-size", "16"]
    result = _tool().main([*argv, "--gpu", "H100", "--top", "1000"])
    out = capsys.readouterr().out
    model = config_from_hf(load_hf_config(str(tmp_path))[0])
    built = sum(
        p.numel()
        for p in build_model(model, ParallelContext.virtual(ParallelConfig(), 1, 0), device="meta").parameters()
    )
    assert f"model: {built / 1e6:.1f}M parameters," in out, (built, out.splitlines()[0])
    assert "hybrid layers M*-M*-ME (Mamba: 32 heads of 64, 8 groups, state 128)" in out
    fits = result["fits"]
    assert fits and {f["layout"]["tp"] for f in fits} == {1, 2} and {f["layout"]["cp"] for f in fits} == {1}
    assert all(f["memory"]["activations"] > 0 for f in fits)
