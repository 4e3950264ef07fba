"""Optimizer, learning-rate schedule and mixed-precision settings (Megatron's flags and defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_lite.config import ConfigError

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WD_INCR_STYLES = ("constant", "linear", "cosine")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
# --optimizer muon's choices (optimizer/muon.py)
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_MATMUL_PRECS = ("low", "medium", "high")
MUON_TP_MODES = ("blockwise", "duplicated", "distributed")


@dataclass(frozen=True)
class OptimizerConfig:
    # Megatron's --optimizer: adam (AdamW), sgd (with --sgd-momentum), muon, or dist_muon (muon with each data-parallel
    # rank keeping the state of, and stepping, only the parameters it owns: optimizer/layer_wise_optimizer.py)
    optimizer: str = "adam"
    sgd_momentum: float = 0.9
    # --optimizer muon (optimizer/muon.py), Megatron-LM's flags and defaults (its --muon-momentum is 0.9)
    muon_momentum: float = 0.9
    muon_split_qkv: bool = True  # --muon-no-split-qkv: the fused QKV weight orthogonalized whole
    muon_use_nesterov: bool = False
    muon_scale_mode: str = "spectral"
    muon_fp32_matmul_prec: str = "medium"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "blockwise"
    muon_extra_scale_factor: float = 1.0
    lr: float = 1e-4
    use_distributed_optimizer: bool = False  # ZeRO-1: main weights and moments sharded over data parallelism
    zero_stage: int = 1  # 2: gradients too (each bucket's full gradient dropped once reduce-scattered)
    use_torch_fsdp2: bool = False  # ZeRO-3 through PyTorch FSDP2: parameters sharded over data parallelism
    torch_fsdp2_reshard_after_forward: bool = True  # False: layers stay gathered from forward to backward
    overlap_param_gather: bool = False  # distributed optimizer: weights' all-gathers under the next forward
    min_lr: float = 0.0
    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None  # default: --train-iters
    lr_warmup_iters: int = 0
    lr_warmup_init: float = 0.0
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_iters: int | None = None
    # Sample-based schedule (with --train-samples), in samples: Megatron's --lr-*-samples
    lr_decay_samples: int | None = None  # default: --train-samples
    lr_warmup_samples: int = 0
    lr_warmup_fraction: float | None = None  # warmup as this share of the decay (replaces -iters / -samples)
    lr_wsd_decay_samples: int | None = None
    # Megatron's --decoupled-lr / --decoupled-min-lr: the word embeddings' and the output layer's own peak and
    # floor, on the same schedule shape (None: they follow --lr / --min-lr)
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    weight_decay: float = 0.01
    # Megatron's --apply-wd-to-qk-layernorm (Qwen3-Next): the --qk-layernorm weights take weight decay too (the
    # other norms and the biases still take none)
    apply_wd_to_qk_layernorm: bool = False
    # Megatron: given --embedding-init-method-std, the embeddings take no weight decay (default_skip_embedding_
    # weight_decay; arXiv 2312.16903: decay shrank them towards zero)
    skip_embedding_weight_decay: bool = False
    # Megatron's weight-decay increment: from --start-weight-decay to --end-weight-decay over the whole run,
    # linear or cosine; constant: --weight-decay throughout
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    weight_decay_incr_style: str = "constant"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping
    bf16: bool = False
    fp16: bool = False
    # Megatron's --grad-reduce-in-bf16: with --bf16, main gradients accumulate and are reduced in bf16 (half
    # the gradient memory and reduction bytes); the optimizer still steps fp32 copies of them
    grad_reduce_in_bf16: bool = False
    # Megatron's --ddp-reduce-scatter-with-fp32-accumulation: the distributed optimizer's reduce-scatters send the
    # gradients' dtype (bf16 with the flag above) but sum them in fp32, rounding once (distributed/fp32_accumulation.py)
    ddp_reduce_scatter_with_fp32_accumulation: bool = False
    # a constant loss scale (fp16; as in Megatron also bf16 and the distributed optimizer); fp16 scales dynamically
    # when None
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    use_apex_adam: bool = False  # NVIDIA apex FusedAdam, when installed
    # Megatron's --use-precision-aware-optimizer with --exp-avg-dtype / --exp-avg-sq-dtype: Adam's moments stored
    # in fp32, bf16 or fp16 (the update itself in fp32; optimizer/adam.py)
    use_precision_aware_optimizer: bool = False
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    # A non-finite gradient norm skips the update on every rank (the norm is reduced over all of them);
    # the training loop then applies --nan-policy.
    check_for_nan_in_loss_and_grad: bool = True

    def __post_init__(self) -> None:
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 are exclusive; pick one")
        if self.optimizer not in ("adam", "sgd", "muon", "dist_muon"):
            raise ConfigError(f"--optimizer {self.optimizer} is not supported; use adam, sgd, muon or dist_muon")
        if self.is_muon:
            self._check_muon()
        if self.optimizer == "sgd" and (self.use_apex_adam or not 0 <= self.sgd_momentum < 1):
            raise ConfigError(
                "--use-apex-adam is Adam's; drop it with --optimizer sgd"
                if self.use_apex_adam
                else f"--sgd-momentum {self.sgd_momentum} must be in [0, 1)"
            )
        for flag, value in (("--exp-avg-dtype", self.exp_avg_dtype), ("--exp-avg-sq-dtype", self.exp_avg_sq_dtype)):
            if value not in ("fp32", "bf16", "fp16"):
                raise ConfigError(f"{flag} {value} is not fp32|bf16|fp16")
            if value == "fp16":  # g^2 (1 - beta2) underflows fp16 for ordinary gradients without a scale
                raise ConfigError(
                    f"{flag} fp16 is not supported: fp16 moments need per-tensor scaling (Transformer Engine's), "
                    "which is not implemented; use bf16"
                )
            if value != "fp32" and not self.use_precision_aware_optimizer:
                raise ConfigError(f"{flag} {value} needs --use-precision-aware-optimizer (as in Megatron)")
        if self.use_precision_aware_optimizer and (self.optimizer != "adam" or self.use_apex_adam):
            raise ConfigError(
                "--use-precision-aware-optimizer is our Adam's: drop it with "
                + (f"--optimizer {self.optimizer}" if self.optimizer != "adam" else "--use-apex-adam")
            )
        if self.grad_reduce_in_bf16 and self.fp16:
            raise ConfigError(
                "--grad-reduce-in-bf16 with --fp16 is not supported: fp16 gradients are reduced in fp32; "
                "use --bf16 or drop the flag"
            )
        # signs no optimizer takes (torch's AdamW refuses a negative eps only at its first step); a negative --lr
        # named itself before the --min-lr range below (it read as a --min-lr out of range)
        for flag, value in (
            ("--lr", self.lr),
            ("--decoupled-lr", self.decoupled_lr),
            ("--weight-decay", self.weight_decay),
            ("--adam-eps", self.adam_eps),
        ):
            if value is not None and not value >= 0:
                raise ConfigError(f"{flag} {value} must be >= 0")
        if not 0 <= self.min_lr <= self.lr:  # (a NaN too: it had trained at a NaN rate, blamed on the gradients)
            raise ConfigError(f"--min-lr {self.min_lr} must be in [0, --lr {self.lr}]")
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise ConfigError("--decoupled-min-lr sets the floor of --decoupled-lr: add --decoupled-lr")
        if self.decoupled_lr is not None and not 0 <= (self.decoupled_min_lr or 0.0) <= self.decoupled_lr:
            raise ConfigError(
                f"--decoupled-min-lr {self.decoupled_min_lr} must be in [0, --decoupled-lr {self.decoupled_lr}]"
            )
        if self.lr_decay_style not in DECAY_STYLES:
            raise ConfigError(f"--lr-decay-style {self.lr_decay_style} is not supported; use one of {DECAY_STYLES}")
        if self.weight_decay_incr_style not in WD_INCR_STYLES:
            raise ConfigError(
                f"--weight-decay-incr-style {self.weight_decay_incr_style} is not supported; use one of "
                f"{WD_INCR_STYLES}"
            )
        ends = (self.start_weight_decay, self.end_weight_decay)
        if self.weight_decay_incr_style == "constant" and ends != (None, None):
            flag = "--start-weight-decay" if self.start_weight_decay is not None else "--end-weight-decay"
            raise ConfigError(
                f"{flag} needs --weight-decay-incr-style linear|cosine (constant keeps --weight-decay "
                f"{self.weight_decay})"
            )
        if self.weight_decay_incr_style != "constant":
            if None in ends:
                raise ConfigError(
                    f"--weight-decay-incr-style {self.weight_decay_incr_style} needs --start-weight-decay and "
                    "--end-weight-decay"
                )
            if not 0 <= ends[0] <= ends[1]:
                raise ConfigError(
                    f"--start-weight-decay {ends[0]} and --end-weight-decay {ends[1]} must satisfy 0 <= start <= end "
                    "(Megatron's weight decay only increases)"
                )
        if self.lr_wsd_decay_style not in WSD_DECAY_STYLES:
            raise ConfigError(
                f"--lr-wsd-decay-style {self.lr_wsd_decay_style} is not supported; use one of {WSD_DECAY_STYLES}"
            )
        if self.lr_warmup_fraction is not None and not 0.0 <= self.lr_warmup_fraction < 1.0:
            raise ConfigError(f"--lr-warmup-fraction {self.lr_warmup_fraction} must be in [0, 1)")
        if self.lr_warmup_iters < 0 or self.lr_warmup_samples < 0:
            raise ConfigError(
                f"--lr-warmup-iters/-samples {self.lr_warmup_iters or self.lr_warmup_samples} must be >= 0"
            )
        if not self.clip_grad >= 0:  # (a NaN turned clipping off)
            raise ConfigError(f"--clip-grad {self.clip_grad} must be >= 0 (0 disables clipping)")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ConfigError(f"--adam-beta1 {self.adam_beta1} / --adam-beta2 {self.adam_beta2} must be in [0, 1)")
        if self.zero_stage not in (1, 2):
            raise ConfigError(
                f"--zero-stage {self.zero_stage} is not supported: 1 or 2 with --use-distributed-optimizer "
                "(stage 3, sharded parameters, is planned through PyTorch FSDP2)"
            )
        if not self.torch_fsdp2_reshard_after_forward and not self.use_torch_fsdp2:
            raise ConfigError(
                "--torch-fsdp2-no-reshard-after-forward acts on --use-torch-fsdp2: add it or drop the flag"
            )
        if self.use_torch_fsdp2 and (self.use_distributed_optimizer or self.fp16 or self.loss_scale):
            flag = "--use-distributed-optimizer" if self.use_distributed_optimizer else "--fp16"
            flag = f"--loss-scale {self.loss_scale:g}" if self.loss_scale and not self.fp16 else flag
            raise ConfigError(f"--use-torch-fsdp2 with {flag} is not supported; FSDP2 shards the fp32 weights itself")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError(
                "--overlap-param-gather overlaps the distributed optimizer's all-gathers; "
                "add --use-distributed-optimizer or drop the flag"
            )
        if self.zero_stage == 2 and not self.use_distributed_optimizer:
            raise ConfigError(
                "--zero-stage 2 shards gradients for the distributed optimizer: add --use-distributed-optimizer"
            )
        if self.hysteresis < 1:
            raise ConfigError(f"--hysteresis {self.hysteresis} must be >= 1")
        self._check_values()

    def _check_muon(self) -> None:
        """What Megatron's get_megatron_muon_optimizer and emerging_optimizers refuse (they raise at the first
        step or at build time), and the combinations not implemented here."""
        refused = (
            ("--use-distributed-optimizer", self.use_distributed_optimizer, "Megatron refuses it too"),
            ("--fp16", self.fp16, "Megatron refuses it too; use --bf16"),
            ("--use-torch-fsdp2", self.use_torch_fsdp2, "Muon orthogonalizes whole matrices"),
            ("--use-apex-adam", self.use_apex_adam, "the Adam part is torch's AdamW"),
            # (Megatron's --overlap-param-gather asserts --use-distributed-optimizer, which Muon refuses; its
            # LayerWiseDistributedOptimizer all-gathers the updated weights after the step, as here)
            (
                "--overlap-param-gather",
                self.overlap_param_gather and self.optimizer == "dist_muon",
                "Megatron refuses it too: the layer-wise all-gather follows the step",
            ),
        )
        for flag, given, why in refused:
            if given:
                raise ConfigError(f"--optimizer {self.optimizer} with {flag} is not supported ({why}); drop {flag}")
        for flag, value, choices in (
            ("--muon-scale-mode", self.muon_scale_mode, MUON_SCALE_MODES),
            ("--muon-fp32-matmul-prec", self.muon_fp32_matmul_prec, MUON_MATMUL_PRECS),
            ("--muon-tp-mode", self.muon_tp_mode, MUON_TP_MODES),
        ):
            if value not in choices:
                raise ConfigError(f"{flag} {value} is not one of {'|'.join(choices)}")
        if self.muon_num_ns_steps < 1 or self.muon_num_ns_steps % 5:
            raise ConfigError(
                f"--muon-num-ns-steps {self.muon_num_ns_steps} must be a positive multiple of 5 (Megatron's quintic "
                "Newton-Schulz coefficients come in 5 sets); use 5"
            )
        if not 0 <= self.muon_momentum < 1:
            raise ConfigError(f"--muon-momentum {self.muon_momentum} must be in [0, 1)")

    def _check_values(self) -> None:
        """Values Megatron's scheduler and scaler assert on."""
        if not 0 <= self.lr_warmup_init <= self.lr:
            raise ConfigError(f"--lr-warmup-init {self.lr_warmup_init} must be in [0, --lr {self.lr}]")
        for flag, value in (
            ("--lr-decay-iters", self.lr_decay_iters),
            ("--lr-decay-samples", self.lr_decay_samples),
            ("--lr-wsd-decay-iters", self.lr_wsd_decay_iters),
            ("--lr-wsd-decay-samples", self.lr_wsd_decay_samples),
        ):
            if value is not None and value < 1:
                raise ConfigError(f"{flag} {value} must be >= 1 (omit it for the default)")
        # the dynamic loss scaler's (Megatron's DynamicGradScaler asserts these)
        if self.loss_scale is not None and not self.loss_scale > 0:
            raise ConfigError(f"--loss-scale {self.loss_scale} must be > 0 (omit it for dynamic scaling)")
        if self.fp16 and not 0 < self.initial_loss_scale < math.inf:  # (a NaN read as a --min-loss-scale fault)
            raise ConfigError(f"--initial-loss-scale {self.initial_loss_scale} must be a finite number > 0")
        if self.fp16 and not 0 < self.min_loss_scale <= self.initial_loss_scale:  # (only fp16 scales dynamically)
            raise ConfigError(
                f"--min-loss-scale {self.min_loss_scale} must be in (0, --initial-loss-scale {self.initial_loss_scale}]"
            )
        if self.fp16 and self.loss_scale_window < 1:
            raise ConfigError(f"--loss-scale-window {self.loss_scale_window} must be >= 1")

    @property
    def is_muon(self) -> bool:
        """Muon on the matrices, AdamW on the rest: --optimizer muon or its layer-wise distributed dist_muon."""
        return self.optimizer in ("muon", "dist_muon")

    @property
    def grad_dtype(self):
        """The dtype main gradients accumulate and are reduced in."""
        import torch

        return torch.bfloat16 if self.bf16 and self.grad_reduce_in_bf16 else torch.float32

    @property
    def sample_based(self) -> bool:
        return bool(self.lr_decay_samples or self.lr_warmup_samples or self.lr_wsd_decay_samples)

    def schedule(self, train_iters: int, train_samples: int | None = None) -> tuple[str, float, int, int | None]:
        """(unit, warmup, decay, WSD decay) of the schedule as the flags give them: in iterations, or in samples
        when the run is sample-based (--train-samples). --lr-warmup-fraction is a share of the decay, not
        rounded to whole iterations (Megatron takes it of the decay's samples)."""
        if train_samples is not None:
            unit, warmup, decay = "samples", self.lr_warmup_samples, self.lr_decay_samples or train_samples
            wsd = self.lr_wsd_decay_samples
        else:
            unit, warmup, decay = "iters", self.lr_warmup_iters, self.lr_decay_iters or train_iters
            wsd = self.lr_wsd_decay_iters
        if self.lr_warmup_fraction is not None:
            warmup = self.lr_warmup_fraction * decay
        return unit, warmup, decay, wsd

    def validate_schedule(self, train_iters: int, train_samples: int | None = None) -> None:
        if self.lr_decay_style == "WSD" and not (self.lr_wsd_decay_iters or self.lr_wsd_decay_samples):
            unit = "samples" if train_samples is not None else "iters"  # (the form the run's length takes)
            raise ConfigError(f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} N (the length of the final decay)")
        unit, warmup, decay, wsd = self.schedule(train_iters, train_samples)
        if warmup >= decay and (warmup or self.lr_decay_style != "constant"):  # (Megatron asserts it for every style)
            # (named as given: the decay's length defaults to the run's; a --lr-warmup-fraction is below 1)
            explicit = self.lr_decay_samples if unit == "samples" else self.lr_decay_iters
            run = "--train-samples" if unit == "samples" else "--train-iters"
            length = (
                f"--lr-decay-{unit} {decay}"
                if explicit
                else f"the decay's {decay} {unit} ({run}: no --lr-decay-{unit})"
            )
            raise ConfigError(
                f"--lr-warmup-{unit} {warmup} must be below {length}; use --lr-warmup-{unit} "
                f"{max(decay // 10, 1) if decay > 1 else 0}"
            )
        if self.lr_decay_style == "WSD" and (wsd or 0) > decay:
            raise ConfigError(f"--lr-wsd-decay-{unit} {wsd} exceeds --lr-decay-{unit} {decay}")
