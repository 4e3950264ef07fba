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
import re
import sys
import time
import urllib.parse
from typing import Any

from megatron_lite.training.configs import JobConfig, LoggingConfig, wandb_dir


def _wandb_mode() -> str:
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    # (a self-hosted server's login, `wandb login --host`, is stored under its own host)
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        if netrc.netrc().authenticators(host):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError):
        pass
    return "offline"


# Megatron's training_log, field by field: (our metric, its console label, its format), in its order; a
# parser or dashboard written for Megatron's logs reads ours. Metrics Megatron has no field for follow.
MEGATRON_CONSOLE = (
    ("consumed_samples", "consumed samples", "{:12d}"),
    ("skipped_samples", "skipped samples", "{:12d}"),  # (once --iterations-to-skip dropped any, as Megatron's)
    ("iteration_time", "elapsed time per iteration (ms)", "ms"),  # (seconds in JSONL, as our other times)
    ("tflops_per_gpu", "throughput per GPU (TFLOP/s/GPU)", "{:.1f}"),
    ("lr", "learning rate", "{:.6E}"),
    ("decoupled_lr", "decoupled learning rate", "{:.6E}"),
    ("global_batch_size", "global batch size", "{:5d}"),
    ("lm_loss", "lm loss", "{:.6E}"),
    ("moe_aux_loss", "load_balancing_loss", "{:.6E}"),
    ("moe_seq_aux_loss", "seq_load_balancing_loss", "{:.6E}"),
    ("moe_z_loss", "z_loss", "{:.6E}"),
    ("mtp_*_loss", None, "{:.6E}"),  # "mtp_1 loss", ... (after the MoE losses, as Megatron's)
    ("loss_scale", "loss scale", "{:.1f}"),
    ("grad_norm", "grad norm", "{:.3f}"),
    ("num_zeros_in_grad", "num zeros", "{}"),
    ("params_norm", "params norm", "{:.3f}"),
    ("skipped_iterations", "number of skipped iterations", "{:3d}"),
    ("nonfinite_iterations", "number of nan iterations", "{:3d}"),
)
# Megatron's W&B / TensorBoard keys for the metrics it has (TensorBoard also gets its "<key> vs samples");
# the others go under train/.
MEGATRON_KEYS = {
    "lm_loss": "lm loss",
    "lr": "learning-rate",
    "decoupled_lr": "decoupled-learning-rate",
    "global_batch_size": "batch-size",
    "loss_scale": "loss-scale",
    "grad_norm": "grad-norm",
    "num_zeros_in_grad": "num-zeros",
    "params_norm": "params-norm",
    "max_attention_logit": "max_attention_logit",  # (--qk-clip / --log-max-attention-logit)
    "iteration_time": "iteration-time",
    "tflops_per_gpu": "throughput",
    "moe_aux_loss": "load_balancing_loss",
    "moe_seq_aux_loss": "seq_load_balancing_loss",
    "moe_z_loss": "z_loss",
    "consumed_samples": "samples vs steps",
    "skipped_samples": "skipped-train-samples",
    "peak_memory_bytes": "mem-max-allocated-bytes",  # (--log-memory-to-tensorboard's; the largest over all ranks)
}


# Of Megatron's metrics these are the --log-interval window's (times); the rest go to W&B and TensorBoard each
# --tensorboard-log-interval iterations as that iteration's value (MetricsLogger.step). Ours-only metrics
# (under train/) go with the window.
WINDOW_METRICS = ("iteration_time", "tflops_per_gpu", "peak_memory_bytes")


def _per_step(key: str) -> bool:
    return _megatron_key(key) is not None and key not in WINDOW_METRICS


def _megatron_key(key: str) -> str | None:
    if key.startswith("mtp_") and key.endswith("_loss"):
        return f"{key[:-5]} loss"  # Megatron's "mtp_1 loss"
    if layer := MOE_LAYER_LOSS.fullmatch(key):  # --moe-per-layer-logging: "moe/load_balancing_loss_layer_3"
        return f"moe/{MEGATRON_KEYS['moe_' + layer[2]]}_layer_{layer[1]}"
    return MEGATRON_KEYS.get(key)


MOE_LAYER_LOSS = re.compile(r"moe_layer(\d+)_(aux_loss|seq_aux_loss|z_loss)")


def train_line(iteration: int, train_iters: int, metrics: dict[str, Any]) -> str:
    """Megatron's iteration line (its labels, formats and order), then the metrics it has no field for."""
    parts = [f"iteration {iteration:8d}/{train_iters if train_iters is not None else '?':>8}"]
    shown = set()
    for key, label, fmt in MEGATRON_CONSOLE:
        keys = [k for k in metrics if k.startswith("mtp_") and k.endswith("_loss")] if "*" in key else [key]
        for k in keys:
            v = metrics.get(k)
            shown.add(k)
            if v is None or isinstance(v, (dict, list)):
                continue
            try:
                text = f"{v * 1000.0:.1f}" if fmt == "ms" else fmt.format(int(v) if fmt.endswith("d}") else v)
            except (TypeError, ValueError, OverflowError):  # (a NaN count, say: said as it is, never a crash)
                text = _fmt(v)
            parts.append(f"{label or _megatron_key(k)}: {text}")
    rest = {k: v for k, v in metrics.items() if k not in shown and v is not None}
    parts += [f"{k}: {_fmt(v)}" for k, v in rest.items() if not isinstance(v, (dict, list))]
    return " | ".join(parts) + " |"


def _flat_config(job: JobConfig, world_size: int | None = None) -> dict:
    """The job's settings as one flat dict (Megatron hands W&B its flat arguments, so runs filter on
    num_layers or tensor_model_parallel_size); a name two sections share keeps its section."""
    nested = job.to_dict()
    nested.pop("origin", None)  # (where the weights came from: not a setting)
    sections = {k: v for k, v in nested.items() if isinstance(v, dict)}
    seen: dict[str, int] = {}
    for sec in sections.values():
        for k in sec:
            seen[k] = seen.get(k, 0) + 1
    flat = {k: v for k, v in nested.items() if not isinstance(v, dict)}
    for name, sec in sections.items():
        flat.update({(k if seen[k] == 1 else f"{name}.{k}"): v for k, v in sec.items()})
    # Megatron's vocab_size is the tokenizer's and padded_vocab_size the embedding's rows (the data section's
    # --vocab-size is only the flag, None with a real tokenizer)
    flat.pop("data.vocab_size", None)
    flat.pop("model.vocab_size", None)
    flat["vocab_size"] = job.model.vocab_size
    flat["padded_vocab_size"] = job.model.padded_vocab_size(job.parallel.tensor_model_parallel_size)
    # the values Megatron's validate_args fills in, which scaling studies group runs by
    m = job.model
    flat.update(ffn_hidden_size=m.ffn_size, kv_channels=m.head_dim, num_query_groups=m.query_groups)
    if world_size is not None:
        flat.update(world_size=world_size, data_parallel_size=job.parallel.data_parallel_size(world_size))
    return flat


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value == 0 or math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4E}" if abs(value) < 1e-2 or abs(value) >= 1e5 else f"{value:.4f}"
    return str(value)


class MetricsLogger:
    def __init__(self, job: JobConfig, enabled: bool, world_size: int | None = None) -> None:
        self.enabled = enabled
        self.config: LoggingConfig = job.logging
        self.train_iters = job.training.train_iters
        self._jsonl = None
        self._wandb = None
        self._tb = None
        self._last_iteration = self._last_train = self._wandb_step = self._step_offset = 0  # (W&B's step, see _emit)
        self._opened = -1  # the iteration whose own values step() logged last
        self._samples = 0  # consumed by the last iteration logged: TensorBoard's "vs samples" axis
        if not enabled:
            return
        if self.config.log_jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(self.config.log_jsonl)), exist_ok=True)
            self._jsonl = open(self.config.log_jsonl, "a", buffering=1)
        if self.config.wandb_project:
            import wandb  # only when asked for: W&B is heavy and absent from some images

            mode = _wandb_mode()
            save_dir = wandb_dir(job)
            os.makedirs(save_dir, exist_ok=True)
            self._wandb = wandb.init(
                project=self.config.wandb_project,
                name=self.config.wandb_exp_name,
                entity=self.config.wandb_entity,
                dir=save_dir,
                config=_flat_config(job, world_size),
                mode=mode,
            )
            self.info(f"W&B run {self._wandb.id} ({mode}) in {save_dir}")
        if self.config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # (LoggingConfig checked that tensorboard is there)

            self._tb = SummaryWriter(self.config.tensorboard_dir, max_queue=self.config.tensorboard_queue_size)

    def info(self, message: str) -> None:
        if self.enabled:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            print(f"[{stamp}] {message}", file=sys.stdout, flush=True)

    def log(
        self,
        iteration: int,
        metrics: dict[str, Any],
        kind: str = "train",
        final: bool = False,
        samples: int | None = None,
        trackers: bool = True,
    ) -> None:
        """One record: `kind` train, or validation / test with lm_loss and ppl (`final`: the evaluation at the
        end of the run, which Megatron's line says; `samples`: the training samples consumed by then; `trackers`
        False: the console and JSONL only, not W&B and TensorBoard, as Megatron's --skip-train evaluations)."""
        if not self.enabled:
            return
        record = {"iteration": iteration, **metrics} if kind == "train" else {"iteration": iteration, kind: metrics}
        if final:
            record["final"] = True  # (in W&B it shares the iteration's step with an evaluation just before)
        self._samples = samples if samples is not None else metrics.get("consumed_samples", self._samples)
        if kind == "train":
            self.info(train_line(iteration, self.train_iters, metrics))
        else:  # Megatron's evaluate_and_print_results, its test set's line included ("validation-0": one of
            # --multiple-validation-sets, its line " validation-0 loss at ...")
            label = kind if kind.startswith("validation") else "validation"
            at = f"iteration {iteration}" + (f" on {kind.split('-')[0]} set" if final else "")
            line = f" {label} loss at {at} | lm loss value: {metrics['lm_loss']:.6E} | "
            line += f"lm loss PPL: {metrics['ppl']:.6E} | "
            print(f"{'-' * (len(line) + 1)}\n{line}\n{'-' * (len(line) + 1)}", flush=True)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
        if kind == "train":  # (the per-iteration metrics went out in step())
            self._emit(iteration, {k: v for k, v in metrics.items() if not _per_step(k)}, new_step=False)
        elif trackers:  # Megatron's "lm loss validation", "lm loss validation-0" (its test set's; ours: "lm loss test")
            flat = {f"lm loss {kind}": metrics["lm_loss"], f"lm loss {kind} ppl": metrics["ppl"]}
            self._emit(iteration, flat, new_step=False, named=True)

    def step(self, iteration: int, metrics: dict[str, Any]) -> None:
        """One iteration's own values (Megatron's loss_dict, learning rate, grad norm, ...) to W&B and
        TensorBoard every --tensorboard-log-interval iterations, as Megatron's training_log writes them (the
        console and JSONL show the --log-interval window's means instead)."""
        if not self.enabled or (self._wandb is None and self._tb is None):
            return
        if iteration % self.config.tensorboard_log_interval == 0:
            self._samples = metrics.get("consumed_samples", self._samples)
            self._emit(iteration, {k: v for k, v in metrics.items() if _per_step(k)}, new_step=True)

    def _emit(self, iteration: int, metrics: dict[str, Any], new_step: bool, named: bool = False) -> None:
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        flat = scalars if named else {(_megatron_key(k) or f"train/{k}"): v for k, v in scalars.items()}
        if not flat:
            return
        if self._wandb is not None:
            # W&B drops a step below its last, and merges calls at one step: iterations a rollback replays go on
            # after it (the iteration goes along as a field), the last one logged included. An iteration's
            # window metrics join the step its own values opened; an evaluation joins its iteration's step.
            joins = named or (not new_step and self._opened == iteration)
            if iteration < self._last_iteration or (not joins and iteration <= self._last_train):
                self._step_offset = self._wandb_step - iteration + 1
            if not named:
                self._last_train = iteration
            if new_step:
                self._opened = iteration
            self._last_iteration, self._wandb_step = iteration, iteration + self._step_offset
            self._wandb_call(lambda: self._wandb.log({**flat, "iteration": iteration}, step=self._wandb_step))
        if self._tb is not None:
            for k, v in flat.items():
                self._tb.add_scalar(k, v, iteration)
                if not k.startswith(("train/", "mem-")) and k != "samples vs steps":  # (Megatron's has none)
                    self._tb.add_scalar(f"{k} vs samples", v, self._samples)

    def _wandb_call(self, call) -> None:
        """A W&B call; W&B gone (Slurm's preemption signal reaches its service process too: the next call raised
        ConnectionResetError, and the run died without its save) is one warning, the run going on without it."""
        try:
            call()
        except Exception as e:
            self._wandb = None
            try:  # (its exit hook would try the service again: a traceback as the process ends)
                import wandb

                wandb.teardown(exit_code=1)
            except Exception:
                pass
            print(
                f"warning: W&B stopped answering ({type(e).__name__}: {str(e)[:200]}); the run goes on without it "
                "(the console and --log-jsonl keep the metrics)",
                file=sys.stderr,
                flush=True,
            )

    def close(self, exit_code: int = 0) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb is not None:  # (a halted or failed run is not marked finished)
            self._wandb_call(lambda: self._wandb.finish(exit_code=exit_code))
        if self._tb is not None:
            self._tb.close()
        self._jsonl = self._wandb = self._tb = None  # (closed once)
