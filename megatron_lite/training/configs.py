"""Checkpoint and logging settings, and the bundle of every config a training job runs with."""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import asdict, dataclass, field

from megatron_lite.config import ConfigError, ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.data.config import DataConfig
from megatron_lite.lora.config import LoraConfig
from megatron_lite.optimizer.config import OptimizerConfig


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    # Megatron's --load-main-params-from-ckpt: with --no-load-optim, the fp32 main weights come from the
    # checkpoint's, not from the (bf16) model weights' rounding; the moments and the schedule still start afresh
    load_main_params_from_ckpt: bool = False
    no_save_optim: bool = False  # weights only: resuming needs --no-load-optim (fresh moments) or --finetune
    no_save_rng: bool = False
    finetune: bool = False  # load weights only; start at iteration 0
    use_checkpoint_args: bool = False
    exit_on_missing_checkpoint: bool = False
    async_save: bool = False  # write in a background thread while training goes on
    # Megatron's: the data-parallel replicas split reading what they all hold, then all-gather it
    # (checkpoint/parallel_load.py); off, each reads every byte it holds
    ckpt_fully_parallel_load: bool = False
    ckpt_keep_last: int | None = None  # delete older checkpoints, keeping the newest N
    # Megatron's --save-retain-interval: each save deletes the checkpoint before it unless its iteration is a
    # multiple of this (the newest and every multiple stay)
    save_retain_interval: int | None = None
    ckpt_step: int | None = None  # load this iteration's checkpoint instead of the newest
    # the loaded schedule's lengths (in samples) win over this run's flags (Megatron's flag)
    use_checkpoint_opt_param_scheduler: bool = False
    # Megatron's --moe-use-upcycling: the dense checkpoint in --load becomes this MoE run's start, saved to --save
    # as iteration 1 (training/upcycling.py); --moe-upcycling-granularity cuts each dense MLP into that many experts
    moe_use_upcycling: bool = False
    moe_upcycling_granularity: int = 1
    # Megatron's non-persistent checkpoints (checkpoint/non_persistent.py): every N iterations that are not a
    # --save-interval's, a checkpoint of which only the newest is kept, taken at start-up when newer than --load's
    non_persistent_save_interval: int | None = None
    non_persistent_ckpt_type: str | None = None  # global (a directory of ours) or local (each rank's own files)
    non_persistent_global_ckpt_dir: str | None = None  # default: <save>/non_persistent
    non_persistent_local_ckpt_dir: str | None = None
    non_persistent_local_ckpt_algo: str = "fully_parallel"

    def __post_init__(self) -> None:
        from megatron_lite.checkpoint.non_persistent import validate

        validate(self)
        if self.moe_upcycling_granularity < 1:
            raise ConfigError(
                f"--moe-upcycling-granularity {self.moe_upcycling_granularity} must be >= 1 (1: each expert a whole "
                "copy of the dense MLP)"
            )
        if self.ckpt_keep_last is not None and self.ckpt_keep_last < 1:
            raise ConfigError(f"--ckpt-keep-last {self.ckpt_keep_last} must be >= 1 (omit it to keep every checkpoint)")
        if self.save_retain_interval is not None and self.save_retain_interval < 1:
            raise ConfigError(f"--save-retain-interval {self.save_retain_interval} must be >= 1 (iterations)")
        if self.save_retain_interval and self.save_interval and self.save_retain_interval % self.save_interval:
            raise ConfigError(  # (Megatron asserts it; ours kept no checkpoint between the last two)
                f"--save-retain-interval {self.save_retain_interval} is not a multiple of --save-interval "
                f"{self.save_interval}: the checkpoints it keeps are saved ones; give a multiple (as Megatron asks)"
            )
        if self.save_retain_interval and self.ckpt_keep_last:
            raise ConfigError(
                f"--save-retain-interval {self.save_retain_interval} and --ckpt-keep-last {self.ckpt_keep_last} "
                "would each delete what the other keeps: give one"
            )
        if (self.async_save or self.ckpt_keep_last or self.save_retain_interval) and not self.save:
            flag = next(f for f, on in (("--async-save", self.async_save), ("--ckpt-keep-last", self.ckpt_keep_last),
                                        ("--save-retain-interval", True)) if on)  # fmt: skip
            raise ConfigError(f"{flag} needs --save DIR")
        if self.load_main_params_from_ckpt and not self.no_load_optim:  # (Megatron asserts the same)
            raise ConfigError(
                "--load-main-params-from-ckpt loads the main weights in place of the optimizer state: add "
                "--no-load-optim (without it the optimizer state, main weights included, is loaded anyway)"
            )
        if self.ckpt_step is not None and not self.load:
            raise ConfigError(f"--ckpt-step {self.ckpt_step} picks a checkpoint under --load: give --load DIR")
        if self.save_interval is not None and self.save_interval < 0:  # (0: no periodic saves, as in Megatron)
            raise ConfigError(f"--save-interval {self.save_interval} must be >= 0 (0 saves only at the end)")


@dataclass(frozen=True)
class LoggingConfig:
    log_jsonl: str | None = None
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_entity: str | None = None
    wandb_save_dir: str | None = None
    tensorboard_dir: str | None = None
    tensorboard_log_interval: int = 1  # Megatron's: each iteration's scalars to W&B and TensorBoard every N
    tensorboard_queue_size: int = 1000
    log_memory_breakdown: bool = False  # per rank: parameter, gradient, optimizer and activation bytes
    log_params_norm: bool = False  # Megatron's: the parameters' L2 norm after each step
    moe_per_layer_logging: bool = False  # Megatron's: each MoE layer's losses as scalars of their own
    log_num_zeros_in_grad: bool = False  # Megatron's: zero entries of the gradients
    # --profile (training/profiling.py): iterations after profile_step_start completed ones up to profile_step_end
    profile: bool = False
    use_pytorch_profiler: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: tuple[int, ...] = (0,)
    profile_dir: str | None = None  # ours: where the torch.profiler trace goes (default: --tensorboard-dir)

    def __post_init__(self) -> None:
        for flag, value in (
            ("--tensorboard-log-interval", self.tensorboard_log_interval),
            ("--tensorboard-queue-size", self.tensorboard_queue_size),
        ):
            if value < 1:
                raise ConfigError(f"{flag} {value} must be >= 1")
        # checked at start-up, not when the logger first imports them after the process groups are up
        for flag, value, package in (
            ("--wandb-project", self.wandb_project, "wandb"),
            ("--tensorboard-dir", self.tensorboard_dir, "tensorboard"),
        ):
            if value and importlib.util.find_spec(package) is None:
                raise ConfigError(f"{flag} {value} needs the {package} package: pip install {package} or drop {flag}")
        # (W&B refuses these in wandb.init, after the process groups: a traceback on rank 0, the others "a peer left")
        bad = [c for c in "/\\#?%:" if c in (self.wandb_project or "")]
        if bad:
            fix = " (the team goes in --wandb-entity)" if "/" in bad else ""
            raise ConfigError(
                f"--wandb-project {self.wandb_project}: W&B project names cannot contain {' '.join(bad)}{fix}"
            )


SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
NAN_POLICIES = ("skip", "halt", "rollback")
SPIKE_POLICIES = ("report", "rollback")
RERUN_MODES = ("disabled", "validate_results", "report_stats")  # (Megatron's --rerun-mode choices)


@dataclass(frozen=True)
class ResilienceConfig:
    """What keeps a long job going and makes its failures explain themselves."""

    auto_resume: bool = True  # with --save DIR holding a checkpoint (--load none or elsewhere), resume from it
    exit_signal_handler: bool = False  # the signal makes every rank save at the next iteration and exit 0
    exit_signal: str = "SIGTERM"
    nan_policy: str = "halt"  # on a non-finite loss or gradient (--check-for-nan-in-loss-and-grad)
    check_for_spiky_loss: bool = False
    spiky_loss_window: int = 50
    spiky_loss_zscore: float = 6.0
    spiky_loss_policy: str = "report"
    # Megatron's --check-for-large-grads: a local bucket gradient norm >= 10x the largest of the first 100 is
    # reported (resilience/supervisor.py); --rerun-mode (Megatron's, default validate_results) says which are checked
    check_for_large_grads: bool = False
    rerun_mode: str = "validate_results"
    log_straggler: bool = False
    flight_recorder: bool = True  # record collectives; a hang past the timeout ends the job with a report

    def __post_init__(self) -> None:
        for flag, value, choices in (
            ("--exit-signal", self.exit_signal, SIGNALS),
            ("--nan-policy", self.nan_policy, NAN_POLICIES),
            ("--spiky-loss-policy", self.spiky_loss_policy, SPIKE_POLICIES),
            ("--rerun-mode", self.rerun_mode, RERUN_MODES),
        ):
            if value not in choices:
                raise ConfigError(f"{flag} {value} is not one of {', '.join(choices)}")
        if self.spiky_loss_window < 10 or not self.spiky_loss_zscore > 0:  # (NaN included)
            raise ConfigError(
                f"--spiky-loss-window {self.spiky_loss_window} must be >= 10 and --spiky-loss-zscore "
                f"{self.spiky_loss_zscore} positive"
            )

    def validate(self, checkpoint: CheckpointConfig) -> None:
        rollback = self.nan_policy == "rollback" or (self.check_for_spiky_loss and self.spiky_loss_policy == "rollback")
        if rollback and not (checkpoint.save or checkpoint.load):
            flag = "--nan-policy rollback" if self.nan_policy == "rollback" else "--spiky-loss-policy rollback"
            raise ConfigError(f"{flag} rolls back to the last checkpoint: it needs --save DIR (with --save-interval)")


@dataclass(frozen=True)
class JobConfig:
    model: ModelConfig
    parallel: ParallelConfig
    training: TrainingConfig
    optimizer: OptimizerConfig
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    lora: LoraConfig | None = None  # fine-tune LoRA adapters on a frozen base
    dry_run: bool = False
    distributed_backend: str | None = None
    distributed_timeout_minutes: float = 10.0
    # Megatron's --deterministic-mode and --data-parallel-random-init (training/determinism.py): run-wide, as the
    # backend (not taken over from a checkpoint: a resumed run sets them with its own flags)
    deterministic_mode: bool = False
    data_parallel_random_init: bool = False
    # Megatron's --iterations-to-skip: these iterations read their global batch and drop it (no forward, no
    # update, no learning-rate step); the iteration count and the consumed samples go on (training/skipping.py)
    iterations_to_skip: tuple[int, ...] = ()
    # where the weights came from (checkpoint/origin.py): the loaded checkpoint's record, saved in this run's
    # checkpoints (set at start-up, not a flag)
    origin: dict | None = None

    def __post_init__(self) -> None:
        r = self.resilience
        if any(i < 1 for i in self.iterations_to_skip):
            raise ConfigError(
                f"--iterations-to-skip {' '.join(map(str, self.iterations_to_skip))}: iterations count from 1 (the "
                "first step is iteration 1); give iterations >= 1"
            )
        rollback = [
            flag
            for flag, on in (
                ("--nan-policy", r.nan_policy == "rollback"),
                ("--spiky-loss-policy", r.check_for_spiky_loss and r.spiky_loss_policy == "rollback"),
            )
            if on
        ]
        if not 0 < self.distributed_timeout_minutes < math.inf:  # (0 made the hang watchdog fire on a healthy run)
            raise ConfigError(
                f"--distributed-timeout-minutes {self.distributed_timeout_minutes:g} must be a positive number of "
                "minutes (default 10)"
            )
        if r.spiky_loss_policy != "report" and not r.check_for_spiky_loss:
            raise ConfigError(
                f"--spiky-loss-policy {r.spiky_loss_policy} acts on the loss spikes --check-for-spiky-loss finds: "
                "add --check-for-spiky-loss"
            )
        if r.nan_policy != "halt" and not self.optimizer.check_for_nan_in_loss_and_grad:
            raise ConfigError(
                f"--nan-policy {r.nan_policy} acts on the non-finite losses --check-for-nan-in-loss-and-grad finds, "
                "which --no-check-for-nan-in-loss-and-grad turns off: drop one of them"
            )
        if self.checkpoint.moe_use_upcycling:
            from megatron_lite.training.upcycling import validate_upcycling  # (it imports the checkpoint code)

            validate_upcycling(self)
        if self.checkpoint.no_save_optim and rollback:
            raise ConfigError(
                f"{rollback[0]} rollback restores the optimizer state from the last checkpoint, which "
                "--no-save-optim leaves out; drop one of them"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    def checkpoint_dict(self) -> dict:
        """`to_dict` as a checkpoint records it: the data prefixes and tokenizer files that exist here by their
        absolute paths, so `--load CKPT` alone resumes from any directory (relative ones were read from wherever
        the resume ran: a tokenizer never given was 'no such file'). A Hub name or a weight stays as given."""
        from megatron_lite.data.config import _blend

        d = self.to_dict()
        data = d["data"]
        for k in ("tokenizer_model", "vocab_file", "merge_file", "data_cache_path"):
            if data.get(k) and os.path.exists(data[k]):
                data[k] = os.path.abspath(data[k])
        for k in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
            entries = tuple(data[k])
            # the prefixes of a blend (its weights stay), or an SFT job's JSONL file
            prefixes = {p for _, p in _blend(entries)}
            data[k] = tuple(
                os.path.abspath(x) if x in prefixes and (os.path.exists(x + ".idx") or os.path.isfile(x)) else x
                for x in entries
            )
        return d


def check_output_paths(job: JobConfig) -> None:
    """The directories and files the job will write can be made: checked at start-up, before any process group
    (a --save under a regular file failed on rank 0 alone at the first save, the others waiting in a barrier)."""
    # (--skip-train writes no checkpoint, as Megatron: a --save on a read-only mount beside --load is left alone)
    save = None if job.training.skip_train else job.checkpoint.save
    dirs = [("--save", save), ("--tensorboard-dir", job.logging.tensorboard_dir)]
    dirs += [("--profile-dir", job.logging.profile_dir), ("--wandb-save-dir", job.logging.wandb_save_dir)]
    dirs += [("--data-cache-path", job.data.data_cache_path)]  # (the dataset indices are built there)
    files = [("--log-jsonl", job.logging.log_jsonl)]
    for flag, path, is_dir in [(f, p, True) for f, p in dirs] + [(f, p, False) for f, p in files]:
        if path:
            check_output_path(flag, path, is_dir)


def check_output_path(flag: str, path: str, is_dir: bool = False) -> None:
    """`path` (a directory, or a file) can be made or written, its missing parents created: else one line
    naming the flag. The tools check their outputs with it before their work, not after."""
    if os.path.exists(path) and os.path.isdir(path) != is_dir:
        kind = "a file" if is_dir else "a directory"
        raise ConfigError(f"{flag} {path} is {kind}; give a {'directory' if is_dir else 'file'} path")
    parent = os.path.abspath(path if is_dir else os.path.dirname(os.path.abspath(path)))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag} {path} cannot be created: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path} cannot be written: {parent} is not writable by this user")


def check_writable_dir(flag: str, path: str, value: str | None = None) -> None:
    """`path` is made (with its parents) and a file written into it and removed: the permission bits alone
    passed a --save under /proc (root may write everywhere, yet nothing can be made there) or on a read-only
    mount, which then failed at the first save, after the training before it. Each rank probes with a file of
    its own (made exclusively: a host name and pid repeat across containers), so ranks sharing it do not race.
    `value`: the flag's, where `path` is the directory of the file it names."""
    import errno
    import tempfile

    doing = "making the directory"
    try:
        os.makedirs(path, exist_ok=True)
        doing = "writing a file there"
        fd, probe = tempfile.mkstemp(prefix=".megatron_lite_write_probe.", dir=path)
        with os.fdopen(fd, "w") as f:
            f.write("probe\n")
        os.remove(probe)
    except OSError as e:
        why = f"{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})"
        said = f"{flag} {path}" if value is None else f"{flag} {value}: its directory {path}"
        where = "a directory" if value is None else "a path in a directory"
        raise ConfigError(
            f"{said} cannot be written: {doing} failed: {why}; give {flag} {where} this user can create and write"
        ) from None


def wandb_dir(job: JobConfig) -> str:
    """Where the W&B run goes: --wandb-save-dir, else beside the checkpoints (as Megatron), not in every node's
    working directory (the working directory without --save)."""
    return job.logging.wandb_save_dir or os.path.join(job.checkpoint.save or os.getcwd(), "wandb")


def output_dirs(job: JobConfig, rank: int, logging_rank: bool = False) -> list[tuple[str, str]]:
    """(flag, directory) this rank writes into, probed at start-up (check_writable_dir): --save, and the
    non-persistent checkpoints' own directory where one is given (a local one: this rank's); on the rank that
    logs (`logging_rank`), the logs' directories; on a profiled rank, --profile-dir."""
    from megatron_lite.checkpoint.non_persistent import local_dir

    ck, lg = job.checkpoint, job.logging
    out = []
    if not job.training.skip_train:  # (nothing is trained, so nothing saved: check_output_paths)
        out += [("--save", ck.save)] if ck.save else []
        if ck.non_persistent_ckpt_type == "local" and ck.non_persistent_local_ckpt_dir:
            out.append(("--non-persistent-local-ckpt-dir", local_dir(ck, rank)))
        elif ck.non_persistent_ckpt_type == "global" and ck.non_persistent_global_ckpt_dir:
            out.append(("--non-persistent-global-ckpt-dir", ck.non_persistent_global_ckpt_dir))
    # The logs' permission bits alone (check_output_paths) passed a directory under /proc or on a read-only
    # mount for root: the logging rank failed opening them with a traceback, the others then in a collective
    if logging_rank and lg.log_jsonl:
        out.append(("--log-jsonl", os.path.dirname(os.path.abspath(lg.log_jsonl))))
    if logging_rank and lg.tensorboard_dir:
        out.append(("--tensorboard-dir", lg.tensorboard_dir))
    if logging_rank and lg.wandb_project:
        out.append(("--wandb-save-dir", wandb_dir(job)))
    if lg.profile and lg.use_pytorch_profiler and lg.profile_dir and rank in lg.profile_ranks:
        out.append(("--profile-dir", lg.profile_dir))
    return out


def probe_output_dirs(job: JobConfig, rank: int, logging_rank: bool = False) -> str | None:
    """check_writable_dir on each of output_dirs: the first failure's one line, or None."""
    for flag, path in output_dirs(job, rank, logging_rank):
        try:
            check_writable_dir(flag, path)
        except ConfigError as e:
            return str(e)
    return None
