"""The start-up barrier (megatron_lite/start_up_error.py) under the races a review found: a rank arriving after
another gave up, rank 0's store coming late on a store per attempt, one node with a store per attempt. The
two-launcher runs are in test_fault_tolerance.py."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_lite.config import ConfigError
from megatron_lite.start_up_error import FAILED, job_store, report_error, wait_for_every_rank

from pretrain_jobs import free_port


def _store(port: int = 0):
    return dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)


def test_a_rank_arriving_after_another_gave_up_stops_too():
    """Rank 1 gave up waiting for rank 0 (held up) and left its line; rank 0, arriving later, completed the count
    with its own add and went on to its process group, to wait there a whole timeout more and report a hang."""
    store = _store()
    with pytest.raises(ConfigError, match="1 of the 2 ranks never started within 0.3 s"):
        wait_for_every_rank(store, 2, 0.3)
    store.compare_set(FAILED, "", "rank 1 (node 1) stopped at start-up: 1 of the 2 ranks never started")  # (its line)
    with pytest.raises(ConfigError, match=r"rank 1 \(node 1\) stopped at start-up: 1 of the 2 ranks never started"):
        wait_for_every_rank(store, 2, 60.0)


def test_a_rank_on_time_is_not_told_it_was_late(monkeypatch):
    """A review's: where the rank that gave up left no line, a rank that had waited on time was told "this rank is
    late", quoting its own timeout as the one that ran out; one arriving after is late."""
    import megatron_lite.start_up_error as sue

    monkeypatch.setattr(sue, "GAVE_UP_LINE_S", 0.3)
    store, said = _store(), {}

    def wait(name, timeout_s):
        try:
            wait_for_every_rank(store, 3, timeout_s)
        except ConfigError as e:
            said[name] = str(e)

    waiting = threading.Thread(target=wait, args=("on time", 30.0))
    waiting.start()
    wait("gave up", 0.5)
    waiting.join(30)
    wait("late", 30.0)
    assert said["gave up"].startswith("1 of the 3 ranks never started within 0.5 s"), said
    assert "while this one waited too: some rank never started" in said["on time"], said
    assert "this rank is late" in said["late"] and "late" not in said["on time"], said


def test_ranks_that_all_start_pass_and_none_gives_up_after():
    store = _store()
    done = []
    threads = [threading.Thread(target=lambda: done.append(wait_for_every_rank(store, 3, 30.0))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(done) == 3


@pytest.fixture
def store_per_attempt(monkeypatch):
    """torchrun's environment on node 1 of 2 with a store per attempt (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1):
    rank 0's store at MASTER_PORT, not served yet."""
    port = free_port()
    env = dict(TORCHELASTIC_RUN_ID="x", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK="1",
               LOCAL_RANK="0", GROUP_RANK="1", GROUP_WORLD_SIZE="2")  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    return port


def test_rank_0s_store_is_waited_for_quietly_for_the_start_up_timeout(store_per_attempt, capfd):
    """The store was reached with the backend's timeout (gloo's, 2 x T + 60 s under the flight recorder), torch's
    client printing a C++ stack trace at every retry; now the start-up timeout, polled quietly."""
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"which rank 0 serves, did not answer within 1 s \(nothing listens there\)"):
        job_store(66.0, connect_s=1.0)
    assert time.monotonic() - start < 5
    threading.Timer(2.0, lambda: servers.append(_store(store_per_attempt))).start()
    servers = []
    client = job_store(66.0, connect_s=20.0)
    client.set("k", "v")
    assert servers[0].get("k") == b"v"
    assert "frame #" not in capfd.readouterr().err


def test_a_start_up_error_reaches_rank_0s_store_when_it_comes_late(store_per_attempt, capfd):
    """A rank of another node stopped at start-up tried rank 0's store for 5 s: rank 0 still at its own start-up
    (an index build) then waited the whole timeout, not knowing why. Now a minute, the line said first."""
    servers = []
    threading.Timer(7.0, lambda: servers.append(_store(store_per_attempt))).start()
    report_error(ConfigError("--data-path d: missing d.idx"), False)
    assert capfd.readouterr().err == "error (rank 1): --data-path d: missing d.idx\n"
    assert servers[0].get(FAILED) == b"rank 1 (node 1) stopped at start-up: --data-path d: missing d.idx"


def test_one_node_with_a_store_per_attempt_reaches_for_none(store_per_attempt, monkeypatch, capfd):
    """On one node nobody serves a store before the process group: every rank tried MASTER_PORT for 5 s, a C++
    stack trace each, before exiting on its error."""
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    monkeypatch.setenv("GROUP_RANK", "0")
    start = time.monotonic()
    report_error(ConfigError("--hidden-size 64 is not divisible by --num-attention-heads 3"), False)
    assert time.monotonic() - start < 3
    assert capfd.readouterr().err == "error (rank 1): --hidden-size 64 is not divisible by --num-attention-heads 3\n"


def test_torchruns_own_store_refusing_connections_is_taken_as_gone_in_seconds(store_per_attempt, monkeypatch):
    """torchrun's own store (TORCHELASTIC_USE_AGENT_STORE) is up before any worker starts, on every node: refused,
    its node stopped. The other node's ranks waited a minute to say so (now 5 s); a store answering late is still
    reached."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    start = time.monotonic()
    with pytest.raises(
        ConfigError, match=r"which the first node's torchrun serves, refused connections for 5 s: that node stopped"
    ):
        job_store(300.0, connect_s=300.0)
    assert time.monotonic() - start < 15
    servers = []
    threading.Timer(2.0, lambda: servers.append(_store(store_per_attempt))).start()
    client = job_store(300.0, connect_s=300.0)  # (this attempt's keys, under a prefix: read back through it)
    client.set("k", "v")
    assert client.get("k") == b"v" and servers
