"""Command-line flags, with Megatron-LM's names (defined in flag_parser.py), turned into the config dataclasses.

A Megatron script ports by changing its entry point: every flag here keeps Megatron's spelling and, but for
those docs/training.md lists (--lr, --micro-batch-size, --num-workers, --distributed-backend, the MoE
dispatcher and router dtype), its default. Flags that Megatron's example scripts use and we do not implement
are refused with one line naming them (never silently ignored); flags that change nothing here (e.g.
--use-mcore-models) are accepted and reported at start-up.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from megatron_lite import flag_values
from megatron_lite.checkpoint_flags import explicit_dests, flags_from_checkpoint, with_origin
from megatron_lite.config import ConfigError, ModelConfig, ParallelConfig, RopeScaling, TrainingConfig
from megatron_lite.data.config import DataConfig
from megatron_lite.data.tokenizers import tokenizer_file
from megatron_lite.flag_checks import check_moe_flags, check_run_length, resolve_kernel_impl
from megatron_lite.flag_parser import build_parser
from megatron_lite.layout_validation import parse_pipeline_layout
from megatron_lite.lora.config import LoraConfig, has_dense_mlp, lora_for_model, target_modules
from megatron_lite.megatron_flags import OTHER_NAMES, refuse_unsupported
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.optimizer.muon import MUON_FIELDS
from megatron_lite.training.configs import CheckpointConfig, JobConfig, LoggingConfig, ResilienceConfig


def _require(ns: argparse.Namespace, *names: str) -> None:
    missing = ["--" + n.replace("_", "-") for n in names if getattr(ns, n) is None]
    if missing:
        raise ConfigError(f"missing required flag(s): {' '.join(missing)}")


# What fp8 does not run with yet: the ring GEMMs and QLoRA's NF4 weights
FP8_NOT_WITH = {"--tp-comm-overlap": "tp_comm_overlap", "--qlora": "qlora"}


def _rope_scaling(ns: argparse.Namespace) -> RopeScaling | None:
    """--use-rope-scaling's Llama-3 scaling, or MLA's YaRN (MLA ignores --use-rope-scaling, as in Megatron). A
    checkpoint's full parameters (Llama-3's frequency factors and original length; YaRN's resolved softmax factor,
    which --mscale, not kept, went into) have no flags: they come back from it."""
    saved = getattr(ns, "rope_scaling_params", None) or {}
    if ns.multi_latent_attention:
        if saved.get("rope_type") == "yarn":
            return RopeScaling(**{**saved, "factor": ns.rotary_scaling_factor})
        if saved:  # (saved before --use-rope-scaling stopped applying to MLA: the scaling it was trained with)
            return RopeScaling(**saved)
        return flag_values.mla_yarn(ns)
    if ns.use_rope_scaling:
        if not ns.rope_scaling_factor > 0:  # (0 and NaN trained into a NaN loss; -1 trained on, unsaid)
            raise ConfigError(f"--rope-scaling-factor {ns.rope_scaling_factor} must be > 0 (Llama 3.1's: 8)")
        return RopeScaling(**{**saved, "factor": ns.rope_scaling_factor})
    return flag_values.mla_yarn(ns)  # (None: its checks of --rope-type and --rotary-scaling-factor without MLA)


def job_config_from_args(ns: argparse.Namespace) -> JobConfig:
    refuse_unsupported(ns)
    if ns.seq_length is not None and ns.seq_length < 1:  # (it was said as --max-position-embeddings, its default)
        raise ConfigError(f"--seq-length {ns.seq_length} must be a positive integer")
    if ns.num_layers is None and ns.hybrid_override_pattern:  # (Megatron's HybridModel: the pattern's length)
        ns.num_layers = len(ns.hybrid_override_pattern)
    _require(ns, "num_layers", "hidden_size", "num_attention_heads", "seq_length")
    check_run_length(ns)
    if ns.overlap_p2p_comm and ns.no_overlap_p2p_communication:
        raise ConfigError("--overlap-p2p-comm and --no-overlap-p2p-communication contradict each other; keep one")
    if ns.overlap_moe_expert_parallel_comm and ns.moe_token_dispatcher_type != "alltoall":
        raise ConfigError(
            f"--overlap-moe-expert-parallel-comm overlaps the all-to-all dispatcher's exchanges; it does nothing with "
            f"--moe-token-dispatcher-type {ns.moe_token_dispatcher_type}: use alltoall or drop the flag"
        )
    check_moe_flags(ns)
    if ns.fp8 is not None and (both := [f for f, on in FP8_NOT_WITH.items() if getattr(ns, on)]):
        raise ConfigError(
            f"--fp8-format {ns.fp8} with {both[0]}: not implemented together (the fp8 GEMMs are the plain linears' "
            "of the transformer layers); drop one"
        )
    kernel_impl = resolve_kernel_impl(ns.kernel_impl, ns.distributed_backend, ns.bf16 or ns.fp16)
    balancing, aux_loss_coeff = flag_values.balancing(ns)
    vocab = ns.vocab_size
    model = ModelConfig(
        num_layers=ns.num_layers,
        hidden_size=ns.hidden_size,
        num_attention_heads=ns.num_attention_heads,
        vocab_size=vocab if vocab is not None else 1,  # replaced once the tokenizer is known
        ffn_hidden_size=flag_values.ffn_hidden_size(ns),
        num_query_groups=ns.num_query_groups if ns.group_query_attention else None,
        kv_channels=ns.kv_channels,
        max_position_embeddings=ns.seq_length if ns.max_position_embeddings is None else ns.max_position_embeddings,
        make_vocab_size_divisible_by=ns.make_vocab_size_divisible_by,
        normalization=ns.normalization,
        apply_layernorm_1p=ns.apply_layernorm_1p,
        apply_residual_connection_post_layernorm=ns.apply_residual_connection_post_layernorm,
        fp32_residual_connection=ns.fp32_residual_connection,
        norm_epsilon=ns.norm_epsilon,
        activation=flag_values.activation(ns),
        glu_linear_offset=ns.glu_linear_offset,
        activation_func_clamp_value=ns.activation_func_clamp_value,
        position_embedding_type=ns.position_embedding_type,
        rotary_base=ns.rotary_base,
        rotary_percent=ns.rotary_percent,
        rotary_interleaved=ns.rotary_interleaved,
        is_hybrid_model=ns.is_hybrid_model,
        hybrid_attention_ratio=ns.hybrid_attention_ratio,
        hybrid_mlp_ratio=ns.hybrid_mlp_ratio,
        hybrid_override_pattern=ns.hybrid_override_pattern,
        mamba_state_dim=ns.mamba_state_dim,
        mamba_head_dim=ns.mamba_head_dim,
        mamba_num_groups=ns.mamba_num_groups,
        mamba_num_heads=ns.mamba_num_heads,
        heterogeneous_layers_config_encoded_json=flag_values.heterogeneous_json(ns),
        rope_scaling=_rope_scaling(ns),
        sliding_window=ns.window_size,
        window_attn_skip_freq=ns.window_attn_skip_freq,
        softmax_type=ns.softmax_type,
        no_rope_freq=ns.no_rope_freq,
        qk_l2_norm=ns.qk_l2_norm,
        qk_l2_norm_rope_only=ns.qk_l2_norm_rope_only,
        attention_chunk_size=ns.attention_chunk_size,
        attn_temperature_floor_scale=ns.attn_temperature_floor_scale,
        attn_temperature_scale=ns.attn_temperature_scale,
        attention_output_gate=ns.attention_output_gate,
        **flag_values.qk_clip(ns),
        add_bias_linear=not ns.disable_bias_linear,
        add_qkv_bias=ns.add_qkv_bias,
        qk_layernorm=ns.qk_layernorm,
        multi_latent_attention=ns.multi_latent_attention,
        q_lora_rank=ns.q_lora_rank,
        kv_lora_rank=ns.kv_lora_rank,
        qk_head_dim=ns.qk_head_dim,
        qk_pos_emb_head_dim=ns.qk_pos_emb_head_dim,
        v_head_dim=ns.v_head_dim,
        mla_mscale_all_dim=ns.mscale_all_dim if ns.multi_latent_attention else 0.0,
        untie_embeddings_and_output_weights=ns.untie_embeddings_and_output_weights,
        mtp_num_layers=ns.mtp_num_layers or 0,
        mtp_loss_scaling_factor=ns.mtp_loss_scaling_factor,
        init_method_std=ns.init_method_std,
        embedding_init_method_std=ns.embedding_init_method_std,
        init_method_xavier_uniform=ns.init_method_xavier_uniform,
        hidden_dropout=ns.hidden_dropout,
        attention_dropout=ns.attention_dropout,
        recompute_granularity=ns.recompute_granularity,
        recompute_method=ns.recompute_method,
        recompute_num_layers=ns.recompute_num_layers,
        recompute_modules=tuple(ns.recompute_modules),
        kernel_impl=kernel_impl,
        fp8=ns.fp8,
        fp8_recipe=ns.fp8_recipe,
        fp8_margin=ns.fp8_margin,
        fp8_amax_history_len=ns.fp8_amax_history_len,
        fp8_amax_compute_algo=ns.fp8_amax_compute_algo,
        fp8_wgrad=not ns.no_fp8_wgrad,
        fp8_bf16_layers=(
            (ns.num_layers_at_start_in_bf16, ns.num_layers_at_end_in_bf16) if ns.first_last_layers_bf16 else (0, 0)
        ),
        num_experts=ns.num_experts,
        moe_router_topk=ns.moe_router_topk,
        moe_router_score_function=ns.moe_router_score_function,
        moe_router_pre_softmax=ns.moe_router_pre_softmax,
        moe_router_num_groups=ns.moe_router_num_groups,
        moe_router_group_topk=ns.moe_router_group_topk,
        moe_router_group_score_topn=ns.moe_router_group_score_topn,
        moe_router_topk_scaling_factor=ns.moe_router_topk_scaling_factor,
        moe_router_dtype=ns.moe_router_dtype,
        moe_ffn_hidden_size=ns.moe_ffn_hidden_size,
        moe_router_load_balancing_type=balancing,
        moe_aux_loss_coeff=aux_loss_coeff,
        moe_z_loss_coeff=ns.moe_z_loss_coeff,
        moe_router_enable_expert_bias=ns.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=ns.moe_router_bias_update_rate,
        moe_expert_capacity_factor=flag_values.capacity_factor(ns),
        moe_token_drop_policy=ns.moe_token_drop_policy,
        moe_layer_freq=flag_values.layer_freq(ns.moe_layer_freq),
        moe_shared_expert_intermediate_size=ns.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=ns.moe_shared_expert_gate,
        moe_token_dispatcher_type=ns.moe_token_dispatcher_type,
        moe_input_jitter_eps=ns.moe_input_jitter_eps,
        moe_router_force_load_balancing=ns.moe_router_force_load_balancing,
        moe_pad_expert_input_to_capacity=ns.moe_pad_expert_input_to_capacity,
        moe_apply_probs_on_input=ns.moe_apply_probs_on_input,
    )
    model.check_recompute_targets()
    for flag, value in (  # (used in divisions below, before the parallel config's own checks)
        ("--pipeline-model-parallel-size", ns.pipeline_model_parallel_size),
        ("--num-layers-per-virtual-pipeline-stage", ns.num_layers_per_virtual_pipeline_stage),
        ("--num-virtual-stages-per-pipeline-rank", ns.num_virtual_stages_per_pipeline_rank),
        ("--microbatch-group-size-per-virtual-pipeline-stage", ns.microbatch_group_size_per_virtual_pipeline_stage),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value} must be a positive integer")
    vp = ns.num_virtual_stages_per_pipeline_rank
    if ns.num_layers_per_virtual_pipeline_stage is not None and vp is not None:
        raise ConfigError(  # (Megatron's validate_args allows one of the two)
            "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank both set the virtual "
            "stages; keep one"
        )
    if ns.num_layers_per_virtual_pipeline_stage is not None and ns.pipeline_model_parallel_layout is not None:
        raise ConfigError(
            "--pipeline-model-parallel-layout places every layer: drop --num-layers-per-virtual-pipeline-stage"
        )
    uneven = ns.decoder_first_pipeline_num_layers is not None or ns.decoder_last_pipeline_num_layers is not None
    if ns.num_layers_per_virtual_pipeline_stage is not None and uneven:
        raise ConfigError(  # (Megatron's validate_args too: the layers per stage differ between ranks)
            "--num-layers-per-virtual-pipeline-stage with --decoder-first/last-pipeline-num-layers: the ranks hold "
            "different numbers of layers; use --num-virtual-stages-per-pipeline-rank"
        )
    if ns.num_layers_per_virtual_pipeline_stage is not None:
        # (as Megatron: an embedding or loss counted in the pipeline split counts here too)
        counted = int(ns.account_for_embedding_in_pipeline_split) + int(ns.account_for_loss_in_pipeline_split)
        per_rank = (ns.num_layers + counted) // ns.pipeline_model_parallel_size
        if per_rank % ns.num_layers_per_virtual_pipeline_stage:
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage {ns.num_layers_per_virtual_pipeline_stage} does not "
                f"divide the {per_rank} layers of each pipeline rank"
            )
        vp = per_rank // ns.num_layers_per_virtual_pipeline_stage
    layout = None
    if ns.pipeline_model_parallel_layout is not None:
        pp = ns.pipeline_model_parallel_size
        layout = parse_pipeline_layout(ns.pipeline_model_parallel_layout, pp, ns.num_layers, ns.mtp_num_layers or 0)
        if ns.decoder_first_pipeline_num_layers is not None or ns.decoder_last_pipeline_num_layers is not None:
            raise ConfigError(
                "--pipeline-model-parallel-layout places every layer: drop --decoder-first/last-pipeline-num-layers"
            )
        if vp not in (None, len(layout) // pp):
            raise ConfigError(
                f"--pipeline-model-parallel-layout has {len(layout)} stages, {len(layout) // pp} per pipeline rank, "
                f"but the virtual-stage flags give {vp}; drop them (the layout decides)"
            )
        vp = len(layout) // pp if len(layout) > pp else None
    group = ns.microbatch_group_size_per_virtual_pipeline_stage
    if group is not None and (vp or 1) == 1:  # (Megatron takes it and leaves it unused: scripts pass it either way)
        ns.schedule_notes = [
            *getattr(ns, "schedule_notes", []),
            f"--microbatch-group-size-per-virtual-pipeline-stage {group} has no effect without virtual stages: "
            "it groups the interleaved schedule's micro-batches (as in Megatron)",
        ]
        group = None
    parallel = ParallelConfig(
        tensor_model_parallel_size=ns.tensor_model_parallel_size,
        pipeline_model_parallel_size=ns.pipeline_model_parallel_size,
        context_parallel_size=ns.context_parallel_size,
        cp_comm_type=flag_values.cp_comm_type(ns.cp_comm_type, ns.num_layers),
        hierarchical_context_parallel_sizes=(
            tuple(ns.hierarchical_context_parallel_sizes) if ns.hierarchical_context_parallel_sizes else None
        ),
        expert_model_parallel_size=ns.expert_model_parallel_size,
        expert_tensor_parallel_size=ns.expert_tensor_parallel_size,
        virtual_pipeline_model_parallel_size=vp,
        sequence_parallel=ns.sequence_parallel,
        tp_comm_overlap=ns.tp_comm_overlap,
        tp_comm_overlap_ag=not ns.disable_tp_comm_overlap_ag,
        tp_comm_overlap_rs=not ns.disable_tp_comm_overlap_rs,
        overlap_p2p_comm=False if ns.no_overlap_p2p_communication else (True if ns.overlap_p2p_comm else None),
        microbatch_group_size=group,
        overlap_moe_expert_parallel_comm=ns.overlap_moe_expert_parallel_comm,
        decoder_first_pipeline_num_layers=ns.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=ns.decoder_last_pipeline_num_layers,
        pipeline_layout=layout,
        account_for_embedding_in_pipeline_split=ns.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=ns.account_for_loss_in_pipeline_split,
    )
    training = TrainingConfig(
        micro_batch_size=ns.micro_batch_size,
        global_batch_size=ns.global_batch_size,
        seq_length=ns.seq_length,
        train_iters=ns.train_iters or 0,  # with --train-samples: resolved at start-up
        train_samples=ns.train_samples,
        rampup_batch_size=tuple(ns.rampup_batch_size) if ns.rampup_batch_size else None,
        resumed_samples=getattr(ns, "resumed_samples", 0),
        seed=ns.seed,
        log_interval=ns.log_interval,
        eval_interval=ns.eval_interval,
        eval_iters=ns.eval_iters,
        skip_train=ns.skip_train,
        exit_interval=ns.exit_interval,
        exit_duration_in_mins=ns.exit_duration_in_mins,
        overlap_grad_reduce=ns.overlap_grad_reduce and not ns.use_torch_fsdp2,  # (FSDP2 overlaps its own)
        ddp_bucket_size=ns.ddp_bucket_size,
    )
    optimizer = OptimizerConfig(
        optimizer=ns.optimizer,
        sgd_momentum=ns.sgd_momentum,
        **{k: getattr(ns, k) for k in MUON_FIELDS},
        use_distributed_optimizer=ns.use_distributed_optimizer,
        zero_stage=ns.zero_stage,
        use_torch_fsdp2=ns.use_torch_fsdp2,
        torch_fsdp2_reshard_after_forward=ns.torch_fsdp2_reshard_after_forward,
        overlap_param_gather=ns.overlap_param_gather,
        lr=ns.lr,
        min_lr=ns.min_lr,
        lr_decay_style=ns.lr_decay_style,
        lr_decay_iters=ns.lr_decay_iters,
        lr_warmup_iters=ns.lr_warmup_iters,
        lr_warmup_init=ns.lr_warmup_init,
        lr_wsd_decay_style=ns.lr_wsd_decay_style,
        lr_wsd_decay_iters=ns.lr_wsd_decay_iters,
        lr_decay_samples=ns.lr_decay_samples,
        lr_warmup_samples=ns.lr_warmup_samples,
        lr_warmup_fraction=ns.lr_warmup_fraction,
        lr_wsd_decay_samples=ns.lr_wsd_decay_samples,
        decoupled_lr=ns.decoupled_lr,
        decoupled_min_lr=ns.decoupled_min_lr,
        weight_decay=ns.weight_decay,
        # (Megatron's validate_args: the deprecated --no-weight-decay-cond-type apply_wd_to_qk_layernorm sets it)
        apply_wd_to_qk_layernorm=ns.apply_wd_to_qk_layernorm or ns.no_weight_decay_cond_type is not None,
        skip_embedding_weight_decay=ns.embedding_init_method_std is not None,
        start_weight_decay=ns.start_weight_decay,
        end_weight_decay=ns.end_weight_decay,
        weight_decay_incr_style=ns.weight_decay_incr_style,
        adam_beta1=ns.adam_beta1,
        adam_beta2=ns.adam_beta2,
        adam_eps=ns.adam_eps,
        clip_grad=ns.clip_grad,
        bf16=ns.bf16,
        fp16=ns.fp16,
        # --accumulate-allreduce-grads-in-fp32 wins over a value restored from a checkpoint's arguments (given
        # with --grad-reduce-in-bf16, parse_args has dropped it: bf16 wins then, as in Megatron)
        grad_reduce_in_bf16=(flag_values.main_grads_bf16(ns) or ns.grad_reduce_in_bf16)  # (its checks run either way)
        and not ns.accumulate_allreduce_grads_in_fp32,
        ddp_reduce_scatter_with_fp32_accumulation=ns.ddp_reduce_scatter_with_fp32_accumulation,
        loss_scale=ns.loss_scale,
        initial_loss_scale=ns.initial_loss_scale,
        min_loss_scale=ns.min_loss_scale,
        loss_scale_window=flag_values.whole("--loss-scale-window", ns.loss_scale_window),
        hysteresis=ns.hysteresis,
        use_apex_adam=ns.use_apex_adam,
        use_precision_aware_optimizer=ns.use_precision_aware_optimizer,
        exp_avg_dtype=ns.exp_avg_dtype,
        exp_avg_sq_dtype=ns.exp_avg_sq_dtype,
        check_for_nan_in_loss_and_grad=ns.check_for_nan_in_loss_and_grad,
    )
    data = DataConfig(
        **flag_values.data_paths(ns),
        split=ns.split,
        mock_data=ns.mock_data,
        # (Megatron's pretrain_gpt.py defaults it to GPT2BPETokenizer: its GPT-3 scripts give only the two files)
        tokenizer_type=ns.tokenizer_type or ("GPT2BPETokenizer" if ns.vocab_file and ns.merge_file else None),
        tokenizer_model=tokenizer_file(ns.tokenizer_model),  # (a model directory: its tokenizer.json)
        vocab_file=ns.vocab_file,
        merge_file=ns.merge_file,
        vocab_size=ns.vocab_size,
        tiktoken_pattern=ns.tiktoken_pattern,
        tiktoken_num_special_tokens=ns.tiktoken_num_special_tokens,
        tiktoken_special_tokens=tuple(ns.tiktoken_special_tokens) if ns.tiktoken_special_tokens else None,
        tokenizer_special_tokens=tuple(ns.tokenizer_special_tokens) if ns.tokenizer_special_tokens else None,
        legacy_tokenizer=ns.legacy_tokenizer,
        data_cache_path=ns.data_cache_path,
        mid_level_dataset_surplus=ns.mid_level_dataset_surplus,
        num_workers=ns.num_workers,
        eod_mask_loss=ns.eod_mask_loss,
        reset_position_ids=ns.reset_position_ids,
        reset_attention_mask=ns.reset_attention_mask,
        sft=ns.sft,
        full_validation=ns.full_validation,
        multiple_validation_sets=ns.multiple_validation_sets,
    )
    checkpoint = CheckpointConfig(
        save=ns.save,
        load=ns.load,
        save_interval=ns.save_interval,
        no_load_optim=ns.no_load_optim,
        no_load_rng=ns.no_load_rng,
        load_main_params_from_ckpt=ns.load_main_params_from_ckpt,
        no_save_optim=ns.no_save_optim,
        no_save_rng=ns.no_save_rng,
        finetune=ns.finetune,
        use_checkpoint_args=ns.use_checkpoint_args,
        exit_on_missing_checkpoint=ns.exit_on_missing_checkpoint,
        async_save=ns.async_save,
        ckpt_fully_parallel_load=ns.ckpt_fully_parallel_load,
        ckpt_keep_last=ns.ckpt_keep_last,
        save_retain_interval=ns.save_retain_interval,
        ckpt_step=ns.ckpt_step,
        use_checkpoint_opt_param_scheduler=ns.use_checkpoint_opt_param_scheduler,
        moe_use_upcycling=ns.moe_use_upcycling,
        moe_upcycling_granularity=ns.moe_upcycling_granularity,
        **{k: getattr(ns, k) for k in CheckpointConfig.__dataclass_fields__ if k.startswith("non_persistent_")},
    )
    logging = LoggingConfig(
        log_jsonl=ns.log_jsonl,
        wandb_project=ns.wandb_project,
        wandb_exp_name=ns.wandb_exp_name,
        wandb_entity=ns.wandb_entity,
        wandb_save_dir=ns.wandb_save_dir,
        tensorboard_dir=ns.tensorboard_dir,
        tensorboard_log_interval=ns.tensorboard_log_interval,
        tensorboard_queue_size=ns.tensorboard_queue_size,
        log_memory_breakdown=ns.log_memory_breakdown,
        log_params_norm=ns.log_params_norm,
        moe_per_layer_logging=ns.moe_per_layer_logging,
        log_num_zeros_in_grad=ns.log_num_zeros_in_grad,
        profile=ns.profile,
        use_pytorch_profiler=ns.use_pytorch_profiler,
        profile_step_start=ns.profile_step_start,
        profile_step_end=ns.profile_step_end,
        profile_ranks=tuple(ns.profile_ranks),
        profile_dir=ns.profile_dir or ns.tensorboard_dir,
    )
    resilience = ResilienceConfig(
        auto_resume=not ns.no_auto_resume,
        exit_signal_handler=ns.exit_signal_handler,
        exit_signal=ns.exit_signal,
        nan_policy=ns.nan_policy,
        check_for_spiky_loss=ns.check_for_spiky_loss,
        check_for_large_grads=ns.check_for_large_grads,
        rerun_mode=ns.rerun_mode or "validate_results",
        spiky_loss_window=ns.spiky_loss_window,
        spiky_loss_zscore=ns.spiky_loss_zscore,
        spiky_loss_policy=ns.spiky_loss_policy,
        log_straggler=ns.log_straggler,
        flight_recorder=not ns.disable_flight_recorder,
    )
    resilience.validate(checkpoint)
    lora = None
    if ns.qlora and not ns.lora_rank:
        raise ConfigError("--qlora trains LoRA adapters on an NF4 base: add --lora-rank R")
    if ns.lora_rank:
        targets = target_modules(ns.lora_target_modules)
        lora = lora_for_model(LoraConfig(ns.lora_rank, ns.lora_alpha, ns.lora_dropout, targets, ns.qlora), model)
        lora.validate(
            model.num_experts,
            parallel.tp_comm_overlap,
            model.multi_latent_attention,
            model.q_lora_rank is not None,
            dense_mlp=has_dense_mlp(model),
        )
        if lora.qlora and optimizer.use_torch_fsdp2:
            raise ConfigError(
                "--qlora with --use-torch-fsdp2 is not supported: FSDP2 shards the weights before they are "
                "quantised; use --use-distributed-optimizer (or plain data parallelism) instead"
            )
    if model.fp32_residual_connection:
        _check_fp32_residual(optimizer)
    if model.hybrid and "M" in model.layer_types and ns.reset_attention_mask:
        raise ConfigError(
            "--reset-attention-mask is not supported with Mamba layers (the scan would carry its state across "
            "documents): drop --reset-attention-mask"
        )
    return JobConfig(
        model=model,
        parallel=parallel,
        training=training,
        optimizer=optimizer,
        data=data,
        checkpoint=checkpoint,
        logging=logging,
        resilience=resilience,
        lora=lora,
        dry_run=ns.dry_run,
        distributed_backend=ns.distributed_backend,
        distributed_timeout_minutes=ns.distributed_timeout_minutes,
        deterministic_mode=ns.deterministic_mode,
        data_parallel_random_init=ns.data_parallel_random_init,
        iterations_to_skip=tuple(ns.iterations_to_skip),
    )


PER_SPLIT_DESTS = ("train_data_path", "valid_data_path", "test_data_path", "per_split_data_args_path")


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, JobConfig]:
    """Parse the flags. With --load pointing at a checkpoint, flags not given take the checkpoint's values,
    so `--load DIR` alone rebuilds and continues the run."""
    import sys

    from megatron_lite.checkpoint.checkpointing import find_checkpoint, read_metadata, same_directory

    argv = list(sys.argv[1:] if argv is None else argv)
    flags = [tok.split("=")[0] for tok in argv]
    for other, name in OTHER_NAMES.items():  # Megatron's other names: read as ours, a checkpoint's included
        if other in flags:
            if name in flags:
                raise ConfigError(f"{other} is Megatron's other name for {name}: give one of them")
            argv = [tok.replace(other, name, 1) if tok.split("=")[0] == other else tok for tok in argv]
    parser = build_parser()
    ns = parser.parse_args(argv)
    if "--use-rotary-position-embeddings" in argv:  # (its conflicts with a checkpoint are the type flag's)
        ns.position_embedding_type = "rope"
    if ns.lr_warmup_fraction is not None and (ns.lr_warmup_iters or ns.lr_warmup_samples):
        # (checked on the flags given, before a checkpoint's values fill the others in)
        flag = "--lr-warmup-iters" if ns.lr_warmup_iters else "--lr-warmup-samples"
        raise ConfigError(f"--lr-warmup-fraction and {flag} are exclusive (as in Megatron); keep one")
    if ns.override_opt_param_scheduler and ns.use_checkpoint_opt_param_scheduler:
        raise ConfigError(
            "--override-opt_param-scheduler (the flags' schedule) and --use-checkpoint-opt_param-scheduler (the "
            "checkpoint's) are exclusive; pick one"
        )
    ns.schedule_notes = []
    given = explicit_dests(parser, argv)
    per_split = [d for d in PER_SPLIT_DESTS if d in given]
    if "split" in given and per_split:  # (Megatron asserts "split and blend_per_split are incompatible")
        raise ConfigError(
            f"--split {ns.split} divides --data-path; with --{per_split[0].replace('_', '-')} each split has its own "
            "datasets, used whole: drop --split (or give --data-path instead)"
        )
    accumulate = "accumulate_allreduce_grads_in_fp32" in given and ns.accumulate_allreduce_grads_in_fp32  # (not --no-)
    if accumulate and getattr(ns, "main_grads_dtype", None) == "bf16" and ns.bf16:
        raise ConfigError(
            "--accumulate-allreduce-grads-in-fp32 needs fp32 main gradients (as Megatron asserts), not "
            "--main-grads-dtype bf16; drop one"
        )
    if accumulate and "grad_reduce_in_bf16" in given and ns.grad_reduce_in_bf16 and ns.bf16:
        ns.accumulate_allreduce_grads_in_fp32 = False  # both given: bf16 wins, as in Megatron's validate_args
    lenient = same_directory(ns.load, ns.save) or bool(ns.non_persistent_ckpt_type)  # (see resume.py: --load S)
    path = find_checkpoint(ns.load, ns.ckpt_step, own=lenient) if ns.load else None
    resumed = False
    if ns.save and not ns.no_auto_resume and not same_directory(ns.load, ns.save):
        # a restart resumes from its own --save (training/resume.starting_checkpoint): that is the checkpoint
        # whose architecture the flags must agree with (a changed --rotary-base there trained other math)
        own = find_checkpoint(ns.save, own=True, flag="--save")
        path, resumed = own or path, own is not None
    if path is None:
        return _finish(ns, argv, given)
    meta = read_metadata(path)
    saved_dp = (meta.get("layout") or {}).get("dp")
    ns = flags_from_checkpoint(parser, argv, ns, meta["config"], path, meta.get("scheduler"), resumed, saved_dp)
    # (the ramp's batches before them are not run again; --finetune starts at 0 but where it resumes its own --save)
    ns.resumed_samples = 0 if ns.finetune and not resumed else int(meta.get("consumed_samples", 0))
    try:
        return _finish(ns, argv, given)
    except ConfigError as e:
        raise with_origin(e, ns) from None


def _finish(ns: argparse.Namespace, argv: Sequence[str], given: set[str]) -> tuple[argparse.Namespace, JobConfig]:
    """parse_args past the checkpoint's flags: the rules that read the flags as they now stand, and the job."""
    ns.given_dests = given  # (the notes of flags that have no effect name only those given)
    if getattr(ns, "from_checkpoint", None):
        if ns.rampup_batch_size and ns.train_samples is None and not given & {"rampup_batch_size", "train_iters"}:
            ns.old_rampup = True  # (saved before the refusal: it resumes as it ran)
            ns.schedule_notes.append(
                "the checkpoint ramps its batch in an iteration-based run, which Megatron refuses (the decay ends "
                "past the samples the run consumes); it goes on as it ran (--train-samples makes it sample-based)"
            )
    if "--use-rotary-position-embeddings" in argv and not ns.use_checkpoint_args:
        ns.position_embedding_type = "rope"  # (Megatron's validate_args: whatever the type flag says)
    if ns.fp16 and "check_for_nan_in_loss_and_grad" not in given:
        if ns.loss_scale is None and ns.nan_policy == "halt" and "nan_policy" not in given:
            # Megatron's validate_args: with dynamic loss scaling a non-finite loss or gradient is the scaler's
            # signal (the step is skipped and the scale lowered), not a fault to halt on
            if ns.check_for_nan_in_loss_and_grad:
                ns.schedule_notes.append(
                    "--fp16 with a dynamic loss scale turns --check-for-nan-in-loss-and-grad off, as Megatron does: "
                    "a non-finite loss or gradient skips the step and lowers the scale (--loss-scale S, or "
                    "--nan-policy, keeps the check)"
                )
            ns.check_for_nan_in_loss_and_grad = False
        else:  # (on resume, a checkpoint's False may be this rule's, from a run with a dynamic scale)
            ns.check_for_nan_in_loss_and_grad = True
    lora_only = [d for d in ("lora_alpha", "lora_dropout", "lora_target_modules") if d in given]
    if lora_only and not ns.lora_rank:  # (without a rank there are no adapters: every weight would train)
        raise ConfigError(f"--{lora_only[0].replace('_', '-')} sets up LoRA adapters: add --lora-rank R, or drop it")
    # A number that must be finite, given inf or NaN, was let through by checks written as "> 0" (--loss-scale inf
    # skipped every step, exit 0), or raised converting it (--rotary-percent nan, --moe-expert-capacity-factor
    # inf): the flags' own checks first, then this line for any left
    try:
        job = job_config_from_args(ns)
    except ConfigError:  # (a ValueError too: the flags' own lines stand)
        raise
    except (ValueError, OverflowError):
        if said := _non_finite(ns, given):
            raise ConfigError(said) from None
        raise  # (no flag to blame: a fault of ours, its traceback kept for a report, not a line naming nothing)
    if said := _non_finite(ns, given):
        raise ConfigError(said)
    return ns, job


def _non_finite(ns: argparse.Namespace, given: set[str]) -> str | None:
    for dest in sorted(given):
        value = getattr(ns, dest, None)
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, float) and not math.isfinite(v):
                return f"--{dest.replace('_', '-')} {v} must be a finite number"
    return None


def _check_fp32_residual(optimizer) -> None:
    """--fp32-residual-connection keeps an fp32 stream under a lower-precision compute dtype (Megatron's check)."""
    if not (optimizer.bf16 or optimizer.fp16):
        raise ConfigError(
            "--fp32-residual-connection keeps the residual stream in fp32 under --bf16 or --fp16; this run is fp32 "
            "throughout already: add --bf16 (or --fp16) or drop the flag"
        )
    if optimizer.use_torch_fsdp2:  # (its policy casts each layer's inputs, the residual stream, to bf16)
        raise ConfigError(
            "--fp32-residual-connection with --use-torch-fsdp2 is not supported: FSDP2 casts each layer's input to "
            "the compute dtype; use --use-distributed-optimizer (or plain data parallelism) instead"
        )
