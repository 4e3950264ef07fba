"""LoRA adapters out of megatron_lite: as a PEFT adapter (adapter_model.safetensors + adapter_config.json,
what `PeftModel.from_pretrained` loads onto the Hugging Face base), or merged into the base weights.

Our adapters sit one per Hugging Face projection (q, k, v, o, gate, up, down), so each maps to a PEFT
module one to one: A [r, in] and B [out, r], with the projection's rows in Hugging Face order (our
grouped-QKV layout is only the base weight's).

Routed experts (Mixtral): transformers holds a layer's experts as two 3-D parameters, experts.gate_up_proj
[E, 2I, H] and experts.down_proj [E, H, I], which PEFT adapts through `target_parameters`: one lora_A
[E r, in] whose rows are expert-major (expert e's A is rows e r .. e r + r), and one lora_B [out, r E] whose
columns are rank-major (expert e's column j is column j E + e). Two targets on one module nest: the first
listed (gate_up_proj) becomes the inner `base_layer`."""

from __future__ import annotations

import os
import re

import torch

from megatron_lite.config import ConfigError, ModelConfig
from megatron_lite.lora.config import LoraConfig
from megatron_lite.models.hf import LLAMA_LIKE, MODEL_TYPES
from megatron_lite.models.hf_qwen2moe import QWEN2_MOE
from megatron_lite.models.hf_weights import _group_qkv, mla_rope_rows

# our (layer, adapter) -> the Hugging Face module inside a decoder layer
HF_MODULES = {
    ("self_attention.linear_qkv", "q"): "self_attn.q_proj",
    ("self_attention.linear_qkv", "k"): "self_attn.k_proj",
    ("self_attention.linear_qkv", "v"): "self_attn.v_proj",
    ("self_attention.linear_proj", "proj"): "self_attn.o_proj",
    ("mlp.linear_fc1", "gate"): "mlp.gate_proj",
    ("mlp.linear_fc1", "up"): "mlp.up_proj",
    ("mlp.linear_fc2", "fc2"): "mlp.down_proj",
    ("mlp.linear_fc1", "fc1"): "mlp.up_proj",  # (a non-gated MLP: Nemotron's up_proj)
    ("mlp.shared_expert.linear_fc1", "gate"): "mlp.shared_experts.gate_proj",  # (DeepSeek-V3)
    ("mlp.shared_expert.linear_fc1", "up"): "mlp.shared_experts.up_proj",
    ("mlp.shared_expert.linear_fc2", "fc2"): "mlp.shared_experts.down_proj",
    ("self_attention.linear_q_proj", "q"): "self_attn.q_proj",  # multi-latent attention (DeepSeek-V3)
    ("self_attention.linear_q_down_proj", "q_down"): "self_attn.q_a_proj",
    ("self_attention.linear_q_up_proj", "q_up"): "self_attn.q_b_proj",
    ("self_attention.linear_kv_down_proj", "kv_down"): "self_attn.kv_a_proj_with_mqa",
    ("self_attention.linear_kv_up_proj", "kv_up"): "self_attn.kv_b_proj",
}
_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)\.lora\.pairs\.(\w+)\.(A|B)$")
_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(linear_fc1|linear_fc2)\.lora\.pairs\.\w+\.(A|B)$")
# our expert weight -> (PEFT target parameter, its adapter's prefix inside the experts module where both are
# adapted: PEFT wraps the module once per target parameter, the first innermost; one alone is not nested)
HF_EXPERT_PARAMS = {"linear_fc1": ("experts.gate_up_proj", "base_layer."), "linear_fc2": ("experts.down_proj", "")}


# Classes whose MLP targets PEFT may convert onto fused expert parameters (its transformers weight conversions:
# qwen2_moe's pattern, which DeepSeek, Qwen3-MoE and GLM-4-MoE use): what the export assumes without PEFT.
# PEFT 0.21 with transformers 5.25 leaves Qwen2-MoE's own targets alone (no model_type maps to itself there).
FUSED_EXPERT_CONVERSIONS = (
    "DeepseekV3ForCausalLM",
    "DeepseekV2ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "Glm4MoeForCausalLM",
)


def peft_moves_mlp_targets(arch: str) -> bool:
    """Whether PEFT, loading an adapter onto `arch`, turns gate_proj/up_proj/down_proj targets into the routed
    experts' fused parameters, so that dense and shared-expert adapters would land there. The installed PEFT's
    own tables say; without them (no PEFT, transformers 4, or tables renamed) the classes it may convert."""
    try:
        from peft.utils.transformers_weight_conversion import _MODEL_TO_CONVERSION_PATTERN, _MOE_TARGET_MODULE_MAPPING
    except Exception:
        return arch in FUSED_EXPERT_CONVERSIONS
    pattern = _MODEL_TO_CONVERSION_PATTERN.get(MODEL_TYPES.get(arch))
    return bool({"gate_proj", "up_proj", "down_proj"} & set(_MOE_TARGET_MODULE_MAPPING.get(pattern) or ()))


# MLA projections whose output holds RoPE dims
_ROPE_ROWS = ("self_attention.linear_q_proj", "self_attention.linear_q_up_proj", "self_attention.linear_kv_down_proj")


def _rope_rows_of(module: str, c: ModelConfig) -> torch.Tensor:
    """Row order from ours to DeepSeek's interleaved RoPE rows (rope_interleave=true, as our export writes)."""
    q_rows, kv_rows = mla_rope_rows(c, inverse=True)
    return kv_rows if module.endswith("kv_down_proj") else q_rows


def split_lora(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base weights, adapter weights) of a full state dict."""
    lora = {k: v for k, v in state.items() if ".lora." in k}
    return {k: v for k, v in state.items() if k not in lora}, lora


def to_peft(
    lora_state: dict[str, torch.Tensor], config: ModelConfig, lora: LoraConfig, arch: str, rope_interleave: bool = True
) -> tuple[dict[str, torch.Tensor], dict]:
    """PEFT's tensors and adapter_config.json for our adapters. `rope_interleave`: the base's DeepSeek RoPE row
    layout (its config.json's flag; false keeps our rotate-half rows)."""
    if arch not in LLAMA_LIKE or arch == "Phi3ForCausalLM":
        raise ConfigError(
            f"--saver hf-peft supports Llama-like models (separate q/k/v projections), not {arch}; export merged "
            "weights with --saver hf --merge-lora"
        )
    mlp = sorted({k.split(".lora.")[0] for k in lora_state if ".mlp." in k and ".mlp.experts." not in k})
    if mlp and peft_moves_mlp_targets(arch):
        # PEFT rewrites gate_proj / up_proj / down_proj targets of a model with fused experts into the routed
        # experts' parameters: the dense and shared-expert adapters would land on the experts instead.
        raise ConfigError(
            f"--saver hf-peft: PEFT cannot target {arch}'s dense or shared-expert MLPs ({mlp[0]}, ...): it "
            "maps gate_proj/up_proj/down_proj to the routed experts; export merged weights with --saver hf "
            "--merge-lora, or adapt attention and experts only (--lora-target-modules linear_qkv linear_proj experts)"
        )
    experts = sorted({k.split(".lora.")[0] for k in lora_state if ".mlp.experts." in k})
    if arch == "GptOssForCausalLM" and experts:  # (their PEFT layout is not Mixtral's, which the map below writes)
        raise ConfigError(
            f"--saver hf-peft: gpt-oss's experts hold gate_up_proj as [experts, hidden, 2 x ffn] with gate and up "
            f"interleaved, which the adapters on {experts[0]}, ... are not mapped onto; export merged weights with "
            "--saver hf --merge-lora, or adapt attention only (--lora-target-modules linear_qkv linear_proj)"
        )
    feed_forward = sorted({k.split(".lora.")[0] for k in lora_state if ".mlp." in k})
    if arch == "Llama4ForCausalLM" and feed_forward:  # (its MLPs are feed_forward.*, the experts [E, in, out])
        raise ConfigError(
            f"--saver hf-peft: the adapters on {feed_forward[0]}, ... are not mapped onto Llama 4's feed_forward "
            "modules; export merged weights with --saver hf --merge-lora, or adapt attention only "
            "(--lora-target-modules linear_qkv linear_proj)"
        )
    mtp = sorted(k for k in lora_state if k.startswith("mtp."))
    if mtp:
        raise ConfigError(
            f"--saver hf-peft: transformers' {arch} has no multi-token-prediction layers for the adapters on "
            f"{mtp[0].split('.lora.')[0]}, ...; export merged weights with --saver hf --merge-lora"
        )
    tensors, modules = {}, set()
    experts: dict[tuple[int, str, str], dict[int, torch.Tensor]] = {}
    for key, value in lora_state.items():
        e = _EXPERT.match(key)
        if e is not None:
            experts.setdefault((int(e.group(1)), e.group(3), e.group(4)), {})[int(e.group(2))] = value
            continue
        m = _KEY.match(key)
        if m is None or (m.group(2), m.group(3)) not in HF_MODULES:
            raise ConfigError(f"{key} is not a LoRA adapter of a projection PEFT knows")
        layer, hf = m.group(1), HF_MODULES[(m.group(2), m.group(3))]
        if arch == QWEN2_MOE:  # (one shared expert module, not DeepSeek's shared_experts)
            hf = hf.replace("mlp.shared_experts.", "mlp.shared_expert.")
        modules.add(hf.split(".")[-1])
        if m.group(4) == "B" and m.group(2) in _ROPE_ROWS and rope_interleave:  # B's rows: the base's RoPE order
            value = value[_rope_rows_of(m.group(2), config)]
        tensors[f"base_model.model.model.layers.{layer}.{hf}.lora_{m.group(4)}.weight"] = value.contiguous()
    for (layer, ours, which), per_expert in experts.items():
        stacked = [per_expert[e] for e in range(config.num_experts)]
        if which == "A":  # [E r, in], expert-major rows
            value = torch.cat(stacked, dim=0)
        else:  # [out, r E], column j E + e = expert e's column j
            value = torch.stack(stacked, dim=2).reshape(stacked[0].shape[0], -1)
        both = all((layer, w, which) in experts for w in HF_EXPERT_PARAMS)
        prefix = HF_EXPERT_PARAMS[ours][1] if both else ""
        tensors[f"base_model.model.model.layers.{layer}.mlp.experts.{prefix}lora_{which}.weight"] = value.contiguous()
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        # PEFT refuses dropout on expert parameters (ParamWrapper); dropout changes no output at inference
        "lora_dropout": 0.0 if experts else lora.dropout,
        "target_modules": sorted(modules),
        "target_parameters": [HF_EXPERT_PARAMS[w][0] for w in HF_EXPERT_PARAMS if any(k[1] == w for k in experts)],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "base_model_name_or_path": None,
        "inference_mode": True,
    }
    return tensors, adapter_config


def write_peft(directory: str, tensors: dict[str, torch.Tensor], adapter_config: dict) -> None:
    from safetensors.torch import save_file

    from megatron_lite.checkpoint.atomic import atomic_write, atomic_write_json

    os.makedirs(directory, exist_ok=True)  # (each file whole or absent: a cut-short export is never half a file)
    atomic_write(os.path.join(directory, "adapter_model.safetensors"),
                 lambda path: save_file(tensors, path, metadata={"format": "pt"}))  # fmt: skip
    atomic_write_json(os.path.join(directory, "adapter_config.json"), adapter_config)


def merge(state: dict[str, torch.Tensor], config: ModelConfig, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """Base weights with every adapter folded in, W + (alpha / r) B A, in our layout (no LoRA keys left). Each
    adapted weight's pairs are placed as its layer lays them out: q, k and v into the grouped QKV rows, gate
    and up stacked (dense and shared-expert fc1), a single pair as is (a routed expert's fc1 covers both)."""
    base, adapters = split_lora(state)
    merged = {k: v.clone() for k, v in base.items()}
    scale = lora.alpha / lora.rank
    deltas: dict[str, dict[str, torch.Tensor]] = {}  # adapted layer -> {pair: scaled B A}
    for key, a in adapters.items():
        if key.endswith(".A"):
            layer, pair = key[: -len(".A")].split(".lora.pairs.")
            deltas.setdefault(layer, {})[pair] = scale * (adapters[key[:-1] + "B"].float() @ a.float())
    for layer, d in deltas.items():
        some = next(iter(d.values()))
        if layer.endswith(".linear_qkv"):  # (a part not adapted adds nothing: zeros of its rows)
            rows = {"q": config.num_attention_heads * config.head_dim, "k": config.query_groups * config.head_dim}
            q, k, v = (d.get(n, some.new_zeros(rows.get(n, rows["k"]), some.shape[1])) for n in "qkv")
            delta = _group_qkv(q, k, v, config.query_groups)
        elif set(d) <= {"gate", "up"} and layer.endswith("linear_fc1"):
            delta = torch.cat([d.get("gate", torch.zeros_like(some)), d.get("up", torch.zeros_like(some))])
        elif len(d) == 1:
            delta = next(iter(d.values()))
        else:
            raise ConfigError(f"{layer}: adapters {sorted(d)} do not make one weight's update")
        key = f"{layer}.weight"
        merged[key] = merged[key] + delta.to(merged[key].dtype)
    return merged
