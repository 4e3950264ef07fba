"""The flag values a checkpoint carries: `pretrain_gpt.py --load DIR` alone rebuilds the run that wrote it.

`flags_from_checkpoint` (called by arguments.parse_args) takes these as defaults for flags not given, refuses an
explicit flag that would change the weights' architecture (ARCH_DESTS) unless --use-checkpoint-args, and notes
schedule flags that differ from the checkpoint's.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Sequence

from megatron_lite.config import ConfigError, yarn_mscale
from megatron_lite.data.config import TOKENIZER_FIELDS
from megatron_lite.flag_help import off_switch
from megatron_lite.flag_values import heterogeneous_json
from megatron_lite.models.heterogeneous import check_given_blocks
from megatron_lite.schedule_flags import RUN_LENGTH, global_batch, in_other_unit, schedule_notes

SHARDING = (
    "use_distributed_optimizer",
    "zero_stage",
    "use_torch_fsdp2",
    "torch_fsdp2_reshard_after_forward",
    "overlap_param_gather",
)

# Flags whose value defines the weights: given explicitly with a different value than the checkpoint's, they
# are an error unless --use-checkpoint-args (then the checkpoint's value wins). Not --make-vocab-size-divisible-by:
# padding rows are never stored and masked out of the softmax, so it is a layout setting like TP (a Megatron
# script's 1187, which pads Qwen3's tokenizer to its 151936 rows, stopped on a converted checkpoint's 128).
ARCH_DESTS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "group_query_attention",
    "num_query_groups",
    "kv_channels",
    "max_position_embeddings",
    "normalization",
    "norm_epsilon",
    "apply_layernorm_1p",
    "apply_residual_connection_post_layernorm",  # (no tensor changes, the math does)
    "swiglu",
    "openai_gelu",
    "no_bias_gelu_fusion",
    "squared_relu",
    "quick_geglu",
    "glu_linear_offset",
    "activation_func_clamp_value",
    "rotary_percent",
    "rotary_interleaved",
    "position_embedding_type",
    "rotary_base",
    "use_rope_scaling",
    "rope_scaling_factor",
    "window_size",
    "window_attn_skip_freq",
    "softmax_type",
    "no_rope_freq",
    "qk_l2_norm",
    "qk_l2_norm_rope_only",
    "attention_chunk_size",
    "attn_temperature_floor_scale",
    "attn_temperature_scale",
    "attention_output_gate",
    "untie_embeddings_and_output_weights",
    "disable_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rotary_scaling_factor",
    "mscale_all_dim",
    "mtp_num_layers",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_router_enable_expert_bias",
    "moe_router_group_score_topn",
    *(HYBRID := ("is_hybrid_model", "hybrid_attention_ratio", "hybrid_mlp_ratio", "hybrid_override_pattern")),
    *(MAMBA := ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads")),
    # (Megatron keeps the block configs' text in its checkpoints too; they are compared as blocks, the path's file
    # as the text it gives)
    *(HETEROGENEOUS := ("heterogeneous_layers_config_encoded_json", "heterogeneous_layers_config_path")),
)

# The architecture flags in which an upcycled MoE run differs from the dense checkpoint it starts from
UPCYCLED_DESTS = ("ffn_hidden_size", *(d for d in ARCH_DESTS if d == "num_experts" or d.startswith("moe_")))

# fp8's flags: a precision given (--bf16, --fp16) without --fp8-format replaces the checkpoint's fp8 too. The first
# are ModelConfig's fields of the same names; the others its fp8_wgrad and fp8_bf16_layers
FP8_FIELDS = ("fp8", "fp8_recipe", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo")
FP8_DESTS = (*FP8_FIELDS, "no_fp8_wgrad", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
             "num_layers_at_end_in_bf16")  # fmt: skip

# What --finetune takes from the checkpoint besides ARCH_DESTS: what else makes the model compute what it was
# trained to (its routing, RoPE, tokenizer, adapters). Megatron's --finetune reads no flag from a checkpoint; the
# schedule, optimizer, batch, seed, dropout and data are the flags' (and their defaults) here too.
FINETUNE_KEEPS = (
    "rope_scaling_params",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_topk_scaling_factor",
    "moe_apply_probs_on_input",  # (where the weight applies is the function; jitter is a regulariser, as dropout)
    "moe_layer_freq",
    *TOKENIZER_FIELDS,
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "qlora",
)


def defaults_from_checkpoint(saved: dict) -> dict:
    """Flag values (argparse dests) of the job that wrote a checkpoint: the model, data, batch, schedule and
    optimizer settings. The layout, logging and checkpoint flags are not taken over."""
    m, t, o, d = saved["model"], saved["training"], saved["optimizer"], saved["data"]
    out = {
        k: m[k]
        for k in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "kv_channels",
            "max_position_embeddings",
            "normalization",
            "norm_epsilon",
            "position_embedding_type",
            "rotary_base",
            "add_qkv_bias",
            "untie_embeddings_and_output_weights",
            "make_vocab_size_divisible_by",
            "init_method_std",
            "hidden_dropout",
            "attention_dropout",
        )
    }
    out["apply_layernorm_1p"] = m.get("apply_layernorm_1p", False)
    out["apply_residual_connection_post_layernorm"] = m.get("apply_residual_connection_post_layernorm", False)
    out["qk_layernorm"] = m.get("qk_layernorm", False)  # (absent from older checkpoints)
    for k, default in (
        ("multi_latent_attention", False),
        ("q_lora_rank", None),
        ("kv_lora_rank", 32),
        ("qk_head_dim", 128),
        ("qk_pos_emb_head_dim", 64),
        ("v_head_dim", 128),
    ):
        out[k] = m.get(k, default)
    out["mscale_all_dim"] = m.get("mla_mscale_all_dim", 0.0)
    out["mtp_num_layers"] = m.get("mtp_num_layers", 0)  # (absent from older checkpoints)
    out["mtp_loss_scaling_factor"] = m.get("mtp_loss_scaling_factor", 0.1)
    rs = m["rope_scaling"]
    mla_yarn = m.get("multi_latent_attention") and rs is not None and rs.get("rope_type") == "yarn"
    out["rotary_scaling_factor"] = rs["factor"] if mla_yarn else 1.0
    out["group_query_attention"] = m["num_query_groups"] is not None
    out["num_query_groups"] = m["num_query_groups"] if m["num_query_groups"] is not None else 1
    out["swiglu"] = m["activation"] == "swiglu"
    out["openai_gelu"] = m["activation"] == "gelu_tanh"
    out["no_bias_gelu_fusion"] = m["activation"] == "gelu" and m["add_bias_linear"]  # (exact GELU with biases)
    out["squared_relu"] = m["activation"] == "squared_relu"
    out["quick_geglu"] = m["activation"] == "quick_geglu"
    out["glu_linear_offset"] = m.get("glu_linear_offset", 0.0)  # (absent from older checkpoints)
    out["activation_func_clamp_value"] = m.get("activation_func_clamp_value")
    out["rotary_percent"] = m.get("rotary_percent", 1.0)
    out["rotary_interleaved"] = m.get("rotary_interleaved", False)  # (Llama 4's: a resume rotated halves instead)
    out["use_rope_scaling"] = m["rope_scaling"] is not None and not m.get("multi_latent_attention")
    if m["rope_scaling"] is not None:
        out["rope_scaling_factor"] = m["rope_scaling"]["factor"]
        out["rope_scaling_params"] = m["rope_scaling"]
    out["window_size"] = m.get("sliding_window")
    freq = m.get("window_attn_skip_freq")  # (absent from older checkpoints; a pattern as the flag reads it)
    out["window_attn_skip_freq"] = tuple(freq) if isinstance(freq, list) else freq
    freq = m.get("no_rope_freq")  # (likewise, and the next two)
    out["no_rope_freq"] = tuple(freq) if isinstance(freq, list) else freq
    out["qk_l2_norm"] = m.get("qk_l2_norm", False)
    out["qk_l2_norm_rope_only"] = m.get("qk_l2_norm_rope_only", False)  # (Llama 4's, and the next three)
    out["attention_chunk_size"] = m.get("attention_chunk_size")
    out["attn_temperature_floor_scale"] = m.get("attn_temperature_floor_scale")
    out["attn_temperature_scale"] = m.get("attn_temperature_scale", 0.1)
    out["attention_output_gate"] = m.get("attention_output_gate", False)
    out["softmax_type"] = m.get("softmax_type", "vanilla")
    out["disable_bias_linear"] = not m["add_bias_linear"]
    # the run's precision and training behaviour, not its weights (a resume dropped them without a word: fp8's
    # amax histories ignored, an fp32 residual stream in bf16, --qk-clip off, the embedding's weight decay back on)
    for k in (*FP8_FIELDS, "fp32_residual_connection", "qk_clip", "qk_clip_alpha", "qk_clip_threshold",
              "log_max_attention_logit", "embedding_init_method_std"):  # fmt: skip
        if k in m:  # (absent from older checkpoints: the flags' defaults)
            out[k] = m[k]
    if "fp8_wgrad" in m:
        out["no_fp8_wgrad"] = not m["fp8_wgrad"]
    if any(m.get("fp8_bf16_layers") or ()):
        out["first_last_layers_bf16"] = True
        out["num_layers_at_start_in_bf16"], out["num_layers_at_end_in_bf16"] = m["fp8_bf16_layers"]
    # (a hybrid Mamba model's layer kinds and mixer sizes; absent from older checkpoints: the flags' defaults)
    hybrid_defaults = (False, 0.0, 0.0, None, 128, 64, 8, None)
    out.update({k: m.get(k, default) for k, default in zip((*HYBRID, *MAMBA), hybrid_defaults)})
    out["heterogeneous_layers_config_encoded_json"] = m.get("heterogeneous_layers_config_encoded_json")
    out["heterogeneous_layers_config_path"] = None  # (the text above is the blocks: --use-checkpoint-args drops a path)
    out.update({k: v for k, v in m.items() if k.startswith("moe_") or k == "num_experts"})
    out.update(
        {
            k: t[k]
            for k in (
                "micro_batch_size",
                "global_batch_size",
                "seq_length",
                "train_iters",
                "seed",
                "log_interval",
                "eval_interval",
                "eval_iters",
            )
        }
    )
    if t.get("rampup_batch_size"):
        out["rampup_batch_size"] = list(t["rampup_batch_size"])
    if t.get("train_samples") is not None:  # a sample-based run: its iterations follow from the samples again
        out.update(train_samples=t["train_samples"], train_iters=None)
    # (the sharding of the optimizer state is a layout choice, as TP and PP sizes are: not taken over, or its
    # store_true flags could never be turned off for a checkpoint that loads under any layout)
    out.update({k: v for k, v in o.items() if k not in SHARDING})
    lora = saved.get("lora")  # a LoRA run's adapters are built again (else they would not be loaded)
    if lora:
        out.update(
            lora_rank=lora["rank"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora["dropout"],
            lora_target_modules=list(lora["target_modules"]),
            qlora=lora.get("qlora", False),
        )
    paths = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
    out.update({k: v for k, v in d.items() if k not in paths})
    out.update({k: list(d.get(k) or ()) or None for k in paths})
    if out["ffn_hidden_size"] is None:  # saved before --swiglu took Megatron's default: built 4 x hidden wide
        out["ffn_hidden_size"] = 4 * m["hidden_size"]
    return out


def _check_yarn(ns: argparse.Namespace, saved: dict, given: set[str], path: str) -> None:
    """An MLA checkpoint's YaRN keeps its resolved cos / sin factor, not --mscale: an explicit --mscale or
    --rope-type that would build another RoPE is refused (they would otherwise be ignored)."""
    params = saved.get("rope_scaling_params") or {}
    if not saved.get("multi_latent_attention") or params.get("rope_type") != "yarn":
        return
    if "rope_type" in given and ns.rope_type != "yarn":
        raise ConfigError(
            f"--rope-type {ns.rope_type} conflicts with the checkpoint in {path} (YaRN); drop the flag, or pass "
            "--use-checkpoint-args"
        )
    if "mscale" in given:
        f = params["factor"]
        factor = yarn_mscale(f, ns.mscale) / yarn_mscale(f, saved.get("mscale_all_dim") or 0.0)
        if not math.isclose(factor, params.get("attention_factor", 1.0), rel_tol=1e-9):
            raise ConfigError(
                f"--mscale {ns.mscale} conflicts with the checkpoint in {path} (its YaRN scales cos / sin by "
                f"{params.get('attention_factor')}, this would by {factor:.6g}); drop the flag, or pass "
                "--use-checkpoint-args"
            )


def with_origin(e: ConfigError, ns: argparse.Namespace | None) -> ConfigError:
    """`e`, saying which of the flags it names the user did not give: their values came from the checkpoint (a
    resume on more ranks was refused for "--global-batch-size 2", a flag never typed)."""
    path, flags, offs = getattr(ns, "from_checkpoint", (None, (), {}))
    named = [f for f in flags if re.search(rf"{re.escape(f)}(?![\w-])", str(e))]
    if not named:
        return e
    off = [offs[f] for f in named if f in offs]  # (a switch on there: its off form, which --help does not list)
    off_text = f"; {' / '.join(off)} turns it off" if off else ""
    return ConfigError(f"{e} ({', '.join(named)}: not given, the checkpoint's value, {path}{off_text})")


def _flag(parser: argparse.ArgumentParser, dest: str, value) -> str:
    """`dest = value` as the flag that sets it: a switch by its name alone, else the name and the value."""
    actions = [a for a in parser._actions if a.dest == dest and a.option_strings]
    # (a dest two switches share, --x and --no-x: the one that sets this value)
    action = next((a for a in actions if a.nargs == 0 and a.const == value), actions[0] if actions else None)
    flag = max(action.option_strings, key=len) if action else "--" + dest.replace("_", "-")
    if action is not None and action.nargs == 0:  # (store_true / store_false: on when the value is its const)
        return flag if value == action.const else f"{flag} off"
    if isinstance(value, (list, tuple)):  # (nargs flags take the values apart; the others one comma list)
        return f"{flag} {(' ' if action is not None and action.nargs else ',').join(map(str, value))}"
    return f"{flag} {value}"


def _parsed_default(parser: argparse.ArgumentParser, dest: str):
    """A flag's default as its value reads (--moe-layer-freq's "1" is the 1 a checkpoint holds)."""
    default = parser.get_default(dest)
    action = next((a for a in parser._actions if a.dest == dest), None)
    if isinstance(default, str) and action is not None and callable(action.type):
        return action.type(default)
    if dest == "moe_layer_freq" and isinstance(default, str) and default.isdigit():
        return int(default)
    return default


def explicit_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    actions = parser._option_string_actions
    return {actions[tok.split("=")[0]].dest for tok in argv if tok.split("=")[0] in actions}


def tokenizer_beside(recorded: str | None, path: str) -> str | None:
    """A converted checkpoint's tokenizer travels in its hf/ directory, recorded by its absolute path: the same
    file under this checkpoint's own hf/ (`path`: the checkpoint or its root) where it has one, so a copy or a
    moved checkpoint reads its own (a copy read the original's while that existed: another model converted into
    the original's directory since would have lent the copy its tokenizer); else the recorded one."""
    if not recorded:
        return recorded
    side = os.path.basename(os.path.dirname(os.path.normpath(recorded))) == "hf"  # (a tokenizer given by flag: kept)
    if side or not os.path.exists(recorded):
        for root in (path, os.path.dirname(os.path.normpath(path))):
            own = os.path.join(root, "hf", os.path.basename(recorded))
            if os.path.isfile(own):
                return own
    return recorded


def _given_text(argv: Sequence[str], flag: str) -> str | None:
    """The text given to `flag` last (argparse's value), as --flag VALUE or --flag=VALUE."""
    for i in range(len(argv) - 1, -1, -1):
        if argv[i] == flag:
            return argv[i + 1] if i + 1 < len(argv) else None
        if argv[i].startswith(flag + "="):
            return argv[i][len(flag) + 1 :]
    return None


def _same_number(text: str, value) -> bool:
    try:
        return float(text) == float(value)
    except (TypeError, ValueError):
        return str(value) == text


def flags_from_checkpoint(
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    ns: argparse.Namespace,
    config: dict,
    path: str,
    scheduler: dict | None = None,
    resumed: bool = False,
    saved_dp: int | None = None,
) -> argparse.Namespace:
    """The flags of `argv` parsed again with the checkpoint's values (its metadata's `config`) as the defaults of
    flags not given: an explicit flag that would change the weights' architecture is refused (unless
    --use-checkpoint-args), schedule flags that differ are noted (ns.schedule_notes). `resumed`: the checkpoint
    is the job's own, in --save, which a restart resumes whole, also a --finetune job's (read as any resume).
    `saved_dp`: the data-parallel size it was saved at (its global batch, where none was given)."""
    saved = defaults_from_checkpoint(config)
    if saved.get("fp16") and saved.get("loss_scale") is None and saved.get("check_for_nan_in_loss_and_grad") is False:
        # (the check off is --fp16's dynamic scale's rule, re-derived on resume while the run is fp16: taken as a
        # flag, a --bf16 resume trained on after a NaN step, an exploratory run found; Megatron's default is on)
        saved.pop("check_for_nan_in_loss_and_grad")
    if "tokenizer_model" in saved:
        saved["tokenizer_model"] = tokenizer_beside(saved["tokenizer_model"], path)
    given = explicit_dests(parser, argv)
    conflicts = [d for d in ARCH_DESTS if d in given and d not in HETEROGENEOUS and getattr(ns, d) != saved.get(d)]
    if given & set(HETEROGENEOUS) and not ns.use_checkpoint_args and "model" in config:
        flag = "--heterogeneous-layers-config-" + (
            "encoded-json" if ns.heterogeneous_layers_config_encoded_json else "path"
        )
        check_given_blocks(heterogeneous_json(ns), flag, config["model"], path)
    # --moe-use-upcycling from a dense --load: the experts and their size are this run's own (training/upcycling.py
    # checks them against the dense checkpoint); its own checkpoint, resumed, is an MoE one like any other
    upcycled = UPCYCLED_DESTS if ns.moe_use_upcycling and not resumed else ()
    conflicts = [d for d in conflicts if d not in upcycled]
    if not ns.group_query_attention and not saved["group_query_attention"]:  # (ignored without GQA, as in Megatron)
        conflicts = [d for d in conflicts if d != "num_query_groups"]
    # (no biases, or another activation than GELU: no bias-GELU fusion to turn off, the flag changes nothing, as
    # in Megatron; it conflicted on resuming a --swiglu run's own checkpoint given with it)
    other = any(saved.get(k) for k in ("swiglu", "squared_relu", "quick_geglu", "openai_gelu"))
    if (saved.get("disable_bias_linear") and ns.disable_bias_linear) or other:
        conflicts = [d for d in conflicts if d != "no_bias_gelu_fusion"]
    if saved.get("position_embedding_type") != "learned_absolute":  # (a table of no weights: RoPE's positions run
        conflicts = [d for d in conflicts if d != "max_position_embeddings"]  # as far as asked; longer fine-tunes)
    if saved.get("multi_latent_attention"):  # (MLA's RoPE is its YaRN: these two do nothing there, as in Megatron)
        conflicts = [d for d in conflicts if d not in ("use_rope_scaling", "rope_scaling_factor")]
    if conflicts and not ns.use_checkpoint_args:
        d = conflicts[0]
        flag = f"--{d.replace('_', '-')}"
        value = getattr(ns, d)
        text = None if isinstance(value, bool) else _given_text(argv, flag)  # (a switch takes no text)
        if text is not None and not _same_number(text, value):
            value = f"{text} (read as {value})"  # (--window-size 7,0 is a window of 8 tokens)
        given_as = _flag(parser, d, value) if isinstance(value, bool) else f"{flag} {value}"  # (as typed: --no-X)
        raise ConfigError(
            f"{given_as} conflicts with the checkpoint in {path} "
            f"({saved.get(d)}); drop the flag, or pass --use-checkpoint-args to take the checkpoint's value"
        )
    if not ns.use_checkpoint_args:
        _check_yarn(ns, saved, given, path)
    if saved.get("lora_rank") and "lora_rank" in given and ns.lora_rank != saved["lora_rank"]:
        raise ConfigError(
            f"--lora-rank {ns.lora_rank} conflicts with the rank-{saved['lora_rank']} LoRA adapters in {path}: drop "
            "the flag (they load at their own rank), or fold them into the weights first (tools/checkpoint/"
            "convert.py --saver hf --merge-lora, then --loader hf) and start new adapters from those"
        )
    if saved.get("lora_rank") and "lora_target_modules" in given:
        from megatron_lite.lora.config import LoraConfig, lora_for_model, target_modules

        # (PEFT's names given are ours here; on an MLA model linear_qkv is its projections, and without SwiGLU
        # up_proj is linear_fc1, as when it was saved)
        mla = argparse.Namespace(
            multi_latent_attention=saved["multi_latent_attention"],
            q_lora_rank=saved["q_lora_rank"],
            activation="swiglu" if saved.get("swiglu") else "quick_geglu" if saved.get("quick_geglu") else "gelu",
        )
        ours = lora_for_model(LoraConfig(target_modules=target_modules(ns.lora_target_modules)), mla).target_modules
        if set(ours) != set(saved["lora_target_modules"]):
            from megatron_lite.lora.config import PARTS

            fused = [f for f, parts in PARTS.items() if f in saved["lora_target_modules"] and set(parts) & set(ours)]
            why = (
                f"; its {fused[0]} adapts every part of that layer (before per-projection targets, PEFT's names "
                "adapted the whole layer)"
                if fused
                else ""
            )
            raise ConfigError(
                f"--lora-target-modules {' '.join(ns.lora_target_modules)} differs from the adapters in {path} (on "
                f"{' '.join(saved['lora_target_modules'])}){why}: drop the flag to take them from the checkpoint"
            )
    if saved.get("lora_rank") and "lora_alpha" in given and ns.lora_alpha != saved["lora_alpha"]:
        # (the adapters' product is scaled by alpha / rank: another alpha is another trained function)
        raise ConfigError(
            f"--lora-alpha {ns.lora_alpha:g} conflicts with the LoRA adapters in {path}, trained at alpha "
            f"{saved['lora_alpha']:g}: drop the flag"
        )
    notes = []
    # (--finetune: the schedule, seed and the rest had come over too: warmup, decay style, a --min-lr above the new
    # --lr; a fine-tune restarted from its own --save goes on with the flags it saved, as any resume)
    finetune = ns.finetune and not resumed
    if finetune:
        # (the dropouts said with their values: a converted checkpoint's 0.0 became the default 0.1 unseen)
        drops = [d for d in ("hidden_dropout", "attention_dropout") if d not in given and d in saved]
        drops = [f"--{d.replace('_', '-')} {getattr(ns, d)} (the checkpoint: {saved[d]})" for d in drops
                 if getattr(ns, d) != saved[d]]  # fmt: skip
        saved = {k: v for k, v in saved.items() if k in ARCH_DESTS or k in FINETUNE_KEEPS}
        notes.append(
            "--finetune: the model's settings (architecture, routing, tokenizer) are the checkpoint's; the training "
            "flags not given (schedule, optimizer, batch, seed, dropout, data, and MoE capacity, drop policy, "
            "router dtype, input jitter and forced balancing) take their defaults, as in Megatron"
            + (f": {', '.join(drops)}" if drops else "")
        )
    # a precision given replaces the checkpoint's, and its bf16-only settings (an fp16 run was refused for them)
    bf16_only = ("grad_reduce_in_bf16", "use_precision_aware_optimizer", "exp_avg_dtype", "exp_avg_sq_dtype")
    for flag, drop in (("bf16", ("fp16",)), ("fp16", ("bf16", *bf16_only))):
        if flag in given and getattr(ns, flag):  # (turned on: --no-bf16 given replaces nothing)
            if saved.get("fp8") and "fp8" not in given:  # (dropped without a word: a review's)
                notes.append(f"--{flag} replaces the checkpoint's fp8 (--fp8-format {saved['fp8']}): the run computes "
                             f"in {flag} (--fp8-format {saved['fp8']} with --{flag} keeps it)")  # fmt: skip
            for k in (*drop, *(FP8_DESTS if "fp8" not in given else ())):
                saved.pop(k, None)
    # `full` keeps the checkpoint's own schedule (--use-checkpoint-opt_param-scheduler); `saved` is trimmed below
    full, saved = saved, dict(saved)
    if full.get("global_batch_size") is None and saved_dp and full.get("micro_batch_size"):
        # (its batch was Megatron's default, --micro-batch-size x data-parallel size: its schedule lengths, in
        # the other unit, came over as none without it, or were a TypeError)
        full["global_batch_size"] = full["micro_batch_size"] * saved_dp
    # a run's length given in the other unit than the checkpoint's replaces it; its schedule lengths are carried
    # over into the run's unit (a sample-based warmup had become none when resumed with --train-iters)
    for dest, other in (("train_iters", "samples"), ("train_samples", "iters")):
        if dest in given:
            new_gbs = ns.global_batch_size if "global_batch_size" in given else saved.get("global_batch_size")
            new_gbs = new_gbs or global_batch(ns)[0]  # (neither given: this run's micro-batch x data-parallel size)
            carried = in_other_unit(saved, "iters" if other == "samples" else "samples", full.get("global_batch_size"),
                                     new_gbs)  # fmt: skip
            saved = {k: v for k, v in saved.items() if k not in RUN_LENGTH[other]} | carried
    if given & {"lr_warmup_iters", "lr_warmup_samples"}:  # a warmup length given replaces the saved fraction
        saved.pop("lr_warmup_fraction", None)
    sources = ("mock_data", "data_path", "train_data_path", "valid_data_path", "test_data_path")
    if any(getattr(ns, d) for d in given & set(sources[:3])):  # a training data source given replaces the
        saved = {k: v for k, v in saved.items() if k not in sources}  # checkpoint's; a split's path only its own
    # (an explicit other optimizer: no precision-aware Adam)
    if ns.optimizer in ("sgd", "muon", "dist_muon") or ns.use_apex_adam:
        for k in ("use_precision_aware_optimizer", "exp_avg_dtype", "exp_avg_sq_dtype"):
            saved.pop(k, None)
    taken = {
        k: v
        for k, v in saved.items()
        if hasattr(ns, k)
        and k not in given
        and v != _parsed_default(parser, k)
        and (saved.get("num_experts") or not k.startswith("moe_"))  # (a dense model's MoE settings mean nothing)
    }
    parser.set_defaults(**{k: v for k, v in saved.items() if hasattr(ns, k)})
    ns = parser.parse_args(argv)
    ns.rope_scaling_params = saved.get("rope_scaling_params")
    # (for with_origin: the flags taken, and each switch's off form)
    offs = {  # (not an architecture's switch: its off form is refused as a conflict with the weights)
        f"--{k.replace('_', '-')}": off_switch(_flag(parser, k, True))
        for k, v in taken.items()
        if v is True and k not in ARCH_DESTS
    }
    offs = {k: v for k, v in offs.items() if v in parser._option_string_actions}  # (a --no-X switch has none)
    ns.from_checkpoint = (path, [f"--{k.replace('_', '-')}" for k in taken], offs)
    if not finetune and (listed := [_flag(parser, k, v) for k, v in taken.items() if k not in ARCH_DESTS]):
        # (Megatron takes nothing but --use-checkpoint-args' model flags: say what came over, as a switch left
        # on there, --eod-mask-loss say, is not turned off by leaving its flag out here: its --no- form does)
        notes.append(f"flags not given take the checkpoint's values: {', '.join(listed)}")
        if off := list(offs.values()):
            notes.append(f"a switch taken from the checkpoint is turned off by its off form: {', '.join(off)}")
    # (not for a checkpoint that trained nothing, a conversion's, whose --seq-length is a placeholder: a review)
    trained = scheduler is not None
    if trained and not finetune and "seq_length" in given and full.get("seq_length") not in (None, ns.seq_length):
        # (accepted, as Megatron accepts it; said, as the schedule's changes are: an exploratory run)
        notes.append(
            f"--seq-length {ns.seq_length} differs from the checkpoint's {full['seq_length']}: training goes on after "
            f"its consumed samples, which were of {full['seq_length']} tokens, with samples of {ns.seq_length}"
        )
    # (`scheduler`: the checkpoint's schedule state; older ones hold no lengths in samples)
    ns.schedule_notes = notes + schedule_notes(ns, saved, given, full, scheduler, resumed)
    if ns.use_checkpoint_args:
        for d in (d for d in ARCH_DESTS if d not in upcycled):
            setattr(ns, d, saved.get(d, getattr(ns, d)))
    return ns
