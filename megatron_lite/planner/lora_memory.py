"""What LoRA changes in the activations the planner prices (planner/memory.py): a frozen linear keeps no input, the
adapters keep their own."""

from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.planner.layout import Layout


def lora_layer_bytes(model: ModelConfig, layout: Layout, a: int, layer: int, lora, modules: set, mask: int) -> float:
    """What LoRA changes in a layer's saved tensors, per token: a frozen linear keeps no input (autograd saves it
    for the weight's gradient only); an adapted one keeps it for its adapters' A, or with --lora-dropout each
    adapter keeps its own dropped copy and mask instead; each adapter keeps its rank-r intermediate for B. Dense
    attention and MLPs; multi-latent attention and the experts are priced as trained."""
    from megatron_lite.lora.config import layer_parts

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
    if not mla:
        linears += [(len(layer_parts(lora, "linear_qkv") or ()), h, not (regen and not sp))]
        linears += [(int("linear_proj" in lora.target_modules), q / tp, proj_apart)]
    if not moe and not mlp_checkpointed:
        linears += [(len(layer_parts(lora, "linear_fc1") or ()), h, not (regen and not sp))]
        linears += [(int("linear_fc2" in lora.target_modules), f / tp, True)]
    change = 0.0
    for adapters, width, counted in linears:
        if counted and (adapters == 0 or dropout):
            change -= width * a
        change += adapters * (lora.rank * a + (width * (a + mask) if dropout else 0))
    return change


def lora_first_layer_bytes(model: ModelConfig, layout: Layout, a: int, lora, mask: int) -> float:
    """What the model's first layer keeps less under LoRA: its input, the frozen embedding's output, needs no
    gradient, so its input norm (frozen) keeps nothing and its QKV adapters' dropout no mask."""
    from megatron_lite.lora.config import layer_parts
    from megatron_lite.planner.memory import _norm_bytes

    h, norm_div = model.hidden_size, layout.tp if layout.sp else 1
    regen = layout.recompute == "selective" and "layernorm" in model.recompute_modules
    norm = h * a if regen else _norm_bytes(model, a, frozen=True)
    qkv = 0 if model.multi_latent_attention else len(layer_parts(lora, "linear_qkv") or ())
    return norm / norm_div + (qkv * h * mask if lora.dropout > 0 else 0)
