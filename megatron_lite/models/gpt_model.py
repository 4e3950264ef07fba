"""The decoder-only language model: Llama, Qwen2, Mistral-style and GPT-2 from one config.

Shapes: input ids and labels are [batch, seq]; the residual stream is [seq, batch, hidden] (under
sequence parallelism [seq / TP, batch, hidden]); logits are [batch, seq, padded_vocab / TP], this rank's
vocabulary slice, and the loss is computed from them without gathering the vocabulary.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.models.rope import RotaryEmbedding
from megatron_lite.models.transformer import TransformerBlock, dropout
from megatron_lite.models.weights import init_parameters, load_full_state_dict, local_full_state_dict
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.parameters import ParamMeta, set_param_meta
from megatron_lite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lite.tensor_parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from megatron_lite.tensor_parallel.mappings import split_dim0

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


class LanguageModelEmbedding(nn.Module):
    """Word embeddings (vocabulary-parallel), learned absolute positions when configured, dropout.

    Under sequence parallelism the word embedding sum is reduce-scattered along the sequence and each
    rank adds the position embeddings of its own sequence shard, so the position table's gradient is
    partial per rank and marked for the TP all-reduce."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, device=None, dtype=torch.float32) -> None:
        super().__init__()
        self.tp = ctx.tp
        self.sequence_parallel = ctx.sequence_parallel
        self.dropout_p = config.hidden_dropout
        self.rng = ctx.rng
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size,
            config.padded_vocab_size(ctx.tp.size),
            config.hidden_size,
            ctx.tp,
            reduce_scatter_embeddings=ctx.sequence_parallel,
            init_std=config.init_method_std,
            device=device,
            dtype=dtype,
        )
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(
                config.max_position_embeddings, config.hidden_size, device=device, dtype=dtype
            )
            meta = ParamMeta(("normal", config.init_method_std), sequence_parallel=ctx.sequence_parallel)
            set_param_meta(self.position_embeddings, "weight", meta)
        else:
            self.position_embeddings = None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids)  # [seq (shard), batch, hidden]
        if self.position_embeddings is not None:
            pos = position_ids.t()  # [seq, batch]
            if self.sequence_parallel:
                pos = split_dim0(pos, self.tp)
            x = x + self.position_embeddings(pos)
        return dropout(x, self.dropout_p, self.training, self.rng, self.sequence_parallel)


class GPTModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        ctx: ParallelContext,
        *,
        seed: int = 1234,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        device = torch.device(device) if device is not None else ctx.device
        self.config = config
        self.tp = ctx.tp
        self.vocab_size = config.vocab_size
        self.embedding = LanguageModelEmbedding(config, ctx, device, dtype)
        self.rotary_pos_emb = (
            RotaryEmbedding(config.head_dim, config.rotary_base, config.rope_scaling, device=device)
            if config.position_embedding_type == "rope"
            else None
        )
        self.decoder = TransformerBlock(config, ctx, config.num_layers, 0, True, device, dtype)
        self.output_layer = ColumnParallelLinear(
            config.hidden_size,
            config.vocab_size,
            ctx.tp,
            bias=False,
            sequence_parallel=ctx.sequence_parallel,
            init_std=config.init_method_std,
            padded_output_size=config.padded_vocab_size(ctx.tp.size),
            skip_weight_param_allocation=config.tied_embeddings,
            device=device,
            dtype=dtype,
        )
        if device.type != "meta":
            self.init_weights(seed)

    # Weights ------------------------------------------------------------------------------------
    def global_name(self, name: str) -> str:
        """A parameter's name with the global layer number, the same under any pipeline split."""
        m = _LAYER.match(name)
        if m is None:
            return name
        number = self.decoder.layers[int(m.group(1))].layer_number
        return f"decoder.layers.{number}.{name[m.end() :]}"

    def init_weights(self, seed: int) -> None:
        init_parameters(self, seed, self.global_name)
        if self.rotary_pos_emb is not None:
            self.rotary_pos_emb.reset_parameters()

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load_full_state_dict(self, state, self.global_name)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors of an unsharded model (TP = 1), padding trimmed."""
        return local_full_state_dict(self, self.global_name)

    def output_weight(self) -> torch.Tensor:
        return self.embedding.word_embeddings.weight if self.config.tied_embeddings else self.output_layer.weight

    # Forward ------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-token loss [batch, seq] when `labels` is given, else this rank's logits
        [batch, seq, padded_vocab / TP]."""
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
        x = self.embedding(input_ids, position_ids)
        rope = self.rotary_pos_emb(position_ids) if self.rotary_pos_emb is not None else None
        x = self.decoder(x, rope)
        logits = self.output_layer(x, weight=self.output_weight())  # [seq, batch, vocab shard]
        if labels is None:
            return logits.transpose(0, 1)
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.tp, self.vocab_size)
        return loss.t()
