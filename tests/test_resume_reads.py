"""A resume reads on from the checkpoint's consumed samples: where this run's train split, sized for its own
--global-batch-size (a weighted blend is exactly that long), ends before the samples it would read, start-up says
so in one line, as Megatron's sampler asserts (no samples left to consume). From an exploratory run: a job resumed
with a smaller batch (a relaunch on fewer ranks) trained on the blend's first samples again without a word."""

from __future__ import annotations

import numpy as np
from test_pretrain_cli import TINY, _one_line_error, _run

from megatron_lite.data.indexed import IndexedDatasetWriter


def _blend(tmp_path) -> list[str]:
    out = []
    for k, name in enumerate("ab"):
        prefix = str(tmp_path / "data" / name)
        w = IndexedDatasetWriter(prefix, vocab_size=100)
        rng = np.random.default_rng(k)
        for _ in range(30):
            w.add_document(rng.integers(0, 100, size=int(rng.integers(20, 60))))
        w.finalize()
        out += ["0.5", prefix]
    return ["--data-path", *out, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


def test_a_resume_reading_past_its_split_is_refused(tmp_path, capsys, monkeypatch):
    data, ckpt = _blend(tmp_path), str(tmp_path / "ckpt")
    # (TINY: --micro-batch-size 2 --global-batch-size 4; 3 iterations of 4 read 12 samples)
    rc, _, err = _run([*data, "--train-iters", "6", "--exit-interval", "3", "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    # 3 more iterations of 2 read samples 12-17; this run's split holds 6 x 2 = 12
    rc, _, err = _run([*data, "--train-iters", "6", "--global-batch-size", "2", "--load", ckpt], capsys, monkeypatch)
    _one_line_error(rc, err, "--load: the checkpoint read 12 training samples in 3 iterations (4 a step), and the 3 "
                    "left at --global-batch-size 2 read up to sample 18, past the 12 this run's train split holds",
                    "resume with the checkpoint's global batch size")  # fmt: skip
    # the checkpoint's batch (or a longer run whose split holds them) goes on
    rc, _, err = _run([*data, "--train-iters", "6", "--load", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    assert TINY[TINY.index("--global-batch-size") + 1] == "4"


def test_a_restart_after_a_rollback_is_not_refused(tmp_path, capsys, monkeypatch):
    """A rollback skips a batch, so the checkpoint has read more samples than its iterations' batches, and the job
    reads past its split on purpose (training/batches.py): a restart of the same job goes on (a review of the
    check above: it refused every checkpoint after a rollback)."""
    data, ckpt = _blend(tmp_path), str(tmp_path / "ckpt")
    job = [*data, "--train-iters", "6", "--save", ckpt, "--save-interval", "1", "--nan-policy", "rollback"]
    monkeypatch.setenv("MEGATRON_LITE_INJECT_FAULT", "nan,rank=0,iteration=3")
    rc, _, err = _run([*job, "--exit-interval", "4"], capsys, monkeypatch)
    assert rc == 0, err
    monkeypatch.delenv("MEGATRON_LITE_INJECT_FAULT")
    rc, out, err = _run([*job, "--load", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    assert "earlier rollbacks of this job skip the batches at samples [8]" in out, out
