"""The key/value cache of autoregressive decoding: each attention layer's keys and values of every token
seen so far, so a new token attends to them without recomputing them."""

from __future__ import annotations

import torch


class KVCache:
    """Per global layer number: two tensors of every token so far, [batch, max_len, ...], filled up to `offset`
    tokens: keys and values [.., local kv heads, head_dim], or what a layer expands them from (multi-latent
    attention caches its key/value latent and RoPE key part). Attention layers call `append`; the engine calls
    `advance` once all layers of the forward have appended (every layer of this rank sees the same new tokens)."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.offset = 0
        self._store: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._derived: dict[int, object] = {}

    def derived(self, layer: int, make):
        """What `make()` returns, made once per layer for this cache's generation (weights do not change while
        it runs): multi-latent attention's absorbed up-projections."""
        if layer not in self._derived:
            self._derived[layer] = make()
        return self._derived[layer]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s = k.shape[:2]
        end = self.offset + s
        if end > self.max_len:
            raise RuntimeError(f"KV cache holds {self.max_len} tokens; {end} were asked for")
        if layer not in self._store:
            self._store[layer] = tuple(t.new_zeros((b, self.max_len, *t.shape[2:])) for t in (k, v))
        keys, values = self._store[layer]
        keys[:, self.offset : end] = k
        values[:, self.offset : end] = v
        return keys[:, :end], values[:, :end]

    def advance(self, n: int) -> None:
        self.offset += n


def cache_bytes(config, tp: int, layers: int, batch: int, max_len: int, dtype: torch.dtype) -> int:
    """What a full KVCache holds on one rank: `layers` attention layers of `batch` sequences of `max_len` tokens,
    keys and values of its share of the key/value heads (one each where TP exceeds them), or multi-latent
    attention's latent and RoPE key part."""
    if config.multi_latent_attention:
        per_token = config.kv_lora_rank + config.qk_pos_emb_head_dim
    else:
        per_token = 2 * max(1, config.query_groups // tp) * config.head_dim
    return layers * batch * max_len * per_token * torch.empty((), dtype=dtype).element_size()
