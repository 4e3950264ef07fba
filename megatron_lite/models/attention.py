"""Self-attention with grouped-query heads, split across tensor-parallel ranks by query group."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite import kernels as K
from megatron_lite.config import ModelConfig
from megatron_lite.context_parallel.attention import IMPLEMENTATIONS as CP_ATTENTION
from megatron_lite.context_parallel.zigzag import zigzag_positions
from megatron_lite.models.attention_variants import (
    attention_with_offset,
    chunked_documents,
    flash_attention_with_offset,
    l2_norm,
    output_gate,
    temperature_scaled,
)
from megatron_lite.models.norms import build_norm
from megatron_lite.models.qk_clip import group_eta, max_attention_logits, qkv_row_scale, records_max_logit
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.parameters import ParamMeta, set_param_meta
from megatron_lite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_lite.tensor_parallel.random import checkpoint, is_recomputing
from megatron_lite.tensor_parallel.sharding import ShardSpec


def qkv_output_size(config: ModelConfig) -> int:
    """Rows of the fused QKV weight. The layout is grouped per query group: for each of the query
    groups, its (heads / groups) query heads, then (--attention-output-gate) as many gate heads, then its key
    head, then its value head, each head_dim rows (Megatron-Core's). Tensor parallelism therefore splits whole
    groups, each head's gate with it, and the layout does not depend on TP."""
    per_group = qkv_heads_per_group(config)
    return config.query_groups * per_group * config.head_dim


def qkv_heads_per_group(config: ModelConfig) -> int:
    """Head-sized row blocks per query group of the fused QKV weight: queries, gates, key, value."""
    heads = config.num_attention_heads // config.query_groups
    return heads * (2 if config.attention_output_gate else 1) + 2


def attention_mask(seq_q: int, seq_k: int, window: int | None, device) -> torch.Tensor | None:
    """Where query i may look, [seq_q, seq_k] (True = visible), or None for the plain causal square. The
    causal mask is aligned to the bottom right (query i sits at position i + seq_k - seq_q, as with a KV
    cache), and a sliding window keeps the last `window` keys up to that position."""
    if window is None and seq_q == seq_k:
        return None
    pos = torch.arange(seq_q, device=device).unsqueeze(1) + (seq_k - seq_q)
    keys = torch.arange(seq_k, device=device).unsqueeze(0)
    visible = keys <= pos
    if window is not None:
        visible &= pos - keys < window
    return visible


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """Causal attention inside each document (--reset-attention-mask; the ids come from data/documents.py):
    [batch, 1, seq, seq], True where query i may see key j."""
    seq = documents.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    same = documents.unsqueeze(-1) == documents.unsqueeze(-2)
    return (same & causal).unsqueeze(1)


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v with a causal mask (and a sliding window, or Llama 4's chunks, when configured),
    through PyTorch's scaled_dot_product_attention or our flash kernel.
    q: [batch, seq_q, heads, head_dim]; k: [batch, seq_k, kv_heads, head_dim]; v: [batch, seq_k, kv_heads,
    v_head_dim] -> [batch, seq_q, heads * v_head_dim]
    (seq_k > seq_q with a KV cache). The heads here are this rank's shard, so attention dropout draws from
    the per-TP-rank generator."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, layer_number: int = 0, device=None) -> None:
        super().__init__()
        self.dropout = config.attention_dropout
        self.scale = config.softmax_scale
        self.rng = ctx.rng
        self.triton = config.kernel_impl == "triton"
        self.window = config.layer_window(layer_number)  # (--window-attn-skip-freq: some layers attend fully)
        # Llama 4's chunked attention, on its RoPE layers (transformers' chunked_attention layer type)
        self.chunk = None if config.skips_rope(layer_number) else config.attention_chunk_size
        # --softmax-type: an extra logit per head beside the scores (models/attention_variants.py); this rank's
        # heads' offsets, in fp32 as the softmax
        heads = self.local_heads = config.num_attention_heads // ctx.tp.size
        if config.softmax_type == "learnable":
            self.softmax_offset = nn.Parameter(torch.empty(heads, device=device, dtype=torch.float32))
            spec = ShardSpec.even(0, config.num_attention_heads, ctx.tp.size)
            meta = ParamMeta(("normal", config.init_method_std), spec, ctx.tp.rank)  # (Megatron's init_method)
            set_param_meta(self, "softmax_offset", meta)
        elif config.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(heads, device=device), persistent=False)
        else:
            self.softmax_offset = None
        # Context parallelism: this rank holds a (zigzag) part of the sequence; attention over the whole of
        # it is a parallel layer that communicates over the CP group.
        self.cp = ctx.cp if ctx.cp.size > 1 else None
        # QK-clip / --log-max-attention-logit: the largest logit per local head over the step's training forwards
        # (models/qk_clip.py), taken and reset by the training step
        self.records_max_logit = records_max_logit(config)
        self.max_logits: torch.Tensor | None = None
        self.cp_attention = CP_ATTENTION[ctx.parallel.cp_comm_type]
        if ctx.parallel.cp_comm_type == "a2a+p2p":  # its two levels of groups
            self.cp_attention = functools.partial(self.cp_attention, inner=ctx.cp_inner, outer=ctx.cp_outer)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`documents` [batch, seq]: each token's document (--reset-attention-mask); queries see only earlier keys
        of their own document (the flash kernel skips the other documents' blocks; SDPA takes a mask)."""
        b, s, heads, d = q.shape
        sk = k.shape[1]
        p = self.dropout if self.training else 0.0
        if self.chunk is not None:
            k, v, documents = self._chunked(k, v, s, documents)
            sk = k.shape[1]
        if self.cp is not None:  # documents: the whole sequence's ids, on every CP rank
            extra = {"document_ids": documents} if documents is not None else {}
            extra |= {"window_size": self.window} if self.window is not None else {}  # (a2a and allgather only)
            extra |= {"offset": self.softmax_offset} if self.softmax_offset is not None else {}
            found = [] if self.records_max_logit and self.training else None  # (QK-clip: each block's max logit)
            out = self.cp_attention(q, k, v, self.cp, causal=True, scale=self.scale, triton=self.triton,
                                    max_logits=found, **extra)  # fmt: skip
            if found:
                self._note_max_logits(torch.stack(found).amax(0))
            return out.reshape(b, s, -1)
        record = self.records_max_logit and self.training
        flash = self.triton and p == 0.0 and self.softmax_offset is None  # (the kernel returns the max logit)
        if record and not flash and not is_recomputing():  # (a recompute's forward sees the same logits again)
            self._note_max_logits(max_attention_logits(q, k, self.scale, self._mask(s, sk, documents, q.device)))
        if self.window is not None and documents is None and sk > s + self.window - 1:
            # decoding past the window: the keys no query of this step sees are not read (nor expanded, nor masked)
            k, v = k[:, sk - (s + self.window - 1) :], v[:, sk - (s + self.window - 1) :]
            sk = k.shape[1]
        if self.softmax_offset is not None:
            return self._with_offset(q, k, v, documents, p).reshape(b, s, -1)
        if flash:  # the flash kernel handles grouped-query heads itself
            out = K.flash_attention(
                q, k, v, True, self.scale, window_size=self.window, document_ids=documents, return_max_logit=record
            )
            if record:
                out, found = out
                self._note_max_logits(found)
            return out.reshape(b, s, -1)
        kv_heads, dv = k.shape[2], v.shape[-1]
        if kv_heads != heads and sk > s and documents is None and p == 0.0:
            return self._decode_grouped(q, k, v)
        if kv_heads != heads:  # grouped-query: query head i reads key/value head i // (heads / kv_heads)
            rep = heads // kv_heads
            k = k.unsqueeze(3).expand(b, sk, kv_heads, rep, d).reshape(b, sk, heads, d)
            v = v.unsqueeze(3).expand(b, sk, kv_heads, rep, dv).reshape(b, sk, heads, dv)
        mask = self._mask(s, sk, documents, q.device)
        if dv < d:  # SDPA's fused backends take one head size; its math fallback would keep the probabilities
            v = F.pad(v, (0, d - dv))
        rng = self.rng.fork() if p > 0 else contextlib.nullcontext()
        with rng:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=mask,
                dropout_p=p,
                is_causal=mask is None,
                scale=self.scale,
            )
        return out.transpose(1, 2)[..., :dv].reshape(b, s, -1)

    def _note_max_logits(self, found: torch.Tensor) -> None:
        """Max-accumulate a forward's largest logit per head (the flash kernel's, or recomputed beside SDPA)."""
        found = found.detach().float()
        self.max_logits = found if self.max_logits is None else torch.maximum(self.max_logits, found)

    def take_max_logits(self) -> torch.Tensor | None:
        """The step's largest logit per local head (None: no training forward ran), reset for the next step."""
        found, self.max_logits = self.max_logits, None
        return found

    def _chunked(self, k: torch.Tensor, v: torch.Tensor, s: int, documents: torch.Tensor | None):
        """Llama 4's chunks as documents (models/attention_variants.py's chunked_documents): the keys and values
        from the first query's chunk on (decoding: no query of this step sees an earlier chunk, so those keys are
        not read), and the document ids that keep each query in its chunk, None once all of them are in one chunk
        (a decoding step within a chunk: the plain causal mask then). The keys sit at positions 0.. (a KV cache
        from the first token; under context parallelism the whole sequence's, of which this rank holds a part)."""
        sk = k.shape[1]
        if self.cp is not None:
            return k, v, chunked_documents(self.chunk, k.shape[0], sk * self.cp.size, k.device, documents)
        first = 0
        if documents is None:  # (with documents, training: sk = s, nothing before the first chunk)
            first = (sk - s) // self.chunk * self.chunk  # (the queries are the last s positions)
            k, v, sk = k[:, first:], v[:, first:], sk - first
            if sk <= self.chunk:
                return k, v, None
        return k, v, chunked_documents(self.chunk, k.shape[0], sk, k.device, documents, first)

    def _mask(self, s: int, sk: int, documents: torch.Tensor | None, device) -> torch.Tensor | None:
        """Where each query may look: the causal (windowed) mask within each document, None for the causal square."""
        mask = attention_mask(s, sk, self.window, device)
        if documents is None:
            return mask
        inside = document_mask(documents)[..., sk - s :, :]  # (the queries are the last s keys' positions)
        return inside if mask is None else inside & mask

    def _with_offset(self, q, k, v, documents, p: float) -> torch.Tensor:
        if self.triton and p == 0.0:
            return flash_attention_with_offset(q, k, v, self.softmax_offset, self.scale, self.window, documents)
        s, sk = q.shape[1], k.shape[1]
        visible = self._mask(s, sk, documents, q.device)
        if visible is None:  # (the plain causal square, which SDPA takes as is_causal)
            visible = torch.ones(s, sk, dtype=torch.bool, device=q.device).tril()
        with self.rng.fork() if p > 0 else contextlib.nullcontext():
            return attention_with_offset(q, k, v, self.softmax_offset, self.scale, visible, p)

    def _decode_grouped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention on a KV cache, without expanding it: each key/value head's query heads become
        rows of one query block (a step's few queries), so the cache is read as it is stored, where expanding it
        copied every cached key and value heads / kv_heads times at every step."""
        b, s, heads, d = q.shape
        sk, kv_heads, dv = k.shape[1], k.shape[2], v.shape[-1]
        rep = heads // kv_heads
        rows = q.reshape(b, s, kv_heads, rep, d).permute(0, 2, 1, 3, 4).reshape(b, kv_heads, s * rep, d)
        mask = attention_mask(s, sk, self.window, q.device)  # (bottom-right: sk > s) each row is its query's
        if s == 1 and self.window is None:
            mask = None  # one query at the end sees every key
        elif mask is not None:
            mask = mask.repeat_interleave(rep, dim=0)
        out = F.scaled_dot_product_attention(
            rows, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=self.scale
        )
        return out.reshape(b, kv_heads, s, rep, dv).permute(0, 2, 1, 3, 4).reshape(b, s, heads * dv)


class SelfAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, ctx: ParallelContext, device=None, dtype=torch.float32, layer_number: int = 0
    ) -> None:
        super().__init__()
        tp = ctx.tp
        self.layer_number = layer_number
        sp = ctx.sequence_parallel
        self.head_dim = config.head_dim
        self.heads_per_group = config.num_attention_heads // config.query_groups
        self.local_groups = config.query_groups // tp.size
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size,
            qkv_output_size(config),
            tp,
            bias=config.add_bias_linear or config.add_qkv_bias,
            sequence_parallel=sp,
            comm_overlap=ctx.parallel.tp_comm_overlap and ctx.parallel.tp_comm_overlap_ag,
            triton_gemm=config.kernel_impl == "triton",
            init_std=config.init_method_std,
            device=device,
            dtype=dtype,
        )
        self.gated = config.attention_output_gate
        # --no-rope-freq: Llama 4's NoPE layers take no rotation (the model's tables stay shared)
        self.skips_rope = config.skips_rope(layer_number)
        # (Hugging Face's Llama 4 normalises the RoPE layers' queries and keys only: qk_l2_norm_rope_only)
        l2 = config.qk_l2_norm and not (config.qk_l2_norm_rope_only and self.skips_rope)
        self.qk_l2_eps = config.norm_epsilon if l2 else None
        # Llama 4's temperature tuning, on its NoPE layers: (floor_scale, scale), None elsewhere
        tuned = self.skips_rope and config.attn_temperature_floor_scale is not None
        self.temperature = (config.attn_temperature_floor_scale, config.attn_temperature_scale) if tuned else None
        self.cp = ctx.cp if ctx.cp.size > 1 else None
        if config.qk_layernorm:  # one weight over head_dim for all heads; this rank sees only its heads
            self.q_layernorm = build_norm(config, tp.size > 1, device, dtype, size=config.head_dim)
            self.k_layernorm = build_norm(config, tp.size > 1, device, dtype, size=config.head_dim)
        else:
            self.q_layernorm = self.k_layernorm = None
        self.core_attention = CoreAttention(config, ctx, layer_number, device)
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            tp,
            bias=config.add_bias_linear,
            sequence_parallel=sp,
            comm_overlap=ctx.parallel.tp_comm_overlap and ctx.parallel.tp_comm_overlap_rs,
            triton_gemm=config.kernel_impl == "triton",
            init_std=config.output_layer_init_std,
            device=device,
            dtype=dtype,
        )
        # Selective recomputation (Megatron's default module): keep only q, k, v for the backward.
        self.rope = K.apply_rope if config.kernel_impl == "triton" else K.apply_rope_reference
        self.rotary_interleaved = config.rotary_interleaved
        self.recompute_core_attention = (
            config.recompute_granularity == "selective" and "core_attn" in config.recompute_modules
        )

    def qk_clip_row_scales(self, max_logits: torch.Tensor, threshold: float, alpha: float) -> list:
        """QK-clip's [(weight, factor per row of this rank's shard)], from the step's max logit per local head
        (already the maximum over data-parallel replicas): Megatron-Core's Attention.clip_qk, per query group.
        A QKV bias (--add-qkv-bias, --add-bias-linear) is scaled with its rows, which Megatron leaves alone: q and
        k are then scaled exactly (q = Wx + b), so the group's logits are bounded as the clip means them to be,
        where a weight-only scale leaves the bias's part of every logit unclipped (docs/training.md)."""
        eta = group_eta(max_logits, self.local_groups, threshold)
        gates = self.heads_per_group if self.gated else 0
        scale = qkv_row_scale(eta, self.heads_per_group, gates, self.head_dim, alpha)
        bias = self.linear_qkv.bias
        return [(self.linear_qkv.weight, scale), *([(bias, scale)] if bias is not None else [])]

    def _rotate(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE on the first cos.shape[-1] dims of each head (all of them unless --rotary-percent < 1).
        --rotary-interleaved rotates the pairs (0, 1), (2, 3), ...: the rotated dims are reordered, evens then
        odds, and rotated by halves, which is the interleaved rotation in that order. q and k alike: their dot
        products, all attention reads of them, are the interleaved ones (the values are not reordered)."""
        cos, sin = rope
        r = cos.shape[-1]
        if self.rotary_interleaved:
            x = torch.cat([x[..., 0:r:2], x[..., 1:r:2], x[..., r:]], dim=-1)
        if r == x.shape[-1]:
            return self.rope(x, cos, sin)
        return torch.cat([self.rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def _positions(self, s: int, kv_cache, device) -> torch.Tensor:
        """The absolute positions of this rank's s queries: after the cached tokens, this CP rank's zigzag part,
        or 0..s-1 (the position ids are not read: --reset-position-ids restarts them, transformers' temperature
        does not)."""
        if kv_cache is not None:
            return torch.arange(kv_cache.offset, kv_cache.offset + s, device=device)
        if self.cp is not None:
            return zigzag_positions(s * self.cp.size, self.cp.size, self.cp.rank, device)
        return torch.arange(s, device=device)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, kv_cache=None, documents=None
    ) -> torch.Tensor:
        """x: [seq (or its shard), batch, hidden] -> [same, batch, hidden]. With `kv_cache` (inference), the
        new keys and values are appended to this layer's cache and attention reads all of them. `documents`:
        each token's document (CoreAttention)."""
        qkv = self.linear_qkv(x)  # [seq, batch, local groups * (heads/group (x2 gated) + 2) * head_dim]
        s, b, _ = qkv.shape
        n = self.heads_per_group
        gates = n if self.gated else 0
        qkv = qkv.transpose(0, 1).reshape(b, s, self.local_groups, n + gates + 2, self.head_dim)
        q, gate, k, v = qkv.split([n, gates, 1, 1], dim=3)
        q = q.reshape(b, s, self.local_groups * n, self.head_dim)
        k = k.squeeze(3)
        v = v.squeeze(3)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if self.qk_l2_eps is not None:  # (before RoPE, as Megatron; a rotation keeps the RMS, so after is the same)
            q, k = l2_norm(q, self.qk_l2_eps), l2_norm(k, self.qk_l2_eps)
        if rope is not None and not self.skips_rope:
            q, k = self._rotate(q, rope), self._rotate(k, rope)
        if self.temperature is not None:  # (after the L2 norm, as transformers; a NoPE layer has no RoPE)
            q = temperature_scaled(q, self._positions(s, kv_cache, q.device), *self.temperature)
        if kv_cache is not None:
            k, v = kv_cache.append(self.layer_number, k, v, self.core_attention.chunk)
        if self.recompute_core_attention and self.training:
            out = checkpoint(
                functools.partial(self.core_attention, documents=documents), self.core_attention.rng, q, k, v
            )
        else:
            out = self.core_attention(q, k, v, documents)
        if self.gated:  # (per token: context parallelism's shard of the sequence gates its own outputs)
            out = output_gate(out, gate)
        return self.linear_proj(out.transpose(0, 1))
