"""Checks of the parsed flags on their own (before any config is built) and the kernel choice: one line naming
the flag, its value and the fix (split from arguments.py)."""

from __future__ import annotations

import argparse

from megatron_lite.config import ConfigError


def resolve_kernel_impl(requested: str | None, backend: str | None = None, half: bool = False) -> str:
    """Triton on CUDA, PyTorch on a CPU, unless asked; Triton where it cannot run is refused, not ignored. A gloo
    job runs on CPU tensors even on a GPU machine. `half`: --bf16 or --fp16, which the Triton interpreter cannot run
    (it has no half-precision arithmetic: its tl.dot returns garbage)."""
    import os

    import torch

    from megatron_lite.kernels import HAVE_TRITON

    on_gpu = torch.cuda.is_available() and backend != "gloo"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # (every kernel, a GPU's tensors' too)
    runnable = HAVE_TRITON and (on_gpu or interpreted)
    if requested is None:
        requested = "triton" if runnable and on_gpu else "torch"
    if requested == "triton" and not runnable:
        where = "--distributed-backend gloo runs on CPU tensors" if torch.cuda.is_available() else "no CUDA GPU"
        raise ConfigError(
            f"--kernel-impl triton needs a CUDA GPU with triton installed ({where}); use --kernel-impl torch (or "
            "TRITON_INTERPRET=1 for the slow CPU interpreter)"
        )
    if requested == "triton" and half and interpreted:
        raise ConfigError(
            "--kernel-impl triton with --bf16 / --fp16 runs under the Triton interpreter (TRITON_INTERPRET=1), "
            "which has no half-precision arithmetic (its matmuls return garbage); use --kernel-impl torch, or fp32"
        )
    return requested


def check_run_length(ns: argparse.Namespace) -> None:
    """Iteration-based or sample-based, never both (Megatron's rule), schedule flags in the run's unit."""
    if ns.train_iters is None and ns.train_samples is None:
        raise ConfigError("missing required flag: --train-iters N (or --train-samples N)")
    if ns.train_iters is not None and ns.train_samples is not None:
        raise ConfigError("--train-iters and --train-samples are exclusive; keep one")
    by_iters = {"--lr-decay-iters": ns.lr_decay_iters, "--lr-warmup-iters": ns.lr_warmup_iters or None,
                "--lr-wsd-decay-iters": ns.lr_wsd_decay_iters}  # fmt: skip
    by_samples = {"--lr-decay-samples": ns.lr_decay_samples, "--lr-warmup-samples": ns.lr_warmup_samples or None,
                  "--lr-wsd-decay-samples": ns.lr_wsd_decay_samples}  # fmt: skip
    if ns.rampup_batch_size is not None and ns.train_samples is None and not getattr(ns, "old_rampup", False):
        # (the ramp's steps take fewer samples than the iteration lengths' final batches: the decay would never end)
        raise ConfigError(
            f"--rampup-batch-size {' '.join(map(str, ns.rampup_batch_size))} needs a sample-based run, as in "
            "Megatron: give --train-samples (and --lr-*-samples) instead of --train-iters"
        )
    wrong = by_iters if ns.train_samples is not None else by_samples
    for flag, value in wrong.items():
        if value is not None:
            run, other = (
                ("--train-samples", "-samples") if ns.train_samples is not None else ("--train-iters", "-iters")
            )
            raise ConfigError(f"{flag} {value} does not go with {run}: use the {other} form of the flag")


def check_moe_flags(ns: argparse.Namespace) -> None:
    """Megatron's refusals of MoE flags that would do nothing, or train nothing."""
    if ns.overlap_moe_expert_parallel_comm and (ns.num_experts is None or ns.expert_model_parallel_size == 1):
        what = "no --num-experts" if ns.num_experts is None else "--expert-model-parallel-size 1"
        raise ConfigError(
            f"--overlap-moe-expert-parallel-comm overlaps the expert-parallel all-to-alls; with {what} there are "
            "none: drop the flag (or set --expert-model-parallel-size > 1)"
        )
    post = ns.moe_router_score_function == "softmax" and not ns.moe_router_pre_softmax
    kinds = ns.moe_router_load_balancing_type
    post = post and "sinkhorn" not in ([kinds] if isinstance(kinds, str) else kinds)  # (sigmoid at top-1 there)
    if ns.num_experts is not None and ns.moe_router_topk == 1 and post:
        raise ConfigError(
            "--moe-router-topk 1 with the softmax over the chosen expert alone gives every token the weight 1, so "
            "the router learns nothing from the LM loss: add --moe-router-pre-softmax (as Megatron asks)"
        )
