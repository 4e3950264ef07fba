"""tests/head_start.py, the background's head starts: a registered call gives the test the same value whether
the background's subprocess made it or the test's own process did, a failure says why in either place, and the
tests that own a head start run after all the others."""

from __future__ import annotations

import errno
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import head_start
import pytest
from test_dist_pool import _alive

# (at collection, before the background starts)
FOREGROUND = head_start._autogroup("self")


def sample(n: int) -> dict:
    return {"n": n, "pair": (1, 2), "pid": os.getpid(), "policy": os.sched_getscheduler(0)}


def broken() -> None:
    raise ValueError("no luck here")


def test_a_call_gives_the_same_value_from_the_background_and_from_the_test():
    head_start.register_call("test_head_start:background", "test_head_start", "sample", 3)
    head_start.register_call("test_head_start:here", "test_head_start", "sample", 3)
    head_start._execute(head_start._take("test_head_start:background"), background=True)  # (as the background runs it)
    background = head_start.call_result("test_head_start:background")
    here = head_start.call_result("test_head_start:here")
    assert background["pid"] != os.getpid() and here["pid"] == os.getpid()
    # the background's runs only on an idle core: a rank of a multi-rank test is never kept waiting behind it
    if shutil.which("chrt"):
        assert background["policy"] == os.SCHED_IDLE and here["policy"] != os.SCHED_IDLE
    # (through JSON both ways: the tuple is a list in each)
    same = {"pid": 0, "policy": 0}
    assert {**background, **same} == {**here, **same} == {"n": 3, "pair": [1, 2], **same}
    assert head_start.call_result("test_head_start:here") == here  # asked again: the value made


def settled_nice() -> str:
    """The nice of this process's autogroup once it is 19, or after 3 s."""
    for _ in range(30):
        nice = pathlib.Path("/proc/self/autogroup").read_text().split()[-1]
        if nice == "19":
            break
        time.sleep(0.1)
    return nice


def sessions() -> list[str]:
    """The settled nice of this process's autogroup and of two children's: one that starts a session of its own
    (as torchrun starts each worker) and one that stays in this session."""
    mine = settled_nice()  # (before the children: a check that starts none is given nice 19 too)
    kids = [
        subprocess.Popen(
            [sys.executable, "-c", "import test_head_start as t; print(t.settled_nice())"],
            start_new_session=own,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for own in (True, False)
    ]
    return [mine, *(kid.communicate()[0].strip() for kid in kids)]


def autogroup_nice_refused() -> str | None:
    """Why this machine does not let this process set a new session's autogroup nice; None where it does."""
    if FOREGROUND is None:
        return "this kernel has no autogroups"
    probe = subprocess.Popen(["sleep", "60"], start_new_session=True)
    path = pathlib.Path(f"/proc/{probe.pid}/autogroup")
    try:
        group = head_start._autogroup(probe.pid)
        if group is None or group[0] == FOREGROUND[0]:
            return f"a new session gets no autogroup of its own here ({path.name}: {group})"
        for _ in range(20):  # (unprivileged writes are limited to one per 100 ms, machine-wide: EAGAIN)
            try:
                path.write_text("19")
            except OSError as e:
                why = f"this machine refuses an autogroup nice: writing 19 to {path}: {e}"
                if e.errno != errno.EAGAIN:
                    return why
                time.sleep(0.1)
                continue
            nice = head_start._autogroup(probe.pid)
            return None if nice is not None and nice[1] == "19" else f"19 written to {path}, {nice} read back"
        return why
    finally:
        probe.kill()
        probe.wait()


@pytest.mark.skipif(bool(REFUSED := autogroup_nice_refused()), reason=str(REFUSED))
def test_the_background_runs_in_autogroups_at_nice_19_and_the_foreground_s_is_left_alone():
    """The idle policy ranks processes only within an autogroup (one per session), and the cores are first shared
    among autogroups at equal weight: the background's sessions, its own and those its processes start (a
    torchrun worker's), run at autogroup nice 19, so a foreground torchrun worker in a session of its own has
    the cores it wants. The foreground's own group is left as it was."""
    head_start.register_call("test_head_start:sessions", "test_head_start", "sessions")
    head_start._execute(head_start._take("test_head_start:sessions"), background=True)
    assert head_start.call_result("test_head_start:sessions") == ["19", "19", "19"]
    assert head_start._autogroup("self") == FOREGROUND


def test_checks_are_given_sessions_of_their_own_where_this_machine_lets_them_be_niced():
    assert head_start._sessions_can_be_niced() == (REFUSED is None), REFUSED


def placement() -> dict:
    return {"pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0), "group": head_start._autogroup("self")}


def test_where_sessions_cannot_be_niced_a_check_stays_in_pytests(monkeypatch):
    """There, a session of its own would be an autogroup at full weight, where the idle policy ranks nothing below
    the check: it stays in pytest's session and autogroup, in a process group of its own (to stop it whole)."""
    monkeypatch.setattr(head_start, "_sessions_can_be_niced", lambda: False)
    head_start.register_call("test_head_start:placement", "test_head_start", "placement")
    head_start._execute(head_start._take("test_head_start:placement"), background=True)
    check = head_start.call_result("test_head_start:placement")
    assert check["sid"] == os.getsid(0) and check["pgid"] == check["pid"] != os.getpgid(0)
    assert check["group"] == (None if FOREGROUND is None else list(FOREGROUND))


def tree(pid_file: str) -> None:
    """A check with a child: the child's pid written to `pid_file`, then both sleep."""
    child = subprocess.Popen(["sleep", "600"])
    pathlib.Path(pid_file + ".tmp").write_text(str(child.pid))
    os.replace(pid_file + ".tmp", pid_file)
    time.sleep(600)


@pytest.mark.parametrize("sessions", [True, False], ids=["own-session", "pytests-session"])
def test_a_check_stopped_stops_its_children_too(tmp_path, monkeypatch, sessions):
    """A check killed (past its test's wait, or at the session's end) takes its children with it: a demo's
    torchrun and its workers do not run on into the next tests."""
    monkeypatch.setattr(head_start, "_sessions_can_be_niced", lambda: sessions)
    pid_file = tmp_path / "child"
    head_start.register_call(f"test_head_start:tree-{sessions}", "test_head_start", "tree", str(pid_file))
    job = head_start._take(f"test_head_start:tree-{sessions}")
    threading.Thread(target=head_start._execute, args=(job, True), daemon=True).start()
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    try:
        head_start._kill(job.proc)
        assert job.done.wait(10) and job.result.returncode != 0
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the check's child outlived it"
    finally:
        if _alive(child):
            os.kill(child, 9)


def test_a_failed_call_says_why_wherever_it_ran():
    head_start.register_call("test_head_start:broken_background", "test_head_start", "broken")
    head_start.register_call("test_head_start:broken_here", "test_head_start", "broken")
    head_start._execute(head_start._take("test_head_start:broken_background"), background=True)
    with pytest.raises(AssertionError, match="failed in the background:(.|\n)*ValueError: no luck here"):
        head_start.call_result("test_head_start:broken_background")
    for _ in range(2):  # (a second test asking for it is told too)
        with pytest.raises(ValueError, match="no luck here"):
            head_start.call_result("test_head_start:broken_here")
    with pytest.raises(KeyError, match="no call registered as 'nothing'"):
        head_start.call_result("nothing")


def test_the_tests_that_own_a_head_start_run_last(request):
    owners = [item.get_closest_marker("head_start") is not None for item in request.session.items]
    assert owners == sorted(owners), "a test without a head start runs after one with"
