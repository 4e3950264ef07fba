"""Configuration dataclasses, validated per concern.

Every check raises `ConfigError` with one line that names the flags (Megatron's spelling), their values and a
valid alternative. The checks across configs that depend on how the job is split are in layout_validation.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "squared_relu", "quick_geglu")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
# Megatron's selective-recompute modules: core attention; the two layer norms; a dense layer's MLP; a MoE layer whole;
# its shared expert; its experts' activation (with fc2 here); MLA's up-projections and RoPE (with core attention here)
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "shared_experts", "moe_act", "mla_up_proj")


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line naming the flag, value and fix."""


def divisors(n: int) -> list[int]:
    return list(_divisors(n))


@functools.lru_cache(maxsize=1024)
def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)  # the planner's search asks for the same few often


def _nearest_multiples(value: int, step: int) -> str:
    lo = (value // step) * step
    hi = lo + step
    return f"{lo} or {hi}" if lo > 0 else f"{hi}"


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's attention scale for a context stretched `scale` times: 0.1 m ln(scale) + 1 (1 when not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """Frequency-dependent RoPE scaling: Llama 3's (HF `rope_type: llama3`, Megatron `--use-rope-scaling`), or
    YaRN (HF `rope_type: yarn`, from a converted checkpoint): frequencies blended between extrapolation and
    interpolation by `factor` over the band set by beta_fast / beta_slow, and cos / sin scaled by
    `attention_factor`."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"  # llama3 | yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # YaRN's cos / sin scale (resolved from mscale / mscale_all_dim at conversion)
    truncate: bool = True  # YaRN: round the correction band outwards to whole dims


# The architecture flags of a Llama-shaped model (RMSNorm, SwiGLU, RoPE, no biases, no dropout), for configs
# built in code: ModelConfig(**LLAMA_ARCHITECTURE, num_layers=..., ...).
LLAMA_ARCHITECTURE = dict(
    normalization="RMSNorm",
    activation="swiglu",
    position_embedding_type="rope",
    add_bias_linear=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer. Defaults follow Megatron-LM's GPT defaults (LayerNorm, GELU, biases,
    learned positions, tied embeddings); Llama sets RMSNorm, SwiGLU, RoPE, no biases, untied output."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    num_query_groups: int | None = None  # grouped-query attention; default = num_attention_heads
    kv_channels: int | None = None  # head_dim; default hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    make_vocab_size_divisible_by: int = 128
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    # Megatron's --apply-layernorm-1p (Transformer Engine's zero-centred gamma): norm weights are stored as
    # w = gamma - 1 (zeros at init) and applied as 1 + w
    apply_layernorm_1p: bool = False
    # Megatron's --apply-residual-connection-post-layernorm (the original BERT ordering): each residual add takes
    # the norm's output, not its input: x = norm(x) + attn(norm(x)), then the same around the MLP
    apply_residual_connection_post_layernorm: bool = False
    # Megatron's --fp32-residual-connection (with --bf16 / --fp16): the residual stream (the embeddings, each
    # residual add, what passes between layers and pipeline stages) is fp32; the norms read it and give the
    # branches their input in the compute dtype, and each branch's output is added to the stream in fp32
    fp32_residual_connection: bool = False
    # gelu (exact) | gelu_tanh (GPT-2's gelu_new; Megatron's --openai-gelu, and its default fused bias-GELU: the
    # flags give it with biases unless --no-bias-gelu-fusion) | swiglu | squared_relu (--squared-relu: relu(x)^2,
    # Nemotron) | quick_geglu (--quick-geglu: gated like SwiGLU with x * sigmoid(1.702 x) on the gate, gpt-oss).
    # (This dataclass's default stays exact GELU: conversions and tests name theirs.)
    activation: str = "gelu"
    # Megatron's --glu-linear-offset and --activation-func-clamp-value (gpt-oss: 1 and 7): a gated unit computes
    # act(min(gate, c)) * (clamp(up, -c, c) + offset), after fc1's bias; here only with --quick-geglu
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0
    # Megatron's --rotary-percent (Hugging Face's partial_rotary_factor): RoPE rotates the first
    # int(head_dim * rotary_percent) dims of each head and passes the rest through
    rotary_percent: float = 1.0
    # Megatron's --rotary-interleaved: RoPE rotates the pairs (0, 1), (2, 3), ... of each head, not its halves
    rotary_interleaved: bool = False
    rope_scaling: RopeScaling | None = None
    # Sliding-window attention (Mistral): each token sees the last `sliding_window` tokens, itself included.
    sliding_window: int | None = None
    # Megatron's --window-attn-skip-freq: which layers the window applies to. N: every Nth layer (1-based: N, 2N,
    # ...) attends to the whole sequence, the others window (gpt-oss: 2); or a 0/1 pattern per layer, 1 = window
    window_attn_skip_freq: int | tuple[int, ...] | None = None
    # Megatron's --softmax-type: vanilla | off-by-one (a zero logit beside each query's keys: softmax_1) |
    # learnable (a learned logit per head, gpt-oss's attention sinks); the extra column takes probability and
    # adds no value
    softmax_type: str = "vanilla"
    add_bias_linear: bool = True
    add_qkv_bias: bool = False  # Qwen2: bias on QKV only
    # Megatron's --qk-layernorm (Qwen3, OLMo-2 style per head): each query and key head is normalised over
    # head_dim, with one weight shared by all heads (--normalization picks the norm), before RoPE
    qk_layernorm: bool = False
    # Megatron's --qk-l2-norm (Llama 4): each query and key head scaled to unit RMS over head_dim, no weight
    # (Megatron-Core's L2Norm: x * rsqrt(mean(x^2) + norm_epsilon)), before RoPE
    qk_l2_norm: bool = False
    # Megatron's --no-rope-freq (Llama 4's NoPE layers): which layers skip RoPE. N: every Nth layer (1-based: N,
    # 2N, ...); or a 0/1 pattern per layer, 1 = no RoPE
    no_rope_freq: int | tuple[int, ...] | None = None
    # Llama 4 as Hugging Face computes it (no Megatron flag): see models/attention_variants.py
    qk_l2_norm_rope_only: bool = False
    attention_chunk_size: int | None = None
    attn_temperature_floor_scale: int | None = None
    attn_temperature_scale: float = 0.1
    # Megatron's --attention-output-gate (Qwen3-Next): linear_qkv also makes a gate per query head and dim (rows
    # after each group's query heads); the attention output is multiplied by sigmoid(gate) before linear_proj
    attention_output_gate: bool = False
    # Megatron's QK-clip (MuonClip; models/qk_clip.py): after each optimizer step, each query group whose largest
    # attention logit of the step exceeds qk_clip_threshold has its query and key rows scaled down to it;
    # log_max_attention_logit (implied by qk_clip) records and logs that max logit without clipping
    qk_clip: bool = False
    qk_clip_alpha: float = 0.5
    qk_clip_threshold: float = 100.0
    log_max_attention_logit: bool = False
    # Multi-latent attention (DeepSeek-V2/V3; Megatron's --multi-latent-attention and flags of the same names): the
    # queries come through a q_lora_rank latent (or one projection when None), keys and values from one
    # kv_lora_rank latent per token. Each query/key head is qk_head_dim dims without position and
    # qk_pos_emb_head_dim dims with RoPE (one such key part shared by all heads); values have v_head_dim.
    # --qk-layernorm puts an RMS norm on each latent. The softmax scale is (qk_head_dim + qk_pos_emb_head_dim)^-0.5,
    # times YaRN's mscale(factor, mla_mscale_all_dim)^2 when the RoPE scaling is YaRN (DeepSeek-V3's mscale_all_dim).
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    mla_mscale_all_dim: float = 0.0
    untie_embeddings_and_output_weights: bool = False
    init_method_std: float = 0.02
    embedding_init_method_std: float | None = None  # Megatron's: the embeddings' init std (else init_method_std)
    init_method_xavier_uniform: bool = False  # Megatron's: Xavier-uniform weights instead of normal(0, std)
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    recompute_granularity: str | None = None  # None | full | selective
    recompute_method: str | None = None  # uniform | block (full only)
    recompute_num_layers: int | None = None
    recompute_modules: tuple[str, ...] = ("core_attn",)
    # Mixture of experts (Megatron's names); dense when num_experts is None.
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"  # softmax | sigmoid
    moe_router_pre_softmax: bool = False  # softmax over all experts, then top-k (else top-k, then softmax)
    # Group-limited routing (DeepSeek-V3's node-limited routing): experts in num_groups equal groups; a token
    # picks its top-k among the group_topk groups whose best topk // group_topk scores sum highest
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None  # the selected experts' weights times this (DeepSeek-V3)
    # How many of a group's best scores rank the group: Megatron's topk // group_topk when None; converted
    # checkpoints set their model's rule (transformers' DeepSeek-V3: 2, DeepSeek-V2's group_limited_greedy: 1)
    moe_router_group_score_topn: int | None = None
    moe_router_dtype: str = "fp32"  # Megatron's --moe-router-dtype: the routing computation in fp32 or fp64
    moe_ffn_hidden_size: int | None = None  # default: ffn_hidden_size
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss | seq_aux_loss | sinkhorn | none
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_expert_capacity_factor: float | None = None  # dropless when None
    moe_token_drop_policy: str = "probs"  # probs | position
    moe_layer_freq: int | tuple[int, ...] = 1  # every Nth layer is MoE, or a 0/1 pattern per layer
    moe_shared_expert_intermediate_size: int | None = None
    # Megatron's --moe-shared-expert-gate (Qwen2-MoE's shared_expert_gate): the shared expert's output times
    # sigmoid(x . w), w a [1, hidden] weight replicated across TP
    moe_shared_expert_gate: bool = False
    moe_token_dispatcher_type: str = "alltoall"  # alltoall | allgather
    # Megatron's --moe-input-jitter-eps (Switch Transformer's jitter): in training, the router's input (not the
    # experts') times noise uniform in [1 - eps, 1 + eps], drawn from the default generator (moe/router.py)
    moe_input_jitter_eps: float | None = None
    # Megatron's --moe-router-force-load-balancing (its benchmarking mode): normal random router logits, their
    # gradient passed straight through to the real logits
    moe_router_force_load_balancing: bool = False
    # Megatron's --moe-pad-expert-input-to-capacity: each expert's input padded with zero rows to its capacity
    # (needs moe_expert_capacity_factor); the padding's outputs are dropped, so the math is unchanged
    moe_pad_expert_input_to_capacity: bool = False
    # Megatron's --moe-apply-probs-on-input: the routing weight multiplies the expert's input, not its output
    # (top-k 1 only, as Megatron asserts)
    moe_apply_probs_on_input: bool = False
    # Multi-token prediction (DeepSeek-V3; Megatron's --mtp-num-layers, --mtp-loss-scaling-factor): after the
    # last layer, depth k (1..mtp_num_layers) combines each position's hidden state with the embedding of the
    # token k ahead and predicts the token k + 1 ahead through one more transformer layer and the shared output
    # layer; its loss, averaged over depths and weighted by the factor, joins the training loss.
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1
    # Hybrid Mamba models (Nemotron-H; Megatron's MambaModel and flags, models/mamba.py): each layer one residual
    # block of one kind, M Mamba-2, * attention, - MLP, E MoE (models/hybrid_pattern.py). A model is hybrid with
    # --is-hybrid-model, a pattern or a ratio; all Mamba when neither pattern nor ratios are given.
    is_hybrid_model: bool = False
    hybrid_attention_ratio: float = 0.0
    hybrid_mlp_ratio: float = 0.0
    hybrid_override_pattern: str | None = None
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: int | None = None  # default: 2 x hidden_size / mamba_head_dim (Megatron's expand 2)
    # Heterogeneous layers (Llama-Nemotron; Megatron's --heterogeneous-layers-config-path / -encoded-json): the text
    # of a Hugging Face config.json whose block_configs give each layer its own query groups and FFN size, or a
    # no-op or linear in place of its attention or MLP (models/heterogeneous.py). Kept as text, as Megatron keeps
    # it, so that a checkpoint carries it.
    heterogeneous_layers_config_encoded_json: str | None = None
    # Which implementation runs the norms, SwiGLU, RoPE, attention and loss: our Triton kernels or PyTorch.
    kernel_impl: str = "torch"
    # fp8 GEMMs in the transformer layers' linears (Megatron's --fp8-format e4m3|hybrid, --fp8-recipe,
    # --no-fp8-wgrad; tensor_parallel/fp8.py), None: in the compute dtype. fp8_bf16_layers: how many of the first
    # and last layers stay in the compute dtype (--first-last-layers-bf16 --num-layers-at-start/end-in-bf16)
    fp8: str | None = None
    fp8_recipe: str = "delayed"
    fp8_margin: int = 0  # delayed scaling's: --fp8-margin, --fp8-amax-history-len, --fp8-amax-compute-algo
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    fp8_wgrad: bool = True
    fp8_bf16_layers: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        self.validate()

    # Derived sizes -----------------------------------------------------------------------------
    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def gated_linear_unit(self) -> bool:
        """Megatron's name: fc1 computes a gate and an up projection (stacked [gate; up]), the activation gates."""
        return self.activation in ("swiglu", "quick_geglu")

    @property
    def query_groups(self) -> int:
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.head_dim * self.rotary_percent)

    @property
    def mla_q_head_dim(self) -> int:
        """A query / key head of multi-latent attention: the part without position, then the RoPE part."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    @property
    def softmax_scale(self) -> float:
        if not self.multi_latent_attention:
            return self.head_dim**-0.5
        scale = self.mla_q_head_dim**-0.5
        s = self.rope_scaling
        if s is not None and s.rope_type == "yarn" and self.mla_mscale_all_dim and s.factor > 1:
            scale *= yarn_mscale(s.factor, self.mla_mscale_all_dim) ** 2
        return scale

    @property
    def embedding_init_std(self) -> float:
        return self.init_method_std if self.embedding_init_method_std is None else self.embedding_init_method_std

    @property
    def output_layer_init_std(self) -> float:
        """Megatron's scaled init for the projections that write into the residual stream: std / sqrt(2 L), two
        branches a layer; a hybrid model's layers have one branch each, std / sqrt(L) (Megatron's multiplier 1)."""
        return self.init_method_std / math.sqrt((1.0 if self.hybrid else 2.0) * self.num_layers)

    @property
    def tied_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        """Megatron's padding: a multiple of make_vocab_size_divisible_by x TP. Padding never changes a
        result here: padded rows are zero, never looked up, and masked out of the softmax."""
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def validate(self) -> None:
        from megatron_lite.models.config_checks import validate_model  # (it imports this module)

        validate_model(self)

    @property
    def moe_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_size

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (0-based; the multi-token-prediction layers follow the decoder's,
        numbered on as Megatron numbers them), or None where it attends to the whole sequence."""
        freq = self.window_attn_skip_freq
        if self.sliding_window is None or freq is None:
            return self.sliding_window
        if isinstance(freq, int):
            return self.sliding_window if (layer + 1) % freq else None  # (Megatron's is_layer_window_attention)
        return self.sliding_window if freq[min(layer, self.num_layers - 1)] else None

    def skips_rope(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) is a NoPE layer (--no-rope-freq; Megatron's no_rope_freq[layer_number - 1]
        with its 1-based layer numbers). 0 (Megatron: falsy) skips none."""
        freq = self.no_rope_freq
        if not freq:
            return False
        return (layer + 1) % freq == 0 if isinstance(freq, int) else bool(freq[layer])

    @functools.cached_property  # (the planner asks millions of times a search)
    def hybrid(self) -> bool:
        return bool(
            self.is_hybrid_model
            or self.hybrid_override_pattern is not None
            or self.hybrid_attention_ratio
            or self.hybrid_mlp_ratio
        )

    @functools.cached_property
    def layer_types(self) -> tuple[str, ...]:
        """A hybrid model's layer kinds, Megatron's symbols (models/hybrid_pattern.py)."""
        from megatron_lite.models.hybrid_pattern import layer_types

        return layer_types(self)

    @functools.cached_property
    def heterogeneous_blocks(self) -> tuple | None:
        """Each layer's BlockConfig (models/heterogeneous.py), or None for a homogeneous model."""
        if self.heterogeneous_layers_config_encoded_json is None:
            return None
        from megatron_lite.models.heterogeneous import parse_block_configs

        return parse_block_configs(
            self.heterogeneous_layers_config_encoded_json, self.num_attention_heads, self.hidden_size
        )

    @functools.cached_property
    def _layer_configs(self) -> tuple[ModelConfig, ...]:
        # (Megatron's get_config_for_layer: the model's config with the block's query groups and FFN size)
        return tuple(
            dataclasses.replace(
                self,
                heterogeneous_layers_config_encoded_json=None,
                num_query_groups=self.num_query_groups if b.num_query_groups is None else b.num_query_groups,
                ffn_hidden_size=self.ffn_hidden_size if b.ffn_hidden_size is None else b.ffn_hidden_size,
            )
            for b in self.heterogeneous_blocks
        )

    def layer_config(self, layer: int) -> ModelConfig:
        """The config layer `layer` (0-based) is built with: its own query groups and FFN size in a heterogeneous
        model, else the model's."""
        return self if self.heterogeneous_blocks is None else self._layer_configs[layer]

    @property
    def mamba_heads(self) -> int:
        return self.mamba_num_heads if self.mamba_num_heads is not None else 2 * self.hidden_size // self.mamba_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Layers num_layers.. are the multi-token-prediction layers: the kind of the last decoder layer."""
        if self.num_experts is None:
            return False
        return self._moe_layer_kinds[min(layer, self.num_layers - 1)]

    def __hash__(self) -> int:
        # Hashed once: the planner's caches take the config as a key, and a search's hundreds of thousands of
        # lookups each hashed its hundred fields again (an eighth of a large MoE search's time)
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        # (a string's hash differs between processes: an unpickled copy hashes itself again)
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @functools.cached_property  # (the planner asks millions of times a search)
    def _moe_layer_kinds(self) -> tuple[bool, ...]:
        if self.hybrid:  # (the pattern's E layers)
            return tuple(t == "E" for t in self.layer_types)
        if isinstance(self.moe_layer_freq, int):
            return tuple(i % self.moe_layer_freq == 0 for i in range(self.num_layers))
        return tuple(bool(self.moe_layer_freq[i]) for i in range(self.num_layers))

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Which layers are MoE: --moe-layer-freq 2 and the pattern (1, 0, 1, 0) give the same."""
        return tuple(self.is_moe_layer(i) for i in range(self.num_layers))

    def check_recompute_targets(self) -> None:
        from megatron_lite.models.config_checks import check_recompute_targets

        check_recompute_targets(self)


@dataclass(frozen=True)
class ParallelConfig:
    """How the world is split. Rank order is Megatron's: TP fastest, then CP, DP, PP; the expert grid is
    expert-TP, EP, expert-DP, PP."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # default: same as TP
    virtual_pipeline_model_parallel_size: int | None = None  # model chunks per pipeline rank
    sequence_parallel: bool = False
    decoder_first_pipeline_num_layers: int | None = None  # uneven first stage
    decoder_last_pipeline_num_layers: int | None = None  # uneven last stage
    # --pipeline-model-parallel-layout, parsed: the decoder layers of each virtual stage (chunk * PP + rank)
    pipeline_layout: tuple[int, ...] | None = None
    # Megatron's --account-for-embedding/loss-in-pipeline-split: the embedding / the loss counts as one layer in
    # the even split, so the first / last stage holds one layer fewer
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    cp_comm_type: str = "p2p"  # context-parallel attention: p2p (ring) | a2a (all-to-all) | allgather | a2a+p2p
    # a2a+p2p (Megatron's --hierarchical-context-parallel-sizes A P): all-to-all inside groups of A adjacent CP
    # ranks, a ring over the P groups
    hierarchical_context_parallel_sizes: tuple[int, ...] | None = None
    tp_comm_overlap: bool = False  # sequence-parallel GEMMs as rings overlapping their all-gather/reduce-scatter
    # --disable-tp-comm-overlap-ag / -rs: the column-parallel (all-gather) / row-parallel (reduce-scatter) layers
    # keep their plain collectives under --tp-comm-overlap
    tp_comm_overlap_ag: bool = True
    tp_comm_overlap_rs: bool = True
    overlap_p2p_comm: bool | None = None  # pipeline receives waited on lazily; default: on with virtual stages
    # --microbatch-group-size-per-virtual-pipeline-stage: the interleaved schedule's micro-batches per group
    # through each chunk (default: PP)
    microbatch_group_size: int | None = None
    overlap_moe_expert_parallel_comm: bool = False  # MoE dispatch in chunks, all-to-all under the experts

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def etp(self) -> int:
        e = self.expert_tensor_parallel_size
        return self.tensor_model_parallel_size if e is None else e

    @property
    def vp(self) -> int:
        return self.virtual_pipeline_model_parallel_size or 1

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp * self.cp)

    def expert_data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.etp * self.ep * self.pp)


@dataclass(frozen=True)
class TrainingConfig:
    """Batch geometry, length of the run and its cadences."""

    micro_batch_size: int = 1
    global_batch_size: int | None = None  # default: micro_batch_size x data-parallel size
    seq_length: int = 1024
    train_iters: int = 100
    # Megatron's --train-samples: the run's length in samples; train_iters is then resolved at start-up as
    # train_samples // global batch (resolve_train_iters), once the data-parallel size is known.
    train_samples: int | None = None
    # Megatron's --rampup-batch-size START INCREMENT SAMPLES: the global batch grows from START by INCREMENT
    # in even steps over the first SAMPLES samples, then stays at --global-batch-size (batch_size_at)
    rampup_batch_size: tuple[int, int, int] | None = None
    # not a flag: the samples the checkpoint it resumes had consumed (0 from scratch, or with --finetune): the
    # ramp's batches before them are not run again, so another data-parallel size need not divide them
    resumed_samples: int = 0
    seed: int = 1234
    log_interval: int = 100
    eval_interval: int = 1000
    eval_iters: int = 100
    skip_train: bool = False  # Megatron's --skip-train: evaluate the loaded model on the valid and test sets, exit
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    overlap_grad_reduce: bool = False
    ddp_bucket_size: int | None = None

    def global_batch(self, dp: int) -> int:
        return self.global_batch_size or self.micro_batch_size * dp

    def batch_size_at(self, consumed: int, dp: int) -> int:
        """The global batch of the step that starts after `consumed` samples (Megatron's ramp-up: the batch
        steps up by INCREMENT every SAMPLES / ((final - START) / INCREMENT) samples)."""
        final = self.global_batch(dp)
        if self.rampup_batch_size is None:
            return final
        start, increment, ramp = self.rampup_batch_size
        if consumed > ramp:
            return final
        per_increment = ramp / ((final - start) // increment)
        return start + int(consumed / per_increment) * increment

    def validate_rampup(self, dp: int) -> None:
        if self.rampup_batch_size is None:
            return
        start, increment, ramp = self.rampup_batch_size
        final, unit = self.global_batch(dp), self.micro_batch_size * dp
        flag = f"--rampup-batch-size {start} {increment} {ramp}"
        if not (0 < start < final and increment > 0 and ramp > 0 and (final - start) % increment == 0):
            raise ConfigError(
                f"{flag}: START must be below --global-batch-size {final}, which START + k x INCREMENT must reach, "
                "and SAMPLES must be positive"
            )
        now = self.batch_size_at(self.resumed_samples, dp)  # (a ramp's batches only grow)
        ahead = [(consumed, batch) for consumed, batch in self.rampup_batches(dp) if batch >= now]
        for consumed, batch in ahead:
            if batch % unit:  # (Megatron checks the batch of each step it runs, not START and INCREMENT)
                raise ConfigError(
                    f"{flag}: the ramp's global batch of {batch} samples (after {consumed} samples) is not a "
                    f"multiple of micro-batch x data-parallel size ({unit}); use START and INCREMENT multiples "
                    f"of {unit}"
                )

    def rampup_batches(self, dp: int) -> list[tuple[int, int]]:
        """(samples consumed, global batch) where each batch of the ramp starts, the final batch left out: only
        the batches a step runs. A ramp of few SAMPLES jumps past some of START + k x INCREMENT (Megatron asks
        its calculator at every step), so those need not split into micro-batches."""
        if self.rampup_batch_size is None:
            return []
        start, increment, ramp = self.rampup_batch_size
        final, out, consumed = self.global_batch(dp), [], 0
        per_increment = ramp / ((final - start) // increment)
        while consumed <= ramp and (batch := self.batch_size_at(consumed, dp)) < final:
            if not out or out[-1][1] != batch:
                out.append((consumed, batch))
            # (the steps that stay on this batch, all but the last one or two taken at once: a long ramp of
            # small batches is millions of steps)
            boundary = ((batch - start) // increment + 1) * per_increment
            consumed += max(1, int((boundary - consumed) / batch) - 1) * batch
        return out

    def resolve_train_iters(self, dp: int) -> TrainingConfig:
        """With --train-samples, the iterations it makes at this data-parallel size (Megatron's rule: the
        ramp-up's iterations, then the rest // global batch, the remainder not trained)."""
        if self.train_samples is None:
            return self
        gbs = self.global_batch(dp)
        if self.rampup_batch_size is None and self.train_samples < gbs:
            raise ConfigError(f"--train-samples {self.train_samples} is less than one global batch ({gbs} samples)")
        iters, consumed = self.rampup_iterations(dp)
        return dataclasses.replace(self, train_iters=iters + max(0, self.train_samples - consumed) // gbs)

    def rampup_iterations(self, dp: int) -> tuple[int, int]:
        """(iterations, samples) of a --train-samples run's ramp-up: the steps that start within its SAMPLES
        (Megatron's update_train_iters); (0, 0) without one."""
        iters = consumed = 0
        ramp = self.rampup_batch_size[2] if self.rampup_batch_size else -1
        while consumed <= ramp and consumed <= self.train_samples:
            consumed += self.batch_size_at(consumed, dp)
            iters += 1
        return iters, consumed
