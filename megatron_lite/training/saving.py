"""A checkpoint save that fails mid-run, and a rank that lost its peers: each said in one line on every rank,
not as each rank's traceback."""

from __future__ import annotations

import contextlib
import re

import torch.distributed as dist

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
def saving(root: str):
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
        raise SaveFailed(
            f"saving a checkpoint into --save {root} failed: {type(e).__name__}: {e}. The previous checkpoint is "
            "untouched: free space there (or give another --save) and run the command again to resume from it"
        ) from e


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
