"""GLM-4.5-style MoE (transformers' Glm4MoeForCausalLM) <-> megatron_lite through tools/checkpoint/convert.py, against
real transformers models with every weight random (QKV biases, q/k norms, the router's score-correction bias too):
our logits equal transformers' (per tensor within 1e-5, fp32; one process and TP=2 with our KV cache's greedy
generation); the export loads in transformers bit-exact, with the same logits; a checkpoint's multi-token-prediction
layer (DeepSeek-V3's layout, which transformers skips) round-trips; what either side cannot express is one line."""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from convert_flow import IDS, converts_both_ways, randomised, tp2_equals_transformers
from safetensors.torch import save_file
from test_convert import V, _hf_logits, _load_ours, _tensors, convert

from megatron_lite.config import ConfigError, ParallelConfig

CASES = {
    # GLM-4.5's shape: QKV bias, q/k norms, head_dim 32 (not hidden / heads), partial RoPE 0.5 (the class default),
    # four expert groups of which two are kept, ranked by their top-2 sums (Megatron's rule would take the top
    # k // 2 = 1), two shared experts, routed_scaling_factor 2.5, one dense layer first
    "bias-qk-norm-groups": dict(
        attention_bias=True, use_qk_norm=True, head_dim=32, n_routed_experts=8, n_group=4, topk_group=2,
        n_shared_experts=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
    ),
    # no bias or q/k norms, tied embeddings, a quarter of each head rotated under YaRN, top-1 routing (not
    # renormalised), MoE from the first layer
    "tied-yarn-top1": dict(
        tie_word_embeddings=True, num_experts_per_tok=1, norm_topk_prob=False, first_k_dense_replace=0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "rope_theta": 5e3, "partial_rotary_factor": 0.25},
    ),
}  # fmt: skip


def _config(**kw) -> transformers.Glm4MoeConfig:
    return transformers.Glm4MoeConfig(
        **{
            "vocab_size": V,
            "hidden_size": 64,
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 64,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e3, "partial_rotary_factor": 0.5},
            **kw,
        }
    )


def _random_model(config) -> transformers.Glm4MoeForCausalLM:
    # (transformers starts the router, its correction bias and the QKV biases at zeros)
    big = ("mlp.gate.weight", "e_score_correction_bias")
    return randomised(transformers.Glm4MoeForCausalLM(config), big=big, buffers=True)


def _moe_layers(model) -> list[bool]:
    return [type(layer.mlp).__name__ == "Glm4MoeMoE" for layer in model.model.layers]


@pytest.mark.parametrize("case", list(CASES))
def test_glm4_moe_converts_both_ways_with_transformers_logits(tmp_path, case):
    model = _random_model(_config(**CASES[case]))
    fields = ("attention_bias", "use_qk_norm", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
              "n_shared_experts", "first_k_dense_replace", "tie_word_embeddings")  # fmt: skip
    config, reloaded = converts_both_ways(model, tmp_path, fields)
    c = model.config
    assert list(config.moe_layers) == _moe_layers(model) == _moe_layers(reloaded)
    assert config.moe_router_score_function == "sigmoid"
    assert config.add_qkv_bias == c.attention_bias and not config.add_bias_linear
    assert config.qk_layernorm == c.use_qk_norm and config.rotary_percent == c.rope_parameters["partial_rotary_factor"]
    assert config.moe_shared_expert_intermediate_size == c.n_shared_experts * c.moe_intermediate_size
    assert config.moe_router_group_score_topn == (2 if c.n_group > 1 else None)
    rope = reloaded.config.rope_parameters  # (YaRN's defaults written out)
    assert {k: rope[k] for k in c.rope_parameters} == c.rope_parameters


def test_a_dense_glm4_moe_converts_both_ways(tmp_path):
    """first_k_dense_replace = num_hidden_layers: no MoE layer. Exported back to GLM-4-MoE (no Qwen class computes
    QKV bias with partial RoPE), bit-exact, with transformers' logits."""
    model = _random_model(_config(attention_bias=True, first_k_dense_replace=3))
    config, reloaded = converts_both_ways(model, tmp_path)
    assert not config.num_experts and config.add_qkv_bias and config.rotary_percent == 0.5
    assert not any(_moe_layers(reloaded))


def test_glm4_moe_at_tp2_gives_transformers_logits_and_greedy_generation(dist, tmp_path):
    """The converted model split over TP=2 (QKV biases and q/k norms, the shared experts split), with our KV cache."""
    tp2_equals_transformers(dist, _random_model(_config(**CASES["bias-qk-norm-groups"])), tmp_path)


def test_a_glm4_moe_multi_token_prediction_layer_round_trips(tmp_path):
    """GLM-4.5's checkpoints hold num_nextn_predict_layers MTP layers after the last (enorm, hnorm, eh_proj,
    shared_head.norm, a full MoE decoder layer, and copies of the embedding and output layer), which transformers
    skips: they convert to our --mtp-num-layers depth and export back bit-exact, the main logits unchanged."""
    model = _random_model(_config(**CASES["bias-qk-norm-groups"]))
    hf_dir, ours, back = (str(tmp_path / k) for k in ("hf", "ours", "back"))
    model.save_pretrained(hf_dir)
    hf, n = _tensors(hf_dir), model.config.num_hidden_layers
    torch.manual_seed(1)
    last = f"model.layers.{n - 1}."
    mtp = {f"model.layers.{n}." + k.removeprefix(last): t + 0.05 * torch.randn_like(t)
           for k, t in hf.items() if k.startswith(last)}  # fmt: skip
    p = f"model.layers.{n}."
    mtp |= {p + k: 1 + 0.1 * torch.randn(64) for k in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")}
    mtp[p + "eh_proj.weight"] = 0.08 * torch.randn(64, 128)
    mtp[p + "embed_tokens.weight"] = hf["model.embed_tokens.weight"].clone()
    mtp[p + "shared_head.head.weight"] = hf["lm_head.weight"].clone()
    save_file(hf | mtp, f"{hf_dir}/model.safetensors", metadata={"format": "pt"})
    assert convert.main(["--loader", "hf", "--saver", "megatron_lite", "--load-dir", hf_dir, "--save-dir", ours]) == 0

    from megatron_lite.checkpoint.hf_convert import read_model_tensors

    _, _, config = _load_ours(ours, ParallelConfig())  # (it loads: every tensor is there, with its shape)
    assert config.mtp_num_layers == 1 and config.is_moe_layer(n)
    state = read_model_tensors(ours)[1]
    assert torch.equal(state["mtp.layers.0.eh_proj.weight"], mtp[p + "eh_proj.weight"])
    q_bias = state["mtp.layers.0.transformer_layer.self_attention.linear_qkv.bias"]
    assert q_bias.shape == (4 * 32 + 2 * 2 * 32,)
    assert torch.equal(state["mtp.layers.0.transformer_layer.mlp.router.expert_bias"],
                       mtp[p + "mlp.gate.e_score_correction_bias"])  # fmt: skip
    assert convert.main(["--loader", "megatron_lite", "--saver", "hf", "--load-dir", ours, "--save-dir", back]) == 0
    a, b = hf | mtp, _tensors(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), sorted(a.keys() ^ b.keys())[:4]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    assert reloaded.config.num_nextn_predict_layers == 1
    assert torch.equal(_hf_logits(reloaded, IDS), _hf_logits(model, IDS))


@pytest.mark.parametrize(
    "changes,fragment",
    [
        ({"norm_topk_prob": False}, "norm_topk_prob=false with num_experts_per_tok=2 is not supported"),
        ({"num_experts_per_tok": 1}, "norm_topk_prob=true with num_experts_per_tok=1 is not supported"),
        ({"n_shared_experts": 0}, "n_shared_experts=0 is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"mlp_bias": True}, "mlp_bias=true is not supported"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope type 'dynamic'"),
    ],
)
def test_what_glm4_moe_we_cannot_compute_is_refused(changes, fragment):
    """Read by transformers' config class and, as without transformers installed, from config.json alone."""
    from megatron_lite.checkpoint.hf_convert import _fallback_config
    from megatron_lite.models.hf import config_from_hf

    config = _config(**changes)
    for read in (config, _fallback_config(config.to_dict())):
        with pytest.raises(ConfigError, match=re.escape(fragment)) as err:
            config_from_hf(read)
        assert "\n" not in str(err.value)


def test_a_glm4_moe_config_json_without_transformers_reads_as_with_it():
    """GLM-4.5's config.json writes partial_rotary_factor and rope_theta at the top level (transformers 4.x); a
    field left at its class default is absent: the fallback reads both as transformers does."""
    from megatron_lite.checkpoint.hf_convert import _fallback_config
    from megatron_lite.models.hf import config_from_hf

    raw = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": V, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 32, "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
           "rope_theta": 1e6, "partial_rotary_factor": 0.5, "attention_bias": True}  # fmt: skip
    ours = config_from_hf(_fallback_config(raw))
    assert ours == config_from_hf(transformers.Glm4MoeConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
    assert (ours.rotary_percent, ours.rotary_base, ours.add_qkv_bias, ours.moe_layers) == (0.5, 1e6, True, (0, 1, 1))


@pytest.mark.parametrize(
    "changes,fragment",
    [
        ({"moe_shared_expert_intermediate_size": None}, "a shared expert of 0"),
        ({"moe_shared_expert_intermediate_size": 48}, "a shared expert of 48"),
        ({"moe_layer_freq": (1, 0, 1)}, "dense layers after the first MoE layer"),
        ({"moe_router_num_groups": 2, "moe_router_group_topk": 1, "moe_router_group_score_topn": 1}, "top 2 scores"),
        ({"sliding_window": 4}, "a sliding window"),
        ({"moe_shared_expert_gate": True}, "a gated shared expert"),
        ({"moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False}, "softmax routing"),
    ],
)
def test_what_glm4_moe_cannot_compute_is_refused_on_export(changes, fragment):
    from megatron_lite.models.hf import _architecture, check_exportable, hf_config_dict
    from megatron_lite.models.hf_glm4moe import GLM4_MOE

    from models import llama_config

    moe = dict(num_layers=3, num_experts=4, moe_router_topk=2, moe_router_score_function="sigmoid",
               moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=64, moe_ffn_hidden_size=32,
               add_qkv_bias=True, rotary_percent=0.5)  # fmt: skip
    glm = llama_config(**moe)
    assert _architecture(glm) == GLM4_MOE
    fields = hf_config_dict(glm, GLM4_MOE)
    assert (fields["n_shared_experts"], fields["attention_bias"], fields["rope_parameters"]["partial_rotary_factor"]) \
        == (2, True, 0.5)  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape(fragment)) as err:
        check_exportable(llama_config(**(moe | changes)), GLM4_MOE)
    assert "\n" not in str(err.value) and str(err.value).startswith(f"cannot export to {GLM4_MOE}")
