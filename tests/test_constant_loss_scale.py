"""A constant --loss-scale (under --fp16, --bf16 or the distributed optimizer) skips a step whose gradients are
inf/nan, and while --check-for-nan-in-loss-and-grad is on (its default there, as Megatron keeps it on for any
scale but fp16's dynamic one) --nan-policy then acts as on any non-finite gradient. From an exploratory run: the
skip alone hid it, so --nan-policy halt never halted and a scale that overflowed every step trained nothing and
exited 0."""

from __future__ import annotations

import json

import pytest
from test_pretrain_cli import _run

DATA = ["--mock-data", "--vocab-size", "100", "--train-iters", "3"]


@pytest.mark.parametrize(
    "scaled",
    [["--bf16", "--loss-scale", "1024"], ["--fp16", "--loss-scale", "1024"],
     ["--use-distributed-optimizer", "--loss-scale", "1"]],
    ids=["bf16", "fp16", "fp32-distributed-optimizer"],
)  # fmt: skip
def test_an_overflow_under_a_constant_scale_meets_the_nan_policy(tmp_path, capsys, monkeypatch, scaled):
    monkeypatch.setenv("MEGATRON_LITE_INJECT_FAULT", "nan,rank=0,iteration=2")  # (a NaN gradient)
    rc, _, err = _run([*DATA, *scaled], capsys, monkeypatch)
    assert rc == 3 and "iteration 2: non-finite grad norm (nan)" in err, (rc, err)
    # --nan-policy skip: the step is skipped and counted; the check off: skipped as Megatron's scaler skips it
    for policy in (["--nan-policy", "skip"], ["--no-check-for-nan-in-loss-and-grad"]):
        log = tmp_path / "m.jsonl"
        rc, _, err = _run([*DATA, *scaled, *policy, "--log-jsonl", str(log)], capsys, monkeypatch)
        assert rc == 0, err
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        assert [r["skipped_iterations"] for r in rows] == [0, 1, 0], rows
        log.unlink()
