"""Qwen2-MoE (transformers' Qwen2MoeForCausalLM) <-> megatron_lite through tools/checkpoint/convert.py, against
real transformers models with every weight random (biases and the shared-expert gates too): our logits equal
transformers' (per tensor within 1e-5, one process, fp32); the export loads in transformers bit-exact, with the same
logits and the same MoE layers; what either side cannot express is a one-line error."""

from __future__ import annotations

import json
import re

import pytest
import transformers
from convert_flow import converts_both_ways, randomised, tp2_equals_transformers
from test_convert import V

from megatron_lite.config import ConfigError

CASES = {
    # softmax over all experts, top-k not renormalised (--moe-router-pre-softmax); QKV bias; layer 2 dense
    "pre-softmax-bias-dense-layer": dict(norm_topk_prob=False, qkv_bias=True, mlp_only_layers=[2]),
    # renormalised top-k; no QKV bias; MoE on every second layer (1 and 3)
    "renormalised-sparse-step-2": dict(norm_topk_prob=True, qkv_bias=False, decoder_sparse_step=2),
}


def _qwen2_moe_config(**kw) -> transformers.Qwen2MoeConfig:
    return transformers.Qwen2MoeConfig(
        **{
            "vocab_size": V,
            "hidden_size": 64,
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 64,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
            **kw,
        }
    )


def _random_model(config) -> transformers.Qwen2MoeForCausalLM:
    # (transformers starts the router at zeros, biases at zero)
    return randomised(transformers.Qwen2MoeForCausalLM(config), big=("mlp.gate.weight", "shared_expert_gate.weight"))


def _moe_layers(model) -> list[bool]:
    return [type(layer.mlp).__name__ == "Qwen2MoeSparseMoeBlock" for layer in model.model.layers]


@pytest.mark.parametrize("case", list(CASES))
def test_qwen2_moe_converts_both_ways_with_transformers_logits(tmp_path, case):
    model = _random_model(_qwen2_moe_config(**CASES[case]))
    fields = ("norm_topk_prob", "qkv_bias", "shared_expert_intermediate_size", "moe_intermediate_size")
    config, reloaded = converts_both_ways(model, tmp_path, fields)
    assert config.moe_shared_expert_gate and config.moe_shared_expert_intermediate_size == 48
    assert list(config.moe_layers) == _moe_layers(model) == _moe_layers(reloaded)
    assert config.moe_router_pre_softmax == (not model.config.norm_topk_prob)
    assert config.add_qkv_bias == model.config.qkv_bias


def test_qwen2_moe_at_tp2_gives_transformers_logits_and_greedy_generation(dist, tmp_path):
    """The converted model split over TP=2 (the gate replicated, the shared expert's MLP split), with our KV cache."""
    tp2_equals_transformers(dist, _random_model(_qwen2_moe_config(**CASES["pre-softmax-bias-dense-layer"])), tmp_path)


@pytest.mark.parametrize(
    "changes,fragment",
    [
        # transformers windows the even layers below max_window_layers: layer_types says which
        ({"use_sliding_window": True, "max_window_layers": 2}, "use_sliding_window=true (layer_types"),
        ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0 is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_what_qwen2_moe_we_cannot_compute_is_refused(changes, fragment):
    """Read by transformers' config class and, as without transformers installed, from config.json alone (no
    layer_types: our copy of transformers' window rule)."""
    from megatron_lite.checkpoint.hf_convert import _fallback_config
    from megatron_lite.models.hf import config_from_hf

    config = _qwen2_moe_config(**changes)
    raw = {k: v for k, v in config.to_dict().items() if k != "layer_types"}
    for read in (config, _fallback_config(raw)):
        with pytest.raises(ConfigError, match=re.escape(fragment)) as err:
            config_from_hf(read)
        assert "\n" not in str(err.value)


def test_a_qwen2_moe_without_windows_or_experts_reads_as_its_math():
    """max_window_layers 0 windows no layer; num_experts 0 is a dense Qwen2 (its QKV bias kept); a config.json of
    transformers 4.x has no qkv_bias field: the bias is there (4.x always had it)."""
    from megatron_lite.checkpoint.hf_convert import _fallback_config
    from megatron_lite.models.hf import _architecture, config_from_hf

    assert config_from_hf(_qwen2_moe_config(use_sliding_window=True, max_window_layers=0)).sliding_window is None
    dense = config_from_hf(_qwen2_moe_config(num_experts=0, qkv_bias=True))
    assert not dense.num_experts and dense.add_qkv_bias and _architecture(dense) == "Qwen2ForCausalLM"
    raw = json.loads(_qwen2_moe_config().to_json_string())
    del raw["qkv_bias"]
    assert config_from_hf(_fallback_config(raw)).add_qkv_bias


@pytest.mark.parametrize(
    "changes,fragment",
    [
        ({"qk_layernorm": True}, "q/k norms"),
        ({"sliding_window": 4}, "a sliding window"),
        ({"moe_router_topk_scaling_factor": 2.0}, "--moe-router-topk-scaling-factor 2"),
    ],
)
def test_what_qwen2_moe_cannot_compute_is_refused_on_export(changes, fragment):
    from megatron_lite.models.hf import _architecture, check_exportable, hf_config_dict
    from megatron_lite.models.hf_qwen2moe import QWEN2_MOE

    from models import llama_config

    moe = dict(num_experts=4, moe_router_topk=2, add_qkv_bias=True, moe_shared_expert_intermediate_size=32)
    gated = llama_config(**moe, moe_shared_expert_gate=True)
    assert _architecture(gated) == QWEN2_MOE
    assert hf_config_dict(gated, QWEN2_MOE)["qkv_bias"] is True
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        check_exportable(llama_config(**moe, moe_shared_expert_gate=True, **changes), QWEN2_MOE)
    # an ungated shared expert: no Hugging Face class here computes it with softmax routing and no MLA
    ungated = llama_config(**moe)
    with pytest.raises(ConfigError, match="without a gated shared expert"):
        check_exportable(ungated, QWEN2_MOE)
    with pytest.raises(ConfigError, match="shared experts"):
        check_exportable(ungated, _architecture(ungated))
