"""The planner's memory estimate for what changes the bytes a model keeps beyond its layout: fp8 GEMMs (their fp8
inputs and weights saved for the backward; delayed scaling's weight cache held for the step), an fp32 residual
stream under bf16, experts padded to their capacity or dropping past it, the attention output's and the shared
expert's gates, quick-GEGLU, an fp64 router on a jittered input, routing weights on the experts' input,
--qk-l2-norm and --softmax-type's offsets. Each within 3% of the breakdown measured from the tensors of a real
step on CPU (torch's float8 dtypes and its fp8 GEMM fallback run there), the bound the recompute-module tests
use: each term moves the total by 4% or more."""

from __future__ import annotations

import dataclasses

import head_start
import pytest
from test_planner import (
    GBS,
    LLAMA3_8B_TOP1,
    MODELS,
    ROOT,
    _check,
    measure,
    measure_triton,  # noqa: F401 - the background's call (triton_key) finds it here
    moe_llama,
    triton_case,
    triton_key,
)

from megatron_lite.planner.layout import Layout

from models import deepseek_config, gpt2_config, llama_config

PRECISION_MODELS = {
    "llama_fp8": lambda **kw: llama_config(fp8="hybrid", **kw),  # delayed scaling, the weights cached
    # tensorwise: each micro-batch quantizes (and saves) its own weights; without RoPE the output projection reads
    # SDPA's own output, which stays
    "gpt2_fp8_tensorwise": lambda **kw: gpt2_config(fp8="hybrid", fp8_recipe="tensorwise", **kw),
    "llama_fp8_nowgrad": lambda **kw: llama_config(fp8="e4m3", fp8_wgrad=False, **kw),  # the input kept beside
    "llama_fp8_bf16ends": lambda **kw: llama_config(fp8="hybrid", fp8_bf16_layers=(1, 1), **kw),
    # the MLP checkpointed: its cached fp8 weights are run only inside the checkpoint (transient, not activations)
    "llama_fp8_mlp": lambda **kw: llama_config(fp8="hybrid", recompute_modules=("mlp",), **kw),
    # multi-latent attention, experts run one by one in fp8, a shared expert, two MTP depths with eh_proj
    "deepseekmtp_fp8": lambda **kw: deepseek_config(fp8="hybrid", mtp_num_layers=2, **kw),
    "moe_pad": lambda **kw: moe_llama(moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True, **kw),
    "moe_drop": lambda **kw: moe_llama(moe_expert_capacity_factor=0.5, **kw),  # half the pairs dropped
    "moe_pad_fp8": lambda **kw: moe_llama(
        moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True, fp8="hybrid", **kw
    ),
    "gpt2_fp32_residual": lambda **kw: gpt2_config(fp32_residual_connection=True, **kw),
    # --attention-output-gate: its sigmoid, its rows of a QKV output kept whole (no RoPE), the gated output
    "llama_gate": lambda **kw: llama_config(attention_output_gate=True, **kw),
    "gpt2_gate": lambda **kw: gpt2_config(attention_output_gate=True, **kw),
    "llama_gate_selective": lambda **kw: llama_config(
        attention_output_gate=True, recompute_modules=("core_attn",), **kw
    ),
    "deepseek_shared_gate": lambda **kw: deepseek_config(moe_shared_expert_gate=True, **kw),
    # gpt-oss's quick-GEGLU (PyTorch's ops, or its Triton kernel), clamped, with an offset; its experts' activation
    # made again (moe_act)
    "llama_qgeglu": lambda **kw: llama_config(
        activation="quick_geglu", activation_func_clamp_value=7.0, glu_linear_offset=1.0, **kw
    ),
    "gptoss_moe_act": lambda **kw: moe_llama(
        activation="quick_geglu", add_bias_linear=True, recompute_modules=("moe_act",), **kw
    ),
    # the router in fp64 (its input's fp64 copy, fp64 scores) on a jittered input (the noise kept)
    "moe_router_fp64_jitter": lambda **kw: moe_llama(moe_router_dtype="fp64", moe_input_jitter_eps=0.01, **kw),
    # top-1 weights on the input: no output kept for the weighting
    "moe_probs_on_input": lambda **kw: llama_config(
        num_experts=4, moe_router_topk=1, moe_ffn_hidden_size=48, moe_apply_probs_on_input=True, **kw
    ),
    # --qk-l2-norm: its fp32 q and k and 1/rms (in fp32, q's copy and the QKV output k is a view of); without RoPE
    # the attention keeps the normalised q and k (in bf16 on CPU too: GPT-2-shaped)
    "llama_l2": lambda **kw: llama_config(qk_l2_norm=True, **kw),
    "gpt2_l2": lambda **kw: gpt2_config(qk_l2_norm=True, **kw),
    # Llama 4's: the NoPE layers (every second) not normalised (--qk-l2-norm-rope-only)
    "llama_l2_rope_only": lambda **kw: llama_config(qk_l2_norm=True, qk_l2_norm_rope_only=True, no_rope_freq=2, **kw),
    # --softmax-type: PyTorch's unfused attention keeps O(seq^2) fp32 probabilities
    "llama_learnable": lambda **kw: llama_config(softmax_type="learnable", **kw),
    "gpt2_offbyone": lambda **kw: gpt2_config(softmax_type="off-by-one", **kw),
    # all at once through the Triton kernels: fp8, the flash kernel with offsets, the gate, --qk-l2-norm
    "llama_variants": lambda **kw: llama_config(
        fp8="hybrid", softmax_type="learnable", attention_output_gate=True, qk_l2_norm=True, **kw
    ),
}
MODELS.update(PRECISION_MODELS)  # (measure() and _check() build from test_planner's table)


def measure_precision(name: str, layout: Layout, bf16: bool = False, gbs: int = GBS) -> dict:
    """test_planner's measure (one step, memory only), on a rank of a world that imported this module (and so
    knows its models)."""
    return measure(name, layout, "torch", bf16, iters=0, gbs=gbs)


ONE_PROCESS = {
    "llama_fp8": Layout(micro_batch_size=2),
    "llama_fp8_nowgrad": Layout(micro_batch_size=2),
    "llama_fp8_bf16ends": Layout(micro_batch_size=2),
    "llama_fp8_mlp": Layout(micro_batch_size=2, recompute="selective"),
    "deepseekmtp_fp8": Layout(micro_batch_size=2),
    "moe_pad": Layout(micro_batch_size=2),
    "moe_drop": Layout(micro_batch_size=2),
    "moe_pad_fp8": Layout(micro_batch_size=2),
    "llama_gate": Layout(micro_batch_size=2),
    "gpt2_gate": Layout(micro_batch_size=2),
    "llama_gate_selective": Layout(micro_batch_size=2, recompute="selective"),
    "deepseek_shared_gate": Layout(micro_batch_size=2),
    "llama_qgeglu": Layout(micro_batch_size=2),
    "gptoss_moe_act": Layout(micro_batch_size=2, recompute="selective"),
    "moe_router_fp64_jitter": Layout(micro_batch_size=2),
    "moe_probs_on_input": Layout(micro_batch_size=2),
    "llama_l2": Layout(micro_batch_size=2),
    "llama_l2_rope_only": Layout(micro_batch_size=2),
    "llama_learnable": Layout(micro_batch_size=2),
}


@pytest.mark.parametrize("name", list(ONE_PROCESS))
def test_memory_estimate_with_fp8_expert_capacity_and_gates(name):
    layout = ONE_PROCESS[name]
    # (one micro-batch: without pipelining the peak is one micro-batch's, delayed scaling's cache included)
    _check(name, layout, [measure_precision(name, layout, gbs=layout.micro_batch_size)], tol=0.03)


@pytest.mark.parametrize("name", ["llama_fp8", "gpt2_fp8_tensorwise"])
def test_memory_estimate_with_fp8_under_pipelining_and_tp(dist, name):
    """Under PP=2 rank 0 holds two micro-batches: delayed scaling's cached weights are held once, tensorwise's own
    copies once per micro-batch in flight; under TP with SP each linear quantizes its gathered (or split) input
    and its weight shard."""
    for layout in (Layout(pp=2, micro_batch_size=1), Layout(tp=2, micro_batch_size=2)):
        _check(name, layout, dist(layout.world, measure_precision, name, layout), tol=0.03)


def test_memory_estimate_of_the_gates_under_tp(dist):
    """Under TP with SP: the attention gate's terms split by heads; the shared expert's gate keeps its input, the
    norm's sequence shard, besides its output and sigmoid."""
    layout = Layout(tp=2, micro_batch_size=2)
    for name in ("llama_gate", "deepseek_shared_gate"):
        _check(name, layout, dist(2, measure_precision, name, layout), tol=0.03)


VARIANTS = triton_key("llama_variants", module="test_planner_precision")


@pytest.mark.head_start(VARIANTS)
def test_memory_estimate_of_the_variants_with_the_triton_kernels():
    """fp8 GEMMs, the flash kernel with softmax offsets, the output gate and --qk-l2-norm through the Triton
    kernels (the interpreter on CPU): one step of one micro-batch."""
    _check("llama_variants", Layout(micro_batch_size=2), [head_start.call_result(VARIANTS)], "triton", tol=0.03)


@pytest.mark.parametrize(
    "name,key",
    [
        triton_case(n, ONE_PROCESS[n].recompute, "test_planner_precision")
        for n in ("llama_qgeglu", "gptoss_moe_act", "moe_pad_fp8")
    ],
)
def test_memory_estimate_of_the_activation_kernels_in_every_mlp(name, key):
    """Under --kernel-impl triton quick-GEGLU's kernel keeps fc1's output alone (as SwiGLU's does), in the dense
    MLP and between the experts' GEMMs (PyTorch's ops keep the clamped halves, the sigmoid and the products);
    fp8 experts, run one by one, take the activation's kernel too."""
    layout = ONE_PROCESS[name]
    assert layout == Layout(micro_batch_size=2, recompute=layout.recompute)  # (what measure_triton measures)
    _check(name, layout, [head_start.call_result(key)], "triton", tol=0.03)


@pytest.mark.parametrize("name", ["gpt2_fp32_residual", "gpt2_l2", "gpt2_offbyone"])
def test_memory_estimate_in_bf16(name):
    """Under --bf16 (GPT-2-shaped: LayerNorm, no RoPE, whose bf16 ops save on CPU what the estimate counts;
    Llama's RMSNorm does not, the reason test_planner compares no bf16 activations): --fp32-residual-connection's
    norms keep their fp32 input; --qk-l2-norm keeps fp32 copies of q and k; the offset softmax its bf16 copy of
    the probabilities."""
    layout = Layout(micro_batch_size=2)
    _check(name, layout, [measure_precision(name, layout, True, gbs=2)], bf16=True, tol=0.03)


def test_memory_estimate_with_an_fp32_residual_stream_pipelined(dist):
    """--fp32-residual-connection under --bf16 and PP=2: a stage receives (and keeps) the fp32 stream."""
    name = "gpt2_fp32_residual"
    layout = Layout(pp=2, micro_batch_size=1)
    _check(name, layout, dist(2, measure_precision, name, layout, bf16=True), bf16=True, tol=0.03)


def test_fp8_gemms_are_priced_at_the_fp8_peak():
    """The time model runs the transformer layers' GEMMs at the accelerator's fp8 peak (twice bf16's on an H100;
    none on an A100, priced at bf16's), the weight-gradient GEMM in bf16 under --no-fp8-wgrad, and the layers
    --num-layers-at-start/end-in-bf16 keeps in bf16. By hand: a 16384 x 4096 x 14336 GEMM in fp8 on an H100 is
    its FLOPs at 60% of 1979 TFLOP/s plus its bytes (fp8 operands, a bf16 output, the input read and written in
    fp8 to quantize it) at 70% of 3.35 TB/s."""
    from megatron_lite.planner.cost import EFF, _gemm, step_time
    from megatron_lite.planner.hardware import cluster
    from megatron_lite.planner.published import L8_FUSED

    m, k, n = 16384, 4096, 14336
    by_hand = 2 * m * k * n / (1978.9e12 * 0.6) + (m * k + k * n + 2 * m * n + 3 * m * k) / (3.35e12 * 0.7)
    h100 = cluster("H100", 8, 1, None, None)
    assert _gemm(m, k, n, 2, h100, EFF, fp8="fp8") == pytest.approx(by_hand)
    layout = Layout(tp=2, dp=4, micro_batch_size=1)

    def compute(gpu="H100", **kw):
        model = dataclasses.replace(L8_FUSED, **kw)
        return step_time(model, layout, 8192, 32, cluster(gpu, 8, 1, None, None)).compute

    bf16, fp8 = compute(), compute(fp8="hybrid")
    assert 0.5 * bf16 < fp8 < 0.8 * bf16  # (the GEMMs halve; attention and element-wise work stay)
    assert fp8 < compute(fp8="hybrid", fp8_wgrad=False) < bf16
    assert fp8 < compute(fp8="hybrid", fp8_bf16_layers=(2, 2)) < bf16
    assert compute("A100", fp8="hybrid") == pytest.approx(compute("A100"))


# (three shipped scripts' plans, 15 s: started ahead in the background, tests/head_start.py)
head_start.register_call(
    "plans_unmodelled",
    "test_planner",
    "plans",
    ["--script", str(ROOT / "pretrain" / "gpt_oss_20b.sh"), "--top", "1"],
    [*LLAMA3_8B_TOP1, "--", "--attention-dropout", "0.1"],
    [*LLAMA3_8B_TOP1, "--gpu", "A100", "--", "--fp8-format", "hybrid"],
)


@pytest.mark.head_start("plans_unmodelled")
def test_the_plan_says_what_its_estimate_leaves_out():
    """A setting the memory model does not price is said with the plan (it was dropped without a word):
    --attention-dropout under the Triton kernels (attention then runs through SDPA); fp8 on an A100, priced at
    bf16's rate. gpt-oss's learnable softmax offsets and clamped quick-GEGLU are priced: nothing to say. The
    header says the job's fp8 GEMMs."""
    gpt_oss, dropout, a100 = head_start.call_result("plans_unmodelled")
    assert gpt_oss["value"]["unmodelled"] == []
    assert "leaves out" not in gpt_oss["out"]
    assert [u.split(" (")[0] for u in dropout["value"]["unmodelled"]] == ["--attention-dropout 0.1"]
    assert (
        "warning: the memory estimate leaves out --attention-dropout 0.1 (attention runs through SDPA"
        in (dropout["out"])
    )
    assert a100["value"]["unmodelled"] == []
    assert "bf16, fp8 GEMMs (hybrid, delayed)" in a100["out"]
    no_fp8 = "warning: the A100 SXM 80GB has no fp8 tensor cores: the fp8 GEMMs are priced at its bf16 rate"
    assert no_fp8 in a100["out"]
