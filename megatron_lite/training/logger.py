"""Where training metrics go: a console line, a JSONL file, W&B and TensorBoard.

One rank logs: the first rank of the last pipeline stage (where the loss is known). W&B is imported
only when --wandb-project is given, and runs offline when no API key is configured, so a job never
blocks on a login prompt; `wandb sync` uploads an offline run later.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import sys
import time
from typing import Any

from megatron_lite.training.configs import JobConfig, LoggingConfig


def _wandb_mode() -> str:
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError):
        pass
    return "offline"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value == 0 or math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4E}" if abs(value) < 1e-2 or abs(value) >= 1e5 else f"{value:.4f}"
    return str(value)


class MetricsLogger:
    def __init__(self, job: JobConfig, enabled: bool) -> None:
        self.enabled = enabled
        self.config: LoggingConfig = job.logging
        self.train_iters = job.training.train_iters
        self._jsonl = None
        self._wandb = None
        self._tb = None
        self._last_iteration = self._last_train = self._wandb_step = self._step_offset = 0  # (W&B's step, see log)
        if not enabled:
            return
        if self.config.log_jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(self.config.log_jsonl)), exist_ok=True)
            self._jsonl = open(self.config.log_jsonl, "a", buffering=1)
        if self.config.wandb_project:
            import wandb  # only when asked for: W&B is heavy and absent from some images

            mode = _wandb_mode()
            # (as Megatron: beside the checkpoints, not in every node's working directory)
            save_dir = self.config.wandb_save_dir or os.path.join(job.checkpoint.save or os.getcwd(), "wandb")
            os.makedirs(save_dir, exist_ok=True)
            self._wandb = wandb.init(
                project=self.config.wandb_project,
                name=self.config.wandb_exp_name,
                entity=self.config.wandb_entity,
                dir=save_dir,
                config=job.to_dict(),
                mode=mode,
            )
            self.info(f"W&B run {self._wandb.id} ({mode}) in {save_dir}")
        if self.config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # (LoggingConfig checked that tensorboard is there)

            self._tb = SummaryWriter(self.config.tensorboard_dir)

    def info(self, message: str) -> None:
        if self.enabled:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            print(f"[{stamp}] {message}", file=sys.stdout, flush=True)

    def log(self, iteration: int, metrics: dict[str, Any], kind: str = "train") -> None:
        if not self.enabled:
            return
        record = {"iteration": iteration, **metrics} if kind == "train" else {"iteration": iteration, kind: metrics}
        if kind == "train":
            fields = " | ".join(
                f"{k}: {_fmt(v)}" for k, v in metrics.items() if v is not None and not isinstance(v, (dict, list))
            )
            self.info(f"iteration {iteration:>6}/{self.train_iters} | {fields}")
        else:
            self.info(f"{kind} at iteration {iteration} | " + " | ".join(f"{k}: {_fmt(v)}" for k, v in metrics.items()))
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
        flat = {f"{kind}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float)) and v is not None}
        if self._wandb is not None:
            # W&B drops a step below its last, and merges calls at one step: iterations a rollback replays go on
            # after it (the iteration goes along as a field), the last one logged included (an evaluation shares
            # its training's step)
            replayed = kind == "train" and iteration <= self._last_train
            if iteration < self._last_iteration or replayed:
                self._step_offset = self._wandb_step - iteration + 1
            if kind == "train":
                self._last_train = iteration
            self._last_iteration, self._wandb_step = iteration, iteration + self._step_offset
            self._wandb.log({**flat, "iteration": iteration}, step=self._wandb_step)
        if self._tb is not None:
            for k, v in flat.items():
                self._tb.add_scalar(k, v, iteration)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()
        self._jsonl = self._wandb = self._tb = None  # (closed once)
