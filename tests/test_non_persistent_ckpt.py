"""Megatron's non-persistent checkpoints (checkpoint/non_persistent.py): saved at multiples of
--non-persistent-save-interval that are not --save-interval's, only the newest kept, and at start-up taken when
newer than the persistent checkpoint. A run stopped after one continues as the uninterrupted run did (the oracle:
that run's own per-iteration lm_loss and grad norm)."""

from __future__ import annotations

import os
import shutil

import pytest
from test_pretrain_cli import TINY, _one_line_error, _run
from test_pretrain_torchrun import records


def _stop_after_iteration_7(ckpt) -> None:
    """What a run killed in iteration 7 or 8 leaves: the persistent checkpoint of 4 and the non-persistent one of 6
    (iteration 8's persistent save never happened)."""
    shutil.rmtree(ckpt / "iter_0000008")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")


def _same(a: list[dict], b: list[dict], rel: float = 0.0) -> None:
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b], (a, b)
    for x, y in zip(a, b):
        for k in ("lm_loss", "grad_norm"):
            assert abs(x[k] - y[k]) <= rel * abs(x[k]), (k, x, y)


def test_global_resumes_from_the_newer_one_and_keeps_only_the_newest(tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "ckpt"
    flags = ["--mock-data", "--vocab-size", "100", "--train-iters", "8", "--save", str(ckpt), "--save-interval", "4",
             "--non-persistent-save-interval", "3", "--non-persistent-ckpt-type", "global"]  # fmt: skip
    rc, out, err = _run([*flags, "--log-jsonl", str(tmp_path / "straight.jsonl")], capsys, monkeypatch)
    assert rc == 0, err
    # saved at 3 and 6 (not at 4 and 8: persistent saves there), each replacing the one before
    assert "non_persistent/iter_0000003 (non-persistent)" in out and "non_persistent/iter_0000006" in out
    assert "iter_0000004 (non-persistent)" not in out and "iter_0000008 (non-persistent)" not in out
    assert sorted(os.listdir(ckpt / "non_persistent")) == ["iter_0000006", "latest_checkpointed_iteration.txt"]
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("iter_")) == ["iter_0000004", "iter_0000008"]
    _stop_after_iteration_7(ckpt)
    # the same command again: the non-persistent checkpoint of 6 is newer than the persistent one of 4
    rc, out, err = _run([*flags, "--log-jsonl", str(tmp_path / "resumed.jsonl")], capsys, monkeypatch)
    assert rc == 0, err
    assert "resuming from the non-persistent checkpoint" in out and "iteration 6, 24 samples consumed" in out
    straight, resumed = records(tmp_path / "straight.jsonl"), records(tmp_path / "resumed.jsonl")
    assert len(straight) == 8
    _same(straight[6:], resumed)  # bit for bit
    # now the persistent one (8, saved at the end) is newer: it is taken, and said so
    rc, out, err = _run(
        [*flags[:-4], "--train-iters", "9", "--non-persistent-ckpt-type", "global"], capsys, monkeypatch
    )
    assert rc == 0, err
    assert "iteration 6) is older than" in out and "loaded " + str(ckpt / "iter_0000008") in out


def test_local_at_dp2_resumes_and_another_layout_takes_the_persistent_one(tmp_path, pretrain_job):
    """Each rank's own files (async, under the distributed optimizer): a DP=2 run stopped after a local save
    continues bit for bit; on one process the local checkpoints (DP=2's) are passed over for the persistent one,
    and that run equals the DP=2 one (a one-process run of the same global batch; no dropout, whose draws differ
    by rank)."""
    local, ckpt = tmp_path / "local", tmp_path / "ckpt"
    args = ["--mock-data", "--vocab-size", "100", *TINY, "--train-iters", "8", "--distributed-backend", "gloo",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            "--save", str(ckpt), "--save-interval", "4", "--non-persistent-save-interval", "3",
            "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", str(local),
            "--use-distributed-optimizer", "--async-save"]  # fmt: skip
    out = pretrain_job(2, [*args, "--log-jsonl", str(tmp_path / "straight.jsonl")])
    assert "async non-persistent save started" in out
    for rank in (0, 1):  # each rank's own, the newest only
        assert sorted(os.listdir(local / str(rank))) == ["iter_0000006", "latest_checkpointed_iteration.txt"]
        assert sorted(os.listdir(local / str(rank) / "iter_0000006")) == [
            f"index_r0000{rank}.json", "metadata.json", f"rng_r0000{rank}.safetensors",
            f"tensors_r0000{rank}.safetensors",
        ]  # fmt: skip
    assert not (ckpt / "non_persistent").exists()
    _stop_after_iteration_7(ckpt)
    out = pretrain_job(2, [*args, "--log-jsonl", str(tmp_path / "resumed.jsonl")])
    assert "resuming from the non-persistent checkpoint" in out and "iteration 6, 24 samples consumed" in out
    straight = records(tmp_path / "straight.jsonl")
    _same(straight[6:], records(tmp_path / "resumed.jsonl"))  # bit for bit
    # a rank without its own (a node's disk replaced): every rank starts from the persistent checkpoint
    _stop_after_iteration_7(ckpt)
    shutil.rmtree(local / "1")
    out = pretrain_job(2, args)
    assert "the ranks found different local non-persistent checkpoints" in out
    assert "loaded " + str(ckpt / "iter_0000004") in out
    _stop_after_iteration_7(ckpt)
    out = pretrain_job(1, [*args, "--log-jsonl", str(tmp_path / "one.jsonl")])
    assert "was saved under another layout (world_size 2 then, 1 now)" in out, out
    assert "loaded " + str(ckpt / "iter_0000004") in out
    _same(straight[4:], records(tmp_path / "one.jsonl"), rel=1e-5)


@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["--save", "S", "--non-persistent-save-interval", "5"], ["5 needs --non-persistent-ckpt-type"]),
        (["--non-persistent-save-interval", "5", "--non-persistent-ckpt-type", "global"], ["5 needs --save DIR"]),
        (["--non-persistent-ckpt-type", "local"], ["local needs --non-persistent-local-ckpt-dir"]),
        (["--non-persistent-ckpt-type", "in_memory"], ["--non-persistent-ckpt-type in_memory is not supported"]),
        (["--non-persistent-save-interval", "-1"], ["--non-persistent-save-interval -1 must be >= 0"]),
        (  # (checked before any process group: WORLD_SIZE 2 on one process)
            ["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "L",
             "--pipeline-model-parallel-size", "2", "--distributed-backend", "gloo"],
            ["--pipeline-model-parallel-size 2 and tied embeddings", "--untie-embeddings-and-output-weights"],
        ),
    ],
)  # fmt: skip
def test_bad_flags_are_one_line(extra, fragments, capsys, monkeypatch):
    world = 2 if "--pipeline-model-parallel-size" in extra else 1
    rc, _, err = _run(["--mock-data", "--vocab-size", "100", *extra], capsys, monkeypatch, world=world)
    _one_line_error(rc, err, *fragments)
