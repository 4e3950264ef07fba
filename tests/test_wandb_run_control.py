"""W&B under run control (from an exploratory review). Slurm's preemption signal reaches every process of the job
step, W&B's own service among them, and the next W&B call raised (ConnectionResetError): a traceback, no save,
exit code 1, where --exit-signal-handler promises a save and a clean exit (docs/fault_tolerance.md); W&B gone is
now one warning and the run goes on without it. --skip-train's evaluation went into the run's W&B curves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from test_pretrain_cli import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [d for c in map(int, out) for d in (c, *_descendants(c))]


def test_sigterm_to_every_process_with_wandb_saves_and_exits(tmp_path):
    log = tmp_path / "m.jsonl"
    argv = [*TINY, "--mock-data", "--vocab-size", "100", "--train-iters", "200", "--exit-signal-handler",
            "--save", str(tmp_path / "ck"), "--save-interval", "1000", "--wandb-project", "p",
            "--wandb-save-dir", str(tmp_path / "wb"), "--log-jsonl", str(log)]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "MEGATRON_LITE_INJECT_FAULT": "slow,rank=0,seconds=0.3"}
    job = subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain", "pretrain_gpt.py"), *argv], env=env,
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.time() + 180
    while time.time() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 3):
        time.sleep(0.2)
    services = _descendants(job.pid)
    assert services, "no W&B service process found"
    for pid in (job.pid, *services):  # (as Slurm's --signal=TERM@120: every process of the step)
        os.kill(pid, signal.SIGTERM)
    out = job.communicate(timeout=120)[0]
    assert job.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "warning: W&B stopped answering" in out, out[-3000:]
    assert list((tmp_path / "ck").glob("iter_*")), out[-3000:]


def test_skip_train_keeps_its_evaluation_out_of_wandb(tmp_path):
    """Megatron evaluates a --skip-train run with write_to_tensorboard=not args.skip_train: a draw from the
    validation set's start (not where training left it) stays out of the training run's curves; the console and
    --log-jsonl still have it."""
    from test_cli_logging import _wandb_history

    log = tmp_path / "m.jsonl"
    argv = [*TINY, "--mock-data", "--vocab-size", "100", "--eval-iters", "1", "--skip-train", "--wandb-project", "p",
            "--wandb-save-dir", str(tmp_path / "wb"), "--log-jsonl", str(log)]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline"}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain", "pretrain_gpt.py"), *argv], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "validation loss at iteration 0" in out.stdout and '"validation"' in log.read_text(), out.stdout[-2000:]
    history = _wandb_history(next((tmp_path / "wb" / "wandb").glob("offline-run-*")))
    assert not any(k.startswith("lm loss") for row in history for k in row), history
