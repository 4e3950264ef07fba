"""--log-straggler: every log interval, each rank's mean step time and compute time (the step less the time
it spent blocked in communication) gathered on every rank: min, median, max and the slowest rank. A slow
rank shows as the one with the longest compute time; the others wait for it inside collectives, so their
step times all look alike. The slowest rank's compute is compared with the other ranks of its pipeline stage
(ranks of different stages hold different layers, and an uneven split is not a straggler), itself left out of
the median (with two ranks it was half the median: no slowdown could show above 2x)."""

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
    slowest = max(range(len(computes)), key=computes.__getitem__)
    peers = [c for r, c in enumerate(computes) if r != slowest and stages[r] == stages[slowest]]
    if not peers:  # (one rank a stage: the other ranks, whatever they hold)
        peers = [c for r, c in enumerate(computes) if r != slowest] or [computes[slowest]]
    return {
        "straggler_step_min": min(steps),
        "straggler_step_median": statistics.median(steps),
        "straggler_step_max": max(steps),
        "straggler_compute_min": min(computes),
        "straggler_compute_median": statistics.median(computes),
        "straggler_compute_max": max(computes),
        "straggler_slowest_rank": slowest,
        "straggler_slowdown": computes[slowest] / max(statistics.median(peers), 1e-12),
        "straggler_same_stage": any(r != slowest and stages[r] == stages[slowest] for r in range(len(stages))),
    }


def describe(report: dict) -> str:
    r = report
    return (
        f"stragglers: compute per step min {r['straggler_compute_min']:.3f} / median "
        f"{r['straggler_compute_median']:.3f} / max {r['straggler_compute_max']:.3f} s, slowest rank "
        f"{r['straggler_slowest_rank']} ({r['straggler_slowdown']:.2f}x the median of the other ranks"
        f"{' of its pipeline stage' if r['straggler_same_stage'] else ''}); step time "
        f"{r['straggler_step_min']:.3f} - {r['straggler_step_max']:.3f} s"
    )
