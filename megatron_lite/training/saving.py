"""A checkpoint save that fails mid-run, and a rank that lost its peers: each said in one line on every rank,
not as each rank's traceback."""

from __future__ import annotations

import contextlib
import errno
import os
import re

import torch.distributed as dist

from megatron_lite.checkpoint.format import read_tracker
from megatron_lite.config import ConfigError
from megatron_lite.resilience.supervisor import TrainingHalted


def finish_async_save(saver, log) -> None:
    """Publish an --async-save still being written (every rank calls it at the same point)."""
    if saver is None:
        return
    with saving(saver.root):
        if path := saver.finish():
            log.info(f"saved {path} (async)")


class SaveFailed(RuntimeError):
    """A checkpoint that could not be written (a full disk, a --save made read-only mid-run), raised by every rank
    at the same point (the save's own collectives tell the others): one line, not each rank's traceback."""


@contextlib.contextmanager
def saving(root: str, flag: str = "--save"):
    """A failed save as SaveFailed, naming --save (a full disk on rank 0 was a 30-line traceback whose last line
    named no directory: "SafetensorError: ... No space left on device"); the tracker still names the previous
    checkpoint, so the same command resumes from it once there is room."""
    try:
        yield
    except (ConfigError, TrainingHalted, SaveFailed):
        raise
    except Exception as e:
        if peer_lost(e):  # (a rank that died mid-save: main says so)
            raise
        raise SaveFailed(_failure(root, e, flag)) from e


def _failure(root: str, e: Exception, flag: str = "--save") -> str:
    """What failed, the OS's reason, and what is true of --save now: it said "the previous checkpoint is untouched:
    free space there" when there was none and the cause was a missing directory."""
    code = _os_errno(e)
    name = errno.errorcode.get(code, str(code))
    cause = "" if code is None else f" ({name})" if os.strerror(code) in str(e) else f" ({os.strerror(code)}, {name})"
    try:
        previous = read_tracker(root)
    except (OSError, ValueError):
        previous = None
    space = code in (errno.ENOSPC, getattr(errno, "EDQUOT", -1))
    fix = "free space there" if space else "fix the cause"
    if previous is None:
        then = f"No checkpoint was saved there: {fix} (or give another {flag}) and run the command again"
    else:
        then = (
            f"The previous checkpoint (iteration {previous}) is untouched: {fix} (or give another {flag}) and run "
            "the command again to resume from it"
        )
    return f"saving a checkpoint into {flag} {root} failed: {type(e).__name__}: {e}{cause}. {then}"


def _os_errno(e: BaseException) -> int | None:
    """The OS error number behind `e`: its own, a cause's, or one named in its text (safetensors' Rust errors say
    "... (os error 28)"; an --async-save's repeats the failing rank's "[Errno 28] ...")."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    found = re.search(r"\[Errno (\d+)\]|os error (\d+)", str(e))  # (an --async-save's, from the rank it failed on)
    return int(found.group(1) or found.group(2)) if found else None


def peer_lost(e: BaseException) -> str | None:
    """The transport's words when `e` says a peer rank went away (gloo: a connection reset or closed by the
    peer; NCCL: a backend error), else None: such a rank is not the one to explain the failure, and its
    traceback buried the one that does."""
    if isinstance(e, OSError) or not (dist.is_initialized() and dist.get_world_size() > 1):
        return None  # (a closed stdout is a BrokenPipeError of this process, not a lost rank)
    text = str(e).split(". ")[0]
    if isinstance(e, getattr(dist, "DistBackendError", ())) or re.search(r"by peer|Broken pipe", text):
        return re.sub(r"^\[[^\]]*\]\s*", "", text).strip()[:200]
    return None
