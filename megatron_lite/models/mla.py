"""Multi-latent attention (DeepSeek-V2/V3; Megatron's --multi-latent-attention).

Per token, queries come from a q_lora_rank latent (or straight from the hidden state when --q-lora-rank is
unset), and keys and values from one kv_lora_rank latent plus a qk_pos_emb_head_dim RoPE part that every head
shares. Each query/key head is [qk_head_dim dims without position, qk_pos_emb_head_dim dims with RoPE]; values
have v_head_dim. With --qk-layernorm each latent is RMS-normalised before its up-projection.

Tensor parallelism splits heads, as for ordinary attention: the up-projections are column-parallel and the
output projection row-parallel. The down-projections are column-parallel with their output gathered, so every
rank holds the whole latent (the split only divides their GEMM); the latents' norms then see identical inputs
and gradients on every rank. The shared RoPE key part feeds only this rank's heads, so its gradient is partial:
it enters through copy_to_tensor_model_parallel_region, whose backward sums it over TP.

Values keep their own head size through the attention kernels (the flash kernel, context-parallel attention and
SDPA all take a v_head_dim other than the query/key head's), so no padding is stored, multiplied or sent. In
inference the KV cache keeps the latents (kv_lora_rank + RoPE dims per token), as transformers does. The prompt's
forward expands keys and values from them as training does; each decoding step after it attends to the latents
themselves, the key up-projection absorbed into the query and the value up-projection applied after the
attention (DeepSeek-V2's inference form): a step then reads kv_lora_rank + RoPE values per cached token instead
of making every head's key and value of every cached token again (heads x (qk_head_dim + v_head_dim) each).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from megatron_lite import kernels as K
from megatron_lite.config import ConfigError, ModelConfig
from megatron_lite.kernels.nf4 import dequantize_nf4
from megatron_lite.models.attention import CoreAttention, attention_mask
from megatron_lite.models.norms import build_norm
from megatron_lite.models.qk_clip import group_eta, qkv_row_scale_parts
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_lite.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron_lite.tensor_parallel.random import Regenerated, checkpoint


class MultiLatentAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, ctx: ParallelContext, device=None, dtype=torch.float32, layer_number: int = 0
    ) -> None:
        super().__init__()
        tp = ctx.tp
        self.tp = tp
        self.layer_number = layer_number
        self.local_heads = config.num_attention_heads // tp.size
        self.nope, self.pe, self.v_dim = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        heads, hidden = config.num_attention_heads, config.hidden_size
        common = dict(
            tp=tp,
            bias=False,
            sequence_parallel=ctx.sequence_parallel,
            triton_gemm=config.kernel_impl == "triton",
            init_std=config.init_method_std,
            device=device,
            dtype=dtype,
        )
        q_out = heads * config.mla_q_head_dim
        latent_in = {**common, "sequence_parallel": False}  # a gathered latent (whole sequence): no second gather
        if config.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(hidden, q_out, **common)
            self.linear_q_down_proj = self.q_layernorm = self.linear_q_up_proj = None
        else:
            self.linear_q_proj = None
            self.linear_q_down_proj = ColumnParallelLinear(hidden, config.q_lora_rank, gather_output=True, **common)
            self.q_layernorm = (
                build_norm(config, False, device, dtype, size=config.q_lora_rank) if config.qk_layernorm else None
            )
            self.linear_q_up_proj = ColumnParallelLinear(config.q_lora_rank, q_out, **latent_in)
        self.linear_kv_down_proj = ColumnParallelLinear(
            hidden, config.kv_lora_rank + config.qk_pos_emb_head_dim, gather_output=True, **common
        )
        self.kv_layernorm = (
            build_norm(config, False, device, dtype, size=config.kv_lora_rank) if config.qk_layernorm else None
        )
        kv_out = heads * (config.qk_head_dim + config.v_head_dim)  # per head: [k without position, v]
        self.linear_kv_up_proj = ColumnParallelLinear(config.kv_lora_rank, kv_out, **latent_in)
        self.core_attention = CoreAttention(config, ctx, layer_number, device)
        self.linear_proj = RowParallelLinear(
            heads * config.v_head_dim,
            hidden,
            tp,
            bias=False,
            sequence_parallel=ctx.sequence_parallel,
            comm_overlap=ctx.parallel.tp_comm_overlap and ctx.parallel.tp_comm_overlap_rs,
            triton_gemm=config.kernel_impl == "triton",
            init_std=config.output_layer_init_std,
            device=device,
            dtype=dtype,
        )
        self.rope = K.apply_rope if config.kernel_impl == "triton" else K.apply_rope_reference
        modules = config.recompute_modules if config.recompute_granularity == "selective" else ()
        self.recompute_core_attention = "core_attn" in modules
        # mla_up_proj: the per-head queries, keys and values (the up-projections' and RoPE's outputs) are not kept
        # but made again from the latents in the backward (Megatron discards the up-projections' outputs)
        self.recompute_up_proj = "mla_up_proj" in modules

    def qk_clip_row_scales(self, max_logits: torch.Tensor, threshold: float, alpha: float) -> list:
        """QK-clip per head (Megatron-Core's MLASelfAttention.clip_qk): the query projection's rows of a head, its
        part without position by eta^alpha and its RoPE part by eta (the key's RoPE part is shared by every head,
        so the whole correction is on the query side); the key/value up-projection's key rows by eta^(1 - alpha),
        its value rows and the down-projections untouched."""
        eta = group_eta(max_logits, self.local_heads, threshold)
        ones = torch.ones_like(eta)
        q_weight = (self.linear_q_proj if self.linear_q_proj is not None else self.linear_q_up_proj).weight
        q = qkv_row_scale_parts(eta, [(self.nope, eta.pow(alpha)), (self.pe, eta)])
        kv = qkv_row_scale_parts(eta, [(self.nope, eta.pow(1.0 - alpha)), (self.v_dim, ones)])
        return [(q_weight, q), (self.linear_kv_up_proj.weight, kv)]

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, kv_cache=None, documents=None
    ) -> torch.Tensor:
        """x: [seq (or its shard), batch, hidden] -> [same, batch, hidden] (SelfAttention's contract)."""
        if self.linear_q_proj is not None:
            q_in = self.linear_q_proj(x)  # the queries themselves
        else:
            latent = self.linear_q_down_proj(x)  # [seq (all of it under SP), batch, q_lora_rank]
            q_in = self.q_layernorm(latent) if self.q_layernorm is not None else latent
        kv_latent, k_pe = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.pe], dim=-1)
        if self.kv_layernorm is not None:
            kv_latent = self.kv_layernorm(kv_latent)
        # one RoPE key part for all heads, read by this rank's heads only: its gradient is summed over TP
        k_pe = copy_to_tensor_model_parallel_region(k_pe, self.tp).transpose(0, 1).unsqueeze(2)  # [b, s, 1, pe]
        if self.recompute_up_proj and self.training and self.recompute_core_attention:
            # both modules: one checkpoint recomputes the up-projections and the attention from the latents
            attend = functools.partial(self._attend, rope=rope, documents=documents)
            out = checkpoint(attend, self.core_attention.rng, q_in, kv_latent, k_pe)
        elif self.recompute_up_proj and self.training:
            # mla_up_proj alone (Megatron's): the attention keeps its output and is not run again; the per-head
            # q, k, v it saves are dropped and made again from the latents when its backward asks for them
            regen = Regenerated(self.core_attention.rng)  # (LoRA adapters on the up-projections may drop out)
            q, k, v = regen.first(functools.partial(self._up_project, q_in, kv_latent, k_pe, rope))
            with regen.hooks():
                out = self.core_attention(q, k, v, documents)
        else:
            out = self._attend(q_in, kv_latent, k_pe, rope, kv_cache, documents)
        s, b = out.shape[1], out.shape[0]
        return self.linear_proj(out.reshape(b, s, self.local_heads * self.v_dim).transpose(0, 1))

    def _attend(self, q_in, kv_latent, k_pe, rope, kv_cache=None, documents=None) -> torch.Tensor:
        """The up-projections, RoPE and the core attention: [batch, seq, local heads, v_head_dim]."""
        if kv_cache is not None and kv_cache.offset > 0 and documents is None:
            return self._attend_absorbed(q_in, kv_latent, k_pe, rope, kv_cache)
        q, k, v = self._up_project(q_in, kv_latent, k_pe, rope, kv_cache)
        # (inside the mla_up_proj checkpoint the attention is recomputed with it already)
        if self.recompute_core_attention and self.training and not self.recompute_up_proj:
            return checkpoint(
                functools.partial(self.core_attention, documents=documents), self.core_attention.rng, q, k, v
            )
        return self.core_attention(q, k, v, documents)

    def _queries(self, q_in, k_pe, rope):
        """Per-head queries [batch, seq, local heads, qk_head_dim] without position and with RoPE (pe), and the
        shared key's RoPE part [batch, seq, 1, pe] rotated."""
        q = q_in if self.linear_q_proj is not None else self.linear_q_up_proj(q_in)
        s, b, _ = q.shape
        q = q.transpose(0, 1).reshape(b, s, self.local_heads, self.nope + self.pe)
        q_nope, q_pe = q.split([self.nope, self.pe], dim=-1)
        if rope is not None:
            cos, sin = rope
            q_pe, k_pe = self.rope(q_pe, cos, sin), self.rope(k_pe, cos, sin)
        return q_nope, q_pe, k_pe

    def _up_project(self, q_in, kv_latent, k_pe, rope, kv_cache=None):
        """The up-projections and RoPE: per-head q, k [batch, seq, local heads, qk head] and v (v_head_dim)."""
        q_nope, q_pe, k_pe = self._queries(q_in, k_pe, rope)
        b, s = q_nope.shape[:2]
        if kv_cache is not None:  # the cache keeps the latents (kv_lora_rank + pe per token, not heads x 2 x head)
            latents, k_pe = kv_cache.append(self.layer_number, kv_latent.transpose(0, 1).unsqueeze(2), k_pe)
            kv_latent = latents.squeeze(2).transpose(0, 1)  # [every token so far, b, kv_lora_rank]
        t = kv_latent.shape[0]
        kv = self.linear_kv_up_proj(kv_latent).transpose(0, 1).reshape(b, t, self.local_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        v = v.contiguous()  # a view would keep the whole up-projection output alive where v is saved (ring, recompute)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(b, t, self.local_heads, self.pe)], dim=-1)
        return q, k, v

    def _attend_absorbed(self, q_in, kv_latent, k_pe, rope, kv_cache) -> torch.Tensor:
        """A decoding step on the cached latents: score_t = q_nope W_uk . c_t + q_pe . k_pe_t (the same number as
        k_nope_t = W_uk c_t would give), out = W_uv (sum_t p_t c_t). [batch, seq, local heads, v_head_dim]."""
        q_nope, q_pe, k_pe = self._queries(q_in, k_pe, rope)
        latents, k_pe = kv_cache.append(self.layer_number, kv_latent.transpose(0, 1).unsqueeze(2), k_pe)
        latents, k_pe = latents.squeeze(2), k_pe.squeeze(2)  # [b, every token so far, kv_lora_rank], [.., pe]
        w_uk, w_uv = kv_cache.derived(self.layer_number, self._absorbed_weights)
        # the scores in fp32, as the flash kernel and SDPA's fused backends accumulate q.k (bf16 einsums, added in
        # bf16, were 3x further from fp64 at DeepSeek-V3's sizes); the step's query in fp32 too
        q_latent = torch.einsum("bshn,hnr->bshr", q_nope.float(), w_uk.float())
        scores = torch.einsum("bshr,btr->bsht", q_latent, latents.float())
        scores = scores + torch.einsum("bshp,btp->bsht", q_pe.float(), k_pe.float())
        scores = scores * self.core_attention.scale
        s, t = scores.shape[1], scores.shape[3]
        mask = attention_mask(s, t, self.core_attention.window, scores.device)
        if mask is not None:
            scores = scores.masked_fill(~mask.unsqueeze(1), -torch.inf)
        probs = torch.softmax(scores, dim=-1).to(latents.dtype)
        return torch.einsum("bshr,hvr->bshv", torch.einsum("bsht,btr->bshr", probs, latents), w_uv)

    def absorbed_bytes(self) -> int:
        """What `_absorbed_weights` makes beside the parameters, held for a whole generation: nothing for a
        plain weight (its views), a dense up-projection where an NF4 base is dequantised or LoRA's B A added."""
        layer = self.linear_kv_up_proj
        if layer.nf4 is None and layer.lora is None:
            return 0
        dtype = layer.nf4.dtype if layer.nf4 is not None else layer.weight.dtype
        return self.local_heads * (self.nope + self.v_dim) * self.kv_lora_rank * dtype.itemsize

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The key/value up-projection as applied (the NF4 base dequantised, LoRA's B A added), split per local
        head: W_uk [heads, qk_head_dim, kv_lora_rank] and W_uv [heads, v_head_dim, kv_lora_rank]."""
        layer = self.linear_kv_up_proj
        w = layer.weight if layer.nf4 is None else dequantize_nf4(layer.nf4.weight())
        if layer.lora is not None:  # (eval: no adapter dropout) its output for each unit input is (s B A)^T
            w = w + layer.lora(torch.eye(self.kv_lora_rank, device=w.device, dtype=w.dtype)).t()
        w = w.view(self.local_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope :]


def validate_mla_config(c: ModelConfig) -> None:
    """ModelConfig's checks of the --multi-latent-attention settings (part of its validate())."""
    if not c.multi_latent_attention:
        return
    for flag, value in (
        ("--kv-lora-rank", c.kv_lora_rank),
        ("--qk-head-dim", c.qk_head_dim),
        ("--qk-pos-emb-head-dim", c.qk_pos_emb_head_dim),
        ("--v-head-dim", c.v_head_dim),
        ("--q-lora-rank", 1 if c.q_lora_rank is None else c.q_lora_rank),
    ):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be a positive integer (with --multi-latent-attention)")
    if c.qk_pos_emb_head_dim % 2:
        raise ConfigError(f"--qk-pos-emb-head-dim {c.qk_pos_emb_head_dim} must be even (RoPE rotates pairs)")
    if c.position_embedding_type != "rope":
        raise ConfigError(
            f"--multi-latent-attention needs --position-embedding-type rope (got {c.position_embedding_type})"
        )
    if c.query_groups != c.num_attention_heads:
        raise ConfigError(
            f"--multi-latent-attention gives every head its own key and value; --num-query-groups "
            f"{c.query_groups} must equal --num-attention-heads {c.num_attention_heads} (drop "
            "--group-query-attention)"
        )
    for flag, on in (
        ("--rotary-interleaved", c.rotary_interleaved),
        ("--rotary-percent", c.rotary_percent != 1.0),
        ("--window-size", c.sliding_window is not None),
        ("--add-qkv-bias", c.add_qkv_bias),
    ):
        if on:
            raise ConfigError(f"--multi-latent-attention with {flag} is not supported; drop one of them")
    if c.add_bias_linear:
        raise ConfigError(  # (Megatron's MLA has one, on its output projection; DeepSeek's have none)
            "--multi-latent-attention with biases (the default) is not supported: here MLA's projections have "
            "no biases, as DeepSeek-V2/V3's; add --disable-bias-linear"
        )
