"""How a start-up error is said under torchrun: once per node where every rank found it, and by the rank that
found it alone otherwise."""

from __future__ import annotations

import os
import sys
import time


def report_error(error: Exception, initialized: bool) -> None:
    """A start-up error, said once per node: before the process group (`initialized` False) the flags and files
    are the same for every rank, and so is the error, said by the first local rank; later, by each rank with
    its own."""
    rank = os.environ.get("RANK", "0")
    line = f"error: {error}" if rank == "0" else f"error (rank {rank}): {error}"
    if initialized:
        print(line, file=sys.stderr, flush=True)
        return
    # Under torchrun the node's first local rank leaves what it said in the launcher's store: another local rank
    # keeps quiet only where that is its own error. One only it found (a file its own copy lacks, a cache
    # directory of its own) was never said, torchrun showing its exit code 2 alone.
    store = _launcher_store()
    key = f"megatron_lite/start_up_error/{os.environ.get('GROUP_RANK', '0')}"
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
        if store is not None:
            store.set(key, str(error))
        return
    if store is None:  # a moment for the first local rank to say it: torchrun stops the others at the first exit
        time.sleep(1.0)
        return
    from datetime import timedelta

    try:
        store.wait([key], timedelta(seconds=3))
        said = store.get(key).decode()
    except Exception:  # (nothing within the wait: the first local rank found no error, or is slower)
        said = None
    if said != str(error):
        print(line, file=sys.stderr, flush=True)


def _launcher_store():
    """torchrun's store (this restart attempt's keys), or None outside torchrun or where it cannot be reached."""
    try:
        from megatron_lite.parallel_context import _attempt_store

        return _attempt_store(5.0)
    except Exception:
        return None
