"""What a job's number formats change in a rank's memory, from the model's dimensions: fp8 GEMMs (--fp8-format,
tensor_parallel/fp8.py), the fp32 residual stream (--fp32-residual-connection), and the experts' rows under a
capacity factor (what they keep, or are padded to).

A transformer layer's linears run in fp8 (all but the first and last --num-layers-at-start/end-in-bf16 of the
decoder; every multi-token-prediction depth, its eh_proj included). Each keeps for its backward the fp8 copy of
its input (1 byte a value) in place of the input itself, or beside it with --no-fp8-wgrad, and the fp8 copy of its
weight. Where another op keeps the input anyway (the router beside the shared expert, SDPA's output read by the
output projection without RoPE, a regenerated norm's output without SP) the fp8 copy is added.

The fp8 weights: --fp8-recipe delayed quantizes each weight once an iteration into Fp8State.weight_cache, alive
from the first micro-batch's forward until the scales' update after the last backward (one copy of every fp8
weight on the rank, whatever the schedule); tensorwise scaling, and FSDP2 (which caches nothing), quantize per
micro-batch, the copy saved with that micro-batch's activations. The per-tensor scales and amax histories are a
few fp32 values a linear (left out)."""

from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.planner.layout import Layout


def fp8_layer(model: ModelConfig, layer: int) -> bool:
    """Whether the linears of global layer `layer` (numbered past the decoder's for an MTP depth) run in fp8."""
    if model.fp8 is None:
        return False
    start, end = model.fp8_bf16_layers
    return layer >= model.num_layers or start <= layer < model.num_layers - end


def fp8_caches_weights(model: ModelConfig, layout: Layout) -> bool:
    """Delayed scaling's one fp8 copy of each weight an iteration (not under FSDP2, as describe_fp8 sets it)."""
    return model.fp8_recipe == "delayed" and layout.sharding != "fsdp2"


def _mlp_weights(h: int, f: int, swiglu: bool, tp: int) -> int:
    return h * f * (2 if swiglu else 1) // tp + f // tp * h


def fp8_weight_parts(model: ModelConfig, layer: int, tp: int, ep: int, etp: int | None = None) -> dict[str, int]:
    """Weights of layer `layer`'s fp8 linears on one rank by where they run (biases, norms and the router stay in
    the compute dtype): the attention (MLA's up-projections apart), the dense MLP or the experts and the shared
    expert, an MTP depth's eh_proj. Empty where the layer runs in the compute dtype."""
    if not fp8_layer(model, layer):
        return {}
    h, d = model.hidden_size, model.head_dim
    q, kv = model.num_attention_heads * d, model.query_groups * d
    parts = {}
    if model.multi_latent_attention:
        heads, r, kvr = model.num_attention_heads, model.q_lora_rank, model.kv_lora_rank
        qd = model.mla_q_head_dim
        attn = h * heads * qd // tp if r is None else h * r // tp
        parts["up_proj"] = (0 if r is None else r * heads * qd // tp) + kvr * heads * (
            model.qk_head_dim + model.v_head_dim
        ) // tp
        attn += h * (kvr + model.qk_pos_emb_head_dim) // tp + heads * model.v_head_dim // tp * h
    else:
        attn = h * (q * (2 if model.attention_output_gate else 1) + 2 * kv) // tp + q // tp * h
    parts["attn"] = attn
    swiglu = model.gated_linear_unit
    if model.is_moe_layer(layer):
        parts["moe"] = model.num_experts // ep * _mlp_weights(h, model.moe_ffn_size, swiglu, etp or tp)
        if model.moe_shared_expert_intermediate_size:
            parts["shared_experts"] = _mlp_weights(h, model.moe_shared_expert_intermediate_size, swiglu, tp)
    else:
        parts["mlp"] = _mlp_weights(h, model.ffn_size, swiglu, tp)
    if layer >= model.num_layers:
        parts["eh_proj"] = 2 * h * h // tp
    return parts


def fp8_checkpointed(recompute: str, modules) -> set[str]:
    """The weight parts (fp8_weight_parts) a layer's checkpoints run: everything under full recomputation; the
    MLP, the MoE layer (its shared expert too), the shared expert or MLA's up-projections as --recompute-modules
    names them. Their fp8 copies are saved only inside a checkpoint, where the activation meter does not look."""
    if recompute == "full":
        return {"attn", "up_proj", "mlp", "moe", "shared_experts", "eh_proj"}
    if recompute != "selective":
        return set()
    parts = {"mla_up_proj": "up_proj", "mlp": "mlp", "moe": "moe", "shared_experts": "shared_experts"}
    hidden = {parts[m] for m in modules if m in parts}
    return hidden | ({"shared_experts"} if "moe" in hidden else set())


def fp8_input_bytes(width: float, a: int, wgrad: bool, own: bool = True) -> float:
    """What an fp8 linear changes per token for an input `width` values wide: its fp8 copy in place of the input
    (`own`: nothing else keeps the input), or beside it (kept anyway, or --no-fp8-wgrad's compute-dtype input)."""
    return width * (1 - a) if own and wgrad else width


def fp8_weight_bytes_held(model: ModelConfig, layout: Layout, layers, cached: bool = True) -> tuple[float, float]:
    """The fp8 weights of `layers` ((global layer number, its recompute) each), one byte a weight, as (saved by
    the linears where the activation meter sees them, run only inside checkpoints): delayed scaling's cache of
    the whole rank, held for the whole step; with `cached` False a micro-batch's own copies (tensorwise, FSDP2).
    Nothing where the recipe's weights are not of that kind."""
    seen = hidden = 0.0
    if model.fp8 is None or fp8_caches_weights(model, layout) != cached:
        return seen, hidden
    modules = set(model.recompute_modules)
    for i, recompute in layers:
        inside = fp8_checkpointed(recompute, modules)
        for part, n in fp8_weight_parts(model, i, layout.tp, layout.ep, layout.etp).items():
            hidden, seen = (hidden + n, seen) if part in inside else (hidden, seen + n)
    return seen, hidden


def fp8_activation_bytes(model: ModelConfig, layout: Layout, a: int, layer: int, modules: set, rows: float) -> float:
    """What layer `layer`'s fp8 linears change in its saved tensors per token (times nothing: widths already per
    rank), under selective recomputation of `modules` (empty without); `rows`: expert rows a token makes (top-k,
    or what the capacity keeps or pads to). A checkpointed MLP or MoE layer saves nothing of its linears."""
    if not fp8_layer(model, layer):
        return 0.0
    h, tp, sp, wgrad = model.hidden_size, layout.tp, layout.sp, model.fp8_wgrad
    triton, rope = model.kernel_impl == "triton", model.position_embedding_type == "rope"
    regen = "layernorm" in modules  # (the norm's output, QKV's and fc1's input without SP, is made again)
    first_own = not regen or sp  # the first GEMM's input is its own (the norm's output, or its gathered copy)
    change = 0.0
    if model.multi_latent_attention:
        # both down-projections read the norm's output (each gathers its own copy under SP)
        change += fp8_input_bytes(h, a, wgrad, first_own) + fp8_input_bytes(h, a, wgrad, sp)
        if "mla_up_proj" not in modules:  # (checkpointed: the up-projections keep nothing in the forward)
            change += fp8_input_bytes(model.q_lora_rank or 0, a, wgrad) + fp8_input_bytes(model.kv_lora_rank, a, wgrad)
        change += fp8_input_bytes(model.num_attention_heads * model.v_head_dim / tp, a, wgrad)
    else:
        change += fp8_input_bytes(h, a, wgrad, first_own)
        # PyTorch's attention without RoPE hands the output projection SDPA's own output (kept by SDPA)
        proj_own = triton or rope or "core_attn" in modules
        change += fp8_input_bytes(model.num_attention_heads * model.head_dim / tp, a, wgrad, proj_own)
    if model.is_moe_layer(layer):
        if "moe" in modules:
            return change
        shared = model.moe_shared_expert_intermediate_size
        if shared and "shared_experts" not in modules:  # its own gathered input under SP; the router's without
            change += fp8_input_bytes(h, a, wgrad, sp) + fp8_input_bytes(shared / tp, a, wgrad)
        act_kept = "moe_act" not in modules  # (moe_act: fc2's input is made again, its fp8 copy kept)
        etp = layout.expert_tp  # (an expert-TP group's share of the rows, at its width: layer_activation_bytes)
        ffn = fp8_input_bytes(model.moe_ffn_size / etp, a, wgrad, act_kept)
        change += rows * etp / tp * (fp8_input_bytes(h, a, wgrad) + ffn)
    elif "mlp" not in modules:
        change += fp8_input_bytes(h, a, wgrad, first_own) + fp8_input_bytes(model.ffn_size / tp, a, wgrad)
    return change


def stream_bytes(model: ModelConfig, a: int) -> int:
    """Bytes per value of the residual stream between layers: fp32 under --fp32-residual-connection (the
    norms keep it as their input, the stages send it), else the compute dtype's `a`."""
    return 4 if model.fp32_residual_connection else a


def expert_rows(model: ModelConfig, tokens: int) -> tuple[float, float]:
    """(rows the router keeps, rows the experts compute on) per token of a `tokens`-token micro-batch, routing
    balanced: top-k dropless; with --moe-expert-capacity-factor what each expert's capacity keeps, and with
    --moe-pad-expert-input-to-capacity each expert's input padded to its capacity."""
    from megatron_lite.moe.router import expert_capacity

    k, e = model.moe_router_topk, model.num_experts
    capacity = expert_capacity(model, tokens) if tokens else None
    if capacity is None:
        return k, k
    kept = min(tokens * k / e, capacity) * e / tokens
    return kept, (capacity * e / tokens if model.moe_pad_expert_input_to_capacity else kept)
