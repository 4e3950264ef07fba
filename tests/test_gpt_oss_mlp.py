"""gpt-oss's MLP: Megatron's --quick-geglu, --glu-linear-offset, --activation-func-clamp-value (refused before),
checked against the formula written out by hand (Megatron-Core's unfused GLU in transformer/mlp.py) and against
transformers' GptOssExperts / GptOssTopKRouter."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.checkpoint_flags import defaults_from_checkpoint
from megatron_lite.config import ConfigError, ModelConfig, ParallelConfig
from megatron_lite.parallel_context import ParallelContext

SMALL = "--num-layers 2 --hidden-size 16 --num-attention-heads 4 --seq-length 8 --train-iters 2".split()
MOCK = [*SMALL, "--mock-data", "--vocab-size", "100", "--ffn-hidden-size", "32"]
GPT_OSS = ["--quick-geglu", "--glu-linear-offset", "1", "--activation-func-clamp-value", "7"]


def _by_hand(x, w1, b1, w2, b2, offset=1.0, limit=7.0):
    """fc1 -> [gate; up] halves -> clamp -> gate * sigmoid(1.702 gate) * (up + offset) -> fc2, in fp64."""
    x, w1, w2 = x.double(), w1.double(), w2.double()
    h = x @ w1.T + (b1.double() if b1 is not None else 0)
    f = h.shape[-1] // 2
    gate, up = h[..., :f], h[..., f:]
    gate = torch.minimum(gate, torch.tensor(limit, dtype=torch.float64))
    up = torch.maximum(torch.minimum(up, torch.tensor(limit, dtype=torch.float64)), torch.tensor(-limit).double())
    a = gate / (1 + torch.exp(-1.702 * gate)) * (up + offset)
    return a @ w2.T + (b2.double() if b2 is not None else 0)


def test_the_flags_pick_the_activation_and_a_checkpoint_keeps_them():
    _, job = parse_args([*MOCK, *GPT_OSS])
    m = job.model
    assert (m.activation, m.glu_linear_offset, m.activation_func_clamp_value) == ("quick_geglu", 1.0, 7.0)
    assert m.gated_linear_unit and parse_args([*SMALL, "--mock-data", *GPT_OSS])[1].model.ffn_size == 4 * 16
    saved = defaults_from_checkpoint(job.to_dict())
    assert (saved["quick_geglu"], saved["glu_linear_offset"], saved["activation_func_clamp_value"]) == (True, 1.0, 7.0)
    assert parse_args(MOCK)[1].model.activation_func_clamp_value is None


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--quick-geglu", "--swiglu"], "--swiglu and --quick-geglu both pick the activation"),
        (["--glu-linear-offset", "1"], "--glu-linear-offset 1.0 applies to the quick-GELU gated unit only; add"),
        (["--swiglu", "--activation-func-clamp-value", "7"], "--activation-func-clamp-value 7.0 applies to the quick"),
        (["--quick-geglu", "--activation-func-clamp-value", "0"], "--activation-func-clamp-value 0.0 must be > 0"),
        (["--quick-geglu", "--activation-func-clamp-value", "-7"], "--activation-func-clamp-value -7.0 must be > 0"),
        (["--quick-geglu", "--glu-linear-offset", "nan"], "--glu-linear-offset nan must be a finite number"),
        (["--quick-geglu", "--activation-func-clamp-value", "inf"], "--activation-func-clamp-value inf must be a fin"),
        # (Megatron's SharedExpertMLP asserts --disable-bias-linear)
        (["--num-experts", "4", "--moe-shared-expert-intermediate-size", "32"], "with biases (the default) is not"),
    ],
)
def test_bad_values_are_one_line_at_start_up(flags, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)) as e:
        parse_args([*MOCK, *flags])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_dense_mlp_is_the_clamped_offset_quick_geglu_written_out(kernels):
    """Megatron-Core's unfused GLU (transformer/mlp.py): fc1 + bias, split into [glu; linear] halves, glu clamped
    from above and linear on both sides, quick_gelu(glu) * (linear + offset), fc2 + bias. Weights large enough that
    both clamps bite."""
    from megatron_lite.models.mlp import MLP

    config = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=4, vocab_size=10, ffn_hidden_size=24,
                         activation="quick_geglu", glu_linear_offset=1.0, activation_func_clamp_value=7.0,
                         kernel_impl=kernels, init_method_std=1.0)  # fmt: skip
    mlp = MLP(config, ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu")))
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 1.0, generator=torch.Generator().manual_seed(p.numel()))
    x = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(0))
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    h = x @ fc1.weight.T + fc1.bias
    assert (h[..., :24] > 7).any() and (h[..., 24:] > 7).any() and (h[..., 24:] < -7).any()
    want = _by_hand(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias)
    got = mlp(x)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    # (and the clamp's gradient: none through the clamped entries, as autograd's clamp gives)
    x.requires_grad_(True)
    mlp(x).sum().backward()
    xd = x.detach().double().requires_grad_(True)
    _by_hand(xd, fc1.weight.detach(), fc1.bias.detach(), fc2.weight.detach(), fc2.bias.detach()).sum().backward()
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-4)


def test_export_of_gpt_oss_mlps_is_refused_but_to_gpt_oss():
    """Only GptOssForCausalLM computes the quick-GEGLU experts and biased MoE layers (a model without gpt-oss's
    attention sinks has no Hugging Face class; tests/test_convert_gpt_oss.py exports gpt-oss itself)."""
    from megatron_lite.models.hf import architecture_for, check_exportable

    rope = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--disable-bias-linear"]
    model = parse_args([*MOCK, *rope, *GPT_OSS])[1].model
    with pytest.raises(ConfigError, match="quick_geglu"):
        architecture_for(model)
    with pytest.raises(ConfigError, match=r"gpt-oss's MLP \(--quick-geglu with its offset and clamp, or experts"):
        check_exportable(model, "LlamaForCausalLM")
    biased_moe = parse_args([*MOCK, "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                             "--num-experts", "4"])[1].model  # fmt: skip
    with pytest.raises(ConfigError, match=r"or experts with biases\): only GptOssForCausalLM computes it"):
        check_exportable(biased_moe, "MixtralForCausalLM")


def _moe_config(**kw) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=4, vocab_size=10, ffn_hidden_size=8,
                       num_experts=4, moe_router_topk=2, activation="quick_geglu", glu_linear_offset=1.0,
                       activation_func_clamp_value=7.0, add_bias_linear=True, **kw)  # fmt: skip


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_moe_layer_with_biases_is_transformers_gpt_oss_mlp(kernels, monkeypatch):
    """transformers' GptOssMLP (router with a bias, top-k of the logits then a softmax over them; experts with
    gate_up_proj interleaved, gate at even columns and up at odd, alpha 1.702, limit 7, (up + 1) * glu, and biases;
    each expert's output, down_proj's bias included, weighted by its probability) with its weights mapped by hand
    into the MoE layer; and both against the routing and experts written out. Under --kernel-impl triton the
    experts run as two grouped GEMMs, each row's expert's bias added after them."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from megatron_lite import kernels as K
    from megatron_lite.moe.layer import MoELayer

    from models import record_calls

    sizes = dict(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=7.0)
    hf_config = GptOssConfig(**sizes, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4)
    hf = GptOssMLP(hf_config).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    ours = MoELayer(
        _moe_config(kernel_impl=kernels), ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    )
    e = hf.experts
    with torch.no_grad():
        ours.router.weight.copy_(hf.router.weight)
        ours.router.bias.copy_(hf.router.bias)
        for i, expert in enumerate(ours.experts.local_experts):
            w, b = e.gate_up_proj[i], e.gate_up_proj_bias[i]  # [h, 2f] (x @ w), gate and up interleaved
            expert.linear_fc1.weight.copy_(torch.cat([w[:, 0::2], w[:, 1::2]], dim=1).T)  # our [gate; up] rows
            expert.linear_fc1.bias.copy_(torch.cat([b[0::2], b[1::2]]))
            expert.linear_fc2.weight.copy_(e.down_proj[i].T)
            expert.linear_fc2.bias.copy_(e.down_proj_bias[i])
    x = torch.randn(6, 2, 16, generator=g) * 2  # [seq, batch, hidden]
    grouped = record_calls(monkeypatch, K, "grouped_gemm")
    with torch.no_grad():
        want, _ = hf(x.transpose(0, 1).double())
        got = ours(x)
    assert len(grouped) == (2 if kernels == "triton" else 0)
    want = want.transpose(0, 1)
    gate_up = torch.einsum("th,ehf->tef", x.reshape(-1, 16).double(), e.gate_up_proj) + e.gate_up_proj_bias
    assert (gate_up[..., 0::2] > 7).any() and (gate_up[..., 1::2].abs() > 7).any()  # (both clamps bite)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    # by hand: top-2 of the biased logits, softmax over the two, each expert's clamped offset quick-GEGLU with biases
    t = x.reshape(-1, 16)
    logits = t.double() @ ours.router.weight.double().T + ours.router.bias.double()
    top, idx = logits.topk(2, dim=-1)
    probs = torch.exp(top) / torch.exp(top).sum(-1, keepdim=True)
    by_hand = torch.zeros(t.shape[0], 16, dtype=torch.float64)
    for n in range(t.shape[0]):
        for j in range(2):
            ex = ours.experts.local_experts[int(idx[n, j])]
            f1, f2 = ex.linear_fc1, ex.linear_fc2
            by_hand[n] += probs[n, j] * _by_hand(t[n], f1.weight.detach(), f1.bias.detach(), f2.weight.detach(),
                                                 f2.bias.detach())  # fmt: skip
    torch.testing.assert_close(want.reshape(-1, 16), by_hand, rtol=1e-5, atol=1e-4)  # (ours: fp32 weights)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 needs a GPU: the Triton interpreter has no bf16")
def test_gpu_gpt_oss_moe_layer_in_bf16_runs_grouped_and_matches_fp32():
    """On a GPU (tools/device_checks.sh): gpt-oss's MoE layer in bf16 through the grouped GEMMs with the experts'
    biases against the same layer in fp32 with PyTorch's ops, output and input gradient within bf16's tolerance."""
    from megatron_lite.moe.layer import MoELayer

    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cuda"))
    sizes = dict(hidden_size=256, ffn_hidden_size=512, num_experts=8, moe_router_topk=4)
    layers = {}
    for impl in ("triton", "torch"):
        config = ModelConfig(num_layers=1, num_attention_heads=4, vocab_size=10, activation="quick_geglu",
                             glu_linear_offset=1.0, activation_func_clamp_value=7.0, add_bias_linear=True,
                             kernel_impl=impl, **sizes)  # fmt: skip
        layers[impl] = MoELayer(config, ctx, device=torch.device("cuda"), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for (_, a), (_, b) in zip(layers["torch"].named_parameters(), layers["triton"].named_parameters()):
            a.copy_(torch.randn(a.shape, generator=g) * 0.05)
            b.copy_(a)
    layers["triton"].to(torch.bfloat16)
    x = torch.randn(512, 2, 256, generator=g).cuda()
    outs = {}
    for impl, dtype in (("triton", torch.bfloat16), ("torch", torch.float32)):
        xi = x.to(dtype).requires_grad_()
        y = layers[impl](xi)
        y.float().square().sum().backward()
        outs[impl] = (y.float(), xi.grad.float())
    for a, b in zip(outs["triton"], outs["torch"]):
        assert ((a - b).norm() / b.norm()).item() < 2e-2
