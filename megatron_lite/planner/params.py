"""Parameters per rank of a layout, from the model's dimensions alone (no model is built), counted tensor by tensor
as our layers hold them: the vocabulary padded to a multiple of make_vocab_size_divisible_by x TP, grouped-query
QKV split by query group, a tied output layer copied onto the last pipeline stage, a heterogeneous layer
(models/heterogeneous.py) at its own query groups and FFN size, a linear replacement one [hidden, hidden] linear
split over TP and a no-op part nothing (not even its norm), a hybrid model's layer its one part (a Mamba mixer's
heads and groups split over TP: planner/hybrid.py). tests/test_planner.py holds the counts to the built
model's at every layout."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megatron_lite.config import ModelConfig
from megatron_lite.layout_validation import stage_layer_counts
from megatron_lite.models.heterogeneous import NO_OP, NORMAL, BlockConfig
from megatron_lite.optimizer.muon import qkv_split_rows
from megatron_lite.planner.hybrid import MAMBA_MIXER, layer_block, mamba_tensors
from megatron_lite.planner.layout import Layout


@dataclass(frozen=True)
class Matrix:
    """A 2-D weight as one rank holds it ([out, in]), which --optimizer muon's Newton-Schulz orthogonalizes
    (planner/muon_cost.py prices it): `dim` the dimension tensor parallelism splits (None: whole on every rank);
    `qkv` the fused QKV's parts' rows per query group (optimizer/muon.py's qkv_split_rows), split by
    --muon-split-qkv."""

    rows: int
    cols: int
    dim: int | None = None
    qkv: tuple[int, ...] | None = None


# One parameter tensor on one rank: (elements, the matrix Muon steps (a 2-D one but the word embeddings and the
# output layer, optimizer.runs_muon's rule) or None (Adam steps it); whether it is an expert's, sharded over
# expert-data-parallelism)
Tensor = tuple[int, Matrix | None, bool]


@dataclass(frozen=True)
class StageParams:
    dense: int  # parameters sharded over the data-parallel group (x CP)
    expert: int  # expert parameters, sharded over the expert-data-parallel group
    layers: tuple[int, ...]  # global numbers of the layers this rank runs
    embeddings: int = 0  # of `dense`: the word and position embeddings and the output layer (and their copies)
    muon: int = 0  # of the whole: what --optimizer muon steps with Muon (optimizer.runs_muon's rule), not Adam

    @property
    def total(self) -> int:
        return self.dense + self.expert


def _matrix(rows: int, cols: int, dim: int | None, expert: bool = False, qkv: tuple[int, ...] | None = None) -> Tensor:
    """A weight Muon steps: [rows, cols] on this rank, split over TP along `dim` (0: column-parallel, 1: row-)."""
    return rows * cols, Matrix(rows, cols, dim, qkv), expert


def norm_tensors(model: ModelConfig, width: int) -> list[Tensor]:
    """A norm over `width` values: its weight, and LayerNorm's bias (two tensors, as dist_muon splits them)."""
    return [(width, None, False)] * (2 if model.normalization == "LayerNorm" else 1)


def _mlp_tensors(h: int, f: int, swiglu: bool, bias: bool, tp: int, expert: bool = False) -> list[Tensor]:
    fc1 = f * (2 if swiglu else 1) // tp
    fc1_bias, fc2_bias = ([(fc1, None, expert)], [(h, None, expert)]) if bias else ([], [])
    return [_matrix(fc1, h, 0, expert), *fc1_bias, _matrix(h, f // tp, 1, expert), *fc2_bias]


def _mla_tensors(m: ModelConfig, tp: int) -> list[Tensor]:
    """Multi-latent attention on one TP rank: down-projections split by rows, latent norms whole, up-projections
    and the output projection split by heads."""
    h, heads, qd, r = m.hidden_size, m.num_attention_heads, m.mla_q_head_dim, m.q_lora_rank
    norm = functools.partial(norm_tensors, m) if m.qk_layernorm else lambda width: []
    if r is None:
        out = [_matrix(heads * qd // tp, h, 0)]
    else:
        out = [_matrix(r // tp, h, 0), *norm(r), _matrix(heads * qd // tp, r, 0)]
    out += [_matrix((m.kv_lora_rank + m.qk_pos_emb_head_dim) // tp, h, 0), *norm(m.kv_lora_rank)]
    out += [_matrix(heads * (m.qk_head_dim + m.v_head_dim) // tp, m.kv_lora_rank, 0)]
    return out + [_matrix(h, heads * m.v_head_dim // tp, 1)]


def _attention_tensors(model: ModelConfig, tp: int) -> list[Tensor]:
    if model.multi_latent_attention:
        return _mla_tensors(model, tp)
    h, d = model.hidden_size, model.head_dim
    q, kv = model.num_attention_heads * d, model.query_groups * d
    rows = q * (2 if model.attention_output_gate else 1) + 2 * kv  # (--attention-output-gate: its gate rows)
    per_group = model.num_attention_heads // model.query_groups
    out = [_matrix(rows // tp, h, 0, qkv=qkv_split_rows(per_group, d, model.attention_output_gate))]
    out += [(rows // tp, None, False)] if model.add_bias_linear or model.add_qkv_bias else []
    if model.qk_layernorm:
        out += 2 * norm_tensors(model, d)  # (the queries' and the keys')
    if model.softmax_type == "learnable":
        out += [(model.num_attention_heads // tp, None, False)]  # (an offset a head)
    return out + [_matrix(h, q // tp, 1)] + ([(h, None, False)] if model.add_bias_linear else [])


def layer_tensors(
    model: ModelConfig, layer: int, tp: int, ep: int, trained: bool = False, etp: int | None = None
) -> list[Tensor]:
    """The parameters of one transformer layer on one rank, in the model's order. A heterogeneous layer at its own
    sizes: a linear replacement's [hidden, hidden] linear (its bias split too: column-parallel) and norm, a no-op
    part nothing. `trained`: only those the optimizer steps (the router's expert_bias, updated by the load
    balancing and not by gradients, is left out). `etp`: the experts' tensor-parallel size (None: TP)."""
    block = layer_block(model, layer) or BlockConfig()  # (a hybrid layer's one part too)
    if block.attention == MAMBA_MIXER:
        return mamba_tensors(model, tp)
    m = model.layer_config(layer) if layer < model.num_layers else model
    h = m.hidden_size
    norm = norm_tensors(m, h)
    linear = [_matrix(h // tp, h, 0)] + ([(h // tp, None, False)] if m.add_bias_linear else [])
    out: list[Tensor] = []
    if block.attention != NO_OP:
        out += norm + (_attention_tensors(m, tp) if block.attention == NORMAL else linear)
    if block.mlp == NO_OP:
        return out
    out += norm
    swiglu = m.gated_linear_unit
    if block.mlp != NORMAL:
        return out + linear
    if not m.is_moe_layer(layer):
        return out + _mlp_tensors(h, m.ffn_size, swiglu, m.add_bias_linear, tp)
    e = m.num_experts
    out += [_matrix(e, h, None)]  # the router (replicated)
    out += [(e, None, False)] if m.add_bias_linear else []
    out += [(e, None, False)] if m.moe_router_enable_expert_bias and not trained else []
    out += (e // ep) * _mlp_tensors(h, m.moe_ffn_size, swiglu, m.add_bias_linear, etp or tp, expert=True)
    if m.moe_shared_expert_intermediate_size:
        out += [_matrix(1, h, None)] if m.moe_shared_expert_gate else []  # (the gate's [1, hidden], replicated)
        out += _mlp_tensors(h, m.moe_shared_expert_intermediate_size, swiglu, m.add_bias_linear, tp)
    return out


@functools.lru_cache(maxsize=65536)
def layer_params(model: ModelConfig, layer: int, tp: int, ep: int, etp: int | None = None) -> tuple[int, int]:
    """(dense, expert) parameters of one transformer layer on one rank."""
    return _sums(layer_tensors(model, layer, tp, ep, etp=etp))


def _sums(tensors) -> tuple[int, int]:
    """(dense, expert) elements of `tensors`."""
    return sum(n for n, _, e in tensors if not e), sum(n for n, _, e in tensors if e)


def _stage_groups(model: ModelConfig, layout: Layout, pp_rank: int):
    # (cached by what decides them: a search's layouts share a few parallel sizes)
    return _groups(model, layout.params_key(), pp_rank)


@functools.lru_cache(maxsize=1024)
def _groups(
    model: ModelConfig, layout: Layout, pp_rank: int
) -> tuple[tuple[tuple[tuple[Tensor, ...], int], ...], tuple[int, ...], int]:
    """(the stage's parameters as (tensors, how many times the stage holds them): each kind of layer once with its
    count; the global numbers of its layers; the elements of its word and position embeddings and output layer,
    and their copies)."""
    h, tp = model.hidden_size, layout.tp
    counts = stage_layer_counts(model.num_layers, layout.parallel_config())
    tensors: list[Tensor] = []
    layers: list[int] = []
    first_layer = 0
    by_kind: dict[tuple, list] = {}  # a layer's tensors depend on it only through these: [tensors, count]
    for vstage, n in enumerate(counts):
        if vstage % layout.pp == pp_rank:
            for layer in range(first_layer, first_layer + n):
                kind = (model.is_moe_layer(layer), layer_block(model, layer))
                if kind not in by_kind:
                    by_kind[kind] = [layer_tensors(model, layer, tp, layout.ep, etp=layout.etp), 0]
                by_kind[kind][1] += 1
                layers.append(layer)
        first_layer += n
    vocab = (model.padded_vocab_size(tp) // tp * h, None, False)  # (the word embeddings, the output layer: Adam)
    embedding: list[Tensor] = []
    if pp_rank == 0:
        embedding.append(vocab)
        if model.position_embedding_type == "learned_absolute":
            embedding.append(_matrix(model.max_position_embeddings, h, None))  # (2-D, not the word embeddings)
    if pp_rank == layout.pp - 1:
        norm = norm_tensors(model, h)
        tensors += norm
        if model.untie_embeddings_and_output_weights or layout.pp > 1:
            embedding.append(vocab)  # the output layer, or the last stage's copy of the tied embedding
        for k in range(model.mtp_num_layers):  # multi-token prediction: 3 norms, eh_proj, a layer per depth
            tensors += layer_tensors(model, model.num_layers + k, tp, layout.ep, etp=layout.etp)
            tensors += 3 * norm + [_matrix(h // tp, 2 * h, 0)]  # (eh_proj: column-parallel)
            layers.append(model.num_layers + k)  # (its time is a layer's, numbered after the decoder's)
        if model.mtp_num_layers and model.untie_embeddings_and_output_weights and layout.pp > 1:
            embedding.append(vocab)  # the last stage's copy of the word embeddings, which MTP reads
    groups = [(ts, c) for ts, c in by_kind.values()] + [(tuple(tensors + embedding), 1)]
    groups = tuple((tuple(t for t in ts if t[0]), c) for ts, c in groups)
    return groups, tuple(layers), sum(n for n, _, _ in embedding)


def stage_params(model: ModelConfig, layout: Layout, pp_rank: int) -> StageParams:
    """Parameters held by one rank of pipeline stage `pp_rank` (all of its virtual stages)."""
    return _stage_params(model, layout.params_key(), pp_rank)


@functools.lru_cache(maxsize=65536)
def _stage_params(model: ModelConfig, layout: Layout, pp_rank: int) -> StageParams:
    # (cached by what decides them: a search's layouts share a few parallel sizes)
    groups, layers, embeddings = _stage_groups(model, layout, pp_rank)
    sums = [(c * d, c * e) for (d, e), c in ((_sums(ts), c) for ts, c in groups)]
    muon = sum(c * n for ts, c in groups for n, by_muon, _ in ts if by_muon)
    return StageParams(sum(d for d, _ in sums), sum(e for _, e in sums), layers, embeddings, muon)


@functools.lru_cache(maxsize=1024)
def trained_tensors(model: ModelConfig, layout: Layout, pp_rank: int) -> tuple[Tensor, ...]:
    """The parameters the optimizer steps on one rank of pipeline stage `pp_rank`, in the runtime's order (each
    model chunk's named_parameters: the embeddings, the layers in model order, the final norm, the output layer,
    each MTP depth's norms, eh_proj and layer), which dist_muon's split of whole tensors breaks ties by
    (optimizer/layer_wise_optimizer.py): equal-sized matrices of other shapes land on the runtime's ranks.
    (_stage_groups holds each kind of layer once, which counting wants.) Cached by what decides them."""
    layout = layout.params_key()
    h, tp, ep, etp = model.hidden_size, layout.tp, layout.ep, layout.etp
    counts = stage_layer_counts(model.num_layers, layout.parallel_config())
    vocab = (model.padded_vocab_size(tp) // tp * h, None, False)
    norm = norm_tensors(model, h)
    by_kind: dict[tuple, list[Tensor]] = {}
    out: list[Tensor] = []
    first_layer = 0
    for vstage, n in enumerate(counts):
        if vstage % layout.pp == pp_rank:
            pre, post = vstage == 0, vstage == len(counts) - 1
            embedding = pre or (post and model.mtp_num_layers > 0)  # (MTP embeds tokens on the last stage too)
            if embedding:
                out.append(vocab)
                if pre and model.position_embedding_type == "learned_absolute":
                    out.append(_matrix(model.max_position_embeddings, h, None))
            for layer in range(first_layer, first_layer + n):
                kind = (model.is_moe_layer(layer), layer_block(model, layer))
                if kind not in by_kind:
                    by_kind[kind] = layer_tensors(model, layer, tp, ep, trained=True, etp=etp)
                out += by_kind[kind]
            if post:
                out += norm
                if model.untie_embeddings_and_output_weights or not embedding:
                    out.append(vocab)  # the output layer, or the last stage's copy of the tied embeddings
                for k in range(model.mtp_num_layers):  # enorm, hnorm, eh_proj (column-parallel), the layer, its norm
                    out += 2 * norm + [_matrix(h // tp, 2 * h, 0)]
                    out += layer_tensors(model, model.num_layers + k, tp, ep, trained=True, etp=etp) + norm
        first_layer += n
    return tuple(t for t in out if t[0])
