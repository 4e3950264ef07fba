"""How a start-up error is said under torchrun: once per node where every rank found it, and by the rank that
found it alone otherwise."""

from __future__ import annotations

import json
import os
import sys
import time


def report_error(error: Exception, initialized: bool) -> None:
    """A start-up error, said once per node: before the process group (`initialized` False) the flags and files
    are the same for every rank, and so is the error, said by the first local rank; later, by each rank with
    its own."""
    rank = os.environ.get("RANK", "0")
    line = f"error: {error}" if rank == "0" else f"error (rank {rank}): {error}"
    record_for_launcher(line)
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


def record_for_launcher(line: str) -> None:
    """`line`, the one this rank exits on, left where torchrun's summary reads it: its "Root Cause" block said only
    "traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html", 45-53 lines
    burying ours. The JSON is torch elastic's ErrorHandler.record_exception's (the same from torch 2.4 on); the
    summary shows its py_callstack, here the line itself. Nothing outside torchrun (no TORCHELASTIC_ERROR_FILE)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    tmp = f"{path}.{os.getpid()}.tmp"  # (whole or not at all: torchrun raises on a file it cannot parse)
    try:
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:  # (the summary then says what it said before; the line was printed all the same)
        pass


def _launcher_store():
    """torchrun's store (this restart attempt's keys), or None outside torchrun or where it cannot be reached."""
    try:
        from megatron_lite.parallel_context import _attempt_store

        return _attempt_store(5.0)
    except Exception:
        return None
