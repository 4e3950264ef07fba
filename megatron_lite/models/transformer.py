"""Transformer layers and the block that stacks them, with Megatron's activation recomputation.

A layer reads like the single-device math: pre-norm attention and MLP with residuals. Communication
lives inside the parallel linear layers; the only layout-dependent choice here is which generator
hidden dropout draws from (per TP rank when the activations are sequence-sharded, shared otherwise).

--apply-residual-connection-post-layernorm adds each branch to its norm's output instead of its input;
--fp32-residual-connection keeps the stream the residuals add into in fp32 (the norms give the branches the
compute dtype; a bf16 branch output added to the fp32 stream is summed in fp32).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.models.attention import SelfAttention
from megatron_lite.models.mla import MultiLatentAttention
from megatron_lite.models.mlp import MLP
from megatron_lite.models.norms import build_norm
from megatron_lite.moe.layer import MoELayer
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.tensor_parallel.layers import ColumnParallelLinearGathered
from megatron_lite.tensor_parallel.random import Regenerated, RNGStatesTracker, checkpoint


def dropout(x: torch.Tensor, p: float, training: bool, rng: RNGStatesTracker, sharded: bool) -> torch.Tensor:
    """Dropout on the residual stream. `sharded`: each rank holds different activations (a sequence
    shard), so masks come from the per-rank generator; otherwise all TP ranks draw the same mask."""
    if not training or p == 0.0:
        return x
    with rng.fork() if sharded else contextlib.nullcontext():
        return F.dropout(x, p, training=True)


def _linear_replacement(config: ModelConfig, ctx: ParallelContext, device, dtype) -> nn.Module:
    """A heterogeneous layer's attention or MLP replaced with one [hidden -> hidden] linear on the normed input
    (Megatron's ColumnParallelLinearGathered: the model's init std, its --add-bias-linear)."""
    h = config.hidden_size
    return ColumnParallelLinearGathered(
        h,
        h,
        ctx.tp,
        bias=config.add_bias_linear,
        sequence_parallel=ctx.sequence_parallel,
        init_std=config.init_method_std,
        device=device,
        dtype=dtype,
    )


def build_attention(config: ModelConfig, ctx: ParallelContext, layer_number: int, device, dtype) -> nn.Module:
    """Layer `layer_number`'s attention: its linear replacement in a heterogeneous model, else self-attention
    (multi-latent or not) built with the layer's own config (a heterogeneous layer's own query groups)."""
    blocks = config.heterogeneous_blocks
    if blocks is not None and blocks[layer_number].attention == "linear":
        return _linear_replacement(config, ctx, device, dtype)
    layer = config.layer_config(layer_number) if blocks is not None else config
    attention = MultiLatentAttention if layer.multi_latent_attention else SelfAttention
    return attention(layer, ctx, device, dtype, layer_number)


def build_mlp(config: ModelConfig, ctx: ParallelContext, layer_number: int, device, dtype) -> nn.Module:
    """Layer `layer_number`'s MLP: a MoE layer, a heterogeneous layer's linear replacement, or a dense MLP of the
    layer's own FFN size."""
    if config.is_moe_layer(layer_number):
        return MoELayer(config, ctx, device, dtype)
    blocks = config.heterogeneous_blocks
    if blocks is not None and blocks[layer_number].mlp == "linear":
        return _linear_replacement(config, ctx, device, dtype)
    return MLP(config.layer_config(layer_number) if blocks is not None else config, ctx, device, dtype)


class TransformerLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, ctx: ParallelContext, layer_number: int, device=None, dtype=torch.float32
    ) -> None:
        super().__init__()
        self.layer_number = layer_number  # global, 0-based: the same at any pipeline layout
        self.hidden_dropout = config.hidden_dropout
        self.post_norm_residual = config.apply_residual_connection_post_layernorm
        self.fp32_residual = config.fp32_residual_connection
        self.rng = ctx.rng
        self.sequence_parallel = ctx.sequence_parallel
        self.input_layernorm = build_norm(config, ctx.sequence_parallel, device, dtype)
        self.self_attention = build_attention(config, ctx, layer_number, device, dtype)
        self.pre_mlp_layernorm = build_norm(config, ctx.sequence_parallel, device, dtype)
        self.mlp = build_mlp(config, ctx, layer_number, device, dtype)
        modules = config.recompute_modules if config.recompute_granularity == "selective" else ()
        # (as in Megatron, "mlp" is a dense layer's MLP and "moe" a MoE layer's)
        mlp = "moe" if config.is_moe_layer(layer_number) else "mlp"
        self.recompute = {"layernorm": "layernorm" in modules, "mlp": mlp in modules}

    def _maybe_recompute(self, name: str, fn, *args: torch.Tensor):
        """Checkpoint `fn` when `name` is in --recompute-modules (the MLP; the norms are Regenerated)."""
        if self.recompute[name] and self.training:
            return checkpoint(fn, self.rng, *args)
        return fn(*args)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, kv_cache=None, documents=None
    ) -> torch.Tensor:
        """`documents` [batch, seq]: each token's document (--reset-attention-mask), attention kept inside it.

        --recompute-modules layernorm (Megatron's CheckpointWithoutOutput): each norm's output, which the
        attention's and the MLP's first GEMMs save for their weight gradients, is dropped after the forward and
        made again from the norm's input (saved anyway, by the norm) when the backward first needs it: one
        [s, b, h] a norm. (Checkpointing the norm alone freed nothing: its consumers kept its output.)"""
        if self.fp32_residual:  # (the embeddings and the previous stage send fp32; an MTP depth's projection not)
            x = x.float()
        regen = self.recompute["layernorm"] and self.training
        if regen:  # (the norm itself checkpointed too: it keeps only its input, not the PyTorch norm's temporaries)
            attn_norm = Regenerated(self.rng)
            h = attn_norm.first(functools.partial(checkpoint, self.input_layernorm, self.rng, x))
        else:
            h = self.input_layernorm(x)
        if self.post_norm_residual:  # (the norm's output joins the stream: in its dtype, fp32 under the flag)
            x = h.to(x.dtype)
        with attn_norm.hooks() if regen else contextlib.nullcontext():
            h = self.self_attention(h, rope, kv_cache, documents)
        h = dropout(h, self.hidden_dropout, self.training, self.rng, self.sequence_parallel)
        if not regen or self.pre_mlp_layernorm.triton:
            # x + h and its norm in one pass (one kernel with --kernel-impl triton, which keeps the sum alone; an
            # fp32 stream beside a bf16 h is summed and normalised in fp32)
            h, x = self.pre_mlp_layernorm(h, x)
        else:  # the sum (the next residual, alive anyway), then its norm keeping only it
            x = x + h
            h = checkpoint(self.pre_mlp_layernorm, self.rng, x)
        if regen:  # made again from the sum (the fused kernel normalises the sum it returns: the same values)
            mlp_norm = Regenerated(self.rng)
            mlp_norm.adopt(h, functools.partial(self.pre_mlp_layernorm, x))
        if self.post_norm_residual:
            x = h.to(x.dtype)
        with mlp_norm.hooks() if regen else contextlib.nullcontext():
            h = self._maybe_recompute("mlp", self.mlp, h)
        return x + dropout(h, self.hidden_dropout, self.training, self.rng, self.sequence_parallel)


class HybridLayer(nn.Module):
    """One layer of a hybrid Mamba model (Megatron's MambaStack): its own pre-norm, one branch, the residual add.
    The names are Megatron's: a Mamba layer's norm and mixer (MambaLayer), an attention layer's input_layernorm and
    self_attention, an MLP or MoE layer's pre_mlp_layernorm and mlp (its TransformerLayers with the other half
    an identity).

    A heterogeneous model's layer with a no-op attention or MLP is one of these too (`kind` "-" or "*", "" for a
    layer whose both parts are no-ops: an identity), as Megatron's TransformerLayer with an IdentityOp half."""

    def __init__(
        self,
        config: ModelConfig,
        ctx: ParallelContext,
        layer_number: int,
        device=None,
        dtype=torch.float32,
        kind: str | None = None,
    ) -> None:
        super().__init__()
        from megatron_lite.models.mamba import MambaMixer

        self.layer_number = layer_number
        self.kind = config.layer_types[layer_number] if kind is None else kind
        self.hidden_dropout = config.hidden_dropout
        self.fp32_residual = config.fp32_residual_connection
        self.rng = ctx.rng
        self.sequence_parallel = ctx.sequence_parallel
        norm = build_norm(config, ctx.sequence_parallel, device, dtype)
        modules = config.recompute_modules if config.recompute_granularity == "selective" else ()
        self.recompute = False
        if self.kind == "M":
            self.norm, self.mixer = norm, MambaMixer(config, ctx, device, dtype)
        elif self.kind == "*":
            self.input_layernorm = norm
            self.self_attention = build_attention(config, ctx, layer_number, device, dtype)
        elif self.kind:
            self.pre_mlp_layernorm = norm
            moe = self.kind == "E"
            self.mlp = (
                MoELayer(config, ctx, device, dtype) if moe else build_mlp(config, ctx, layer_number, device, dtype)
            )
            self.recompute = ("moe" if moe else "mlp") in modules

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, kv_cache=None, documents=None
    ) -> torch.Tensor:
        if self.fp32_residual:
            x = x.float()
        if not self.kind:  # (a heterogeneous layer whose attention and MLP are both no-ops)
            return x
        if self.kind == "M":
            if documents is not None:  # (refused at start-up; said again here)
                raise ValueError(
                    "a Mamba layer carries its scan across documents: --reset-attention-mask is not supported with "
                    "Mamba layers"
                )
            h = self.mixer(self.norm(x), kv_cache, self.layer_number)
        elif self.kind == "*":
            h = self.self_attention(self.input_layernorm(x), rope, kv_cache, documents)
        else:
            h = self.pre_mlp_layernorm(x)
            h = checkpoint(self.mlp, self.rng, h) if self.recompute and self.training else self.mlp(h)
        return x + dropout(h, self.hidden_dropout, self.training, self.rng, self.sequence_parallel)


def build_layer(config: ModelConfig, ctx: ParallelContext, layer_number: int, device, dtype) -> nn.Module:
    """Decoder layer `layer_number`: a hybrid model's one-branch layer; a heterogeneous layer with a no-op part as
    the one-branch layer of what it keeps; else a transformer layer."""
    if config.hybrid:
        return HybridLayer(config, ctx, layer_number, device, dtype)
    if config.heterogeneous_blocks is not None:
        from megatron_lite.models.heterogeneous import layer_kinds

        kinds = layer_kinds(config, layer_number)
        if kinds != "*-":
            return HybridLayer(config, ctx, layer_number, device, dtype, kind=kinds)
    return TransformerLayer(config, ctx, layer_number, device, dtype)


class TransformerBlock(nn.Module):
    """The layers this rank runs, `layer_offset` being the global number of the first one, and the
    final norm when this rank holds the last layer.

    Full recomputation (`--recompute-granularity full`): `uniform` checkpoints consecutive groups of
    `--recompute-num-layers` layers; `block` checkpoints each of the first `--recompute-num-layers`
    layers and runs the rest normally."""

    def __init__(
        self,
        config: ModelConfig,
        ctx: ParallelContext,
        num_layers: int,
        layer_offset: int = 0,
        final_norm: bool = True,
        device=None,
        dtype=torch.float32,
    ) -> None:
        super().__init__()
        self.config = config
        self.rng = ctx.rng
        self.layers = nn.ModuleList(
            build_layer(config, ctx, layer_offset + i, device, dtype) for i in range(num_layers)
        )
        self.final_layernorm = build_norm(config, ctx.sequence_parallel, device, dtype) if final_norm else None

    def _run(self, start: int, end: int, rope, documents=None):
        def fn(x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers[start:end]:
                x = layer(x, rope, documents=documents)
            return x

        return fn

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, kv_cache=None, documents=None
    ) -> torch.Tensor:
        cfg = self.config
        n = len(self.layers)
        if kv_cache is not None and documents is not None:
            raise ValueError("document masks are for training: inference with a KV cache takes one document")
        if kv_cache is not None:  # inference: no recomputation
            for layer in self.layers:
                x = layer(x, rope, kv_cache)
        elif cfg.recompute_granularity == "full" and self.training:
            k = cfg.recompute_num_layers
            if cfg.recompute_method == "uniform":
                for start in range(0, n, k):
                    x = checkpoint(self._run(start, min(start + k, n), rope, documents), self.rng, x)
            else:  # block
                for i in range(n):
                    run = self._run(i, i + 1, rope, documents)
                    x = checkpoint(run, self.rng, x) if i < k else run(x)
        else:
            x = self._run(0, n, rope, documents)(x)
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x
