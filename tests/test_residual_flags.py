"""Megatron's residual-stream flags (both refused before).

--fp32-residual-connection (with --bf16 / --fp16): the embeddings, each residual add and what passes between
layers and pipeline stages are fp32; the norms give the branches bf16 inputs. Seen with hooks, measured against an
fp32 model (closer than without the flag), a no-op in fp32, and equal to one process at TP=2 with sequence
parallelism and at PP=2 (fp32 hidden states sent between the stages).

--apply-residual-connection-post-layernorm: each branch is added to its norm's output. A GPT-2-shaped model equals
a hand-written post-LN block (torch's layer_norm, SDPA and GELU), forward and backward, through the PyTorch norms,
the fused add+norm kernel and --recompute-modules layernorm; it trains like one process at TP=2 + SP and PP=2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_train_equivalence import _compare, train_run

from megatron_lite import kernels as K
from megatron_lite.arguments import parse_args
from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.models.gpt_model import build_model
from megatron_lite.parallel_context import ParallelContext

from models import VOCAB, gpt2_config, llama_config, needs_triton_on_cpu, nemotron_config, perturbed_full_state

P = ParallelConfig
FLAGS = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --train-iters 2 --mock-data".split()


def _ctx() -> ParallelContext:
    return ParallelContext.virtual(P(), device=torch.device("cpu"))


def _tokens(seed: int = 0, b: int = 4, s: int = 32) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


# --fp32-residual-connection ------------------------------------------------------------------------------------
def test_fp32_residual_flag_parses_and_needs_a_lower_precision():
    _, job = parse_args([*FLAGS, "--vocab-size", "100", "--bf16", "--fp32-residual-connection"])
    assert job.model.fp32_residual_connection
    with pytest.raises(ConfigError, match=r"--fp32-residual-connection keeps the residual stream in fp32 under --bf16"):
        parse_args([*FLAGS, "--vocab-size", "100", "--fp32-residual-connection"])
    with pytest.raises(ConfigError, match=r"--fp32-residual-connection with --use-torch-fsdp2 is not supported"):
        parse_args([*FLAGS, "--vocab-size", "100", "--bf16", "--fp32-residual-connection", "--use-torch-fsdp2"])


def _dtypes(model) -> dict[str, set]:
    """The dtypes each kind of module reads and writes in one forward and backward."""
    seen: dict[str, set] = {}

    def hook(kind):
        def fn(module, args, out):
            first = out[0] if isinstance(out, tuple) else out
            seen.setdefault(kind, set()).add((args[0].dtype, first.dtype))

        return fn

    chunk = model[0]
    chunk.embedding.register_forward_hook(lambda m, a, out: seen.setdefault("embedding", set()).add(out.dtype))
    for layer in chunk.decoder.layers:
        layer.register_forward_hook(hook("layer"))
        for name in ("input_layernorm", "pre_mlp_layernorm", "self_attention", "mlp"):
            getattr(layer, name).register_forward_hook(hook(name))
    chunk.decoder.final_layernorm.register_forward_hook(hook("final_layernorm"))
    t = _tokens()
    chunk(t, labels=t).float().mean().backward()
    seen["grads"] = {p.grad.dtype for p in model.parameters()}
    return seen


@pytest.mark.parametrize("config", [llama_config, gpt2_config, nemotron_config])  # (nemotron: 1p LayerNorms)
def test_fp32_residual_stream_is_fp32_and_the_branches_bf16(config):
    f32, bf = torch.float32, torch.bfloat16
    seen = _dtypes(build_model(config(fp32_residual_connection=True), _ctx(), seed=1, dtype=bf))
    assert seen["embedding"] == {f32}
    assert seen["layer"] == {(f32, f32)}  # what each layer takes and gives: the stream
    assert seen["input_layernorm"] == {(f32, bf)}  # an fp32 stream normalised, the branch reading bf16
    assert seen["pre_mlp_layernorm"] == {(bf, bf)}  # (called with the attention's bf16 output and the fp32 stream)
    assert seen["self_attention"] == seen["mlp"] == {(bf, bf)}
    assert seen["final_layernorm"] == {(f32, bf)}  # the output layer reads bf16
    assert seen["grads"] == {bf}  # (the weights stay bf16)
    without = _dtypes(build_model(config(), _ctx(), seed=1, dtype=bf))
    assert without["embedding"] == {bf} and without["layer"] == {(bf, bf)}


def test_fp32_residual_brings_a_bf16_model_closer_to_fp32():
    """The same bf16 weights run three ways: in fp32 (the reference), in bf16, and in bf16 with an fp32 residual
    stream. Eight layers, so the stream's rounding accumulates: measured here, the per-token losses' mean error
    falls 2.7x and 3.0x with the flag (seeds 0, 1); asserted at 2x."""
    for seed in (0, 1):
        weights = build_model(llama_config(num_layers=8), _ctx(), seed=seed, dtype=torch.bfloat16)[0].full_state_dict()
        t = _tokens(seed)
        losses = {}
        for dtype, fp32_residual in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
            config = llama_config(num_layers=8, fp32_residual_connection=fp32_residual)
            model = build_model(config, _ctx(), seed=seed, dtype=dtype)
            model[0].load_full_state_dict({k: v.to(dtype) for k, v in weights.items()})
            with torch.no_grad():
                losses[dtype, fp32_residual] = model[0](t, labels=t).double()
        ref = losses[torch.float32, False]
        plain = (losses[torch.bfloat16, False] - ref).abs().mean().item()
        fp32_stream = (losses[torch.bfloat16, True] - ref).abs().mean().item()
        assert fp32_stream * 2 < plain, (seed, plain, fp32_stream)


@needs_triton_on_cpu
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_fused_add_norm_kernel_sums_a_bf16_branch_into_an_fp32_stream(norm):
    """The Triton add+norm with a bf16 x and an fp32 residual (before: PyTorch's reference took it): the sum and
    the output fp32, equal to the reference's; x's gradient the fp32 one rounded to bf16 by autograd."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=gen).bfloat16().requires_grad_()
    r = torch.randn(6, 64, generator=gen).requires_grad_()
    w = (1 + 0.1 * torch.randn(64, generator=gen)).bfloat16().requires_grad_()
    b = (0.1 * torch.randn(64, generator=gen)).bfloat16()
    fused, ref = (K.rms_norm, K.rms_norm_reference) if norm == "rms" else (K.layer_norm, K.layer_norm_reference)
    args = (w, 1e-5) if norm == "rms" else (w, b, 1e-5)
    out = []
    for fn in (fused, ref):
        launches = K.LAUNCHES[f"{norm}_norm_fwd"]
        y, s = fn(x, *args, residual=r)
        ran = K.LAUNCHES[f"{norm}_norm_fwd"] > launches
        loss = (y * torch.linspace(-1, 1, 64)).sum() + (s * torch.linspace(0, 1, 64)).sum()
        out.append((ran, y, s, *torch.autograd.grad(loss, (x, r, w))))
    (ran, *got), (ran_ref, *want) = out
    assert ran and not ran_ref
    f32, bf = torch.float32, torch.bfloat16
    assert [t.dtype for t in got] == [t.dtype for t in want] == [f32, f32, bf, f32, bf]  # y, s, dx, dr, dw
    for name, a, e in zip(("y", "s", "dx", "dr"), got, want):
        assert torch.allclose(a.float(), e.float(), rtol=1e-6, atol=1e-6), name
    assert torch.allclose(got[4].float(), want[4].float(), rtol=8e-3)  # dw: bf16, summed in another order


def test_fp32_residual_changes_nothing_in_fp32():
    out = []
    for flag in (False, True):
        model = build_model(llama_config(fp32_residual_connection=flag), _ctx(), seed=3)
        t = _tokens()
        loss = model[0](t, labels=t)
        loss.mean().backward()
        out.append((loss.detach(), [p.grad for p in model.parameters()]))
    assert torch.equal(out[0][0], out[1][0])
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))


# --apply-residual-connection-post-layernorm --------------------------------------------------------------------
def _post_ln_oracle(w: dict[str, torch.Tensor], tokens: torch.Tensor, layers: int, heads: int = 4) -> torch.Tensor:
    """GPT-2's block with the residual taken after each norm, in plain torch: logits [batch, seq, vocab]."""
    b, s = tokens.shape
    hidden = w["embedding.word_embeddings.weight"].shape[1]
    d = hidden // heads

    def ln(x, name):
        return F.layer_norm(x, (hidden,), w[f"{name}.weight"], w[f"{name}.bias"], 1e-5)

    def linear(x, name):
        return F.linear(x, w[f"{name}.weight"], w[f"{name}.bias"])

    x = w["embedding.word_embeddings.weight"][tokens] + w["embedding.position_embeddings.weight"][:s]
    for i in range(layers):
        p = f"decoder.layers.{i}."
        residual = ln(x, p + "input_layernorm")
        qkv = linear(residual, p + "self_attention.linear_qkv").view(b, s, heads, 3, d)  # (q, k, v per head)
        q, k, v = (qkv[..., j, :].transpose(1, 2) for j in range(3))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, hidden)
        x = residual + linear(a, p + "self_attention.linear_proj")
        residual = ln(x, p + "pre_mlp_layernorm")
        x = residual + linear(F.gelu(linear(residual, p + "mlp.linear_fc1"), approximate="tanh"), p + "mlp.linear_fc2")
    return F.linear(ln(x, "decoder.final_layernorm"), w["embedding.word_embeddings.weight"])  # (tied)


POST_LN_CASES = {
    "torch": {},
    "triton": {"kernel_impl": "triton"},  # (the fused add+norm kernel, given the norm's output as the residual)
    "recompute-layernorm": {"recompute_granularity": "selective", "recompute_modules": ("layernorm",)},
}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[needs_triton_on_cpu] if c == "triton" else []) for c in POST_LN_CASES]
)
def test_post_layernorm_residual_is_the_hand_written_block(case):
    config = gpt2_config(apply_residual_connection_post_layernorm=True, **POST_LN_CASES[case])
    state = perturbed_full_state(gpt2_config(), seed=2)  # (norms away from 1 / 0: which tensor is added shows)
    model = build_model(config, _ctx(), seed=2)
    model[0].load_full_state_dict(state)
    model.train()
    weights = {k: v.clone().requires_grad_() for k, v in state.items()}
    t = _tokens(1, b=2, s=16)
    want = _post_ln_oracle(weights, t, config.num_layers)
    fused = K.LAUNCHES["layer_norm_fwd"]
    got = model[0](t)[..., :VOCAB]
    assert (K.LAUNCHES["layer_norm_fwd"] > fused) == (case == "triton")
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    labels = _tokens(2, b=2, s=16)
    F.cross_entropy(want.flatten(0, 1), labels.flatten()).backward()
    model[0](t, labels=labels).mean().backward()
    grads = {model[0].global_name(n): p.grad for n, p in model[0].named_parameters()}
    for name, w in weights.items():
        assert torch.allclose(grads[name], w.grad, rtol=1e-4, atol=1e-6), name
    pre = build_model(gpt2_config(), _ctx(), seed=2)  # (and the pre-norm model computes something else)
    pre[0].load_full_state_dict(state)
    with torch.no_grad():
        assert (pre[0](t)[..., :VOCAB] - want).abs().max() > 1e-2


def test_post_layernorm_residual_is_refused_on_export():
    from megatron_lite.models.hf import check_exportable

    flags = [*FLAGS, "--vocab-size", "100", "--apply-residual-connection-post-layernorm"]
    _, job = parse_args(flags)
    assert job.model.apply_residual_connection_post_layernorm
    with pytest.raises(ConfigError, match=r"residuals taken after each norm \(--apply-residual-connection-post-layer"):
        check_exportable(job.model, "GPT2LMHeadModel")
    _, job = parse_args([*FLAGS, "--vocab-size", "100", "--bf16", "--fp32-residual-connection"])
    check_exportable(job.model, "GPT2LMHeadModel")  # (an fp32 stream changes no weight)


def test_post_layernorm_residual_says_megatron_core_ignores_it():
    """Megatron-Core 0.16's layers never read apply_residual_connection_post_layernorm (only Megatron's legacy
    models, refused here, do): a Megatron script with it trains pre-norm there; here the flag acts as its help
    says, and the start-up notes say so."""
    from megatron_lite.megatron_flags import accepted_no_ops

    ns, _ = parse_args([*FLAGS, "--vocab-size", "100", "--apply-residual-connection-post-layernorm"])
    assert any("Megatron-Core's models (Megatron-LM's default) ignore it" in n for n in accepted_no_ops(ns))
    assert not any("post-layernorm" in n for n in accepted_no_ops(parse_args([*FLAGS, "--vocab-size", "100"])[0]))


def test_a_checkpoint_keeps_post_layernorm_residuals():
    """An architecture flag (the same tensors, another model): --load alone takes it over, the opposite conflicts."""
    from megatron_lite.checkpoint_flags import defaults_from_checkpoint, flags_from_checkpoint
    from megatron_lite.flag_parser import build_parser

    argv = [*FLAGS, "--vocab-size", "100"]
    saved = parse_args([*argv, "--apply-residual-connection-post-layernorm"])[1].to_dict()
    assert defaults_from_checkpoint(saved)["apply_residual_connection_post_layernorm"] is True
    ns = flags_from_checkpoint(build_parser(), argv, build_parser().parse_args(argv), saved, "ckpt")
    assert ns.apply_residual_connection_post_layernorm
    pre = parse_args(argv)[1].to_dict()
    argv = [*argv, "--apply-residual-connection-post-layernorm"]
    with pytest.raises(ConfigError, match="--apply-residual-connection-post-layernorm conflicts with the check"):
        flags_from_checkpoint(build_parser(), argv, build_parser().parse_args(argv), pre, "ckpt")


# Equivalence with one process ----------------------------------------------------------------------------------
LAYOUTS = {  # world, layout, micro-batch size
    "tp2-sp": (2, P(tensor_model_parallel_size=2, sequence_parallel=True), 2),
    "pp2": (2, P(pipeline_model_parallel_size=2), 1),
}
SAME_SUM_TOL = 5e-3  # bf16 under TP: the row-parallel sums round once more (as tests/test_grad_reduce_bf16.py)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_post_layernorm_residual_trains_like_one_process(dist, layout):
    """fp32: GPT-2-shaped (LayerNorm, embeddings tied across the two stages at PP=2) with post-LN residuals."""
    world, parallel, mbs = LAYOUTS[layout]
    ref = train_run("postln", P(), 4, 4, iters=4)
    for history in dist(world, train_run, "postln", parallel, 4, mbs, iters=4):
        _compare(history, ref)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp32_residual_trains_like_one_process(dist, layout):
    """bf16 with an fp32 stream. At PP=2 the first stage sends the fp32 stream: the same micro-batches in one
    process give the same losses and norms to 1e-4 (a bf16 buffer rounded the hidden states, or failed). At TP=2
    the bf16 row-parallel sums round differently: equal within SAME_SUM_TOL."""
    world, parallel, _ = LAYOUTS[layout]
    ref = train_run("fp32res", P(), 2, 1, iters=3, bf16=True)  # (bf16 on a CPU is slow: two micro-batches of one)
    tol = SAME_SUM_TOL if parallel.tensor_model_parallel_size > 1 else 1e-4  # (PP=2: 2e-16 measured, the same ops)
    for history in dist(world, train_run, "fp32res", parallel, 2, 1, iters=3, bf16=True):
        for it, (a, b) in enumerate(zip(history, ref)):
            assert abs(a[0] - b[0]) <= tol * abs(b[0]) and abs(a[1] - b[1]) <= tol * abs(b[1]), (it, a, b)


def _generated(parallel: P, state: dict, prompt: list[int]) -> dict:
    """A bf16 Llama with an fp32 stream on this layout, loaded with `state`: greedy tokens and their log-probs."""
    from megatron_lite.inference.generation import generate

    from dist_pool import get_context

    ctx = get_context(parallel) if parallel.pipeline_model_parallel_size > 1 else _ctx()
    model = build_model(llama_config(fp32_residual_connection=True), ctx, seed=1, dtype=torch.bfloat16)
    for chunk in model:
        chunk.load_full_state_dict(state)
    return generate(model, ctx, prompt, 4)


def test_pipelined_generation_sends_the_fp32_stream(dist):
    """PP=2 generation's stages exchange the fp32 hidden states (a bf16 buffer met an fp32 send): the tokens and
    log-probabilities of one process."""
    state = build_model(llama_config(), _ctx(), seed=4, dtype=torch.bfloat16)[0].full_state_dict()
    prompt = _tokens(3, b=1, s=6)[0].tolist()
    want = _generated(P(), state, prompt)
    got = dist(2, _generated, P(pipeline_model_parallel_size=2), state, prompt)
    assert got[0]["generated_ids"] == got[1]["generated_ids"] == want["generated_ids"]
    assert got[1]["logprobs"] == want["logprobs"]  # (the last stage's)
