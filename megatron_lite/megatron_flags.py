"""Megatron-LM flags we take but do not act on (accepted, reported at start-up) or do not implement
(refused with the reason), so a Megatron user's script ports by changing only the entry point."""

from __future__ import annotations

import argparse

from megatron_lite.config import ConfigError
from megatron_lite.layout_validation import standalone_mtp, unroll_layout

TP_SWITCH = "--tp-comm-overlap decomposes the tensor-parallel GEMMs into ring steps; there is no per-collective switch"

# Megatron flags (from its example scripts) that change nothing here: accepted, and reported at start-up
# with the reason. True where the flag takes a value.
ACCEPTED_NO_OPS: dict[str, tuple[bool, str]] = {
    "use_mcore_models": (False, "megatron_lite has one model implementation"),
    "use_flash_attn": (
        False,
        "attention is flash attention either way: our Triton kernel with --kernel-impl triton (the default on "
        "CUDA), scaled_dot_product_attention with --kernel-impl torch",
    ),
    "attention_backend": (True, "--kernel-impl picks attention: our flash kernel (triton) or SDPA (torch)"),
    "accumulate_allreduce_grads_in_fp32": (
        False,
        "main gradients are accumulated and reduced in fp32 by default",
    ),
    "attention_softmax_in_fp32": (
        False,
        "the softmax runs in fp32 for low-precision inputs, with the flag or without (Megatron's unfused local "
        "path without it runs a half-precision softmax, which is not reproduced)",
    ),
    "calculate_per_token_loss": (
        False,
        "the loss is always averaged over the tokens of the whole global batch",
    ),
    "ddp_average_in_collective": (
        False,
        "each rank's loss is already divided by the global batch's token count, so the data-parallel sum of the "
        "gradients is the average (the same gradients as averaging in the collective)",
    ),
    "cross_entropy_loss_fusion": (
        False,
        "--kernel-impl triton fuses the output layer with the loss (chunked, logits never whole) either way",
    ),
    "moe_grouped_gemm": (
        False,
        "SwiGLU experts run as grouped GEMMs with --kernel-impl triton (the default on CUDA; under --qlora "
        "one by one), a loop with torch",
    ),
    "log_throughput": (False, "throughput is always logged"),
    "log_validation_ppl_to_tensorboard": (
        False,
        "validation lm_loss and its perplexity always go to every sink (console, JSONL, W&B, TensorBoard)",
    ),
    "log_memory_to_tensorboard": (False, "peak memory is logged every --log-interval to every sink"),
    "log_loss_scale_to_tensorboard": (False, "loss_scale goes to W&B/TensorBoard every --tensorboard-log-interval"),
    "log_batch_size_to_tensorboard": (
        False,
        "global_batch_size goes to W&B/TensorBoard every --tensorboard-log-interval",
    ),
    "log_world_size_to_tensorboard": (False, "the world size and every group's layout are logged at start-up"),
    "log_timers_to_tensorboard": (False, "iteration, data and exposed-communication times are logged every interval"),
    "no_masked_softmax_fusion": (
        False,
        "there is no fused masked softmax to disable; the softmax is fp32 either way (Megatron's unfused local path "
        "is half-precision unless it is told to run in fp32)",
    ),
    "no_bias_swiglu_fusion": (False, "SwiGLU's fusion follows --kernel-impl (triton: fused, torch: not)"),
    "no_bias_dropout_fusion": (False, "there is no fused bias-dropout to disable"),
    "no_rope_fusion": (False, "RoPE's fusion follows --kernel-impl (triton: fused, torch: not)"),
    "no_gradient_accumulation_fusion": (False, "there is no fused weight-gradient accumulation to disable"),
    "no_create_attention_mask_in_dataloader": (False, "no attention mask is ever built (causal SDPA)"),
    "no_mmap_bin_files": (False, "indexed datasets are always memory-mapped"),
    "manual_gc": (False, "Python's garbage collector is left to run normally"),
    "manual_gc_interval": (True, "Python's garbage collector is left to run normally"),
    "moe_router_fusion": (False, "the router's top-k and scores run as PyTorch ops, fused or not"),
    "moe_shared_expert_overlap": (
        False,
        "the shared expert runs after the routed experts (the dispatch overlaps: --overlap-moe-expert-parallel-comm)",
    ),
    "cross_entropy_fusion_impl": (
        True,
        "--kernel-impl triton fuses the output layer with the loss (our kernel, not Transformer Engine's)",
    ),
    "logging_level": (True, "the log says what happened at one level: start-up, each interval, checkpoints, errors"),
    "timing_log_level": (True, "iteration, data and exposed-communication times are logged every interval"),
    "dist_ckpt_strictness": (
        True,
        "a missing or misshapen tensor stops the job with its name, and unexpected ones are ignored (Megatron's "
        "default, assume_ok_unexpected; LoRA adapters the model lacks stop it); raise_unexpected and raise_all are "
        "refused",
    ),
    "auto_detect_ckpt_format": (False, "checkpoints are always safetensors + JSON"),
    "ckpt_fully_parallel_load": (False, "each rank reads only the slices of the tensors it holds"),
    "empty_unused_memory_level": (True, "the CUDA caching allocator is not emptied between steps"),
    "ckpt_format": (True, "checkpoints are always safetensors + JSON (layout-free, no pickle)"),
    "no_position_embedding": (False, "implied by --position-embedding-type rope/none (refused with learned_absolute)"),
    # checkpoint and logging machinery of Megatron's (its examples and functional tests pass them)
    "ckpt_fully_parallel_save": (False, "each rank writes only the slices of the tensors it holds"),
    "no_ckpt_fully_parallel_save": (False, "each rank writes only the slices of the tensors it holds"),
    "use_dist_ckpt": (False, "checkpoints are always layout-free (safetensors + JSON), loadable under any layout"),
    "dist_ckpt_format": (True, "checkpoints are always safetensors + JSON"),
    "use_persistent_ckpt_worker": (False, "--async-save writes in a background thread of each rank"),
    "ckpt_assume_constant_structure": (False, "each save writes the whole state; nothing is cached between saves"),
    "timing_log_option": (True, "iteration, data and exposed-communication times are logged every interval"),
    "no_persist_layer_norm": (False, "there is no persistent layer-norm kernel to disable"),
    # Megatron's store_false spellings (a flag-defaults review found scripts refused on them)
    "no_align_grad_reduce": (False, "each pipeline stage starts its gradient reductions on its own"),
    "no_align_param_gather": (False, "each pipeline stage starts its weight all-gathers on its own"),
    "tp_comm_overlap_rs_dgrad": (
        False,
        "under --tp-comm-overlap the column-parallel backward's reduce-scatter is already a ring overlapped with its "
        "GEMM",
    ),
    "tp_comm_overlap_cfg": (True, "the ring overlap takes no userbuffer configuration"),
    "tp_comm_bootstrap_backend": (True, "the ring overlap has no userbuffers to bootstrap"),
    "disable_tp_comm_bulk_dgrad": (False, TP_SWITCH),
    "disable_tp_comm_bulk_wgrad": (False, TP_SWITCH),
    "disable_tp_comm_split_ag": (False, TP_SWITCH),
    "disable_tp_comm_split_rs": (False, TP_SWITCH),
    "no_scatter_gather_tensors_in_pipeline": (False, "pipeline messages are sent as the stage holds them"),
    "no_gradient_reduce_div_fusion": (False, "there is no fused division in the gradient reduction to disable"),
    "no_initialization": (False, "weights are always initialised (a --load then overwrites them)"),
    "no_clone_scatter_output_in_embedding": (False, "the embedding's scattered output is never cloned"),
    "disable_gloo_process_groups": (False, "no gloo groups are made beside the --distributed-backend's own"),
    "no_one_logger": (False, "there is no one-logger"),
    "no_manual_gc_eval": (False, "Python's garbage collector is left to run normally"),
    "disable_straggler_on_startup": (
        False,
        "--log-straggler reports from the first interval; nothing runs at start-up",
    ),
    # (refused as "no such flag", from the resilience review)
    "straggler_minmax_count": (True, "--log-straggler reports min, median, max and the slowest rank, not N of each"),
    "straggler_ctrlr_port": (True, "there is no straggler controller: --log-straggler is set at start-up"),
    # pipeline performance switches of Megatron's (a pipeline review found them "no such flag")
    "variable_seq_lengths": (False, "every micro-batch has the --seq-length shape: pipeline messages need no shape"),
    "defer_embedding_wgrad_compute": (False, "the output layer's weight gradient is computed in its backward"),
    "wgrad_deferral_limit": (True, "the output layer's weight gradient is computed in its backward"),
    "overlap_p2p_communication_warmup_flush": (
        False,
        "pipeline receives overlap compute with --overlap-p2p-comm (the default with virtual stages) throughout",
    ),
    "no_pin_cpu_grads": (False, "nothing is offloaded to the CPU"),
    "no_pin_cpu_params": (False, "nothing is offloaded to the CPU"),
    "disable_msc": (False, "paths are local files (no multi-storage client)"),
    "no_log_loss_scale_to_tensorboard": (False, "loss_scale goes to W&B/TensorBoard every --tensorboard-log-interval"),
    "log_progress": (
        False,
        "no progress.txt is written; each checkpoint's save is logged, and --log-jsonl records every interval's "
        "throughput and consumed samples",
    ),
    "log_energy": (False, "GPU energy is not measured"),
    # logging flags of Megatron's example scripts (a logging review found them "no such flag")
    "log_memory_interval": (
        True,
        "peak memory (the largest over ranks) is logged every --log-interval; each rank's memory report (on a GPU) "
        "once, after the first",
    ),
    "one_logger_project": (True, "there is no one-logger"),
    "one_logger_run_name": (True, "there is no one-logger"),
    "one_logger_async": (False, "there is no one-logger"),
    "app_tag_run_name": (True, "there is no one-logger to tag runs for"),
    "app_tag_run_version": (True, "there is no one-logger to tag runs for"),
    "check_weight_hash_across_dp_replicas_interval": (
        True,
        "data-parallel replicas' weights are not hashed against each other (a checkpoint's checksums are checked "
        "when it is loaded)",
    ),
    "record_memory_history": (False, "CUDA memory history is not recorded (--log-memory-breakdown counts it by kind)"),
    "memory_snapshot_path": (True, "CUDA memory history is not recorded, so no snapshot is written"),
    "log_max_attention_logit": (False, "the largest attention logit is not computed (there is no QK-clip)"),
    "apply_query_key_layer_scaling": (
        False,
        "the softmax runs in fp32, so scores are not scaled by the layer number (the scaling cancels in the softmax)",
    ),
    "moe_use_legacy_grouped_gemm": (
        False,
        "there is one grouped GEMM (ours with --kernel-impl triton), no legacy one to choose",
    ),
    "no_barrier_with_level_1_timing": (False, "iteration times are measured without barriers"),
    # (values other than 1 are refused: refuse_unsupported)
    "num_distributed_optimizer_instances": (True, "one distributed-optimizer instance over the data-parallel group"),
    "rotary_seq_len_interpolation_factor": (True, "RoPE positions are not interpolated (a factor of 1)"),
    "transformer_impl": (True, "--kernel-impl picks the layers' kernels: ours (triton) or PyTorch's (torch)"),
    "use_contiguous_parameters_in_local_ddp": (
        False,
        "gradients always live in contiguous per-bucket buffers; parameters stay their own tensors",
    ),
    "no_async_tensor_model_parallel_allreduce": (
        False,
        "deprecated in Megatron too; tensor-parallel communication overlaps with --tp-comm-overlap",
    ),
    "local_rank": (True, "the local rank comes from the launcher's LOCAL_RANK environment variable"),
    "moe_permute_fusion": (
        False,
        "the MoE token permutation is a fused kernel with --kernel-impl triton (the default on CUDA) either way",
    ),
    "rerun_mode": (
        True,
        "megatron_lite has no re-run engine; non-finite losses follow --nan-policy, loss spikes --spiky-loss-policy",
    ),
    # in Megatron's release configs and example scripts (a flag-compatibility review found them "no such flag")
    "enable_experimental": (False, "no features are gated behind an experimental switch here"),
    "use_cpu_initialization": (
        False,
        "the initialisation is already the same under every layout (what Megatron's CPU initialisation is for): "
        "each rank makes its part of the one-process weights from --seed",
    ),
    "num_dataset_builder_threads": (True, "each rank builds (or reads the cached) dataset indices on one thread"),
    "te_rng_tracker": (False, "there is no Transformer Engine; dropout's per-rank RNG states are tracked either way"),
    "distributed_timeout_seconds_after_init": (
        True,
        "--distributed-timeout-minutes holds after start-up too (hangs are reported by the flight recorder)",
    ),
}

# Megatron flags we do not implement: refused with one line naming the flag and why.
NON_PERSISTENT = (
    "Megatron's non-persistent (local) checkpoints are not implemented; --save-interval with --ckpt-keep-last N "
    "keeps only the newest N"
)
REFUSED: dict[str, str] = {
    "non_persistent_save_interval": NON_PERSISTENT,
    "non_persistent_ckpt_type": NON_PERSISTENT,
    "non_persistent_global_ckpt_dir": NON_PERSISTENT,
    "fp8_param_gather": "weights kept and all-gathered in fp8 are not implemented (--fp8-format quantizes the "
    "compute-dtype weights at each GEMM)",
    "enable_cuda_graph": "CUDA graphs are not implemented",
    "cuda_graph_impl": "CUDA graphs are not implemented (none, Megatron's default, is taken)",
    "moe_enable_deepep": "DeepEP is not used; --moe-token-dispatcher-type alltoall (or allgather) dispatches tokens",
    "optimizer_cpu_offload": "the optimizer state stays on the accelerator (no CPU offload)",
    "moe_layer_recompute": "use --recompute-granularity selective --recompute-modules moe (its successor in Megatron)",
    "moe_router_force_load_balancing": (
        "forced balancing (random router scores, Megatron's benchmarking mode) is not implemented: routing follows "
        "the router"
    ),
    "use_legacy_models": "megatron_lite has one model implementation, Megatron-core's (drop the flag)",
    "rotary_interleaved": "RoPE rotates the halves of each head (Hugging Face's rotate-half), not interleaved pairs",
    "fp32_residual_connection": "the residual stream is kept in the compute dtype (--bf16 / --fp16)",
    "apply_residual_connection_post_layernorm": "the residual is taken before each norm (pre-norm), as GPT and Llama",
    "moe_pad_expert_input_to_capacity": (
        "experts' inputs are not padded to their capacity: the tokens over it are dropped, the rest run unpadded"
    ),
    "moe_input_jitter_eps": "router input jitter is not implemented",
    "overlap_param_gather_with_optimizer_step": (
        "the distributed optimizer's weight all-gather overlaps the next forward (--overlap-param-gather), not the "
        "optimizer step"
    ),
    "check_for_large_grads": (
        "a check for large (finite) gradients is not implemented; non-finite ones stop the run "
        "(--check-for-nan-in-loss-and-grad) and --spiky-loss-policy acts on loss spikes"
    ),
    # (in Megatron's functional tests' configs; a flag review found them "no such flag")
    "use_megatron_fsdp": "Megatron-FSDP is not implemented; --use-torch-fsdp2 shards parameters (ZeRO-3)",
    "data_parallel_sharding_strategy": (
        "Megatron-FSDP's sharding strategies are not implemented; --use-distributed-optimizer (with --zero-stage 2) "
        "or --use-torch-fsdp2 shard over the data-parallel group"
    ),
    "outer_dp_sharding_strategy": "Megatron-FSDP's hybrid sharding is not implemented",
    "error_injection_rate": "megatron_lite has no re-run engine to test with injected errors",
    "error_injection_type": "megatron_lite has no re-run engine to test with injected errors",
    "deterministic_mode": (
        "PyTorch and the kernels are not switched to deterministic algorithms (CPU runs repeat exactly; GPU runs "
        "are not guaranteed to)"
    ),
    # attention and MoE-block variants of Megatron-Core 0.16 (an attention review found them "no such flag")
    "moe_shared_expert_gate": (
        "the sigmoid gate on the shared expert's output (Qwen2-MoE's shared_expert_gate) is not implemented: the "
        "shared expert's output is added ungated"
    ),
    "window_attn_skip_freq": (
        "--window-size windows every layer; full-attention layers between the sliding-window ones are not implemented"
    ),
    "no_rope_freq": "RoPE is applied in every layer; layers without it (Llama 4's NoPE layers) are not implemented",
    "qk_l2_norm": (
        "L2-normalised queries and keys (Llama 4) are not implemented; --qk-layernorm normalises them with a learned "
        "weight"
    ),
    "softmax_type": (
        "the attention softmax is the vanilla one (Megatron's default): off-by-one and learnable attention sinks "
        "(gpt-oss) are not implemented"
    ),
    "attention_output_gate": "the sigmoid gate on the attention output (Qwen3-Next) is not implemented",
}


def add_megatron_flag_groups(parser: argparse.ArgumentParser) -> None:
    x = parser.add_argument_group("Megatron flags accepted without effect (reported at start-up)")
    for name, (takes_value, why) in ACCEPTED_NO_OPS.items():
        flag = "--" + name.replace("_", "-")
        if takes_value:
            x.add_argument(flag, default=None, help=why)
        else:
            x.add_argument(flag, action="store_true", help=why)
    r = parser.add_argument_group("Megatron flags not implemented (refused with the reason)")
    for name, why in REFUSED.items():
        r.add_argument("--" + name.replace("_", "-"), nargs="*", default=None, help=why)


DATALOADER_TYPES = ("single", "cyclic")


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
    if getattr(ns, "cuda_graph_impl", None) == ["none"]:  # (Megatron's default: no CUDA graphs)
        ns.cuda_graph_impl = None
    if getattr(ns, "softmax_type", None) == ["vanilla"]:  # (Megatron's default: the softmax there is)
        ns.softmax_type = None
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
    if len(refused) == 1:
        raise ConfigError(f"{refused[0][0]} is not supported: {refused[0][1]}; remove the flag")
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


def accepted_no_ops(ns: argparse.Namespace) -> list[str]:
    """Lines describing the accepted-but-ineffective flags this job passed."""
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
    if getattr(ns, "no_weight_decay_cond_type", None):
        lines.append(
            f"--no-weight-decay-cond-type {ns.no_weight_decay_cond_type} is Megatron's deprecated spelling of "
            "--apply-wd-to-qk-layernorm: taken as that"
        )
    if getattr(ns, "tokenizer_type", None) != "TikTokenizer":  # (Megatron's examples pass it with NullTokenizer)
        given = [f for f in ("tiktoken_pattern", "tiktoken_special_tokens") if getattr(ns, f, None)]
        if getattr(ns, "tiktoken_num_special_tokens", 1000) != 1000:
            given.append("tiktoken_num_special_tokens")
        lines += [f"--{f.replace('_', '-')} has no effect without --tokenizer-type TikTokenizer" for f in given]
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
    masked = [f for f in ("eod_mask_loss", "sft") if getattr(ns, f, False)]
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
