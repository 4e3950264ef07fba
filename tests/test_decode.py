"""Decoding on a KV cache: every step's logits equal those of one forward over the whole sequence, and a step reads
the cache as it is stored (grouped-query keys/values not copied per query head; multi-latent attention's latents
not expanded into every head's keys and values)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_lite.config import ParallelConfig
from megatron_lite.inference.generation import _forward_batch
from megatron_lite.inference.kv_cache import KVCache
from megatron_lite.lora.apply import apply_lora
from megatron_lite.lora.config import LoraConfig
from megatron_lite.lora.qlora import quantize_base
from megatron_lite.models.gpt_model import build_model
from megatron_lite.parallel_context import ParallelContext

from models import deepseek_config, llama_config, rel

SEQ, PREFILL, CHUNK = 40, 17, 3  # the prompt's forward, a few tokens at once on the cache, then one at a time

SETUPS = {
    "gqa": lambda: llama_config(num_layers=2),  # 8 query heads on 4 key/value heads
    "mqa_window": lambda: llama_config(num_layers=2, num_query_groups=1, sliding_window=6),
    # Llama 4's L2-normalised q/k with a NoPE layer (its cached keys unrotated) and Qwen3-Next's output gate
    "gated_nope": lambda: llama_config(num_layers=2, qk_l2_norm=True, no_rope_freq=2, attention_output_gate=True),
    "mla": lambda: deepseek_config(num_layers=2),
    "mla_lora": lambda: deepseek_config(num_layers=2),
    "mla_qlora": lambda: deepseek_config(num_layers=2),
}


class LargestMade(TorchDispatchMode):
    """The most values any tensor made inside holds (views aside)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):  # (a view of an input, such as a weight's or the cache's, makes nothing)
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.largest = max(self.largest, t.numel())
        return out


def _model(name: str):
    config = SETUPS[name]()
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    model = build_model(config, ctx, seed=3)
    if name in ("mla_lora", "mla_qlora"):
        lora = LoraConfig(rank=4, alpha=8.0, target_modules=("linear_kv_up_proj",), qlora=name == "mla_qlora")
        apply_lora(model, config, lora, ctx, seed=2)
        gen = torch.Generator().manual_seed(5)
        for n, p in model.named_parameters():
            if n.endswith(".B"):  # (B starts at zero: an adapter left out would change nothing)
                p.data = 0.3 * torch.randn(p.shape, generator=gen)
        if name == "mla_qlora":
            quantize_base(model, ctx)
    for chunk in model:
        chunk.eval()
    return model, ctx, config


def _attention_modules(model):
    return [layer.self_attention for chunk in model for layer in chunk.decoder.layers]


@pytest.mark.parametrize("name", list(SETUPS))
def test_decoding_on_the_cache_equals_one_forward_and_reads_the_cache_as_stored(name):
    model, ctx, config = _model(name)
    ids = torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    cache = KVCache(SEQ)
    steps, largest = [], 0
    attention = _attention_modules(model)
    with torch.no_grad():
        whole = _forward_batch(model, ctx, ids, KVCache(SEQ), every=True)
        steps.append(_forward_batch(model, ctx, ids[:, :PREFILL], cache, every=True))
        cuts = [PREFILL, PREFILL + CHUNK, *range(PREFILL + CHUNK + 1, SEQ + 1)]
        for a, b in zip(cuts, cuts[1:]):
            meter = LargestMade()
            hooks = [m.register_forward_pre_hook(lambda *_, m=meter: [m.__enter__(), None][1]) for m in attention]
            hooks += [m.register_forward_hook(lambda *_, m=meter: m.__exit__(None, None, None)) for m in attention]
            steps.append(_forward_batch(model, ctx, ids[:, a:b], cache, every=True))
            for h in hooks:
                h.remove()
            if b - a == 1:
                largest = max(largest, meter.largest)
    assert rel(torch.cat(steps, dim=1), whole) < 1e-5, rel(torch.cat(steps, dim=1), whole)
    # A one-token step past the prompt: nothing as large as the cache's keys for every query head (what expanding
    # grouped heads, or the latents into per-head keys, makes) is made, counting only the keys the step reads.
    heads, keys = config.num_attention_heads, min(SEQ, config.sliding_window or SEQ)
    head_dim = config.qk_head_dim if config.multi_latent_attention else config.head_dim
    assert largest < 2 * keys * heads * head_dim, (largest, 2 * keys * heads * head_dim)


def test_absorbed_weights_are_made_once_per_generation():
    """The absorbed up-projections come from the weights as applied (NF4 base dequantised, LoRA added) once per
    layer and cache, not at every step."""
    model, ctx, config = _model("mla_qlora")
    calls = []
    for m in _attention_modules(model):
        make = m._absorbed_weights
        m._absorbed_weights = lambda make=make: calls.append(1) or make()
    cache = KVCache(12)
    with torch.no_grad():
        for a, b in ((0, 5), (5, 6), (6, 7), (7, 8)):
            _forward_batch(model, ctx, torch.arange(a, b).unsqueeze(0), cache)
    assert len(calls) == config.num_layers


@pytest.mark.parametrize("name", ["gqa", "mla", "mla_lora", "mla_qlora"])
def test_generation_bytes_count_what_a_generation_holds(name):
    """The GPU's fits-in-memory check counts what a generation holds beside the model: the cache, and the absorbed
    up-projections where they are new tensors (an NF4 base dequantised, LoRA added), not views of a weight."""
    from megatron_lite.inference.generation import generation_bytes

    model, ctx, config = _model(name)
    cache = KVCache(12)
    with torch.no_grad():
        for a, b in ((0, 5), (5, 6), (6, 7)):
            _forward_batch(model, ctx, torch.arange(a, b).repeat(2, 1), cache)
    weights = {t.untyped_storage().data_ptr() for chunk in model for t in [*chunk.parameters(), *chunk.buffers()]}
    held = {}  # storage -> bytes
    for t in tree_leaves((cache._store, cache._derived)):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in weights:
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert generation_bytes(model, ctx, 2, 12, scored_rows=0) == sum(held.values())


def test_a_bf16_decoding_step_scores_the_latents_in_fp32():
    """From the diff review: the absorbed step formed its attention logits as bf16 einsums added in bf16, where the
    flash kernel and SDPA's fused backends accumulate q.k in fp32. One bf16 step against the same step in fp64 from
    the same bf16-representable weights, latents and queries: the logits' rounding doubled the error (0.016 on
    average over these draws, 0.009 with fp32 logits)."""
    import copy

    config = deepseek_config(num_layers=1, hidden_size=64, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=128,
                             qk_head_dim=64, qk_pos_emb_head_dim=32, v_head_dim=32)  # fmt: skip
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    from megatron_lite.models.mla import MultiLatentAttention

    errors, t = [], 512
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        module = MultiLatentAttention(config, ctx, layer_number=1).eval()
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2 if p.dim() > 1 else torch.ones(p.shape))
        latents = (2 * torch.randn(1, t + 1, 1, 128, generator=gen)).bfloat16()
        k_pe = (2 * torch.randn(1, t + 1, 1, 32, generator=gen)).bfloat16()
        x = torch.randn(1, 1, 64, generator=gen).bfloat16()

        def step(dtype, module=module, latents=latents, k_pe=k_pe, x=x):
            m = copy.deepcopy(module).to(dtype)
            cache = KVCache(t + 1)
            cache.append(1, latents[:, :t].to(dtype), k_pe[:, :t].to(dtype))
            cache.advance(t)
            with torch.no_grad():
                new = latents[:, t:].to(dtype).squeeze(2).transpose(0, 1)
                return m._attend_absorbed(m.linear_q_proj(x.to(dtype)), new, k_pe[:, t:].to(dtype), None, cache)

        errors.append(rel(step(torch.bfloat16), step(torch.float64)))
    assert sum(errors) / len(errors) < 0.012, errors
