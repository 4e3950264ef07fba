"""The run's train, validation and test datasets: sized as Megatron sizes them (get_train_valid_test_num_samples),
the validation split past that where a resumed run's evaluations read more, and what they lack said."""

from __future__ import annotations

from collections.abc import Callable

from megatron_lite.checkpoint.checkpointing import TrainState
from megatron_lite.config import ConfigError
from megatron_lite.data.builder import build_datasets
from megatron_lite.training.configs import JobConfig


def run_datasets(
    source, job: JobConfig, dp: int, state: TrainState, log, data_log: Callable[[str], None], skips=()
) -> tuple:
    """(train, validation, test, whether the run evaluates: Megatron's do_valid); a split with no samples asked
    for, or none to give, is None. `state`: where the run starts (a resume's validation reads so far); `skips`:
    the batches earlier rollbacks of the job skipped (training/resume.py recorded_skips)."""
    t = job.training
    gbs = t.global_batch(dp)
    # (Megatron's get_train_valid_test_num_samples: one evaluation's batches under --skip-train)
    evals = t.eval_iters if t.skip_train else (t.train_iters // t.eval_interval + 1) * t.eval_iters
    valid_n = evals * gbs
    if not t.skip_train and state.consumed_valid_samples:
        # A resume whose --eval-iters or --eval-interval differ from the checkpoint's can need more than that:
        # Megatron's sampler then asserts at an evaluation, and reading on from the split's first samples
        # would repeat them unsaid. The evaluations left: each interval's past this iteration, and the last.
        ahead = (t.train_iters // t.eval_interval - state.iteration // t.eval_interval + 1) * t.eval_iters * gbs
        if state.consumed_valid_samples + ahead > valid_n:
            valid_n = state.consumed_valid_samples + ahead
            log.info(
                f"the validation split is sized for the checkpoint's {state.consumed_valid_samples} samples read "
                f"and the {ahead} ahead ({valid_n}), not for --eval-iters {t.eval_iters} x the evaluations "
                f"of --train-iters {t.train_iters} ({evals * gbs}): the checkpoint's evaluations read more"
            )
    # (--train-samples asks for that many, as Megatron: a ramped-up run's train_iters x the final batch asked
    # for more, and a split's epochs, hence its sample order, depend on the count asked for)
    train_n = t.train_samples if t.train_samples is not None else t.train_iters * gbs
    notes: list[str] = []
    train_ds, valid_ds, test_ds = build_datasets(
        source, job.data, (train_n, valid_n, t.eval_iters * gbs), t.seq_length, t.seed, data_log, notes
    )
    for note in notes:
        log.info(note)
    prompts, responses = getattr(train_ds, "cut", (0, 0))
    if prompts or responses:
        log.info(
            f"--sft: {prompts} of the train split's {train_ds.num_records} records longer than --seq-length "
            f"{t.seq_length} + 1 lost the start of their prompt; {responses} (a response alone too long, or a "
            "messages conversation, cut on the right) lost the end of theirs"
        )
    untrained = getattr(train_ds, "untrained", 0)
    if untrained:  # (their samples carry no loss at all: a batch of them logs no lm loss)
        log.info(
            f"--sft: {untrained} of the train split's {train_ds.num_records} conversations have no assistant "
            f"reply within --seq-length {t.seq_length} + 1 tokens, so their samples train nothing: raise --seq-length"
        )
    if train_ds is None and not t.skip_train:  # (every rank finds the same: none waits in a collective)
        raise ConfigError(
            f"the train split holds no documents (--split {job.data.split} of --data-path, or "
            "--train-data-path): give it some, or --skip-train to evaluate only"
        )
    _check_resumed_reads(train_ds, t, gbs, state, train_n, len(skips))
    validates = t.eval_iters > 0 or job.data.full_validation  # (Megatron's do_valid)
    if validates:  # (evaluation was skipped without a word)
        # (the test set is read --eval-iters batches: none with --full-validation --eval-iters 0, as Megatron)
        for ds, name, flag in [(valid_ds, "validation", "--valid-data-path")] + (
            [(test_ds, "test", "--test-data-path")] if t.eval_iters > 0 else []
        ):
            if ds is None:
                # (--split cuts --data-path's datasets and the embedded corpus; per-split paths are whole)
                given = f"no {flag}" if job.data.train_data_path else f"--split {job.data.split}"
                what = "records" if job.data.sft else "documents"
                log.info(f"no {name} evaluation: the {name} split holds no {what} ({given})")
    return train_ds, valid_ds, test_ds, validates


def _check_resumed_reads(train_ds, t, gbs: int, state: TrainState, train_n: int, skips: int) -> None:
    """A resume with a smaller global batch than the checkpoint's (a relaunch on fewer data-parallel ranks, say)
    reads past a split sized for this run's batch (a weighted blend is exactly that long), and the loop read the
    split's first samples again without a word. Megatron's sampler asserts there (no samples left to consume);
    here it is a start-up line. (A ramp's batch varies: not checked.)"""
    if t.skip_train or train_ds is None or t.rampup_batch_size is not None or not state.consumed_samples:
        return
    # a rollback's skipped batches (rollback_skips.json in --save: those before the checkpoint, counted in its
    # samples, and those after, skipped again) read past the split's end on purpose (training/batches.py)
    need = state.consumed_samples + max(0, t.train_iters - state.iteration) * gbs
    if need - skips * gbs <= len(train_ds):
        return
    read = state.consumed_samples
    even = state.iteration and read % state.iteration == 0 and not skips
    was = f" ({read // state.iteration} a step)" if even else ""
    raise ConfigError(
        f"--load: the checkpoint read {read} training samples in {state.iteration} iterations{was}, and the "
        f"{t.train_iters - state.iteration} left at --global-batch-size {gbs} read up to sample {need}, past the "
        f"{len(train_ds)} this run's train split holds (sized for {train_n}: --train-iters x --global-batch-size, "
        "or --train-samples), which would read its first samples again: resume with the checkpoint's global "
        "batch size"
    )
