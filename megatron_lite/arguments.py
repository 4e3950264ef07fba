"""Command-line flags, with Megatron-LM's names, turned into the config dataclasses.

A Megatron script ports by changing its entry point: every flag here keeps Megatron's spelling and
default. Flags that Megatron's example scripts use and we do not implement are refused with one line
naming them (never silently ignored); flags that change nothing here (e.g. --use-mcore-models) are
accepted and reported at start-up.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from megatron_lite.checkpoint_flags import ARCH_DESTS, defaults_from_checkpoint
from megatron_lite.config import ConfigError, ModelConfig, ParallelConfig, RopeScaling, TrainingConfig
from megatron_lite.data.config import TOKENIZER_TYPES, DataConfig
from megatron_lite.lora.config import LoraConfig, target_modules
from megatron_lite.megatron_flags import add_megatron_flag_groups, refuse_unsupported
from megatron_lite.optimizer.config import DECAY_STYLES, WSD_DECAY_STYLES, OptimizerConfig
from megatron_lite.training.configs import CheckpointConfig, JobConfig, LoggingConfig, ResilienceConfig


def _window_size(text: str) -> int:
    """'(L, R)' or 'L,R' -> the number of keys each query sees (L + 1); only causal windows (R = 0)."""
    parts = [p.strip() for p in text.strip().strip("()").split(",")]
    try:
        left, right = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a window (left,right), e.g. 4095,0") from None
    if right != 0 or left < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: only causal windows (left >= 0, right = 0) are supported")
    return left + 1


def _bool(p: argparse._ArgumentGroup, flag: str, help: str) -> None:
    p.add_argument(flag, action="store_true", help=help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="megatron_lite GPT/Llama pretraining (launch with torchrun). Flag names follow Megatron-LM.",
        allow_abbrev=False,
    )
    m = parser.add_argument_group("model")
    m.add_argument("--num-layers", type=int, required=False)
    m.add_argument("--hidden-size", type=int)
    m.add_argument("--ffn-hidden-size", type=int, help="default 4 x hidden size")
    m.add_argument("--num-attention-heads", type=int)
    _bool(m, "--group-query-attention", "use --num-query-groups key/value heads")
    m.add_argument("--num-query-groups", type=int, default=1)
    m.add_argument("--kv-channels", type=int, help="head dim; default hidden / heads")
    m.add_argument("--max-position-embeddings", type=int)
    m.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    _bool(m, "--apply-layernorm-1p", "store norm weights centred on zero (gamma - 1), applied as 1 + weight")
    m.add_argument("--norm-epsilon", type=float, default=1e-5)
    _bool(m, "--swiglu", "SwiGLU MLP (Llama)")
    _bool(m, "--openai-gelu", "tanh-approximated GELU (GPT-2's gelu_new)")
    m.add_argument(
        "--position-embedding-type", default="learned_absolute", choices=["learned_absolute", "rope", "none"]
    )
    m.add_argument("--rotary-base", type=float, default=10000.0)
    m.add_argument("--rotary-percent", type=float, default=1.0, help="only 1.0 (rotate the whole head) is supported")
    _bool(m, "--use-rope-scaling", "Llama-3 RoPE frequency scaling")
    m.add_argument("--rope-scaling-factor", type=float, default=8.0)
    m.add_argument(
        "--window-size",
        type=_window_size,
        help="sliding-window attention as (left, right) like Megatron/Transformer Engine, e.g. 4095,0: each "
        "token sees itself and the 4095 before it (Mistral's sliding_window 4096); right must be 0",
    )
    _bool(m, "--untie-embeddings-and-output-weights", "separate output layer (Llama)")
    _bool(m, "--disable-bias-linear", "no biases in linear layers (Llama)")
    _bool(m, "--add-qkv-bias", "bias on QKV only (Qwen2)")
    m.add_argument("--init-method-std", type=float, default=0.02)
    m.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    m.add_argument("--hidden-dropout", type=float, default=0.1)
    m.add_argument("--attention-dropout", type=float, default=0.1)
    m.add_argument("--recompute-granularity", choices=["full", "selective"])
    m.add_argument("--recompute-method", choices=["uniform", "block"])
    m.add_argument("--recompute-num-layers", type=int)
    m.add_argument("--recompute-modules", nargs="+", default=["core_attn"])
    e = parser.add_argument_group("mixture of experts")
    e.add_argument("--num-experts", type=int)
    e.add_argument("--moe-router-topk", type=int, default=2)
    e.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default="softmax")
    _bool(e, "--moe-router-pre-softmax", "softmax over all experts before top-k")
    e.add_argument("--moe-ffn-hidden-size", type=int)
    e.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "none"], default="aux_loss")
    e.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    e.add_argument("--moe-z-loss-coeff", type=float)
    _bool(e, "--moe-router-enable-expert-bias", "aux-loss-free balancing (needs sigmoid scores)")
    e.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    e.add_argument("--moe-expert-capacity-factor", type=float, help="dropless when unset")
    e.add_argument("--moe-token-drop-policy", choices=["probs", "position"], default="probs")
    e.add_argument("--moe-layer-freq", default="1", help="N (every Nth layer) or a 0/1 list, e.g. 0,1,1,1")
    e.add_argument("--moe-shared-expert-intermediate-size", type=int)
    e.add_argument("--moe-token-dispatcher-type", choices=["alltoall", "allgather"], default="alltoall")
    m.add_argument("--kernel-impl", choices=["torch", "triton"], default=None, help="default: triton on CUDA")

    d = parser.add_argument_group("distributed")
    d.add_argument("--tensor-model-parallel-size", type=int, default=1)
    d.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    d.add_argument("--context-parallel-size", type=int, default=1, help="split each sequence over this many ranks")
    d.add_argument(
        "--cp-comm-type",
        default="p2p",
        help="context-parallel attention: p2p (ring, zigzag load balance), a2a (all-to-all over heads), allgather",
    )
    d.add_argument(
        "--hierarchical-context-parallel-sizes", type=int, nargs="+", help="not implemented (refused at start-up)"
    )
    d.add_argument("--expert-model-parallel-size", type=int, default=1)
    d.add_argument("--expert-tensor-parallel-size", type=int)
    d.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    d.add_argument("--num-virtual-stages-per-pipeline-rank", type=int)
    d.add_argument("--decoder-first-pipeline-num-layers", type=int, help="layers of the first stage (uneven split)")
    d.add_argument("--decoder-last-pipeline-num-layers", type=int, help="layers of the last stage (uneven split)")
    _bool(d, "--sequence-parallel", "Megatron sequence parallelism (needs TP > 1)")
    _bool(d, "--overlap-grad-reduce", "launch each gradient bucket's all-reduce during the backward")
    _bool(d, "--tp-comm-overlap", "sequence-parallel GEMMs as TP rings overlapping all-gather / reduce-scatter")
    _bool(d, "--overlap-p2p-comm", "pipeline: wait on each receive only when its data is needed (default with VP)")
    _bool(d, "--no-overlap-p2p-communication", "pipeline: wait on every receive before the next compute")
    _bool(
        d,
        "--overlap-moe-expert-parallel-comm",
        "MoE: dispatch in chunks, each chunk's all-to-all under the previous chunk's experts",
    )
    d.add_argument("--ddp-bucket-size", type=int)
    d.add_argument("--distributed-backend", choices=["nccl", "gloo"], help="default: nccl on CUDA, gloo on CPU")
    d.add_argument("--distributed-timeout-minutes", type=float, default=10.0)

    t = parser.add_argument_group("training")
    t.add_argument("--micro-batch-size", type=int, default=1)
    t.add_argument("--global-batch-size", type=int)
    t.add_argument("--seq-length", type=int)
    t.add_argument("--train-iters", type=int)
    t.add_argument("--train-samples", type=int, help="the run's length in samples (instead of --train-iters)")
    t.add_argument(
        "--rampup-batch-size",
        type=int,
        nargs=3,
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="grow the global batch from START by INCREMENT over the first SAMPLES samples",
    )
    t.add_argument("--exit-interval", type=int)
    t.add_argument("--exit-duration-in-mins", type=float)
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--eval-interval", type=int, default=1000)
    t.add_argument("--eval-iters", type=int, default=100)
    _bool(t, "--dry-run", "build on the meta device, validate, print parameters and memory per rank, exit")

    o = parser.add_argument_group("optimizer and learning rate")
    o.add_argument("--optimizer", default="adam", choices=["adam"])
    o.add_argument("--lr", type=float, default=1e-4)
    o.add_argument("--min-lr", type=float, default=0.0)
    o.add_argument("--lr-decay-style", default="linear", choices=list(DECAY_STYLES))
    o.add_argument("--lr-decay-iters", type=int)
    o.add_argument("--lr-warmup-iters", type=int, default=0)
    o.add_argument("--lr-warmup-fraction", type=float)
    o.add_argument("--lr-warmup-init", type=float, default=0.0)
    o.add_argument("--lr-wsd-decay-style", default="exponential", choices=list(WSD_DECAY_STYLES))
    o.add_argument("--lr-wsd-decay-iters", type=int)
    o.add_argument("--lr-decay-samples", type=int, help="with --train-samples (default: --train-samples)")
    o.add_argument("--lr-warmup-samples", type=int, default=0, help="with --train-samples")
    o.add_argument("--lr-wsd-decay-samples", type=int, help="with --train-samples")
    o.add_argument("--decoupled-lr", type=float, help="peak rate of the word embeddings and the output layer")
    o.add_argument("--decoupled-min-lr", type=float, help="their floor (default: --min-lr)")
    o.add_argument("--weight-decay", type=float, default=0.01)
    _bool(o, "--use-distributed-optimizer", "shard fp32 main weights and Adam moments over data parallelism (ZeRO-1)")
    _bool(
        o,
        "--overlap-param-gather",
        "with --use-distributed-optimizer: all-gather updated weights under the next forward",
    )
    _bool(o, "--use-torch-fsdp2", "ZeRO-3 through PyTorch FSDP2: parameters sharded over data parallelism")
    o.add_argument(
        "--zero-stage", type=int, default=1, help="2: with --use-distributed-optimizer, shard gradients too (ZeRO-2)"
    )
    o.add_argument("--clip-grad", type=float, default=1.0)
    o.add_argument("--adam-beta1", type=float, default=0.9)
    o.add_argument("--adam-beta2", type=float, default=0.999)
    o.add_argument("--adam-eps", type=float, default=1e-8)
    _bool(o, "--use-apex-adam", "NVIDIA apex FusedAdam (must be installed)")

    p = parser.add_argument_group("mixed precision")
    _bool(p, "--bf16", "bf16 weights and activations, fp32 main weights and gradients")
    _bool(p, "--fp16", "fp16 with dynamic loss scaling")
    p.add_argument("--loss-scale", type=float, help="constant loss scale (fp16); dynamic when unset")
    p.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    p.add_argument("--min-loss-scale", type=float, default=1.0)
    p.add_argument("--loss-scale-window", type=int, default=1000)
    p.add_argument("--hysteresis", type=int, default=2)

    a = parser.add_argument_group("data")
    a.add_argument("--data-path", nargs="+", help="PREFIX, or W1 PREFIX1 W2 PREFIX2 ...; default: embedded corpus")
    a.add_argument("--split", default="969,30,1")
    _bool(a, "--mock-data", "synthetic tokens (needs --vocab-size)")
    a.add_argument("--tokenizer-type", choices=list(TOKENIZER_TYPES))
    a.add_argument(
        "--tokenizer-model",
        help="tokenizer.json for HuggingFaceTokenizer; for Llama2Tokenizer / GPTSentencePieceTokenizer the "
        "tokenizer.model (the tokenizer.json beside it is read) or that tokenizer.json",
    )
    a.add_argument("--vocab-file")
    a.add_argument("--merge-file")
    a.add_argument("--vocab-size", type=int)
    a.add_argument("--data-cache-path")
    a.add_argument("--num-workers", type=int, default=0)
    _bool(a, "--eod-mask-loss", "no loss on end-of-document tokens")
    _bool(a, "--sft", "--data-path is a JSONL file of {prompt, response} records; loss on the responses only")

    c = parser.add_argument_group("checkpointing")
    c.add_argument("--save")
    c.add_argument("--load")
    c.add_argument("--save-interval", type=int)
    _bool(c, "--no-load-optim", "load weights but not the optimizer state")
    _bool(c, "--no-load-rng", "do not restore random-number-generator states")
    _bool(c, "--finetune", "load weights only and start from iteration 0")
    _bool(c, "--use-checkpoint-args", "take the model configuration from the checkpoint")
    _bool(c, "--exit-on-missing-checkpoint", "fail instead of starting from scratch when --load has none")
    _bool(c, "--async-save", "write checkpoints in a background thread while training continues")
    c.add_argument("--ckpt-keep-last", type=int, help="keep only the newest N checkpoints under --save")

    lo = parser.add_argument_group("LoRA fine-tuning")
    lo.add_argument("--lora-rank", type=int, default=0, help="train rank-r adapters on a frozen base (0: off)")
    lo.add_argument("--lora-alpha", type=float, default=16.0, help="adapters scaled by alpha / rank")
    lo.add_argument("--lora-dropout", type=float, default=0.0)
    lo.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        help="our layer names or PEFT's (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj); add experts "
        "for every routed expert's fc1 and fc2 (PEFT's experts.gate_up_proj and experts.down_proj)",
    )
    _bool(lo, "--qlora", "store the adapted layers' frozen weights in NF4 (4.127 bits per parameter)")

    f = parser.add_argument_group("fault tolerance")
    _bool(f, "--no-auto-resume", "with --save DIR holding a checkpoint and no --load, start over instead of resuming")
    _bool(f, "--exit-signal-handler", "on --exit-signal, every rank saves at the next iteration and exits 0")
    f.add_argument("--exit-signal", default="SIGTERM", help="the signal --exit-signal-handler acts on")
    f.add_argument(
        "--check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_true",
        default=True,
        help="(default) a non-finite loss or gradient norm skips the update and applies --nan-policy",
    )
    f.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_false")
    f.add_argument(
        "--nan-policy",
        default="halt",
        help="skip (the step), halt (naming the iteration, rank and parameter) or rollback (to the last "
        "checkpoint, skipping the offending batch)",
    )
    _bool(f, "--check-for-spiky-loss", "report a loss whose z-score over the last iterations exceeds a bound")
    f.add_argument("--spiky-loss-window", type=int, default=50, help="iterations the z-score is taken over")
    f.add_argument("--spiky-loss-zscore", type=float, default=6.0, help="a loss above mean + Z std is a spike")
    f.add_argument("--spiky-loss-policy", default="report", help="report, or rollback like --nan-policy rollback")
    _bool(f, "--log-straggler", "per-rank step and compute time (min, median, max, slowest rank) every log interval")
    _bool(f, "--disable-flight-recorder", "do not record collectives (a hang then ends only at the gloo/NCCL timeout)")

    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--log-jsonl", help="write one JSON object per logged iteration to this file")
    _bool(g, "--log-memory-breakdown", "log bytes of parameters, gradients, optimizer state and peak activations")
    _bool(g, "--log-params-norm", "log the parameters' L2 norm (each counted once over the layout)")
    _bool(g, "--log-num-zeros-in-grad", "log the number of zero entries in the gradients")
    g.add_argument("--wandb-project")
    g.add_argument("--wandb-exp-name")
    g.add_argument("--wandb-save-dir")
    g.add_argument("--tensorboard-dir")
    _bool(g, "--profile", "profile iterations (--profile-step-start, --profile-step-end] on --profile-ranks")
    _bool(g, "--use-pytorch-profiler", "with --profile: a torch.profiler trace in --tensorboard-dir (else nsys)")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0])
    g.add_argument("--profile-dir", help="where --use-pytorch-profiler writes its trace (default: --tensorboard-dir)")

    add_megatron_flag_groups(parser)
    return parser


def _kernel_impl(requested: str | None, backend: str | None = None) -> str:
    """Triton on CUDA, PyTorch on a CPU, unless asked; Triton where it cannot run is refused, not ignored. A gloo
    job runs on CPU tensors even on a GPU machine."""
    import os

    import torch

    from megatron_lite.kernels import HAVE_TRITON

    on_gpu = torch.cuda.is_available() and backend != "gloo"
    runnable = HAVE_TRITON and (on_gpu or os.environ.get("TRITON_INTERPRET") == "1")
    if requested is None:
        return "triton" if runnable and on_gpu else "torch"
    if requested == "triton" and not runnable:
        where = "--distributed-backend gloo runs on CPU tensors" if torch.cuda.is_available() else "no CUDA GPU"
        raise ConfigError(
            f"--kernel-impl triton needs a CUDA GPU with triton installed ({where}); use --kernel-impl torch (or "
            "TRITON_INTERPRET=1 for the slow CPU interpreter)"
        )
    return requested


def _layer_freq(text) -> int | tuple[int, ...]:
    """Megatron's --moe-layer-freq: an integer N, or a per-layer pattern ("0,1,1" or "[0,1,1]")."""
    if isinstance(text, (int, tuple, list)):
        return text if isinstance(text, int) else tuple(text)
    body = str(text).strip().strip("[]() ")
    try:
        values = [int(x) for x in body.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--moe-layer-freq {text!r} must be an integer or a comma-separated 0/1 list") from None
    return values[0] if len(values) == 1 else tuple(values)


def _require(ns: argparse.Namespace, *names: str) -> None:
    missing = ["--" + n.replace("_", "-") for n in names if getattr(ns, n) is None]
    if missing:
        raise ConfigError(f"missing required flag(s): {' '.join(missing)}")


def _check_run_length(ns: argparse.Namespace) -> None:
    """Iteration-based or sample-based, never both (Megatron's rule), schedule flags in the run's unit."""
    if ns.train_iters is None and ns.train_samples is None:
        raise ConfigError("missing required flag: --train-iters N (or --train-samples N)")
    if ns.train_iters is not None and ns.train_samples is not None:
        raise ConfigError("--train-iters and --train-samples are exclusive; keep one")
    by_iters = {"--lr-decay-iters": ns.lr_decay_iters, "--lr-warmup-iters": ns.lr_warmup_iters or None,
                "--lr-wsd-decay-iters": ns.lr_wsd_decay_iters}  # fmt: skip
    by_samples = {"--lr-decay-samples": ns.lr_decay_samples, "--lr-warmup-samples": ns.lr_warmup_samples or None,
                  "--lr-wsd-decay-samples": ns.lr_wsd_decay_samples}  # fmt: skip
    wrong = by_iters if ns.train_samples is not None else by_samples
    for flag, value in wrong.items():
        if value is not None:
            run, other = (
                ("--train-samples", "-samples") if ns.train_samples is not None else ("--train-iters", "-iters")
            )
            raise ConfigError(f"{flag} {value} does not go with {run}: use the {other} form of the flag")


def job_config_from_args(ns: argparse.Namespace) -> JobConfig:
    refuse_unsupported(ns)
    _require(ns, "num_layers", "hidden_size", "num_attention_heads", "seq_length")
    _check_run_length(ns)
    if ns.rotary_percent != 1.0:
        raise ConfigError(f"--rotary-percent {ns.rotary_percent} is not supported; only 1.0 (full rotary)")
    if ns.overlap_p2p_comm and ns.no_overlap_p2p_communication:
        raise ConfigError("--overlap-p2p-comm and --no-overlap-p2p-communication contradict each other; keep one")
    if ns.overlap_moe_expert_parallel_comm and ns.moe_token_dispatcher_type != "alltoall":
        raise ConfigError(
            f"--overlap-moe-expert-parallel-comm overlaps the all-to-all dispatcher's exchanges; it does nothing with "
            f"--moe-token-dispatcher-type {ns.moe_token_dispatcher_type}: use alltoall or drop the flag"
        )
    if ns.hierarchical_context_parallel_sizes is not None:
        raise ConfigError(
            "--hierarchical-context-parallel-sizes (--cp-comm-type a2a+p2p) is not supported; use --cp-comm-type "
            "p2p, a2a or allgather"
        )
    kernel_impl = _kernel_impl(ns.kernel_impl, ns.distributed_backend)
    vocab = ns.vocab_size
    model = ModelConfig(
        num_layers=ns.num_layers,
        hidden_size=ns.hidden_size,
        num_attention_heads=ns.num_attention_heads,
        vocab_size=vocab if vocab is not None else 1,  # replaced once the tokenizer is known
        ffn_hidden_size=ns.ffn_hidden_size,
        num_query_groups=ns.num_query_groups if ns.group_query_attention else None,
        kv_channels=ns.kv_channels,
        max_position_embeddings=ns.max_position_embeddings or ns.seq_length,
        make_vocab_size_divisible_by=ns.make_vocab_size_divisible_by,
        normalization=ns.normalization,
        apply_layernorm_1p=ns.apply_layernorm_1p,
        norm_epsilon=ns.norm_epsilon,
        activation="swiglu" if ns.swiglu else ("gelu_tanh" if ns.openai_gelu else "gelu"),
        position_embedding_type=ns.position_embedding_type,
        rotary_base=ns.rotary_base,
        # The checkpoint's full Llama-3 parameters (low/high frequency factors, original length) have no flags.
        rope_scaling=RopeScaling(
            **{**(getattr(ns, "rope_scaling_params", None) or {}), "factor": ns.rope_scaling_factor}
        )
        if ns.use_rope_scaling
        else None,
        sliding_window=ns.window_size,
        add_bias_linear=not ns.disable_bias_linear,
        add_qkv_bias=ns.add_qkv_bias,
        untie_embeddings_and_output_weights=ns.untie_embeddings_and_output_weights,
        init_method_std=ns.init_method_std,
        hidden_dropout=ns.hidden_dropout,
        attention_dropout=ns.attention_dropout,
        recompute_granularity=ns.recompute_granularity,
        recompute_method=ns.recompute_method,
        recompute_num_layers=ns.recompute_num_layers,
        recompute_modules=tuple(ns.recompute_modules),
        kernel_impl=kernel_impl,
        num_experts=ns.num_experts,
        moe_router_topk=ns.moe_router_topk,
        moe_router_score_function=ns.moe_router_score_function,
        moe_router_pre_softmax=ns.moe_router_pre_softmax,
        moe_ffn_hidden_size=ns.moe_ffn_hidden_size,
        moe_router_load_balancing_type=ns.moe_router_load_balancing_type,
        moe_aux_loss_coeff=ns.moe_aux_loss_coeff,
        moe_z_loss_coeff=ns.moe_z_loss_coeff,
        moe_router_enable_expert_bias=ns.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=ns.moe_router_bias_update_rate,
        moe_expert_capacity_factor=ns.moe_expert_capacity_factor,
        moe_token_drop_policy=ns.moe_token_drop_policy,
        moe_layer_freq=_layer_freq(ns.moe_layer_freq),
        moe_shared_expert_intermediate_size=ns.moe_shared_expert_intermediate_size,
        moe_token_dispatcher_type=ns.moe_token_dispatcher_type,
    )
    vp = ns.num_virtual_stages_per_pipeline_rank
    if ns.num_layers_per_virtual_pipeline_stage is not None:
        per_rank = ns.num_layers // ns.pipeline_model_parallel_size
        if per_rank % ns.num_layers_per_virtual_pipeline_stage:
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage {ns.num_layers_per_virtual_pipeline_stage} does not "
                f"divide the {per_rank} layers of each pipeline rank"
            )
        vp = per_rank // ns.num_layers_per_virtual_pipeline_stage
    parallel = ParallelConfig(
        tensor_model_parallel_size=ns.tensor_model_parallel_size,
        pipeline_model_parallel_size=ns.pipeline_model_parallel_size,
        context_parallel_size=ns.context_parallel_size,
        cp_comm_type=ns.cp_comm_type,
        expert_model_parallel_size=ns.expert_model_parallel_size,
        expert_tensor_parallel_size=ns.expert_tensor_parallel_size,
        virtual_pipeline_model_parallel_size=vp,
        sequence_parallel=ns.sequence_parallel,
        tp_comm_overlap=ns.tp_comm_overlap,
        overlap_p2p_comm=False if ns.no_overlap_p2p_communication else (True if ns.overlap_p2p_comm else None),
        overlap_moe_expert_parallel_comm=ns.overlap_moe_expert_parallel_comm,
        decoder_first_pipeline_num_layers=ns.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=ns.decoder_last_pipeline_num_layers,
    )
    training = TrainingConfig(
        micro_batch_size=ns.micro_batch_size,
        global_batch_size=ns.global_batch_size,
        seq_length=ns.seq_length,
        train_iters=ns.train_iters or 0,  # with --train-samples: resolved at start-up
        train_samples=ns.train_samples,
        rampup_batch_size=tuple(ns.rampup_batch_size) if ns.rampup_batch_size else None,
        seed=ns.seed,
        log_interval=ns.log_interval,
        eval_interval=ns.eval_interval,
        eval_iters=ns.eval_iters,
        exit_interval=ns.exit_interval,
        exit_duration_in_mins=ns.exit_duration_in_mins,
        overlap_grad_reduce=ns.overlap_grad_reduce,
        ddp_bucket_size=ns.ddp_bucket_size,
    )
    warmup, warmup_samples = ns.lr_warmup_iters, ns.lr_warmup_samples
    if ns.lr_warmup_fraction is not None and ns.train_samples is not None:
        warmup_samples = int(ns.lr_warmup_fraction * (ns.lr_decay_samples or ns.train_samples))
    elif ns.lr_warmup_fraction is not None:
        warmup = int(ns.lr_warmup_fraction * (ns.lr_decay_iters or ns.train_iters))
    optimizer = OptimizerConfig(
        use_distributed_optimizer=ns.use_distributed_optimizer,
        zero_stage=ns.zero_stage,
        use_torch_fsdp2=ns.use_torch_fsdp2,
        overlap_param_gather=ns.overlap_param_gather,
        lr=ns.lr,
        min_lr=ns.min_lr,
        lr_decay_style=ns.lr_decay_style,
        lr_decay_iters=ns.lr_decay_iters,
        lr_warmup_iters=warmup,
        lr_warmup_init=ns.lr_warmup_init,
        lr_wsd_decay_style=ns.lr_wsd_decay_style,
        lr_wsd_decay_iters=ns.lr_wsd_decay_iters,
        lr_decay_samples=ns.lr_decay_samples,
        lr_warmup_samples=warmup_samples,
        lr_wsd_decay_samples=ns.lr_wsd_decay_samples,
        decoupled_lr=ns.decoupled_lr,
        decoupled_min_lr=ns.decoupled_min_lr,
        weight_decay=ns.weight_decay,
        adam_beta1=ns.adam_beta1,
        adam_beta2=ns.adam_beta2,
        adam_eps=ns.adam_eps,
        clip_grad=ns.clip_grad,
        bf16=ns.bf16,
        fp16=ns.fp16,
        loss_scale=ns.loss_scale,
        initial_loss_scale=ns.initial_loss_scale,
        min_loss_scale=ns.min_loss_scale,
        loss_scale_window=ns.loss_scale_window,
        hysteresis=ns.hysteresis,
        use_apex_adam=ns.use_apex_adam,
        check_for_nan_in_loss_and_grad=ns.check_for_nan_in_loss_and_grad,
    )
    data = DataConfig(
        data_path=tuple(ns.data_path or ()),
        split=ns.split,
        mock_data=ns.mock_data,
        tokenizer_type=ns.tokenizer_type,
        tokenizer_model=ns.tokenizer_model,
        vocab_file=ns.vocab_file,
        merge_file=ns.merge_file,
        vocab_size=ns.vocab_size,
        data_cache_path=ns.data_cache_path,
        num_workers=ns.num_workers,
        eod_mask_loss=ns.eod_mask_loss,
        sft=ns.sft,
    )
    checkpoint = CheckpointConfig(
        save=ns.save,
        load=ns.load,
        save_interval=ns.save_interval,
        no_load_optim=ns.no_load_optim,
        no_load_rng=ns.no_load_rng,
        finetune=ns.finetune,
        use_checkpoint_args=ns.use_checkpoint_args,
        exit_on_missing_checkpoint=ns.exit_on_missing_checkpoint,
        async_save=ns.async_save,
        ckpt_keep_last=ns.ckpt_keep_last,
    )
    logging = LoggingConfig(
        log_jsonl=ns.log_jsonl,
        wandb_project=ns.wandb_project,
        wandb_exp_name=ns.wandb_exp_name,
        wandb_save_dir=ns.wandb_save_dir,
        tensorboard_dir=ns.tensorboard_dir,
        log_memory_breakdown=ns.log_memory_breakdown,
        log_params_norm=ns.log_params_norm,
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
        lora = LoraConfig(ns.lora_rank, ns.lora_alpha, ns.lora_dropout, targets, ns.qlora)
        lora.validate(model.num_experts, parallel.tp_comm_overlap)
        if lora.qlora and optimizer.use_torch_fsdp2:
            raise ConfigError(
                "--qlora with --use-torch-fsdp2 is not supported: FSDP2 shards the weights before they are "
                "quantised; use --use-distributed-optimizer (or plain data parallelism) instead"
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
    )


def _explicit_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    actions = parser._option_string_actions
    return {actions[tok.split("=")[0]].dest for tok in argv if tok.split("=")[0] in actions}


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, JobConfig]:
    """Parse the flags. With --load pointing at a checkpoint, flags not given take the checkpoint's values,
    so `--load DIR` alone rebuilds and continues the run."""
    import sys

    from megatron_lite.checkpoint.checkpointing import find_checkpoint, read_metadata

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = parser.parse_args(argv)
    path = find_checkpoint(ns.load) if ns.load else None
    if path is not None:
        saved = defaults_from_checkpoint(read_metadata(path)["config"])
        given = _explicit_dests(parser, argv)
        conflicts = [d for d in ARCH_DESTS if d in given and getattr(ns, d) != saved.get(d)]
        if conflicts and not ns.use_checkpoint_args:
            d = conflicts[0]
            raise ConfigError(
                f"--{d.replace('_', '-')} {getattr(ns, d)} conflicts with the checkpoint in {path} "
                f"({saved.get(d)}); drop the flag, or pass --use-checkpoint-args to take the checkpoint's value"
            )
        # a run's length given in the other unit than the checkpoint's replaces it, schedule lengths included
        other = {"train_iters": "samples", "train_samples": "iters"}
        for dest, unit in other.items():
            if dest in given:
                saved = {k: v for k, v in saved.items() if not (k.startswith("train_") or k.endswith(unit))}
        parser.set_defaults(**{k: v for k, v in saved.items() if hasattr(ns, k)})
        ns = parser.parse_args(argv)
        ns.rope_scaling_params = saved.get("rope_scaling_params")
        if ns.use_checkpoint_args:
            for d in ARCH_DESTS:
                setattr(ns, d, saved.get(d, getattr(ns, d)))
    return ns, job_config_from_args(ns)
