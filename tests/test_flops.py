"""The FLOPs formula against two published closed forms and a parameter count."""

from __future__ import annotations

import pytest

from megatron_lite.config import ParallelConfig
from megatron_lite.models.gpt_model import GPTModel
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.training.flops import flops_per_token

from models import gpt2_config, llama_config


def test_gpt_matches_megatron_closed_form():
    c = gpt2_config(num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=50304)
    B, s, L, h, V = 8, 2048, 24, 2048, 50304
    megatron = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert flops_per_token(c, s) * B * s == pytest.approx(megatron, rel=1e-12)


@pytest.mark.parametrize("make", [llama_config, gpt2_config])
def test_six_n_plus_attention(make):
    """torchtitan's form: 6 N + 12 L s heads d per token, N = parameters of every matmul (the output
    layer included, the input embedding and norms and biases excluded), counted from a real model."""
    c = make(untie_embeddings_and_output_weights=True)
    s = 32
    model = GPTModel(c, ParallelContext.virtual(ParallelConfig()), device="meta")
    n = sum(p.numel() for name, p in model.named_parameters() if p.ndim == 2 and "embedding" not in name)
    n -= (c.padded_vocab_size(1) - c.vocab_size) * c.hidden_size  # padding rows are not real work
    expected = 6 * n + 12 * c.num_layers * s * c.num_attention_heads * c.head_dim
    assert flops_per_token(c, s) == pytest.approx(expected, rel=1e-12)
