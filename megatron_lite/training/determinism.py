"""Megatron's --deterministic-mode and --data-parallel-random-init: what a run sets up before it trains.

--deterministic-mode (Megatron-LM's validate_args, Megatron-Core's `deterministic_mode`): the run calls
torch.use_deterministic_algorithms(True) (cuDNN deterministic, no cuDNN benchmarking), so PyTorch's index_add_,
scatter_add_ and index_put_ on CUDA (MoE token combine, the vocabulary-parallel loss's gradient, the embedding's
gradient) take their deterministic algorithms, and an op that has none raises instead of varying. Our Triton
kernels read the same switch: they use no atomics, and flash attention, whose autotuner picks tiles by timing
(two runs could pick two tilings, which round differently), runs on fixed tiles (kernels/flash_attention.py).
cuBLAS is deterministic only with a fixed workspace: CUBLAS_WORKSPACE_CONFIG is set to :4096:8 before CUDA
starts, unless given. As Megatron, NCCL must be pinned to an algorithm that reduces in a fixed order (NCCL_ALGO;
NVLS's in-switch reductions do not): refused at start-up otherwise. Gloo's reductions are ordered already.
Megatron also refuses --use-flash-attn (the flash-attn package's backward adds with atomics) and
--cross-entropy-loss-fusion; here both name kernels that are deterministic under the flag (no-ops, see
megatron_flag_tables.py), so they are not refused.

--data-parallel-random-init (Megatron's _set_random_seed and get_model): each data-parallel rank seeds its
generators with --seed + 10 x its data-parallel rank, so it draws its own weights and, from then on, its own
dropout masks; the weights are then broadcast from data-parallel rank 0 (Megatron's DDP.broadcast_params), so
every replica trains from rank 0's, the weights a run without the flag draws. What differs is the dropout: each
replica draws its own masks, where without the flag every replica repeats rank 0's for its own micro-batches. With
dropout a run with the flag is therefore not the run without it (by design; neither is the one-process run, which
draws one stream for all micro-batches); without dropout it still logs what one process logs.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.config import ConfigError
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.parameters import named_param_meta, replica_group

# Megatron-LM's list (validate_args): NCCL algorithms whose reductions add in a fixed order.
DETERMINISTIC_NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")
# The workspace settings with which cuBLAS is deterministic (PyTorch's reproducibility notes); torch refuses a
# CUDA matmul under deterministic algorithms without one.
CUBLAS_WORKSPACE_CONFIGS = (":4096:8", ":16:8")

_SAVED: list[tuple] = []  # the caller's settings, restored by leave_deterministic_mode


def enter_deterministic_mode(job, world_size: int) -> list[str]:
    """Check --deterministic-mode's requirements (a one-line ConfigError) and set PyTorch's switches to the flag's
    value for this run: on with it, off without it (an in-process caller's earlier run does not leak into this
    one); `leave_deterministic_mode` restores the caller's. Called before CUDA and the process group start.
    Returns the lines to log."""
    on = job.deterministic_mode
    env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if on:
        backend = job.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        on_gpu = torch.cuda.is_available() and backend != "gloo"  # (a gloo job runs on the CPU: parallel_context)
        algo = os.environ.get("NCCL_ALGO")
        if backend == "nccl" and world_size > 1 and algo not in DETERMINISTIC_NCCL_ALGOS:
            raise ConfigError(
                f"--deterministic-mode with NCCL needs NCCL_ALGO set to one of {', '.join(DETERMINISTIC_NCCL_ALGOS)} "
                f"(as Megatron requires: NCCL's choice, NVLS's in-switch sums among them, may add in another order "
                f"from run to run), not {'unset' if algo is None else repr(algo)}: export NCCL_ALGO=Ring, say"
            )
        if env is not None and env not in CUBLAS_WORKSPACE_CONFIGS:
            raise ConfigError(
                f"--deterministic-mode with CUBLAS_WORKSPACE_CONFIG={env}: cuBLAS is deterministic only with "
                f"{' or '.join(CUBLAS_WORKSPACE_CONFIGS)}; export one of them, or unset it (:4096:8 is then set)"
            )
        if env is None and on_gpu and torch.cuda.is_initialized():
            # (cuBLAS reads it when its handle is made: too late for a caller that already ran CUDA work)
            raise ConfigError(
                "--deterministic-mode: CUDA was started in this process before the run, without "
                "CUBLAS_WORKSPACE_CONFIG; export CUBLAS_WORKSPACE_CONFIG=:4096:8 before starting"
            )
    _SAVED.append(
        (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
            env,
        )
    )
    torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.deterministic = on
    if not on:
        return []
    torch.backends.cudnn.benchmark = False
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = env or CUBLAS_WORKSPACE_CONFIGS[0]
    return [
        "--deterministic-mode: torch.use_deterministic_algorithms(True), "
        f"CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']}, flash attention on fixed tiles"
    ]


def leave_deterministic_mode() -> None:
    """Restore what `enter_deterministic_mode` found (the CLI's process ends anyway; in-process callers, the test
    pools among them, go on with their own settings)."""
    if not _SAVED:
        return
    on, warn_only, cudnn_deterministic, benchmark, env = _SAVED.pop()
    torch.use_deterministic_algorithms(on, warn_only=warn_only)
    torch.backends.cudnn.deterministic = cudnn_deterministic
    torch.backends.cudnn.benchmark = benchmark
    if env is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = env


def seed_rngs(ctx: ParallelContext, job) -> int:
    """Megatron's _set_random_seed: the generators of this rank (ParallelContext.seed adds 100 x the pipeline rank
    and the tensor/expert offsets), with --data-parallel-random-init 10 x the data-parallel rank more. Returns the
    seed this rank draws its weights with."""
    seed = job.training.seed + (10 * ctx.dp.rank if job.data_parallel_random_init else 0)
    ctx.seed(seed)
    return seed


@torch.no_grad()
def broadcast_params(model: nn.Module, ctx: ParallelContext, job) -> None:
    """Megatron's DistributedDataParallel.broadcast_params, called where Megatron's get_model calls it (with
    --data-parallel-random-init only, before training): each weight from data-parallel rank 0 of the ranks holding
    it (data x context parallel; an expert's expert-data-parallel group)."""
    if not job.data_parallel_random_init:
        return
    for _, p, meta in named_param_meta(model):
        group = replica_group(meta, ctx)
        if group.size > 1:
            dist.broadcast(p.data, src=group.ranks[0], group=group.pg)
