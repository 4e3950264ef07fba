"""Whole pretraining jobs on the ranks of a persistent pool: for the tests whose subject is what a job
computes under a layout (its flags, data, loop and logging), not how its processes are launched.

A torchrun job on a 2-core machine spends most of its time starting and stopping processes: every rank
imports torch, then torch._dynamo (torch.optim's constructor pulls it in), and tears them down at exit,
~15 s of a 4-rank job's ~20 s. Here each rank of a bare WorkerPool (tests/dist_pool.py) calls
pretrain_gpt.py's `main(argv)` with the environment torchrun gives its workers (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the job validates its flags, joins a gloo world
of its own (env://), trains, and leaves it, as under torchrun. The launcher itself (rendezvous, restarts in
fresh processes that resume exactly, signals, exit codes) stays tested under torchrun: tests/test_fault_tolerance.py,
and the demos and dry runs in tests/test_pretrain_torchrun.py.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

from dist_pool import RankError, WorkerPool


def free_port() -> int:
    """A TCP port nobody listens on now (for a job's MASTER_PORT or a rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main_on_rank(argv: list[str], master_port: int, log_dir: str, cwd: str, extra_env: dict[str, str]) -> int:
    """One rank of the job, in directory `cwd` with `extra_env` set: its stdout and stderr go to
    log_dir/rank{RANK}.log; returns main's exit code."""
    import torch.distributed as dist

    from megatron_lite.training.pretrain import main

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), **extra_env}
    os.environ.update(env)
    home = os.getcwd()
    os.chdir(cwd)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(os.path.join(log_dir, f"rank{os.environ['RANK']}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's errors and --help
        rc = e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for src, dst in zip(saved, (1, 2)):
            os.dup2(src, dst)
            os.close(src)
        for k in env:
            os.environ.pop(k, None)
        os.chdir(home)
    # the next job on this rank must start its own world, as a new process would, and no watchdog of this one's
    # may outlive it (a halted job's flight recorder stayed installed and killed the next job in its processes)
    from megatron_lite.resilience import flight_recorder

    assert not dist.is_initialized(), f"main returned {rc} with its process group still initialized"
    assert not flight_recorder._INSTALLED, f"main returned {rc} with its flight recorder still installed"
    return rc


def _logs(log_dir: str, world_size: int) -> list[str]:
    out = []
    for r in range(world_size):
        path = os.path.join(log_dir, f"rank{r}.log")
        out.append(open(path).read() if os.path.exists(path) else "")
    return out


def run_job(
    pool: WorkerPool, argv: list[str], tmp_path, env: dict[str, str] | None = None, exit_code: int = 0, timeout=180
) -> str:
    """Run the job on every rank of `pool` (a WorkerPool(n, init_group=False)) in `tmp_path`, with `env` added
    to the ranks' environment; fail with each failing rank's log unless every rank's main returned `exit_code`.
    Returns the ranks' logs, joined."""
    log_dir = tempfile.mkdtemp(prefix="job_", dir=tmp_path)
    try:
        codes = pool.run(_main_on_rank, argv, free_port(), log_dir, str(tmp_path), env or {}, timeout=timeout)
    except RankError as e:
        logs = _logs(log_dir, pool.world_size)
        tails = "\n".join(f"--- rank {r}'s log:\n{log[-2000:]}" for r, log in enumerate(logs))
        raise RankError(f"{e}\n{tails}") from None
    logs = _logs(log_dir, pool.world_size)
    failed = [r for r, rc in enumerate(codes) if rc != exit_code]
    if failed:  # a failed job may have left state behind: the next test gets a fresh pool
        pool.close(force=True)
    assert not failed, "\n".join(f"--- rank {r} exited with {codes[r]}:\n{logs[r][-3000:]}" for r in failed)
    # the ranks formed one world (not n one-process jobs, which would agree with one process trivially); a refused
    # configuration (exit code 2) stops before any
    text = "".join(logs)
    assert exit_code == 2 or f"world {pool.world_size} on " in text, (
        f"the ranks did not form a world of {pool.world_size}:\n{text[-3000:]}"
    )
    return text
