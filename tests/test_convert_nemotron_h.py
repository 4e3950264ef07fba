"""Nemotron-H (transformers' NemotronHForCausalLM) <-> megatron_lite through tools/checkpoint/convert.py, against a
real transformers model with every weight random (Mamba, attention, MLP and MoE layers): our logits equal
transformers' (its CPU path is its own PyTorch SSD scan; fp32, within 1e-5) in one process and at TP=2; the export
is bit-exact and loads as the same class."""

from __future__ import annotations

import pytest
import torch
import transformers
from convert_flow import IDS, converts_both_ways, randomised
from test_convert import V, _hf_logits, _load_ours, _rel, convert

from megatron_lite.config import ConfigError, ParallelConfig


def _config(**kw) -> transformers.NemotronHConfig:
    return transformers.NemotronHConfig(
        **{
            "vocab_size": V,
            "hidden_size": 32,
            "hybrid_override_pattern": "M*-ME",
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "intermediate_size": 48,
            "ssm_state_size": 8,
            "mamba_num_heads": 8,
            "mamba_head_dim": 8,
            "n_groups": 2,
            "chunk_size": 4,  # (16 tokens: several of transformers' chunks; ours are 128 long)
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "moe_shared_expert_intermediate_size": 24,
            "routed_scaling_factor": 2.5,
            "max_position_embeddings": 64,
            **kw,
        }
    )


def _random_model(config) -> transformers.NemotronHForCausalLM:
    # (routers and their score-correction bias start at zeros in transformers)
    return randomised(transformers.NemotronHForCausalLM(config), big=("gate.weight",), buffers=True)


def test_nemotron_h_converts_both_ways_with_transformers_logits(tmp_path):
    fields = ("layers_block_type", "ssm_state_size", "mamba_num_heads", "n_groups", "routed_scaling_factor")
    config, _ = converts_both_ways(_random_model(_config()), tmp_path, fields)
    assert "".join(config.layer_types) == "M*-ME" and config.position_embedding_type == "none"
    assert (config.mamba_heads, config.mamba_num_groups, config.mamba_state_dim) == (8, 2, 8)


def _logits_at(ckpt: str, parallel: ParallelConfig, ids: list[int]):
    model, _, _ = _load_ours(ckpt, parallel)
    from megatron_lite.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    with torch.no_grad():
        logits = model(torch.tensor([ids]))
        return gather_from_tensor_model_parallel_region(logits, model[0].tp)[0, :, :V].float()


def test_nemotron_h_at_tp2_gives_transformers_logits(dist, tmp_path):
    """Split over TP=2: each rank half the Mamba heads and groups (its in_proj's z, x, B, C, dt rows, its conv
    channels, its gated norm's groups), half the attention heads, half of each expert's rows."""
    model = _random_model(_config())
    hf_dir, ours = str(tmp_path / "hf"), str(tmp_path / "ours")
    model.save_pretrained(hf_dir)
    assert convert.main(["--loader", "hf", "--saver", "megatron_lite", "--load-dir", hf_dir, "--save-dir", ours]) == 0
    ref = _hf_logits(model, IDS)
    results = dist(2, _logits_at, ours, ParallelConfig(tensor_model_parallel_size=2), IDS)
    assert len(results) == 2
    for logits in results:
        assert _rel(logits, ref) <= 1e-5, _rel(logits, ref)


@pytest.mark.parametrize(
    "field,message",
    [
        ({"time_step_limit": (0.0, 0.5)}, r"time_step_limit=\[0.0, 0.5\] \(Megatron's mixer does not clamp dt\)"),
        ({"conv_kernel": 3}, "conv_kernel=3"),
        ({"moe_latent_size": 16}, "moe_latent_size"),
        ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06"),
    ],
)
def test_what_nemotron_h_computes_differently_is_refused(field, message):
    from megatron_lite.models.hf import config_from_hf

    config = _config(**field)
    config.architectures = ["NemotronHForCausalLM"]
    with pytest.raises(ConfigError, match=message):
        config_from_hf(config)


def test_a_tied_nemotron_h_exports_its_output_layer(tmp_path):
    """An exploratory run's finding: a Nemotron-H trained with tied embeddings (our default) exported without
    lm_head.weight, as tied checkpoints are; transformers 5's NemotronHForCausalLM ties nothing, so it loaded a random
    output layer (logits 140% off). The export writes it, and transformers computes our logits."""
    model = _random_model(_config(tie_word_embeddings=True))
    with torch.no_grad():  # (transformers' class keeps its own lm_head: the tied model is the one it equals)
        model.lm_head.weight.copy_(model.get_input_embeddings().weight)
    config, _ = converts_both_ways(model, tmp_path)
    assert config.tied_embeddings
