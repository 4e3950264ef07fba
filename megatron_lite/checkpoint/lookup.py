"""Finding a checkpoint: the newest complete iteration under a --load/--save directory (or the one --ckpt-step
names), its metadata, and the one-line errors for directories that hold something else (a Megatron-LM
checkpoint, a Hugging Face model or PEFT adapter, a save cut short)."""

from __future__ import annotations

import glob
import json
import os

from megatron_lite.checkpoint.compatibility import megatron_lm
from megatron_lite.checkpoint.format import (
    FORMAT,
    NON_PERSISTENT_SUBDIR,
    READABLE,
    TRACKER,
    complete_iterations,
    iteration_dir,
    read_tracker,
)
from megatron_lite.checkpoint.hf_files import peft_adapter
from megatron_lite.config import ConfigError


def _non_persistent(root: str, step: int) -> str:
    """A hint where iteration `step` is one of the run's non-persistent checkpoints, which --ckpt-step does not
    look at under the --save directory (an exploratory run: the error said it was not there)."""
    other = os.path.join(root, NON_PERSISTENT_SUBDIR)  # (the global ones' default: checkpoint/non_persistent.py)
    if os.path.isdir(other) and _whole(iteration_dir(other, step)) is not None:
        # (--no-auto-resume: the --save that holds it, holding checkpoints, would be resumed from instead)
        return (
            f"; iteration {step} is a non-persistent checkpoint: --load {other} --ckpt-step {step} --no-auto-resume "
            "loads it"
        )
    return ""


def find_checkpoint(root: str | None, step: int | None = None, own: bool = False, flag: str = "--load") -> str | None:
    """The newest complete checkpoint directory under `root` (iteration `step`'s with --ckpt-step); `root`
    itself when it is one iteration's directory; None when `root` is missing or empty. Without the tracker file
    (a job killed between publishing its first checkpoint and writing the tracker), the newest complete one.
    A directory that holds something else is a one-line error naming `flag` (the caller's), unless it is the
    job's own --save directory (`own`): its logs may lie there before any checkpoint does."""
    if root and step is None and os.path.isfile(os.path.join(root, "metadata.json")):
        return root  # (a QLoRA checkpoint records its base this way: that iteration, not the newest)
    leftovers = (".tmp", ".old", ".partial")  # a save killed before the first checkpoint was published
    # (and a run's non-persistent checkpoints alone: checkpoint/non_persistent.py looks there)
    if (
        not root
        or not os.path.isdir(root)
        or all(n.endswith(leftovers) or n == NON_PERSISTENT_SUBDIR for n in os.listdir(root))
    ):
        if step is not None:
            raise ConfigError(f"--ckpt-step {step}: --load {root} holds no checkpoint{_non_persistent(root, step)}")
        return None
    if step is not None:
        path = _whole(iteration_dir(root, step))
        if path is None:
            have = complete_iterations(root)
            raise ConfigError(
                f"--ckpt-step {step}: --load {root} has no complete checkpoint of iteration {step} "
                f"(it has {have or 'none'}); pick one of those or drop --ckpt-step for the newest"
                + _non_persistent(root, step)
            )
        return path
    try:
        iteration = read_tracker(root)
    except ValueError as e:
        megatron_lm(f"{flag} {root}", os.path.join(root, "release"))  # (Megatron's released ones: "release")
        raise ConfigError(f"{flag} {root}: {e}") from None
    if iteration is None and (have := complete_iterations(root)):
        iteration = have[-1]
    if iteration is None:
        if own:
            return None
        fix = (
            "point --load at the --save directory of a run, or at an empty directory to start from scratch"
            if flag == "--load"
            else "give the --save directory of a run, or one of its iteration directories"
        )
        if (adapter := peft_adapter(root)) is not None:
            fix = "it " + adapter.removeprefix(f"{root} ")  # (beside a model's weights too: the adapter)
        elif os.path.isfile(os.path.join(root, "config.json")) and glob.glob(os.path.join(root, "*.safetensors")):
            fix = (
                "it is a Hugging Face model directory: convert it first (tools/checkpoint/convert.py --loader hf "
                f"--saver megatron_lite --load-dir {root} --save-dir CKPT) and give CKPT"
            )
        raise ConfigError(f"{flag} {root} is not a megatron_lite checkpoint directory (no {TRACKER}); {fix}")
    path = _whole(iteration_dir(root, iteration))
    if path is None:
        megatron_lm(f"{flag} {root}", iteration_dir(root, iteration))
        missing = os.path.join(iteration_dir(root, iteration), "metadata.json")
        have = complete_iterations(root)
        fix = (
            f"; the complete ones there are {have}: resume from one with --load {root} --ckpt-step {have[-1]}"
            if have
            else "; it holds no complete checkpoint"
        )
        raise ConfigError(f"{flag} {root}: {TRACKER} names iteration {iteration} but {missing} is missing{fix}")
    return path


def same_directory(a: str | None, b: str | None) -> bool:
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def _whole(path: str) -> str | None:
    """An iteration's directory if it is complete; else its `.old` copy if that one is (a job killed while a
    re-save of the same iteration swapped directories: format.replace_dir); else None."""
    for candidate in (path, path + ".old"):
        if os.path.isfile(os.path.join(candidate, "metadata.json")):
            return candidate
    return None


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint file {path} cannot be read ({type(e).__name__}: {e})") from None


def read_metadata(path: str) -> dict:
    meta = _read_json(os.path.join(path, "metadata.json"))
    if meta.get("format") not in READABLE:
        megatron_lm(None, path)
        raise ConfigError(f"{path}/metadata.json has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta
