"""The command-line flags themselves: Megatron-LM's names, defaults and groups (`--help` lists them by group).
arguments.py turns the parsed flags into the config dataclasses."""

from __future__ import annotations

import argparse

from megatron_lite.data.flags import add_data_flags
from megatron_lite.flag_help import add_missing_help, add_off_switches
from megatron_lite.megatron_flags import add_megatron_flag_groups
from megatron_lite.moe.flags import add_moe_flags
from megatron_lite.one_line_parser import OneLineErrorParser  # (the tools import it from here too)
from megatron_lite.optimizer.config import (
    DECAY_STYLES,
    MUON_MATMUL_PRECS,
    MUON_SCALE_MODES,
    MUON_TP_MODES,
    WD_INCR_STYLES,
    WSD_DECAY_STYLES,
)


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


def _skip_freq(text: str) -> int | tuple[int, ...]:
    """--window-attn-skip-freq, read as --moe-layer-freq is (an integer or a 0/1 pattern), so a checkpoint's value
    compares with the flag's."""
    from megatron_lite.config import ConfigError
    from megatron_lite.flag_values import layer_freq

    try:
        return layer_freq(text, "--window-attn-skip-freq")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _no_rope_freq(text: str) -> int | tuple[int, ...]:
    """--no-rope-freq, read as --window-attn-skip-freq is, so a checkpoint's value compares with the flag's."""
    from megatron_lite.config import ConfigError
    from megatron_lite.flag_values import layer_freq

    try:
        return layer_freq(text, "--no-rope-freq")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _bool(p: argparse._ArgumentGroup, flag: str, help: str, *aliases: str) -> None:
    p.add_argument(flag, *aliases, action="store_true", help=help)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="pretrain_gpt.py",
        description="megatron_lite GPT/Llama pretraining (launch with torchrun). Flag names follow Megatron-LM.",
        allow_abbrev=False,
    )
    m = parser.add_argument_group("model")
    m.add_argument("--num-layers", type=int, required=False)
    m.add_argument("--hidden-size", type=int)
    m.add_argument(
        "--ffn-hidden-size", type=int, help="default 4 x hidden size; with --swiglu int(8 x hidden / 3 / 64) x 64"
    )
    m.add_argument("--num-attention-heads", type=int)
    _bool(m, "--group-query-attention", "use --num-query-groups key/value heads")
    m.add_argument(
        "--num-query-groups", type=int, default=1, help="with --group-query-attention (default 1; else one a head)"
    )
    m.add_argument("--kv-channels", type=int, help="head dim; default hidden / heads")
    m.add_argument("--max-position-embeddings", type=int)
    m.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    _bool(m, "--apply-layernorm-1p", "store norm weights centred on zero (gamma - 1), applied as 1 + weight")
    _bool(
        m,
        "--apply-residual-connection-post-layernorm",
        "the residual is each norm's output, not its input (the original BERT ordering)",
    )
    m.add_argument("--norm-epsilon", type=float, default=1e-5)
    _bool(m, "--swiglu", "SwiGLU MLP (Llama)")
    _bool(m, "--openai-gelu", "tanh-approximated GELU (GPT-2's gelu_new)")
    _bool(
        m,
        "--no-bias-gelu-fusion",
        "exact GELU: Megatron's default GELU with biases is its fused bias-GELU, the tanh approximation, which "
        "this flag turns off (without biases GELU is exact)",
    )
    _bool(m, "--squared-relu", "squared ReLU activation, relu(x)^2 (Nemotron)")
    _bool(m, "--quick-geglu", "gated MLP with quick GELU, x * sigmoid(1.702 x), on the gate (gpt-oss)")
    m.add_argument(
        "--glu-linear-offset", type=float, default=0.0, help="with --quick-geglu: act(gate) * (up + offset); gpt-oss: 1"
    )
    m.add_argument(
        "--activation-func-clamp-value",
        type=float,
        help="with --quick-geglu: the gate clamped to <= value and up to [-value, value] (gpt-oss: 7)",
    )
    m.add_argument(
        "--position-embedding-type", default="learned_absolute", choices=["learned_absolute", "rope", "none"]
    )
    m.add_argument(
        "--use-rotary-position-embeddings",
        dest="position_embedding_type",
        action="store_const",
        const="rope",
        help="Megatron's deprecated spelling of --position-embedding-type rope",
    )
    m.add_argument("--rotary-base", type=float, default=10000.0)
    m.add_argument(
        "--rotary-percent", type=float, default=1.0, help="fraction of each head's dims RoPE rotates (the first ones)"
    )
    _bool(m, "--rotary-interleaved", "RoPE rotates each head's dim pairs (0, 1), (2, 3), ... instead of its halves")
    _bool(m, "--use-rope-scaling", "Llama-3 RoPE frequency scaling")
    _bool(m, "--is-hybrid-model", "a hybrid Mamba model (Nemotron-H): Mamba-2, attention, MLP and MoE layers")
    m.add_argument("--hybrid-attention-ratio", type=float, default=0.0, help="share of attention layers (hybrid)")
    m.add_argument("--hybrid-mlp-ratio", type=float, default=0.0, help="share of MLP layers (hybrid)")
    m.add_argument(
        "--hybrid-override-pattern", help="each layer's kind, e.g. M-M*-: M Mamba, * attention, - MLP, E MoE"
    )
    m.add_argument(
        "--heterogeneous-layers-config-path",
        help="a Hugging Face config.json (Llama-Nemotron, DeciLM) whose block_configs give each layer its own shape",
    )
    m.add_argument(
        "--heterogeneous-layers-config-encoded-json",
        help="the text of such a config.json (used in place of the path's file when both are given, as Megatron)",
    )
    m.add_argument("--mamba-state-dim", type=int, default=128, help="the SSM state size N per group")
    m.add_argument("--mamba-head-dim", type=int, default=64, help="the dims P of each Mamba head")
    m.add_argument("--mamba-num-groups", type=int, default=8, help="the B / C groups (divisible by TP)")
    m.add_argument("--mamba-num-heads", type=int, help="Mamba heads (default 2 x hidden / --mamba-head-dim)")
    m.add_argument("--rope-scaling-factor", type=float, default=8.0)
    m.add_argument(
        "--window-size",
        type=_window_size,
        help="sliding-window attention as (left, right) like Megatron/Transformer Engine, e.g. 4095,0: each "
        "token sees itself and the 4095 before it (Mistral's sliding_window 4096); right must be 0",
    )
    m.add_argument(
        "--window-attn-skip-freq",
        type=_skip_freq,
        help="which layers --window-size windows: N, every Nth layer attends fully (gpt-oss: 2); or a per-layer "
        "pattern, 1 = window, e.g. '[1,1,1,0]*3'",
    )
    m.add_argument(
        "--softmax-type",
        default="vanilla",
        choices=("vanilla", "off-by-one", "learnable"),
        help="attention softmax: vanilla, off-by-one (an extra zero logit per query), learnable (a learned logit "
        "per head: gpt-oss's attention sinks)",
    )
    m.add_argument(
        "--no-rope-freq",
        type=_no_rope_freq,
        help="which layers skip RoPE (Llama 4's NoPE layers): N, every Nth layer (1-based: N, 2N, ...; Llama 4: 4); "
        "or a per-layer pattern, 1 = no RoPE, e.g. '([0]*3+[1])*3'",
    )
    _bool(m, "--qk-l2-norm", "scale each query and key head to unit RMS before RoPE, no weight (Llama 4)")
    # (not Megatron's: Hugging Face's Llama 4, set by its converter; see models/attention_variants.py)
    _bool(m, "--qk-l2-norm-rope-only", "--qk-l2-norm on the RoPE layers only, as Hugging Face's Llama 4")
    m.add_argument("--attention-chunk-size", type=int, help="Llama 4's chunked attention on the RoPE layers: a "
                   "query sees earlier keys of its own chunk of N absolute positions only")  # fmt: skip
    m.add_argument("--attn-temperature-floor-scale", type=int, help="Llama 4's NoPE-layer temperature tuning: "
                   "queries times log1p(floor((pos + 1) / N)) x --attn-temperature-scale + 1")  # fmt: skip
    m.add_argument("--attn-temperature-scale", type=float, default=0.1, help="its strength (Llama 4: 0.1)")
    _bool(
        m,
        "--attention-output-gate",
        "gate the attention output by sigmoid of a per-head, per-dim gate made by linear_qkv (Qwen3-Next)",
    )
    _bool(m, "--untie-embeddings-and-output-weights", "separate output layer (Llama)")
    _bool(m, "--disable-bias-linear", "no biases in linear layers (Llama)")
    _bool(m, "--add-qkv-bias", "bias on QKV only (Qwen2)")
    _bool(
        m,
        "--qk-layernorm",
        "normalise each query and key head over head_dim before RoPE (Qwen3); with --multi-latent-attention, "
        "RMS-normalise the query and key/value latents (DeepSeek)",
    )
    from megatron_lite.flag_groups_deepseek import add_deepseek_groups  # (it imports this module's _bool)

    add_deepseek_groups(parser)
    m.add_argument("--init-method-std", type=float, default=0.02)
    m.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    m.add_argument("--hidden-dropout", type=float, default=0.1)
    m.add_argument("--attention-dropout", type=float, default=0.1)
    m.add_argument("--recompute-granularity", choices=["full", "selective"])
    m.add_argument(
        "--recompute-activations",
        dest="recompute_granularity",
        action="store_const",
        const="selective",
        help="Megatron's older spelling of --recompute-granularity selective",
    )
    m.add_argument("--recompute-method", choices=["uniform", "block"])
    m.add_argument("--recompute-num-layers", type=int)
    m.add_argument("--recompute-modules", nargs="+", default=["core_attn"])
    add_moe_flags(parser)
    m.add_argument("--kernel-impl", choices=["torch", "triton"], default=None, help="default: triton on CUDA")

    d = parser.add_argument_group("distributed")
    d.add_argument("--tensor-model-parallel-size", type=int, default=1)
    d.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    d.add_argument("--context-parallel-size", type=int, default=1, help="split each sequence over this many ranks")
    d.add_argument(
        "--cp-comm-type",
        nargs="+",
        default=["p2p"],
        help="context-parallel attention: p2p (ring, zigzag load balance), a2a (all-to-all over heads), allgather, "
        "a2a+p2p (with --hierarchical-context-parallel-sizes); Megatron's one value per layer is taken when all agree",
    )
    d.add_argument(
        "--hierarchical-context-parallel-sizes",
        type=int,
        nargs="+",
        help="A P with --cp-comm-type a2a+p2p: all-to-all in groups of A adjacent CP ranks, a ring over the P groups",
    )
    d.add_argument("--expert-model-parallel-size", type=int, default=1)
    d.add_argument("--expert-tensor-parallel-size", type=int)
    d.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    d.add_argument("--num-virtual-stages-per-pipeline-rank", type=int)
    d.add_argument("--decoder-first-pipeline-num-layers", type=int, help="layers of the first stage (uneven split)")
    d.add_argument("--decoder-last-pipeline-num-layers", type=int, help="layers of the last stage (uneven split)")
    _bool(
        d,
        "--account-for-embedding-in-pipeline-split",
        "count the embedding as a layer: the first stage holds one fewer",
    )
    _bool(d, "--account-for-loss-in-pipeline-split", "count the loss as a layer: the last stage holds one fewer")
    d.add_argument(
        "--pipeline-model-parallel-layout",
        help='the layers of every (virtual) stage, e.g. "Et*3|(t*4|)*14,t*2mL" (61 layers and an MTP layer on PP '
        "16): E embedding, t layer, m MTP layer, L loss, | between stages; the stage count / PP gives the virtual "
        "stages",
    )
    _bool(d, "--sequence-parallel", "Megatron sequence parallelism (needs TP > 1)")
    _bool(d, "--overlap-grad-reduce", "launch each gradient bucket's all-reduce during the backward")
    _bool(d, "--tp-comm-overlap", "sequence-parallel GEMMs as TP rings overlapping all-gather / reduce-scatter")
    _bool(d, "--disable-tp-comm-overlap-ag", "column-parallel layers keep the plain all-gather (--tp-comm-overlap)")
    _bool(d, "--disable-tp-comm-overlap-rs", "row-parallel layers keep the plain reduce-scatter (--tp-comm-overlap)")
    _bool(
        d,
        "--overlap-p2p-comm",
        "pipeline: wait on each receive only when its data is needed (default with VP)",
        "--overlap-p2p-communication",  # (older Megatron scripts' spelling)
    )
    _bool(d, "--no-overlap-p2p-communication", "pipeline: wait on every receive before the next compute")
    d.add_argument(
        "--microbatch-group-size-per-virtual-pipeline-stage",
        type=int,
        help="interleaved pipeline: micro-batches per group through each model chunk (default: PP); micro-batches "
        "need not then be a multiple of PP",
    )
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
    t.add_argument("--encoder-seq-length", type=int, help="Megatron's other name for --seq-length")
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
    _bool(
        t,
        "--data-parallel-random-init",
        "seed each data-parallel rank with --seed + 10 x its rank (Megatron's): its own dropout masks (by design, "
        "other masks than the job without the flag, whose replicas repeat rank 0's); the weights it draws are "
        "replaced by DP rank 0's, a run without the flag's. Without dropout a DP>1 run still equals one process",
    )
    _bool(
        t,
        "--deterministic-mode",
        "run-to-run identical results: torch's deterministic algorithms, CUBLAS_WORKSPACE_CONFIG, flash attention "
        "on fixed tiles; with NCCL over several ranks NCCL_ALGO must be Tree, Ring, CollnetDirect, CollnetChain or "
        "^NVLS (Megatron's)",
    )
    t.add_argument("--eval-interval", type=int, default=1000)
    t.add_argument("--eval-iters", type=int, default=100)
    _bool(t, "--skip-train", "no training: evaluate the (loaded) model on the valid and test sets, then exit")
    t.add_argument(
        "--iterations-to-skip",
        type=int,
        nargs="+",
        default=[],
        help="iterations whose global batch is read and dropped: no forward, no update, no learning-rate step",
    )
    _bool(t, "--dry-run", "build on the meta device, validate, print parameters and memory per rank, exit")

    o = parser.add_argument_group("optimizer and learning rate")
    o.add_argument(
        "--optimizer",
        default="adam",
        choices=["adam", "sgd", "muon", "dist_muon"],
        help="adam (AdamW), sgd, muon (Muon on the hidden layers' matrices, AdamW on the rest), or dist_muon "
        "(muon with each parameter's state and update on one data-parallel rank)",
    )
    o.add_argument("--sgd-momentum", type=float, default=0.9, help="with --optimizer sgd")
    o.add_argument("--muon-momentum", type=float, default=0.9, help="with --optimizer muon: its momentum EMA")
    o.add_argument(
        "--muon-no-split-qkv",
        action="store_false",
        dest="muon_split_qkv",
        help="orthogonalize the fused QKV weight whole (default: its query, key and value parts each alone)",
    )
    _bool(o, "--muon-use-nesterov", "Nesterov momentum in Muon")
    o.add_argument("--muon-scale-mode", default="spectral", choices=list(MUON_SCALE_MODES))
    o.add_argument(
        "--muon-fp32-matmul-prec",
        default="medium",
        choices=list(MUON_MATMUL_PRECS),
        help="Newton-Schulz matmuls: medium in bf16, high TF32 (on GPUs), low at the process's precision",
    )
    o.add_argument("--muon-num-ns-steps", type=int, default=5, help="Newton-Schulz iterations (a multiple of 5)")
    o.add_argument(
        "--muon-tp-mode",
        default="blockwise",
        choices=list(MUON_TP_MODES),
        help="tensor-parallel matrices: each shard alone, the gathered matrix, or Newton-Schulz over TP",
    )
    o.add_argument("--muon-extra-scale-factor", type=float, default=1.0, help="times Muon's update")
    _bool(o, "--qk-clip", "MuonClip: after each step, scale down the query and key rows of query groups whose max "
          "attention logit exceeded --qk-clip-threshold (logs max_attention_logit)")  # fmt: skip
    o.add_argument("--qk-clip-alpha", type=float, default=0.5, help="query rows take eta^alpha, key rows the rest")
    o.add_argument("--qk-clip-threshold", type=float, default=100.0, help="the largest attention logit kept")
    _bool(o, "--log-max-attention-logit", "log the step's largest attention logit (max_attention_logit)")
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
    _bool(o, "--init-method-xavier-uniform", "every weight drawn normal(0, std) is drawn Xavier-uniform instead")
    o.add_argument("--embedding-init-method-std", type=float, help="the embeddings' init std (default "
                   "--init-method-std); given, they take no weight decay (Megatron's)")  # fmt: skip
    _bool(o, "--apply-wd-to-qk-layernorm", "weight decay on the --qk-layernorm weights too (not other norms, biases)")
    o.add_argument("--no-weight-decay-cond-type", choices=["apply_wd_to_qk_layernorm"],
                   help="Megatron's deprecated spelling of --apply-wd-to-qk-layernorm")  # fmt: skip
    o.add_argument("--start-weight-decay", type=float, help="weight decay at the start (linear|cosine increment)")
    o.add_argument("--end-weight-decay", type=float, help="weight decay at the end of the run (linear|cosine)")
    o.add_argument(
        "--weight-decay-incr-style",
        default="constant",
        choices=list(WD_INCR_STYLES),
        help="how weight decay goes from --start-weight-decay to --end-weight-decay over the run",
    )
    _bool(o, "--use-distributed-optimizer", "shard fp32 main weights and Adam moments over data parallelism (ZeRO-1)")
    _bool(
        o,
        "--overlap-param-gather",
        "with --use-distributed-optimizer: all-gather updated weights under the next forward",
    )
    _bool(o, "--use-torch-fsdp2", "ZeRO-3 through PyTorch FSDP2: parameters sharded over data parallelism")
    o.add_argument(
        "--torch-fsdp2-no-reshard-after-forward",
        dest="torch_fsdp2_reshard_after_forward",
        action="store_false",
        help="with --use-torch-fsdp2: keep each layer's gathered weights from its forward to its backward (more "
        "memory, one all-gather fewer per layer)",
    )
    o.add_argument(
        "--zero-stage", type=int, default=1, help="2: with --use-distributed-optimizer, shard gradients too (ZeRO-2)"
    )
    o.add_argument("--clip-grad", type=float, default=1.0)
    o.add_argument("--adam-beta1", type=float, default=0.9)
    o.add_argument("--adam-beta2", type=float, default=0.999)
    o.add_argument("--adam-eps", type=float, default=1e-8)
    _bool(o, "--use-apex-adam", "NVIDIA apex FusedAdam (must be installed)")
    _bool(o, "--use-precision-aware-optimizer", "Adam's moments stored in --exp-avg-dtype / --exp-avg-sq-dtype")
    o.add_argument("--exp-avg-dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="Adam's first moment")
    o.add_argument("--exp-avg-sq-dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="Adam's second moment")
    o.add_argument(
        "--main-grads-dtype",
        choices=["fp32", "bf16"],
        help="with --use-precision-aware-optimizer: bf16 main gradients, as --grad-reduce-in-bf16",
    )
    o.add_argument("--main-params-dtype", choices=["fp32", "fp16"], help="main weights: fp32 only here")

    p = parser.add_argument_group("mixed precision")
    _bool(p, "--bf16", "bf16 weights and activations, fp32 main weights and gradients (see --grad-reduce-in-bf16)")
    _bool(p, "--fp16", "fp16 with dynamic loss scaling")
    _bool(p, "--fp32-residual-connection", "with --bf16 / --fp16: keep the residual stream in fp32")
    _bool(
        p,
        "--grad-reduce-in-bf16",
        "with --bf16: accumulate and reduce main gradients in bf16 (half the gradient buffers and traffic); "
        "the optimizer steps fp32 copies made at the step",
    )
    _bool(
        p,
        "--ddp-reduce-scatter-with-fp32-accumulation",
        "the distributed optimizer's gradient reduce-scatters send bf16 (--grad-reduce-in-bf16) but sum in fp32 "
        "(an all-to-all, then a local fp32 sum rounded once)",
    )
    p.add_argument("--loss-scale", type=float, help="constant loss scale (--fp16, --bf16, the distributed "
                   "optimizer: an inf/nan step is skipped, --nan-policy acts); fp16: dynamic when unset")  # fmt: skip
    p.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    p.add_argument("--min-loss-scale", type=float, default=1.0)
    p.add_argument("--loss-scale-window", type=float, default=1000)  # (a float in Megatron: "1000.0" is taken)
    p.add_argument("--hysteresis", type=int, default=2)
    p.add_argument("--fp8-format", dest="fp8", choices=["e4m3", "hybrid"], help="fp8 GEMMs in the transformer "
                   "layers: inputs and weights e4m3, output gradients e5m2 (hybrid) or e4m3")  # fmt: skip
    p.add_argument(
        "--fp8-recipe",
        default="delayed",
        choices=["tensorwise", "delayed", "mxfp8", "blockwise"],
        help="delayed (the default): scaled from the amax history; tensorwise: from its own; mxfp8, blockwise refused",
    )
    _bool(p, "--no-fp8-wgrad", "with --fp8-format: the weight gradients in the compute dtype")
    p.add_argument("--fp8-margin", type=int, default=0, help="delayed scaling's margin (no effect with tensorwise)")
    p.add_argument("--fp8-interval", type=int, default=1, help="deprecated in Megatron: no effect")
    p.add_argument("--fp8-amax-history-len", type=int, default=1, help="delayed scaling's (no effect with tensorwise)")
    p.add_argument("--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"],
                   help="delayed scaling's (no effect with tensorwise)")  # fmt: skip
    _bool(p, "--first-last-layers-bf16", "with --fp8-format: the first and last layers in the compute dtype")
    p.add_argument("--num-layers-at-start-in-bf16", type=int, default=1)
    p.add_argument("--num-layers-at-end-in-bf16", type=int, default=1)

    add_data_flags(parser)

    c = parser.add_argument_group("checkpointing")
    c.add_argument("--save")
    c.add_argument("--load")
    c.add_argument("--save-interval", "--persistent-save-interval", type=int)  # (Megatron takes both)
    c.add_argument("--ckpt-step", type=int, help="load this iteration's checkpoint under --load (default: the newest)")
    _bool(c, "--no-load-optim", "load weights but not the optimizer state")
    _bool(c, "--no-load-rng", "do not restore random-number-generator states")
    _bool(
        c,
        "--load-main-params-from-ckpt",
        "with --no-load-optim: the fp32 main weights from the checkpoint's (a --bf16/--fp16 run's), not from the "
        "rounded model weights; moments and LR schedule start afresh",
    )
    _bool(c, "--no-save-optim", "save weights without optimizer state or LR schedule (resume with --no-load-optim)")
    _bool(c, "--no-save-rng", "save no random-number-generator states")
    _bool(c, "--finetune", "load weights only and start from iteration 0")
    _bool(c, "--use-checkpoint-args", "take the model configuration from the checkpoint")
    _bool(
        c,
        "--override-opt_param-scheduler",
        "on resume, the schedule flags given (learning rate, warmup, decay, weight decay) win over the checkpoint's, "
        "without a note (they win anyway)",
        "--override-opt-param-scheduler",
    )
    _bool(
        c,
        "--use-checkpoint-opt_param-scheduler",
        "on resume, keep the checkpoint's schedule (learning rate, warmup, decay, weight decay) whatever the flags say",
        "--use-checkpoint-opt-param-scheduler",
    )
    _bool(c, "--exit-on-missing-checkpoint", "fail instead of starting from scratch when --load has none")
    _bool(c, "--async-save", "write checkpoints in a background thread while training continues")
    _bool(c, "--ckpt-fully-parallel-load", "data-parallel replicas each read a part of what they all hold, then "
          "exchange the parts (default: each reads all it holds)")  # fmt: skip
    c.add_argument("--ckpt-keep-last", type=int, help="keep only the newest N checkpoints under --save")
    c.add_argument("--save-retain-interval", type=int, help="keep the checkpoints of multiples of N iterations and "
                   "the newest; each save deletes the one before it otherwise (Megatron's)")  # fmt: skip
    c.add_argument(
        "--non-persistent-save-interval",
        type=int,
        help="also save every N iterations a checkpoint "
        "of which only the newest is kept (not at --save-interval's); a restart takes it when newer",
    )
    c.add_argument(
        "--non-persistent-ckpt-type",
        choices=("global", "local", "in_memory"),
        help="global: one checkpoint in --non-persistent-global-ckpt-dir; local: each rank's own files "
        "in --non-persistent-local-ckpt-dir (same layout to resume)",
    )
    c.add_argument("--non-persistent-global-ckpt-dir", help="default: <--save>/non_persistent")
    c.add_argument("--non-persistent-local-ckpt-dir", help="a node-local directory; each rank writes <DIR>/<rank>")
    c.add_argument(
        "--non-persistent-local-ckpt-algo",
        choices=("fully_parallel", "atomic"),
        default="fully_parallel",
        help="accepted: each rank's files hold all it loads (Megatron's atomic)",
    )

    from megatron_lite.lora.flags import add_lora_group  # (it imports this module's _bool)

    add_lora_group(parser)

    f = parser.add_argument_group("fault tolerance")
    _bool(
        f,
        "--no-auto-resume",
        "with --save DIR holding a checkpoint (and --load none or another directory), start from --load, or from "
        "scratch, instead of resuming DIR's newest",
    )
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
    _bool(
        f,
        "--check-for-large-grads",
        "report a local bucket gradient norm >= 10x the largest of the first 100 (Megatron's check; training goes "
        "on with the flagged gradient: there is no re-run; --rerun-mode disabled also checks the first iteration)",
    )
    _bool(f, "--log-straggler", "per-rank step and compute time (min, median, max, slowest rank) every log interval")
    _bool(f, "--disable-flight-recorder", "do not record collectives (a hang then ends only at the gloo/NCCL timeout)")

    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--log-jsonl", help="write one JSON object per logged iteration to this file")
    _bool(g, "--log-memory-breakdown", "log bytes of parameters, gradients, optimizer state and peak activations")
    _bool(g, "--log-params-norm", "log the parameters' L2 norm (each counted once over the layout)")
    _bool(g, "--moe-per-layer-logging", "log each MoE layer's balancing and z losses (moe_layer<N>_*)")
    _bool(g, "--log-num-zeros-in-grad", "log the number of zero entries in the gradients")
    g.add_argument("--wandb-project")
    g.add_argument("--wandb-exp-name")
    g.add_argument("--wandb-entity", help="the W&B team or user the run is logged under (default: yours)")
    g.add_argument("--wandb-save-dir")
    g.add_argument("--tensorboard-dir")
    g.add_argument(
        "--tensorboard-log-interval",
        type=int,
        default=1,
        help="write each iteration's loss, learning rate, grad norm, ... to W&B and TensorBoard every N "
        "iterations (Megatron's; the console and JSONL keep --log-interval's window means)",
    )
    g.add_argument("--tensorboard-queue-size", type=int, default=1000, help="TensorBoard events queued before a flush")
    _bool(g, "--profile", "profile iterations (--profile-step-start, --profile-step-end] on --profile-ranks")
    _bool(g, "--use-pytorch-profiler", "with --profile: a torch.profiler trace in --tensorboard-dir (else nsys)")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0])
    g.add_argument("--profile-dir", help="where --use-pytorch-profiler writes its trace (default: --tensorboard-dir)")

    add_megatron_flag_groups(parser)
    add_missing_help(parser)
    _say_defaults(parser)
    add_off_switches(parser)
    return parser


def _say_defaults(parser: argparse.ArgumentParser) -> None:
    """--help names each flag's default value (the README quotes them) unless its help already says one."""
    for action in parser._actions:
        default = action.default
        if not action.option_strings or any(default is x for x in (None, False, True, argparse.SUPPRESS)):
            continue  # (identity: a default of 0 or 1 is shown)
        if default == [] or isinstance(action, argparse._HelpAction):
            continue
        text = action.help or ""
        if "default" in text.lower():
            continue
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        shown = shown.replace("%", "%%")
        action.help = f"{text} (default: {shown})" if text else f"default: {shown}"
