"""Memory per GPU of a layout, from the model's dimensions alone (no model is built).

Parameters are counted as our layers hold them (planner/params.py). Gradients live in an fp32 buffer (bf16
with --grad-reduce-in-bf16, whose optimizer step copies them to fp32 once the activations are freed: the peak
is the larger of the two); Adam keeps two fp32 moments plus an fp32 main copy of low-precision weights (the
distributed optimizer always keeps its own fp32 copy of its shard).

Activations are the tensors autograd saves for the backward, per token of one micro-batch, counted from our
own layers the way `training/memory.py`'s meter counts them (each storage once). The terms, in values per
token and layer (h hidden, q = heads x head_dim, kv = groups x head_dim, f the FFN size):
  norm (each of two)   RMSNorm: input and normalised input (2h) + 1/rms (fp32); LayerNorm: input + mean, 1/std
                       (the Triton kernels save only the input and their statistics)
  linear inputs        the normalised input fed to QKV and fc1 (2h), all-gathered (full sequence) under SP
  attention (/TP)      Triton flash: roped q and k, v, output, output copy for the projection, log-sum-exp;
                       PyTorch SDPA: the same with k and v expanded to every query head (grouped-query), or
                       the fused QKV output itself when there is no RoPE
  MLP (/TP)            SwiGLU: fc1 output (2f), SiLU output and fc2 input (PyTorch 4f; Triton saves gate, up
                       and fc2 input, 3f); GELU: fc1 output and fc2 input (2f)
Norm terms are divided by TP under sequence parallelism. Full recomputation keeps only each layer's input;
selective recomputation (core attention) keeps q, k, v instead of the attention's outputs. Pipeline
schedules keep several micro-batches alive: the count comes from the schedule itself. fp8 GEMMs, an fp32
residual stream and the experts' capacity: planner/precision.py. A hybrid model's layers, each one part, and what
a Mamba mixer saves: planner/hybrid.py."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from megatron_lite.config import ModelConfig
from megatron_lite.layout_validation import stage_layer_counts
from megatron_lite.models.heterogeneous import NO_OP, NORMAL, BlockConfig, layer_kinds
from megatron_lite.planner.attention_memory import (
    l2_norm_bytes,
    mla_activation_bytes,
    qk_norm_bytes,
    softmax_offset_bytes,
)
from megatron_lite.planner.hybrid import MAMBA_MIXER, layer_block, mixer_activation_bytes
from megatron_lite.planner.layout import Layout
from megatron_lite.planner.lora_memory import adapted, lora_first_layer_bytes, lora_layer_bytes
from megatron_lite.planner.params import StageParams, stage_params, trained_tensors
from megatron_lite.planner.precision import (
    expert_rows,
    fp8_activation_bytes,
    fp8_caches_weights,
    fp8_input_bytes,
    fp8_layer,
    fp8_weight_bytes_held,
    stream_bytes,
)
from megatron_lite.planner.schedule import forward_states

ADAM_MOMENTS = 8  # exp_avg + exp_avg_sq, fp32
MAIN_COPY = 4  # fp32 main weights


def _norm_bytes(model: ModelConfig, a: int, frozen: bool = False) -> float:
    """What a norm keeps per token: the Triton kernels their input and statistics; PyTorch's RMSNorm also the
    normalised input, for the weight's gradient (none for a frozen one); PyTorch's LayerNorm its input, mean and
    rstd."""
    h = model.hidden_size
    if model.kernel_impl == "triton" or model.normalization != "RMSNorm":
        return h * a + 8
    # (the input upcast to fp32, which the reference saves in its place: kernels/norms.py; in fp32, the input)
    return (0 if frozen else h * a) + h * 4 + 4


def layer_activation_bytes(
    model: ModelConfig, layout: Layout, a: int, layer: int, recompute: str, lora=None, mask: int = 1, tokens: int = 0
) -> float:
    """Bytes saved per token (of this rank's sequence part) by one transformer layer; `a` bytes per value. Under
    selective recomputation, what each of the model's --recompute-modules drops (see models/transformer.py);
    with `lora` (a LoraConfig), what the frozen weights and the adapters change. `mask`: bytes per element of a
    dropout mask (a GPU's are bool; PyTorch's CPU dropout keeps its scaled noise, in the activations' dtype).
    `tokens`: of a micro-batch on this rank, for an expert's capacity.

    A heterogeneous layer (models/heterogeneous.py) at its own query groups and FFN size: a no-op part keeps
    nothing, not even its norm; a linear one its norm and the linear's input; an identity layer nothing (checkpointed,
    its checkpoint's input is priced, which activation_bytes leaves out for a run of identities alone but for one
    ending a chunk sent to another stage)."""
    block = layer_block(model, layer) or BlockConfig()  # (a hybrid layer's one part too: planner/hybrid.py)
    if block.attention == block.mlp == NO_OP and recompute != "full":
        return 0.0
    model = model.layer_config(layer) if layer < model.num_layers else model
    attn_kept, mlp_kept = block.attention != NO_OP, block.mlp != NO_OP
    parts = attn_kept + mlp_kept  # (each kept part: its norm, its dropout mask)
    h, d = model.hidden_size, model.head_dim
    q, kv, heads = model.num_attention_heads * d, model.query_groups * d, model.num_attention_heads
    tp, sp, triton = layout.tp, layout.sp, model.kernel_impl == "triton"
    rope, fp8 = model.position_embedding_type == "rope", fp8_layer(model, layer)
    norm_div = tp if sp else 1
    wide = h * (stream_bytes(model, a) - a)  # each norm's input, the residual stream, in fp32 under the flag
    if recompute == "full":
        return (h * a + wide) / norm_div
    if block.attention == MAMBA_MIXER:  # its norm, in_proj's (gathered) input, the mixer, the dropout mask
        masks = h * mask / norm_div if model.hidden_dropout > 0 else 0
        mixer = mixer_activation_bytes(model, tp, a, tokens // layout.micro_batch_size, layout.micro_batch_size)
        return (_norm_bytes(model, a) + wide) / norm_div + h * a + mixer + masks
    modules = set(model.recompute_modules) if recompute == "selective" else set()
    core = "selective" if "core_attn" in modules else "none"
    rms = model.normalization == "RMSNorm"
    norm = _norm_bytes(model, a, frozen=lora is not None)
    regen = "layernorm" in modules  # each norm keeps its input (the fused Triton one its statistics too) and
    # its output's storage is freed, made again in the backward: kept are only the GEMMs' gathered copies (SP)
    total = (2 * h * a + (8 if triton else 0)) / norm_div if regen else parts * norm / norm_div
    total += parts * wide / norm_div
    total += 0 if (regen and not sp) or not attn_kept else h * a  # QKV's (or its linear replacement's) input
    checkpointed = ("moe" if model.is_moe_layer(layer) else "mlp") in modules
    if mlp_kept and checkpointed:  # the MLP checkpointed keeps only its input
        total += 0 if regen else h * a / norm_div
    elif mlp_kept:
        total += 0 if regen and not sp else h * a  # fc1's (the router's, the linear replacement's) input
    one_group = kv != q and model.query_groups <= tp  # (one key/value head a rank: q and its expansions views)
    if core == "selective":  # the checkpoint keeps q, k, v (v, or all three, views of the QKV output)
        attn = ((q + kv if rope else 0) + (q + 2 * kv) + q) * a
    elif triton:
        attn = (3 * q + 2 * kv) * a + heads * 4
    elif rope or (kv != q and not one_group):
        # MHA: k roped, v a view of QKV; GQA: expanded to every head (without RoPE q a copy in place of the roped
        # q), but for one group a rank, whose expanded k and v are views (three groups' worth kept, measured on
        # CPU: two heads' worth each overestimated it; without RoPE they are views of QKV's output, below)
        kv_saved = kv + (q + 2 * kv) if kv == q else 3 * d * tp if one_group else 2 * q
        attn = (q + kv_saved + 2 * q) * a + heads * 4
    else:
        attn = (q + 2 * kv) * a + q * a + heads * 4  # q, k, v (views of QKV's output), the output, its LSE
    if model.softmax_type != "vanilla" and core == "none" and tokens:
        attn = softmax_offset_bytes(model, a, triton, attn, tokens // layout.micro_batch_size, layout)
    if model.attention_output_gate:
        # the gate's sigmoid (fp32); its rows of the QKV output where that is kept whole (q, k or v views of it);
        # the gated output where the attention's output was the projection's input (SDPA's own without RoPE, or
        # the checkpoint's, or the offset softmax's), now kept by the gate's product instead
        qkv_kept = core == "selective" or (not triton and (kv == q or (not rope and one_group)))
        qkv_kept = qkv_kept or (model.qk_l2_norm and a == 4)  # (fp32 --qk-l2-norm keeps k, a view of it)
        # (the attention's output is its own, not kept by the attention: the checkpoint's, the offset softmax's)
        fresh = core == "selective" or not (triton or rope or (kv != q and not one_group))
        fresh = fresh or model.softmax_type != "vanilla"
        attn += q * 4 + (q * a if qkv_kept else 0) + (q * a if fresh else 0)
    if model.qk_layernorm and not model.multi_latent_attention:  # (MLA's latent norms: attention_memory.py)
        # (QKV's output kept already: MHA's v, one group's views, the selective checkpoint's q, k, v)
        kept = kv == q or one_group or core == "selective"
        attn += qk_norm_bytes(
            model, a, q, kv, triton, qkv_kept=kept, q_view=model.num_attention_heads == model.query_groups or one_group
        )
    nope = layer < model.num_layers and model.skips_rope(layer)  # (--no-rope-freq: saves alike here, but for l2)
    if model.qk_l2_norm and not (model.qk_l2_norm_rope_only and nope):
        attn += l2_norm_bytes(model, a, triton, rope, core)
    if model.multi_latent_attention:
        attn = mla_activation_bytes(model, a, tp, sp, rms, triton, core, "mla_up_proj" in modules)
    if layout.cp > 1 and layout.cp_comm_type == "allgather" and core == "none":
        # attention keeps the whole sequence's gathered keys and values, not only this rank's part
        k_v = heads * (model.mla_q_head_dim + model.v_head_dim) if model.multi_latent_attention else 2 * kv
        attn += (layout.cp - 1) * k_v * a
    if block.attention != NORMAL:  # (a linear replacement keeps its input alone, counted above; nothing gathered)
        attn = 0
    swiglu = model.gated_linear_unit

    def mlp(f: int, act_regenerated: bool = False, fused: bool = triton) -> float:  # past fc1's input, times TP
        if not swiglu:
            return 2 * f * a
        if model.activation == "quick_geglu" and not fused:  # PyTorch's ops: fc1's output, the sigmoid, the
            # gate's product, up + offset and the output (each gate and up clamped copy too); its kernel, SwiGLU's
            return (6 + (1 if model.activation_func_clamp_value is not None else 0) - act_regenerated) * f * a
        return ((2 if fused else 3) if act_regenerated else (3 if fused else 4)) * f * a

    if model.is_moe_layer(layer):
        total += attn / tp
        if "moe" in modules:  # the whole MoE layer checkpointed (its input counted above)
            total += fp8_activation_bytes(model, layout, a, layer, modules, 0) if fp8 and lora is None else 0
            return total + (parts * h * mask / norm_div if model.hidden_dropout > 0 else 0)
        # (fp8 experts run one by one, the activation's kernel all the same)
        # Expert TP below TP: each expert-TP group dispatches its 1 / (TP / ETP) of the gathered tokens (MoELayer),
        # to experts split ETP ways: its routed pairs' rows and outputs are that share, their FFN width 1 / ETP
        share = layout.expert_tp / tp
        per = mlp(model.moe_ffn_size, "moe_act" in modules) / layout.expert_tp
        # router scores (fp32), then each token's top-k copies through an expert (expected, balanced): the output
        # of every routed pair (a dropped one's zero) and the rows the experts compute on, the input among them
        # (only the kept pairs; with padding, each expert's whole padded input)
        # (--moe-apply-probs-on-input scales the input instead, keeping the fp32 weight: the output's scaling, by
        # the constant keep mask, keeps no output)
        outputs = model.moe_router_topk * (4 if model.moe_apply_probs_on_input else h * a)
        total += model.num_experts * 4 * 3 + share * (outputs + expert_rows(model, tokens)[1] * (h * a + per))
        if model.moe_token_dispatcher_type == "allgather":
            # the experts' outputs again, kept by their scaling with the routing weights, a routed pair's (measured
            # on CPU, at TP 1 and 2 and EP 1 and 2: 11-15% of the activations were missing)
            total += share * model.moe_router_topk * (h * a + 4)
        if model.moe_router_dtype == "fp64":  # the scores in fp64, and the router's fp64 copy of its input
            total += model.num_experts * 4 * 3 + h * (8 - a)
        if model.moe_input_jitter_eps is not None:  # the noise (the jittered input replaces the input)
            total += h * a
        shared = model.moe_shared_expert_intermediate_size
        if shared and "shared_experts" not in modules:  # its MLP, and under SP its own gathered input
            total += mlp(shared) / tp + (h * a if sp else 0)
            if model.moe_shared_expert_gate:  # its output and sigmoid; under SP the gate's input, the norm's shard
                total += (h * a + a + (h * a if sp else 0)) / norm_div
    else:
        total += attn / tp
        if "mlp" not in modules and block.mlp == NORMAL:
            total += mlp(model.ffn_size) / tp
    if model.hidden_dropout > 0:
        total += parts * h * mask / norm_div  # the dropout masks (two)
    if lora is not None:
        total += lora_layer_bytes(model, layout, a, layer, lora, modules, mask)
    elif fp8:
        total += fp8_activation_bytes(model, layout, a, layer, modules, expert_rows(model, tokens)[1])
    return total


def _chunk_layers(model: ModelConfig, layout: Layout, pp_rank: int) -> list[list[int]]:
    """The global layer numbers of each model chunk (virtual stage chunk * PP + pp_rank) on this rank."""
    counts = stage_layer_counts(model.num_layers, layout.parallel_config())
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [
        list(range(starts[c * layout.pp + pp_rank], starts[c * layout.pp + pp_rank] + counts[c * layout.pp + pp_rank]))
        for c in range(layout.vp)
    ]


def full_recompute_runs(model: ModelConfig, layout: Layout, pp_rank: int) -> tuple[list[int], list[list[int]]]:
    """Under full recomputation, the layers of this rank whose forward runs again in the backward and the layers
    of each checkpoint: --recompute-method block, the first --recompute-num-layers of each chunk, one checkpoint
    each; uniform, every layer, in runs of --recompute-num-layers a checkpoint."""
    if layout.recompute != "full":
        return [], []
    chunks, n = _chunk_layers(model, layout, pp_rank), model.recompute_num_layers or 1
    if model.recompute_method == "block":
        layers = [i for c in chunks for i in c[:n]]
        return layers, [[i] for i in layers]
    return [i for c in chunks for i in c], [c[k : k + n] for c in chunks for k in range(0, len(c), n)]


def layer_recomputes(model: ModelConfig, layout: Layout, pp_rank: int) -> list[list[tuple[int, str]]]:
    """(global layer, its recomputation) of each layer of each model chunk on this rank, the MTP depths with the
    last: under --recompute-method block only the first --recompute-num-layers of a chunk are recomputed (an MTP
    depth never); under uniform, every layer and depth."""
    block = layout.recompute == "full" and model.recompute_method == "block"
    n = model.recompute_num_layers or 0
    chunks = [
        [(i, "none" if block and index >= n else layout.recompute) for index, i in enumerate(layers)]
        for layers in _chunk_layers(model, layout, pp_rank)
    ]
    if pp_rank == layout.pp - 1:
        depth = "none" if block else layout.recompute
        chunks[-1] += [(model.num_layers + k, depth) for k in range(model.mtp_num_layers)]
    return chunks


@functools.lru_cache(maxsize=256)
def _layer_kinds(model: ModelConfig) -> tuple[tuple, ...]:
    """What each decoder layer's saved bytes depend on besides its recomputation: MoE or not, fp8, NoPE (for
    --qk-l2-norm), and a heterogeneous layer's own kinds and sizes (a hybrid layer's kind). Once a model: a search
    asked each layer of each layout."""
    return tuple(
        (model.is_moe_layer(i), fp8_layer(model, i), model.skips_rope(i), layer_block(model, i))
        for i in range(model.num_layers)
    )


def activation_bytes(
    model: ModelConfig, layout: Layout, seq_length: int, pp_rank: int, micro: int, bf16: bool, lora=None, mask: int = 1
) -> float:
    """Peak of the activations one rank of pipeline stage `pp_rank` keeps for the backward, following its
    schedule: each forward of a chunk adds that chunk's activations until the matching backward. `lora`: a
    LoraConfig (the base frozen, the output layer too)."""

    a = 2 if bf16 else 4
    tokens = seq_length // layout.cp * layout.micro_batch_size
    h, norm_div = model.hidden_size, layout.tp if layout.sp else 1
    chunk_bytes = []
    # a layer's bytes depend on it through is_moe_layer, its recompute, fp8 and (for --qk-l2-norm) NoPE
    by_kind: dict[tuple[bool, str, bool, bool], float] = {}
    # --recompute-method block checkpoints the first --recompute-num-layers layers of each model chunk, the rest
    # keep everything; uniform checkpoints each run of --recompute-num-layers layers, keeping its first one's input
    block = layout.recompute == "full" and model.recompute_method == "block"
    group = (model.recompute_num_layers or 1) if layout.recompute == "full" and not block else 1

    def identity(i: int) -> bool:  # (a heterogeneous layer of two no-ops)
        return model.heterogeneous_blocks is not None and i < model.num_layers and not layer_kinds(model, i)

    def attends(i: int) -> bool:  # (not a linear replacement, a no-op or a Mamba mixer)
        return (layer_block(model, i) or BlockConfig()).attention == NORMAL

    def layer_bytes(i: int, index: int, layers: list[int], sent: bool) -> float:
        if index % group:
            return 0.0  # inside a uniform run: its input is the run's, rebuilt in the backward
        recompute = "none" if block and index >= (model.recompute_num_layers or 0) else layout.recompute
        # a checkpoint of identities returns its input, which the next layer or checkpoint keeps; the chunk's last,
        # whose output is `sent` to another stage, keeps it itself
        last = index + group >= len(layers)
        if recompute == "full" and all(identity(j) for j in layers[index : index + group]) and not (last and sent):
            return 0.0
        key = (recompute, kinds[i])
        if key not in by_kind:
            by_kind[key] = layer_activation_bytes(model, layout, a, i, recompute, lora, mask, tokens)
        return by_kind[key]

    fp8_layers = layer_recomputes(model, layout, pp_rank)
    kinds = _layer_kinds(model)
    for c, layers in enumerate(_chunk_layers(model, layout, pp_rank)):
        sent = not (c == layout.vp - 1 and pp_rank == layout.pp - 1)  # (the last chunk's goes to the final norm)
        kept = list(enumerate(layers))
        if lora is not None and 0 in layers and layout.recompute != "full":
            # nothing before the first adapted layer needs a gradient (the embedding and those layers frozen, their
            # input the embedding's): they save nothing (a hybrid model's `-` layers before a `*`, targets q v)
            first = next((index for index, i in kept if adapted(model, lora, i)), len(kept))
            kept = kept[first:]
            per_token = -lora_first_layer_bytes(model, layout, a, lora, mask, layers[first]) if kept else 0.0
        else:
            per_token = 0.0
        per_token += sum(layer_bytes(i, index, layers, sent) for index, i in kept)
        some_kept = layout.recompute != "full" or (block and len(layers) > (model.recompute_num_layers or 0))
        whole = 0.0  # bytes per micro-batch, whatever its tokens
        if model.fp8 is not None and not fp8_caches_weights(model, layout) and lora is None:
            # each micro-batch's own fp8 weights, saved by its linears (those run inside checkpoints: transient)
            whole += fp8_weight_bytes_held(model, layout, fp8_layers[c], cached=False)[0]
        # (a chunk of heterogeneous or hybrid layers without attention uses no RoPE; a linear replacement of
        # attention reads none either)
        if model.position_embedding_type == "rope" and some_kept and any(attends(i) for i in layers):
            per_token += 2 * model.rotary_dim * 4  # cos and sin of every position, fp32
        # its mask (none under LoRA: no gradient flows into a frozen embedding's output)
        embedding_dropout = h * mask / norm_div if model.hidden_dropout > 0 and lora is None else 0
        if c == 0 and pp_rank == 0:
            per_token += 8 + embedding_dropout  # input ids
        if c == layout.vp - 1 and pp_rank == layout.pp - 1:  # final norm, output layer input, loss
            norm = _norm_bytes(model, a, frozen=lora is not None)
            final_norm = (norm + h * (stream_bytes(model, a) - a)) / norm_div
            vocab = model.padded_vocab_size(layout.tp) // layout.tp
            if model.kernel_impl == "triton":
                loss = final_norm + h * a + 8  # the fused loss keeps its input and labels
                # the loss computed last makes its gradients in the forward and keeps them until its backward:
                # the hidden gradient and the output layer's weight gradient
                per_token += h * a
                # (none for a frozen output layer; the padding rows' are not kept)
                whole += 0 if lora is not None else min(vocab, model.vocab_size) * h * a
            else:
                # logits (fp32), labels and masks; the output layer's input, unless it is frozen
                loss = final_norm + (h * a if lora is None else 0) + vocab * 4 + 10
            per_token += loss
            # (Megatron's MTP is one checkpoint a depth under uniform full recomputation, not recomputed under block)
            # the hidden state a depth reads is the one the loss before it keeps, unless that is gathered (SP) or
            # the loss keeps no input (PyTorch's, of a frozen output layer)
            hidden_apart = norm_div > 1 or (model.kernel_impl != "triton" and lora is not None)
            for k in range(model.mtp_num_layers):
                if layout.recompute == "full" and not block:
                    # its inputs: the embedding of its tokens and the hidden state; its token ids, and the loss of
                    # its output
                    per_token += (2 if hidden_apart else 1) * h * a / norm_div + 8 + loss - final_norm
                    per_token += embedding_dropout
                    continue
                # a depth: its layer, the norms of the embedding and hidden state, eh_proj's input (whole under
                # SP), its token ids, then a final norm and the loss as above
                depth_recompute = "none" if block else layout.recompute
                frozen = None if lora is None else dataclasses.replace(lora, target_modules=())  # (no adapters)
                layer = layer_activation_bytes(
                    model, layout, a, model.num_layers + k, depth_recompute, frozen, mask, tokens
                )
                if lora is not None:  # the frozen eh_proj keeps no input; enorm, on the frozen embedding, nothing
                    per_token += layer + norm / norm_div + 8 + loss
                else:
                    per_token += layer + 2 * final_norm + 2 * h * a + 8 + loss + embedding_dropout
                    per_token += fp8_input_bytes(2 * h, a, model.fp8_wgrad) if model.fp8 is not None else 0
        chunk_bytes.append(per_token * tokens + whole)
    # delayed scaling's fp8 weights, cached from the first forward to the scales' update (those only checkpoints
    # run are priced with the transient buffers)
    cache = 0.0 if lora is not None else fp8_weight_bytes_held(model, layout, sum(fp8_layers, []))[0]
    if layout.pp == 1:
        return chunk_bytes[0] + cache  # micro-batches run forward and backward one after another
    # A received input is saved by the chunk's first op; the executor still holds it until the chunk's next
    # backward has run, so it outlives its micro-batch's other activations by one backward.
    s = stream_bytes(model, a)  # (fp32 under --fp32-residual-connection, as stages send it)
    # (a chunk that saves nothing, of identities alone, saves no received input either)
    received = [
        0.0 if (c == 0 and pp_rank == 0) or not chunk_bytes[c] else h * s / norm_div * tokens for c in range(layout.vp)
    ]
    # after a chunk's first backward, the executor keeps one received input of it past its micro-batch
    states = forward_states(layout.pp, layout.vp, micro, pp_rank, layout.microbatch_group_size)
    peak = max(
        (sum(n * b + r * p for n, b, r, p in zip(held, chunk_bytes, received, past)) for held, past in states),
        default=0.0,
    )
    return max(peak, 0.0) + cache


def recompute_transient_bytes(
    model: ModelConfig, layout: Layout, seq_length: int, pp_rank: int, bf16: bool, lora=None, mask: int = 1
) -> float:
    """With recomputation, one checkpoint's activations are rebuilt at a time during the backward (inside the
    checkpoint, where the activation meter does not see them): one layer's, or a uniform run's of
    --recompute-num-layers layers (at most a chunk's)."""
    layers = stage_params(model, layout, pp_rank).layers
    if layout.recompute == "none" or not layers:
        return 0.0
    a, i = 2 if bf16 else 4, layers[-1]
    tokens = seq_length // layout.cp * layout.micro_batch_size
    if model.heterogeneous_blocks is not None or model.hybrid:  # (the layer that keeps most: the layers differ)
        i = max(layers, key=lambda j: layer_activation_bytes(model, layout, a, j, "none", lora, mask, tokens))
    run = 1
    if layout.recompute == "full" and model.recompute_method != "block":
        run = min(model.recompute_num_layers or 1, max(len(c) for c in _chunk_layers(model, layout, pp_rank)))
    rebuilt = run * layer_activation_bytes(model, layout, a, i, "none", lora, mask, tokens)
    rebuilt -= layer_activation_bytes(model, layout, a, i, layout.recompute, lora, mask, tokens)
    return max(rebuilt, 0.0) * tokens  # (a stage of identities rebuilds nothing, less than its checkpoint keeps)


@dataclass(frozen=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float  # saved for the backward, at the schedule's peak
    transient: float = 0.0  # rebuilt by recomputation, FSDP2's gathered layers, the step's copies and buffers

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.transient

    def as_dict(self) -> dict[str, float]:
        return {
            "mem_params_bytes": self.params,
            "mem_grads_bytes": self.grads,
            "mem_optimizer_bytes": self.optimizer,
            "mem_activations_bytes": self.activations,
        }


@dataclass(frozen=True)
class LayerWiseSplit:
    """--optimizer dist_muon's split of one pipeline stage's parameters (optimizer/layer_wise_optimizer.py): whole
    tensors, largest first, each to the rank of its data-parallel group (x CP; experts: expert-data-parallel)
    holding the fewest bytes of state so far. Megatron deals them out ping-pong by size; ours balances better."""

    optimizer: float  # bytes of state and fp32 main copies on the busiest rank (the busiest dense and expert share)
    owned: float  # parameters that rank steps
    widths: tuple[tuple[int, int], ...]  # (group size, the largest rank's elements): each all-gather after the step
    # each group's (dense, then experts, where the stage holds any) owner of each of its tensors, in trained_tensors'
    # order (which matrices each rank's Muon orthogonalizes: planner/muon_cost.py)
    owners: tuple[tuple[int, ...], ...] = ()


@functools.lru_cache(maxsize=4096)
def _layer_wise_split(model: ModelConfig, layout: Layout, pp_rank: int, bf16: bool) -> LayerWiseSplit:
    from megatron_lite.optimizer.layer_wise_optimizer import layer_wise_split, state_bytes

    tensors = trained_tensors(model, layout, pp_rank)  # (in the runtime's order: the split breaks ties by it)
    dp_cp = layout.dp * layout.cp
    optimizer = owned = 0.0
    widths, owners = [], []
    for expert, ranks in ((False, dp_cp), (True, layout.edp)):
        numels = [n for n, _, e in tensors if e == expert]
        if not numels:
            continue
        sizes = [state_bytes(n, matrix is not None, bf16) for n, matrix, e in tensors if e == expert]
        state, elements = [0] * ranks, [0] * ranks
        owners.append(tuple(layer_wise_split(sizes, ranks)))
        for n, size, r in zip(numels, sizes, owners[-1]):
            state[r], elements[r] = state[r] + size, elements[r] + n
        busiest = state.index(max(state))
        optimizer, owned = optimizer + state[busiest], owned + elements[busiest]
        widths.append((ranks, max(elements)))
    return LayerWiseSplit(optimizer, owned, tuple(widths), tuple(owners))


def layer_wise_split_of(model: ModelConfig, layout: Layout, pp_rank: int, bf16: bool) -> LayerWiseSplit:
    """The split on pipeline stage `pp_rank` (what decides it, for the cache: the parallel sizes, not the batch)."""
    key = Layout(layout.tp, layout.pp, layout.vp, layout.dp, layout.cp, layout.ep, stages=layout.stages, etp=layout.etp)
    return _layer_wise_split(model, key, pp_rank, bf16)


class MuonStateBytes(float):
    """--optimizer muon's state per parameter: Muon's one momentum (4 bytes) on what it steps, Adam's two moments
    (8) on the rest, as the runtime splits them (optimizer.runs_muon: the 2-D parameters but the embeddings and
    output layer; norms, biases, a Mamba mixer's 3-D conv weight and its dt_bias, A_log and D take Adam's).
    As a float, the whole model's average (what the step-time model reads); rank_memory prices each pipeline
    stage by its own mix (the first and last hold the vocabulary)."""

    def __new__(cls, model: ModelConfig) -> MuonStateBytes:
        return super().__new__(cls, cls.of_stage(stage_params(model, Layout(), 0)))

    @staticmethod
    def of_stage(counts: StageParams) -> float:
        return (8 * counts.total - 4 * counts.muon) / counts.total if counts.total else 8.0


def parameter_state_bytes(
    dense: float,
    expert: float,
    dp_cp: int,
    edp: int,
    sharding: str,
    bf16: bool,
    grads_bf16: bool = False,
    state_bytes: int = ADAM_MOMENTS,
    whole_grads: float = 0,
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes of `dense` and `expert` trainable parameters replicated over `dp_cp`
    and `edp` ranks: weights in compute precision (bf16: 2 bytes), gradient buffers (bf16 with `grads_bf16`),
    fp32 main copies in low precision and the optimizer's `state_bytes`. The distributed optimizer shards the
    main copies (an fp32 weight is its own, as in Megatron) and state, ZeRO-2 the gradients too (but
    `whole_grads` parameters'), FSDP2 everything in fp32 shards that are the main weights; dist_muon's layer-wise
    split ("layer-wise") the main copies of low-precision weights and state, by whole parameters (here an even
    split, as the dry run prices it; rank_memory prices the planner's busiest rank of the real split:
    layer_wise_split_of)."""
    local = dense / dp_cp + expert / edp
    if sharding == "fsdp2":
        params = 4 * local  # bf16 copies are gathered a layer at a time for compute
        return params, params, state_bytes / 4 * params
    total = dense + expert
    grad_bytes = 2 if bf16 and grads_bf16 else 4
    grads = grad_bytes * ((local + whole_grads) if sharding == "zero2" else total)
    if sharding in ("dist-opt", "zero2", "layer-wise"):
        optimizer = (state_bytes + (MAIN_COPY if bf16 else 0)) * local
    else:
        optimizer = (state_bytes + (MAIN_COPY if bf16 else 0)) * total
    return (2 if bf16 else 4) * total, grads, optimizer


def rank_memory(
    model: ModelConfig,
    layout: Layout,
    seq_length: int,
    global_batch_size: int,
    bf16: bool,
    pp_rank: int,
    grads_bf16: bool = False,
    state_bytes: int = ADAM_MOMENTS,
    lora=None,
    dropout_mask_bytes: int = 1,
) -> Memory:
    """Bytes held by one rank of pipeline stage `pp_rank`. `grads_bf16`: --grad-reduce-in-bf16 (with bf16,
    the gradient buffers hold bf16; FSDP2's sharded gradients stay fp32, only its reduce-scatters change).
    `lora` (a LoraConfig): its activations (the weights' terms here are the trained model's; the dry run counts
    a LoRA job's own). `dropout_mask_bytes`: 1 on a GPU (bool masks); a CPU's dropout keeps the activations' dtype."""
    counts = stage_params(model, layout, pp_rank)
    dp_cp = layout.dp * layout.cp
    edp = layout.edp  # expert-data-parallel
    param_bytes = 2 if bf16 else 4
    grad_bytes = 2 if bf16 and grads_bf16 else 4
    whole = 0  # the tied copy's gradient stays whole for the step under ZeRO-2 (reduced after the embedding all-reduce)
    if model.tied_embeddings and layout.pp > 1 and pp_rank in (0, layout.pp - 1):
        whole = model.padded_vocab_size(layout.tp) // layout.tp * model.hidden_size
    if isinstance(state_bytes, MuonStateBytes):
        state_bytes = state_bytes.of_stage(counts)
    params, grads, optimizer = parameter_state_bytes(
        counts.dense, counts.expert, dp_cp, edp, layout.sharding, bf16, grads_bf16, state_bytes, whole
    )
    split = layer_wise_split_of(model, layout, pp_rank, bf16) if layout.sharding == "layer-wise" else None
    if split is not None:  # (dist_muon: whole tensors a rank, not an even share)
        optimizer = split.optimizer
    micro = max(layout.micro_batches(global_batch_size), 1)
    act = _activation_bytes(model, layout.activations_key(), seq_length, pp_rank, micro, bf16, lora, dropout_mask_bytes)
    transient = recompute_transient_bytes(model, layout, seq_length, pp_rank, bf16, lora, dropout_mask_bytes)
    if lora is None and fp8_caches_weights(model, layout):  # fp8 weights cached by linears inside checkpoints
        transient += fp8_weight_bytes_held(model, layout, sum(layer_recomputes(model, layout, pp_rank), []))[1]
    if layout.sharding == "fsdp2":  # one layer's gathered weights in compute precision, plus the next prefetched
        transient += 2 * param_bytes * counts.total / max(len(counts.layers), 1)
    elif grad_bytes == 2 and lora is None:
        # the step's fp32 copies of the gradients it updates (the activations are gone by then)
        # (dist_muon's: the busiest rank's owned tensors, whole)
        stepped = counts.total if layout.sharding == "none" else counts.dense / dp_cp + counts.expert / edp
        stepped = split.owned if split is not None else stepped
        transient = max(transient, 4 * stepped - act)
    if split is not None:
        # after the step (its fp32 gradient copies freed), dist_muon all-gathers the updated weights a group at a
        # time, in place, into one buffer of the largest group's: width (the largest rank's) x group size
        gather = param_bytes * max((width * size for size, width in split.widths if size > 1), default=0)
        transient = max(transient, gather - act)
    return Memory(params, grads, optimizer, act, transient)


@functools.lru_cache(maxsize=1 << 14)
def _activation_bytes(
    model: ModelConfig, layout: Layout, seq_length: int, pp_rank: int, micro: int, bf16: bool, lora, mask: int
) -> float:
    """activation_bytes, once per layout of a search's shardings (its layout is `Layout.activations_key`'s): they
    were two thirds of its memory estimates' time."""
    return activation_bytes(model, layout, seq_length, pp_rank, micro, bf16, lora, mask)


def peak_rank_memory(
    model: ModelConfig,
    layout: Layout,
    seq_length: int,
    global_batch_size: int,
    bf16: bool,
    grads_bf16: bool = False,
    state_bytes: int = ADAM_MOMENTS,
) -> tuple[int, Memory]:
    """(pipeline rank, memory) of the rank that needs the most. `state_bytes`: the optimizer's state per
    parameter (Adam's moments 8, SGD's momentum 4, none 0)."""
    # every rank: an uneven split, a --pipeline-model-parallel-layout or the MoE layers' places can make a middle
    # one the heaviest (rank 1 holds the most micro-batches in flight but need not hold the most layers)
    mems = [
        (r, rank_memory(model, layout, seq_length, global_batch_size, bf16, r, grads_bf16, state_bytes))
        for r in range(layout.pp)
    ]
    return max(mems, key=lambda x: x[1].total)
