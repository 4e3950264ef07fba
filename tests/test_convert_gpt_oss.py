"""gpt-oss (transformers' GptOssForCausalLM) <-> megatron_lite through tools/checkpoint/convert.py, against real
transformers models with every weight random (sinks, biases, router): our logits equal transformers' (per tensor
within 1e-5, fp32; one process and TP=2 with our KV cache's greedy generation); the export loads in transformers
bit-exact; the Hub's MXFP4 expert weights are dequantised as transformers dequantises them."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from convert_flow import converts_both_ways, randomised, tp2_equals_transformers
from test_convert import V, _load_ours, convert

from megatron_lite.config import ConfigError, ParallelConfig


def _config(**kw) -> transformers.GptOssConfig:
    return transformers.GptOssConfig(
        **{
            "vocab_size": V,
            "hidden_size": 64,
            "intermediate_size": 32,
            "head_dim": 16,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 64,
            "sliding_window": 5,  # (16 tokens: longer than the window)
            "swiglu_limit": 1.5,  # (small enough that the clamps bite on random weights)
            # YaRN as gpt-oss's, scaled down: original length 8, factor 4, truncate false
            "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 8, "rope_theta": 5e3},
            **kw,
        }
    )  # fmt: skip


def _random_model(config) -> transformers.GptOssForCausalLM:
    # (transformers starts biases and the router at zeros; sinks uninitialised)
    return randomised(transformers.GptOssForCausalLM(config), big=("router.weight", "sinks", "router.bias"))


def test_gpt_oss_converts_both_ways_with_transformers_logits(tmp_path):
    fields = ("layer_types", "sliding_window", "swiglu_limit", "head_dim", "num_local_experts", "attention_bias")
    # (the export wrote our 0 over router_aux_loss_coef, transformers' training setting: kept as the others keep it)
    fields += ("router_aux_loss_coef",)
    config, _ = converts_both_ways(_random_model(_config(router_aux_loss_coef=0.02)), tmp_path, fields)
    assert (config.softmax_type, config.activation, config.glu_linear_offset) == ("learnable", "quick_geglu", 1.0)
    assert config.activation_func_clamp_value == 1.5 and config.add_bias_linear and config.num_experts == 4
    # layer_types alternate sliding / full from the first layer: Megatron's --window-attn-skip-freq 2
    assert config.window_attn_skip_freq == 2 and config.sliding_window == 5
    assert [config.layer_window(i) for i in range(4)] == [5, None, 5, None]


def test_gpt_oss_at_tp2_gives_transformers_logits_and_greedy_generation(dist, tmp_path):
    """Split over TP=2 (each rank its heads' sinks, its experts' fc1 rows), generating with our KV cache."""
    tp2_equals_transformers(dist, _random_model(_config()), tmp_path)


def test_mxfp4_dequantisation_is_transformers_own():
    """The Hub's gpt-oss experts: e2m1 codes two a byte (low nibble first) and an e8m0 scale a 32-value block; a
    byte worked out by hand, and random blocks against transformers' convert_moe_packed_tensors."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from megatron_lite.models.hf_gpt_oss import dequantize_mxfp4

    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x2B  # low nibble 0xB = -1.5, high nibble 0x2 = +1.0
    scales = torch.full((1, 1), 129, dtype=torch.uint8)  # 2^(129 - 127) = 4
    assert dequantize_mxfp4(blocks, scales)[0, :2].tolist() == [-6.0, 4.0]
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 2), generator=g, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales)  # [E, in, out]: transposed, as GptOssExperts holds them
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), theirs)


def test_an_mxfp4_checkpoint_converts_to_the_dequantised_model(tmp_path):
    """A checkpoint whose experts are stored as the Hub stores gpt-oss's (gate_up_proj_blocks / _scales, down_proj
    likewise, quantization_config mxfp4) converts to the weights those blocks hold: the same checkpoint as the model
    with the dequantised weights in place."""
    from safetensors.torch import load_file, save_file

    model = _random_model(_config(num_hidden_layers=2))
    plain, packed, a, b = (tmp_path / k for k in ("plain", "packed", "a", "b"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:  # weights MXFP4 can hold: random blocks and scales, dequantised
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(layer.mlp.experts, name)
                rows, cols = w.shape[2], w.shape[1]
                blocks = torch.randint(0, 256, (w.shape[0], rows, cols // 32, 16), generator=g, dtype=torch.uint8)
                scales = torch.randint(120, 125, (w.shape[0], rows, cols // 32), generator=g, dtype=torch.uint8)
                layer.mlp.experts.register_buffer(f"_{name}_packed", blocks, persistent=False)
                layer.mlp.experts.register_buffer(f"_{name}_scales", scales, persistent=False)
                from transformers.integrations.mxfp4 import convert_moe_packed_tensors

                w.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    model.save_pretrained(str(plain))
    model.save_pretrained(str(packed))
    tensors = load_file(str(packed / "model.safetensors"))
    for i, layer in enumerate(model.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{i}.mlp.experts.{name}"
            del tensors[key]
            tensors[key + "_blocks"] = getattr(layer.mlp.experts, f"_{name}_packed")
            tensors[key + "_scales"] = getattr(layer.mlp.experts, f"_{name}_scales")
    save_file(tensors, str(packed / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((packed / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (packed / "config.json").write_text(json.dumps(raw))
    for src, dst in ((plain, a), (packed, b)):
        assert convert.main(["--loader", "hf", "--saver", "megatron_lite", "--load-dir", str(src),
                             "--save-dir", str(dst)]) == 0  # fmt: skip
    ours_a, ours_b = (_load_ours(str(d), ParallelConfig())[0].state_dict() for d in (a, b))
    for k, v in ours_a.items():
        if "experts" in k and "weight" in k:  # (bf16 dequantisation of values bf16 holds exactly)
            assert torch.equal(ours_b[k].float(), v.float()), k


@pytest.mark.parametrize(
    "changes,fragment",
    [
        ({"swiglu_alpha": 1.5}, "swiglu_alpha 1.5 is not supported"),
        ({"attention_bias": False}, "attention_bias=false is not supported"),
        ({"layer_types": ["sliding_attention"] * 3 + ["chunked_attention"]}, "layer_types"),
    ],
)
def test_what_gpt_oss_we_cannot_compute_is_refused(changes, fragment):
    from megatron_lite.models.hf import config_from_hf

    with pytest.raises(ConfigError, match=fragment):
        config_from_hf(_config(**changes))


def test_a_non_alternating_window_pattern_converts_as_a_pattern():
    from megatron_lite.models.hf import config_from_hf

    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    config = config_from_hf(_config(layer_types=types))
    assert config.window_attn_skip_freq == (0, 1, 1, 0)
    assert [config.layer_window(i) for i in range(4)] == [None, 5, 5, None]


def test_a_peft_export_of_gpt_oss_expert_adapters_is_refused():
    """Its experts' PEFT layout ([E, hidden, 2 ffn], gate and up interleaved) is not Mixtral's, which the expert
    adapters' map writes: refused in one line (attention adapters export)."""
    from megatron_lite.lora.config import LoraConfig
    from megatron_lite.lora.peft import to_peft
    from megatron_lite.models.hf import config_from_hf

    config = config_from_hf(_config(num_hidden_layers=1))
    lora = LoraConfig(rank=2, alpha=4.0)
    attention = {f"decoder.layers.0.self_attention.linear_proj.lora.pairs.proj.{w}": torch.zeros(2, 2) for w in "AB"}
    tensors, adapter_config = to_peft(attention, config, lora, "GptOssForCausalLM")
    assert adapter_config["target_modules"] == ["o_proj"] and len(tensors) == 2
    expert = {f"decoder.layers.0.mlp.experts.1.linear_fc1.lora.pairs.fc1.{w}": torch.zeros(2, 2) for w in "AB"}
    with pytest.raises(ConfigError, match="gpt-oss's experts hold gate_up_proj as .experts, hidden, 2 x ffn."):
        to_peft({**attention, **expert}, config, lora, "GptOssForCausalLM")


def test_a_gpt_oss_without_windowed_layers_exports_a_model_transformers_runs(tmp_path):
    """Every layer full attention: the export wrote sliding_window null over the original's 5, and transformers'
    GptOss forward then raised ("Could not find a sliding_window argument"). The value unused by any layer stays."""
    config, _ = converts_both_ways(
        _random_model(_config(layer_types=["full_attention"] * 4)), tmp_path, ("layer_types", "sliding_window")
    )
    assert [config.layer_window(i) for i in range(4)] == [None] * 4
