"""The FLOPs formula against two published closed forms and a parameter count."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.config import ParallelConfig
from megatron_lite.models.gpt_model import GPTModel
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.training.flops import flops_per_token

from models import deepseek_config, gpt2_config, llama_config


def test_gpt_matches_megatron_closed_form():
    """Megatron's num_floating_point_operations halves core attention for the causal mask (its closed form's
    s / (6h) becomes s / (12h)); the earlier full-attention form is causal=False."""
    c = gpt2_config(num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=50304)
    B, s, L, h, V = 8, 2048, 24, 2048, 50304
    causal = 72 * B * s * L * h * h * (1 + s / (12 * h) + V / (12 * L * h))
    full = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert flops_per_token(c, s) * B * s == pytest.approx(causal, rel=1e-12)
    assert flops_per_token(c, s, causal=False) * B * s == pytest.approx(full, rel=1e-12)


@pytest.mark.parametrize("make", [llama_config, gpt2_config])
def test_six_n_plus_attention(make):
    """torchtitan's form: 6 N + 12 L s heads d per token (6 L s heads d causally halved), N = parameters of
    every matmul (the output layer included, the input embedding and norms and biases excluded), counted from a
    real model."""
    c = make(untie_embeddings_and_output_weights=True)
    s = 32
    model = GPTModel(c, ParallelContext.virtual(ParallelConfig()), device="meta")
    n = sum(p.numel() for name, p in model.named_parameters() if p.ndim == 2 and "embedding" not in name)
    n -= (c.padded_vocab_size(1) - c.vocab_size) * c.hidden_size  # padding rows are not real work
    full = 6 * n + 12 * c.num_layers * s * c.num_attention_heads * c.head_dim
    assert flops_per_token(c, s, causal=False) == pytest.approx(full, rel=1e-12)
    causal = 6 * n + 6 * c.num_layers * s * c.num_attention_heads * c.head_dim
    assert flops_per_token(c, s) == pytest.approx(causal, rel=1e-12)


@pytest.mark.parametrize("make", [llama_config, deepseek_config])
def test_frozen_weights_take_no_weight_gradient(make):
    """LoRA: the frozen weights' backward is the input gradient alone, 4 N per token against the 6 N of full
    training (TFLOP/s and MFU of a fine-tune were counted as full training, up to 1.5x high), while attention's
    weightless q.k^T and p.v keep their 3x: the difference is 2 N exactly, N counted from a real model."""
    c = make(untie_embeddings_and_output_weights=True)
    s = 32
    model = GPTModel(c, ParallelContext.virtual(ParallelConfig()), device="meta")
    n = sum(p.numel() for name, p in model.named_parameters() if p.ndim == 2 and "embedding" not in name)
    n -= (c.padded_vocab_size(1) - c.vocab_size) * c.hidden_size
    if c.num_experts:  # a token runs only its top-k routed experts' weights (and the shared one)
        per_expert = 3 * c.hidden_size * c.moe_ffn_size
        moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_layers + c.mtp_num_layers))
        n -= moe_layers * (c.num_experts - c.moe_router_topk) * per_expert
    assert flops_per_token(c, s) - flops_per_token(c, s, frozen=True) == pytest.approx(2 * n, rel=1e-12)


@pytest.mark.parametrize("window", [1, 5, 31, 32, 100])
def test_a_sliding_window_counts_the_scores_it_computes(window):
    """Mistral's window: attention counts the (query, key) pairs the causal window mask keeps, less the half
    diagonal the causal convention leaves out (s / 2 keys per query, not (s + 1) / 2); the rest is unchanged."""
    s = 32
    c = llama_config(sliding_window=window)
    mask = torch.ones(s, s).tril() - torch.ones(s, s).tril(-min(window, s))  # key j seen by query i
    keys = float(mask.sum()) / s - min(window, s) / (2 * s)
    per_key = 3 * 4 * c.num_layers * c.num_attention_heads * c.head_dim  # q.k^T and p.v, forward + backward
    unwindowed = flops_per_token(llama_config(), s)
    assert flops_per_token(c, s) == pytest.approx(unwindowed - per_key * (s / 2 - keys), rel=1e-12)
    assert flops_per_token(c, s, causal=False) - flops_per_token(c, s) == pytest.approx(per_key * keys, rel=1e-12)


@pytest.mark.parametrize("freq, windowed", [(2, 2), (4, 3), ((0, 0, 1, 0), 1)])
def test_layers_spared_the_window_count_the_whole_sequence(freq, windowed):
    """--window-attn-skip-freq: the layers without a window count s / 2 keys per query, the windowed ones what the
    window keeps (Megatron's gpt-oss FLOPs formula likewise counts each layer's own attention)."""
    s, w = 32, 5
    c = llama_config(num_layers=4, sliding_window=w, window_attn_skip_freq=freq)
    keys = w - w * w / (2 * s)  # (the window's pairs, as the test above counts them)
    per_key = 3 * 4 * c.num_attention_heads * c.head_dim  # one layer's q.k^T and p.v, forward + backward
    unwindowed = flops_per_token(llama_config(num_layers=4), s)
    assert flops_per_token(c, s) == pytest.approx(unwindowed - windowed * per_key * (s / 2 - keys), rel=1e-12)


@pytest.mark.parametrize("mtp", [0, 2])
def test_mla_and_moe_count_the_work_each_token_does(mtp):
    """DeepSeek-shaped (multi-latent attention, MoE with top-2 of 4 experts and a shared expert): 6 N_active +
    6 L s heads (qk + v dims) per token, N_active counted from a real model (one expert's weights x top-k). With
    multi-token prediction, its layers count as layers and each depth runs the (shared) output layer again."""
    c = deepseek_config(num_layers=3, mtp_num_layers=mtp)
    s = 32
    model = GPTModel(c, ParallelContext.virtual(ParallelConfig()), device="meta")
    n = 0
    for name, p in model.named_parameters():
        if p.ndim != 2 or "embedding" in name:
            continue
        n += p.numel() * (c.moe_router_topk / c.num_experts if ".experts." in name else 1)
    n -= (c.padded_vocab_size(1) - c.vocab_size) * c.hidden_size
    n += mtp * c.hidden_size * c.vocab_size  # the output layer, once more per depth
    n += mtp * 3 * c.hidden_size  # (Megatron's "MTP eh norm + final norm": 3h a depth, as a matmul's)
    attention = 6 * (c.num_layers + mtp) * s * c.num_attention_heads * (c.mla_q_head_dim + c.v_head_dim)
    assert flops_per_token(c, s, causal=False) == pytest.approx(6 * n + attention, rel=1e-12)
    assert flops_per_token(c, s) == pytest.approx(6 * n + attention / 2, rel=1e-12)


@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),  # shares "H100" with the SXM part: the specific entry must win
        ("NVIDIA H200 NVL", 835e12),
        ("Some Future GPU", None),
    ],
)
def test_mfu_peak_is_the_datasheet_figure_of_the_named_card(monkeypatch, name, peak):
    from megatron_lite.training.flops import peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)  # no GPU here to name itself
    assert peak_flops(torch.device("cuda"), low_precision=True) == peak


@pytest.mark.parametrize("chunk, nope", [(5, None), (8, None), (8, 2), (32, None), (100, None)])
def test_chunked_attention_counts_the_scores_of_each_chunk(chunk, nope):
    """Llama 4's chunked attention (--attention-chunk-size, on the RoPE layers only): each chunk of the sequence
    counts as a causal sequence of its own length (L^2 / 2 pairs, the causal convention), the NoPE layers
    (--no-rope-freq) the whole sequence; a chunk at least the sequence changes nothing."""
    s = 32
    c = llama_config(attention_chunk_size=chunk, no_rope_freq=nope)
    lengths = [chunk] * (s // chunk) + ([s % chunk] if s % chunk else [])
    keys = sum(n * n / 2 for n in lengths) / s
    chunked_layers = sum(not c.skips_rope(i) for i in range(c.num_layers))
    assert chunked_layers == (c.num_layers // 2 if nope else c.num_layers)
    per_key = 3 * 4 * chunked_layers * c.num_attention_heads * c.head_dim  # q.k^T and p.v, forward + backward
    whole = flops_per_token(llama_config(no_rope_freq=nope), s)
    assert flops_per_token(c, s) == pytest.approx(whole - per_key * (s / 2 - keys), rel=1e-12)
