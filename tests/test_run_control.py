"""How a run ends, as Megatron's train loop ends it: the save before the final evaluation, an exit by
--exit-interval / --exit-duration-in-mins that saves and goes (its clock counting start-up), an --async-save
in flight published before a halt or a rollback, the loss average over applied steps only, and W&B steps that
survive a rollback's replayed iterations. Single process, in-process runs."""

from __future__ import annotations

import json
import time

import pytest
from test_pretrain_cli import _run

DATA = ["--mock-data", "--vocab-size", "100"]


def _order(out: str, *fragments: str) -> list[int]:
    return [out.index(f) for f in fragments]


def test_the_final_save_comes_before_the_final_evaluation(tmp_path, capsys, monkeypatch):
    """A run that ends normally saves, then evaluates (Megatron's pretrain()); one that ends by --exit-interval
    saves and exits without evaluating (checkpoint_and_decide_exit), so a long evaluation never delays the save."""
    argv = [*DATA, "--train-iters", "4", "--eval-iters", "2", "--eval-interval", "100", "--save-interval", "100"]
    rc, out, err = _run([*argv, "--save", str(tmp_path / "a")], capsys, monkeypatch)
    assert rc == 0, err
    saved, valid, test = _order(
        out,
        "saved ",
        "validation loss at iteration 4 on validation set |",
        "validation loss at iteration 4 on test set |",
    )
    assert saved < valid < test, out
    rc, out, err = _run([*argv, "--save", str(tmp_path / "b"), "--exit-interval", "3"], capsys, monkeypatch)
    assert rc == 0, err
    assert "exiting at iteration 3" in out and "saved " in out and "iter_0000003" in out
    assert "validation loss at" not in out, out


def test_exit_duration_counts_the_start_up(tmp_path, capsys, monkeypatch):
    """--exit-duration-in-mins is measured from the start of the job (Megatron's _TRAIN_START_TIME), not from
    the first iteration: a start-up longer than the limit exits after one iteration (it trained them all)."""
    import megatron_lite.training.datasets as datasets

    real = datasets.build_datasets

    def slow(*a, **kw):
        time.sleep(2.0)
        return real(*a, **kw)

    monkeypatch.setattr(datasets, "build_datasets", slow)
    argv = [*DATA, "--train-iters", "20", "--exit-duration-in-mins", "0.02", "--save", str(tmp_path / "c")]
    rc, out, err = _run(argv, capsys, monkeypatch)
    assert rc == 0, err
    assert "exiting at iteration 1 " in out and "iteration       20/      20 |" not in out, out


def test_an_exit_duration_of_zero_sets_no_limit(tmp_path, capsys, monkeypatch):
    """Megatron tests `if args.exit_duration_in_mins:`, so 0 (launch scripts' default) is off; it exited after
    iteration 1 here, having saved. Negative values, and a negative --exit-interval (which exited at its
    multiples), are refused in one line (a negative --eval-iters is Megatron's "no evaluation": its examples pass
    -1, tests/test_cli_megatron_scripts.py)."""
    from test_pretrain_cli import _one_line_error

    argv = [*DATA, "--train-iters", "3", "--eval-iters", "1", "--exit-duration-in-mins", "0"]
    rc, out, err = _run(argv, capsys, monkeypatch)
    assert rc == 0, err
    assert "exiting at iteration" not in out and "iteration        3/       3 |" in out, out
    for flag, value in (("--exit-duration-in-mins", "-1"), ("--exit-interval", "-2")):
        rc, _, err = _run([*DATA, "--train-iters", "3", flag, value], capsys, monkeypatch)
        _one_line_error(rc, err, f"{flag} {value} must be >= 0")
    # (and a global batch of 0 was "not divisible by" micro-batch x DP, which 0 is)
    rc, _, err = _run([*DATA, "--train-iters", "3", "--global-batch-size", "0"], capsys, monkeypatch)
    _one_line_error(rc, err, "--global-batch-size 0 must be positive")


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_a_seed_numpy_cannot_take_is_refused_at_start_up(tmp_path, capsys, monkeypatch, seed):
    """The dataset's shuffle is numpy's RandomState(seed), as Megatron's: a seed outside 0 .. 2**32 - 1 was a
    numpy traceback on every rank once the process groups were up."""
    from test_pretrain_cli import _dataset, _one_line_error

    data = ["--data-path", _dataset(tmp_path), "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    data += ["--train-iters", "2"]
    rc, _, err = _run([*data, "--seed", seed], capsys, monkeypatch)
    _one_line_error(rc, err, f"--seed {seed} is out of range: give an integer from 0 to 4294967295")
    rc, _, err = _run([*data, "--seed", str(2**32 - 1), "--eval-iters", "1"], capsys, monkeypatch)
    assert rc == 0, err


def test_a_skipped_step_is_not_averaged_into_the_logged_loss(tmp_path, capsys, monkeypatch):
    """--nan-policy skip: the non-finite step's loss stays out of the window's lm_loss (it made the whole
    window's NaN), and is counted as skipped (Megatron's training_log)."""
    monkeypatch.setenv("MEGATRON_LITE_INJECT_FAULT", "nan,rank=0,iteration=2")  # (a NaN gradient)
    losses = {}
    for interval in (1, 3):
        log = tmp_path / f"m{interval}.jsonl"
        argv = [*DATA, "--train-iters", "3", "--nan-policy", "skip", "--log-jsonl", str(log)]
        rc, _, err = _run([*argv, "--log-interval", str(interval)], capsys, monkeypatch)
        assert rc == 0, err
        losses[interval] = [json.loads(line) for line in log.read_text().splitlines()]
    each = [r["lm_loss"] for r in losses[1]]
    window = losses[3][-1]
    assert window["skipped_iterations"] == 1
    assert each[1] is None  # a window of skipped steps logs no loss (it logged NaN; Megatron leaves it out)
    assert window["lm_loss"] == pytest.approx((each[0] + each[2]) / 2, rel=1e-12), (window, each)


@pytest.mark.parametrize("moe", [False, True, "no-aux"], ids=["dense", "moe", "moe-without-aux-losses"])
def test_a_global_batch_without_loss_tokens_steps_with_zero_gradients(tmp_path, capsys, monkeypatch, moe):
    """--eod-mask-loss on documents of end-of-document tokens alone: no label is kept. The step runs with zero
    gradients (Megatron's finalize_model_grads skips the 1/num_tokens scaling; here it divided by zero), says so,
    and logs no loss rather than tripping the NaN check. (An --sft prompt filling the sequence did this once; such
    a prompt now loses its start, not the response.) With MoE the auxiliary losses, which count no label, still
    train the routers, as in Megatron: the message says so (it said zero gradients, from the pipeline review)."""
    from megatron_lite.data.indexed import IndexedDatasetWriter

    prefix = str(tmp_path / "eods")
    w = IndexedDatasetWriter(prefix, vocab_size=101)
    for _ in range(20):
        w.add_document([100] * 40)  # (NullTokenizer --vocab-size 100: EOD is 100)
    w.finalize()
    log = tmp_path / "m.jsonl"
    argv = ["--data-path", prefix, "--eod-mask-loss", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    argv += ["--eval-iters", "0"]
    if moe:  # (without an aux or z coefficient, the default, nothing trains either: the diff review)
        argv += ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]
        argv += ["--moe-aux-loss-coeff", "0.01"] if moe is True else []
    rc, out, err = _run(
        [*argv, "--train-iters", "2", "--log-interval", "1", "--log-jsonl", str(log)], capsys, monkeypatch
    )
    assert rc == 0, err
    rest = "only the MoE auxiliary losses' gradients" if moe is True else "zero gradients"
    assert f"iteration 1: every label of the global batch is masked: no loss, {rest}" in out, out
    records = [json.loads(line) for line in log.read_text().splitlines() if "lm_loss" in line]
    assert len(records) == 2 and all(r["skipped_iterations"] == 0 for r in records), records
    assert all((r["grad_norm"] > 0) if moe is True else (r["grad_norm"] == 0.0) for r in records), records


def _slow_writes(monkeypatch):
    from megatron_lite.checkpoint import checkpointing

    real = checkpointing._write_rank_files

    def slow(*a, **kw):
        time.sleep(0.5)  # a large checkpoint: still being written when the next iterations come
        return real(*a, **kw)

    monkeypatch.setattr(checkpointing, "_write_rank_files", slow)


def test_an_async_save_in_flight_is_published_before_a_halt(tmp_path, capsys, monkeypatch):
    """--nan-policy halt with --async-save: the checkpoint being written is published before the job stops
    (it was abandoned as iter_N.tmp, and the last good checkpoint lost)."""
    from megatron_lite.checkpoint.checkpointing import find_checkpoint

    _slow_writes(monkeypatch)
    monkeypatch.setenv("MEGATRON_LITE_INJECT_FAULT", "nan,rank=0,iteration=3")
    ckpt = str(tmp_path / "ck")
    argv = [*DATA, "--train-iters", "6", "--save", ckpt, "--save-interval", "2", "--async-save"]
    rc, _, err = _run(argv, capsys, monkeypatch)
    assert rc == 3 and "halted" in err, err
    assert find_checkpoint(ckpt).endswith("iter_0000002")


def test_a_rollback_waits_for_the_async_save_it_may_go_back_to(tmp_path, capsys, monkeypatch):
    """--nan-policy rollback with --async-save: the checkpoint still being written is published, then rolled
    back to (the rollback found no checkpoint and halted)."""
    _slow_writes(monkeypatch)
    monkeypatch.setenv("MEGATRON_LITE_INJECT_FAULT", "nan,rank=0,iteration=3")
    ckpt = str(tmp_path / "ck")
    argv = [*DATA, "--train-iters", "4", "--save", ckpt, "--save-interval", "2", "--async-save"]
    rc, out, err = _run([*argv, "--nan-policy", "rollback"], capsys, monkeypatch)
    assert rc == 0, err
    assert "rolled back to" in out and "iter_0000002: iteration 2" in out, out


@pytest.mark.parametrize("own_save", [False, True])
def test_a_rollback_to_the_starting_checkpoint_reads_it_with_the_start_flags(tmp_path, capsys, monkeypatch, own_save):
    """--load BASE --no-load-optim --nan-policy rollback, BASE saved with --no-save-optim: before this job's first
    save the rollback goes back to BASE as the job loaded it (it read BASE's absent optimizer state and failed
    telling the user to add the --no-load-optim they had given; with --save elsewhere it found nothing there and
    halted)."""
    base = str(tmp_path / "base")
    rc, _, err = _run([*DATA, "--train-iters", "2", "--save", base, "--no-save-optim"], capsys, monkeypatch)
    assert rc == 0, err
    monkeypatch.setenv("MEGATRON_LITE_INJECT_FAULT", "nan,rank=0,iteration=4")
    argv = [*DATA, "--train-iters", "5", "--load", base, "--no-load-optim", "--nan-policy", "rollback"]
    if own_save:
        argv += ["--save", str(tmp_path / "own"), "--save-interval", "100"]
    rc, out, err = _run(argv, capsys, monkeypatch)
    assert rc == 0, err
    assert f"rolled back to {base}/iter_0000002: iteration 2" in out, out


def test_a_halted_run_closes_its_logger(tmp_path, capsys, monkeypatch):
    """--nan-policy halt: the run's logger is closed (W&B's run finished, the JSONL closed) before main returns 3,
    as at a normal end; it had been left open, and wandb.finish never called. Under torchrun the halt's line is
    what its summary shows as the root cause (read back by torch elastic's own reader; it said "To enable
    traceback see: ...")."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from megatron_lite.training import logger

    closed = []
    real = logger.MetricsLogger.close
    monkeypatch.setattr(logger.MetricsLogger, "close", lambda self, **kw: (closed.append(kw), real(self, **kw)))
    monkeypatch.setenv("MEGATRON_LITE_INJECT_FAULT", "nan,rank=0,iteration=2")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    log = tmp_path / "m.jsonl"
    rc, _, err = _run([*DATA, "--train-iters", "4", "--log-jsonl", str(log)], capsys, monkeypatch)
    assert rc == 3 and "halted" in err, err
    assert closed == [{"exit_code": 3}] and log.read_text().count("lm_loss") == 1  # (W&B's run: halted, not finished)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=3, error_file=str(tmp_path / "error.json"))
    summary = ChildFailedError("pretrain_gpt.py", {0: failure}).format_msg()
    assert f"traceback : {err.strip()}" in summary.split("Root Cause")[1], summary


def test_wandb_steps_keep_growing_through_a_rollback():
    """A rollback replays iterations W&B has seen: its step keeps growing (W&B drops a step below its last)
    and the iteration goes along as a field; validation at the same iteration shares the training's step. (The
    W&B run is a recorder here: what is checked is the step arithmetic.)"""
    from megatron_lite.training.configs import LoggingConfig
    from megatron_lite.training.logger import MetricsLogger

    class Recorder:
        def __init__(self):
            self.calls = []

        def log(self, data, step):
            self.calls.append((step, data["iteration"]))

    def fresh(every=1):
        logger = MetricsLogger.__new__(MetricsLogger)
        logger.enabled, logger.train_iters = True, 9
        logger.config = LoggingConfig(tensorboard_log_interval=every)
        logger._jsonl = logger._tb = None
        logger._last_iteration = logger._last_train = logger._wandb_step = logger._step_offset = logger._samples = 0
        logger._opened = -1
        logger._wandb = Recorder()
        return logger

    logger = fresh()
    for it in (1, 2, 3, 4, 5, 6, 5, 6, 7):  # rolled back to 4 after 6
        logger.log(it, {"iteration_time": 1.0})
        if it == 6:
            logger.log(it, {"lm_loss": 1.0, "ppl": 2.7}, kind="validation")
    steps = [s for s, _ in logger._wandb.calls]
    assert steps == [1, 2, 3, 4, 5, 6, 6, 7, 8, 8, 9], steps
    assert [i for _, i in logger._wandb.calls] == [1, 2, 3, 4, 5, 6, 6, 5, 6, 6, 7]
    # logging every 2: the replay's first log is the iteration logged last (it had shared its step, and W&B
    # merged the two into one row)
    logger = fresh()
    for it in (2, 4, 4, 6):  # rolled back to 3 after 5
        logger.log(it, {"iteration_time": 1.0})
    assert [s for s, _ in logger._wandb.calls] == [2, 4, 5, 7], logger._wandb.calls
    # each iteration's own values (step(), every --tensorboard-log-interval) open its step; the window's metrics
    # at --log-interval and an evaluation join it; a replayed iteration opens a new one
    logger = fresh()
    for it in (1, 2, 3, 4, 3, 4):  # rolled back to 2 after 4; the window logged every 2
        logger.step(it, {"lm_loss": 1.0, "grad_norm": 2.0})
        if it % 2 == 0:
            logger.log(it, {"lm_loss": 1.0, "grad_norm": 2.0, "iteration_time": 1.0})
            logger.log(it, {"lm_loss": 1.0, "ppl": 2.7}, kind="validation")
    assert logger._wandb.calls == [(1, 1), (2, 2), (2, 2), (2, 2), (3, 3), (4, 4), (4, 4), (4, 4), (5, 3)] + [
        (6, 4),
        (6, 4),
        (6, 4),
    ]
    logger = fresh(every=2)  # --tensorboard-log-interval 2: odd iterations' own values are not written
    for it in (1, 2, 3):
        logger.step(it, {"lm_loss": 1.0})
        logger.log(it, {"lm_loss": 1.0, "iteration_time": 1.0})
    assert logger._wandb.calls == [(1, 1), (2, 2), (2, 2), (3, 3)]


def test_validation_goes_on_where_the_last_evaluation_stopped(tmp_path, capsys, monkeypatch):
    """Megatron's evaluate(): each evaluation reads the next --eval-iters global batches of the validation set
    and a resumed run goes on from the checkpoint's count (consumed_valid_samples); --skip-train and the test
    set start at the beginning. Every evaluation here had read the same first batches."""
    from megatron_lite.training.batches import Batches

    reads = []
    real = Batches.get
    monkeypatch.setattr(Batches, "get", lambda self, n: reads.append((id(self.dataset), n)) or real(self, n))

    def valid_reads(argv):
        reads.clear()
        rc, _, err = _run([*DATA, "--eval-iters", "2", "--eval-interval", "1", "--split", "8,1,1", *argv],
                          capsys, monkeypatch)  # fmt: skip
        assert rc == 0, err
        test = reads[-1][0]  # (the test set is evaluated last; training reads first, unless skipped)
        train = reads[0][0] if "--skip-train" not in argv else None
        assert [n for d, n in reads if d == test] == [0, 4]
        return [n for d, n in reads if d not in (train, test)]

    ckpt = str(tmp_path / "ckpt")  # a global batch is 4 samples
    # (the run's end evaluates again, as Megatron's pretrain(): after the final save, so a resume reads it again)
    assert valid_reads(["--train-iters", "2", "--save", ckpt]) == [0, 4, 8, 12, 16, 20]
    assert valid_reads(["--train-iters", "3", "--load", ckpt]) == [16, 20, 24, 28]
    assert valid_reads(["--train-iters", "3", "--load", ckpt, "--skip-train"]) == [0, 4]


def test_a_rollback_never_goes_to_the_run_this_job_went_back_from(tmp_path, capsys, monkeypatch):
    """A job restarted from iteration 2 of a directory that holds 2, 4 and 6 (--ckpt-step 2) and rolled back at
    iteration 5 before its own first save goes back to 2, where it started: it had loaded the abandoned run's 4."""
    ckpt = str(tmp_path / "ck")
    rc, _, err = _run([*DATA, "--train-iters", "6", "--save", ckpt, "--save-interval", "2"], capsys, monkeypatch)
    assert rc == 0, err
    monkeypatch.setenv("MEGATRON_LITE_INJECT_FAULT", "nan,rank=0,iteration=5")
    argv = [*DATA, "--train-iters", "6", "--load", ckpt, "--save", ckpt, "--ckpt-step", "2", "--save-interval", "10"]
    rc, out, err = _run([*argv, "--nan-policy", "rollback", "--lr", "1e-4"], capsys, monkeypatch)
    assert rc == 0, err
    assert f"rolled back to {ckpt}/iter_0000002: iteration 2" in out, out


def _losses(path) -> dict[int, tuple[float, float]]:
    records = [json.loads(line) for line in open(path)]
    return {r["iteration"]: (r["lm_loss"], r["lr"]) for r in records if "lm_loss" in r and "validation" not in r}


def test_a_restart_resumes_its_own_optimizer_state_whatever_the_start_flags(tmp_path, capsys, monkeypatch):
    """Megatron's fine-tuning launch, --load BASE --no-load-optim --no-load-rng --save OUT, restarted (here: ended
    by --exit-interval and launched again with the same flags): the restart resumes OUT with its optimizer state,
    LR schedule and RNG, and goes on as the uninterrupted job (its warmup started over, the loss diverged)."""
    base = str(tmp_path / "base")
    warm = ["--lr", "1e-2", "--lr-warmup-iters", "4", "--lr-decay-style", "constant", "--hidden-dropout", "0.1"]
    rc, _, err = _run([*DATA, *warm, "--train-iters", "5", "--save", base], capsys, monkeypatch)  # (warmup < decay)
    assert rc == 0, err
    tune = [
        *DATA,
        *warm,
        "--train-iters",
        "8",
        "--load",
        base,
        "--no-load-optim",
        "--no-load-rng",
        "--save-interval",
        "2",
    ]
    rc, _, err = _run([*tune, "--save", str(tmp_path / "ref"), "--log-jsonl", str(tmp_path / "ref.jsonl")],
                      capsys, monkeypatch)  # fmt: skip
    assert rc == 0, err
    out = ["--save", str(tmp_path / "out"), "--log-jsonl", str(tmp_path / "out.jsonl")]
    rc, _, err = _run([*tune, *out, "--exit-interval", "6"], capsys, monkeypatch)
    assert rc == 0, err
    # a restart with a flag that changes the math of its own checkpoint's model is refused, as with --load (from the
    # validation review: the resume from --save read the flags against --load's checkpoint or none, and trained a
    # changed --rotary-base, --norm-epsilon or --window-size silently)
    rc, _, err = _run([*tune, *out, "--norm-epsilon", "1e-2"], capsys, monkeypatch)
    assert rc == 2 and f"--norm-epsilon 0.01 conflicts with the checkpoint in {tmp_path / 'out'}" in err, err
    rc, text, err = _run([*tune, *out], capsys, monkeypatch)
    assert rc == 0 and "resuming from it instead of --load" in text, err
    ref, got = _losses(tmp_path / "ref.jsonl"), _losses(tmp_path / "out.jsonl")
    for it in (7, 8):
        assert got[it][1] == ref[it][1] and got[it][0] == pytest.approx(ref[it][0], rel=1e-6, abs=0), (it, got, ref)


def test_a_save_directory_without_a_tracker_file_is_resumed_or_started(tmp_path, capsys, monkeypatch):
    """--save OUT holding the run's own logs but no checkpoint yet (a worker killed before the first save) starts
    from scratch, with --load OUT too (Megatron's --load X --save X); one killed between publishing its first
    checkpoint and writing the tracker file resumes that checkpoint. Every restart had stopped with 'not a
    megatron_lite checkpoint directory'. A --load that is not the job's own directory is still refused."""
    import shutil

    from megatron_lite.checkpoint.format import TRACKER

    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    for load in ([], ["--load", str(out)], ["--load", f"{out}/"]):  # (the same directory, however written)
        rc, text, err = _run([*DATA, "--train-iters", "1", "--save", str(out), "--save-interval", "100", *load,
                              "--exit-interval", "1"], capsys, monkeypatch)  # fmt: skip
        assert rc == 0 and "loaded" not in text, err
        (out / TRACKER).unlink()  # (killed before it was written)
        rc, text, err = _run([*DATA, "--train-iters", "2", "--save", str(out), *load], capsys, monkeypatch)
        assert rc == 0 and f"loaded {out}/iter_0000001: iteration 1" in text, err
        for p in out.iterdir():
            if p.name != "metrics.jsonl":
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    rc, _, err = _run([*DATA, "--load", str(out), "--save", str(tmp_path / "elsewhere")], capsys, monkeypatch)
    assert rc == 2 and "is not a megatron_lite checkpoint directory" in err, err


def test_iterations_past_seven_digits_are_found(tmp_path):
    """iter_10000000 (iteration_dir pads to 7 digits, no more) counts for --ckpt-keep-last and rollbacks."""
    import os

    from megatron_lite.checkpoint.format import complete_iterations, iteration_dir

    for it in (9_999_999, 10_000_000):
        os.makedirs(iteration_dir(str(tmp_path), it))
        open(os.path.join(iteration_dir(str(tmp_path), it), "metadata.json"), "w").close()
    assert complete_iterations(str(tmp_path)) == [9_999_999, 10_000_000]


def test_a_signal_during_start_up_saves_at_the_first_iteration(tmp_path, capsys, monkeypatch):
    """--exit-signal-handler is installed at start-up, as Megatron's initialize installs it: SIGTERM while the
    checkpoint loads is kept, and the job saves after its first iteration and exits 0 (the default action killed
    it). The handler is put back when the run ends (an in-process caller's SIGTERM had been swallowed since)."""
    import os
    import signal

    import megatron_lite.training.pretrain as pretrain

    ckpt = str(tmp_path / "ck")
    rc, _, err = _run([*DATA, "--train-iters", "2", "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    real = pretrain.load_checkpoint

    def load_and_signal(*a, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **kw)

    monkeypatch.setattr(pretrain, "load_checkpoint", load_and_signal)
    caught = []  # (the caller's handler: a signal the job misses lands here instead of killing pytest)
    before = signal.signal(signal.SIGTERM, lambda *a: caught.append(a[0]))
    try:
        rc, out, err = _run([*DATA, "--train-iters", "6", "--load", ckpt, "--save", ckpt, "--exit-signal-handler"],
                            capsys, monkeypatch)  # fmt: skip
        assert rc == 0 and "SIGTERM received: saving at iteration 3 and exiting" in out and not caught, err
        os.kill(os.getpid(), signal.SIGTERM)  # after the run, the caller's handler again
        assert caught == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("start", ["no_load_optim", "saved_without_state"])
def test_a_rollback_to_a_start_loaded_without_optimizer_state_replays_the_first_pass(
    tmp_path, capsys, monkeypatch, start
):
    """--load CKPT --no-load-optim, or a CKPT at iteration 0 that holds no optimizer state (as a conversion writes
    them), and a rollback before the job's own first save: the replayed iterations equal the first pass (fresh
    Adam moments, LR schedule and loss scale, as at the start); the rollback had kept the moments and schedule
    of the pass it went back from (lr 3e-3 where the first pass ran at 0)."""
    ckpt, log = str(tmp_path / "ck"), tmp_path / "m.jsonl"
    flags = [*DATA, "--lr", "3e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--hidden-dropout", "0",
             "--attention-dropout", "0"]  # fmt: skip
    at = 3 if start == "no_load_optim" else 0
    rc, _, err = _run([*flags, "--train-iters", str(at or 3), "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    if at == 0:  # its weights as a weights-only checkpoint at iteration 0 (what the conversion writes)
        from megatron_lite.checkpoint.hf_convert import read_model_tensors, write_model_checkpoint

        meta, tensors = read_model_tensors(ckpt)
        ckpt = str(tmp_path / "weights")
        write_model_checkpoint(ckpt, tensors, meta["config"], {})
    monkeypatch.setenv("MEGATRON_LITE_INJECT_FAULT", f"nan,rank=0,iteration={at + 3}")
    loaded = ["--no-load-optim"] if at else []
    rc, out, err = _run([*flags, "--train-iters", str(at + 3), "--load", ckpt, *loaded, "--nan-policy", "rollback",
                         "--log-jsonl", str(log)], capsys, monkeypatch)  # fmt: skip
    assert rc == 0 and f"rolled back to {ckpt}/iter_{at:07d}" in out, out + err
    rows = [json.loads(line) for line in open(log)]
    rows = [
        (r["iteration"], r["lm_loss"], r["grad_norm"], r["lr"])
        for r in rows
        if "lm_loss" in r and "validation" not in r
    ]
    first, replay = rows[:2], [r for r in rows if r[0] in (at + 1, at + 2)][2:]
    assert [r[0] for r in first] == [at + 1, at + 2] and len(replay) == 2, rows
    for a, b in zip(first, replay):
        assert a[3] == b[3] and a[1:3] == pytest.approx(b[1:3], rel=1e-6), (a, b)


def test_a_resume_may_change_the_data_source(tmp_path, capsys, monkeypatch):
    """From the validation review: a checkpoint's data source was a default of the resumed run, so --mock-data (no
    off switch) and --data-path were both set and refused as exclusive, naming a flag the user never gave. A data
    source given replaces the checkpoint's."""
    from megatron_lite.data.indexed import IndexedDatasetWriter

    prefix = str(tmp_path / "docs")
    w = IndexedDatasetWriter(prefix, vocab_size=101)
    for i in range(40):
        w.add_document([(7 * i + j) % 100 for j in range(30)] + [100])
    w.finalize()
    data = ["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    ckpt = str(tmp_path / "ck")
    rc, _, err = _run([*DATA, "--train-iters", "2", "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    rc, out, err = _run(["--load", ckpt, "--train-iters", "4", *data], capsys, monkeypatch)
    assert rc == 0 and "done: iteration 4" in out, err
    rc, _, err = _run([*data, "--train-iters", "2", "--save", str(tmp_path / "ck2")], capsys, monkeypatch)
    assert rc == 0, err
    rc, out, err = _run(["--load", str(tmp_path / "ck2"), "--train-iters", "4", *DATA], capsys, monkeypatch)
    assert rc == 0 and "done: iteration 4" in out, err
    # a split's own path given replaces that split's alone (the diff review: it dropped the training path too)
    splits = ["--train-data-path", prefix, "--valid-data-path", prefix, "--tokenizer-type", "NullTokenizer"]
    rc, _, err = _run([*splits, "--vocab-size", "100", "--train-iters", "2", "--save", str(tmp_path / "ck3")],
                      capsys, monkeypatch)  # fmt: skip
    assert rc == 0, err
    resume = ["--load", str(tmp_path / "ck3"), "--train-iters", "4", "--valid-data-path", prefix]
    rc, out, err = _run(resume, capsys, monkeypatch)
    assert rc == 0 and "done: iteration 4" in out, err


@pytest.mark.parametrize("async_save", [False, True])
def test_save_retain_interval_keeps_the_multiples_and_the_newest(tmp_path, capsys, monkeypatch, async_save):
    """Megatron's --save-retain-interval (it stopped the job as not implemented): each save deletes the checkpoint
    the tracker named before it unless that one's iteration is a multiple of the interval (checkpointing.py,
    iter_finalize_fn). Saving every iteration with interval 2: 2, 4 and the newest stay; a resume goes on."""
    from megatron_lite.checkpoint.format import complete_iterations

    save = str(tmp_path / "ck")
    flags = [*DATA, "--save", save, "--save-interval", "1", "--save-retain-interval", "2"]
    flags += ["--async-save"] if async_save else []
    rc, out, err = _run([*flags, "--train-iters", "5"], capsys, monkeypatch)
    assert rc == 0, err
    assert complete_iterations(save) == [2, 4, 5]
    rc, out, err = _run([*flags, "--train-iters", "7", "--load", save], capsys, monkeypatch)
    assert rc == 0, err
    assert complete_iterations(save) == [2, 4, 6, 7]  # (5 went when 6 was saved; 6 is a multiple)
    rc, out, err = _run([*flags, "--train-iters", "8", "--ckpt-keep-last", "2"], capsys, monkeypatch)
    assert rc == 2 and "--save-retain-interval 2 and --ckpt-keep-last 2 would each delete what the other keeps" in err
    # (as Megatron asserts: an exploratory port saving every 2 and retaining every 3 kept only the last two)
    rc, out, err = _run([*DATA, "--save", save, "--save-interval", "2", "--save-retain-interval", "3"], capsys,
                        monkeypatch)  # fmt: skip
    assert rc == 2 and "--save-retain-interval 3 is not a multiple of --save-interval 2" in err, err
