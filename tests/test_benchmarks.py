"""The benchmark scripts run (tiny) and report both sides and a ratio; they are measured, not asserted."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_bench_train_step_reports_a_ratio(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "bench_train_step.py"),
            "--num-layers",
            "1",
            "--hidden-size",
            "64",
            "--vocab-size",
            "512",
            "--seq-length",
            "32",
            "--warmup",
            "1",
            "--iters",
            "2",
            "--device",
            "cpu",
            "--json",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    assert set(result["step_time_s"]) == {"megatron_lite", "transformers"}
    assert result["ratio_transformers_over_megatron_lite"] > 0
    assert "speed-up of megatron_lite over transformers" in out.stdout


@pytest.mark.slow
def test_bench_pipeline_reports_bubble_and_ratio(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "bench_pipeline.py"),
            "--pp",
            "2",
            "--microbatches",
            "2",
            "--forward-ms",
            "2",
            "--repeats",
            "1",
            "--json",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [r["schedule"] for r in rows] == ["1F1B", "interleaved 1F1B"]
    assert rows[0]["theory_bubble"] == 0.5 and rows[1]["theory_bubble"] == 0.25
    assert all(r["torch_over_ours"] > 0 and r["measured_bubble"] > 0 for r in rows)
