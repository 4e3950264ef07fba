"""Megatron's --iterations-to-skip: a listed iteration reads its global batch and drops it. Nothing runs: no
forward or backward, no optimizer or learning-rate step (the schedule goes on where it was, as Megatron's
scheduler counts the steps taken), no log line, evaluation, save or exit check at that iteration; the
iteration count and the consumed samples go on, so the next iteration reads the batch after the dropped one.
Iterations are numbered from 1, as logged (Megatron's train() tests iteration + 1 before the step)."""

from __future__ import annotations

from megatron_lite.checkpoint.checkpointing import TrainState


def skip_iteration(iterations_to_skip: tuple[int, ...], state: TrainState, global_batch: int, log) -> bool:
    """True, with the iteration and its batch consumed, where the next iteration is one to skip."""
    if state.iteration + 1 not in iterations_to_skip:
        return False
    state.iteration += 1
    state.consumed_samples += global_batch
    state.skipped_samples += global_batch  # (Megatron's skipped_train_samples: logged once any were dropped)
    # (Megatron says nothing; a line here tells a reader of the log why the iteration has none)
    log.info(f"iteration {state.iteration} skipped (--iterations-to-skip): its {global_batch} samples dropped")
    return True
