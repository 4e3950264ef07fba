"""The key/value cache of autoregressive decoding: each attention layer's keys and values of every token
seen so far, so a new token attends to them without recomputing them; and each Mamba layer's state after the tokens
so far (its conv window and SSM state, which stand for all of them)."""

from __future__ import annotations

import torch


class KVCache:
    """Per global layer number: two tensors of every token so far, [batch, max_len, ...], filled up to `offset`
    tokens: keys and values [.., local kv heads, head_dim], or what a layer expands them from (multi-latent
    attention caches its key/value latent and RoPE key part). Attention layers call `append`; the engine calls
    `advance` once all layers of the forward have appended (every layer of this rank sees the same new tokens).
    A Mamba layer reads `mamba_state` and leaves its new state with `keep_mamba_state`: its conv window, the last
    D_CONV - 1 inputs of its depthwise conv [batch, this rank's x B C channels, D_CONV - 1], and its SSM state
    [batch, this rank's heads, head_dim, state_dim] (fp32 at least)."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.offset = 0
        self._store: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._derived: dict[int, object] = {}
        self._mamba: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def derived(self, layer: int, make):
        """What `make()` returns, made once per layer for this cache's generation (weights do not change while
        it runs): multi-latent attention's absorbed up-projections."""
        if layer not in self._derived:
            self._derived[layer] = make()
        return self._derived[layer]

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, chunk: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values of every token so far, these included. `chunk` (Llama 4's chunked
        layers): no query reads a key of an earlier chunk than its own, so the layer holds one chunk's tokens
        rather than `max_len`, and the keys returned start at the first query's chunk (a multiple of `chunk`: the
        chunk boundaries fall where they did)."""
        b, s = k.shape[:2]
        end = self.offset + s
        if end > self.max_len:
            raise RuntimeError(f"KV cache holds {self.max_len} tokens; {end} were asked for")
        if chunk is not None and chunk < self.max_len:
            return self._append_chunked(layer, k, v, chunk)
        if layer not in self._store:
            self._store[layer] = tuple(t.new_zeros((b, self.max_len, *t.shape[2:])) for t in (k, v))
        keys, values = self._store[layer]
        keys[:, self.offset : end] = k
        values[:, self.offset : end] = v
        return keys[:, :end], values[:, :end]

    def _append_chunked(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, chunk: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, s = k.shape[:2]
        start, end = self.offset // chunk * chunk, self.offset + s
        if layer not in self._store:
            self._store[layer] = tuple(t.new_zeros((b, chunk, *t.shape[2:])) for t in (k, v))
        keys, values = self._store[layer]  # positions [start, start + chunk): the first query's chunk
        if end <= start + chunk:  # a decoding step (or tokens within one chunk): in place, as the full cache
            keys[:, self.offset - start : end - start] = k
            values[:, self.offset - start : end - start] = v
            return keys[:, : end - start], values[:, : end - start]
        # tokens across a chunk boundary (a prompt): all of them, after the first query's chunk so far; then the
        # last one's chunk is what the cache keeps
        out_k, out_v = (torch.cat([t[:, : self.offset - start], new], dim=1) for t, new in ((keys, k), (values, v)))
        last = (end - 1) // chunk * chunk
        keys[:, : end - last] = out_k[:, last - start :]
        values[:, : end - last] = out_v[:, last - start :]
        return out_k, out_v

    def mamba_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A Mamba layer's conv window and SSM state after the tokens so far; None before its first forward."""
        return self._mamba.get(layer)

    def keep_mamba_state(self, layer: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """The layer's state after this forward's tokens: copied into the tensors it holds (made at the prompt)."""
        if layer in self._mamba:
            held_conv, held_ssm = self._mamba[layer]
            held_conv.copy_(conv)
            held_ssm.copy_(ssm)
        else:  # (copies: the window is a view of the whole conv input, which must not stay alive)
            self._mamba[layer] = (conv.clone(), ssm.clone())

    def advance(self, n: int) -> None:
        self.offset += n


def cache_bytes(
    config,
    tp: int,
    layers: int,
    batch: int,
    max_len: int,
    dtype: torch.dtype,
    mamba_layers: int = 0,
    chunked_layers: int = 0,
) -> int:
    """What a full KVCache holds on one rank: `layers` attention layers of `batch` sequences of `max_len` tokens
    (`chunked_layers` of them Llama 4's chunked ones: a chunk's tokens at most), keys and values of its share of
    the key/value heads (one each where TP exceeds them), or multi-latent attention's latent and RoPE key part;
    and `mamba_layers` Mamba layers' conv windows (in `dtype`) and SSM states (fp32 at least), whatever the
    length."""
    from megatron_lite.models.mamba import D_CONV

    if config.multi_latent_attention:
        per_token = config.kv_lora_rank + config.qk_pos_emb_head_dim
    else:
        per_token = 2 * max(1, config.query_groups // tp) * config.head_dim
    size = torch.empty((), dtype=dtype).element_size()
    chunk = min(config.attention_chunk_size or max_len, max_len)
    need = ((layers - chunked_layers) * max_len + chunked_layers * chunk) * batch * per_token * size
    if mamba_layers:
        heads, gn = config.mamba_heads // tp, config.mamba_num_groups * config.mamba_state_dim // tp
        conv = (heads * config.mamba_head_dim + 2 * gn) * (D_CONV - 1) * size
        ssm = heads * config.mamba_head_dim * config.mamba_state_dim * max(size, 4)
        need += mamba_layers * batch * (conv + ssm)
    return need
