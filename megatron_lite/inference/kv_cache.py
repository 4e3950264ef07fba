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
    config, tp: int, layers: int, batch: int, max_len: int, dtype: torch.dtype, mamba_layers: int = 0
) -> int:
    """What a full KVCache holds on one rank: `layers` attention layers of `batch` sequences of `max_len` tokens,
    keys and values of its share of the key/value heads (one each where TP exceeds them), or multi-latent
    attention's latent and RoPE key part; and `mamba_layers` Mamba layers' conv windows (in `dtype`) and SSM states
    (fp32 at least), whatever the length."""
    from megatron_lite.models.mamba import D_CONV

    if config.multi_latent_attention:
        per_token = config.kv_lora_rank + config.qk_pos_emb_head_dim
    else:
        per_token = 2 * max(1, config.query_groups // tp) * config.head_dim
    size = torch.empty((), dtype=dtype).element_size()
    need = layers * batch * max_len * per_token * size
    if mamba_layers:
        heads, gn = config.mamba_heads // tp, config.mamba_num_groups * config.mamba_state_dim // tp
        conv = (heads * config.mamba_head_dim + 2 * gn) * (D_CONV - 1) * size
        ssm = heads * config.mamba_head_dim * config.mamba_state_dim * max(size, 4)
        need += mamba_layers * batch * (conv + ssm)
    return need
