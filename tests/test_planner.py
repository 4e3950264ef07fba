"""The parallelism planner (megatron_lite/planner, tools/plan_parallelism.py): its parameter counts equal the
built model's at every layout, its memory estimate is within 10% of the measured breakdown per component
for the layouts the equivalence tests run, its search refuses what our validation refuses, and the command
line plans a shipped script and a Hugging Face config."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import pathlib

import head_start
import pytest
import torch

from megatron_lite.planner.layout import Layout
from megatron_lite.planner.memory import rank_memory
from megatron_lite.planner.params import layer_params, stage_params

from dist_pool import get_context
from models import DEVICE, decilm_block, deepseek_config, gpt2_config, hetero_config, hetero_json, llama_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEQ, GBS = 32, 8


def moe_llama(**kw):
    return llama_config(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, **kw)


MODELS = {
    "llama": llama_config,
    "gpt2": gpt2_config,
    "moe": moe_llama,
    "qk_layernorm": lambda **kw: gpt2_config(qk_layernorm=True, **kw),  # LayerNorm q/k norms: weight and bias
    "deepseek": deepseek_config,  # multi-latent attention, sigmoid-routed MoE with a shared expert
    "deepseekmtp": lambda **kw: deepseek_config(mtp_num_layers=2, **kw),  # and two multi-token-prediction depths
    "mla": lambda **kw: deepseek_config(num_experts=None, moe_layer_freq=1, **kw),  # its attention, dense MLPs
    "llamatiedmtp": lambda **kw: llama_config(untie_embeddings_and_output_weights=False, mtp_num_layers=1, **kw),
    # gpt-oss's MLP: biased router and experts (each expert-TP rank holds fc2's whole bias), quick-GEGLU
    "gptossmlp": lambda **kw: moe_llama(add_bias_linear=True, activation="quick_geglu", **kw),
    "learnable": lambda **kw: llama_config(softmax_type="learnable", **kw),  # an fp32 offset a head (split over TP)
    # heterogeneous layers: their own query groups and FFN sizes, linear replacements, no-op parts
    "hetero": hetero_config,
    "hetero_bias": lambda **kw: hetero_config(add_bias_linear=True, **kw),  # (a linear replacement's bias: split)
    "llama_vocab": lambda **kw: llama_config(vocab_size=2048, **kw),  # (the vocabulary's tensors the largest)
    # six heterogeneous layers, the middle two identities (no-op attention and MLP): at PP=3 a stage of them alone
    "hetero_identity_stage": lambda **kw: llama_config(
        **{**kw, "num_layers": 6},
        heterogeneous_layers_config_encoded_json=hetero_json(
            [decilm_block("normal", 2, "normal", ffn_hidden_size=64), decilm_block("linear", None, "normal")]
            + [decilm_block("no_op", None, "no_op")] * 2
            + [decilm_block("normal", 4, "no_op"), decilm_block("no_op", None, "linear")]
        ),
    ),
}


def _recomputing(base: str, modules: tuple[str, ...]):
    return lambda **kw: MODELS[base](recompute_modules=modules, **kw)


# --recompute-modules under selective recomputation: "model/module+module"
SELECTIVE = [
    "llama/layernorm", "llama/mlp", "llama/core_attn+layernorm+mlp", "gpt2/layernorm", "moe/moe", "moe/moe_act",
    "moe/layernorm", "deepseek/shared_experts", "deepseek/mla_up_proj", "deepseek/mla_up_proj+core_attn",
    "mla/mla_up_proj", "deepseek/core_attn+layernorm+moe_act+shared_experts+mla_up_proj",
]  # fmt: skip
for _key in SELECTIVE:
    MODELS[_key] = _recomputing(_key.split("/")[0], tuple(_key.split("/")[1].split("+")))


LLAMA3_8B_TOP1 = ["--script", str(ROOT / "pretrain" / "llama3_8b.sh"), "--top", "1"]  # (its plan's best layout)


def _tool():
    spec = importlib.util.spec_from_file_location("plan_parallelism", ROOT / "tools" / "plan_parallelism.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def plans(*argvs: list[str]) -> list[dict]:
    """tools/plan_parallelism.py's main on each argv in turn (for a head start of a test's plans,
    tests/head_start.py): its value, what it printed to stdout and stderr, and its exit's code or message where
    it refused (None where it planned)."""
    tool, out = _tool(), []
    for argv in argvs:
        printed, said, value, refused = io.StringIO(), io.StringIO(), None, None
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(said):
            try:
                value = tool.main(argv)
            except SystemExit as e:
                refused = e.code if isinstance(e.code, int) else str(e.code)
        out.append({"value": value, "out": printed.getvalue(), "err": said.getvalue(), "exit": refused})
    return out


@pytest.mark.parametrize(
    "name,layout",
    [
        ("llama", Layout(tp=4)),
        ("gpt2", Layout(pp=2)),  # tied embeddings: the last stage holds a copy
        ("gpt2", Layout(tp=2, pp=2, vp=2)),
        ("llama", Layout(pp=4)),
        ("moe", Layout(tp=2, ep=2, dp=2)),
        ("moe", Layout(ep=4, dp=4, pp=2)),
        ("qk_layernorm", Layout(tp=2, pp=2)),
        ("deepseek", Layout(tp=2, ep=2, dp=2)),
        ("deepseek", Layout(pp=2, dp=2)),
        ("deepseekmtp", Layout(tp=2, ep=2, dp=2)),
        ("deepseekmtp", Layout(pp=2, dp=2)),  # the last stage's copy of the word embeddings
        ("llamatiedmtp", Layout(pp=2)),
        ("gptossmlp", Layout(tp=2, ep=2, dp=2)),
        # --expert-tensor-parallel-size 1 under TP: whole experts, E / EP a rank (the planner split them by TP)
        ("moe", Layout(tp=2, ep=2, dp=2, etp=1)),
        ("deepseek", Layout(tp=2, ep=4, dp=2, etp=1)),
        ("learnable", Layout(tp=2, pp=2)),
        ("hetero", Layout(tp=2)),
        ("hetero", Layout(pp=4)),  # (stages of unequal weights)
        ("hetero_bias", Layout(tp=2, pp=2, vp=2)),
    ],
)
def test_parameter_counts_equal_the_built_model(name, layout):
    assert_counts_of_the_built_model(MODELS[name](num_layers=8), layout)


def assert_counts_of_the_built_model(config, layout: Layout) -> None:
    """planner.params' dense and expert parameters of each rank equal those of the model built on meta there."""
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    for rank in range(layout.world):
        ctx = ParallelContext.virtual(layout.parallel_config(), layout.world, rank)
        chunks = build_model(config, ctx, device="meta")
        expert = sum(p.numel() for n, p in chunks.named_parameters() if ".experts." in n)
        counts = stage_params(config, layout, ctx.pp.rank)
        assert (counts.dense, counts.expert) == (sum(p.numel() for p in chunks.parameters()) - expert, expert)


def measure(
    name: str,
    layout: Layout,
    kernel_impl: str = "torch",
    bf16: bool = False,
    grads_bf16: bool = False,
    optimizer: str = "adam",
    iters: int = 1,
    gbs: int = GBS,
) -> dict:
    import torch.distributed as dist

    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.planner.measure import measure_layout

    config = MODELS[name](num_layers=4, kernel_impl=kernel_impl)
    parallel = layout.parallel_config()
    if dist.is_initialized():
        ctx = get_context(parallel)
    else:  # the Triton kernels run on a GPU where there is one, else through the CPU's interpreter
        ctx = ParallelContext.virtual(parallel, device=DEVICE if kernel_impl == "triton" else torch.device("cpu"))
    return measure_layout(
        config, layout, SEQ, gbs, iters=iters, ctx=ctx, bf16=bf16, grads_bf16=grads_bf16, optimizer=optimizer
    )


def _check(
    name: str,
    layout: Layout,
    results: list[dict],
    kernel_impl: str = "torch",
    skip=(),
    bf16=False,
    grads_bf16=False,
    state_bytes=8,
    tol: float = 0.10,
) -> None:
    config = layout.model_config(MODELS[name](num_layers=4, kernel_impl=kernel_impl))
    for r in results:
        est = rank_memory(config, layout, SEQ, GBS, bf16, r["pp_rank"], grads_bf16, state_bytes).as_dict()
        for key, measured in r["memory"].items():
            if key in skip:
                continue
            assert abs(est[key] - measured) <= tol * measured, (
                f"{layout.describe()} pp rank {r['pp_rank']}: {key} estimated {est[key]:.0f}, measured {measured}"
            )


ONE_PROCESS = {
    "llama": Layout(micro_batch_size=2),
    "llama-selective": Layout(micro_batch_size=2, recompute="selective"),
    "llama-full": Layout(micro_batch_size=4, recompute="full"),
    # a script's --recompute-method / --recompute-num-layers (the planner took every full recomputation as uniform 1)
    "llama-full_uniform2": Layout(micro_batch_size=4, recompute="full", recompute_num_layers=2),
    "llama-full_block1": Layout(micro_batch_size=4, recompute="full", recompute_method="block"),
    "llama-full_block3": Layout(micro_batch_size=4, recompute="full", recompute_method="block", recompute_num_layers=3),
    "gpt2": Layout(micro_batch_size=2),
    "gpt2-selective": Layout(micro_batch_size=2, recompute="selective"),
    "moe": Layout(micro_batch_size=2),
    "deepseek": Layout(micro_batch_size=2),  # multi-latent attention: latents whole, v padded for SDPA
    "deepseek-selective": Layout(micro_batch_size=2, recompute="selective"),
    "deepseekmtp": Layout(micro_batch_size=2),
    "deepseekmtp-full": Layout(micro_batch_size=4, recompute="full"),  # the depths' layers recomputed too
}


@pytest.mark.parametrize("case", list(ONE_PROCESS))
def test_memory_estimate_one_process(case):
    name = case.split("-")[0]
    layout = ONE_PROCESS[case]
    _check(name, layout, [measure(name, layout)])


@pytest.mark.parametrize("name", SELECTIVE)
def test_memory_estimate_of_each_recompute_module(name):
    """What each of --recompute-modules drops: the norms' outputs (made again), a dense MLP or a whole MoE layer
    (keeping its input), the experts' activation, the shared expert, MLA's per-head q, k, v (and with core_attn
    one checkpoint from the latents); core_attn only where named."""
    layout = Layout(micro_batch_size=2, recompute="selective")
    _check(name, layout, [measure(name, layout)], tol=0.03)


def measure_triton(name: str, recompute: str) -> dict:
    """One step of one micro-batch through the Triton kernels (the interpreter on CPU), no timed steps."""
    return measure(name, Layout(micro_batch_size=2, recompute=recompute), "triton", iters=0, gbs=2)


def triton_key(name: str, recompute: str = "none", module: str = "test_planner") -> str:
    """The key of `name`'s measure_triton, started ahead in the background (tests/head_start.py): the
    interpreter's 5-15 s each. `module` is the test module whose import puts `name` in MODELS (and which
    imports measure_triton)."""
    key = f"{module}:triton:{name}:{recompute}"
    head_start.register_call(key, module, "measure_triton", name, recompute)
    return key


def triton_case(name: str, recompute: str, module: str = "test_planner"):
    """A test case (name, key) of `name` whose measurement is started ahead (`triton_key`)."""
    key = triton_key(name, recompute, module)
    return pytest.param(name, key, id=name, marks=pytest.mark.head_start(key))


@pytest.mark.parametrize(
    "name,key", [triton_case(n, "selective") for n in ("llama/layernorm", "moe/moe_act", "mla/mla_up_proj")]
)
def test_memory_estimate_of_recompute_modules_with_the_triton_kernels(name, key):
    """The fused add-and-norm keeps its statistics; the SwiGLU kernel saves fc1's output, the flash kernel v
    unpadded. Through the interpreter: one step of one micro-batch."""
    layout = Layout(micro_batch_size=2, recompute="selective")
    _check(name, layout, [head_start.call_result(key)], "triton", tol=0.03)


@pytest.mark.parametrize("name", ["llama/core_attn+layernorm+mlp", "deepseek/mla_up_proj", "moe/moe",
                                  "llama/layernorm", "llama/mlp", "moe/layernorm"])  # fmt: skip
def test_memory_estimate_of_recompute_modules_under_sequence_parallelism(dist, name):
    """Under TP with SP the GEMMs' gathered inputs are not the norms' outputs: they are kept."""
    layout = Layout(tp=2, micro_batch_size=2, recompute="selective")
    _check(name, layout, dist(layout.world, measure, name, layout), tol=0.03)


@pytest.mark.parametrize("name,key", [triton_case(n, "none") for n in ("llama", "mla", "moe", "hetero")])
def test_memory_estimate_with_the_triton_kernels(name, key):
    """The kernels save less than PyTorch's ops (inputs and statistics only; multi-latent attention's values
    unpadded; the grouped GEMM saves no stacked copy of the experts' weights); the fused loss keeps the gradients
    it made in the forward. Run through the interpreter: one step
    of one micro-batch, no timed steps (without pipelining the peak is one micro-batch's)."""
    _check(name, Layout(micro_batch_size=2), [head_start.call_result(key)], "triton")


LAYOUTS = {
    "dp2": Layout(dp=2, micro_batch_size=2),
    "dp4-zero1": Layout(dp=4, sharding="dist-opt", micro_batch_size=2),
    "dp4-zero2": Layout(dp=4, sharding="zero2", micro_batch_size=2),
    "tp2-sp": Layout(tp=2, micro_batch_size=2),
    "tp2-no-sp": Layout(tp=2, micro_batch_size=2, sequence_parallel=False),
    "tp2-sp-dp2-zero1": Layout(tp=2, dp=2, sharding="dist-opt", micro_batch_size=2),
    "pp2": Layout(pp=2, micro_batch_size=2),
    "pp2-vp2-dp2": Layout(pp=2, vp=2, dp=2, micro_batch_size=1),
    "pp4-full-recompute": Layout(pp=4, micro_batch_size=1, recompute="full"),
    "cp2": Layout(cp=2, micro_batch_size=2),
    "cp2-a2a": Layout(cp=2, micro_batch_size=2, cp_comm_type="a2a"),
    "cp2-allgather": Layout(cp=2, micro_batch_size=2, cp_comm_type="allgather"),
    "fsdp2-dp2": Layout(dp=2, sharding="fsdp2", micro_batch_size=2),
    "fsdp2-tp2-dp2": Layout(tp=2, dp=2, sharding="fsdp2", micro_batch_size=2),
    "fsdp2-pp2-dp2": Layout(pp=2, dp=2, sharding="fsdp2", micro_batch_size=1),
    "fsdp2-cp2-dp2": Layout(cp=2, dp=2, sharding="fsdp2", micro_batch_size=2),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_memory_estimate_within_ten_percent(dist, case):
    layout = LAYOUTS[case]
    # (FSDP2's activations were skipped: the meter counted each layer's gathered weights, which the linears save,
    # as activations, 54% more at DP=2 in a review's run)
    _check("llama", layout, dist(layout.world, measure, "llama", layout))


@pytest.mark.parametrize("name", ["llama", "gpt2", "moe"])
def test_fsdp2_saves_the_activations_the_model_saves_without_it(dist, name):
    """The activation meter counts what the model saves, not FSDP2's gathered weights: the same bytes with and
    without it (from reviews: a layer's weights were counted, then still the experts' and a tied output layer's,
    which no forward of their own module uses)."""
    plain, sharded = (Layout(dp=2, micro_batch_size=2, sharding=s) for s in ("none", "fsdp2"))
    got = [[r["memory"]["mem_activations_bytes"] for r in dist(2, measure, name, lay)] for lay in (plain, sharded)]
    assert got[0] == got[1], got


@pytest.mark.parametrize("case", ["tp2-sp", "tp2", "cp2", "cp2-a2a", "cp4-allgather"])
def test_memory_estimate_multi_latent_attention(dist, case):
    """MLA under TP (latents whole on every rank, heads split) and CP, DeepSeek-shaped with MoE layers."""
    layout = {
        "tp2-sp": Layout(tp=2, micro_batch_size=2),
        "tp2": Layout(tp=2, micro_batch_size=2, sequence_parallel=False),
        "cp2": Layout(cp=2, micro_batch_size=2),
        "cp2-a2a": Layout(cp=2, micro_batch_size=2, cp_comm_type="a2a"),
        "cp4-allgather": Layout(cp=4, micro_batch_size=2, cp_comm_type="allgather"),  # (it keeps 4x the keys)
    }[case]
    _check("deepseek", layout, dist(layout.world, measure, "deepseek", layout))


@pytest.mark.parametrize("case", ["dp2", "dp4-zero2", "fsdp2-dp2"])
def test_memory_estimate_with_gradients_in_bf16(dist, case):
    """--bf16 --grad-reduce-in-bf16: bf16 weights and gradient buffers (FSDP2: fp32 shards either way), fp32
    main weights and moments, each within 10% of the measured bytes. (Activations are not compared: the CPU's
    bf16 ops save other tensors than a GPU's.)"""
    layout = LAYOUTS[case]
    results = dist(layout.world, measure, "llama", layout, "torch", True, True)
    _check("llama", layout, results, skip=("mem_activations_bytes",), bf16=True, grads_bf16=True)


@pytest.mark.parametrize("optimizer", ["sgd", "adam-bf16"])
@pytest.mark.parametrize("case", ["dp2", "dp4-zero1"])
def test_memory_estimate_with_4_bytes_of_state(dist, case, optimizer):
    """--optimizer sgd keeps one fp32 momentum buffer per parameter, Adam with bf16 moments two bf16 ones (sharded
    under the distributed optimizer): the estimate with 4 state bytes is within 10% of the measured breakdown."""
    layout = LAYOUTS[case]
    results = dist(layout.world, measure, "llama", layout, "torch", False, False, optimizer)
    _check("llama", layout, results, state_bytes=4)


def test_memory_estimate_zero2_with_embeddings_tied_across_stages(dist):
    """ZeRO-2 keeps the tied embedding's gradient whole on the first and last stage for the whole step."""
    layout = Layout(pp=2, dp=2, sharding="zero2", micro_batch_size=1)
    _check("gpt2", layout, dist(4, measure, "gpt2", layout))


@pytest.mark.parametrize("sharding", ["dist-opt", "fsdp2"])
def test_memory_estimate_with_experts(dist, sharding):
    layout = Layout(dp=4, ep=2, sharding=sharding, micro_batch_size=2)
    # expert activations depend on where the router sends tokens; the estimate assumes a balanced router
    _check("moe", layout, dist(4, measure, "moe", layout), skip=("mem_activations_bytes",))


@pytest.mark.parametrize("case", ["tp2", "tp2-moe_act", "tp2-dp2-ep2-zero1"])
def test_memory_estimate_with_expert_tensor_parallel_size_1(dist, case):
    """--expert-tensor-parallel-size 1 under TP 2: whole experts on every rank, each TP rank dispatching its half of
    the gathered tokens (MoELayer), their gradients and sharded state over the expert-data-parallel group of TP x
    DP / EP ranks. (The planner had priced the experts split by TP: half the weights, half the rows' width.)
    Without EP every token reaches a local expert, so the activations are exact too."""
    name, layout = {
        "tp2": ("moe", Layout(tp=2, etp=1, micro_batch_size=2)),
        "tp2-moe_act": ("moe/moe_act", Layout(tp=2, etp=1, micro_batch_size=2, recompute="selective")),
        "tp2-dp2-ep2-zero1": ("moe", Layout(tp=2, dp=2, ep=2, etp=1, sharding="dist-opt", micro_batch_size=2)),
    }[case]
    skip = ("mem_activations_bytes",) if layout.ep > 1 else ()  # (routed over EP: as test_memory_estimate_with_experts)
    _check(name, layout, dist(layout.world, measure, name, layout), skip=skip, tol=0.03 if not skip else 0.10)


# The cost model against published throughput (deterministic: no timing). Rows outside 15% are listed with
# the reason we believe: strict, so a model change that brings them in shows up.
OFF = {
    "GPT 70B (84 x 8192), TP8 PP2, 768 GPUs": "batch 384 from an unverified transcription: the data-parallel "
    "reduction (fp32, 48 nodes) outlasts the one micro-batch backward it hides under",
}


def test_context_parallelism_is_planned_as_the_ring_all_to_all_and_all_gather():
    """CP layouts come as the ring and as a2a (all-gather too with a sliding window, which the ring refuses as
    pretrain does); a2a and all-gather price their collectives exposed, the ring under its attention."""
    from megatron_lite.planner.hardware import ACCELERATORS, Cluster
    from megatron_lite.planner.search import evaluate, layouts

    config = llama_config(num_layers=4, num_attention_heads=8, num_query_groups=4, hidden_size=512)
    kinds = {lay.cp_comm_type for lay in layouts(config, 8, 8, 16) if lay.cp > 1}
    assert kinds == {"p2p", "a2a"}
    windowed = dataclasses.replace(config, sliding_window=256)
    assert {lay.cp_comm_type for lay in layouts(windowed, 8, 8, 16) if lay.cp > 1} == {"p2p", "a2a", "allgather"}
    cl = Cluster(ACCELERATORS["H100"], 8, 1, 450e9, 50e9)
    ring, a2a, gather = (
        evaluate(windowed, Layout(cp=4, dp=2, cp_comm_type=c), 8192, 16, cl) for c in ("p2p", "a2a", "allgather")
    )
    assert "--window-size with --cp-comm-type p2p is not supported" in ring.reason
    assert a2a.reason is None and gather.reason is None and a2a.time.cp_comm > 0 and gather.time.cp_comm > 0
    # without the window the ring hides its sends under 8192-token attention; a2a's all-to-alls are exposed
    ring, a2a = (evaluate(config, Layout(cp=4, dp=2, cp_comm_type=c), 8192, 16, cl) for c in ("p2p", "a2a"))
    assert a2a.time.cp_comm > ring.time.cp_comm
    recomputed = evaluate(config, Layout(cp=4, dp=2, cp_comm_type="a2a", recompute="selective"), 8192, 16, cl)
    assert recomputed.time.cp_comm == pytest.approx(1.5 * a2a.time.cp_comm)  # the forward's four again


def test_a_ring_across_nodes_runs_through_every_nic_its_ranks_hold():
    """A data-parallel ring with 8 (or 2) of its ranks in each node crosses the network through 8 (2) NICs at
    once, NCCL giving each channel its own rail; one with a single rank per node (TP8 inside) through one, and
    all-to-all and p2p, which send each rank's own data through its own NIC, likewise. (Before, every ring
    across nodes ran at one NIC's 50 GB/s, 8x too slow for FSDP or DP over whole nodes.)"""
    from megatron_lite.planner.cost import EFF, _collective
    from megatron_lite.planner.hardware import cluster

    cl = cluster("H100", 8, 16, None, None)  # NVLink 450 GB/s, 50 GB/s per GPU between nodes
    size = 1e9

    def rate(kind, n, span):
        steps = {"p2p": 1, "all_reduce": 2 * (n - 1)}.get(kind, n - 1)
        t = _collective(kind, size, n, span, cl, EFF) - steps * cl.link_latency
        return {"p2p": 1.0, "all_reduce": 2 * (n - 1) / n}.get(kind, (n - 1) / n) * size / t / EFF.comm / 1e9

    assert rate("reduce_scatter", 128, 128) == pytest.approx(400)  # 8 NICs; NVLink carries 7/8 at 450
    assert rate("all_gather", 64, 128) == pytest.approx(200)  # TP2 inside: 4 of its ranks (and NICs) per node
    assert rate("reduce_scatter", 16, 128) == pytest.approx(50)  # TP8 inside: one rank per node
    assert rate("all_to_all", 128, 128) == pytest.approx(50)
    assert rate("reduce_scatter", 12, 12) == pytest.approx(200)  # DP 12 over nodes of 8: one node holds only 4
    assert rate("all_gather", 3, 12) == pytest.approx(50)  # TP4 inside, DP 3: 2 ranks, then 1, per node
    assert rate("all_reduce", 8, 8) == pytest.approx(450)  # inside one node


def test_fsdp_edges_are_exposed_even_when_compute_hides_the_rest():
    """FSDP2 hides each layer's gathers and reduce-scatters under its neighbours' compute, but not those of a
    micro-batch's edges: the embeddings, output layer and first layer are gathered before anything runs and
    reduce-scattered after the last backward (before, the whole exchange counted as hidden here)."""
    from megatron_lite.planner.cost import EFF, _collective, step_time
    from megatron_lite.planner.hardware import cluster
    from megatron_lite.planner.published import L8_FUSED

    cl = cluster("H100", 8, 1, None, None)
    layout = Layout(dp=8, sharding="fsdp2", micro_batch_size=1)
    t = step_time(L8_FUSED, layout, 8192, 16, cl)  # 2 micro-batches of 8192 tokens: ~1 s each, comm ~0.2 s
    edge = 2 * 128256 * 4096 + 4096 + layer_params(L8_FUSED, 0, 1, 1)[0]
    edges = 2 * (
        _collective("all_gather", 2 * edge, 8, 8, cl, EFF) + _collective("reduce_scatter", 4 * edge, 8, 8, cl, EFF)
    )
    n = stage_params(L8_FUSED, layout, 0).total
    comm = 2 * (
        2 * _collective("all_gather", 2 * n, 8, 8, cl, EFF) + _collective("reduce_scatter", 4 * n, 8, 8, cl, EFF)
    )
    assert comm < t.compute / 3  # the case this test is about
    assert t.dp_comm == pytest.approx(edges + EFF.contention * (comm - edges))


def test_gradients_reduced_in_bf16_halve_the_reduction(capsys):
    """--grad-reduce-in-bf16: the data-parallel reduction moves 2 bytes per gradient instead of 4 (DDP's
    all-reduce, FSDP2's reduce-scatters), priced as such; the planner takes the flag from a script's flags."""
    from megatron_lite.planner.cost import EFF, _collective, step_time
    from megatron_lite.planner.hardware import cluster
    from megatron_lite.planner.published import L8_FUSED

    cl = cluster("H100", 8, 1, None, None)
    layout = Layout(dp=8, micro_batch_size=1)
    n = stage_params(L8_FUSED, layout, 0).total
    for grads_bf16, size in ((False, 4), (True, 2)):
        t = step_time(L8_FUSED, layout, 8192, 8, cl, grads_bf16=grads_bf16)
        assert t.dp_comm == pytest.approx(EFF.contention * _collective("all_reduce", size * n, 8, 8, cl, EFF))
    fsdp = Layout(dp=64, sharding="fsdp2", micro_batch_size=1)
    slow, fast = (step_time(L8_FUSED, fsdp, 8192, 64, cluster("H100", 8, 8, None, None), grads_bf16=g) for g in (0, 1))
    assert fast.dp_comm < slow.dp_comm and fast.compute == slow.compute
    script = str(ROOT / "pretrain" / "llama3_8b.sh")
    plain = _tool().main(["--script", script, "--top", "1"])
    halved = _tool().main(["--script", script, "--top", "1", "--", "--grad-reduce-in-bf16"])
    assert "(gradients reduced in bf16)" in capsys.readouterr().out
    assert halved["yours"]["memory"]["grads"] == pytest.approx(plain["yours"]["memory"]["grads"] / 2)
    # a script's --optimizer sgd: one momentum buffer (4 bytes) beside the fp32 main weights (4), not Adam's 8 + 4
    sgd = _tool().main(["--script", script, "--top", "1", "--", "--optimizer", "sgd"])
    assert "optimizer state 4 bytes per parameter" in capsys.readouterr().out
    assert sgd["yours"]["memory"]["optimizer"] == pytest.approx(plain["yours"]["memory"]["optimizer"] * 8 / 12)
    # bf16 Adam moments (--use-precision-aware-optimizer): 4 bytes too
    flags = "--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16".split()
    bf16_moments = _tool().main(["--script", script, "--top", "1", "--", *flags])
    assert "optimizer state 4 bytes per parameter" in capsys.readouterr().out
    assert bf16_moments["yours"]["memory"]["optimizer"] == pytest.approx(sgd["yours"]["memory"]["optimizer"])


def test_data_parallel_reduction_hides_under_the_last_backward_at_any_tp():
    """Inside one node a DDP all-reduce much shorter than a micro-batch's backward is hidden (only contention
    shows), with and without TP: the window is the backward's compute, not the TP communication."""
    from megatron_lite.planner.cost import EFF, _collective, step_time
    from megatron_lite.planner.hardware import cluster
    from megatron_lite.planner.published import L8_FUSED

    cl = cluster("H100", 8, 1, None, None)
    for tp in (1, 2):
        layout = Layout(tp=tp, dp=8 // tp, micro_batch_size=1)
        t = step_time(L8_FUSED, layout, 8192, 64, cl)
        reduce = _collective("all_reduce", 4 * stage_params(L8_FUSED, layout, 0).total, 8 // tp, 8, cl, EFF)
        per_mb = t.compute / layout.micro_batches(64)
        assert reduce < 2 / 3 * per_mb  # the case this test is about
        assert t.dp_comm == pytest.approx(EFF.contention * reduce), tp


def test_pipelined_reduction_window_grows_with_virtual_stages():
    """Each chunk's buckets go out from its last backward (the runtime's final_grads): with more virtual stages
    the first chunk's reduction starts earlier, so less of a fixed reduction is exposed; without pipelining
    the window is the last micro-batch's backward."""
    from megatron_lite.planner.cost import EFF, _exposed_reduction

    one = _exposed_reduction(Layout(), 8, 3.0, 5.0, EFF)
    assert one == pytest.approx(5.0 - 2.0)  # the backward of the last micro-batch: 2/3 of 3 s
    exposed = [_exposed_reduction(Layout(pp=4, vp=vp, dp=2), 8, 3.0, 5.0, EFF) for vp in (1, 2, 4)]
    assert exposed[0] == pytest.approx(3.0) and exposed[0] > exposed[1] > exposed[2]


def _published_rows():
    from megatron_lite.planner.published import ROWS

    return [
        pytest.param(r, marks=pytest.mark.xfail(strict=True, reason=OFF[r.label])) if r.label in OFF else r
        for r in ROWS
    ]


@pytest.mark.parametrize("row", _published_rows(), ids=lambda r: r.label.split(",")[0])
def test_cost_model_within_15_percent_of_published(row):
    from megatron_lite.planner.published import predict

    assert abs(predict(row) / row.value - 1) <= 0.15, (
        f"{row.label}: predicted {predict(row):.1f}, published {row.value}"
    )


@pytest.mark.parametrize(
    "source",
    [
        pytest.param(
            "torchtitan",
            marks=pytest.mark.xfail(
                strict=True,
                reason="the 8- and 128-GPU FSDP rows of one implementation are 2.3-2.7% apart; the model puts 128 "
                "GPUs just ahead (a 16x smaller optimizer shard; 8 NICs per node carry the ring at 400 GB/s "
                "against NVLink's 450) and has no term for what else scale costs",
            ),
        ),
        pytest.param(
            "Megatron-Core", marks=pytest.mark.xfail(strict=True, reason="the 70B row, and the 1.7B row placed second")
        ),
    ],
)
def test_cost_model_keeps_the_published_order(source):
    from megatron_lite.planner.published import compare

    assert compare(lambda *a: None, recommendations=False)["order_kept"][source]


def test_a_measured_accelerator_is_not_discounted_again():
    """Efficiency factors are fractions of a datasheet peak; a CPU's measured matmul and copy rates already are
    what a kernel achieves, so the model prices them at full rate (before, --check-cpu's one-process step came
    out 35-40% slower than measured, which skewed every communication-heavy layout's ratio)."""
    from megatron_lite.planner.cost import Efficiency, step_time
    from megatron_lite.planner.hardware import ACCELERATORS, Cluster

    gpu = ACCELERATORS["H100"]
    sheet = Cluster(gpu, 8, 1, 450e9, 50e9)
    measured = Cluster(dataclasses.replace(gpu, measured=True), 8, 1, 450e9, 50e9)
    from megatron_lite.planner.published import L8_FUSED

    model, layout = L8_FUSED, Layout(dp=8, micro_batch_size=1)  # Llama 3.1 8B: GEMM-bound, not launch-bound
    full_rate = Efficiency(gemm=1.0, attention=1.0, memory=1.0)
    a = step_time(model, layout, 4096, 8, measured)
    assert a.compute == pytest.approx(step_time(model, layout, 4096, 8, sheet, eff=full_rate).compute)
    assert a.compute < 0.8 * step_time(model, layout, 4096, 8, sheet).compute


@pytest.mark.parametrize("case", ["tp2-sp", "tp2-sp-full", "pp2"])
def test_memory_estimate_multi_token_prediction(dist, case):
    """Two MTP depths on the last stage (DeepSeek-shaped): their layers, inputs and losses, under TP with SP (and
    full recomputation, where a depth keeps its inputs' shards) and under PP (where the last stage also holds a
    copy of the word embeddings)."""
    layout = {
        "tp2-sp": Layout(tp=2, micro_batch_size=2),
        "tp2-sp-full": Layout(tp=2, micro_batch_size=4, recompute="full"),
        "pp2": Layout(pp=2, micro_batch_size=2),
    }[case]
    _check("deepseekmtp", layout, dist(layout.world, measure, "deepseekmtp", layout))


@pytest.mark.parametrize("case", ["one", "tp2-sp", "tp2-no-sp", "pp2", "cp2-a2a"])
def test_memory_estimate_heterogeneous(dist, case):
    """Heterogeneous layers (own query groups and FFN sizes, linear replacements, no-op parts): weights,
    gradients, optimizer state and activations within 10% of the measured breakdown, pipeline stages of unequal
    weight each at its own. The planner refused the model; priced at the model's sizes its weights were 1.5x."""
    layout = {
        "one": Layout(micro_batch_size=2),
        "tp2-sp": Layout(tp=2, micro_batch_size=2),
        "tp2-no-sp": Layout(tp=2, micro_batch_size=2, sequence_parallel=False),
        "pp2": Layout(pp=2, micro_batch_size=2),
        "cp2-a2a": Layout(cp=2, micro_batch_size=2, cp_comm_type="a2a"),
    }[case]
    results = [measure("hetero", layout)] if layout.world == 1 else dist(layout.world, measure, "hetero", layout)
    _check("hetero", layout, results)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_memory_estimate_pipeline_stage_of_identities(dist, recompute):
    """PP=3 over six heterogeneous layers, the middle stage two identities: without recomputation it saves
    nothing, not even its received input (the planner priced that input, the meter found 0 bytes); under full
    recomputation its checkpoint's output goes to the next stage, so the checkpoint keeps its input itself (the
    planner took it as kept by the next checkpoint, as within a stage: a third of the measured, and its rebuilt
    layers' transient as minus that input)."""
    layout = Layout(pp=3, micro_batch_size=2, recompute=recompute)
    results = dist(3, measure, "hetero_identity_stage", layout)
    middle = next(r for r in results if r["pp_rank"] == 1)["memory"]["mem_activations_bytes"]
    assert (middle == 0) == (recompute == "none")  # (then _check's relative bound says nothing)
    config = layout.model_config(MODELS["hetero_identity_stage"](kernel_impl="torch"))
    est = rank_memory(config, layout, SEQ, GBS, False, 1)
    assert (est.activations == 0) == (recompute == "none")
    assert est.transient == 0  # (recomputing identities rebuilds nothing: it was minus the checkpoint's input)
    _check("hetero_identity_stage", layout, results)


@pytest.mark.parametrize("dp", [2, 4])
def test_memory_estimate_dist_muon(dist, dp):
    """--optimizer dist_muon gives each data-parallel rank whole tensors (largest first, to the rank with the fewest
    bytes of state): the busiest rank's optimizer bytes (Muon's momentum on the matrices, Adam's moments on the
    embeddings and output layer) are within 10% of the largest measured, the other components of every rank's. With
    a vocabulary of 2048 the output layer's and embeddings' state each outweigh a quarter of the whole: priced as an
    even split (the plan priced the whole state on every rank, 'an upper bound'), DP=4 came out over a quarter
    short."""
    layout = Layout(dp=dp, sharding="layer-wise", micro_batch_size=2)
    results = dist(dp, measure, "llama_vocab", layout, optimizer="dist_muon")
    _check("llama_vocab", layout, results, skip=("mem_optimizer_bytes",))
    config = layout.model_config(MODELS["llama_vocab"](num_layers=4, kernel_impl="torch"))
    est = rank_memory(config, layout, SEQ, GBS, False, 0).optimizer
    measured = max(r["memory"]["mem_optimizer_bytes"] for r in results)
    assert abs(est - measured) <= 0.10 * measured, (est, [r["memory"]["mem_optimizer_bytes"] for r in results])
