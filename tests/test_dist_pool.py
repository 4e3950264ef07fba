"""The test suite's own worker pool (tests/dist_pool.py)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent

KILLED_PARENT = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from dist_pool import WorkerPool

pool = WorkerPool(2)
assert pool.run(os.getpid) is not None
open(sys.argv[2], "w").write(" ".join(str(p.pid) for p in pool._procs))
os.kill(os.getpid(), signal.SIGKILL)  # as a CI's timeout or a killed pytest: no teardown runs
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # (a zombie counts as gone: it is reaped by init)
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_workers_leave_when_their_pytest_is_killed(tmp_path):
    """A pytest killed by a signal runs no teardown, and daemon processes outlive such a parent: its ranks stayed
    for hours, idle, their gloo threads taking CPU from every later run on the machine. An idle worker whose
    parent is gone now exits."""
    # (output to files: the workers inherit the parent's pipes, which a run capturing them waits to see closed)
    with open(tmp_path / "log", "w") as log:
        env = {**os.environ, "TMPDIR": str(tmp_path)}  # (where the killed parent leaves its pool's rendezvous file)
        done = subprocess.run([sys.executable, "-c", KILLED_PARENT, str(HERE), str(tmp_path / "pids")], stdout=log,
                              stderr=subprocess.STDOUT, timeout=120, env=env)  # fmt: skip
    assert done.returncode == -9, (tmp_path / "log").read_text()[-2000:]
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if _alive(p)]
    for p in left:  # (the old behaviour: clean up so the suite is not left with them)
        os.kill(p, 9)
    assert not left, f"workers {left} outlived their killed parent"
