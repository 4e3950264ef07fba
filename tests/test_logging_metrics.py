"""What the log says of a multi-rank job, from a logging review: memory is the largest over the ranks (the logging
rank is the last pipeline stage; the first holds more activations under 1F1B), tokens per second also per GPU
(torchtitan's and the planner's unit), and no allocator peak on a CPU (the process's size there said nothing of
its tensors: 443 MB for a model of under 1 MB)."""

from __future__ import annotations

import json

from megatron_lite.config import ParallelConfig

from dist_pool import get_context


def largest(values: dict) -> dict:
    from megatron_lite.training.memory import largest_over_ranks

    ctx = get_context(ParallelConfig())
    r = ctx.rank
    return largest_over_ranks({**values, "a": 10 * r + 1, "b": 7 - r, "c": None}, ctx)


def test_memory_is_the_largest_over_the_ranks(dist):
    for got in dist(2, largest, {}):
        assert got == {"a": 11, "b": 7, "c": None}, got


def test_a_pipeline_jobs_log_per_gpu_throughput_and_the_busiest_ranks_memory(tmp_path, pretrain_job):
    log = tmp_path / "m.jsonl"
    args = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "2", "--mock-data",
            "--vocab-size", "100", "--pipeline-model-parallel-size", "2", "--eval-iters", "0", "--log-interval", "1",
            "--log-memory-breakdown", "--log-jsonl", str(log), "--distributed-backend", "gloo"]  # fmt: skip
    pretrain_job(2, [*args, "--decoder-first-pipeline-num-layers", "3"])
    rec = [json.loads(line) for line in log.read_text().splitlines() if "lm_loss" in line][-1]
    assert rec["tokens_per_sec_per_gpu"] * 2 == rec["tokens_per_sec"]
    assert rec["peak_memory_bytes"] is None and rec["max_rss_bytes"] > 0
    # the first stage holds 3 of the 4 layers: its parameters are logged, not the last stage's (the logging rank)
    from megatron_lite.arguments import parse_args
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    job = parse_args([*args, "--decoder-first-pipeline-num-layers", "3"])[1]
    stages = []
    for rank in (0, 1):
        model = build_model(job.model, ParallelContext.virtual(job.parallel, 2, rank), device="meta")
        stages.append(sum(p.numel() * 4 for p in model.parameters()))
    assert stages[0] > stages[1] and rec["mem_params_bytes"] == stages[0], (rec["mem_params_bytes"], stages)
