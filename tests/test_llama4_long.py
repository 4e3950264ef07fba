"""Llama 4 past its chunk and floor scale: chunked attention on the RoPE layers (a query sees earlier keys of its own
chunk of attention_chunk_size absolute positions only) and temperature tuning on the NoPE layers (queries times
log1p(floor((pos + 1) / floor_scale)) x attn_scale + 1), against transformers' Llama4ForCausalLM with every weight
random: logits over three chunks within 1e-5 (fp32) under --kernel-impl torch and triton, greedy generation through
our KV cache past several chunks, TP=2; chunks intersected with --reset-attention-mask's documents against a mask
built by hand, with a KV cache too; CP=2 training like one process."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from convert_flow import converts_both_ways, tp2_equals_transformers
from test_convert import V, _hf_logits, _rel
from test_convert_llama4 import _config, _random_model
from test_train_equivalence import TOL, _compare, train_run

from megatron_lite import kernels as K
from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.models.attention import CoreAttention
from megatron_lite.parallel_context import ParallelContext

from models import CONFIGS, llama_config

CHUNK, FLOOR, SEQ = 8, 6, 24
IDS = [(7 * i + 3) % V for i in range(SEQ)]  # three chunks; the NoPE layer's factor steps at 5, 11, 17, 23


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A transformers Llama 4 (MoE every 2nd layer, NoPE layer 3, the RoPE layers chunked) and its conversion."""
    model = _random_model(_config(interleave_moe_layer_step=2, attention_chunk_size=CHUNK, floor_scale=FLOOR))
    assert model.config.layer_types[:3] == ["chunked_attention"] * 3 and model.config.attn_temperature_tuning
    tmp = tmp_path_factory.mktemp("llama4_long")
    config, _ = converts_both_ways(model, tmp, ("attention_chunk_size", "floor_scale", "layer_types"), ids=IDS)
    assert (config.attention_chunk_size, config.attn_temperature_floor_scale) == (CHUNK, FLOOR)
    return model, str(tmp / "ours"), config


def _ours(ckpt: str, config, kernel_impl: str):
    from megatron_lite.checkpoint.checkpointing import find_checkpoint, load_checkpoint
    from megatron_lite.models.gpt_model import build_model

    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    model = build_model(dataclasses.replace(config, kernel_impl=kernel_impl), ctx)
    load_checkpoint(find_checkpoint(ckpt), model, None, None, ctx, load_rng=False)
    return model.eval(), ctx


def test_triton_logits_equal_transformers_past_the_chunks(converted):
    """(--kernel-impl torch: in the fixture, converts_both_ways.) The flash kernel's document spans as chunks."""
    model, ours, config = converted
    ours_model, _ = _ours(ours, config, "triton")
    launches = K.LAUNCHES["flash_attention_fwd"]
    with torch.no_grad():
        logits = ours_model(torch.tensor([IDS]))[0].float()[..., :V]
    assert K.LAUNCHES["flash_attention_fwd"] > launches
    assert _rel(logits, _hf_logits(model, IDS)) <= 1e-5, _rel(logits, _hf_logits(model, IDS))


def test_greedy_generation_equals_transformers_past_several_chunks(converted):
    """10 prompt tokens and 20 generated: positions 0-29, four chunks; each step's query in its chunk of the cache
    and its temperature at its absolute position."""
    from megatron_lite.inference.generation import generate

    model, ours, config = converted
    prompt, new = IDS[:10], 20
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None)
    ours_model, ctx = _ours(ours, config, "torch")
    assert generate(ours_model, ctx, prompt, new)["generated_ids"] == out[0, len(prompt) :].tolist()


def test_a_chunked_layers_cache_holds_one_chunk():
    """The KV cache of a chunked layer holds `chunk` tokens, not the generation's length, and returns the keys
    and values from the first query's chunk to the newest (oracle: the full sequence's, sliced), for a prompt
    across two chunk boundaries and single steps past two more, as for several tokens on a cache."""
    from megatron_lite.inference.kv_cache import KVCache, cache_bytes

    torch.manual_seed(0)
    chunk, total = 4, 19
    k_all, v_all = torch.randn(2, total, 3, 5), torch.randn(2, total, 3, 5)
    cache = KVCache(total)
    at = 0
    for n in (10, 1, 1, 3, 1, 1, 1, 1):  # (the 3: a multi-token step crossing a boundary on a cache)
        k, v = cache.append(7, k_all[:, at : at + n], v_all[:, at : at + n], chunk)
        start = at // chunk * chunk
        assert torch.equal(k, k_all[:, start : at + n]) and torch.equal(v, v_all[:, start : at + n]), (at, n)
        cache.advance(n)
        at += n
    assert [t.shape[1] for t in cache._store[7]] == [chunk, chunk]
    config = llama_config(attention_chunk_size=chunk, num_query_groups=4)
    full, chunked = (cache_bytes(config, 1, 2, 1, total, torch.float32, chunked_layers=c) for c in (0, 1))
    assert chunked == full * (total + chunk) / (2 * total)  # (one of the two layers at a chunk's tokens)


def test_tp2_equals_transformers(dist, converted, tmp_path):
    """Logits over 24 tokens and greedy generation to position 17 (past two chunk boundaries) split over TP=2."""
    tp2_equals_transformers(dist, converted[0], tmp_path, IDS)


def _masked_attention(q, k, v, visible):
    """softmax(q k^T / sqrt(d)) v where `visible` [b, sq, sk]; one head group per key head (GQA expanded)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    probs = scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v).flatten(2)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_chunks_intersect_documents_and_the_cache(impl):
    """Chunks of 4 with packed documents (--reset-attention-mask) of 3, 7 and 6 tokens: a query sees the earlier keys
    of its chunk and document both; and the last 1 and 3 queries of 13 keys (a KV cache), alone in one chunk or
    across two, see only their chunk's keys."""
    torch.manual_seed(0)
    config = llama_config(attention_chunk_size=4, kernel_impl=impl)
    attn = CoreAttention(config, ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu")), 0).eval()
    b, s, heads, groups, d = 2, 16, 8, 4, config.head_dim
    q, k, v = torch.randn(b, s, heads, d), torch.randn(b, s, groups, d), torch.randn(b, s, groups, d)
    documents = torch.tensor([[0] * 3 + [1] * 7 + [2] * 6, [0] * 16])
    pos = torch.arange(s)
    causal = pos[:, None] >= pos[None, :]
    same_chunk = pos[:, None] // 4 == pos[None, :] // 4
    same_doc = documents[:, :, None] == documents[:, None, :]
    with torch.no_grad():
        out = attn(q, k, v, documents)
    assert _rel(out, _masked_attention(q, k, v, causal & same_chunk & same_doc)) <= 1e-5
    for n in (1, 3):  # queries at 12 (chunk 3's first) or 10-12 (chunks 2 and 3), over the 13 cached keys
        qn, kn, vn = q[:, 13 - n : 13], k[:, :13], v[:, :13]
        visible = (causal & same_chunk)[13 - n : 13, :13].expand(b, n, 13)
        with torch.no_grad():
            assert _rel(attn(qn, kn, vn), _masked_attention(qn, kn, vn, visible)) <= 1e-5, n


# Llama 4's attention at 16 tokens (tests/models.py, layer 0 RoPE, layer 1 NoPE), chunks of 6 across the zigzag's
# chunks of 4 at CP=2, the temperature stepping at positions 2, 5, 8, 11, 14; weights large enough (and the temperature
# strong enough) that attention is far from uniform, so a rank's wrong positions move the loss well past 1e-4
LONG = dict(init_method_std=0.2, attention_chunk_size=6, attn_temperature_floor_scale=3, attn_temperature_scale=1.0)
CONFIGS["llama4-long"] = lambda **kw: CONFIGS["llama4"](**LONG | kw)
CONFIGS["llama4-long-off"] = lambda **kw: CONFIGS["llama4"](init_method_std=0.2, **kw)


def _train_long(parallel: ParallelConfig, gbs: int, mbs: int):
    """(top-level here, so that a worker importing it registers the config)"""
    return train_run("llama4-long", parallel, gbs, mbs, iters=4)


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_context_parallel_trains_like_one_process(dist, comm):
    """CP=2 (ring and all-to-all): the chunks in absolute positions with the zigzag split, the temperature at each
    rank's own positions; per-iteration lm loss and grad norm equal one process's."""
    parallel = ParallelConfig(context_parallel_size=2, cp_comm_type=comm)
    ref = _train_long(ParallelConfig(), 4, 4)
    off = train_run("llama4-long-off", ParallelConfig(), 4, 4, iters=3)
    assert abs(off[0][1] - ref[0][1]) > 100 * TOL * ref[0][1]  # (the chunks and the temperature count)
    for rank_history in dist(2, _train_long, parallel, 4, 2):
        _compare(rank_history, ref)


def test_refusals():
    """Chunks with multi-latent attention (its decoding attends outside these masks), and a config.json chunking
    other layers than the RoPE ones (read by transformers' class and from config.json alone): one line each."""
    from megatron_lite.checkpoint.hf_convert import _fallback_config
    from megatron_lite.models.config_checks import validate_model
    from megatron_lite.models.hf import config_from_hf

    with pytest.raises(ConfigError, match="--attention-chunk-size 8 with --multi-latent-attention") as err:
        validate_model(CONFIGS["deepseek"](attention_chunk_size=8))
    assert "\n" not in str(err.value)
    config = _config(attention_chunk_size=CHUNK, layer_types=["chunked_attention"] * 4)
    for read in (config, _fallback_config(config.to_dict())):
        with pytest.raises(ConfigError, match=re.escape("layer_types chunk the layers [1, 1, 1, 1], not the RoPE")):
            config_from_hf(read)


def test_the_planner_prices_chunked_attention():
    """A query of a chunked layer scores about half a chunk of keys where it scored half the sequence: the attention
    core time falls by 1 - chunk / seq on the RoPE layers, so chunks of 1024 and 4096 at 8192 tokens save 7/8 and 1/2
    of it, 7:4 (a chunk of the whole sequence saves nothing)."""
    from megatron_lite.planner.hardware import ACCELERATORS, Cluster
    from megatron_lite.planner.layout import Layout
    from megatron_lite.planner.search import evaluate

    config = CONFIGS["llama4"](num_layers=4, moe_layer_freq=(0, 1, 0, 1), hidden_size=512, max_position_embeddings=8192)
    cl = Cluster(ACCELERATORS["H100"], 8, 1, 450e9, 50e9)
    full, c1, c2 = (
        evaluate(dataclasses.replace(config, attention_chunk_size=c), Layout(dp=8), 8192, 16, cl).time.compute
        for c in (8192, 1024, 4096)
    )
    assert full == evaluate(config, Layout(dp=8), 8192, 16, cl).time.compute
    assert (full - c1) / (full - c2) == pytest.approx(7 / 4, rel=1e-9)
