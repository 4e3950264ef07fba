"""gpt-oss's MLP: Megatron's --quick-geglu, --glu-linear-offset, --activation-func-clamp-value (refused before),
checked against the formula written out by hand (Megatron-Core's unfused GLU in transformer/mlp.py) and against
transformers' GptOssExperts / GptOssTopKRouter."""

from __future__ import annotations

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
    ],
)
def test_bad_values_are_one_line_at_start_up(flags, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace("+", r"\+")) as e:
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


def test_export_to_hugging_face_is_refused_until_a_gpt_oss_converter():
    from megatron_lite.models.hf import architecture_for, check_exportable

    rope = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--disable-bias-linear"]
    model = parse_args([*MOCK, *rope, *GPT_OSS])[1].model
    with pytest.raises(ConfigError, match="quick_geglu"):
        architecture_for(model)
    with pytest.raises(ConfigError, match=r"gpt-oss's MLP \(--quick-geglu with its offset and clamp, or experts"):
        check_exportable(model, "LlamaForCausalLM")
