"""What a checkpoint must agree with before it is loaded: the model's shape (loading reads only the tensors the
model asks for, so another shape would load in part, or wrongly), the kind of optimizer state, and the LoRA
adapters it holds; and that it is ours at all (a Megatron-LM checkpoint looks like a broken one of ours). Each
disagreement is one line naming the flag."""

from __future__ import annotations

import dataclasses
import glob
import os

from megatron_lite.config import ConfigError, ModelConfig, RopeScaling
from megatron_lite.models.heterogeneous import first_block_difference
from megatron_lite.optimizer.optimizer import state_kinds
from megatron_lite.parameters import named_param_meta


def model_config_from_dict(d: dict) -> ModelConfig:
    """A ModelConfig from the `model` section of a checkpoint's metadata."""
    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    for key, value in d.items():  # (JSON's lists: the config's tuples, so that it hashes as the flags' does)
        if isinstance(value, list):
            d[key] = tuple(tuple(v) if isinstance(v, list) else v for v in value)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in d.items() if k in known})


# Model settings that decide which tensors a model has, and how they are read. Loading only ever reads the
# tensors the model asks for, so a checkpoint of another shape of model would load in part (a checkpoint's
# q/k norms, biases or extra layers left unread) or be read wrongly (norms stored as gamma - 1): refused.
STRUCTURE = {
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "query_groups": "--num-query-groups",
    "head_dim": "--kv-channels",
    "ffn_size": "--ffn-hidden-size",
    # (gelu and squared ReLU have the same shapes; GELU with biases is tanh-approximated unless --no-bias-gelu-fusion)
    "activation": "--swiglu / --squared-relu / --openai-gelu / --no-bias-gelu-fusion",
    "normalization": "--normalization",
    "apply_layernorm_1p": "--apply-layernorm-1p",
    "add_bias_linear": "--disable-bias-linear",
    "add_qkv_bias": "--add-qkv-bias",
    "qk_layernorm": "--qk-layernorm",
    "softmax_type": "--softmax-type",  # (learnable: a softmax_offset per layer)
    "attention_output_gate": "--attention-output-gate",  # (gate rows inside linear_qkv's query groups)
    "multi_latent_attention": "--multi-latent-attention",
    "q_lora_rank": "--q-lora-rank",
    "kv_lora_rank": "--kv-lora-rank",
    "qk_head_dim": "--qk-head-dim",
    "qk_pos_emb_head_dim": "--qk-pos-emb-head-dim",
    "v_head_dim": "--v-head-dim",
    "position_embedding_type": "--position-embedding-type",
    "tied_embeddings": "--untie-embeddings-and-output-weights",
    "num_experts": "--num-experts",
    "moe_layers": "--moe-layer-freq",
    "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
    "moe_shared_expert_gate": "--moe-shared-expert-gate",
    "moe_ffn_size": "--moe-ffn-hidden-size",
    "mtp_num_layers": "--mtp-num-layers",
    "heterogeneous_blocks": "--heterogeneous-layers-config-path",  # (each layer's own kinds and sizes)
    "vocab_size": "--vocab-size (or the tokenizer's)",
}


def check_model_structure(path: str, meta: dict, model) -> None:
    saved = (meta.get("config") or {}).get("model") or {}
    config = getattr(model, "config", None) or getattr(next(iter(model), None), "config", None)
    if not {"num_layers", "hidden_size", "num_attention_heads"} <= saved.keys() or not isinstance(config, ModelConfig):
        return  # a checkpoint that does not say (written by hand), or a model that does not
    theirs = model_config_from_dict(saved)
    for field, flag in STRUCTURE.items():
        a, b = getattr(theirs, field), getattr(config, field)
        if field == "head_dim" and theirs.multi_latent_attention and config.multi_latent_attention:
            continue  # (multi-latent attention does not read --kv-channels)
        if field == "heterogeneous_blocks":  # (the first layer built otherwise, not both lists of blocks)
            if (difference := first_block_difference(theirs, config)) is not None:
                raise ConfigError(
                    f"{path} holds other layers ({difference}): give {flag} the checkpoint's block configs (or pass "
                    "--use-checkpoint-args), or load another checkpoint"
                )
            continue
        if a != b:
            raise ConfigError(
                f"{path} holds a model with {field}={a!r}; this run builds {field}={b!r}: set {flag} as the "
                "checkpoint has it (or pass --use-checkpoint-args), or load another checkpoint"
            )


def check_optimizer_state(path: str, meta: dict, config) -> None:
    """The checkpoint holds the optimizer state this run would load: some (not --no-save-optim past iteration
    0), and of the same kind (Adam's moments, SGD's momentum buffer or nothing)."""
    if meta.get("optimizer_saved") is False:
        if int(meta["iteration"]) > 0:  # (a converted or base checkpoint at iteration 0 starts fresh anyway)
            raise ConfigError(
                f"{path} was saved with --no-save-optim: it holds no optimizer state or LR schedule; add "
                "--no-load-optim to go on from its weights with fresh optimizer state and LR schedule, or "
                "--finetune to start over from them"
            )
        return
    saved = (meta.get("config") or {}).get("optimizer")
    if not saved:  # a checkpoint that does not say
        return
    saved_config = dataclasses.replace(
        config, optimizer=saved.get("optimizer", "adam"), sgd_momentum=saved.get("sgd_momentum", 0.9)
    )
    if state_kinds(saved_config) != state_kinds(config):
        describe = {
            ("exp_avg", "exp_avg_sq"): "Adam moments",
            ("momentum_buffer",): "SGD momentum",
            ("exp_avg", "exp_avg_sq", "momentum_buffer"): "Muon momentum and Adam moments",
            (): "no state",
        }
        raise ConfigError(
            f"{path} holds {describe[state_kinds(saved_config)]} (--optimizer {saved_config.optimizer}); this run "
            f"keeps {describe[state_kinds(config)]} (--optimizer {config.optimizer}): add --no-load-optim to start "
            "the optimizer state fresh from these weights"
        )


def check_adapters_have_a_home(path: str, reader, model) -> None:
    """Every LoRA adapter the checkpoint holds on a layer this model holds is one the model has: loading reads
    only what the model asks for, so a model without LoRA, or with fewer --lora-target-modules, would drop
    trained adapters without a word."""
    names = {f"model/{model.global_name(n)}" for n, _, _ in named_param_meta(model)}
    layers = {n.rsplit(".", 1)[0] for n in names if ".lora." not in n}
    dropped = sorted(k for k in reader.index if ".lora." in k and k.split(".lora.")[0] in layers and k not in names)
    if not dropped:
        return
    if not any(".lora." in n for n in names):
        raise ConfigError(
            f"{path} holds LoRA adapters ({dropped[0]}, ...) and this model has none: rebuild them with the "
            "checkpoint's --lora-rank, or fold them into the weights first (tools/checkpoint/convert.py --saver hf "
            "--merge-lora)"
        )
    raise ConfigError(
        f"{path} holds LoRA adapters this run does not build ({dropped[0]}, ...): give the checkpoint's "
        "--lora-target-modules (or drop the flag to take them from it)"
    )


def megatron_lm(what: str | None, path: str) -> None:
    """A Megatron-LM checkpoint (its torch_dist shards and common.pt, or the legacy mp_rank_* pickles) is one
    line that says so: it shares the tracker file and iteration names, so it had read as a broken one of ours."""
    kind = (
        "torch_dist"
        if glob.glob(os.path.join(path, "*.distcp")) or os.path.isfile(os.path.join(path, "common.pt"))
        else "legacy torch"
        if glob.glob(os.path.join(path, "mp_rank_*"))
        else None
    )
    if kind is not None:
        raise ConfigError(
            f"{what + ': ' if what else ''}{path} is a Megatron-LM checkpoint ({kind} format), which megatron_lite "
            "does not read (its "
            "pickles are not loaded); convert it to Hugging Face with Megatron-LM's tools, then "
            "tools/checkpoint/convert.py --loader hf --saver megatron_lite"
        )
