"""--check-for-large-grads (Megatron's flag): each rank's local gradient norm of every bucket, before its
data-parallel reduction, goes through Megatron's is_unexpectedly_large (threshold 10 over the largest of the first
100 norms). Megatron's check is not fatal: it is reported and training goes on (after a re-run, in its default
--rerun-mode validate_results, which only classifies the finding; there is no re-run engine here).

- The detector against Megatron's rule worked out by hand.
- A DP=2 job with a gradient made 1e6 times larger on rank 1 in iteration 11 (MEGATRON_LITE_INJECT_FAULT
  large,rank=1,iteration=11) reports that iteration, that rank and the bucket, counts it in the metrics, and trains
  on; the same job without the fault reports nothing.
"""

from __future__ import annotations

import json
import math

import pytest

from megatron_lite.resilience.guards import LargeValueDetector

ARGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
    "--global-batch-size 4 --lr 3e-3 --lr-decay-style constant --log-interval 1 --eval-iters 0 --mock-data "
    "--vocab-size 128 --distributed-backend gloo --normalization RMSNorm --swiglu --position-embedding-type rope "
    "--disable-bias-linear --train-iters 12 --check-for-large-grads --overlap-grad-reduce --ddp-bucket-size 1"
).split()


def test_detector_is_megatrons_is_unexpectedly_large():
    d = LargeValueDetector(threshold=10.0, num_samples=4)
    # sampling: never large, NaN and Inf not counted, the sign ignored (fabs)
    assert [d.is_unexpectedly_large(v) for v in (1.0, math.nan, -3.0, math.inf, 2.0, 0.5)] == [False] * 6
    assert d.sampled and d.max_value == 3.0
    assert d.is_unexpectedly_large(30.0)  # >= 10 x 3
    assert d.is_unexpectedly_large(-31.0)
    assert not d.is_unexpectedly_large(29.9)
    assert not d.is_unexpectedly_large(math.inf) and not d.is_unexpectedly_large(math.nan)
    assert d.max_value == 3.0  # after sampling the largest stays: a large value does not raise the bound


class _Buckets:
    """A data-parallel wrapper's local bucket norms, one list per step."""

    def __init__(self, steps: list[list[float]]) -> None:
        self.steps = steps

    def take_local_norms(self) -> list[tuple[str, float]]:
        return [(f"bucket #{i}", v) for i, v in enumerate(self.steps.pop(0))]


@pytest.mark.parametrize("mode,found", [("disabled", [0, 2, 2]), ("validate_results", [0, 0, 1])])
def test_rerun_modes_check_as_megatrons(mode, found):
    """Worked out by hand with 2 samples: disabled samples iteration 1 (1, 1): 100 and 1000 are large after it.
    validate_results skips iteration 1, samples 1 and 100 in iteration 2, and stops at iteration 3's first
    rejection (the re-run would be requested there)."""
    from types import SimpleNamespace

    import torch

    from megatron_lite.resilience.supervisor import Supervisor
    from megatron_lite.training.configs import ResilienceConfig

    ctx = SimpleNamespace(rank=0, device=torch.device("cpu"))
    logs: list[str] = []
    config = ResilienceConfig(check_for_large_grads=True, rerun_mode=mode)
    guard = Supervisor(config, True, ctx, SimpleNamespace(info=logs.append))
    guard.large = LargeValueDetector(10.0, num_samples=2)
    ddp = _Buckets([[1.0, 1.0], [1.0, 100.0, 100.0], [1000.0, 1000.0]])
    metrics = SimpleNamespace(lm_loss=1.0, grad_norm=1.0, num_tokens=1, comm_exposed_seconds=0.0)
    counts = []
    for it in (1, 2, 3):
        assert guard.after_step(it, 0, metrics, ddp, 0.1) == "ok"
        counts.append(guard.log_metrics()["large_grads"])
    assert counts == found, logs


def _records(path) -> dict[int, dict]:
    return {r["iteration"]: r for r in map(json.loads, open(path)) if "lm_loss" in r and "kind" not in r}


@pytest.mark.parametrize("mode", ["validate_results", "disabled"])
def test_a_large_gradient_is_reported_and_training_goes_on(tmp_path, pretrain_job, mode):
    fault = {"MEGATRON_LITE_INJECT_FAULT": "large,rank=1,iteration=11"}
    argv = [*ARGS, "--rerun-mode", mode, "--log-jsonl", str(tmp_path / f"{mode}.jsonl")]
    out = pretrain_job(2, argv, env=fault)
    found = [line for line in out.splitlines() if "found unexpected large grads" in line]
    assert len(found) == 1 and "iteration 11: rank 1: found unexpected large grads in bucket #" in found[0], out
    assert "--check-for-large-grads: rank 0's max value for grads" in out
    r = _records(tmp_path / f"{mode}.jsonl")
    assert sorted(r) == list(range(1, 13))  # trained on to the end
    assert [it for it in r if r[it]["large_grads"]] == [11] and r[11]["large_grads"] == 1
    if mode == "validate_results":
        return
    clean = pretrain_job(2, [*argv[:-1], str(tmp_path / "clean.jsonl")])
    assert "found unexpected large grads" not in clean
    c = _records(tmp_path / "clean.jsonl")
    assert all(c[it]["large_grads"] == 0 for it in c) and sorted(c) == list(range(1, 13))
    assert all(c[it]["lm_loss"] == r[it]["lm_loss"] for it in range(1, 12))  # (the fault changes iteration 11's update)


def test_rerun_mode_is_one_of_megatrons_and_the_start_up_says_what_the_check_does():
    from megatron_lite.arguments import parse_args
    from megatron_lite.config import ConfigError
    from megatron_lite.megatron_flags import accepted_no_ops

    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --mock-data --vocab-size 100 "
    base += "--train-iters 4"
    with pytest.raises(ConfigError, match="^--rerun-mode validate is not one of disabled, validate_results, report_"):
        parse_args([*base.split(), "--rerun-mode", "validate"])
    for extra, note in (
        ("", "--check-for-large-grads under --rerun-mode validate_results: there is no re-run engine here"),
        ("--rerun-mode report_stats", "--check-for-large-grads has no effect with --rerun-mode report_stats"),
        ("--rerun-mode disabled", None),
    ):
        ns, job = parse_args([*base.split(), "--check-for-large-grads", *extra.split()])
        notes = [n for n in accepted_no_ops(ns) if "rerun" in n or "large-grads" in n]
        assert job.resilience.check_for_large_grads and notes == ([] if note is None else notes[:1])
        assert note is None or notes[0].startswith(note), notes
