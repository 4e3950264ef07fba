"""One-process subprocess checks given a head start: run in the background, one at a time and at low priority,
from the end of collection, so a test that owns one finds it done (or running) when its turn comes.

The suite on a 2-core machine keeps both cores busy only while a multi-rank test runs; a one-process stretch
(the planner, the Triton interpreter, a reference run) leaves the other core idle, about a third of the wall time.
A long check that is a subprocess of its own (a shipped script's dry run, a tool run to its JSON, compiling every
kernel for Hopper) runs there instead, under the idle scheduling policy (`chrt --idle 0`), so it takes the idle
core and nothing of a busy one. (At nice 10 it still took its share of a busy core, and a rank of a multi-rank
test woken by a collective could wait behind it: with more work in the background, the rest of the suite ran
minutes slower.) The policy ranks processes only within one autogroup, though: the scheduler first shares the
cores among autogroups (one per session, /proc/PID/autogroup), at equal weight. A foreground torchrun job's
workers are each in a session of their own, so the background's idle processes, in the session of pytest,
took a third of the cores from them: test_fault_tolerance took 240 s in the suite instead of 100. So each check
runs in a session of its own, and that session, like every other one that starts among its processes (a
torchrun worker's), is given autogroup nice 19 as it appears. Where the machine refuses that nice (a sandbox
may: the project's CI did), a session of its own would be an autogroup at full weight, where the idle policy
ranks nothing below the check: the checks then stay in pytest's session, as before.
The test still runs the real command and asserts on its output; only the moment it starts changes. A check whose
test comes before the background reached it is taken off the queue and run by the test itself, at normal
priority. The tests that own a check run after all the others (tests/conftest.py), so the background has the
whole suite's idle time; a check not finished when its test comes then has both cores.

A test module registers its checks when it is imported (`register`) and marks the tests that own them
(`@pytest.mark.head_start(key)`); tests/conftest.py starts the checks of the tests collected, in their order.

A one-process computation inside a test (a measured step through the Triton interpreter, a plan) can be given the
same head start: `register_call` names a function of the test module that returns JSON-able values, and
`call_result` hands the test that value, from the background's subprocess (`python tests/head_start.py MODULE
FUNCTION ARGS OUT`) or, where the background has not reached it, from the call made right there in the test.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import importlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable


@dataclasses.dataclass
class Job:
    argv: Callable[[str], list[str]]  # the command, given a fresh directory of its own for its outputs
    env: dict[str, str] | None
    cwd: str | None
    timeout: float
    out_dir: str = ""
    proc: subprocess.Popen | None = None
    result: subprocess.CompletedProcess | None = None
    error: BaseException | None = None
    value: object = None  # a registered call's value, where it was made in the test's own process
    started: bool = False
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
_JOBS: dict[str, Job] = {}
_CALLS: dict[str, tuple[str, str, tuple]] = {}  # key -> (test module, function, arguments)
_QUEUE: list[str] = []
_LOCK = threading.Lock()
_RUNNER: threading.Thread | None = None
_STOPPED = threading.Event()


def register(
    key: str, argv: Callable[[str], list[str]], env: dict[str, str] | None = None, cwd: str | None = None,
    timeout: float = 600,
) -> None:  # fmt: skip
    """A check `key` runs `argv(out_dir)` with `env` (default: this process's environment) in `cwd`."""
    _JOBS.setdefault(key, Job(argv, env, cwd, timeout))


def start(keys: list[str]) -> None:
    """Queue these registered checks, in this order, and start the background runner."""
    global _RUNNER
    with _LOCK:
        _QUEUE.extend(k for k in keys if k in _JOBS and k not in _QUEUE and not _JOBS[k].started)
        if _QUEUE and (_RUNNER is None or not _RUNNER.is_alive()):
            _RUNNER = threading.Thread(target=_run_queue, name="head-start", daemon=True)
            _RUNNER.start()


def _take(key: str | None) -> Job | None:
    """The job `key` (the queue's next if None), marked started and off the queue; None if it has started (or,
    for the queue's next, if the queue is empty or stopped). A job never queued (a test run without the conftest
    hook) is taken too."""
    with _LOCK:
        if key is None:
            if not _QUEUE or _STOPPED.is_set():
                return None
            key = _QUEUE[0]
        job = _JOBS[key]
        if job.started:
            return None
        if key in _QUEUE:
            _QUEUE.remove(key)
        job.started = True
        return job


def _idle_priority() -> list[str]:
    """The command prefix that runs a process (and its children) only on an otherwise idle core."""
    # (commands, not a preexec_fn: a fork of this threaded process may deadlock before its exec)
    if shutil.which("chrt"):
        return ["chrt", "--idle", "0"]
    return ["nice", "-n", "19"] if shutil.which("nice") else []


def _autogroup(pid: int | str) -> tuple[str, str] | None:
    """(the autogroup's name, its nice) of process `pid`; None where there is none (no such process, or a
    kernel without autogroups)."""
    try:
        name, _, nice = pathlib.Path(f"/proc/{pid}/autogroup").read_text().split()
    except (OSError, ValueError):
        return None
    return name, nice


@functools.cache  # (decided once, by the first check)
def _sessions_can_be_niced() -> bool:
    """Whether a session started here gets an autogroup of its own whose nice this process may set."""
    own = _autogroup("self")
    if own is None:
        return False
    probe = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        for _ in range(20):
            group = _autogroup(probe.pid)
            if group is None or group[0] == own[0]:
                return False
            try:
                pathlib.Path(f"/proc/{probe.pid}/autogroup").write_text("19")
            except OSError as e:  # (unprivileged, a write within 100 ms of another, machine-wide, is EAGAIN)
                if e.errno != errno.EAGAIN:
                    return False
                time.sleep(0.1)
                continue
            return _autogroup(probe.pid) == (group[0], "19")
        return False
    finally:
        probe.kill()
        probe.wait()


def _process_group(own_session: bool) -> dict:
    """Popen's arguments that make a check a process group of its own (to stop it whole: _kill): in a session of
    its own, or in pytest's."""
    if own_session:
        return {"start_new_session": True}
    # (Python 3.10 has no process_group: setpgid in the child, a call that takes no lock)
    return {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rfind(")") + 2 :].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        found.extend(kids := children.get(todo.pop(), []))
        todo.extend(kids)
    return found


def _keep_sessions_idle(job: Job) -> None:
    """Until `job` is done: give its session, and each new one among its processes (a torchrun worker's),
    autogroup nice 19, so they compete with the foreground's only for an idle core, as the idle policy meant.
    (Never the foreground's own group: that would slow the whole suite.)"""
    own = _autogroup("self")
    while own is not None:
        for pid in [job.proc.pid, *_descendants(job.proc.pid)]:
            group = _autogroup(pid)
            if group is not None and group[0] != own[0] and group[1] != "19":
                try:
                    pathlib.Path(f"/proc/{pid}/autogroup").write_text("19")
                except OSError:  # (it exited, or the write came too soon after another: on the next scan)
                    pass
        if job.done.wait(0.5):
            return


def _execute(job: Job, background: bool) -> None:
    """Run `job` to its end: in the background at idle priority with no time limit (it may wait long for an idle
    core; the test that waits for it sets the limit), else at normal priority within the job's timeout."""
    job.out_dir = tempfile.mkdtemp(prefix="head_start_")
    try:
        niced = _sessions_can_be_niced()  # (else a session of its own would be an autogroup at full weight)
        job.proc = subprocess.Popen(
            [*(_idle_priority() if background else []), *job.argv(job.out_dir)],
            env=job.env,
            cwd=job.cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **_process_group(own_session=niced),
        )
        if background and niced:
            threading.Thread(target=_keep_sessions_idle, args=(job,), name="head-start-idle", daemon=True).start()
        try:
            out, err = job.proc.communicate(timeout=None if background else job.timeout)
        except subprocess.TimeoutExpired:
            _kill(job.proc)
            out, err = job.proc.communicate()
            err += f"\n(head_start: killed after {job.timeout} s)"
        job.result = subprocess.CompletedProcess(job.proc.args, job.proc.returncode, out, err)
    except BaseException as e:  # noqa: B036 - handed to the test that waits on it
        job.error = e
    finally:
        job.done.set()


def _kill(proc: subprocess.Popen) -> None:
    """Stop a check's processes, all of them: SIGTERM to its process group (it leads one), so a torchrun agent
    among them stops its workers (each in a session of its own); SIGKILL to what is left 5 s on."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except OSError:  # (no process of the group is left)
            return
        deadline = time.monotonic() + 5
        while sig == signal.SIGTERM and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)


def _run_queue() -> None:
    while (job := _take(None)) is not None:
        _execute(job, background=True)


def result(key: str) -> tuple[subprocess.CompletedProcess, str]:
    """(the finished process, its output directory) of check `key`: run here now if the background has not
    started it, else waited for."""
    if key not in _JOBS:
        raise KeyError(f"head_start: no check registered as {key!r}")
    job = _take(key)
    if job is not None:
        _execute(job, background=False)
    job = _JOBS[key]
    if not job.done.wait(job.timeout):
        if job.proc is not None:
            _kill(job.proc)  # (the background's thread then finishes the job, its output kept for the report)
            job.done.wait(10)
        raise TimeoutError(f"head_start: {key} did not finish within {job.timeout} s of its test's wait")
    if job.error is not None:
        raise job.error
    return job.result, job.out_dir


def register_tool(key: str, script: str, flags: str | list[str], json_name: str | None = "r.json") -> None:
    """A one-process run of tools/`script` with `flags` (a string split at spaces, or a list: paths) as check `key`,
    writing `--json OUT/json_name` (with json_name None, `--out-dir OUT`)."""
    args = flags.split() if isinstance(flags, str) else list(flags)

    def argv(out: str) -> list[str]:
        where = ["--json", str(pathlib.Path(out) / json_name)] if json_name else ["--out-dir", out]
        return [sys.executable, str(ROOT / "tools" / script), *args, *where]

    register(key, argv)


def tool_result(key: str) -> tuple[str, pathlib.Path]:
    """(stdout, output directory) of a tool run registered by `register_tool`, which must have exited 0."""
    done, out_dir = result(key)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, pathlib.Path(out_dir)


def register_call(key: str, module: str, function: str, *args) -> None:
    """Check `key` is `function(*args)` of test module `module`, whose value (and arguments) JSON can carry."""
    _CALLS.setdefault(key, (module, function, args))

    def argv(out: str) -> list[str]:
        return [sys.executable, __file__, module, function, json.dumps(args), str(pathlib.Path(out) / "value.json")]

    register(key, argv, cwd=str(TESTS))


def _call(module: str, function: str, args: tuple):
    # (through JSON here too: the test sees the same types whichever process made the value)
    return json.loads(json.dumps(getattr(importlib.import_module(module), function)(*args)))


def call_result(key: str):
    """The value of the call registered as `key`: the background's, waited for, or made here and now if the
    background has not started it (no subprocess then: its start-up would cost more than the call)."""
    if key not in _CALLS:
        raise KeyError(f"head_start: no call registered as {key!r}")
    job = _take(key)
    if job is not None:
        try:
            job.value = _call(*_CALLS[key])
        except BaseException as e:  # noqa: B036 - raised again below, and to a later test asking for it
            job.error = e
        finally:
            job.done.set()
    done, out_dir = result(key)
    if done is None:  # made here
        return _JOBS[key].value
    assert done.returncode == 0, f"head_start: {key} failed in the background:\n{done.stderr[-3000:]}"
    return json.loads((pathlib.Path(out_dir) / "value.json").read_text())


def stop() -> None:
    """At the session's end: nothing more is started, a check still running is killed, and the checks' output
    directories are removed."""
    _STOPPED.set()
    for job in _JOBS.values():
        if job.proc is not None and job.proc.poll() is None:
            _kill(job.proc)
            job.done.wait(10)
        if job.out_dir:
            shutil.rmtree(job.out_dir, ignore_errors=True)


if __name__ == "__main__":  # a registered call, in the background: MODULE FUNCTION ARGS(JSON) OUT
    sys.path.insert(0, str(TESTS))
    _module, _function, _args, _out = sys.argv[1:]
    _value = _call(_module, _function, tuple(json.loads(_args)))
    pathlib.Path(_out).write_text(json.dumps(_value))
