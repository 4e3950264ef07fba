"""--moe-use-upcycling as Megatron-LM's training.py runs it: the dense checkpoint in --load (weights only: its
iteration, optimizer state and LR schedule are dropped) becomes this MoE model (checkpoint/upcycling.py), which is
saved to --save as iteration 1 before training goes on from there with a fresh optimizer and schedule; the data
goes on where the dense run stopped (Megatron's load_checkpoint takes the dense checkpoint's consumed samples
before training.py sets args.iteration = 1), from its start with --finetune. Megatron refuses the flag once --save holds
a checkpoint ("Upcycling should only be set for the first run"); here a restart of the same command (torchrun
--max-restarts, a requeue) resumes from --save as any run does, and with --no-auto-resume it is refused as there.

Every check runs at start-up, before any process group: the flags (validate_upcycling, from JobConfig) and the
dense checkpoint against them (check_upcycling)."""

from __future__ import annotations

import os

from megatron_lite.checkpoint.checkpointing import (
    TrainState,
    _fresh_optimizer,
    find_checkpoint,
    model_config_from_dict,
    read_metadata,
    same_directory,
    save_checkpoint,
)
from megatron_lite.checkpoint.upcycling import load_upcycled
from megatron_lite.config import ConfigError, ModelConfig


def validate_upcycling(job) -> None:
    """The flags alone (a JobConfig with --moe-use-upcycling)."""
    ck, m = job.checkpoint, job.model
    g = ck.moe_upcycling_granularity
    fix = "(it upcycles the dense checkpoint in --load into this MoE run)"
    if not ck.load:
        raise ConfigError(f"--moe-use-upcycling needs --load DIR, the dense checkpoint to upcycle {fix}")
    if not m.num_experts:
        raise ConfigError(f"--moe-use-upcycling needs --num-experts N, the experts to make {fix}")
    if not ck.save:
        raise ConfigError("--moe-use-upcycling saves the upcycled model to --save as iteration 1 (as Megatron): "
                          "give --save DIR, another directory than --load")  # fmt: skip
    if same_directory(ck.load, ck.save):
        raise ConfigError(
            f"--moe-use-upcycling with --save the same directory as --load ({ck.save}): the upcycled checkpoint "
            "would sit among the dense ones; give --save another directory"
        )
    if m.num_experts % g:
        raise ConfigError(
            f"--moe-upcycling-granularity {g} must divide --num-experts {m.num_experts} (each group of {g} experts "
            "holds one copy of the dense MLP, as in Megatron)"
        )
    if job.lora is not None:
        raise ConfigError(
            "--moe-use-upcycling with --lora-rank: upcycle first (a run with --moe-use-upcycling), then add LoRA "
            "adapters to the upcycled checkpoint in a later run"
        )


def _dense_equivalent(moe: ModelConfig, dense: ModelConfig) -> list[str]:
    """Where the MoE run's model differs from the dense checkpoint's beyond its MLPs."""
    from megatron_lite.checkpoint.compatibility import STRUCTURE

    mlp = {
        "ffn_size",
        "num_experts",
        "moe_layers",
        "moe_shared_expert_intermediate_size",
        "moe_shared_expert_gate",
        "moe_ffn_size",
        "vocab_size",
    }  # fmt: skip  (the vocabulary: checked against the data in pretrain.run)
    return [f"{flag} ({getattr(dense, f)!r} there, {getattr(moe, f)!r} here)" for f, flag in STRUCTURE.items()
            if f not in mlp and getattr(dense, f) != getattr(moe, f)]  # fmt: skip


def check_upcycling(job, ckpt_path: str | None) -> bool:
    """Whether this run upcycles (--moe-use-upcycling: training.resume.starting_checkpoint turns it off where the
    job resumes its own checkpoint in --save), after checking the dense checkpoint `ckpt_path` against the flags;
    before any process group exists."""
    ck = job.checkpoint
    if not ck.moe_use_upcycling:
        return False
    if find_checkpoint(ck.save, own=True, flag="--save"):  # (--no-auto-resume: Megatron's assertion)
        raise ConfigError(
            f"--moe-use-upcycling with --save {ck.save}, which holds a checkpoint already: upcycling is for the "
            "first run only (as in Megatron); drop --moe-use-upcycling (and --no-auto-resume) to resume from it, or "
            "give --save an empty directory"
        )
    if ckpt_path is None:
        raise ConfigError(f"--moe-use-upcycling: --load {ck.load} holds no checkpoint to upcycle")
    dense = model_config_from_dict(read_metadata(ckpt_path)["config"]["model"])
    m, g = job.model, ck.moe_upcycling_granularity
    if dense.num_experts:
        raise ConfigError(
            f"--moe-use-upcycling: {ckpt_path} holds an MoE model already ({dense.num_experts} experts); upcycling "
            "starts from a dense one"
        )
    if dense.ffn_size != m.moe_ffn_size * g:
        flag = "--moe-ffn-hidden-size" if m.moe_ffn_hidden_size is not None else "--ffn-hidden-size"
        raise ConfigError(
            f"{flag} {m.moe_ffn_size} x --moe-upcycling-granularity {g} = {m.moe_ffn_size * g} must be the dense "
            f"checkpoint's FFN size {dense.ffn_size} ({ckpt_path}): set {flag} {dense.ffn_size // g}"
            + ("" if dense.ffn_size % g == 0 else f" with a granularity that divides {dense.ffn_size}")
        )
    if not all(m.moe_layers) and m.ffn_size != dense.ffn_size:
        raise ConfigError(
            f"--ffn-hidden-size {m.ffn_size}: this run's dense layers (--moe-layer-freq) take the dense checkpoint's "
            f"MLPs whole, of size {dense.ffn_size}: set --ffn-hidden-size {dense.ffn_size} (the experts' size is "
            "--moe-ffn-hidden-size)"
        )
    offset, clamp = m.glu_linear_offset, m.activation_func_clamp_value
    if g > 1 and (offset or clamp is not None):  # (Megatron refuses quick-GEGLU at any granularity)
        raise ConfigError(
            f"--moe-upcycling-granularity {g} with --glu-linear-offset {offset} / --activation-func-clamp-value "
            f"{clamp}: the experts' scaled weights would move the clamp and shrink the offset's share (the output "
            "would not be the dense one's); use --moe-upcycling-granularity 1, which copies the MLP exactly"
        )
    if differs := _dense_equivalent(m, dense):
        raise ConfigError(f"--moe-use-upcycling: {ckpt_path} differs from this run's model in {differs[0]}")
    return True


def upcycle(ckpt_path: str, model, optimizer, scheduler, ctx, job, log) -> tuple[TrainState, str]:
    """Load the dense checkpoint upcycled into `model`, start the optimizer and schedule afresh from it and save
    it to --save as iteration 1 (with that fresh optimizer state: a restart from it goes on exactly as this run).
    Returns the state training goes on from and the saved checkpoint (a rollback's start)."""
    ck = job.checkpoint
    kept = load_upcycled(ckpt_path, model, ctx, ck.moe_upcycling_granularity)
    if optimizer is not None:
        _fresh_optimizer(optimizer, scheduler)  # (main weights from the upcycled model)
    # (the dense run's data position, as Megatron's load_checkpoint takes it; --finetune starts the data over)
    meta = read_metadata(ckpt_path)
    seen = (0, 0) if ck.finetune else (int(meta["consumed_samples"]), int(meta.get("consumed_valid_samples", 0)))
    state = TrainState(1, *seen)
    path = save_checkpoint(ck.save, state, model, optimizer, scheduler, ctx, job.checkpoint_dict(),
                           save_optim=not ck.no_save_optim, save_rng=not ck.no_save_rng)  # fmt: skip
    log.info(
        f"upcycled {ckpt_path} into {job.model.num_experts} experts (granularity {ck.moe_upcycling_granularity}), "
        f"saved to {path}: training goes on from iteration 1 with a fresh optimizer and LR schedule, the data "
        + (f"after the dense run's {seen[0]} samples" if seen[0] else "from its start")
        + (f"; {len(kept)} weights the dense model lacks keep their initialisation ({kept[0]}, ...)" if kept else "")
    )
    return state, os.path.abspath(path)
