"""Hang reports when the job's store is the casualty, and the timeouts and launches that reports depend on
(exploratory runs across two torchrun "nodes"): the store's host frozen or gone, this rank's own state read back
after its collective was aborted, subgroups without --distributed-timeout-minutes, multi-node restarts on
torchrun's shared store, and the Slurm script submitted from another directory."""

from __future__ import annotations

import os
import pathlib
import subprocess
import threading
import time

import pytest
import torch

from megatron_lite.config import ConfigError
from megatron_lite.resilience import flight_recorder as fr

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENTRY = fr.Entry("0,1", 351, "all_reduce", [[1]], "optimizer.py:90 (squared_norm)", 0.0)


def _recorder(store, current=ENTRY) -> fr.FlightRecorder:
    rec = fr.FlightRecorder.__new__(fr.FlightRecorder)
    rec.rank, rec.world, rec.timeout_s, rec.history, rec.store, rec.where = 0, 2, 15.0, [], store, None
    rec.state, rec._lock = fr._State(), threading.Lock()
    rec.state.counts = {fr._counter(ENTRY.op, ENTRY.group): ENTRY.seq}
    rec._current = None if current is None else (current, time.time() - 16.0, False)
    return rec


class _Store:
    """A store whose reads block (its host frozen: SIGSTOP) or fail (its host gone: the agent exited)."""

    def __init__(self, reads: str, published: dict | None = None) -> None:
        self.reads, self.published = reads, published or {}

    def set(self, key, value):
        if self.reads == "fail":
            raise RuntimeError("sendBytes failed: Broken pipe")

    def check(self, keys):
        if self.reads == "block":
            time.sleep(60)
        if self.reads == "fail":
            raise RuntimeError("sendBytes failed: Broken pipe")
        return keys[0] in self.published

    def get(self, key):
        return self.published[key]


def test_a_gone_store_is_tried_less_and_less_often():
    """With the first node's agent gone, the recorder's publishing failed every second, each a torch C++ stack
    trace in every rank's log for the rest of the run (an exploratory run: 40 in 10 s)."""
    store = _Store("fail")
    tries = []
    store.set = lambda key, value: (tries.append(key), _Store("fail").check([key]))
    rec = _recorder(store)
    end = time.monotonic() + 3.5
    while time.monotonic() < end:  # (the watchdog publishes every second; here as often as it can)
        rec._publish()
        time.sleep(0.01)
    assert 2 <= len(tries) <= 3, len(tries)  # (at 0, 1 and 3 s)


@pytest.mark.parametrize("reads", ["block", "fail"])
def test_a_frozen_or_gone_store_is_reported_as_such_in_bounded_time(monkeypatch, reads):
    """With the store's host frozen the watchdog's read blocked it, and the job, for good (6 minutes, then killed);
    with its host gone, every rank, the reporting one included, was 'no state published'."""
    monkeypatch.setattr(fr, "STORE_WAIT_S", 0.3)
    monkeypatch.setattr(fr, "LIVENESS_S", 0.0)
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    start = time.time()
    report = _recorder(_Store(reads)).build_report(ENTRY, 16.0)
    assert time.time() - start < 5, "the watchdog waited on the store"
    lines = report.splitlines()
    assert lines[0].startswith("hang: rank 0 has waited 16 s (--distributed-timeout-minutes 0.25) in collective #351")
    assert "the job's store at node0:29500 did not answer within 0.3 s or failed: its host is frozen, lost" in lines[1]
    assert "no state published" not in report, report


def test_the_reporting_ranks_own_line_is_its_state_when_the_hang_was_found(monkeypatch):
    """A peer's exit aborted the reporting rank's collective during the report's liveness wait: its line, read back
    from the store, said 'computing (in no collective)' under a first line saying it waits in #116."""
    monkeypatch.setattr(fr, "LIVENESS_S", 0.0)
    import json

    now = time.time()
    computing = {"rank": 0, "time": now, "counts": {}, "last": {}, "current": None, "where": None}
    peer = {"rank": 1, "time": now - 30, "counts": {fr._counter(ENTRY.op, ENTRY.group): 350}, "last": {},
            "current": None, "where": None}  # fmt: skip
    published = {"megatron_lite/flight_recorder/0": json.dumps(computing),
                 "megatron_lite/flight_recorder/1": json.dumps(peer)}  # fmt: skip
    rec = _recorder(_Store("ok", published))
    rec._publish = lambda: None  # (what the store holds for rank 0 is the later, aborted state)
    report = rec.build_report(ENTRY, 16.0)
    assert "rank 0: computing" not in report, report
    assert "summary: ranks [0] wait in all_reduce #351" in report, report


def test_restarts_across_nodes_on_torchruns_shared_store_are_refused(monkeypatch):
    from megatron_lite.parallel_context import check_restarts_across_nodes

    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match="torchrun --max-restarts 1 across 2 nodes .*TORCH_DISABLE_SHARE_RDZV_TCP"):
        check_restarts_across_nodes()
    for k, v in (("TORCHELASTIC_USE_AGENT_STORE", "False"), ("GROUP_WORLD_SIZE", "1"),
                 ("TORCHELASTIC_MAX_RESTARTS", "0")):  # fmt: skip
        monkeypatch.setenv(k, v)  # (a store per attempt; one node; no restarts: each is fine)
        check_restarts_across_nodes()
        monkeypatch.setenv(k, env[k])


def _group_timeouts() -> list[float]:
    from megatron_lite.config import ParallelConfig
    from megatron_lite.parallel_context import initialize

    from models import llama_config

    parallel = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    ctx = initialize(llama_config(num_layers=2), parallel, timeout_s=7.0)
    import torch.distributed as dist

    # (a group of every rank is the default one, whose timeout is the launcher's: the pool's here)
    handles = {g.handle for g in ctx.groups.values() if g.handle is not None and g.handle is not dist.group.WORLD}
    return sorted(h._get_backend(torch.device("cpu")).options._timeout.total_seconds() for h in handles)


def test_every_group_takes_the_jobs_timeout(dist):
    """Megatron passes --distributed-timeout-minutes to every group it creates; ours gave only the default group
    it, so a hang in a TP, DP or PP group waited torch's 30 minutes on gloo, whatever the flag said."""
    for timeouts in dist(4, _group_timeouts):
        assert timeouts and set(timeouts) == {7.0}, timeouts


def test_the_slurm_script_submitted_elsewhere_says_where_to_submit_from(tmp_path):
    """Submitted from outside the repository, each task failed with "pretrain/llama3_70b_multinode.sh: No such
    file or directory"; it now says what to do before starting anything."""
    env = {**os.environ, "SLURM_SUBMIT_DIR": str(tmp_path), "DRY_RUN": "1"}
    out = subprocess.run(["bash", str(ROOT / "pretrain" / "llama3_70b.sbatch")], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().startswith("error: ") and "set REPO=" in out.stderr, out.stderr


def test_the_multinode_script_gives_each_restart_a_store_of_its_own(tmp_path):
    """The shipped multi-node launch sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which restarts across nodes need (a
    torchrun stand-in on PATH records what it was given)."""
    fake = tmp_path / "torchrun"
    fake.write_text('#!/bin/sh\necho "share=$TORCH_DISABLE_SHARE_RDZV_TCP_STORE $*" > "$RECORD"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "RECORD": str(tmp_path / "rec"), "NNODES": "2",
           "RDZV_HOST": "node0"}  # fmt: skip
    out = subprocess.run(["bash", str(ROOT / "pretrain" / "llama3_70b_multinode.sh")], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    record = (tmp_path / "rec").read_text()
    assert record.startswith("share=1 --nnodes 2 ") and "--rdzv-backend c10d" in record, record
