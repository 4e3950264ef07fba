"""The saved tensors of attention variants per token, for planner/memory.py's layer count: multi-latent
attention's (its latents whole on every TP rank), --qk-l2-norm's and --qk-layernorm's norms, --softmax-type's
offsets."""

from __future__ import annotations

from megatron_lite.config import ModelConfig
from megatron_lite.planner.layout import Layout


def mla_activation_bytes(
    m: ModelConfig, a: int, tp: int, sp: bool, rms: bool, triton: bool, recompute: str, up_proj: bool = False
) -> float:
    """Multi-latent attention's saved tensors per token, times TP (the caller divides by it): the latents and
    their norms whole on every rank; per head q, k and v (the attention's inputs; v padded to the query/key head
    for SDPA), the output projection's input and, without selective recomputation, the attention's output and
    log-sum-exp. Under sequence parallelism the query and key/value down-projections each gather (and save) the
    layer's input."""
    qd, heads = m.mla_q_head_dim, m.num_attention_heads

    def latent(n: int) -> float:  # a latent's norm (when normalised) and the up-projection's input
        if not m.qk_layernorm:
            return n * a
        return n * a + (n * a + 8 if triton else 2 * n * a + 4 if rms else n * a + 8)

    latents = (latent(m.q_lora_rank) if m.q_lora_rank else 0) + latent(m.kv_lora_rank)
    latents += m.hidden_size * a if sp else 0  # the second gathered copy of the input
    v = m.v_head_dim
    if up_proj and recompute == "selective":  # one checkpoint from the latents: the output projection's input
        return latents * tp + heads * v * a
    if recompute == "selective":  # the checkpoint keeps q, k and v as the up-projections made them (v unpadded)
        attn = (2 * qd + v) * heads * a
    elif triton:  # the flash kernel takes v unpadded
        attn = (2 * qd + v) * heads * a + (v * a + 4) * heads
    else:  # SDPA's fused kernels take one head size: v padded to it, the output cut to v (a copy)
        attn = 3 * heads * qd * a + heads * qd * a + heads * 4
    if up_proj:  # (mla_up_proj alone) q, k and v are made again; SDPA's padded copy of v is kept
        attn -= (2 * qd + (v if triton else 0)) * heads * a
    return latents * tp + attn + heads * v * a  # (and the output projection's input, a copy of the output)


def l2_norm_bytes(model: ModelConfig, a: int, triton: bool, rope: bool, core: str) -> float:
    """What --qk-l2-norm adds per token, times TP: its fp32 1/rms of each query and key head, and the fp32 q and k
    it keeps (copies under bf16; in fp32 q itself, a copy for grouped-query heads, and k, a view of the QKV
    output, which keeps that whole unless the attention keeps it already); without RoPE the attention then keeps
    the normalised q and k of its own instead of views of the QKV output."""
    heads, groups, d = model.num_attention_heads, model.query_groups, model.head_dim
    q, kv = heads * d, groups * d
    extra = (heads + groups) * 4
    if a < 4:
        extra += (q + kv) * 4
    else:
        qkv_kept = core == "selective" or (not triton and (not rope or kv == q))
        extra += (q * 4 if heads != groups else 0) + (0 if qkv_kept else (q + 2 * kv) * 4)
    return extra + (0 if rope or (triton and core != "selective") else (q + kv) * a)


def softmax_offset_bytes(model: ModelConfig, a: int, triton: bool, vanilla: float, seq: int, layout: Layout) -> float:
    """--softmax-type learnable or off-by-one, per token times TP, from the plain attention's `vanilla` bytes. The
    flash kernel keeps what it keeps without the offset, plus the output's fp32 rescaling (a head each, and its
    copy in the compute dtype). PyTorch's unfused attention (models/attention_variants.py) keeps q and the
    expanded k in fp32, the expanded v, the fp32 softmax over the `seq` keys and the offset column (and its
    compute-dtype copy under bf16), the output's copy for the projection, and each layer's [seq, seq] mask of a
    micro-batch (bool). (Context parallelism runs its own attention: priced as on one rank.)"""
    heads, d = model.num_attention_heads, model.head_dim
    if triton:
        return vanilla + heads * (4 + a)
    q = heads * d
    probs = heads * (seq + 1) * 4 + (heads * seq * a if a < 4 else 0)
    return 2 * q * 4 + 2 * q * a + probs + seq / layout.micro_batch_size * layout.tp


def qk_norm_bytes(model: ModelConfig, a: int, q: int, kv: int, triton: bool, qkv_kept: bool, q_view: bool) -> float:
    """--qk-layernorm: what the per-head norms of q and k keep per token (values over head_dim, one row a head).
    The Triton kernel: its input (a contiguous copy of q's and k's strided views) and 8 bytes of statistics a
    row. PyTorch's RMSNorm: the normalised q and k, their inputs upcast to fp32 (in fp32 the inputs themselves: q
    a copy where a rank's group holds several heads, else (`q_view`) a view of the QKV output, as k is, keeping
    that whole unless the attention keeps it already) and 1/rms a row; PyTorch's LayerNorm its input, mean and
    rstd. Measured on CPU (an exploratory run: 10-21% of the activations were missing;
    tests/test_planner_activations.py)."""
    rows = model.num_attention_heads + model.query_groups
    if triton:
        return (q + kv) * a + rows * 8
    if model.normalization != "RMSNorm":  # PyTorch's LayerNorm: its input, mean and rstd; its output attention's
        return (2 * q + (kv if kv == q else 2 * kv)) * a + rows * 8  # input (fitted to the measured, on CPU)
    own = (q + kv) * a + rows * 4  # the normalised q and k, 1/rms
    if a < 4:  # their fp32 copies
        return own + (q + kv) * 4
    return own + (0 if q_view else q * a) + (0 if qkv_kept else (q + 2 * kv) * a)
