"""A resumed run's schedule against its checkpoint's: Megatron's OptimizerParamScheduler stops on a changed
schedule unless --override-opt_param-scheduler (the flags' then) or --use-checkpoint-opt_param-scheduler (the
checkpoint's); here the flags win with a note saying what changed, lengths compared in samples as the
scheduler's state keeps them."""

from __future__ import annotations

import argparse
import math
import os

from megatron_lite.optimizer.lr_scheduler import schedule_lengths

# The run's length and schedule lengths in each unit: a length given in the other unit replaces these.
RUN_LENGTH = {
    "iters": ("train_iters", "lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters"),
    "samples": ("train_samples", "lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples"),
}

# The flags that set the schedule's lengths: on resume compared by the lengths in samples they give (_length_notes),
# since another unit or a --lr-warmup-fraction can give the same length by other values
LENGTH_DESTS = (
    "lr_decay_iters",
    "lr_decay_samples",
    "lr_warmup_iters",
    "lr_warmup_samples",
    "lr_warmup_fraction",
    "lr_wsd_decay_iters",
    "lr_wsd_decay_samples",
)

# The schedule a checkpoint's scheduler state continues (Megatron's OptimizerParamScheduler values): on resume,
# given flags that differ from the checkpoint's win (with a note), or not with --use-checkpoint-opt_param-scheduler.
SCHEDULE_DESTS = (
    "lr",
    "min_lr",
    "lr_decay_style",
    "lr_decay_iters",
    "lr_decay_samples",
    "lr_warmup_iters",
    "lr_warmup_samples",
    "lr_warmup_fraction",
    "lr_warmup_init",
    "lr_wsd_decay_style",
    "lr_wsd_decay_iters",
    "lr_wsd_decay_samples",
    "decoupled_lr",
    "decoupled_min_lr",
    "weight_decay",
    "start_weight_decay",
    "end_weight_decay",
    "weight_decay_incr_style",
)


# Those --use-checkpoint-opt_param-scheduler takes from the checkpoint: Megatron's OptimizerParamScheduler restores its
# lr, min lr, warmup and decay lengths, decay style and weight decay; the WSD decay and the warmup's starting lr
# (--lr-warmup-init) are the flags' there too (a resume with another --lr-wsd-decay-iters kept the checkpoint's)
CHECKPOINT_SCHEDULE_DESTS = tuple(d for d in SCHEDULE_DESTS if not d.startswith(("lr_wsd_", "lr_warmup_init")))


def schedule_notes(
    ns: argparse.Namespace,
    saved: dict,
    given: set[str],
    full: dict,
    scheduler: dict | None,
    resumed: bool = False,
) -> list[str]:
    """Reconcile the schedule flags given on resume with the checkpoint's (`full`: all its values, `saved`: those this
    run takes as defaults, `scheduler` its schedule state); returns the notes to log. Nothing to reconcile where no
    schedule state is loaded (--finetune, --no-load-optim, or a checkpoint that holds none, as a conversion's): the
    flags are the schedule (the notes had compared them with a conversion's placeholder values). A job `resumed`
    from its own --save loads its schedule whatever those flags say (they were for its starting checkpoint), unless
    it saved none (--no-save-optim)."""
    # (a first upcycling run starts a fresh optimizer and schedule, as Megatron's loads neither from the dense
    # checkpoint: its schedule had been taken back and said as kept, an exploratory run found)
    fresh = ns.no_save_optim if resumed else ns.finetune or ns.no_load_optim or ns.moe_use_upcycling
    if scheduler is None or fresh:
        return []
    lengths = scheduler.get("lengths")  # (in samples; older checkpoints' state holds none)
    changed = [d for d in SCHEDULE_DESTS if d in given and d in saved and getattr(ns, d) != saved[d]]
    old_gbs, gbs = full.get("global_batch_size"), ns.global_batch_size
    new_batch = None not in (old_gbs, gbs) and gbs != old_gbs
    if ns.use_checkpoint_opt_param_scheduler:
        changed = [d for d in changed if d in CHECKPOINT_SCHEDULE_DESTS]
        for d in changed:
            setattr(ns, d, saved[d])
        _keep_decay_length(ns, full)
        # (the scheduler's state holds the lengths in samples: LRScheduler's keep_saved_lengths; a checkpoint saved
        # before they were counts its iteration lengths in the new batches)
        lost = new_batch and lengths is None and ns.train_samples is None
        kept = changed + (
            [f"warmup and decay lengths in samples (batches of {old_gbs})"] if new_batch and not lost else []
        )
        notes = [f"--use-checkpoint-opt_param-scheduler: the checkpoint's {', '.join(kept)} kept"] if kept else []
        if lost:
            notes.append(
                f"--global-batch-size {gbs} differs from the checkpoint's {old_gbs}, which predates schedule lengths "
                f"in samples: its iteration lengths now count batches of {gbs}"
            )
        return notes
    if ns.override_opt_param_scheduler:
        return []
    # (the lengths in samples the flags give, against the state's: comparable once the global batch is known)
    batch = global_batch(ns)
    by_length = lengths is not None and (ns.train_samples is not None or batch[0] is not None)
    if by_length:
        changed = [d for d in changed if d not in LENGTH_DESTS]
    notes = [
        f"--{d.replace('_', '-')} {getattr(ns, d)} differs from the checkpoint's {saved[d]}: the schedule follows "
        "the flag (Megatron stops unless --override-opt_param-scheduler; --use-checkpoint-opt_param-scheduler keeps "
        "the checkpoint's)"
        for d in changed
    ]
    notes += _length_notes(ns, lengths, batch) if by_length else _run_length_note(ns, full)
    if new_batch and ns.train_samples is None:  # the position is in samples: the lengths move under it
        notes.append(
            f"--global-batch-size {gbs} differs from the checkpoint's {old_gbs}: the schedule's iteration lengths "
            f"now count batches of {gbs}, from the samples consumed so far (--use-checkpoint-opt_param-scheduler "
            "keeps the checkpoint's lengths in samples)"
        )
    return notes


def _length_notes(ns: argparse.Namespace, saved: dict, batch: tuple[int | None, str]) -> list[str]:
    """The schedule's lengths in samples that differ from those of the checkpoint's scheduler state (`saved`),
    each with the flags that give it: a changed run length moves the decay and weight-decay ramp's end, a resume
    in the other unit or with another global batch can change a warmup (Megatron stops on any of these).
    `batch`: the run's global batch and how to say it (global_batch)."""
    samples = ns.train_samples is not None
    gbs, said_gbs = batch
    unit, per = ("samples", "") if samples else ("iters", f" x {said_gbs}")
    now = schedule_lengths(ns, ns.train_iters, ns.train_samples, gbs)
    run = f"--train-{unit} {getattr(ns, f'train_{unit}')}{per}"
    decay = getattr(ns, f"lr_decay_{unit}")
    how = {
        "warmup": f"--lr-warmup-fraction {ns.lr_warmup_fraction:g} of the decay"
        if ns.lr_warmup_fraction is not None
        else f"--lr-warmup-{unit} {getattr(ns, f'lr_warmup_{unit}')}{per}",
        "decay": f"--lr-decay-{unit} {decay}{per}" if decay else run,
        "wsd": f"--lr-wsd-decay-{unit} {getattr(ns, f'lr_wsd_decay_{unit}')}{per}",
        "weight_decay": run,
    }
    names = {"warmup": "LR warmup", "decay": "LR decay", "wsd": "WSD decay", "weight_decay": "weight-decay ramp"}
    live = ["warmup"] + ["decay"] * (ns.lr_decay_style != "constant") + ["wsd"] * (ns.lr_decay_style == "WSD")
    live += ["weight_decay"] * (ns.weight_decay_incr_style != "constant")
    differ = [k for k in live if not math.isclose(now[k] or 0, saved.get(k) or 0, rel_tol=1e-9, abs_tol=1e-9)]
    if not differ:
        return []
    said = "; ".join(
        f"the {names[k]} {now[k] or 0:g} ({how[k]}; the checkpoint's {saved.get(k) or 0:g})" for k in differ
    )
    return [
        f"the schedule's lengths in samples differ from the checkpoint's: {said}: the schedule follows the flags, so "
        "it moves on from where the checkpoint left it (Megatron stops on a changed warmup, decay or weight-decay "
        "length unless --override-opt_param-scheduler; --use-checkpoint-opt_param-scheduler keeps the checkpoint's)"
    ]


def global_batch(ns: argparse.Namespace) -> tuple[int | None, str]:
    """The run's global batch and how to say it: --global-batch-size, else Megatron's --micro-batch-size x the
    data-parallel size this world gives (None where the layout does not divide it: validation says so later)."""
    if ns.global_batch_size is not None:
        return ns.global_batch_size, f"--global-batch-size {ns.global_batch_size}"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = ns.tensor_model_parallel_size * ns.pipeline_model_parallel_size * ns.context_parallel_size
    if world % model:
        return None, ""
    dp = world // model
    return (
        ns.micro_batch_size * dp,
        f"the global batch {ns.micro_batch_size * dp} (--micro-batch-size x data-parallel size {dp})",
    )


def in_other_unit(saved: dict, unit: str, old_gbs: int | None, new_gbs: int | None) -> dict:
    """The checkpoint's schedule lengths in `unit`, the other unit than its own (a resume that gives its run's
    length in that unit): iterations of its global batch become samples; samples become iterations of this run's
    global batch where they are whole ones (else left out: the length note says what changed)."""
    out = {}
    for theirs, mine in zip(RUN_LENGTH["samples" if unit == "iters" else "iters"][1:], RUN_LENGTH[unit][1:]):
        value = saved.get(theirs)
        if not value:
            continue
        if unit == "samples" and old_gbs:
            out[mine] = value * old_gbs
        elif unit == "iters" and new_gbs and value % new_gbs == 0:
            out[mine] = value // new_gbs
    return out


def _run_length_note(ns: argparse.Namespace, full: dict) -> list[str]:
    """A decay with no length of its own runs over the run: a new --train-iters / --train-samples moves its end,
    and the LR jumps from where the checkpoint left it (Megatron stops on the changed total)."""
    unit = "samples" if ns.train_samples is not None else "iters"
    now, was = getattr(ns, f"train_{unit}"), full.get(f"train_{unit}")
    if ns.lr_decay_style == "constant" or getattr(ns, f"lr_decay_{unit}") is not None or was in (None, now):
        return []
    return [
        f"--train-{unit} {now} differs from the checkpoint's {was} and the LR decay, given no --lr-decay-{unit}, "
        f"runs over the run: it now ends at {now}, so the LR moves from where the checkpoint left it (Megatron "
        "stops unless --override-opt_param-scheduler; --use-checkpoint-opt_param-scheduler keeps the checkpoint's "
        "decay)"
    ]


def _keep_decay_length(ns: argparse.Namespace, full: dict) -> None:
    """--use-checkpoint-opt_param-scheduler: the decay runs over the checkpoint's length (its --lr-decay-iters or
    -samples, else the run length it was saved with), whatever length this run is given, in this run's unit."""
    by_samples = full.get("lr_decay_samples") or full.get("train_samples")
    by_iters = full.get("lr_decay_iters") or full.get("train_iters")
    if ns.train_samples is not None:
        old_gbs = full.get("global_batch_size") or global_batch(ns)[0]  # (a checkpoint with no layout recorded)
        if by_samples is None and by_iters and old_gbs:
            by_samples = by_iters * old_gbs
        ns.lr_decay_samples = by_samples or ns.lr_decay_samples
    elif by_iters is not None or by_samples is None:
        ns.lr_decay_iters = by_iters or ns.lr_decay_iters
    else:  # a sample-based checkpoint continued by iterations: its length in whole batches
        ns.lr_decay_iters = max(1, round(by_samples / (ns.global_batch_size or global_batch(ns)[0] or 1)))
