"""Multi-token prediction (DeepSeek-V3, section 2.2; Megatron's --mtp-num-layers).

Depth k = 1..D runs after the model's last layer. At each position i it normalises the previous depth's
hidden state (the main model's final hidden state for k = 1) and the embedding of token i + k, projects
their concatenation [embedding, hidden] back to the hidden size, runs one transformer layer and its own final
norm, and predicts token i + k + 1 through the shared output layer. The word embeddings and the output
layer are the main model's.

The inputs each depth needs — the tokens, labels and loss mask shifted left by k, zero past the end — are cut
from the whole sequence before the batch is split over context-parallel ranks (`mtp_inputs`), so no rank
needs its neighbour's tokens. With document ids (--reset-attention-mask), a position whose target lies in
another document carries no loss.

Depth k's loss is the mean over its loss-bearing tokens in the global batch; the training loss adds
mtp_loss_scaling_factor / D times the sum over depths. Its gradient joins the backward through the main
token loss, as the MoE auxiliary losses do: the training step sets each depth's weight, and the summed token
losses per depth accumulate here for logging (`take_loss_sums`).
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.models.attach_loss import attach_loss
from megatron_lite.models.norms import build_norm
from megatron_lite.models.transformer import TransformerLayer
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.tensor_parallel.cross_entropy import counted_labels
from megatron_lite.tensor_parallel.layers import ColumnParallelLinear
from megatron_lite.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megatron_lite.tensor_parallel.random import checkpoint

MTP_KEYS = ("mtp_tokens", "mtp_labels", "mtp_loss_mask", "mtp_position_ids")


def _shift_left(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[..., i + k] at position i, zero past the end."""
    out = torch.zeros_like(x)
    out[..., : x.shape[-1] - k] = x[..., k:]
    return out


def mtp_inputs(mb: dict[str, torch.Tensor], depths: int) -> dict[str, torch.Tensor]:
    """A micro-batch ([batch, seq] tensors, the whole sequences) with each depth's inputs added, stacked as
    [batch, depths, seq]: the tokens embedded at depth k, its labels, loss mask and positions."""
    tokens, labels, mask = mb["tokens"], mb["labels"], mb["loss_mask"]
    b, s = tokens.shape
    positions = mb.get("position_ids")
    if positions is None:
        positions = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    docs = mb.get("document_ids")
    out = {key: [] for key in MTP_KEYS}
    for k in range(1, depths + 1):
        m = _shift_left(mask, k)
        if docs is not None:  # the token embedded at depth k (i + k) must be in token i's document
            m = m * (_shift_left(docs, k) == docs).to(m.dtype)
        out["mtp_tokens"].append(_shift_left(tokens, k))
        out["mtp_labels"].append(counted_labels(_shift_left(labels, k), m))
        out["mtp_loss_mask"].append(m)
        out["mtp_position_ids"].append(_shift_left(positions, k))
    return {**mb, **{key: torch.stack(v, 1) for key, v in out.items()}}


class MultiTokenPredictionLayer(nn.Module):
    """One depth: enorm, hnorm, eh_proj (column-parallel, output gathered), a transformer layer, a final norm."""

    def __init__(
        self, config: ModelConfig, ctx: ParallelContext, layer_number: int, device=None, dtype=torch.float32
    ) -> None:
        super().__init__()
        self.tp = ctx.tp
        self.sequence_parallel = ctx.sequence_parallel
        self.enorm = build_norm(config, ctx.sequence_parallel, device, dtype)
        self.hnorm = build_norm(config, ctx.sequence_parallel, device, dtype)
        self.eh_proj = ColumnParallelLinear(
            2 * config.hidden_size,
            config.hidden_size,
            ctx.tp,
            bias=False,
            gather_output=True,
            sequence_parallel=ctx.sequence_parallel,
            init_std=config.init_method_std,
            device=device,
            dtype=dtype,
        )
        self.transformer_layer = TransformerLayer(config, ctx, layer_number, device, dtype)
        self.final_layernorm = build_norm(config, ctx.sequence_parallel, device, dtype)
        self.rng = ctx.rng
        # As Megatron's MTP: under full uniform recomputation (one depth a unit, whatever --recompute-num-layers
        # says) the whole depth, norms and projection included, keeps only its two inputs; not under block
        self.recompute = config.recompute_granularity == "full" and config.recompute_method == "uniform"

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope, documents=None) -> torch.Tensor:
        def depth(hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
            x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], -1))  # [seq, batch, hidden]
            if self.sequence_parallel:  # back to this rank's sequence shard, as the layer expects
                x = scatter_to_sequence_parallel_region(x, self.tp)
            return self.final_layernorm(self.transformer_layer(x, rope, documents=documents))

        if self.recompute and self.training:
            return checkpoint(depth, self.rng, hidden, embedded)
        return depth(hidden, embedded)


class MultiTokenPredictionBlock(nn.Module):
    """The D depths, on the last pipeline stage. Layer numbers follow the decoder's: num_layers + k - 1."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, device=None, dtype=torch.float32) -> None:
        super().__init__()
        self.depths = config.mtp_num_layers
        self.weight = config.mtp_loss_scaling_factor / max(self.depths, 1)
        self.layers = nn.ModuleList(
            MultiTokenPredictionLayer(config, ctx, config.num_layers + k, device, dtype) for k in range(self.depths)
        )
        # Set by the training step before each forward-backward: the gradient of depth k's summed token loss.
        self.loss_scales = [0.0] * self.depths
        self._loss_sums: list[torch.Tensor] = []  # [depths] per forward, on the device (no host sync)

    def take_loss_sums(self) -> torch.Tensor | None:
        """Each depth's summed masked token losses since the last call (a [depths] float64 tensor), None if
        no forward ran."""
        sums, self._loss_sums = self._loss_sums, []
        return torch.stack(sums).sum(0) if sums else None

    def forward(self, hidden, embed, token_loss_fn, main_loss, mtp: dict[str, torch.Tensor], rope, documents=None):
        """`hidden`: the main model's final hidden states; `embed(tokens, positions)` the shared embedding;
        `token_loss_fn(x, labels, grads_in_forward)` the shared output layer and loss, per token [batch, seq]. Returns
        `main_loss` with every depth's loss attached to its backward."""
        sums = []
        for k, layer in enumerate(self.layers):
            embedded = embed(mtp["mtp_tokens"][:, k], mtp["mtp_position_ids"][:, k])
            # As in Megatron, the next depth reads this depth's normalised output, the one the output layer reads.
            hidden = layer(hidden, embedded, rope, documents)
            last = k == len(self.layers) - 1  # its backward runs first: the one loss that holds its gradients
            token_loss = token_loss_fn(hidden, mtp["mtp_labels"][:, k], grads_in_forward=last)
            loss_sum = (token_loss.float() * mtp["mtp_loss_mask"][:, k]).sum()
            sums.append(loss_sum.detach().double())
            if torch.is_grad_enabled():
                main_loss = attach_loss(main_loss, loss_sum, self.loss_scales[k])
        self._loss_sums.append(torch.stack(sums))
        return main_loss
