"""Megatron-LM flags we take but do not act on (accepted, reported at start-up) or do not implement
(refused with the reason), so a Megatron user's script ports by changing only the entry point."""

from __future__ import annotations

import argparse
import re

from megatron_lite.config import ConfigError
from megatron_lite.layout_validation import standalone_mtp, unroll_layout
from megatron_lite.megatron_flag_tables import ACCEPTED_NO_OPS, NO_OP_CHOICES, REFUSED, REFUSED_DEFAULTS

# Megatron's other names for flags of ours: read as those (parse_args), both given is one line.
OTHER_NAMES = {
    "--encoder-seq-length": "--seq-length",
    "--encoder-num-layers": "--num-layers",
    # (Megatron-LM's newer name: its HybridModel scripts give it without --num-layers, the pattern's length)
    "--hybrid-layer-pattern": "--hybrid-override-pattern",
}


def add_megatron_flag_groups(parser: argparse.ArgumentParser) -> None:
    x = parser.add_argument_group("Megatron flags accepted without effect (reported at start-up)")
    for name, (takes_value, why) in ACCEPTED_NO_OPS.items():
        flag = "--" + name.replace("_", "-")
        if takes_value:  # (True: one value; "+" / "*": a list, as Megatron's nargs)
            nargs = None if takes_value is True else takes_value
            x.add_argument(flag, default=None, nargs=nargs, choices=NO_OP_CHOICES.get(name), help=why)
        else:
            x.add_argument(flag, action="store_true", help=why)
    r = parser.add_argument_group("Megatron flags not implemented (refused with the reason)")
    for name, why in REFUSED.items():
        r.add_argument("--" + name.replace("_", "-"), nargs="*", default=None, help=why)
    o = parser.add_argument_group("Megatron's other names for flags here")
    o.add_argument("--encoder-num-layers", type=int, help="Megatron's other name for --num-layers")
    o.add_argument("--hybrid-layer-pattern", help="Megatron's newer name for --hybrid-override-pattern")


DATALOADER_TYPES = ("single", "cyclic")

# The layer spec every Megatron Mamba script passes (its mamba_builder raises without a --spec): Megatron-Core's
# MambaStack, which is the hybrid model here (--is-hybrid-model; all Mamba layers without a pattern or ratios)
MAMBA_STACK_SPEC = ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]
HYBRID_STACK_SPEC = ["megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"]  # (its newer name)


def _is_default(values: list[str] | None, default: str) -> bool:
    if not values or len(values) != 1:
        return False
    try:
        return float(values[0]) == float(default)
    except ValueError:
        return values[0] == default


# a refused flag's reason that already tells what to do ("...; use --micro-batch-size", "give the flags")
_ADVISES = re.compile(r"(?:^|[:;] )(?:use|give) |drop the flag|remove the flag")


def refuse_unsupported(ns: argparse.Namespace) -> None:
    if getattr(ns, "moe_token_dispatcher_type", None) == "flex":  # (a choice, so that this reason is what they see)
        raise ConfigError(
            "--moe-token-dispatcher-type flex (DeepEP / HybridEP) is not supported: use alltoall (or allgather), and "
            "drop --moe-enable-deepep"
        )
    if getattr(ns, "dataloader_type", None) not in (None, *DATALOADER_TYPES):
        raise ConfigError(
            f"--dataloader-type {ns.dataloader_type} is not supported: an external data loader cannot be plugged "
            f"in; use {' or '.join(DATALOADER_TYPES)} (remove the flag)"
        )
    if getattr(ns, "spec", None) in (MAMBA_STACK_SPEC, HYBRID_STACK_SPEC):
        ns.is_hybrid_model, ns.spec = True, None
    for name, default in REFUSED_DEFAULTS.items():  # (Megatron's default given: it changes nothing)
        if _is_default(getattr(ns, name, None), default):
            setattr(ns, name, None)
    if getattr(ns, "dist_ckpt_strictness", None) in ("raise_unexpected", "raise_all"):
        raise ConfigError(
            f"--dist-ckpt-strictness {ns.dist_ckpt_strictness} is not supported: tensors a checkpoint holds beyond "
            "the model's are ignored (Megatron's default, assume_ok_unexpected); missing ones stop the job; remove "
            "the flag"
        )
    for name in ("timing_log_level", "empty_unused_memory_level"):  # (Megatron's choices: 0, 1, 2)
        if getattr(ns, name, None) not in (None, "0", "1", "2"):
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(ns, name)} must be 0, 1 or 2 (Megatron's choices)")
    refused = [(f"--{name.replace('_', '-')}", why) for name, why in REFUSED.items() if getattr(ns, name) is not None]
    if len(refused) == 1:  # (a reason that says what to give instead needs no "remove the flag" after it)
        flag, why = refused[0]
        raise ConfigError(f"{flag} is not supported: {why}" + ("" if _ADVISES.search(why) else "; remove the flag"))
    if refused:  # (all of them at once: a script with four fp8 flags was refused four times over)
        flags = " ".join(flag for flag, _ in refused)
        raise ConfigError(f"{flags} are not supported: " + "; ".join(f"{f}: {w}" for f, w in refused) + "; remove them")
    for name in ("num_distributed_optimizer_instances", "rotary_seq_len_interpolation_factor"):
        value = getattr(ns, name, None)
        if value is not None and value.strip() not in ("1", "1.0"):
            raise ConfigError(f"--{name.replace('_', '-')} {value} is not supported: only 1; remove the flag")
    if getattr(ns, "no_position_embedding", False) and ns.position_embedding_type == "learned_absolute":
        # (Megatron: "--no-position-embedding is deprecated, use --position-embedding-type")
        raise ConfigError(
            "--no-position-embedding with --position-embedding-type learned_absolute (the default): Megatron "
            "refuses it too; use --position-embedding-type rope (or none)"
        )


def _fp8_notes(ns: argparse.Namespace) -> list[str]:
    """The fp8 flags given that change nothing: all of them without --fp8-format; the delayed-scaling ones with
    --fp8-recipe tensorwise (as in Megatron); --fp8-interval, deprecated there."""
    given = {
        flag: value
        for flag, value, default in (
            ("--fp8-recipe", getattr(ns, "fp8_recipe", "delayed"), "delayed"),
            ("--fp8-margin", getattr(ns, "fp8_margin", 0), 0),
            ("--fp8-amax-history-len", getattr(ns, "fp8_amax_history_len", 1), 1),
            ("--fp8-amax-compute-algo", getattr(ns, "fp8_amax_compute_algo", "most_recent"), "most_recent"),
            ("--fp8-interval", getattr(ns, "fp8_interval", 1), 1),
            ("--no-fp8-wgrad", getattr(ns, "no_fp8_wgrad", False), False),
            ("--first-last-layers-bf16", getattr(ns, "first_last_layers_bf16", False), False),
        )
        if value != default
    }
    if getattr(ns, "fp8", None) is None:
        return [f"{flag} has no effect without --fp8-format" for flag in given]
    delayed_only = ("--fp8-margin", "--fp8-amax-history-len", "--fp8-amax-compute-algo")
    tensorwise = getattr(ns, "fp8_recipe", "delayed") == "tensorwise"
    out = [f"{f} {given[f]} has no effect with --fp8-recipe tensorwise (Megatron reads it for delayed scaling)"
           for f in delayed_only if f in given and tensorwise]  # fmt: skip
    if "--fp8-interval" in given:
        out.append(f"--fp8-interval {given['--fp8-interval']} has no effect (deprecated in Megatron)")
    return out


def _without_their_switch(ns: argparse.Namespace) -> list[str]:
    """Settings of a feature that is off: --qk-clip-threshold / -alpha without --qk-clip, the --muon-* flags with
    another --optimizer (they changed nothing, unsaid; Megatron says nothing either)."""
    from megatron_lite.flag_parser import build_parser

    parser = build_parser()
    muon = getattr(ns, "optimizer", "adam") in ("muon", "dist_muon")
    switches = [(not getattr(ns, "qk_clip", False), "qk_clip_", "--qk-clip"), (not muon, "muon_", "--optimizer muon")]
    out = []
    for off, prefix, switch in switches:
        for dest in sorted(d for d in vars(ns) if d.startswith(prefix)):
            if off and getattr(ns, dest) != parser.get_default(dest):
                out.append(f"--{dest.replace('_', '-')} has no effect without {switch}")
    # Whole families, given while their feature is off (a fuzzing round: each was taken without a word); only the
    # flags given, a checkpoint's values of a dense model's MoE settings say nothing
    given = getattr(ns, "given_dests", set()) - {*ACCEPTED_NO_OPS, *REFUSED, *NO_OP_CHOICES}  # (said on their own)
    hybrid = getattr(ns, "hybrid_override_pattern", None) or getattr(ns, "is_hybrid_model", False)
    families = [
        (not getattr(ns, "num_experts", None), lambda d: d.startswith("moe_") and d != "moe_use_upcycling",
         "--num-experts"),
        (not getattr(ns, "multi_latent_attention", False),
         lambda d: d in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "mscale",
                         "mscale_all_dim"), "--multi-latent-attention"),
        (not hybrid, lambda d: d.startswith("mamba_"), "--hybrid-override-pattern (a hybrid Mamba model)"),
        (getattr(ns, "lr_decay_style", None) != "WSD", lambda d: d.startswith("lr_wsd_"), "--lr-decay-style WSD"),
        (not getattr(ns, "fp16", False),
         lambda d: d in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"),
         "--fp16 (bf16 and fp32 scale no loss)"),
    ]  # fmt: skip
    for off, member, switch in families:
        out += [
            f"--{d.replace('_', '-')} has no effect without {switch}"
            for d in sorted(given)
            if off and member(d) and getattr(ns, d) != parser.get_default(d)  # (a script's defaults say nothing)
        ]
    return out


def _fp32_accumulation_notes(ns: argparse.Namespace) -> list[str]:
    """--ddp-reduce-scatter-with-fp32-accumulation acts on the distributed optimizer's reduce-scatters only (as in
    Megatron, which takes it silently elsewhere)."""
    flag = "--ddp-reduce-scatter-with-fp32-accumulation"
    if not getattr(ns, "ddp_reduce_scatter_with_fp32_accumulation", False):
        return []
    if getattr(ns, "use_torch_fsdp2", False):
        return [f"{flag} has no effect with --use-torch-fsdp2: FSDP2 reduce-scatters its gradients itself"]
    if not getattr(ns, "use_distributed_optimizer", False):
        return [f"{flag} has no effect without --use-distributed-optimizer: gradients are all-reduced"]
    # (bf16 gradients: --grad-reduce-in-bf16, or Megatron's --main-grads-dtype bf16 with the precision-aware
    # optimizer, which gives them here)
    bf16_grads = getattr(ns, "grad_reduce_in_bf16", False) or getattr(ns, "main_grads_dtype", None) == "bf16"
    if not (bf16_grads and getattr(ns, "bf16", False)):
        return [f"{flag}: fp32 gradients (no --bf16 --grad-reduce-in-bf16) are summed in fp32 either way"]
    return []


def accepted_no_ops(ns: argparse.Namespace) -> list[str]:
    """Lines describing the accepted-but-ineffective flags this job passed (and one that acts here where
    Megatron-Core's models ignore it)."""
    lines = [
        f"--{n.replace('_', '-')} has no effect: {why}"
        for n, (_, why) in ACCEPTED_NO_OPS.items()
        if getattr(ns, n, None) not in (None, False)
    ]
    if getattr(ns, "accumulate_allreduce_grads_in_fp32", False) and getattr(ns, "grad_reduce_in_bf16", False):
        # (the way back to fp32 when --grad-reduce-in-bf16 comes from a checkpoint's arguments)
        lines = [x for x in lines if not x.startswith("--accumulate-allreduce-grads-in-fp32")]
        lines.append(
            "--accumulate-allreduce-grads-in-fp32 overrides --grad-reduce-in-bf16: gradients are reduced in fp32"
        )
    elif (
        getattr(ns, "grad_reduce_in_bf16", False) and not getattr(ns, "bf16", False) and not getattr(ns, "fp16", False)
    ):
        lines.append("--grad-reduce-in-bf16 has no effect without --bf16: fp32 gradients are reduced in fp32")
    lines += _fp8_notes(ns)
    lines += _without_their_switch(ns)
    norms = [f"--{d.replace('_', '-')}" for d in ("qk_layernorm", "qk_l2_norm") if getattr(ns, d, False)]
    if getattr(ns, "qk_clip", False) and norms and not getattr(ns, "multi_latent_attention", False):
        # Accepted, as Megatron accepts it (its users run the pair), but the per-head norm undoes any row scale:
        # the clipped rows shrink at every step over the threshold while the logits stay. (MLA's norms sit on the
        # latents, before the clipped up-projections: unaffected.) It was a Python warning, printed twice.
        lines.append(
            f"--qk-clip with {norms[0]}: the norm undoes the clip's row scale, so it bounds no logit (the query and "
            "key rows shrink at each clipped step instead); Megatron does the same"
        )
    lines += _fp32_accumulation_notes(ns)
    if getattr(ns, "check_for_large_grads", False):
        lines = [x for x in lines if not x.startswith("--rerun-mode has no effect")]
        mode = getattr(ns, "rerun_mode", None) or "validate_results"
        if getattr(ns, "use_torch_fsdp2", False):
            lines.append("--check-for-large-grads has no effect with --use-torch-fsdp2 (nor in Megatron's FSDP2)")
        elif mode == "report_stats":
            lines.append("--check-for-large-grads has no effect with --rerun-mode report_stats (as in Megatron)")
        elif mode == "validate_results":
            lines.append(
                "--check-for-large-grads under --rerun-mode validate_results: there is no re-run engine here; a "
                "large gradient is reported and training goes on with it applied (Megatron re-runs the iteration "
                "and applies the re-run's)"
            )
    longest, seq = getattr(ns, "max_position_embeddings", None), getattr(ns, "seq_length", None)
    if longest and seq and seq > longest and getattr(ns, "position_embedding_type", None) != "learned_absolute":
        # (learned positions are refused past it; RoPE ran past a converted model's length without a word)
        lines.append(
            f"--seq-length {seq} is past --max-position-embeddings {longest} (the model's): positions past it were "
            f"never trained; Megatron refuses this (--max-position-embeddings {seq} says the model is to learn them)"
        )
    if getattr(ns, "apply_residual_connection_post_layernorm", False):
        lines.append(
            "--apply-residual-connection-post-layernorm takes each residual after its norm, as the flag's help and "
            "Megatron's legacy models do; Megatron-Core's models (Megatron-LM's default) ignore it"
        )
    if getattr(ns, "no_weight_decay_cond_type", None):
        lines.append(
            f"--no-weight-decay-cond-type {ns.no_weight_decay_cond_type} is Megatron's deprecated spelling of "
            "--apply-wd-to-qk-layernorm: taken as that"
        )
    if getattr(ns, "tokenizer_type", None) != "TikTokenizer":  # (Megatron's examples pass it with NullTokenizer)
        given = [f for f in ("tiktoken_pattern", "tiktoken_special_tokens", "legacy_tokenizer") if getattr(ns, f, None)]
        if getattr(ns, "tiktoken_num_special_tokens", 1000) != 1000:
            given.append("tiktoken_num_special_tokens")
        lines += [f"--{f.replace('_', '-')} has no effect without --tokenizer-type TikTokenizer" for f in given]
    elif getattr(ns, "legacy_tokenizer", False) and getattr(ns, "tokenizer_special_tokens", None):
        lines.append(
            "--tokenizer-special-tokens has no effect with --legacy-tokenizer (it reads --tiktoken-special-tokens)"
        )
    elif not getattr(ns, "legacy_tokenizer", False) and getattr(ns, "tiktoken_special_tokens", None):
        lines.append(
            "--tiktoken-special-tokens has no effect without --legacy-tokenizer (Megatron-Core's TikTokenizer reads "
            "--tokenizer-special-tokens)"
        )
    if getattr(ns, "rotary_scaling_factor", 1.0) != 1.0 and not getattr(ns, "multi_latent_attention", False):
        lines.append(
            f"--rotary-scaling-factor {ns.rotary_scaling_factor} has no effect without --multi-latent-attention (as in "
            "Megatron, it scales MLA's YaRN; Llama-3 scaling is --use-rope-scaling --rope-scaling-factor)"
        )
    if getattr(ns, "use_rope_scaling", False) and getattr(ns, "multi_latent_attention", False):
        lines.append(
            "--use-rope-scaling has no effect with --multi-latent-attention (as in Megatron, MLA's RoPE is its YaRN: "
            "--rotary-scaling-factor, --mscale, --mscale-all-dim)"
        )
    layout = getattr(ns, "pipeline_model_parallel_layout", None)
    if layout and standalone_mtp(unroll_layout(layout).split("|")):
        lines.append(
            "--pipeline-model-parallel-layout gives the MTP layers a stage of their own (...|m|L): they run in the "
            "loss's stage here, the stage before it left empty (the same math; that rank does less)"
        )
    if (
        getattr(ns, "tokenizer_type", None) is None
        and getattr(ns, "vocab_file", None)
        and getattr(ns, "merge_file", None)
    ):
        lines.append(
            "--vocab-file and --merge-file without --tokenizer-type: GPT2BPETokenizer reads them (Megatron's "
            "pretrain_gpt.py default)"
        )
    groups = getattr(ns, "num_query_groups", 1)
    if not getattr(ns, "group_query_attention", False) and groups not in (1, getattr(ns, "num_attention_heads", 1)):
        lines.append(
            f"--num-query-groups {groups} has no effect without --group-query-attention (as in Megatron): every "
            "head has its own key and value; add --group-query-attention for grouped-query attention"
        )
    if getattr(ns, "overlap_grad_reduce", False) and getattr(ns, "use_torch_fsdp2", False):
        lines.append(
            "--overlap-grad-reduce has no effect with --use-torch-fsdp2 (as in Megatron): FSDP2 overlaps its gradient "
            "reduce-scatters with the backward by itself"
        )
    lines += getattr(ns, "schedule_notes", [])
    if getattr(ns, "exp_avg_sq_dtype", "fp32") == "bf16" and getattr(ns, "adam_beta2", 0.0) > 0.996:
        lines.append(
            f"warning: with --exp-avg-sq-dtype bf16, --adam-beta2 {ns.adam_beta2} barely decays the second moment: "
            "v x beta2 rounds back to v in bf16's 8 bits (as in Transformer Engine); beta2 <= 0.996 avoids it"
        )
    if getattr(ns, "eod_mask_loss", False) and getattr(ns, "sft", False):  # (as Megatron's SFTDataset ignores it)
        lines.append(
            "--eod-mask-loss has no effect on --sft data: a conversation's closing end-of-document token is trained, "
            "as Megatron's SFTDataset trains it"
        )
    masked = [f for f in ("sft", "eod_mask_loss") if getattr(ns, f, False)]
    if masked and not getattr(ns, "calculate_per_token_loss", False):  # (with the flag, its no-op line says so)
        lines.append(
            f"--{masked[0].replace('_', '-')}: micro-batches count different numbers of loss tokens; the loss is the "
            "mean over the global batch's tokens (Megatron's --calculate-per-token-loss), not Megatron's default "
            "mean of the micro-batches' means"
        )
    if getattr(ns, "check_for_spiky_loss", False):  # (the name is Megatron's, the rule is not)
        lines.append(
            f"--check-for-spiky-loss: a loss is a spike when it lies more than --spiky-loss-zscore "
            f"{ns.spiky_loss_zscore:g} standard deviations above the last --spiky-loss-window {ns.spiky_loss_window} "
            "iterations' mean (Megatron's flags a loss above 10x the largest seen, and re-runs the iteration)"
        )
    if getattr(ns, "save_interval", None) and not getattr(ns, "save", None):  # Megatron ignores it too
        lines.append(f"--save-interval {ns.save_interval} has no effect without --save")
    if getattr(ns, "dataloader_type", None) == "cyclic":
        lines.append(
            "--dataloader-type cyclic has no effect: samples are read in the order of the dataset's own seeded "
            "shuffle, which spans every epoch (as with single); global batch i holds the same samples at any DP size"
        )
    if getattr(ns, "sequence_parallel", False) and (getattr(ns, "tensor_model_parallel_size", 1) or 1) == 1:
        lines.append("--sequence-parallel has no effect at --tensor-model-parallel-size 1 (Megatron turns it off)")
    return lines
