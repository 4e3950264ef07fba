"""Small model configurations and helpers shared by the tests."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.config import ModelConfig, ParallelConfig
from megatron_lite.models.gpt_model import GPTModel
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.parameters import named_param_meta

# Where the kernel tests put their tensors: a GPU where there is one (compiled Triton kernels), else the CPU
# (the Triton interpreter, see conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def triton_on_cpu_tensors() -> bool:
    """Whether Triton kernels can run on CPU tensors here (gloo ranks hold CPU tensors): only under the
    interpreter, which conftest.py turns on where there is no GPU."""
    import os

    from megatron_lite.kernels._common import HAVE_TRITON

    return HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1"


# For tests whose Triton kernels run on CPU tensors (gloo ranks, train_run): on a GPU machine, outside the
# interpreter, Triton cannot run them and both sides of the comparison would be the PyTorch path.
needs_triton_on_cpu = pytest.mark.skipif(
    not triton_on_cpu_tensors(),
    reason="gloo ranks hold CPU tensors: Triton runs them only under its interpreter (or not installed)",
)


VOCAB = 250  # not a multiple of 4 x make_vocab_size_divisible_by (2): TP=2 and TP=4 must pad


def llama_config(**kw) -> ModelConfig:
    """Llama-shaped: RMSNorm, SwiGLU, RoPE with a non-default base, GQA (8 heads, 4 groups), no biases,
    untied output layer."""
    base = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=96,
        vocab_size=VOCAB,
        make_vocab_size_divisible_by=2,
        max_position_embeddings=64,
        normalization="RMSNorm",
        norm_epsilon=1e-6,
        activation="swiglu",
        position_embedding_type="rope",
        rotary_base=5000.0,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    base.update(kw)
    return ModelConfig(**base)


def gpt2_config(**kw) -> ModelConfig:
    """GPT-2-shaped: LayerNorm, tanh GELU, learned positions, biases, tied embeddings."""
    base = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=VOCAB,
        make_vocab_size_divisible_by=2,
        max_position_embeddings=64,
        normalization="LayerNorm",
        activation="gelu_tanh",
        position_embedding_type="learned_absolute",
        add_bias_linear=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    base.update(kw)
    return ModelConfig(**base)


def qwen3_config(**kw) -> ModelConfig:
    """Llama-shaped with per-head q/k RMSNorms (--qk-layernorm, Qwen3)."""
    return llama_config(qk_layernorm=True, **kw)


def nemotron_config(**kw) -> ModelConfig:
    """Nemotron-shaped: LayerNorm with zero-centred gamma, squared ReLU, RoPE on half of each head, biases."""
    base = dict(
        normalization="LayerNorm",
        apply_layernorm_1p=True,
        activation="squared_relu",
        position_embedding_type="rope",
        rotary_percent=0.5,
    )
    return gpt2_config(**{**base, **kw})


# DeepSeek-V3's and Nemotron-H's MoE, small: 4 experts top-2, sigmoid routing with the expert bias, a shared expert
SIGMOID_MOE = dict(
    num_experts=4,
    moe_router_topk=2,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_ffn_hidden_size=24,
    moe_shared_expert_intermediate_size=24,
)


def deepseek_config(**kw) -> ModelConfig:
    """DeepSeek-V3-shaped: multi-latent attention (a query latent, normalised latents, RoPE on 8 of each head's 20
    query/key dims, values of 10), then a dense layer and MoE layers with sigmoid routing, an expert bias and a
    shared expert."""
    base = dict(
        num_query_groups=None,
        multi_latent_attention=True,
        qk_layernorm=True,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_head_dim=12,
        qk_pos_emb_head_dim=8,
        v_head_dim=10,
        **SIGMOID_MOE,
    )
    base.update(kw)
    base.setdefault("moe_layer_freq", tuple(int(i > 0) for i in range(base.get("num_layers", 2))))
    return llama_config(**base)


def gpt_oss_config(**kw) -> ModelConfig:
    """gpt-oss-shaped: learned attention sinks with a window on every other layer, biases, quick-GEGLU with an
    offset of 1 and a clamp small enough to bite at init (gpt-oss's 7 would not); a dense layer, then a MoE layer
    of biased experts."""
    base = dict(
        softmax_type="learnable",
        sliding_window=5,
        window_attn_skip_freq=2,
        add_bias_linear=True,
        activation="quick_geglu",
        glu_linear_offset=1.0,
        activation_func_clamp_value=0.2,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=24,
        moe_layer_freq=(0, 1),
    )
    base.update(kw)
    return llama_config(**base)


def nemotron_h_config(**kw) -> ModelConfig:
    """Nemotron-H-shaped (a hybrid Mamba model): Mamba-2, attention without positions, sigmoid-routed MoE with a
    shared expert, repeating M*EM over the layers; 16 Mamba heads of 8 dims in 2 groups of state 8."""
    n = kw.get("num_layers", 2)
    base = dict(
        activation="squared_relu",
        position_embedding_type="none",
        hybrid_override_pattern=("M*EM" * n)[:n],
        mamba_state_dim=8,
        mamba_head_dim=8,
        mamba_num_groups=2,
        **SIGMOID_MOE,
    )
    return llama_config(**{**base, **kw})


def decilm_block(attention: str = "normal", heads_in_group: int | None = None, ffn: str = "normal", **mlp) -> dict:
    """One entry of a DeciLM (Llama-Nemotron) config.json's block_configs, with the fields it writes in every
    block; `mlp` gives ffn_mult or Megatron's ffn_hidden_size."""
    return {
        "attention": {
            "n_heads_in_group": heads_in_group,
            "no_op": attention == "no_op",
            "replace_with_linear": attention == "linear",
            "sparsify": None,
            "window_length": None,
            "num_sink_tokens": None,
            "unshifted_sink": False,
            "use_prefill_window_in_sink_attention": False,
        },
        "ffn": {
            "no_op": ffn == "no_op",
            "replace_with_linear": ffn == "linear",
            "sparsify": None,
            "ffn_mult": None,
            **mlp,
        },  # fmt: skip
    }


# Each kind of heterogeneous layer on llama_config's 8 heads and 64 hidden, every size split by TP=2: 4 query groups
# and an FFN of 64; the attention a no-op and the MLP a linear; the attention a linear and the FFN from ffn_mult
# (int(2 x 1.3 x 64 / 3) = 55, rounded up to 256); 2 query groups and the MLP a no-op.
HETERO_BLOCKS = (
    decilm_block("normal", 2, "normal", ffn_hidden_size=64),
    decilm_block("no_op", None, "linear"),
    decilm_block("linear", None, "normal", ffn_mult=1.3),
    decilm_block("normal", 4, "no_op"),
)


def hetero_json(blocks) -> str:
    import json

    return json.dumps({"model_type": "nemotron-nas", "block_configs": list(blocks)})


def hetero_config(**kw) -> ModelConfig:
    """Llama-shaped with heterogeneous layers: HETERO_BLOCKS in turn, one per layer."""
    n = kw.get("num_layers", 4)
    text = hetero_json(HETERO_BLOCKS[i % len(HETERO_BLOCKS)] for i in range(n))
    return llama_config(**{"num_layers": n, "heterogeneous_layers_config_encoded_json": text, **kw})


CONFIGS = {
    "hetero": hetero_config,
    "nemotron_h": nemotron_h_config,
    "llama": llama_config,
    "gpt2": gpt2_config,
    "qwen3": qwen3_config,
    "nemotron": nemotron_config,
    "deepseek": deepseek_config,
    # gpt-oss's attention: learned sinks (--softmax-type learnable) and a window on every other layer
    "sinks": lambda **kw: llama_config(softmax_type="learnable", sliding_window=5, window_attn_skip_freq=2, **kw),
    "sinks-full": lambda **kw: llama_config(softmax_type="learnable", **kw),  # (no window: every CP type)
    "gptoss": gpt_oss_config,
    # Llama 4's and Qwen3-Next's attention: L2-normalised q/k, RoPE skipped on layer 2 (of 2), a gated output
    "gatednope": lambda **kw: llama_config(qk_l2_norm=True, no_rope_freq=2, attention_output_gate=True, **kw),
    # Llama 4 as Hugging Face computes it: interleaved RoPE, NoPE layer 2 without the L2 norm, MoE on layer 2 only
    # (sigmoid top-1 on the expert's input, a shared expert)
    "llama4": lambda **kw: llama_config(
        **dict(
            qk_l2_norm=True,
            qk_l2_norm_rope_only=True,
            no_rope_freq=2,
            rotary_interleaved=True,
            num_experts=4,
            moe_router_topk=1,
            moe_router_score_function="sigmoid",
            moe_apply_probs_on_input=True,
            moe_ffn_hidden_size=32,
            moe_shared_expert_intermediate_size=32,
            moe_layer_freq=(0, 1),
        )
        | kw
    ),
    # with the auxiliary and z losses in play (a coefficient of 0 leaves their scaling untested)
    "deepseekaux": lambda **kw: deepseek_config(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, **kw),
    # the residual-stream flags (tests/test_residual_flags.py): post-LN residuals on GPT-2's shape; an fp32 stream
    "postln": lambda **kw: gpt2_config(apply_residual_connection_post_layernorm=True, **kw),
    "fp32res": lambda **kw: llama_config(fp32_residual_connection=True, **kw),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Per-tensor relative error ||a - b|| / ||b||."""
    a, b = a.double(), b.double()
    denom = b.norm()
    return float((a - b).norm() / denom) if denom > 0 else float((a - b).norm())


def record_calls(monkeypatch, owner, name: str) -> list[tuple]:
    """Replace owner.<name> by a wrapper that calls it and records each call's positional arguments."""
    calls, real = [], getattr(owner, name)

    def spy(*args, **kw):
        calls.append(args)
        return real(*args, **kw)

    monkeypatch.setattr(owner, name, spy)
    return calls


def perturbed_full_state(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """The full weights of a model initialised from `seed`, with norm weights and biases moved away from
    their 1 / 0 init, so a bias applied twice or a norm weight applied to the wrong shard shows up."""
    model = GPTModel(config, ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu")), seed=seed)
    state = model.full_state_dict()
    gen = torch.Generator().manual_seed(seed + 1)
    return {k: (v + 0.1 * torch.randn(v.shape, generator=gen)) if v.ndim == 1 else v.clone() for k, v in state.items()}


def specs(config: ModelConfig, parallel: ParallelConfig, world_size: int) -> dict:
    """ShardSpec of every parameter (by global name) under a layout, from a meta-device model."""
    model = GPTModel(config, ParallelContext.virtual(parallel, world_size, 0), device="meta")
    return {model.global_name(n): meta.shard for n, _, meta in named_param_meta(model)}


def unshard_all(per_rank: list[dict[str, torch.Tensor]], spec_map: dict, tp: int) -> dict[str, torch.Tensor]:
    """Full tensors from TP ranks 0..tp-1 (the first tensor-parallel group)."""
    out = {}
    for name, spec in spec_map.items():
        if name not in per_rank[0]:  # (a parameter without a gradient: the MoE expert bias)
            continue
        shards = [per_rank[r][name] for r in range(tp)]
        out[name] = shards[0] if spec is None else spec.unshard(shards)
    return out
