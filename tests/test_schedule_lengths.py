"""A resumed run's schedule lengths, compared in samples as the checkpoint's scheduler state keeps them (Megatron's
OptimizerParamScheduler stops on a changed warmup, decay or weight-decay length): a resume in the other unit
carries the checkpoint's warmup and decay over instead of dropping them; a warmup given by other flags with the
same length is not called changed; a changed run length says it moves the weight-decay ramp too. From a review of
the optimizer against Megatron (2026-12-07): each of these moved the LR or weight decay without a word, or said a
change that did not happen."""

from __future__ import annotations

import pytest
from test_schedule_resume import _job, _without

BASE = (
    "--mock-data --vocab-size 100 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --log-interval 1 "
    "--eval-iters 0"
).split()
NOTE = "the schedule's lengths in samples differ from the checkpoint's"


@pytest.mark.parametrize(
    "first, resumed",
    [
        (["--train-samples", "48", "--lr-warmup-samples", "12", "--lr-decay-samples", "40"],
         ["--train-iters", "12"]),
        (["--train-iters", "12", "--lr-warmup-iters", "3", "--lr-decay-iters", "10"], ["--train-samples", "48"]),
    ],
    ids=["samples-then-iters", "iters-then-samples"],
)  # fmt: skip
@pytest.mark.parametrize("batch", ["given", "implicit", "kept-scheduler"])
def test_a_resume_in_the_other_unit_keeps_the_warmup_and_decay(first, resumed, batch, tmp_path, capsys, monkeypatch):
    """Saved at iteration 6 of 12, resumed giving the same run length in the other unit: iterations 7-12 take the
    unbroken run's learning rates (the warmup had become none and the decay the run's: 5.5e-4 for 7.75e-4), the
    checkpoint's lengths are said to come over, and no length is said to differ. The same with the global batch
    left to Megatron's default, --micro-batch-size x data-parallel size (an exploratory run's: the lengths came
    over as none, and with --use-checkpoint-opt_param-scheduler it was a TypeError)."""
    ckpt = str(tmp_path / "ckpt")
    base = BASE if batch == "given" else [*_without(_without(BASE, "--global-batch-size"), "--micro-batch-size"),
                                          "--micro-batch-size", "4"]  # fmt: skip
    resumed = resumed + ["--use-checkpoint-opt_param-scheduler"] * (batch == "kept-scheduler")
    straight, _ = _job([*base, *first, "--save", ckpt, "--save-interval", "6"], tmp_path / "a.jsonl", capsys,
                       monkeypatch)  # fmt: skip
    rows, out = _job([*base, *resumed, "--load", ckpt, "--ckpt-step", "6"], tmp_path / "b.jsonl", capsys, monkeypatch)
    assert [r["iteration"] for r in rows] == list(range(7, 13))
    assert [r["lr"] for r in rows] == pytest.approx([r["lr"] for r in straight[6:]], rel=1e-9)
    if batch == "kept-scheduler":
        return
    carried = "--lr-warmup-iters 3" if resumed[0] == "--train-iters" else "--lr-warmup-samples 12"
    assert "flags not given take the checkpoint's values" in out and carried in out, out
    assert NOTE not in out and "differs from the checkpoint's" not in out, out


def test_the_warmup_is_compared_by_its_length_not_by_its_flag(tmp_path, capsys, monkeypatch):
    """A --lr-warmup-fraction 0.25 checkpoint (3 of 12 iterations) resumed with --lr-warmup-iters 3 has the same
    warmup: nothing said (it was told it differed from the checkpoint's 0). Resumed with --lr-warmup-iters 0 the
    warmup is gone, and that is said (it was silent: 0 equalled the checkpoint's unused 0)."""
    ckpt = str(tmp_path / "ckpt")
    run = [*BASE, "--train-iters", "12"]
    _job([*run, "--lr-warmup-fraction", "0.25", "--save", ckpt, "--save-interval", "2", "--exit-interval", "2"],
         tmp_path / "a.jsonl", capsys, monkeypatch)  # fmt: skip
    _, out = _job([*run, "--load", ckpt, "--lr-warmup-iters", "3", "--exit-interval", "3"], tmp_path / "b.jsonl",
                  capsys, monkeypatch)  # fmt: skip
    assert NOTE not in out and "differs from the checkpoint's" not in out, out
    _, out = _job([*run, "--load", ckpt, "--ckpt-step", "2", "--lr-warmup-iters", "0", "--exit-interval", "3"],
                  tmp_path / "c.jsonl", capsys, monkeypatch)  # fmt: skip
    assert f"{NOTE}: the LR warmup 0 (--lr-warmup-iters 0 x --global-batch-size 4; the checkpoint's 12)" in out, out


def test_a_new_run_length_says_the_weight_decay_ramp_moves(tmp_path, capsys, monkeypatch):
    """--weight-decay-incr-style linear ramps over the whole run whatever --lr-decay-iters says: a resume with
    another --train-iters re-stretched it (0.075 at step 7 of 8 for the unbroken run's 0.05) without a word, the
    LR decay having its own length. Now said; the same --train-iters says nothing."""
    ckpt = str(tmp_path / "ckpt")
    wd = [*_without(BASE, "--lr-decay-style"), "--lr-decay-style", "cosine", "--weight-decay-incr-style", "linear",
          "--start-weight-decay", "0", "--end-weight-decay", "0.1", "--lr-decay-iters", "12"]  # fmt: skip
    _job([*wd, "--train-iters", "12", "--save", ckpt, "--save-interval", "6", "--exit-interval", "6"],
         tmp_path / "a.jsonl", capsys, monkeypatch)  # fmt: skip
    _, out = _job([*wd, "--train-iters", "8", "--load", ckpt], tmp_path / "b.jsonl", capsys, monkeypatch)
    assert f"{NOTE}: the weight-decay ramp 32 (--train-iters 8 x --global-batch-size 4; the checkpoint's 48)" in out
    assert "the LR decay" not in out, out
    _, out = _job([*wd, "--train-iters", "12", "--load", ckpt, "--exit-interval", "7"], tmp_path / "c.jsonl", capsys,
                  monkeypatch)  # fmt: skip
    assert NOTE not in out, out


def test_a_global_batch_left_to_the_layout_is_compared_by_its_samples(tmp_path, capsys, monkeypatch):
    """No --global-batch-size: Megatron's micro-batch x data-parallel size, so a resume on twice the ranks took
    batches of 4 for 2 and the decay ran over 16 samples for 8, without a word (the batch-change line needs the
    flag on both sides). The start-up notes (parsed as on each of 2 ranks) now say it."""
    from megatron_lite.arguments import parse_args

    ckpt = str(tmp_path / "ckpt")
    run = [*_without(BASE, "--global-batch-size"), "--train-iters", "4"]
    _job([*run, "--save", ckpt, "--exit-interval", "2"], tmp_path / "a.jsonl", capsys, monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "2")
    ns, job = parse_args([*run, "--load", ckpt])
    assert job.training.global_batch(2) == 4
    said = "the global batch 4 (--micro-batch-size x data-parallel size 2)"
    assert any(f"the LR decay 16 (--train-iters 4 x {said}; the checkpoint's 8)" in n for n in ns.schedule_notes), (
        ns.schedule_notes
    )
    monkeypatch.setenv("WORLD_SIZE", "1")
    ns, _ = parse_args([*run, "--load", ckpt])
    assert not any(NOTE in n for n in ns.schedule_notes), ns.schedule_notes


def test_a_refused_value_that_came_from_the_checkpoint_says_so(tmp_path, capsys, monkeypatch):
    """A 1-process checkpoint of --global-batch-size 2 resumed on 2 ranks, no batch flag given: refused for a
    "--global-batch-size 2" never typed. A batch-ramp checkpoint resumed with --train-iters: refused for the
    ramp's flag, also never typed. Each line now says the value is the checkpoint's."""
    from megatron_lite.training.pretrain import main

    ckpt, ramp = str(tmp_path / "ckpt"), str(tmp_path / "ramp")
    run = [*_without(BASE, "--global-batch-size"), "--global-batch-size", "2", "--train-iters", "4"]
    _job([*run, "--save", ckpt, "--exit-interval", "1"], tmp_path / "a.jsonl", capsys, monkeypatch)
    base = _without(BASE, "--global-batch-size")
    _job([*base, "--global-batch-size", "8", "--train-samples", "40", "--rampup-batch-size", "4", "4", "8", "--save",
          ramp, "--exit-interval", "1"], tmp_path / "b.jsonl", capsys, monkeypatch)  # fmt: skip
    cases = [
        (2, [*base, "--load", ckpt], "--global-batch-size 2 is not divisible", ckpt, "--global-batch-size"),
        (1, [*base, "--load", ramp, "--train-iters", "12"], "--rampup-batch-size 4 4 8 needs", ramp,
         "--rampup-batch-size"),
    ]  # fmt: skip
    for world, argv, start, path, flag in cases:
        monkeypatch.setenv("WORLD_SIZE", str(world))
        assert main(argv) == 2
        (line,) = [x for x in capsys.readouterr().err.splitlines() if x]
        assert line.startswith(f"error: {start}") and f"({flag}: not given, the checkpoint's value, {path}" in line, (
            line
        )


def test_the_run_length_line_counts_a_ramps_iterations_apart(tmp_path, capsys, monkeypatch):
    """--rampup-batch-size 2 2 40 to 8 over --train-samples 120, worked by hand as Megatron's calculator does: 2
    until 13.3 samples (7 iterations, 14 samples), 4 until 26.7 (4, to 30), 6 until 40 (2, to 42): 13 ramping up;
    then 78 // 8 = 9 of 8. The line said "22 iterations of 8 samples"."""
    argv = [*_without(BASE, "--global-batch-size"), "--global-batch-size", "8", "--train-samples", "120",
            "--rampup-batch-size", "2", "2", "40", "--exit-interval", "1"]  # fmt: skip
    _, out = _job(argv, tmp_path / "a.jsonl", capsys, monkeypatch)
    assert "--train-samples 120: 22 iterations (13 ramping up from 2 samples, then 9 of 8 samples)" in out, out
