"""A job restarted after a rollback (a preemption, a crash, torchrun's restart) goes on as the uninterrupted job:
the batches rollbacks skipped are recorded beside the checkpoints when decided (a restart before the next save
trained them after all), and each checkpoint holds the loss-spike check's history (a restart began with none, so
missed the spike the uninterrupted run rolled back from). The restart is simulated by removing the checkpoints
the uninterrupted run saved after the one it went back to (as a crash before them leaves the directory), then
running the same command again without the fault. From the fault-tolerance review of 2026-12-07."""

from __future__ import annotations

import json
import shutil

import torch.distributed as dist

from megatron_lite.training.pretrain import main

ARGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
    "--global-batch-size 4 --lr-decay-style constant --log-interval 1 --eval-iters 0 --mock-data --vocab-size 128 "
    "--hidden-dropout 0 --attention-dropout 0"
).split()


def _job(argv, jsonl, capsys, monkeypatch, fault: str | None = None, code: int = 0) -> tuple[dict, str]:
    """{iteration: its last record} of a one-process job, and its output."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    if fault:
        monkeypatch.setenv("MEGATRON_LITE_INJECT_FAULT", fault)
    else:
        monkeypatch.delenv("MEGATRON_LITE_INJECT_FAULT", raising=False)
    assert main([*argv, "--log-jsonl", str(jsonl)]) == code
    assert not dist.is_initialized()
    rows = [json.loads(line) for line in open(jsonl)]
    return {r["iteration"]: r for r in rows if "lm_loss" in r and "kind" not in r}, capsys.readouterr().out


def _crash_after(save, iteration: int, keep_skips: bool = True) -> None:
    """--save as a crash right after `iteration`'s checkpoint leaves it: none later, no tracker naming one."""
    for d in save.glob("iter_*"):
        if int(d.name.split("_")[1]) > iteration:
            shutil.rmtree(d)
    (save / "latest_checkpointed_iteration.txt").unlink(missing_ok=True)
    if not keep_skips:
        (save / "rollback_skips.json").unlink()


def test_a_restart_after_a_nan_rollback_still_skips_its_batch(tmp_path, capsys, monkeypatch):
    """A NaN in iteration 4: back to iteration 2, the batch at sample 12 skipped. Restarted from iteration 2
    (without the fault, which came from that batch's step), the batch is skipped again, said at start-up, and
    iterations 3-6 are the uninterrupted run's."""
    save = tmp_path / "ck"
    argv = [*ARGS, "--lr", "3e-3", "--train-iters", "6", "--nan-policy", "rollback", "--save", str(save),
            "--save-interval", "2"]  # fmt: skip
    first, out = _job(argv, tmp_path / "a.jsonl", capsys, monkeypatch, fault="nan,rank=0,iteration=4")
    assert "skipping the batch at sample 12" in out, out
    _crash_after(save, 2)
    again, out = _job(argv, tmp_path / "b.jsonl", capsys, monkeypatch)
    assert "earlier rollbacks of this job skip the batches at samples [12]" in out, out
    for it in (3, 4, 5, 6):
        assert (again[it]["lm_loss"], again[it]["grad_norm"]) == (first[it]["lm_loss"], first[it]["grad_norm"]), it


def test_a_restart_checks_for_spikes_with_the_checkpoints_history(tmp_path, capsys, monkeypatch):
    """Saved every iteration, a loss spike in iteration 6 (a z-score bound low enough for a tiny run to cross):
    back to iteration 5, twice. Restarted from iteration 5 with the rollbacks' record gone, the spike is found
    again from the history iteration 5's checkpoint holds (with none, 5 iterations are needed first: the batch
    was trained), so iteration 6 is the uninterrupted run's."""
    save = tmp_path / "ck"
    argv = [*ARGS, "--lr", "3e-2", "--train-iters", "6", "--check-for-spiky-loss", "--spiky-loss-window", "10",
            "--spiky-loss-zscore", "0.75", "--spiky-loss-policy", "rollback", "--save", str(save),
            "--save-interval", "1"]  # fmt: skip
    first, out = _job(argv, tmp_path / "a.jsonl", capsys, monkeypatch)
    assert out.count("iteration 6: loss spike") == 2 and "rolled back to" in out, out
    _crash_after(save, 5, keep_skips=False)
    again, out = _job(argv, tmp_path / "b.jsonl", capsys, monkeypatch)
    assert out.count("iteration 6: loss spike") == 2, out
    assert (again[6]["lm_loss"], again[6]["grad_norm"]) == (first[6]["lm_loss"], first[6]["grad_norm"])


def test_the_halt_after_three_rollbacks_is_not_announced_as_a_fourth(tmp_path, capsys, monkeypatch):
    """A NaN that comes back whatever the batch (the fault given for four tries of iteration 4): three rollbacks,
    each said, then the halt. The fourth was said as "rolling back ... skipping the batch" too, before the halt."""
    argv = [*ARGS, "--lr", "3e-3", "--train-iters", "6", "--nan-policy", "rollback", "--save", str(tmp_path / "ck"),
            "--save-interval", "2"]  # fmt: skip
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MEGATRON_LITE_INJECT_FAULT", ";".join(["nan,rank=0,iteration=4"] * 4))
    assert main(argv) == 3
    captured = capsys.readouterr()
    assert captured.out.count("rolling back to the last checkpoint") == 3, captured.out
    assert "again after 3 rollbacks" in captured.err, captured.err
