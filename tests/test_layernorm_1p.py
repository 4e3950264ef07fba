"""--apply-layernorm-1p (Megatron; Transformer Engine's zero-centred gamma): norm weights stored as gamma - 1,
zeros at init, applied as 1 + weight. The model computes what the plain model computes with gamma = 1 + w,
forward and backward, with RMSNorm and LayerNorm, with the PyTorch and Triton norms; exported to Hugging
Face, the weights hold gamma and transformers gives our logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_lite.config import ParallelConfig
from megatron_lite.models.gpt_model import GPTModel
from megatron_lite.parallel_context import ParallelContext

from models import CONFIGS, DEVICE, VOCAB, perturbed_full_state, rel


def _pair(name: str, impl: str):
    ctx = ParallelContext.virtual(ParallelConfig(), device=DEVICE)
    plain_cfg = dataclasses.replace(CONFIGS[name](), kernel_impl=impl)
    one_p_cfg = dataclasses.replace(plain_cfg, apply_layernorm_1p=True)
    return GPTModel(plain_cfg, ctx, seed=3), GPTModel(one_p_cfg, ctx, seed=3), plain_cfg


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_zero_centred_norms_compute_the_plain_model_with_gamma_one_plus_w(name, impl):
    plain, one_p, config = _pair(name, impl)
    norms = [k for k in plain.full_state_dict() if k.endswith("layernorm.weight")]
    assert norms and all(one_p.full_state_dict()[k].abs().max() == 0 for k in norms)  # zeros at init
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    torch.testing.assert_close(one_p(ids), plain(ids), rtol=0, atol=0)  # gamma = 1 either way
    state = {k: v.to(DEVICE) for k, v in perturbed_full_state(config).items()}
    plain.load_full_state_dict(state)
    one_p.load_full_state_dict({k: v - 1 if k in norms else v for k, v in state.items()})
    labels = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    losses = [m(ids, labels=labels).mean() for m in (plain, one_p)]
    assert rel(losses[1], losses[0]) < 1e-6
    for loss in losses:
        loss.backward()
    grads = [dict(m.named_parameters()) for m in (plain, one_p)]
    bad = {
        k: rel(grads[1][k].grad, grads[0][k].grad) for k in grads[0] if rel(grads[1][k].grad, grads[0][k].grad) > 1e-5
    }
    assert not bad, bad  # d(1 + w)/dw = 1: the norm weights' gradients too


def test_hugging_face_export_holds_gamma():
    transformers = pytest.importorskip("transformers")
    from megatron_lite.models.hf_weights import state_dict_to_hf

    _, one_p, config = _pair("llama", "torch")
    one_p.to("cpu")
    cfg = dataclasses.replace(config, apply_layernorm_1p=True)
    state = perturbed_full_state(config)
    one_p.load_full_state_dict({k: v - 1 if k.endswith("layernorm.weight") else v for k, v in state.items()})
    hf_cfg = transformers.LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                                      intermediate_size=config.ffn_size, num_hidden_layers=config.num_layers,
                                      num_attention_heads=config.num_attention_heads,
                                      num_key_value_heads=config.query_groups, rms_norm_eps=config.norm_epsilon,
                                      rope_theta=config.rotary_base, max_position_embeddings=64,
                                      tie_word_embeddings=False)  # fmt: skip
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.load_state_dict(state_dict_to_hf(one_p.full_state_dict(), cfg, "LlamaForCausalLM"), strict=False)
    torch.testing.assert_close(hf.model.norm.weight, state["decoder.final_layernorm.weight"])
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (hf(ids).logits - one_p(ids)[..., : config.vocab_size]).abs().max() < 1e-4


@pytest.mark.parametrize("norm", ["RMSNorm", "LayerNorm"])
def test_a_bf16_zero_centred_weight_adds_its_one_in_fp32(norm):
    """From a review against Megatron-Core (Transformer Engine adds the 1 to gamma in fp32): 1 + w was rounded to
    the bf16 weight's dtype, so gamma moved in steps of 2^-7 above 1 and a weight of 0.001 or 0.003 did nothing
    (the output of w = 0 bit for bit). Now gamma = 1 + w in fp32, the rows rounded once, in their dtype."""
    from megatron_lite.models.norms import LayerNorm, RMSNorm

    cls = RMSNorm if norm == "RMSNorm" else LayerNorm
    layer = cls(64, 1e-5, dtype=torch.bfloat16, zero_centered=True)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 3
    outs = {}
    for w in (0.0, 0.003):
        with torch.no_grad():
            layer.weight.fill_(w)
            if norm == "LayerNorm":
                layer.bias.zero_()
        outs[w] = layer(x)
        assert outs[w].dtype == torch.bfloat16
    xd = x.double()
    xhat = (
        xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
        if norm == "RMSNorm"
        else torch.nn.functional.layer_norm(xd, (64,), eps=1e-5)
    )
    expected = (xhat * (1 + torch.tensor(0.003, dtype=torch.bfloat16).double())).to(torch.bfloat16)
    assert not torch.equal(outs[0.003], outs[0.0])
    # within one bf16 rounding of the fp64 value (RMSNorm rounds the normalised rows first, as transformers)
    assert (outs[0.003].double() - expected.double()).abs().max() <= 2 * 2**-8 * expected.double().abs().max()
