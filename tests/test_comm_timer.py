"""The exposed-communication timer (megatron_lite/comm_timer.py) on its own: what it counts and what not.
The multi-process figure (`comm_exposed_fraction` of a gloo job) is checked in test_pretrain_cli.py."""

from __future__ import annotations

import time

import pytest
import torch

from megatron_lite.comm_timer import CommTimer


def test_host_clock_counts_the_outer_region_once_and_nothing_outside():
    timer = CommTimer()
    time.sleep(0.2)  # outside any region
    with timer.blocked():
        time.sleep(0.05)
        with timer.blocked():  # a wait inside a timed collective
            time.sleep(0.05)
    assert 0.1 <= timer.take() < 0.2
    assert timer.take() == 0.0


def _gpu_sleep_seconds(cycles: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_cuda_timer_counts_what_the_stream_waits_not_what_the_host_does():
    """NCCL waits return on the host once queued; a GPU-side stall (here the stream spinning, as it would
    wait on a NCCL kernel) must still be counted, and compute queued before the region must not be."""
    cycles = 50_000_000
    stall = _gpu_sleep_seconds(cycles)  # ~tens of ms
    host_timer, timer = CommTimer(), CommTimer(cuda=True)
    torch.cuda._sleep(cycles)  # compute queued before the region: not counted
    with timer.blocked(), host_timer.blocked():
        torch.cuda._sleep(cycles)  # returns at once on the host
    torch.cuda._sleep(cycles)  # after it: not counted either
    measured = timer.take()
    assert host_timer.take() < 0.2 * stall  # what the host clock would have reported
    assert 0.7 * stall < measured < 1.5 * stall, (measured, stall)
    assert timer.take() == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_cuda_timer_does_not_hold_events_nobody_takes():
    """Generation and evaluation time their collectives too but never take(): finished regions are folded
    into the total as the list grows, so their events do not pile up for a whole generation."""
    timer = CommTimer(cuda=True)
    for _ in range(1000):
        with timer.blocked():
            torch.cuda._sleep(1000)
        if len(timer._events) == 255:
            torch.cuda.synchronize()  # the next region's fold finds all of these finished
    assert len(timer._events) < 300
    assert timer.take() > 0 and not timer._events
