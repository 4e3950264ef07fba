"""Hugging Face <-> megatron_lite configs: config.json to ModelConfig, the class that computes a ModelConfig, and
its config.json. The weights' maps are in models/hf_weights.py.

Supported: LlamaForCausalLM, MistralForCausalLM (with its sliding window), Qwen2ForCausalLM (QKV bias),
Qwen3ForCausalLM and Qwen3MoeForCausalLM (per-head q/k norms: --qk-layernorm), Qwen2MoeForCausalLM (QKV bias,
a gated shared expert: models/hf_qwen2moe.py), Phi3ForCausalLM (Phi-3, Phi-4:
fused qkv_proj and gate_up_proj, partial RoPE, sliding window), NemotronForCausalLM (LayerNorm
with zero-centred gamma, squared ReLU, partial RoPE), MixtralForCausalLM, DeepseekV3ForCausalLM (multi-latent
attention, sigmoid routing with score-correction bias, expert groups, shared experts; Kimi-K2 too),
DeepseekV2ForCausalLM (softmax top-k routing), GptOssForCausalLM (attention sinks, alternating windows, biased
quick-GEGLU experts: models/hf_gpt_oss.py), Glm4MoeForCausalLM (GLM-4.5: QKV bias, partial RoPE, DeepSeek-V3's
router and shared experts with GQA attention: models/hf_glm4moe.py), Llama4ForCausalLM (and the text model of
Llama4ForConditionalGeneration: NoPE layers, q/k L2 norms, a sigmoid top-1 on the experts' inputs, a shared expert:
models/hf_llama4.py), DeciLMForCausalLM (Llama-Nemotron's heterogeneous layers, remote code: models/hf_decilm.py)
and GPT2LMHeadModel. A field that changes
the math and that we do not implement is refused, never ignored.
"""

from __future__ import annotations

from typing import Any

from megatron_lite.config import ConfigError, ModelConfig, RopeScaling
from megatron_lite.models import hf_decilm, hf_deepseek, hf_glm4moe, hf_gpt_oss, hf_llama4, hf_nemotron_h, hf_qwen2moe
from megatron_lite.models.hf_decilm import DECILM
from megatron_lite.models.hf_deepseek import DEEPSEEK, DEEPSEEK_V2, DEEPSEEK_V3
from megatron_lite.models.hf_glm4moe import GLM4_MOE
from megatron_lite.models.hf_gpt_oss import GPT_OSS
from megatron_lite.models.hf_llama4 import LLAMA4, LLAMA4_VLM
from megatron_lite.models.hf_nemotron_h import NEMOTRON_H
from megatron_lite.models.hf_qwen2moe import QWEN2_MOE
from megatron_lite.models.hf_rope import partial_rotary as _partial_rotary
from megatron_lite.models.hf_rope import rope_fields as _rope

LLAMA_LIKE = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    QWEN2_MOE,
    "NemotronForCausalLM",
    "Phi3ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV2ForCausalLM",
    GPT_OSS,
    GLM4_MOE,
    LLAMA4,
)
QWEN3 = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")  # q_norm / k_norm over head_dim before RoPE
MTP = (DEEPSEEK_V3, GLM4_MOE)  # the classes whose checkpoints hold multi-token-prediction layers after the last
# rotate the first partial_rotary_factor of a head (GLM-4-MoE's class default is 0.5: always written)
PARTIAL_ROTARY = ("NemotronForCausalLM", "Phi3ForCausalLM", GLM4_MOE)


def _arch(hf_config: Any) -> str:
    """The class transformers' AutoModelForCausalLM builds from this config: its model_type's (config.json's
    architectures does not decide there: a Mistral model_type listing LlamaForCausalLM is built as Mistral, with
    its window, and was converted as Llama without it). A model_type of none of ours (Kimi-K2's kimi_k2, remote
    code of a DeepSeek class; DeciLM's) goes by its architectures."""
    by_type = _BY_MODEL_TYPE.get(getattr(hf_config, "model_type", None))
    if by_type is not None:
        return by_type
    archs = getattr(hf_config, "architectures", None) or []
    return archs[0] if archs else hf_config.model_type


def listed_architecture(hf_config: Any) -> str | None:
    """config.json's first architecture where it is not the class the model_type builds (None where it is)."""
    archs = getattr(hf_config, "architectures", None) or []
    return archs[0] if archs and archs[0] != _arch(hf_config) else None


def _gqa_fields(c: Any, rope: tuple[float, RopeScaling | None], eps: float | None = None) -> dict:
    """The ModelConfig fields every class with grouped-query attention reads alike (the Llama family's, gpt-oss's,
    GLM-4-MoE's): sizes, heads and groups, RMSNorm, SwiGLU, RoPE, the output layer, no hidden dropout. `eps`: the
    norm's epsilon where config.json does not call it rms_norm_eps (Nemotron)."""
    base, scaling = rope
    return dict(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads or c.num_attention_heads,
        kv_channels=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        ffn_hidden_size=c.intermediate_size,
        vocab_size=c.vocab_size,
        max_position_embeddings=c.max_position_embeddings,
        normalization="RMSNorm",
        norm_epsilon=c.rms_norm_eps if eps is None else eps,
        activation="swiglu",
        position_embedding_type="rope",
        rotary_base=base,
        rope_scaling=scaling,
        untie_embeddings_and_output_weights=not c.tie_word_embeddings,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(c, "attention_dropout", 0.0)),
    )


def config_from_hf(hf_config: Any, **overrides: Any) -> ModelConfig:
    arch = _arch(hf_config)
    if arch == LLAMA4_VLM:  # (its text model: the vision tower is not converted)
        hf_config, arch = hf_llama4.text_config(hf_config), LLAMA4
    if arch == NEMOTRON_H:  # (hybrid Mamba: no RoPE, its norms' epsilon layer_norm_epsilon)
        eps = float(hf_config.layer_norm_epsilon)
        kwargs = _gqa_fields(hf_config, _rope(hf_config), eps) | hf_nemotron_h.config_kwargs(hf_config)
    elif arch in DEEPSEEK:
        kwargs = hf_deepseek.config_kwargs(hf_config, arch, _rope(hf_config))
    elif arch == DECILM:  # (Llama-Nemotron: heterogeneous Llama layers)
        kwargs = hf_decilm.config_kwargs(hf_config, _rope(hf_config))
    elif arch == GPT_OSS:
        kwargs = _gqa_fields(hf_config, _rope(hf_config)) | hf_gpt_oss.config_kwargs(hf_config)
    elif arch == GLM4_MOE:
        kwargs = _gqa_fields(hf_config, _rope(hf_config)) | hf_glm4moe.config_kwargs(
            hf_config, _partial_rotary(hf_config)
        )
    elif arch == LLAMA4:
        kwargs = _gqa_fields(hf_config, _rope(hf_config)) | hf_llama4.config_kwargs(hf_config)
    elif arch in LLAMA_LIKE:
        c = hf_config
        nemotron = arch == "NemotronForCausalLM"
        act = "relu2" if nemotron else "silu"
        hf_deepseek.check_activation(c, arch, act)
        moe = hf_qwen2moe.config_kwargs(c) if arch == QWEN2_MOE else {}  # (its sliding-window rule first)
        if nemotron and getattr(c, "mlp_bias", False) != getattr(c, "attention_bias", False):
            raise ConfigError(
                f"config.json mlp_bias={c.mlp_bias} with attention_bias={c.attention_bias} is not supported: "
                "biases are on every linear layer or none (--disable-bias-linear)"
            )
        if getattr(c, "mlp_bias", False) and not nemotron:
            raise ConfigError(f"config.json mlp_bias=true is not supported for {arch}")
        if getattr(c, "use_sliding_window", False) and not getattr(c, "layer_types", None):
            # Qwen2: windows on layers max_window_layers.. only (transformers 5 writes them as layer_types, checked
            # below); with max_window_layers >= the layers, none (it was refused whatever it said)
            layers, first = c.num_hidden_layers, getattr(c, "max_window_layers", c.num_hidden_layers)
            if first < layers:
                raise ConfigError(
                    f"config.json use_sliding_window=true with max_window_layers {first} < num_hidden_layers "
                    f"{layers} is not supported for {arch} (windows on some layers only)"
                )
        if arch == "Qwen3MoeForCausalLM" and getattr(c, "use_sliding_window", False):
            # Qwen3-MoE has no layer_types: transformers (4.57 and 5) windows every layer, whatever max_window_layers
            moe_window = getattr(c, "sliding_window", 4096)  # (transformers' default where config.json has none)
            if moe_window is not None:
                raise ConfigError(
                    f"config.json use_sliding_window=true (sliding_window {moe_window}) is not supported for {arch}; "
                    "supported: use_sliding_window=false"
                )
        windowed = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
        window = getattr(c, "sliding_window", None) if arch in windowed else None
        if getattr(c, "layer_types", None) and any(t != "full_attention" for t in c.layer_types) and not window:
            raise ConfigError(
                f"config.json layer_types {sorted(set(c.layer_types))} are not supported for {arch}; supported: "
                "full_attention on every layer (use_sliding_window=false)"
            )
        attention_bias = getattr(c, "attention_bias", False)
        if attention_bias and arch not in ("Qwen2ForCausalLM", "NemotronForCausalLM"):
            raise ConfigError(f"config.json attention_bias=true (bias on o_proj too) is not supported for {arch}")
        if getattr(c, "shared_expert_intermediate_size", 0) and arch != QWEN2_MOE:
            raise ConfigError(f"config.json shared_expert_intermediate_size is not supported for {arch}")
        rope = _rope(c)
        partial = _partial_rotary(c)
        if partial != 1.0 and arch not in PARTIAL_ROTARY:  # (their attention rotates whole heads)
            raise ConfigError(f"config.json partial_rotary_factor={partial} is not supported for {arch}")
        kwargs = _gqa_fields(c, rope, c.norm_eps if nemotron else c.rms_norm_eps) | dict(
            normalization="LayerNorm" if nemotron else "RMSNorm",
            apply_layernorm_1p=nemotron,  # Nemotron's LayerNorm1P stores gamma - 1, as we do with the flag
            activation="squared_relu" if nemotron else "swiglu",
            rotary_percent=partial,
            sliding_window=int(window) if window else None,
            add_bias_linear=nemotron and attention_bias,
            add_qkv_bias=arch == "Qwen2ForCausalLM",
            qk_layernorm=arch in QWEN3,
        )
        if arch == "MixtralForCausalLM":
            if getattr(c, "router_jitter_noise", 0.0):
                raise ConfigError(f"config.json router_jitter_noise={c.router_jitter_noise} is not supported")
            # transformers adds its (k-times larger) aux loss only with output_router_logits; the weights'
            # math is the router and the experts, so the auxiliary loss is left to the training flags.
            kwargs.update(
                num_experts=c.num_local_experts,
                moe_router_topk=c.num_experts_per_tok,
                moe_ffn_hidden_size=c.intermediate_size,
                moe_aux_loss_coeff=0.0,
            )
        if arch == "Qwen3MoeForCausalLM" and c.num_experts:
            # MoE on layers (i + 1) % decoder_sparse_step == 0 not in mlp_only_layers; dense layers use
            # intermediate_size. norm_topk_prob=false: the top-k of the full softmax, not renormalised.
            step, dense = int(getattr(c, "decoder_sparse_step", 1) or 1), set(getattr(c, "mlp_only_layers", []) or [])
            pattern = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(c.num_hidden_layers))
            kwargs.update(
                num_experts=c.num_experts,
                moe_router_topk=c.num_experts_per_tok,
                moe_ffn_hidden_size=c.moe_intermediate_size,
                moe_router_pre_softmax=not c.norm_topk_prob,
                moe_layer_freq=1 if all(pattern) else pattern,
                moe_aux_loss_coeff=0.0,
            )
        kwargs.update(moe)
    elif arch == "GPT2LMHeadModel":
        c = hf_config
        if c.activation_function not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise ConfigError(f"config.json activation_function {c.activation_function!r} is not supported")
        if c.scale_attn_by_inverse_layer_idx or c.reorder_and_upcast_attn or not c.scale_attn_weights:
            raise ConfigError("config.json GPT-2 attention scaling variants are not supported")
        kwargs = dict(
            num_layers=c.n_layer,
            hidden_size=c.n_embd,
            num_attention_heads=c.n_head,
            ffn_hidden_size=c.n_inner or 4 * c.n_embd,
            vocab_size=c.vocab_size,
            max_position_embeddings=c.n_positions,
            normalization="LayerNorm",
            norm_epsilon=c.layer_norm_epsilon,
            activation="gelu" if c.activation_function == "gelu" else "gelu_tanh",
            position_embedding_type="learned_absolute",
            add_bias_linear=True,
            untie_embeddings_and_output_weights=not getattr(c, "tie_word_embeddings", True),
            hidden_dropout=c.resid_pdrop,
            attention_dropout=c.attn_pdrop,
        )
    else:
        supported = ", ".join(LLAMA_LIKE + (LLAMA4_VLM, DECILM, "GPT2LMHeadModel"))
        raise ConfigError(f"config.json architecture {arch!r} is not supported; supported: {supported}")
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


# config.json ------------------------------------------------------------------------------------
def architecture_for(config: ModelConfig, preferred: str | None = None) -> str:
    """The Hugging Face class that computes what `config` computes: `preferred` (the class the weights came
    from) when it can, else the first that does."""
    first = _architecture(config)
    if preferred in _EQUIVALENT.get(first, ()):
        try:
            check_exportable(config, preferred)
            return preferred
        except ConfigError:
            pass
    return first


# Classes that compute the same models (a Llama converted from Phi-3 goes back to Phi-3)
_EQUIVALENT = {
    "LlamaForCausalLM": ("MistralForCausalLM", "Phi3ForCausalLM", GLM4_MOE),
    "MistralForCausalLM": ("Phi3ForCausalLM",),
    "Phi3ForCausalLM": ("MistralForCausalLM", GLM4_MOE),
    "Qwen2ForCausalLM": (GLM4_MOE,),
    "Qwen3ForCausalLM": (GLM4_MOE,),  # (a GLM-4-MoE whose layers are all dense goes back to GLM-4-MoE)
    DEEPSEEK_V3: (DEEPSEEK_V2,),  # (dense multi-latent attention models: the two compute the same)
}


def _architecture(config: ModelConfig) -> str:
    if config.hybrid:
        return NEMOTRON_H
    if config.heterogeneous_blocks is not None:
        return DECILM
    if config.multi_latent_attention:
        softmax = config.num_experts and config.moe_router_score_function == "softmax"
        return DEEPSEEK_V2 if softmax else DEEPSEEK_V3
    if config.softmax_type == "learnable" and config.activation == "quick_geglu":
        return GPT_OSS
    if config.position_embedding_type == "learned_absolute" and config.normalization == "LayerNorm":
        return "GPT2LMHeadModel"
    if config.position_embedding_type == "rope" and config.normalization == "LayerNorm":
        if config.activation == "squared_relu":
            return "NemotronForCausalLM"
    if config.position_embedding_type != "rope" or config.normalization != "RMSNorm" or config.activation != "swiglu":
        raise ConfigError(
            f"no Hugging Face architecture computes this model ({config.normalization}, {config.activation}, "
            f"{config.position_embedding_type} positions); supported: Llama/Mistral/Qwen2/Qwen3/Mixtral, Nemotron, "
            "GPT-2"
        )
    nope = any(config.skips_rope(i) for i in range(config.num_layers))
    if config.rotary_interleaved or config.qk_l2_norm or nope or config.moe_apply_probs_on_input:
        return LLAMA4  # (the one class that rotates interleaved pairs, skips RoPE or weighs the experts' inputs)
    if config.num_experts and config.moe_shared_expert_gate:
        return QWEN2_MOE
    if config.num_experts and config.moe_router_score_function == "sigmoid":
        return GLM4_MOE  # (DeepSeek-V3's router and shared experts over grouped-query attention)
    if not config.num_experts and (config.qk_layernorm or config.add_qkv_bias):
        if config.rotary_percent != 1.0 or (config.qk_layernorm and config.add_qkv_bias):
            return GLM4_MOE  # (a dense one: no Qwen class has partial RoPE, or both q/k norms and QKV bias)
    if config.qk_layernorm:
        return "Qwen3MoeForCausalLM" if config.num_experts else "Qwen3ForCausalLM"
    if config.num_experts:
        return "MixtralForCausalLM"
    if config.add_qkv_bias:
        return "Qwen2ForCausalLM"
    if config.rotary_percent != 1.0:
        return "Phi3ForCausalLM"
    if config.sliding_window:
        return "MistralForCausalLM"
    return "LlamaForCausalLM"


def check_exportable(c: ModelConfig, arch: str) -> None:
    """What `arch` cannot express is a one-line error, never silently dropped."""
    problems = (
        ["interleaved RoPE (--rotary-interleaved; Hugging Face's classes rotate halves but Llama 4's)"]
        if c.rotary_interleaved and arch != LLAMA4
        else []
    )
    if c.apply_residual_connection_post_layernorm:  # (fp32 residuals change no weight: exported as they are)
        problems.append("residuals taken after each norm (--apply-residual-connection-post-layernorm; every Hugging "
                        "Face class adds each branch to its norm's input)")  # fmt: skip
    if c.softmax_type != "vanilla" and arch != GPT_OSS:
        problems.append(f"attention sinks (--softmax-type {c.softmax_type})")
    if c.sliding_window and any(c.layer_window(i) is None for i in range(c.num_layers)) and arch != GPT_OSS:
        problems.append("full-attention layers between the windowed ones (--window-attn-skip-freq)")
    llama4 = arch == LLAMA4  # (Llama 4's class computes the first two; Qwen3-Next has no converter yet)
    for on, what in (
        (c.qk_l2_norm and not llama4, "L2-normalised queries and keys (--qk-l2-norm, Llama 4)"),
        (
            any(c.skips_rope(i) for i in range(c.num_layers)) and not llama4,
            "layers without RoPE (--no-rope-freq, Llama 4)",
        ),  # fmt: skip
        (c.attention_output_gate, "the attention output gate (--attention-output-gate, Qwen3-Next)"),
        ((c.heterogeneous_blocks is not None) > (arch == DECILM), f"heterogeneous layers (only {DECILM} has them)"),
    ):
        if on:
            problems.append(what)
    if arch != GPT_OSS and (c.activation == "quick_geglu" or (c.num_experts and c.add_bias_linear)):
        problems.append("gpt-oss's MLP (--quick-geglu with its offset and clamp, or experts with biases): only "
                        "GptOssForCausalLM computes it")  # fmt: skip
    if c.hybrid != (arch == NEMOTRON_H):
        problems.append(f"Mamba layers (only {NEMOTRON_H} has them)" if c.hybrid else "no hybrid layer pattern")
    if arch == NEMOTRON_H:
        problems += hf_nemotron_h.export_problems(c)
    elif arch == DECILM:
        problems += hf_decilm.export_problems(c)
    elif arch == GPT_OSS:
        problems += hf_gpt_oss.export_problems(c)
    elif arch == GLM4_MOE:
        problems += hf_glm4moe.export_problems(c)
    elif arch == LLAMA4:
        problems += hf_llama4.export_problems(c)
    elif arch in DEEPSEEK:
        problems += hf_deepseek.export_problems(c, arch)
    elif arch == "GPT2LMHeadModel":
        if not c.add_bias_linear:
            problems.append("GPT-2 needs biases (drop --disable-bias-linear)")
        if c.ffn_size and c.activation not in ("gelu", "gelu_tanh"):
            problems.append(f"activation {c.activation}")
        for bad, what in (
            (c.qk_layernorm, "q/k norms"),
            (c.sliding_window, "a sliding window"),
            (c.query_groups != c.num_attention_heads, "grouped-query attention"),
            (c.head_dim * c.num_attention_heads != c.hidden_size, f"--kv-channels {c.head_dim} x heads != hidden"),
            (c.num_experts, "experts"),
        ):
            if bad:
                problems.append(what)
    elif arch == "NemotronForCausalLM":
        for bad, what in (
            (c.num_experts, "experts"),
            (c.qk_layernorm, "q/k norms"),
            (c.add_qkv_bias and not c.add_bias_linear, "QKV bias alone"),
            (c.sliding_window, "a sliding window"),
        ):
            if bad:
                problems.append(what)
    else:
        if c.add_bias_linear:
            problems.append("biases on every linear layer (Llama-family models have none)")
        if c.num_experts:
            if c.moe_router_score_function != "softmax" or c.moe_router_enable_expert_bias:
                problems.append(f"a sigmoid router or expert bias ({arch} routes by softmax)")
            if c.moe_shared_expert_intermediate_size and arch != QWEN2_MOE:
                problems.append("shared experts")
            if arch == "MixtralForCausalLM" and c.moe_layer_freq != 1:
                problems.append("dense layers between MoE layers (Qwen3-MoE has them, with --qk-layernorm)")
            scale = c.moe_router_topk_scaling_factor
            if scale is not None and scale != 1.0:
                problems.append(f"--moe-router-topk-scaling-factor {scale:g} ({arch} does not scale the top-k)")
            groups = c.moe_router_num_groups
            if groups and (c.moe_router_group_topk or groups) < groups:
                problems.append("group-limited routing (--moe-router-num-groups / --moe-router-group-topk)")
            if arch == "MixtralForCausalLM" and c.moe_router_pre_softmax:
                problems.append("--moe-router-pre-softmax (Mixtral renormalises the top-k; Qwen3-MoE can not to)")
        if arch in QWEN3 and c.add_qkv_bias:
            problems.append("QKV bias with --qk-layernorm (Qwen3 has no QKV bias)")
        if arch in QWEN3 and c.sliding_window:
            problems.append("a sliding window with --qk-layernorm")
        if arch == "Qwen2ForCausalLM" and c.sliding_window:
            problems.append("a sliding window with --add-qkv-bias (exported as Qwen2, whose window we do not write)")
        if arch == QWEN2_MOE:
            problems += hf_qwen2moe.export_problems(c)
        if arch == "MixtralForCausalLM" and c.add_qkv_bias:
            problems.append("QKV bias (--add-qkv-bias; Mixtral's attention has none)")
        if arch == "Phi3ForCausalLM" and c.rope_scaling is not None:
            problems.append(f"{c.rope_scaling.rope_type} RoPE scaling (Phi-3 takes only longrope)")
    if c.num_experts and c.moe_apply_probs_on_input and arch != LLAMA4:
        problems.append(
            "routing weights on the experts' inputs (--moe-apply-probs-on-input; Hugging Face's weigh outputs)"
        )
    if c.num_experts and c.moe_router_load_balancing_type == "sinkhorn":  # (inference's sigmoid top-1 weights)
        problems.append("Sinkhorn routing's expert weights (--moe-router-load-balancing-type sinkhorn)")
    if c.mtp_num_layers and arch not in MTP:
        problems.append(f"multi-token prediction (--mtp-num-layers {c.mtp_num_layers}; only DeepSeek-V3 and GLM-4-MoE "
                        "hold it)")  # fmt: skip
    if c.rotary_percent != 1.0 and arch not in (*PARTIAL_ROTARY, "GPT2LMHeadModel"):
        problems.append(f"--rotary-percent {c.rotary_percent} ({arch} rotates whole heads)")
    if problems:
        raise ConfigError(f"cannot export to {arch}: {'; '.join(problems)}")


MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    QWEN2_MOE: "qwen2_moe",
    "NemotronForCausalLM": "nemotron",
    "Phi3ForCausalLM": "phi3",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    GPT_OSS: "gpt_oss",
    NEMOTRON_H: "nemotron_h",
    DECILM: hf_decilm.MODEL_TYPE,
    GLM4_MOE: "glm4_moe",
    LLAMA4: "llama4_text",
    "GPT2LMHeadModel": "gpt2",
}
# (and back: the class each model_type builds; Llama 4's multimodal one, whose text model converts)
_BY_MODEL_TYPE = {kind: arch for arch, kind in MODEL_TYPES.items()} | {"llama4": LLAMA4_VLM}


def hf_config_dict(config: ModelConfig, arch: str, base: dict | None = None, dtype: str = "float32") -> dict:
    """config.json for `arch` computing what `config` computes. Fields of `base` (the config.json the
    weights came with: token ids, generation settings) are kept unless they change the math."""
    c = config
    out = dict(base or {})
    out.update(architectures=[arch], model_type=MODEL_TYPES[arch], vocab_size=c.vocab_size, torch_dtype=dtype)
    out.pop("dtype", None)
    # (the weights are not quantised; the remote code auto_map names goes along for DeciLM only, hf_convert.py)
    for dropped in ("quantization_config", "auto_map"):
        out.pop(dropped, None)
    out.setdefault("initializer_range", c.init_method_std)  # (the base's: only new weights' init reads it)
    # (without a base config.json, a class default such as Phi-3's 32000 would be read, past a smaller vocabulary)
    out.setdefault("pad_token_id", None)
    check_exportable(c, arch)
    if arch == NEMOTRON_H:
        return {k: v for k, v in (out | hf_nemotron_h.config_fields(c)).items() if v is not None or k == "pad_token_id"}
    if arch == "GPT2LMHeadModel":
        out.update(
            n_embd=c.hidden_size,
            n_layer=c.num_layers,
            n_head=c.num_attention_heads,
            n_inner=c.ffn_size,
            n_positions=c.max_position_embeddings,
            activation_function="gelu" if c.activation == "gelu" else "gelu_new",
            layer_norm_epsilon=c.norm_epsilon,
            resid_pdrop=c.hidden_dropout,
            embd_pdrop=c.hidden_dropout,
            attn_pdrop=c.attention_dropout,
            scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False,
            reorder_and_upcast_attn=False,
            tie_word_embeddings=c.tied_embeddings,
        )
        return out
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rotary_base}
    if c.rope_scaling is not None and c.rope_scaling.rope_type == "yarn":
        r = c.rope_scaling
        rope.update(
            rope_type="yarn",
            factor=r.factor,
            original_max_position_embeddings=r.original_max_position_embeddings,
            beta_fast=r.beta_fast,
            beta_slow=r.beta_slow,
            attention_factor=r.attention_factor,
            truncate=r.truncate,
        )
    elif c.rope_scaling is not None:
        r = c.rope_scaling
        rope.update(
            rope_type="llama3",
            factor=r.factor,
            low_freq_factor=r.low_freq_factor,
            high_freq_factor=r.high_freq_factor,
            original_max_position_embeddings=r.original_max_position_embeddings,
        )
    for legacy in ("rope_theta", "rope_scaling", "rope_parameters"):
        out.pop(legacy, None)
    out.update(
        hidden_size=c.hidden_size,
        intermediate_size=c.moe_ffn_size if arch == "MixtralForCausalLM" else c.ffn_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.query_groups,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.norm_epsilon,
        hidden_act="silu",
        tie_word_embeddings=c.tied_embeddings,
        attention_dropout=c.attention_dropout,
        # transformers >= 5 reads rope_parameters; 4.x reads rope_theta and rope_scaling.
        rope_parameters=rope,
        rope_theta=c.rotary_base,
        rope_scaling=None if c.rope_scaling is None else {k: v for k, v in rope.items() if k != "rope_theta"},
    )
    # (Qwen3's head_dim defaults to 128 whatever the hidden size, so it is always written there)
    if c.head_dim != c.hidden_size // c.num_attention_heads or out.get("head_dim") is not None or arch in QWEN3:
        out["head_dim"] = c.head_dim
    if c.rotary_percent != 1.0 or arch in PARTIAL_ROTARY:
        rope["partial_rotary_factor"] = c.rotary_percent
        out["partial_rotary_factor"] = c.rotary_percent  # (transformers 4.x reads it here)
        out["rope_parameters"] = rope
    if arch == "NemotronForCausalLM":
        out.pop("rms_norm_eps")
        out.update(norm_eps=c.norm_epsilon, hidden_act="relu2", attention_bias=c.add_bias_linear)
        out["mlp_bias"] = c.add_bias_linear
    if arch in ("LlamaForCausalLM",):
        out.update(attention_bias=False, mlp_bias=False)
    if arch == DECILM:
        return hf_decilm.config_fields(c, out)
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        out["sliding_window"] = c.sliding_window
    if arch in ("Qwen2ForCausalLM", QWEN2_MOE, *QWEN3):
        out.update(use_sliding_window=False, sliding_window=None)
        out.pop("layer_types", None)  # (transformers derives them: full attention everywhere)
    if arch in QWEN3:
        out["attention_bias"] = False
    if arch == QWEN2_MOE:
        out.update(hf_qwen2moe.config_fields(c))
    if arch == "Qwen3MoeForCausalLM":
        out.update(
            num_experts=c.num_experts,
            num_experts_per_tok=c.moe_router_topk,
            moe_intermediate_size=c.moe_ffn_size,
            norm_topk_prob=not c.moe_router_pre_softmax,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(c.num_layers) if not c.is_moe_layer(i)],
        )
    if arch in DEEPSEEK:
        out.update(hf_deepseek.config_fields(c, arch, hf_deepseek.rope_interleave_of(arch, base)))
        if c.rope_scaling is not None and c.rope_scaling.rope_type == "yarn":
            # the softmax scale's factor, in both blocks: with both written, transformers 5 builds its rope
            # parameters from rope_scaling (the scale came back without mscale^2), and 4.x reads only that one
            rope["mscale_all_dim"] = out["rope_scaling"]["mscale_all_dim"] = c.mla_mscale_all_dim
    if arch == GPT_OSS:
        out.update(hf_gpt_oss.config_fields(c))
    if arch == GLM4_MOE:
        out.update(hf_glm4moe.config_fields(c))
    if arch == LLAMA4:
        out.update(hf_llama4.config_fields(c))
    if arch == "MixtralForCausalLM":
        out.update(
            num_local_experts=c.num_experts,
            num_experts_per_tok=c.moe_router_topk,
            router_jitter_noise=0.0,
        )
    return out
