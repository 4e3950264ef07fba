"""--log-straggler: every log interval, each rank's mean step time and compute time (the step less the time
it spent blocked in communication) gathered on every rank: min, median, max and the slowest rank. A slow
rank shows as the one with the longest compute time; the others wait for it inside collectives, so their
step times all look alike. The slowest rank's compute is compared with the other ranks of its pipeline stage
(ranks of different stages hold different layers, and an uneven split is not a straggler), itself left out of
the median (with two ranks it was half the median: no slowdown could show above 2x); the slowest rank is the one
furthest above its peers."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist


def straggler_report(step_seconds: float, compute_seconds: float, device: torch.device, stage: int = 0) -> dict:
    """`stage`: this rank's pipeline stage."""
    mine = torch.tensor([step_seconds, compute_seconds, stage], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
    else:
        every = [mine]
    steps = [float(t[0]) for t in every]
    computes = [float(t[1]) for t in every]
    stages = [int(t[2]) for t in every]

    def slowdown(r: int) -> tuple[float, bool]:
        """Rank r's compute over the median of its stage's other ranks (the other ranks', one rank a stage)."""
        peers = [c for q, c in enumerate(computes) if q != r and stages[q] == stages[r]]
        same = bool(peers)
        peers = peers or [c for q, c in enumerate(computes) if q != r] or [computes[r]]
        return computes[r] / max(statistics.median(peers), 1e-12), same

    # the slowest is the rank furthest above its peers (a straggler in a lighter stage can be faster, in seconds,
    # than the heavier stage's healthy ranks); within a stage that is its slowest rank, so one candidate a stage
    # (not every rank: a median per rank was quadratic in the world size)
    candidates = {}
    for r, c in enumerate(computes):
        if stages[r] not in candidates or c > computes[candidates[stages[r]]]:
            candidates[stages[r]] = r
    slowest = max(candidates.values(), key=lambda r: slowdown(r)[0])
    ratio, same_stage = slowdown(slowest)
    return {
        "straggler_step_min": min(steps),
        "straggler_step_median": statistics.median(steps),
        "straggler_step_max": max(steps),
        "straggler_compute_min": min(computes),
        "straggler_compute_median": statistics.median(computes),
        "straggler_compute_max": max(computes),
        "straggler_slowest_rank": slowest,
        "straggler_slowdown": ratio,
        "straggler_peers": "its pipeline stage's" if same_stage else "the",  # (for describe; not a metric)
    }


def describe(report: dict) -> str:
    r = report
    return (
        f"stragglers: compute per step min {r['straggler_compute_min']:.3f} / median "
        f"{r['straggler_compute_median']:.3f} / max {r['straggler_compute_max']:.3f} s, slowest rank "
        f"{r['straggler_slowest_rank']} ({r['straggler_slowdown']:.2f}x the median of {r['straggler_peers']} other "
        "ranks); step time "
        f"{r['straggler_step_min']:.3f} - {r['straggler_step_max']:.3f} s"
    )
