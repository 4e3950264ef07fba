"""Megatron's --full-validation, --multiple-validation-sets and --iterations-to-skip: a full validation reads
every sample of the validation split once whatever the layout, each of several validation sets gets the loss
it has alone, and a skipped iteration drops its batch and changes nothing else (training/evaluation.py,
data/builder.py, training/skipping.py)."""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest
from test_pretrain_cli import _one_line_error, _run
from test_pretrain_torchrun import records

from megatron_lite.data.indexed import IndexedDatasetWriter

SEQ = 16


def _prefix(tmp_path, name: str, docs: int, seed: int) -> tuple[str, int]:
    """An indexed dataset of `docs` random documents; with the samples one epoch of it holds, worked out from
    its documents' lengths: seq_length + 1 tokens each, consecutive samples sharing one token."""
    prefix = str(tmp_path / name)
    w = IndexedDatasetWriter(prefix, vocab_size=100)
    rng = np.random.default_rng(seed)
    tokens = 0
    for _ in range(docs):
        doc = rng.integers(0, 100, size=int(rng.integers(20, 60)))
        tokens += len(doc)
        w.add_document(doc)
    w.finalize()
    return prefix, (tokens - 1) // SEQ


def _data(tmp_path):
    train, _ = _prefix(tmp_path, "train", 40, 0)
    (va, na), (vb, nb) = _prefix(tmp_path, "va", 7, 1), _prefix(tmp_path, "vb", 5, 2)
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--train-data-path", train], (va, na), (vb, nb)


def _validation(path) -> dict[str, float]:
    """{set name: its loss} of the last evaluation of each set in a JSONL log."""
    out = {}
    for line in open(path):
        r = json.loads(line)
        out.update({k: v["lm_loss"] for k, v in r.items() if k.startswith("validation")})
    return out


def test_full_validation_reads_each_sample_once_and_sets_get_their_own_loss(tmp_path, capsys, monkeypatch):
    """--skip-train --full-validation: one pass over the validation split, from its first sample. Its sample
    count is the one worked out from the documents; with --multiple-validation-sets each --valid-data-path prefix
    logs the loss a run given that prefix alone logs, under Megatron's names (" validation-0 loss at ...",
    "lm loss validation-0" for W&B and TensorBoard)."""
    common, (va, na), (vb, nb) = _data(tmp_path)
    # 3 samples a global batch: neither set is a whole number of them (17 and 13), the last batch is filled
    common += ["--skip-train", "--eval-iters", "0", "--full-validation", "--micro-batch-size", "3",
               "--global-batch-size", "3"]  # fmt: skip
    assert (na, nb) == (17, 13)
    alone = {}
    for name, prefix in (("a", va), ("b", vb)):
        rc, out, err = _run([*common, "--valid-data-path", prefix, "--log-jsonl", str(tmp_path / f"{name}.jsonl")],
                            capsys, monkeypatch)  # fmt: skip
        assert rc == 0, err
        alone[name] = _validation(tmp_path / f"{name}.jsonl")["validation"]
        n = na if name == "a" else nb
        assert f"the validation set's {n} samples in {math.ceil(n / 3)} global batches of 3" in out, out
    both = [*common, "--valid-data-path", va, vb, "--multiple-validation-sets"]
    rc, out, err = _run([*both, "--log-jsonl", str(tmp_path / "both.jsonl")], capsys, monkeypatch)
    assert rc == 0, err
    logged = _validation(tmp_path / "both.jsonl")
    assert logged == {"validation-0": alone["a"], "validation-1": alone["b"]}, (logged, alone)
    assert re.search(r"^ validation-1 loss at iteration 0 on validation set \| lm loss value: ", out, re.M), out

    # one blend of both, by size: every sample of each once, so its loss is the token-weighted mean of theirs
    rc, out, err = _run([*common, "--valid-data-path", va, vb, "--log-jsonl", str(tmp_path / "ab.jsonl")],
                        capsys, monkeypatch)  # fmt: skip
    assert rc == 0 and "the validation set's 30 samples" in out, err
    blended = _validation(tmp_path / "ab.jsonl")["validation"]
    assert blended == pytest.approx((na * alone["a"] + nb * alone["b"]) / (na + nb), rel=1e-6)


@pytest.mark.slow
def test_full_validation_under_data_parallelism_equals_one_process(tmp_path, pretrain_job):
    """Trained 4 iterations and validated at 2 and 4 at DP=2 (1 sample a rank per micro-batch, global batch 4:
    the sets' last batches are filled differently from one process's) and in one process: the same losses."""
    common, (va, _), (vb, _) = _data(tmp_path)
    common += (
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --global-batch-size 4 --lr 1e-3 "
        "--log-interval 1 --train-iters 4 --eval-interval 2 --eval-iters 0 --full-validation --hidden-dropout 0 "
        "--attention-dropout 0 --multiple-validation-sets --distributed-backend gloo --valid-data-path"
    ).split() + [va, vb]
    runs = {}
    for world, mbs in ((1, 4), (2, 1)):
        path = str(tmp_path / f"w{world}.jsonl")
        pretrain_job(world, [*common, "--micro-batch-size", str(mbs), "--log-jsonl", path])
        lines = [json.loads(line) for line in open(path)]
        runs[world] = [(r["iteration"], k, v["lm_loss"]) for r in lines for k, v in r.items() if k.startswith("val")]
        train = records(path)
        runs[world, "train"] = [(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in train]
    # (at 4 twice: the evaluation at --eval-interval, then the final one, as Megatron's)
    assert [(i, k) for i, k, _ in runs[1]] == [(i, f"validation-{k}") for i in (2, 4, 4) for k in (0, 1)]
    for (i, k, one), (_, _, two) in zip(runs[1], runs[2]):
        assert two == pytest.approx(one, rel=1e-5), (i, k)
    for one, two in zip(runs[1, "train"], runs[2, "train"]):
        assert two == pytest.approx(one, rel=1e-5)


def test_validation_loss_is_per_token_over_the_whole_evaluation(tmp_path, capsys, monkeypatch):
    """With --eod-mask-loss the evaluation's batches count different numbers of tokens: the validation loss is
    their summed loss over their summed tokens (Megatron's evaluate()), not the mean of the batches' means."""
    import megatron_lite.training.evaluation as evaluation

    prefix = str(tmp_path / "data" / "toy_text_document")
    w = IndexedDatasetWriter(prefix, vocab_size=100)
    rng = np.random.default_rng(0)
    for d in range(60):  # every 7th document all EOD (99): masked out, in some batches only
        n = int(rng.integers(5, 40))
        w.add_document(np.full(n, 99) if d % 7 == 0 else rng.integers(0, 99, size=n))
    w.finalize()
    batches = []
    real = evaluation.eval_step
    monkeypatch.setattr(evaluation, "eval_step", lambda *a: batches.append(real(*a)) or batches[-1])
    log = tmp_path / "m.jsonl"
    argv = ["--train-iters", "1", "--eval-iters", "4", "--eval-interval", "1", "--data-path", prefix,
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "99", "--eod-mask-loss", "--split", "1,1,0",
            "--log-jsonl", str(log)]  # fmt: skip
    rc, _, err = _run(argv, capsys, monkeypatch)
    assert rc == 0, err
    lines = log.read_text().splitlines()
    logged = [json.loads(line)["validation"]["lm_loss"] for line in lines if "validation" in line]
    first = batches[:4]
    assert len({n for _, n in first}) > 1  # the batches do count different numbers of tokens
    per_token = sum(s for s, _ in first) / sum(n for _, n in first)
    assert logged[0] == pytest.approx(per_token, rel=1e-9)
    assert abs(per_token - sum(s / n for s, n in first) / 4) > 1e-6  # (which the mean of means is not)


def test_each_validation_set_has_megatrons_keys():
    """W&B and TensorBoard get Megatron's "lm loss validation-0" (and its "vs samples" and "ppl" on TensorBoard)."""
    from megatron_lite.training.configs import LoggingConfig
    from megatron_lite.training.logger import MetricsLogger

    class Writer:
        calls: list = []

        def add_scalar(self, key, value, step):
            self.calls.append((key, step))

        def log(self, values, step):
            self.calls.extend((k, step) for k in values)

    logger = MetricsLogger.__new__(MetricsLogger)
    logger.enabled, logger.train_iters, logger._jsonl, logger._wandb, logger._tb = True, 9, None, Writer(), Writer()
    logger._samples, logger.config = 0, LoggingConfig()
    logger._last_iteration = logger._last_train = logger._wandb_step = logger._step_offset = 0
    logger._opened = -1
    logger.log(6, {"lm_loss": 1.0, "ppl": 2.7}, kind="validation-1", samples=24)
    keys = {k for k, _ in Writer.calls}
    assert {"lm loss validation-1", "lm loss validation-1 vs samples", "lm loss validation-1 ppl vs samples"} <= keys


def test_a_skipped_iteration_equals_a_run_without_its_batch(tmp_path, capsys, monkeypatch):
    """--iterations-to-skip 3 over 5 iterations vs a run whose data lacks iteration 3's batch: 2 iterations,
    saved, the checkpoint's sample position moved one global batch on (the batch is gone), resumed for 2 more.
    The skipping run's iterations 4 and 5 are the other's 3 and 4: same loss, gradient norm and learning rate
    (Megatron's scheduler counts the steps taken, so the skipped one does not move it). Iteration 3 logs no
    line and is not evaluated (--eval-interval 3)."""
    common, _, _ = _data(tmp_path)
    common += ["--lr-decay-iters", "10", "--lr-warmup-iters", "1", "--eval-interval", "3"]
    a = str(tmp_path / "a.jsonl")
    rc, out, err = _run([*common, "--train-iters", "5", "--iterations-to-skip", "3", "9", "--log-jsonl", a],
                        capsys, monkeypatch)  # fmt: skip
    assert rc == 0 and "iteration 3 skipped (--iterations-to-skip): its 4 samples dropped" in out, err
    console = out
    ck = tmp_path / "ck"
    rc, _, err = _run([*common, "--train-iters", "2", "--save", str(ck)], capsys, monkeypatch)
    assert rc == 0, err
    meta_path = ck / "iter_0000002" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    assert meta["consumed_samples"] == 8
    meta["consumed_samples"] = 12  # (the 4 samples of the dropped batch)
    meta_path.write_text(json.dumps(meta))
    b = str(tmp_path / "b.jsonl")
    rc, out, err = _run([*common, "--train-iters", "4", "--load", str(ck), "--log-jsonl", b], capsys, monkeypatch)
    assert rc == 0, err
    skipped, without = records(a), records(b)
    assert [r["iteration"] for r in skipped] == [1, 2, 4, 5]
    assert not any("validation" in json.loads(line) for line in open(a) if json.loads(line)["iteration"] == 3)
    for s, w in zip(skipped[2:], without):
        assert (s["iteration"] - 1, s["consumed_samples"]) == (w["iteration"], w["consumed_samples"])
        assert (s["lm_loss"], s["grad_norm"], s["lr"]) == (w["lm_loss"], w["grad_norm"], w["lr"]), (s, w)
    # (an exploratory run's: Megatron's log line says "skipped samples" once any were dropped; ours said nothing)
    assert [r.get("skipped_samples") for r in skipped] == [None, None, 4, 4]
    assert "consumed samples:           16 | skipped samples:            4 |" in console, console
    assert "skipped samples" not in console.split("iteration 3 skipped")[0], console


@pytest.mark.parametrize(
    "flags,fragments",
    [
        (["--multiple-validation-sets", "--full-validation"], ["--multiple-validation-sets evaluates each prefix"]),
        (["--multiple-validation-sets"], ["--multiple-validation-sets needs --full-validation"]),
        (["--full-validation", "--mock-data"], ["--full-validation", "--mock-data's samples never end"]),
        (["--full-validation", "--data-path", "0.5", "A", "0.5", "B"], ["weighted blend --data-path 0.5 A 0.5 B"]),
        (["--iterations-to-skip", "0", "4"], ["--iterations-to-skip 0 4", "iterations >= 1"]),
    ],
)
def test_bad_validation_and_skip_flags_are_one_line(flags, fragments, capsys, monkeypatch):
    argv = [*flags, "--vocab-size", "100"] if "--mock-data" in flags else flags
    rc, _, err = _run(argv, capsys, monkeypatch)
    _one_line_error(rc, err, *fragments)


def test_weighted_validation_sets_are_refused(tmp_path, capsys, monkeypatch):
    common, (va, _), (vb, _) = _data(tmp_path)
    argv = [*common, "--full-validation", "--multiple-validation-sets", "--valid-data-path", "1", va, "2", vb]
    rc, _, err = _run(argv, capsys, monkeypatch)
    _one_line_error(rc, err, f"--valid-data-path 1 {va} 2 {vb}", "without weights")
    assert os.path.exists(va + ".idx")


def test_exhaustive_blend_order_worked_out_by_hand():
    """Megatron's exhaustive blend (helpers.cpp): sample i from the unspent dataset furthest behind its share of
    max(i, 1), the first on ties. Sizes [2, 1] (shares 2/3, 1/3): i=0 0.67 vs 0.33 -> 0; i=1 -0.33 vs 0.33 -> 1
    (spent); i=2 -> 0."""
    from megatron_lite.data.gpt_dataset import exhaustive_blending_indices

    datasets, samples = exhaustive_blending_indices([2, 1])
    assert datasets.tolist() == [0, 1, 0] and samples.tolist() == [0, 0, 1]
    # [1, 3]: i=0 0.25 vs 0.75 -> 1; i=1 0.25 vs -0.25 -> 0 (spent); then 1, 1
    datasets, samples = exhaustive_blending_indices([1, 3])
    assert datasets.tolist() == [1, 0, 1, 1] and samples.tolist() == [0, 0, 1, 2]


def test_fewer_eval_iters_on_resume_read_on_instead_of_wrapping(tmp_path, capsys, monkeypatch):
    """A checkpoint's evaluations read 6 validation batches (--eval-iters 3 at iterations 2 and 4); resumed to 6
    with --eval-iters 1, Megatron's size, (6 // 2 + 1) x 1 batches, ends before the batch the next evaluation
    reads (Megatron's sampler asserts there). The split is sized for the reads ahead instead: the evaluation at
    iteration 6 reads batch 7 of the weighted blend, as a run sized long enough by its --train-iters (12, ended
    at 6 by --exit-interval) reads it. (Every size here keeps each part of the blend within one epoch of its
    dataset, so the blend's order does not depend on the size.)"""
    common, (va, _), (vb, _) = _data(tmp_path)
    common += ["--valid-data-path", "1", va, "1", vb, "--lr-decay-style", "constant", "--eval-interval", "2",
               "--micro-batch-size", "2", "--global-batch-size", "2"]  # fmt: skip
    ck = str(tmp_path / "ck")
    rc, _, err = _run([*common, "--train-iters", "4", "--eval-iters", "3", "--save", ck], capsys, monkeypatch)
    assert rc == 0, err
    assert json.load(open(os.path.join(ck, "iter_0000004", "metadata.json")))["consumed_valid_samples"] == 12
    losses = {}
    for name, flags in (("resumed", ["--train-iters", "6"]), ("long", ["--train-iters", "12", "--exit-interval", "6"])):
        log = str(tmp_path / f"{name}.jsonl")
        argv = [*common, *flags, "--eval-iters", "1", "--load", ck, "--log-jsonl", log]
        rc, out, err = _run(argv, capsys, monkeypatch)
        assert rc == 0, err
        evals = [json.loads(line) for line in open(log)]
        losses[name] = next(r["validation"]["lm_loss"] for r in evals if r["iteration"] == 6 and "validation" in r)
        if name == "resumed":
            assert "the validation split is sized for the checkpoint's 12 samples read and the 4 ahead" in out, out
    assert losses["resumed"] == losses["long"], losses


def test_mock_data_evaluates_no_split_that_split_gives_no_weight(capsys, monkeypatch):
    """An exploratory port of Megatron's Llama-3 example (--mock-data --split 99,1,0) found a test evaluation
    Megatron does not run: our mock builder made all three splits whatever --split said (Megatron's makes none
    for a split without weight)."""
    argv = ["--mock-data", "--vocab-size", "100", "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1"]
    rc, out, err = _run([*argv, "--split", "99,1,0"], capsys, monkeypatch)
    assert rc == 0, err
    assert "no test evaluation: the test split holds no documents (--split 99,1,0)" in out, out
    assert "on validation set" in out and "on test set" not in out, out
    rc, out, err = _run([*argv, "--split", "99,0,1"], capsys, monkeypatch)
    assert rc == 0, err
    assert "no validation evaluation" in out and "on validation set" not in out and "on test set" in out, out
