"""Megatron's --qk-l2-norm and --no-rope-freq (Llama 4) and --attention-output-gate (Qwen3-Next): our attention
against Hugging Face's Llama4TextAttention and Qwen3NextAttention with the weights mapped by hand, the layers
Megatron-Core's rule picks, and the refusals."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.config import ConfigError

HEADS, GROUPS, D, HIDDEN, SEQ = 4, 2, 16, 64, 11
MODEL = f"--num-layers 4 --hidden-size {HIDDEN} --num-attention-heads {HEADS} --kv-channels {D}".split()
MODEL += ["--seq-length", "16", "--train-iters", "2", "--mock-data", "--vocab-size", "100"]
MODEL += ["--position-embedding-type", "rope", "--disable-bias-linear", "--normalization", "RMSNorm"]
MODEL += ["--group-query-attention", "--num-query-groups", str(GROUPS), "--hidden-dropout", "0"]
MODEL += ["--attention-dropout", "0", "--norm-epsilon", "1e-5", "--rotary-base", "500"]


def _model(flags: list[str], seed: int = 5):
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    _, job = parse_args([*MODEL, *flags])
    return build_model(job.model, ParallelContext.virtual(job.parallel, 1), seed=seed)[0]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _causal_mask(b: int, s: int) -> torch.Tensor:
    visible = torch.ones(s, s, dtype=torch.bool).tril()
    return torch.zeros(s, s).masked_fill(~visible, float("-inf")).expand(b, 1, s, s)


def _qkv_blocks(attn, gated: bool):
    """Our fused linear_qkv weight cut into its per-group blocks: [groups, rows per group, hidden] and the row
    ranges of the query, gate, key and value heads in a group (Megatron-Core's layout)."""
    n = HEADS // GROUPS
    w = attn.linear_qkv.weight.view(GROUPS, -1, HIDDEN)
    q, g = slice(0, n * D), slice(n * D, 2 * n * D) if gated else None
    k0 = (2 if gated else 1) * n * D
    return w, q, g, slice(k0, k0 + D), slice(k0 + D, k0 + 2 * D)


def _run(ours, hf, hf_args: dict, x: torch.Tensor, rope):
    """Output and input gradient of our attention ([s, b, h]) and of Hugging Face's ([b, s, h]) on the same x."""
    xo = x.transpose(0, 1).detach().clone().requires_grad_(True)
    xh = x.detach().clone().requires_grad_(True)
    out = ours(xo, rope).transpose(0, 1)
    ref = hf(xh, attention_mask=_causal_mask(*x.shape[:2]), **hf_args)[0]
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3))
    (dx,) = torch.autograd.grad(out, xo, dout)
    (dxh,) = torch.autograd.grad(ref, xh, dout)
    return (out, dx.transpose(0, 1)), (ref, dxh)


def _llama4(layer_idx: int, no_rope_layers: list[int]):
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention, Llama4TextRotaryEmbedding

    config = Llama4TextConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=D, num_hidden_layers=4,
        rms_norm_eps=1e-5, use_qk_norm=True, no_rope_layers=no_rope_layers, attn_temperature_tuning=False,
        rope_parameters={"rope_theta": 500.0, "rope_type": "default"}, attention_bias=False,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return Llama4TextAttention(config, layer_idx), Llama4TextRotaryEmbedding(config)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_l2_norm_and_nope_layers_are_hugging_faces_llama4_attention(kernels):
    """--qk-l2-norm --no-rope-freq 4 --rotary-interleaved: layer 1 (RoPE, L2-normalised q/k) equals transformers'
    Llama4TextAttention with use_qk_norm (its weightless RMS norm, eps = rms_norm_eps; Llama 4 rotates complex
    pairs), output and input gradient; layer 4 (1-based) skips RoPE as Llama 4's NoPE layer (no_rope_layers 0)
    does. Hugging Face puts no L2 norm on NoPE layers where Megatron-Core norms every layer's q/k, so the NoPE
    layer is compared without --qk-l2-norm."""
    flags = ["--kernel-impl", kernels, "--rotary-interleaved", "--no-rope-freq", "4"]
    layers = _model([*flags, "--qk-l2-norm"]).decoder.layers
    nope = _model(flags).decoder.layers[3].self_attention
    x = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1))
    rope_model = _model(flags)
    rope = rope_model.rotary_pos_emb(torch.arange(SEQ).unsqueeze(0).expand(2, SEQ))
    for ours, idx in ((layers[0].self_attention, 0), (nope, 3)):
        hf, rotary = _llama4(idx, [1, 1, 1, 0])  # (Hugging Face's list marks the layers that keep RoPE)
        w, q, _, k, v = _qkv_blocks(ours, gated=False)
        with torch.no_grad():
            hf.q_proj.weight.copy_(w[:, q].reshape(-1, HIDDEN))
            hf.k_proj.weight.copy_(w[:, k].reshape(-1, HIDDEN))
            hf.v_proj.weight.copy_(w[:, v].reshape(-1, HIDDEN))
            hf.o_proj.weight.copy_(ours.linear_proj.weight)
        assert hasattr(hf, "qk_norm") == (idx == 0)
        freqs = rotary(x, torch.arange(SEQ).unsqueeze(0).expand(2, SEQ))
        got, want = _run(ours, hf, {"position_embeddings": freqs}, x, rope)
        for name, a, b in zip(("out", "dx"), got, want):
            assert _err(a, b) <= 1e-5, (idx, name, _err(a, b))
    # the L2 norm on the NoPE layer too (Megatron): each q/k head scaled to unit RMS, worked out by hand
    attn = layers[3].self_attention
    h = x.transpose(0, 1)
    w, q, _, k, v = _qkv_blocks(attn, gated=False)
    qs = (h @ w[:, q].reshape(-1, HIDDEN).T).view(SEQ, 2, HEADS, D)
    ks = (h @ w[:, k].reshape(-1, HIDDEN).T).view(SEQ, 2, GROUPS, D)
    vs = (h @ w[:, v].reshape(-1, HIDDEN).T).view(SEQ, 2, GROUPS, D)
    qs, ks = (t / (t.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() for t in (qs, ks))
    ks, vs = ks.repeat_interleave(HEADS // GROUPS, 2), vs.repeat_interleave(HEADS // GROUPS, 2)
    scores = torch.einsum("ibhd,jbhd->bhij", qs, ks) / D**0.5 + _causal_mask(2, SEQ)
    o = torch.einsum("bhij,jbhd->ibhd", scores.softmax(-1), vs).reshape(SEQ, 2, -1)
    with torch.no_grad():
        assert _err(attn(h, rope), o @ attn.linear_proj.weight.T) <= 1e-5


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_output_gate_is_hugging_faces_qwen3_next_attention(kernels):
    """--attention-output-gate (with Qwen3-Next's --qk-layernorm, zero-centred RMS norms and RoPE on a quarter of
    each head): equals transformers' Qwen3NextAttention, whose q_proj makes each head's query and gate side by
    side, mapped to our rows (per query group: its query heads, then their gates, then key and value), output
    and input gradient."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextRotaryEmbedding

    flags = ["--kernel-impl", kernels, "--attention-output-gate", "--qk-layernorm", "--apply-layernorm-1p"]
    model = _model([*flags, "--rotary-percent", "0.25"])
    ours = model.decoder.layers[0].self_attention
    config = Qwen3NextConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=D, rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 500.0, "rope_type": "default", "partial_rotary_factor": 0.25},
        attention_bias=False,
    )  # fmt: skip
    config._attn_implementation = "eager"
    hf = Qwen3NextAttention(config, 0)
    w, q, g, k, v = _qkv_blocks(ours, gated=True)
    with torch.no_grad():
        ours.q_layernorm.weight.normal_(0, 0.3)  # (zeros at init: 1 + w)
        ours.k_layernorm.weight.normal_(0, 0.3)
        qg = torch.stack([w[:, q].reshape(HEADS, D, HIDDEN), w[:, g].reshape(HEADS, D, HIDDEN)], dim=1)
        hf.q_proj.weight.copy_(qg.reshape(-1, HIDDEN))  # per head: its query rows, then its gate rows
        hf.k_proj.weight.copy_(w[:, k].reshape(-1, HIDDEN))
        hf.v_proj.weight.copy_(w[:, v].reshape(-1, HIDDEN))
        hf.o_proj.weight.copy_(ours.linear_proj.weight)
        hf.q_norm.weight.copy_(ours.q_layernorm.weight)
        hf.k_norm.weight.copy_(ours.k_layernorm.weight)
    x = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    rope = model.rotary_pos_emb(positions)
    cos_sin = Qwen3NextRotaryEmbedding(config)(x, positions)
    got, want = _run(ours, hf, {"position_embeddings": cos_sin}, x, rope)
    for name, a, b in zip(("out", "dx"), got, want):
        assert _err(a, b) <= 1e-5, (name, _err(a, b))


@pytest.mark.parametrize(
    "freq, nope",
    [
        ("4", [False, False, False, True]),  # (Megatron: [0]*(N-1) + [1] repeated, 1-based layer N, 2N, ...)
        ("2", [False, True, False, True]),
        ("1", [True] * 4),
        ("0", [False] * 4),  # (Megatron: a falsy no_rope_freq is unset)
        ("([0]*3+[1]*1)", [False, False, False, True]),
        ("[1,0,0,1]", [True, False, False, True]),
    ],
)
def test_no_rope_freq_skips_the_layers_megatron_skips(freq, nope):
    """Megatron-Core's TransformerConfig turns an integer N into ([0] * (N - 1) + [1]) * (num_layers / N), and
    Attention.forward reads no_rope_freq[layer_number - 1]: 1 skips RoPE."""
    _, job = parse_args([*MODEL, "--no-rope-freq", freq])
    assert [job.model.skips_rope(i) for i in range(4)] == nope
    assert [layer.self_attention.skips_rope for layer in _model(["--no-rope-freq", freq]).decoder.layers] == nope


def test_gate_rows_double_the_query_rows():
    """linear_qkv grows by heads x head_dim gate rows (Megatron-Core's linear_qkv_out_dim); their place in each
    query group is what the Qwen3-Next comparison above checks, their split over TP the equivalence tests."""
    from megatron_lite.models.attention import qkv_output_size

    _, job = parse_args([*MODEL, "--attention-output-gate"])
    assert qkv_output_size(job.model) == (2 * HEADS + 2 * GROUPS) * D
    attn = _model(["--attention-output-gate"]).decoder.layers[0].self_attention
    assert attn.linear_qkv.weight.shape == ((2 * HEADS + 2 * GROUPS) * D, HIDDEN)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--no-rope-freq", "3"], "--no-rope-freq 3 must be >= 1 and divide --num-layers 4"),
        (["--no-rope-freq", "[1,0]"], r"--no-rope-freq pattern \[1, 0\] must hold one 0 .RoPE. or 1"),
        (["--no-rope-freq", "[1,0,2,1]"], "must hold one 0 .RoPE. or 1 .no RoPE. per layer"),
        (["--no-rope-freq", "2", "--mtp-num-layers", "1"], "--no-rope-freq with --mtp-num-layers is not supported"),
        (["--no-rope-freq", "2", "--position-embedding-type", "learned_absolute"], "picks nothing to skip"),
        (["--qk-l2-norm", "--qk-layernorm"], "--qk-l2-norm with --qk-layernorm: Megatron's layer spec takes"),
        (["--qk-l2-norm", "--multi-latent-attention"], "--qk-l2-norm with --multi-latent-attention is not"),
        (["--attention-output-gate", "--multi-latent-attention"], "--attention-output-gate with --multi-latent"),
        (["--attention-output-gate", "--lora-rank", "4"], "--lora-target-modules linear_qkv with --attention-output"),
    ],
)
def test_bad_combinations_are_refused_at_start_up(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args([*MODEL, *flags])


@pytest.mark.parametrize(
    "flags, what",
    [
        (["--qk-l2-norm"], r"L2-normalised queries and keys \(--qk-l2-norm, Llama 4\)"),
        (["--no-rope-freq", "4"], r"layers without RoPE \(--no-rope-freq, Llama 4\)"),
        (["--attention-output-gate"], r"the attention output gate \(--attention-output-gate, Qwen3-Next\)"),
    ],
)
def test_hugging_face_export_refuses_them(flags, what):
    from megatron_lite.models.hf import check_exportable

    with pytest.raises(ConfigError, match=what):
        check_exportable(parse_args([*MODEL, *flags])[1].model, "LlamaForCausalLM")


def test_a_checkpoint_keeps_the_gate_l2_norm_and_nope_layers(tmp_path, capsys, monkeypatch):
    """--load brings back --attention-output-gate, --qk-l2-norm and --no-rope-freq (architecture flags: the gate's
    rows are inside linear_qkv's tensor, and the other two change the math without a tensor to show it); the
    same values again are no conflict, another value is a one-line conflict."""
    from test_pretrain_cli import _one_line_error, _run

    ckpt = str(tmp_path / "ckpt")
    flags = ["--mock-data", "--vocab-size", "100", "--position-embedding-type", "rope", "--no-rope-freq", "[0,1]"]
    flags += ["--qk-l2-norm"]
    rc, _, err = _run([*flags, "--attention-output-gate", "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    again = ["--mock-data", "--vocab-size", "100", "--load", ckpt, "--train-iters", "4"]
    rc, out, err = _run([*again, "--no-rope-freq", "0,1"], capsys, monkeypatch)
    assert rc == 0 and "loaded" in out, err
    rc, _, err = _run([*again, "--no-rope-freq", "2"], capsys, monkeypatch)
    _one_line_error(rc, err, "--no-rope-freq 2 conflicts with the checkpoint")


def test_the_planner_and_the_flops_count_the_gate_rows():
    """The planner's parameter count equals the built gated model's at TP=2 (each rank's half of the gate rows),
    and the FLOPs per token grow by the gate's GEMM, 2 x hidden x heads x head_dim a layer, three times (training)."""
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.planner.layout import Layout
    from megatron_lite.planner.params import stage_params
    from megatron_lite.training.flops import flops_per_token

    config = parse_args([*MODEL, "--attention-output-gate"])[1].model
    layout = Layout(tp=2)
    for rank in range(2):
        chunks = build_model(config, ParallelContext.virtual(layout.parallel_config(), 2, rank), device="meta")
        assert stage_params(config, layout, 0).dense == sum(p.numel() for p in chunks.parameters())
    plain = parse_args(MODEL)[1].model
    gate = 3 * 4 * 2 * HIDDEN * HEADS * D  # (4 layers)
    assert flops_per_token(config, 16) - flops_per_token(plain, 16) == gate
