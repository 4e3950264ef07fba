"""A 70B configuration builds on the meta device, as any rank of a TP=8 job would hold it, with no memory
allocated; its parameter count matches the closed-form count of the architecture."""

from __future__ import annotations

import pytest

from megatron_lite.config import ModelConfig, ParallelConfig
from megatron_lite.models.gpt_model import GPTModel
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.parameters import named_param_meta

LLAMA3_70B = dict(
    num_layers=80,
    hidden_size=8192,
    num_attention_heads=64,
    num_query_groups=8,
    ffn_hidden_size=28672,
    vocab_size=128256,
    max_position_embeddings=8192,
    normalization="RMSNorm",
    norm_epsilon=1e-5,
    activation="swiglu",
    position_embedding_type="rope",
    rotary_base=500000.0,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)


def _expected_counts(c: ModelConfig, tp: int) -> tuple[int, int]:
    """(full parameters, parameters on one TP rank), from the architecture."""
    h, d, kv = c.hidden_size, c.head_dim, c.query_groups
    attn = h * (c.num_attention_heads * d + 2 * kv * d) + c.num_attention_heads * d * h
    mlp = 3 * h * c.ffn_size
    norms = 2 * h
    full = 2 * c.vocab_size * h + c.num_layers * (attn + mlp + norms) + h
    per_rank = 2 * c.padded_vocab_size(tp) * h // tp + c.num_layers * ((attn + mlp) // tp + norms) + h
    return full, per_rank


@pytest.mark.parametrize("tp", [1, 8])
def test_70b_on_meta(tp):
    config = ModelConfig(**LLAMA3_70B)
    ctx = ParallelContext.virtual(ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=True), 8, 0)
    model = GPTModel(config, ctx, device="meta")
    params = list(model.parameters())
    assert all(p.is_meta for p in params)
    full, per_rank = _expected_counts(config, tp)
    assert 70.5e9 < full < 70.6e9  # Llama-3-70B's published size
    assert sum(p.numel() for p in params) == per_rank
    full_numel = sum(
        p.numel() if meta.shard is None else meta.shard.full_size * p.numel() // p.shape[meta.shard.dim]
        for _, p, meta in named_param_meta(model)
    )
    assert full_numel == full
