"""How a start-up error is said under torchrun: once per node where every rank found it, and by the rank that
found it alone otherwise; and how the other nodes hear it: before the process group every rank waits in the job's
store for every other to start, and stops at the first start-up error one left there (an exploratory run: a node
whose flags failed validation exited, the others waited in their first collective for --distributed-timeout-
minutes, 30 in the shipped scripts, and then reported its ranks as silent)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import timedelta

from megatron_lite.config import ConfigError

STARTED = "megatron_lite/started"  # how many ranks of this attempt reached their process group
FAILED = "megatron_lite/start_up_error/any"  # the first start-up error any rank left
GAVE_UP = -(1 << 40)  # STARTED once a rank gave up waiting (any later add leaves it negative)
GAVE_UP_LINE_S = 10.0  # how long a rank waits for the line of the rank that gave up
LINGER_S = 10.0  # how long rank 0, stopped at start-up, serves its store for the other nodes to read why
AGENT_STORE_S = 60.0  # how long torchrun's own store may take to answer a worker it started
REFUSED_S = 5.0  # how long torchrun's own store may refuse connections before it is taken as gone with its node


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
    # on: stopped before it, it serves one a while for the other nodes to read why. On one node with a store per
    # attempt no store is served yet (reaching for one was 5 s and a C++ stack trace a rank).
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    own = not agent and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1
    host, first_local = rank == "0" and own, os.environ.get("LOCAL_RANK", "0") == "0"
    if first_local:  # (said before the store is reached: rank 0's may take a while to come)
        print(line, file=sys.stderr, flush=True)
    store = _launcher_store(host, wait_s=5.0 if agent else AGENT_STORE_S) if agent or own else None
    key = f"megatron_lite/start_up_error/{os.environ.get('GROUP_RANK', '0')}"
    if store is not None:  # (for the other nodes' ranks, waiting for this one: the first error wins)
        where = f"rank {rank} (node {os.environ.get('GROUP_RANK', '0')})"
        _try(lambda: store.compare_set(FAILED, "", f"{where} stopped at start-up: {error}"))
        if first_local:
            _try(lambda: store.set(key, str(error)))
        if host:
            time.sleep(LINGER_S)
    if first_local:
        return
    if store is None:  # a moment for the first local rank to say it: torchrun stops the others at the first exit
        time.sleep(1.0)
        return
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


def _launcher_store(host: bool = False, wait_s: float = 5.0):
    """This attempt's store under torchrun, or None outside torchrun or where it cannot be reached within `wait_s`:
    torchrun's own is up before any worker (gone, it went with its node), rank 0's (a store per attempt) is waited
    for a minute, rank 0 being maybe still at its own start-up (an index build; 5 s: the line was lost)."""
    try:
        return job_store(5.0, host, connect_s=wait_s)
    except Exception:
        return None


def job_store(timeout_s: float, host: bool = False, connect_s: float | None = None):
    """This attempt's store under torchrun (None outside it): the launcher's shared one (this attempt's keys,
    parallel_context._attempt_store), or, where each attempt has a store of its own (TORCH_DISABLE_SHARE_RDZV_TCP_
    STORE=1), rank 0's at MASTER_ADDR:MASTER_PORT, which rank 0 serves (`host`) from before the process group.
    `connect_s`: how long the store may take to answer (the start-up timeout), `timeout_s` each request's."""
    import torch.distributed as dist

    from megatron_lite.parallel_context import _attempt_store

    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env or "MASTER_ADDR" not in env:
        return _attempt_store(timeout_s)
    addr, port, world = env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env.get("WORLD_SIZE", "1"))
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent serves it before starting any worker: one that does not answer soon has stopped (the
        # first node's, its worker failed at start-up: a client waited the whole timeout to connect, unsaid)
        agent_s = min(timeout_s if connect_s is None else connect_s, AGENT_STORE_S)
        # Refused for a few seconds, it is gone: it was up before any worker started (the other node's ranks
        # waited a minute to say so); a timeout (packets dropped) may be a slow network, waited for longer.
        why = "nothing listens there"
        try:  # (polled quietly first: torch's client tried twice, 60 s each and a pause, a C++ trace at each)
            refused = _refused_for(addr, port, agent_s, REFUSED_S)
            if refused is None:
                return _attempt_store(timeout_s, connect_s=agent_s)
        except Exception as e:
            refused, why = False, type(e).__name__
        store = f"the job's store at {addr}:{port}, which the first node's torchrun serves,"
        if refused:  # (said as what happened: timeouts before the refusals may have made the wait longer)
            raise ConfigError(f"{store} refused connections for {REFUSED_S:g} s: that node stopped (its log says why)")
        raise ConfigError(f"{store} did not answer within {agent_s:g} s ({why}): that node stopped (its log says why)")
    wait_s = timeout_s if connect_s is None else connect_s
    # (the port is polled here, quietly: torch's client, retrying, printed a C++ stack trace at every try)
    if host or _port_opens(addr, port, wait_s):
        try:
            return dist.TCPStore(addr, port, world, is_master=host, timeout=timedelta(seconds=timeout_s),
                                 wait_for_workers=False, multi_tenant=True)  # fmt: skip
        except Exception as e:
            if host:
                raise
            why = type(e).__name__
    else:
        why = "nothing listens there"
    raise ConfigError(
        f"the job's store at {addr}:{port}, which rank 0 serves, did not answer within {wait_s:g} s ({why}): "
        "rank 0 is held up before its process group, or its node stopped before it started (its log says why), or "
        "cannot be reached"
    )


def _port_opens(addr: str, port: int, timeout_s: float) -> bool:
    """Whether something listens at addr:port within `timeout_s` (a connection made and closed at once)."""
    return _refused_for(addr, port, timeout_s) is None


def _refused_for(addr: str, port: int, timeout_s: float, refused_s: float | None = None) -> bool | None:
    """Polls addr:port for up to `timeout_s`: None once something listens there (a connection made and closed at
    once), True when every try for `refused_s` was refused, False when the time ran out otherwise."""
    start = time.monotonic()
    deadline, refused_since = start + timeout_s, None
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(min(2.0, deadline - time.monotonic()), 0.1)).close()
            return None
        except ConnectionRefusedError:
            refused_since = time.monotonic() if refused_since is None else refused_since
        except OSError:  # (a timeout, unreachable: the refusals so far are no longer in a row)
            refused_since = None
        now = time.monotonic()
        if refused_s is not None and refused_since is not None and now - refused_since >= refused_s:
            return True
        if now >= deadline:
            return False
        time.sleep(0.2)


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
    """A rank that gives up swaps the count for GAVE_UP, atomically and only while it is short: a rank arriving
    later (its add leaves it negative) stops too, where it passed the barrier, the count complete, and waited in
    its process group for a whole timeout more; and no rank gives up once every one has started."""
    started = store.add(STARTED, 1)
    deadline, pause, late = time.monotonic() + timeout_s, 0.02, started < 0
    while True:
        if started < 0:
            raise ConfigError(_gave_up(store, late))
        if store.check([FAILED]) and (said := store.get(FAILED).decode()):
            raise ConfigError(f"{said} (so does every rank)")
        if started >= world_size:
            return
        if (
            time.monotonic() > deadline
            and store.compare_set(STARTED, str(started), str(GAVE_UP)) == str(GAVE_UP).encode()
        ):
            raise ConfigError(
                f"{world_size - started} of the {world_size} ranks never started within {timeout_s:g} s "
                f"(--distributed-timeout-minutes {timeout_s / 60:g}): held up before their process group (a long "
                "index build, a stuck mount), stopped (their log says why), or their node was never launched"
            )
        time.sleep(pause)
        pause = min(2 * pause, 1.0)
        started = store.add(STARTED, 0)


def _gave_up(store, late: bool) -> str:
    """The line of the rank that gave up waiting for the others (it leaves it as it stops), or a line of ours:
    `late`, this rank arrived after it gave up; else this one was waiting too (a review's: an on-time rank was
    told it was late, quoting its own timeout as the one that ran out)."""
    deadline = time.monotonic() + GAVE_UP_LINE_S
    while time.monotonic() < deadline:
        if store.check([FAILED]) and (said := store.get(FAILED).decode()):
            return f"{said} (so does every rank)"
        time.sleep(0.2)
    if late:
        return (
            "another rank stopped waiting for every rank to start (at its --distributed-timeout-minutes) before "
            "this one started: this rank is late (its start-up was held up), or others never started"
        )
    return (
        "another rank stopped waiting for every rank to start (at its --distributed-timeout-minutes) while this "
        "one waited too: some rank never started (held up before its process group, or stopped: its log says why)"
    )
