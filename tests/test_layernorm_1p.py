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
