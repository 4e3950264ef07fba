"""The tables of megatron_flags.py: Megatron-LM flags we take but do not act on (accepted, reported at start-up)
and those we do not implement (refused with the reason). tests/data/megatron_lm_flags.txt lists Megatron's flags;
each is one of ours, one of these, or another name of one of ours."""

from __future__ import annotations


def _all(why: str, names: str) -> dict[str, str]:
    """One reason for a family of refused flags (by their names with underscores)."""
    return dict.fromkeys(names.split(), why)


def _each(takes_value: bool | str, why: str, names: str) -> dict[str, tuple[bool | str, str]]:
    """One reason for a family of flags (by their names with underscores)."""
    return {name: (takes_value, why) for name in names.split()}


INFERENCE = "pretrain_gpt.py runs no inference engine (Megatron reads it to generate text, and in RL rollouts)"
BERT_T5 = "a BERT / T5 flag (Megatron's pretrain_bert.py, pretrain_t5.py): pretrain_gpt.py builds decoder-only GPTs"
BIENCODER = "a biencoder (ICT / REALM) flag: pretrain_gpt.py builds GPT models"
VISION = "a vision-model flag (Megatron's pretrain_vision_*.py): pretrain_gpt.py builds GPT models"
NO_INPROCESS = "there is no in-process restart: a relaunched job resumes from the newest checkpoint in --save"
NO_OFFLOAD = "nothing is offloaded to the CPU"
NO_MEGATRON_FSDP = "Megatron-FSDP is not implemented, so there is nothing of it to tune (--use-torch-fsdp2 shards)"
NO_NCCL_TUNING = "collectives run with NCCL's default configuration (no buffer registration, SHARP or config file)"
LAYOUT_FREE = "checkpoints are always safetensors + JSON, the optimizer state included, loadable under any layout"
RETRO = "Retro (retrieval-augmented GPT) is not implemented"
RL = "RL (GRPO) training is not implemented: pretrain_gpt.py pretrains, and fine-tunes with --sft"
KITCHEN = "Kitchen quantization is not implemented (--fp8-format quantizes the GEMMs to fp8)"
CONVERT = (
    "checkpoints are not converted in a run: ours are safetensors + JSON (tools/checkpoint/convert.py converts them "
    "to and from Hugging Face's)"
)

TP_SWITCH = "--tp-comm-overlap decomposes the tensor-parallel GEMMs into ring steps; there is no per-collective switch"

# The values Megatron's parser allows for some of those (a typo there is its argparse error, not a silent no-op)
NO_OP_CHOICES: dict[str, tuple[str, ...]] = {
    "ckpt_format": ("torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"),
    "transformer_impl": ("local", "transformer_engine", "inference_optimized"),
    "attention_backend": ("flash", "fused", "unfused", "local", "auto"),
    "cross_entropy_fusion_impl": ("native", "te", "linear"),
    "timing_log_option": ("max", "minmax", "all"),
}  # (--rerun-mode's are checked with the rest of its settings: megatron_flags.py)

# Megatron flags (from its example scripts) that change nothing here: accepted, and reported at start-up
# with the reason. True where the flag takes a value.
ACCEPTED_NO_OPS: dict[str, tuple[bool | str, str]] = {
    "disable_mamba_mem_eff_path": (
        False,
        "the Mamba mixer has one path, unfused PyTorch (no Triton SSD kernel here): the same math either way",
    ),
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
        "gated experts (SwiGLU, gpt-oss's quick-GEGLU, with or without biases) run as grouped GEMMs with "
        "--kernel-impl triton (the default on CUDA; under --qlora or fp8 one by one), a loop with torch",
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
        "megatron_lite has no re-run engine; non-finite losses follow --nan-policy, loss spikes --spiky-loss-policy "
        "(--check-for-large-grads reads it)",
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
    # the rest of Megatron's arguments.py (a flag-coverage review: each was "no such flag", which does not tell
    # Megatron's flags from typos): other models' and the inference engine's flags, and tuning with nothing here
    **_each(
        True,
        INFERENCE,
        "inference_batch_times_seqlen_threshold max_tokens_to_oom inference_max_requests "
        "inference_max_seq_length inference_max_batch_size inference_dynamic_batching_buffer_size_gb "
        "inference_dynamic_batching_block_size inference_dynamic_batching_buffer_guaranteed_fraction "
        "inference_dynamic_batching_buffer_overflow_factor inference_dynamic_batching_max_requests_override "
        "inference_dynamic_batching_max_tokens_override inference_dynamic_batching_num_cuda_graphs "
        "inference_dynamic_batching_unified_memory_level mlp_chunks_for_prefill symmetric_ar_type "
        "inference_wandb_logging_step_interval",
    ),
    **_each(
        False,
        INFERENCE,
        "flash_decode use_legacy_static_engine inference_dynamic_batching "
        "inference_dynamic_batching_track_paused_request_events decode_only_cuda_graphs nccl_all_reduce_for_prefill "
        "disable_chunked_prefill inference_rng_tracker moe_pad_experts_for_cuda_graph_inference cache_mla_latents",
    ),
    **_each(
        True,
        "CUDA graphs are not implemented, so there is nothing to capture",
        "cuda_graph_warmup_steps cuda_graph_scope",
    ),
    **_each(
        True,
        BERT_T5,
        "bert_embedder_type bert_load decoder_num_layers decoder_seq_length "
        "relative_attention_num_buckets relative_attention_max_distance sample_rate mask_prob short_seq_prob",
    ),
    **_each(False, BERT_T5, "output_bert_embeddings bert_no_binary_head"),
    **_each(
        True,
        BIENCODER,
        "ict_head_size biencoder_projection_dim ict_load titles_data_path query_in_block_prob "
        "evidence_data_path block_data_path embedding_path indexer_batch_size indexer_log_interval "
        "retriever_seq_length",
    ),
    **_each("+", BIENCODER, "retriever_report_topk_accuracies"),
    **_each(False, BIENCODER, "biencoder_shared_query_context_model use_one_sent_docs retriever_score_scaling"),
    **_each(
        True,
        VISION,
        "num_classes img_h img_w num_channels patch_dim classes_fraction data_per_class_fraction "
        "head_lr_mult vision_pretraining_type vision_backbone_type swin_backbone_type mask_type mask_factor "
        "iter_per_epoch dino_local_img_size dino_local_crops_number dino_head_hidden_size dino_bottleneck_size "
        "dino_freeze_last_layer dino_warmup_teacher_temp dino_teacher_temp dino_warmup_teacher_temp_epochs",
    ),
    **_each(False, VISION, "no_data_sharding vision_pretraining dino_norm_last_layer"),
    **_each(
        True,
        NO_INPROCESS,
        "inprocess_max_iterations inprocess_monitor_thread_interval "
        "inprocess_monitor_process_interval inprocess_progress_watchdog_interval inprocess_heartbeat_interval "
        "inprocess_soft_timeout inprocess_hard_timeout inprocess_heartbeat_timeout inprocess_barrier_timeout "
        "inprocess_completion_timeout inprocess_last_call_wait inprocess_termination_grace_time "
        "inprocess_granularity inprocess_active_world_size",
    ),
    **_each(False, NO_INPROCESS, "inprocess_empty_cuda_cache"),
    **_each(True, NO_OFFLOAD, "optimizer_offload_fraction"),
    **_each(False, NO_OFFLOAD, "use_torch_optimizer_for_cpu_offload overlap_cpu_optimizer_d2h_h2d"),
    **_each(True, NO_MEGATRON_FSDP, "suggested_communication_unit_size"),
    **_each(False, NO_MEGATRON_FSDP, "fsdp_double_buffer keep_fp8_transpose_cache enable_full_sharding_in_hsdp"),
    **_each(True, NO_NCCL_TUNING, "sharp_enabled_group nccl_communicator_config_path"),
    **_each(False, NO_NCCL_TUNING, "use_nccl_ub disable_symmetric_registration use_sharp"),
    **_each(
        False,
        LAYOUT_FREE,
        "no_strict_fsdp_dtensor_load dist_ckpt_save_pre_mcore_014 "
        "dist_ckpt_optim_fully_reshardable distrib_optim_fully_reshardable_mem_efficient",
    ),
    **_each(True, "there are no local checkpoints to replicate", "replication_jump replication_factor"),
    "replication": (False, "there are no local checkpoints to replicate"),
    "fp4_recipe": (True, "FP4 training is not implemented, so there is no FP4 recipe to pick"),
    "fp4_quantizer_factory": (True, "FP4 training is not implemented, so there is no FP4 quantizer to pick"),
    "fp8_quantizer_factory": (True, "custom fp8 quantizers are not implemented: --fp8-recipe picks one of ours"),
    "mrope_section": ("+", "multimodal RoPE's sections apply to Megatron's mrope position embedding, not one here"),
    "onnx_safe": (True, "nothing is exported to ONNX"),
    "run_workload_inspector_server": (False, "there is no workload-inspector server to profile on demand"),
    "calc_ft_timeouts": (False, "the NVIDIA fault-tolerance package is not used, so it has no timeouts to compute"),
    "config_logger_dir": (True, "module configs are not dumped (each checkpoint records the job's configuration)"),
    "decrease_batch_size_if_needed": (
        False,
        "the global batch size is never decreased: one that --micro-batch-size times the data-parallel size does "
        "not divide is refused",
    ),
    "distribute_saved_activations": (False, "recomputed layers' inputs are not split over the tensor-parallel group"),
    "result_rejected_tracker_filename": (True, "megatron_lite has no re-run engine, so no rejected results to track"),
    "train_sync_interval": (True, "no CPU-GPU synchronisation is added to hold the CPU back"),
    "use_fused_weighted_squared_relu": (False, "there is no fused weighted squared-ReLU kernel to choose"),
    "pipeline_model_parallel_comm_backend": (True, "pipeline messages go over the --distributed-backend"),
    "high_priority_stream_groups": ("*", "communication runs on streams of the default priority"),
    "use_te_activation_func": (False, "there is no Transformer Engine: the activation's kernel follows --kernel-impl"),
    "use_mp_args_from_checkpoint_args": (
        False,
        "checkpoints load under any layout: the parallel sizes are the flags' (and their defaults)",
    ),
    "no_use_tokenizer_model_from_checkpoint_args": (
        False,
        "a --tokenizer-model given is used, with --use-checkpoint-args too; one not given is the checkpoint's",
    ),
    "reuse_grad_buf_for_mxfp8_param_ag": (False, "weights are not all-gathered in MXFP8, so no buffer is reused"),
    "ddp_num_buckets": (True, "the gradient buckets are sized by --ddp-bucket-size"),
    "ddp_pad_buckets_for_high_nccl_busbw": (False, "buckets are not padded for NCCL's bandwidth (the sums are alike)"),
    "use_ring_exchange_p2p": (False, "pipeline messages are sent with the backend's send and receive"),
    "lazy_mpu_init": (True, "the process groups are made at start-up"),
    "init_model_with_meta_device": (False, "each rank makes only its part of the weights, on its device"),
    "use_tp_pp_dp_mapping": (
        False,
        "the ranks' order is megatron_lite's own (its groups are logged at start-up); any order computes the same",
    ),
    "test_mode": (False, "Megatron-Core's real-time tests are not run"),
    "trust_remote_code": (False, "Hugging Face tokenizers are read from their tokenizer.json: no remote code runs"),
    "object_storage_cache_path": (True, "paths are local files (no object storage)"),
    "adlr_autoresume": (False, "there is no ADLR autoresume (--exit-signal-handler saves and exits on a signal)"),
    "adlr_autoresume_interval": (
        True,
        "there is no ADLR autoresume (--exit-signal-handler saves and exits on a signal)",
    ),
    "moe_router_padding_for_fp8": (False, "experts' token counts are not padded for fp8 (padding changes no result)"),
    "moe_deepep_num_sms": (True, "DeepEP is not used"),
    "delay_wgrad_compute": (False, "weight gradients are computed in the backward, with the input gradients"),
}

# Megatron flags we do not implement: refused with one line naming the flag and why.
REFUSED: dict[str, str] = {
    "fp8_param_gather": "weights kept and all-gathered in fp8 are not implemented (--fp8-format quantizes the "
    "compute-dtype weights at each GEMM)",
    "enable_cuda_graph": "CUDA graphs are not implemented",
    "cuda_graph_impl": "CUDA graphs are not implemented (none, Megatron's default, is taken)",
    "moe_enable_deepep": "DeepEP is not used; --moe-token-dispatcher-type alltoall (or allgather) dispatches tokens",
    "optimizer_cpu_offload": "the optimizer state stays on the accelerator (no CPU offload)",
    "moe_layer_recompute": "use --recompute-granularity selective --recompute-modules moe (its successor in Megatron)",
    "use_legacy_models": "megatron_lite has one model implementation, Megatron-core's",
    "overlap_param_gather_with_optimizer_step": (
        "the distributed optimizer's weight all-gather overlaps the next forward (--overlap-param-gather), not the "
        "optimizer step"
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
    # attention and MoE-block variants of Megatron-Core 0.16 (an attention review found them "no such flag")
    # the rest of Megatron's arguments.py (a flag-coverage review: each was "no such flag", which told a Megatron
    # user to drop a flag that changes the model, the data, the optimization or the checkpoints)
    **_all(
        RETRO,
        "retro_project_dir retro_add_retriever retro_cyclic_train_iters retro_encoder_layers "
        "retro_encoder_hidden_dropout retro_encoder_attention_dropout retro_num_neighbors "
        "retro_num_retrieved_chunks retro_attention_gate retro_no_verify_neighbor_count",
    ),
    **_all(
        RL,
        "perform_rl_step rl_prompts_per_eval grpo_prompts_per_step grpo_group_size grpo_iterations "
        "grpo_clamp_eps_lower grpo_clamp_eps_upper grpo_kl_beta grpo_entropy_term_weight "
        "grpo_filter_groups_with_same_reward grpo_default_temperature grpo_default_top_p "
        "langrl_inference_server_type langrl_inference_server_conversation_template langrl_external_server "
        "no_langrl_external_server langrl_env_config rl_offload_optimizer_during_inference "
        "rl_offload_kv_cache_during_training no_rl_offload_kv_cache_during_training "
        "rl_remove_kv_cache_during_training no_rl_remove_kv_cache_during_training rl_reset_cuda_graphs "
        "no_rl_reset_cuda_graphs rl_partial_rollouts no_rl_partial_rollouts "
        "rl_inference_logprobs_is_correction no_rl_inference_logprobs_is_correction "
        "rl_importance_sampling_truncation_coef rl_calculate_intra_group_similarity "
        "no_rl_calculate_intra_group_similarity rl_use_sequence_packing rl_sequence_packing_bin_size "
        "rl_sequence_packing_algo",
    ),
    **_all(KITCHEN, "kitchen_config_file kitchen_recipe_number"),
    **_all(CONVERT, "ckpt_convert_format ckpt_convert_save ckpt_convert_update_legacy_dist_opt_format"),
    "fp4_format": "FP4 (NVFP4) training is not implemented; --fp8-format quantizes the GEMMs to fp8",
    "fp4_param_gather": "weights kept and all-gathered in FP4 are not implemented (FP4 training is not either)",
    "external_cuda_graph": "CUDA graphs are not implemented",
    "inprocess_restart": "in-process restart is not implemented: a relaunched job resumes from the newest checkpoint "
    "in --save",
    "enable_ft_package": "the NVIDIA fault-tolerance package is not used: a relaunched job resumes from the newest "
    "checkpoint in --save (hangs are reported by the flight recorder)",
    "batch_size": "Megatron's old batch-size flag, which it refuses too; use --micro-batch-size",
    "warmup": "Megatron's old warmup flag, which it refuses too; use --lr-warmup-fraction or --lr-warmup-iters",
    "model_parallel_size": "Megatron's old name, which it refuses too; use --tensor-model-parallel-size",
    "checkpoint_activations": (
        "Megatron's old name, which it refuses too; use --recompute-activations, or --recompute-granularity with "
        "--recompute-method"
    ),
    "cpu_offloading_num_layers": "activations are not offloaded to the CPU (0, Megatron's default, is taken)",
    "dump_param_to_param_group_map": (
        "parameter-group maps are not read or written: the optimizer's groups follow weight decay and --decoupled-lr"
    ),
    "pretrained_checkpoint": "use --load DIR --finetune (its weights, with a new schedule and optimizer state)",
    "fp16_lm_cross_entropy": "the loss is computed in fp32 from the logits",
    "disable_bf16_reduced_precision_matmul": (
        "PyTorch's bf16 GEMMs are left as PyTorch sets them (reduced-precision reductions allowed)"
    ),
    "padded_vocab_size": (
        "the vocabulary is padded to a multiple of --make-vocab-size-divisible-by times the tensor-parallel size"
    ),
    "vocab_extra_ids": "extra (T5 sentinel) vocabulary ids are not added (0, Megatron's default, is taken)",
    "tokenizer_metadata": "tokenizer metadata files are not read: --tokenizer-type and --tokenizer-model pick it",
    "allow_ambiguous_pad_tokens": (
        "a pad id shared with another token is not masked out of the loss (Megatron's default)"
    ),
    "moe_extended_tp": "deprecated in Megatron; use --expert-tensor-parallel-size",
    "spec": (
        "custom layer specs are not implemented: the layer is GPT's, its variants set by flags (local is taken, and "
        "megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec: a hybrid Mamba model)"
    ),
    "yaml_cfg": "YAML configs are not read: give the flags",
    "sft_tokenizer_prompt_format": (
        '--sft reads prompt/response records as written and renders "messages" with the tokenizer\'s own chat '
        "template; Megatron's built-in Nemotron prompt formats are not applied"
    ),
}

# Refused flags given as Megatron's default: that changes nothing, and is taken silently.
REFUSED_DEFAULTS = {
    "cuda_graph_impl": "none",  # (no CUDA graphs)
    "cpu_offloading_num_layers": "0",
    "vocab_extra_ids": "0",
    "spec": "local",  # (Megatron-Core's own, non-Transformer-Engine modules: the layer here)
    # (scripts spelling out every default: a flag-defaults review found these refused at Megatron's own value)
    "data_parallel_sharding_strategy": "no_shard",
    "error_injection_rate": "0",
    "error_injection_type": "transient_error",
    "sft_tokenizer_prompt_format": "nemotron-h-aligned",  # (applied by --tokenizer-type SFTTokenizer only)
}
