"""--profile: Megatron's profiling window. On the ranks in --profile-ranks, the iterations after
--profile-step-start completed ones, up to --profile-step-end, are recorded:

- with --use-pytorch-profiler, by torch.profiler (CPU, and CUDA on a GPU; shapes and stacks), written to
  --tensorboard-dir as Megatron does (or to --profile-dir, ours, which needs no tensorboard package) as a
  `*.pt.trace.json` that TensorBoard's profiler plugin and Perfetto open;
- without it, as an Nsight Systems capture range (cudaProfilerStart/Stop, an NVTX range per operator): run the
  job under `nsys profile --capture-range=cudaProfilerApi`. That needs CUDA; on a CPU job it is refused at
  start-up."""

from __future__ import annotations

import contextlib

import torch

from megatron_lite.config import ConfigError
from megatron_lite.training.configs import LoggingConfig


def validate_profile(cfg: LoggingConfig, world_size: int, cuda: bool) -> None:
    if not cfg.profile:
        return
    if not 0 <= cfg.profile_step_start < cfg.profile_step_end:
        raise ConfigError(
            f"--profile-step-start {cfg.profile_step_start} must be below --profile-step-end {cfg.profile_step_end}"
        )
    bad = [r for r in cfg.profile_ranks if not 0 <= r < world_size]
    if bad:
        raise ConfigError(f"--profile-ranks {' '.join(map(str, bad))}: the world has ranks 0..{world_size - 1}")
    if cfg.use_pytorch_profiler and not cfg.profile_dir:
        raise ConfigError(
            "--use-pytorch-profiler writes its trace to --tensorboard-dir (or --profile-dir); add one of them"
        )
    if not cfg.use_pytorch_profiler and not cuda:
        raise ConfigError(
            "--profile without --use-pytorch-profiler marks an Nsight Systems capture range, which needs CUDA; "
            "add --use-pytorch-profiler (a torch.profiler trace, also on CPU)"
        )


class ProfileWindow:
    """Starts and stops the profiler around the window; `completed` is the number of iterations done."""

    def __init__(self, cfg: LoggingConfig, rank: int, cuda: bool, log=print) -> None:
        self.cfg, self.cuda, self.log = cfg, cuda, log
        self.on = cfg.profile and rank in cfg.profile_ranks
        self._prof = None
        self._nvtx = None

    def before_step(self, completed: int) -> None:
        if not self.on or completed != self.cfg.profile_step_start:
            return
        if self.cfg.use_pytorch_profiler:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(
                activities=activities,
                record_shapes=True,
                with_stack=True,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(self.cfg.profile_dir),
            )
            self._prof.start()
        else:
            torch.cuda.cudart().cudaProfilerStart()
            self._nvtx = contextlib.ExitStack()
            self._nvtx.enter_context(torch.autograd.profiler.emit_nvtx(record_shapes=True))
        self.log(f"profiling iterations {completed + 1}..{self.cfg.profile_step_end}")

    def after_step(self, completed: int) -> None:
        if not self.on or completed != self.cfg.profile_step_end:
            return
        self.close()
        where = f"trace in {self.cfg.profile_dir}" if self.cfg.use_pytorch_profiler else "nsys capture range"
        self.log(f"profiling done ({where})")

    def close(self) -> None:
        """Stops a window still open (the run ended or stopped inside it); writes what was recorded."""
        if self._prof is not None:
            self._prof.stop()  # the trace handler writes the file
            self._prof = None
        if self._nvtx is not None:
            self._nvtx.close()
            torch.cuda.cudart().cudaProfilerStop()
            self._nvtx = None
