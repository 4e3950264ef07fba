"""The decoder-only language model: Llama, Qwen2, Mistral-style and GPT-2 from one config.

Shapes: input ids and labels are [batch, seq]; the residual stream is [seq, batch, hidden] (under
sequence parallelism [seq / TP, batch, hidden]); logits are [batch, seq, padded_vocab / TP], this rank's
vocabulary slice, and the loss is computed from them without gathering the vocabulary.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from megatron_lite import kernels as K
from megatron_lite.config import ModelConfig
from megatron_lite.models.mtp import MultiTokenPredictionBlock
from megatron_lite.models.rope import RotaryEmbedding
from megatron_lite.models.transformer import TransformerBlock, dropout
from megatron_lite.models.weights import (
    init_parameters,
    load_full_state_dict,
    local_full_state_dict,
    xavier_instead_of_normal,
)
from megatron_lite.parallel_context import ParallelContext, chunk_layers
from megatron_lite.parameters import ParamMeta, named_param_meta, set_param_meta
from megatron_lite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lite.tensor_parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from megatron_lite.tensor_parallel.mappings import split_dim0

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def _mark_embedding_copy(module: nn.Module) -> None:
    """`module.weight` is the last stage's copy of the first stage's word embeddings: summed with it over the
    embedding group, counted and stored once (ParamMeta.embedding_copy)."""
    meta = next(m for n, _, m in named_param_meta(module) if n == "weight")
    set_param_meta(module, "weight", dataclasses.replace(meta, embedding_copy=True))


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
        self.fp32_residual = config.fp32_residual_connection
        self.rng = ctx.rng
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size,
            config.padded_vocab_size(ctx.tp.size),
            config.hidden_size,
            ctx.tp,
            reduce_scatter_embeddings=ctx.sequence_parallel,
            init_std=config.embedding_init_std,
            device=device,
            dtype=dtype,
        )
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(
                config.max_position_embeddings, config.hidden_size, device=device, dtype=dtype
            )
            meta = ParamMeta(("normal", config.embedding_init_std), sequence_parallel=ctx.sequence_parallel)
            set_param_meta(self.position_embeddings, "weight", meta)
        else:
            self.position_embeddings = None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and input_ids.shape[1] % self.tp.size:  # (said in the model's terms)
            raise ValueError(
                f"a sequence of {input_ids.shape[1]} tokens does not split over --tensor-model-parallel-size "
                f"{self.tp.size} under --sequence-parallel: give a multiple of {self.tp.size}"
            )
        x = self.word_embeddings(input_ids)  # [seq (shard), batch, hidden]
        if self.position_embeddings is not None:
            pos = position_ids.t()  # [seq, batch]
            if self.sequence_parallel:
                pos = split_dim0(pos, self.tp)
            x = x + self.position_embeddings(pos)
        if self.fp32_residual:  # (as Megatron's LanguageModelEmbedding: the stream starts fp32, before dropout)
            x = x.float()
        return dropout(x, self.dropout_p, self.training, self.rng, self.sequence_parallel)


def stream_dtype(config: ModelConfig, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the hidden states between layers, and so between pipeline stages (what a stage receives and
    sends): fp32 under --fp32-residual-connection (as Megatron's inference p2p buffers), else the compute dtype."""
    return torch.float32 if config.fp32_residual_connection else compute_dtype


class GPTModel(nn.Module):
    """The model, or one pipeline stage of it: `layers` are the global layer numbers it runs,
    `pre_process` adds the embeddings (first stage), `post_process` the final norm, output layer and loss
    (last stage). A middle stage takes and returns hidden states [seq (shard), batch, hidden]."""

    def __init__(
        self,
        config: ModelConfig,
        ctx: ParallelContext,
        *,
        seed: int = 1234,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        layers: range | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> None:
        super().__init__()
        device = torch.device(device) if device is not None else ctx.device
        layers = range(config.num_layers) if layers is None else layers
        self.config = config
        # The dtype the weights were built in (Megatron's params_dtype): what the stage computes and sends in, read
        # from here, not from a parameter, as a stage of no-op layers holds none
        self.params_dtype = dtype
        self.tp = ctx.tp
        self.vocab_size = config.vocab_size
        self.first_expert = ctx.ep.rank * (config.num_experts // ctx.ep.size) if config.num_experts else 0
        self.pre_process, self.post_process = pre_process, post_process
        # Multi-token prediction runs on the last stage and embeds tokens there too: a stage without the
        # embeddings holds a copy of the word embeddings, kept equal like tied embeddings' (same name and init).
        mtp = post_process and config.mtp_num_layers > 0
        self.embedding = LanguageModelEmbedding(config, ctx, device, dtype) if pre_process or mtp else None
        if mtp and not pre_process:
            _mark_embedding_copy(self.embedding.word_embeddings)
        self.rotary_pos_emb = (
            RotaryEmbedding(config.rotary_dim, config.rotary_base, config.rope_scaling, device=device)
            if config.position_embedding_type == "rope"
            else None
        )
        self.decoder = TransformerBlock(config, ctx, len(layers), layers.start, post_process, device, dtype)
        self.output_layer = None
        if post_process:
            self.output_layer = ColumnParallelLinear(
                config.hidden_size,
                config.vocab_size,
                ctx.tp,
                bias=False,
                sequence_parallel=ctx.sequence_parallel,
                # (a tied copy of the word embeddings is initialised as they are)
                init_std=config.embedding_init_std if config.tied_embeddings else config.init_method_std,
                padded_output_size=config.padded_vocab_size(ctx.tp.size),
                skip_weight_param_allocation=config.tied_embeddings and self.embedding is not None,
                device=device,
                dtype=dtype,
            )
            if config.tied_embeddings and self.embedding is None:
                # The last stage holds a copy of the first stage's word embeddings (same name, same init).
                _mark_embedding_copy(self.output_layer)
        self.mtp = MultiTokenPredictionBlock(config, ctx, device, dtype) if mtp else None
        if device.type != "meta":
            self.init_weights(seed)

    # Weights ------------------------------------------------------------------------------------
    def global_name(self, name: str) -> str:
        """A parameter's name with the global layer number, the same under any pipeline split."""
        if name == "output_layer.weight" and self.config.tied_embeddings and self.embedding is None:
            return _WORD_EMBEDDINGS
        m = _LAYER.match(name)
        if m is not None:
            number = self.decoder.layers[int(m.group(1))].layer_number
            name = f"decoder.layers.{number}.{name[m.end() :]}"
        elif not name.startswith("mtp."):
            return name
        # Experts by their global index: the same name whichever expert-parallel rank holds them.
        return _EXPERT.sub(lambda e: f".mlp.experts.{self.first_expert + int(e.group(1))}.", name)

    def init_weights(self, seed: int) -> None:
        c = self.config
        if c.init_method_xavier_uniform:
            xavier_instead_of_normal(self, c.embedding_init_method_std not in (None, c.init_method_std))
        init_parameters(self, seed, self.global_name)
        if self.rotary_pos_emb is not None:
            self.rotary_pos_emb.reset_parameters()

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load_full_state_dict(self, state, self.global_name)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors of an unsharded model (TP = 1), padding trimmed."""
        return local_full_state_dict(self, self.global_name)

    def output_weight(self) -> torch.Tensor:
        if self.config.tied_embeddings and self.embedding is not None:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    # Forward ------------------------------------------------------------------------------------
    def _fused_loss(self, x: torch.Tensor, labels: torch.Tensor, grads_in_forward: bool) -> torch.Tensor:
        """Output layer and cross-entropy in chunks (Triton): the logits never exist in full. Padding rows
        of the vocabulary (at the end of the last shards) are left out of the weight. x: [seq (shard), batch,
        hidden]; returns the loss per token [batch, seq]."""
        x = self.output_layer.gather_input(x)  # [seq, batch, hidden] on every TP rank
        s, b, h = x.shape
        weight = self.output_weight()
        start = self.tp.rank * weight.shape[0]
        real = max(0, min(weight.shape[0], self.vocab_size - start))
        loss = K.fused_linear_cross_entropy(
            x.reshape(s * b, h),
            weight[:real],
            labels.t().reshape(s * b),
            reduction="none",
            tp_group=self.tp.pg if self.tp.size > 1 else None,
            vocab_start=start,
            vocab_size=self.vocab_size,
            # (not in fp16: gradients made at unit scale would lose the small probabilities that loss scaling keeps)
            grads_in_forward=grads_in_forward and x.dtype != torch.float16,
        )
        return loss.view(s, b).t()

    def token_loss(self, x: torch.Tensor, labels: torch.Tensor, grads_in_forward: bool = False) -> torch.Tensor:
        """The output layer and the cross-entropy of hidden states x [seq (shard), batch, hidden]: the loss
        per token [batch, seq]. Fused (Triton) where Triton can run these tensors; elsewhere (CPU tensors on a
        GPU machine, outside the interpreter) the vocab-parallel path, as every other kernel takes its reference.
        grads_in_forward: the fused path makes its gradients in the forward (the caller sums the losses; see
        `forward`); only for the loss computed last, as each such loss holds a vocab x hidden weight gradient
        until its backward."""
        if self.config.kernel_impl == "triton" and K.triton_usable(x):
            return self._fused_loss(x, labels, grads_in_forward)
        logits = self.output_layer(x, weight=self.output_weight())  # [seq, batch, vocab shard]
        return vocab_parallel_cross_entropy(logits, labels.t(), self.tp, self.vocab_size).t()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        kv_cache=None,
        document_ids: torch.Tensor | None = None,
        mtp: dict[str, torch.Tensor] | None = None,
        last_logits_only: bool = False,
        grads_in_forward: bool = False,
    ) -> torch.Tensor:
        """Per-token loss [batch, seq] when `labels` is given, else this rank's logits
        [batch, seq, padded_vocab / TP]; a stage without the output layer returns its hidden states.
        `kv_cache` (inference): `position_ids` continue from the cached tokens, whose keys and values the
        attention layers read and extend. `document_ids` [batch, seq] (--reset-attention-mask): tokens attend
        only to earlier tokens of their own document. `mtp`: the multi-token-prediction inputs (models/mtp.py,
        `mtp_inputs`); in training their losses join the returned loss's backward. `last_logits_only`
        (generation): the logits of the last position alone (a prompt's others would be [prompt, vocab] for nothing).

        `grads_in_forward`: the caller promises to sum the per-token losses with one scale and to label the
        tokens outside the loss mask -100 (`counted_labels`), as the training step does. Every counted token's
        loss then gets the same gradient, and the fused cross-entropy makes its gradients in the forward instead
        of recomputing the logits in the backward. A caller that breaks the promise gets, on a CPU, exact
        gradients, a warning and that recomputation; on a GPU, which reads nothing on the host there, a device
        assert that stops the process. Hence off by default: any other use of the losses is exact."""
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
        x = self.embedding(input_ids, position_ids) if self.pre_process else hidden_states
        rope = self.rotary_pos_emb(position_ids) if self.rotary_pos_emb is not None else None
        x = self.decoder(x, rope, kv_cache, documents=document_ids)
        if not self.post_process:
            return x
        if labels is None:
            x = x[-1:] if last_logits_only else x
            return self.output_layer(x, weight=self.output_weight()).transpose(0, 1)
        run_mtp = self.mtp is not None and self.training and kv_cache is None
        loss = self.token_loss(x, labels, grads_in_forward=grads_in_forward and not run_mtp)
        if run_mtp:
            if mtp is None:
                raise ValueError("a model with --mtp-num-layers trains on micro-batches with mtp_inputs added")
            promised = grads_in_forward  # (the depths' loss takes its own flag: a depth keeps it only if promised)

            def depth_loss(h: torch.Tensor, lab: torch.Tensor, grads_in_forward: bool = False) -> torch.Tensor:
                return self.token_loss(h, lab, grads_in_forward=grads_in_forward and promised)

            loss = self.mtp(x, self.embedding, depth_loss, loss, mtp, rope, document_ids)
        return loss


class ModelChunks(nn.ModuleList):
    """This rank's model chunks (one per virtual pipeline stage; one without pipelining)."""

    def global_name(self, name: str) -> str:
        chunk, rest = name.split(".", 1)
        return self[int(chunk)].global_name(rest)

    def forward(self, *args, **kwargs):
        if len(self) != 1:
            raise RuntimeError("a pipelined model runs through the pipeline executor, chunk by chunk")
        return self[0](*args, **kwargs)


def build_model(
    config: ModelConfig, ctx: ParallelContext, *, seed: int = 1234, device=None, dtype: torch.dtype = torch.float32
) -> ModelChunks:
    """The chunks this rank runs: virtual stage s = chunk * PP + pipeline rank holds its layers; the first
    stage has the embeddings, the last the output layer and loss."""
    pp, vp = ctx.pp.size, ctx.vp_size
    chunks = []
    for c in range(vp):
        stage = c * pp + ctx.pp.rank
        layers = chunk_layers(config.num_layers, pp, vp, ctx.pp.rank, c, ctx.parallel)
        chunks.append(
            GPTModel(
                config,
                ctx,
                seed=seed,
                device=device,
                dtype=dtype,
                layers=layers,
                pre_process=stage == 0,
                post_process=stage == pp * vp - 1,
            )
        )
    return ModelChunks(chunks)
