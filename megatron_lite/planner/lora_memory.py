"""What LoRA changes in the activations the planner prices (planner/memory.py): a frozen linear keeps no input, the
adapters keep their own."""

from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.models.heterogeneous import NO_OP, BlockConfig
from megatron_lite.planner.hybrid import layer_block
from megatron_lite.planner.layout import Layout


def lora_layer_bytes(model: ModelConfig, layout: Layout, a: int, layer: int, lora, modules: set, mask: int) -> float:
    """What LoRA changes in a layer's saved tensors, per token: a frozen linear keeps no input (autograd saves it
    for the weight's gradient only); an adapted one keeps it for its adapters' A, or with --lora-dropout each
    adapter keeps its own dropped copy and mask instead; each adapter keeps its rank-r intermediate for B. Dense
    attention and MLPs; multi-latent attention and the experts are priced as trained. A hybrid layer of one part
    (`*` attention alone, `-` an MLP alone: planner/hybrid.py) has only that part's linears and adapters."""
    from megatron_lite.lora.config import layer_parts

    block = layer_block(model, layer) or BlockConfig()

    h, tp, sp = model.hidden_size, layout.tp, layout.sp
    q, f = model.num_attention_heads * model.head_dim, model.ffn_size
    mla, moe = model.multi_latent_attention, model.is_moe_layer(layer)
    regen, dropout = "layernorm" in modules, lora.dropout > 0
    rope, triton = model.position_embedding_type == "rope", model.kernel_impl == "triton"
    # (without RoPE, PyTorch's attention output is the output projection's input itself, kept by SDPA anyway)
    proj_apart = triton or rope or "core_attn" in modules
    mlp_checkpointed = ("moe" if moe else "mlp") in modules
    # (adapters on it, its input's width on this rank, whether the input is counted as a tensor of its own)
    linears = []
    if not mla and block.attention != NO_OP:
        linears += [(len(layer_parts(lora, "linear_qkv") or ()), h, not (regen and not sp))]
        linears += [(int("linear_proj" in lora.target_modules), q / tp, proj_apart)]
    if not moe and not mlp_checkpointed and block.mlp != NO_OP:
        linears += [(len(layer_parts(lora, "linear_fc1") or ()), h, not (regen and not sp))]
        linears += [(int("linear_fc2" in lora.target_modules), f / tp, True)]
    change = 0.0
    for adapters, width, counted in linears:
        if counted and (adapters == 0 or dropout):
            change -= width * a
        change += adapters * (lora.rank * a + (width * (a + mask) if dropout else 0))
    return change


def adapted(model: ModelConfig, lora, layer: int) -> bool:
    """Whether `lora` puts adapters on some linear of layer `layer`: a hybrid layer of an MLP alone (`-`) has none
    when only the attention's linears are targets, one of attention alone (`*`) none when only the MLP's are."""
    from megatron_lite.lora.config import EXPERT_TARGETS, MLP_TARGETS

    block = layer_block(model, layer) or BlockConfig()
    mlp_targets = any(t in MLP_TARGETS for t in lora.target_modules)
    if model.is_moe_layer(layer):  # (fc1 / fc2 name a shared expert's)
        shared = model.moe_shared_expert_intermediate_size is not None
        mlp_targets = (mlp_targets and shared) or any(t in EXPERT_TARGETS for t in lora.target_modules)
    attn_targets = any(t not in MLP_TARGETS + EXPERT_TARGETS for t in lora.target_modules)
    return (block.attention != NO_OP and attn_targets) or (block.mlp != NO_OP and mlp_targets)


def lora_first_layer_bytes(model: ModelConfig, layout: Layout, a: int, lora, mask: int, layer: int = 0) -> float:
    """What the model's first adapted layer (`layer`; the layers before it keep nothing: memory.py) keeps less
    under LoRA: its input, the frozen embedding's output (through frozen layers), needs no gradient, so its first
    part's norm (frozen) keeps nothing and that part's input adapters' dropout no mask: the attention's QKV, or in
    a hybrid layer of an MLP alone (`-`) its fc1 (none when the MLP is checkpointed, its dropout then inside the
    checkpoint; an MoE layer's experts are priced as trained)."""
    from megatron_lite.lora.config import layer_parts
    from megatron_lite.planner.memory import _norm_bytes

    block = layer_block(model, layer) or BlockConfig()

    h, norm_div = model.hidden_size, layout.tp if layout.sp else 1
    regen = layout.recompute == "selective" and "layernorm" in model.recompute_modules
    norm = h * a if regen else _norm_bytes(model, a, frozen=True)
    if block.attention != NO_OP:
        first = 0 if model.multi_latent_attention else len(layer_parts(lora, "linear_qkv") or ())
    else:
        modules = set(model.recompute_modules) if layout.recompute == "selective" else set()
        dense = not model.is_moe_layer(layer) and "mlp" not in modules
        first = len(layer_parts(lora, "linear_fc1") or ()) if dense else 0
    return norm / norm_div + (first * h * mask if lora.dropout > 0 else 0)
