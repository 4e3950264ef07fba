"""How a start-up error is said under torchrun: once per node where every rank found it, and by the rank that
found it alone otherwise; and how the other nodes hear it: before the process group every rank waits in the job's
store for every other to start, and stops at the first start-up error one left there (an exploratory run: a node
whose flags failed validation exited, the others waited in their first collective for --distributed-timeout-
minutes, 30 in the shipped scripts, and then reported its ranks as silent)."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

from megatron_lite.config import ConfigError

STARTED = "megatron_lite/started"  # how many ranks of this attempt reached their process group
FAILED = "megatron_lite/start_up_error/any"  # the first start-up error any rank left
LINGER_S = 10.0  # how long rank 0, stopped at start-up, serves its store for the other nodes to read why
AGENT_STORE_S = 60.0  # how long torchrun's own store may take to answer a worker it started


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
    # Rank 0 serves a store of its own per attempt (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) from its process group
    # on: stopped before it, it serves one a while for the other nodes to read why
    own = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1
    host = rank == "0" and own
    store = _launcher_store(host)
    key = f"megatron_lite/start_up_error/{os.environ.get('GROUP_RANK', '0')}"
    if store is not None:  # (for the other nodes' ranks, waiting for this one: the first error wins)
        where = f"rank {rank} (node {os.environ.get('GROUP_RANK', '0')})"
        _try(lambda: store.compare_set(FAILED, "", f"{where} stopped at start-up: {error}"))
        if host:
            time.sleep(LINGER_S)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
        if store is not None:
            _try(lambda: store.set(key, str(error)))
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


def _try(fn) -> None:
    try:
        fn()
    except Exception:  # (a store gone or slow: the line is printed all the same)
        pass


def _launcher_store(host: bool = False):
    """This attempt's store under torchrun, or None outside torchrun or where it cannot be reached."""
    try:
        return job_store(5.0, host)
    except Exception:
        return None


def job_store(timeout_s: float, host: bool = False):
    """This attempt's store under torchrun (None outside it): the launcher's shared one (this attempt's keys,
    parallel_context._attempt_store), or, where each attempt has a store of its own (TORCH_DISABLE_SHARE_RDZV_TCP_
    STORE=1), rank 0's at MASTER_ADDR:MASTER_PORT, which rank 0 serves (`host`) from before the process group."""
    import torch.distributed as dist

    from megatron_lite.parallel_context import _attempt_store

    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env or "MASTER_ADDR" not in env:
        return _attempt_store(timeout_s)
    addr, port, world = env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env.get("WORLD_SIZE", "1"))
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent serves it before starting any worker: one that does not answer soon has stopped (the
        # first node's, its worker failed at start-up: a client waited the whole timeout to connect, unsaid)
        try:
            return _attempt_store(timeout_s, connect_s=min(timeout_s, AGENT_STORE_S))
        except Exception as e:
            raise ConfigError(
                f"the job's store at {addr}:{port}, which the first node's torchrun serves, did not answer within "
                f"{min(timeout_s, AGENT_STORE_S):g} s ({type(e).__name__}): that node stopped (its log says why)"
            ) from None
    try:
        return dist.TCPStore(addr, port, world, is_master=host, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False, multi_tenant=True)  # fmt: skip
    except Exception as e:
        if host:
            raise
        raise ConfigError(
            f"the job's store at {addr}:{port}, which rank 0 serves, did not answer within {timeout_s:g} s "
            f"({type(e).__name__}): rank 0's node stopped before it started (its log says why), or cannot be reached"
        ) from None


def wait_for_every_rank(store, world_size: int, timeout_s: float) -> None:
    """Before the process group: every rank of this attempt has started, or one on another node left a start-up
    error (then it is this rank's, named), or the timeout passed (one line: how many never started)."""
    if store is None or world_size == 1:
        return
    try:
        _wait(store, world_size, timeout_s)
    except ConfigError:
        raise
    except Exception as e:  # (the store's server went away: its node stopped)
        raise ConfigError(
            f"the job's store stopped answering while the ranks started ({type(e).__name__}): the node serving it "
            "(the first, or rank 0's) stopped (its log says why)"
        ) from None


def _wait(store, world_size: int, timeout_s: float) -> None:
    store.add(STARTED, 1)
    deadline, pause = time.monotonic() + timeout_s, 0.02
    while (started := store.add(STARTED, 0)) < world_size:
        if store.check([FAILED]) and (said := store.get(FAILED).decode()):
            raise ConfigError(f"{said} (so does every rank)")
        if time.monotonic() > deadline:
            raise ConfigError(
                f"{world_size - started} of the {world_size} ranks never started within {timeout_s:g} s "
                f"(--distributed-timeout-minutes {timeout_s / 60:g}): held up before their process group (a long "
                "index build, a stuck mount), stopped (their log says why), or their node was never launched"
            )
        time.sleep(pause)
        pause = min(2 * pause, 1.0)
