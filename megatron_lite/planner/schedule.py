"""A rank's pipeline schedule (pipeline_parallel/schedules.py's compute order) as the few numbers the planner prices
it by, each cached per schedule: a search prices tens of thousands of layouts on a handful of schedules."""

from __future__ import annotations

import functools

from megatron_lite.pipeline_parallel.schedules import BACKWARD, FORWARD, compute_order


@functools.lru_cache(maxsize=4096)
def cached_compute_order(pp: int, vp: int, micro: int, rank: int, group: int | None = None) -> tuple:
    return tuple(compute_order(pp, vp, micro, rank, group=group))


@functools.lru_cache(maxsize=4096)
def forward_states(pp: int, vp: int, micro: int, rank: int, group: int | None) -> tuple[tuple[tuple, tuple], ...]:
    """The distinct states of a rank's schedule just after each forward: per model chunk, the micro-batches whose
    activations it holds (forwards less backwards) and whether it holds a received input past its backward (one
    backward of the chunk has run). What a chunk holds is linear in those, so the peak over the schedule is the
    largest over these few states (walking the schedule for each layout was a fifth of a search's time)."""
    held, past = [0] * vp, [False] * vp
    states = set()
    for kind, _, c in cached_compute_order(pp, vp, micro, rank, group):
        if kind == FORWARD:
            held[c] += 1
            states.add((tuple(held), tuple(past)))
        elif kind == BACKWARD:
            held[c] -= 1
            past[c] = True
    return tuple(states)


@functools.lru_cache(maxsize=4096)
def schedule_marks(pp: int, vp: int, micro: int, group: int | None) -> tuple[tuple, tuple, tuple[int, int]]:
    """Pipeline rank 0's schedule (it starts first and finishes last) as counts of (forwards, backwards): run before
    each chunk's last backward starts, run by the end of each chunk's first forward (in the order they occur),
    and in all. A step's times are linear in them (walking the schedule for each layout was a tenth of a search's
    time)."""
    nf = nb = 0
    last_backward, first_forward = {}, {}
    for kind, _, c in cached_compute_order(pp, vp, micro, 0, group):
        if kind == FORWARD:
            nf += 1
            first_forward.setdefault(c, (nf, nb))
        else:
            last_backward[c] = (nf, nb)  # (the last one wins)
            nb += 1
    return tuple(last_backward.values()), tuple(first_forward.values()), (nf, nb)
