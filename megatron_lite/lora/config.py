"""LoRA settings (--lora-rank, --lora-alpha, --lora-dropout, --lora-target-modules)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_lite.config import ConfigError

# Our layer names and the Hugging Face projections they hold (PEFT's target_modules). A fused layer's parts
# are targets of their own (Megatron-Bridge's canonical names): PEFT's q_proj v_proj adapt q and v, not k.
# `experts`: every routed expert's fc1 and fc2, which PEFT adapts as the 3-D parameters experts.gate_up_proj
# and experts.down_proj (its target_parameters), one adapter per expert; experts_fc1 / experts_fc2 one of the two
# (PEFT's gate_up_proj names experts_fc1 alone; its experts.down_proj has no module name of its own here, as
# down_proj names the dense MLP's linear_fc2).
TARGETS = {
    "linear_qkv": (),  # q, k and v
    "linear_q": ("q_proj",),
    "linear_k": ("k_proj",),
    "linear_v": ("v_proj",),
    "linear_proj": ("o_proj",),
    "linear_fc1": (),  # gate and up (SwiGLU), or the one fc1
    "linear_fc1_gate": ("gate_proj",),
    "linear_fc1_up": ("up_proj",),
    "linear_fc2": ("down_proj",),
    "experts": (),  # fc1 and fc2
    "experts_fc1": ("gate_up_proj",),
    "experts_fc2": (),
    # multi-latent attention (DeepSeek-V3): the query projection or its latent's two, the key/value latent's two
    "linear_q_proj": (),  # (PEFT's q_proj names linear_qkv; on an MLA model linear_qkv means these projections)
    "linear_q_down_proj": ("q_a_proj",),
    "linear_q_up_proj": ("q_b_proj",),
    "linear_kv_down_proj": ("kv_a_proj_with_mqa",),
    "linear_kv_up_proj": ("kv_b_proj",),
}
# a fused layer -> its parts as targets, and the names of its adapters
PARTS = {"linear_qkv": {"linear_q": "q", "linear_k": "k", "linear_v": "v"},
         "linear_fc1": {"linear_fc1_gate": "gate", "linear_fc1_up": "up"},
         "experts": {"experts_fc1": "fc1", "experts_fc2": "fc2"}}  # fmt: skip
EXPERT_TARGETS = ("experts", *PARTS["experts"])
MLP_TARGETS = ("linear_fc1", "linear_fc2", *PARTS["linear_fc1"])  # (a dense MLP's or a shared expert's)
MLA_TARGETS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
DENSE_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DENSE_TARGETS
    qlora: bool = False  # the adapted layers' frozen weights stored in NF4 (4.127 bits per parameter)
    # the base checkpoint the adapters were trained on (recorded): its checkpoints then hold the adapters alone
    base: str | None = None
    base_fingerprint: str | None = None  # (lora_base.checkpoint_fingerprint of that base, when recorded)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"--lora-rank {self.rank} must be >= 1")
        if not self.alpha > 0:  # (0: the adapters add nothing and get no gradient; < 0 flips their sign)
            raise ConfigError(f"--lora-alpha {self.alpha:g} must be > 0 (the adapters are scaled by alpha / rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"--lora-dropout {self.dropout} must be in [0, 1)")
        bad = [t for t in self.target_modules if t not in TARGETS]
        if bad:
            raise ConfigError(f"--lora-target-modules {' '.join(bad)}: choose from {' '.join(TARGETS)}")

    def validate(
        self,
        num_experts: int | None,
        tp_comm_overlap: bool,
        multi_latent_attention: bool = False,
        q_lora=None,
        dense_mlp: bool = True,
    ) -> None:
        """What LoRA does not compose with yet, and targets the model does not have; checked with the flags,
        before any collective. `dense_mlp`: some layer has linear_fc1 / linear_fc2 (a dense MLP or a shared
        expert)."""
        present = [t for t in self.target_modules if dense_mlp or t not in MLP_TARGETS]
        if not present:  # (PEFT: "Target modules ... not found in the base model")
            raise ConfigError(
                f"--lora-target-modules {' '.join(self.target_modules)}: every layer is MoE without a shared "
                "expert, so no layer has these; adapt experts and/or the attention (linear_qkv linear_proj)"
            )
        mla = [t for t in self.target_modules if t in MLA_TARGETS]
        if mla and not multi_latent_attention:
            raise ConfigError(f"--lora-target-modules {' '.join(mla)}: projections of --multi-latent-attention; "
                              "this model has linear_qkv")  # fmt: skip
        if multi_latent_attention and q_lora is not None:
            absent = ("linear_q_proj",) if q_lora else ("linear_q_down_proj", "linear_q_up_proj")
            bad = [t for t in self.target_modules if t in absent]
            if bad:
                raise ConfigError(f"--lora-target-modules {' '.join(bad)}: this model has "
                                  f"{'a' if q_lora else 'no'} query latent (--q-lora-rank)")  # fmt: skip
        if multi_latent_attention and any(t in self.target_modules for t in ("linear_qkv", *PARTS["linear_qkv"])):
            raise ConfigError("--lora-target-modules linear_qkv: a --multi-latent-attention model has "
                              f"{' '.join(MLA_TARGETS)} instead")  # fmt: skip
        if named := [t for t in self.target_modules if t in EXPERT_TARGETS]:
            if not num_experts:
                raise ConfigError(f"--lora-target-modules {named[0]}: the model has no experts; add --num-experts or "
                                  f"drop {named[0]}")  # fmt: skip
        if tp_comm_overlap:
            raise ConfigError("--lora-rank with --tp-comm-overlap is not supported yet; drop --tp-comm-overlap")


def has_dense_mlp(config) -> bool:
    """Whether some decoder layer has linear_fc1 / linear_fc2: a dense MLP, or an MoE layer's shared expert."""
    return not all(config.moe_layers) or config.moe_shared_expert_intermediate_size is not None


def target_modules(names: list[str]) -> tuple[str, ...]:
    """Our target names from ours or PEFT's (q_proj -> linear_q, ...), each projection adapted only when named;
    all parts of a fused layer are that layer's name (q_proj k_proj v_proj -> linear_qkv)."""
    out = []
    for name in names:
        ours = name if name in TARGETS else next((t for t, hf in TARGETS.items() if name in hf), None)
        if ours is None:
            known = " ".join(dict.fromkeys(list(TARGETS) + [h for hs in TARGETS.values() for h in hs]))
            raise ConfigError(f"--lora-target-modules {name}: choose from {known}")
        if ours not in out:
            out.append(ours)
    for fused, parts in PARTS.items():
        if fused in out or set(parts) <= set(out):
            at = min(out.index(t) for t in (fused, *parts) if t in out)
            out = [t for t in out if t not in parts and t != fused]
            out.insert(at, fused)
    return tuple(out)


def layer_parts(lora: LoraConfig, layer: str) -> tuple[str, ...] | None:
    """The adapters `lora` puts on fused layer `layer` (linear_qkv, linear_fc1; experts: each expert's fc1 and
    fc2): all of them when the layer is a target, the named parts, or None."""
    if layer in lora.target_modules:
        return tuple(PARTS[layer].values())
    named = tuple(a for t, a in PARTS[layer].items() if t in lora.target_modules)
    return named or None


def lora_for_model(lora: LoraConfig, config) -> LoraConfig:
    """On a multi-latent attention model, linear_qkv (the default target) means its attention input projections:
    the query projection (or its latent's two) and the key/value latent's two; linear_q (PEFT's q_proj) the query
    projection(s) alone; linear_k / linear_v are refused (keys and values come from one latent). Without SwiGLU,
    fc1 is one projection: linear_fc1_up (PEFT's up_proj, Nemotron's
    fc1) is linear_fc1, and its gate refused."""
    if getattr(config, "hybrid", False) and "M" in config.layer_types:  # (getattr: a Namespace)
        raise ConfigError(
            f"--lora-rank {lora.rank} with Mamba layers is not supported: adapters go on the attention and MLP "
            "linears only, and the Mamba mixers (in_proj, out_proj) would stay frozen; train the model whole"
        )
    if getattr(config, "heterogeneous_layers_config_encoded_json", None) is not None:
        raise ConfigError(
            f"--lora-rank {lora.rank} with heterogeneous layers (--heterogeneous-layers-config-path) is not supported: "
            "adapters are laid out by the model's query groups and FFN size, not each layer's; train the whole model"
        )
    if getattr(config, "qk_clip", False):  # (getattr: a Namespace)
        raise ConfigError(
            f"--qk-clip with --lora-rank {lora.rank} is not supported: the clip scales the QKV weight, which LoRA "
            "freezes (the adapters would not see it); use --log-max-attention-logit to watch the logits"
        )
    targets = list(lora.target_modules)
    if config.activation not in ("swiglu", "quick_geglu") and any(t in targets for t in PARTS["linear_fc1"]):
        if "linear_fc1_gate" in targets:
            raise ConfigError(
                f"--lora-target-modules gate_proj (linear_fc1_gate): this model's MLP ({config.activation}) has no "
                "gate; its fc1 is one projection (linear_fc1, PEFT's up_proj)"
            )
        targets[targets.index("linear_fc1_up")] = "linear_fc1"
    qkv = ("linear_qkv", *PARTS["linear_qkv"])
    if getattr(config, "attention_output_gate", False) and any(t in targets for t in qkv):  # (getattr: a Namespace)
        raise ConfigError(
            "--lora-target-modules linear_qkv with --attention-output-gate is not supported yet (the adapter's rows "
            "do not lay out the gate's); adapt linear_proj and the MLP"
        )
    if config.multi_latent_attention and any(t in targets for t in qkv):
        q = ("linear_q_proj",) if config.q_lora_rank is None else ("linear_q_down_proj", "linear_q_up_proj")
        kv = ("linear_kv_down_proj", "linear_kv_up_proj")
        if "linear_qkv" not in targets and any(t in targets for t in ("linear_k", "linear_v")):
            raise ConfigError(
                "--lora-target-modules k_proj / v_proj (linear_k / linear_v): a --multi-latent-attention model makes "
                "keys and values from one latent; adapt linear_kv_down_proj linear_kv_up_proj (PEFT's "
                "kv_a_proj_with_mqa kv_b_proj)"
            )
        mla = (*q, *kv) if "linear_qkv" in targets else q  # (q_proj alone: the query projection(s) alone)
        targets = [t for t in targets if t not in qkv] + [t for t in mla if t not in targets]
    return dataclasses.replace(lora, target_modules=tuple(dict.fromkeys(targets)))


def adapted_targets(lora: LoraConfig, config) -> tuple[list[str], list[str]]:
    """(the targets that adapt some layer, those that adapt none): an all-MoE model without a shared expert
    has no dense MLP for linear_fc1 / linear_fc2 (Megatron-Bridge would match them to the experts; here
    `experts` names those)."""
    lora = lora_for_model(lora, config)
    absent = [] if has_dense_mlp(config) else [t for t in lora.target_modules if t in MLP_TARGETS]
    return [t for t in lora.target_modules if t not in absent], absent
