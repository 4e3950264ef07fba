"""Checkpoint and logging settings, and the bundle of every config a training job runs with."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from megatron_lite.config import ConfigError, ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.data.config import DataConfig
from megatron_lite.optimizer.config import OptimizerConfig


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False  # load weights only; start at iteration 0
    use_checkpoint_args: bool = False
    exit_on_missing_checkpoint: bool = False
    async_save: bool = False  # write in a background thread while training goes on
    ckpt_keep_last: int | None = None  # delete older checkpoints, keeping the newest N

    def __post_init__(self) -> None:
        if self.ckpt_keep_last is not None and self.ckpt_keep_last < 1:
            raise ConfigError(f"--ckpt-keep-last {self.ckpt_keep_last} must be >= 1 (omit it to keep every checkpoint)")
        if (self.async_save or self.ckpt_keep_last) and not self.save:
            flag = "--async-save" if self.async_save else "--ckpt-keep-last"
            raise ConfigError(f"{flag} needs --save DIR")
        if self.save_interval is not None and self.save_interval < 1:
            raise ConfigError(f"--save-interval {self.save_interval} must be >= 1")
        if self.save_interval is not None and not self.save:
            raise ConfigError("--save-interval needs --save DIR")


@dataclass(frozen=True)
class LoggingConfig:
    log_jsonl: str | None = None
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    tensorboard_dir: str | None = None
    log_memory_breakdown: bool = False  # per rank: parameter, gradient, optimizer and activation bytes


@dataclass(frozen=True)
class JobConfig:
    model: ModelConfig
    parallel: ParallelConfig
    training: TrainingConfig
    optimizer: OptimizerConfig
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    dry_run: bool = False
    distributed_backend: str | None = None
    distributed_timeout_minutes: float = 10.0

    def to_dict(self) -> dict:
        return asdict(self)
