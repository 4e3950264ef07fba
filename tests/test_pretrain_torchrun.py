"""Whole jobs under torchrun: exact resume in fresh processes (and under other layouts), the shipped scripts'
dry runs, and the demos."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def torchrun(nproc: int, args: list[str], cwd, timeout=600) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(ROOT / "pretrain" / "pretrain_gpt.py"),
        *args,
    ]
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def records(path) -> list[dict]:
    return [json.loads(line) for line in open(path) if "lm_loss" in json.loads(line)]


RESUME_LAYOUTS = {
    "tp2-dp2": "--tensor-model-parallel-size 2".split(),
    "pp2-vp2": "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --num-layers 4".split(),
    "moe-ep2": (
        "--num-experts 4 --expert-model-parallel-size 2 --moe-aux-loss-coeff 1e-2 "
        "--moe-router-score-function sigmoid --moe-router-enable-expert-bias"
    ).split(),
    # stopped mid-ramp (batches 4 x 6 then 8): the batch size and the schedule's sample position come back
    "rampup-dp2": "--rampup-batch-size 4 4 24".split(),
    # multi-token prediction on the last stage, with its copy of the word embeddings (never stored: the first
    # stage's comes back into it)
    "mtp-pp2": "--pipeline-model-parallel-size 2 --mtp-num-layers 1".split(),
    # bf16 Adam moments, sharded by the distributed optimizer, saved and restored in their dtype
    "bf16-moments-dp2": (
        "--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --use-distributed-optimizer"
    ).split(),
}


# The restart in new processes under torchrun is taken with the distributed optimizer's sharded bf16 moments (two
# ranks; torchrun's own restarts and a SIGTERM resume also start new processes: tests/test_fault_tolerance.py).
# The other layouts add what their checkpoints hold, and run both jobs on a persistent pool's ranks
# (tests/pretrain_jobs.py): 25-50 s less each.
UNDER_TORCHRUN = {"bf16-moments-dp2"}


@pytest.mark.parametrize("layout", list(RESUME_LAYOUTS))
def test_resume_is_exact(tmp_path, layout, pretrain_job):
    """10 iterations straight (saving at 5) vs --load --ckpt-step 5 + 5: identical lm_loss (and grad norm) at
    6-10, with dropout on, so RNG states, data position, optimizer moments and schedule must all come back.
    (Stopping with --exit-interval and resuming from the newest checkpoint: tests/test_pretrain_cli.py.)"""
    args = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-iters 10 "
        "--micro-batch-size 1 --global-batch-size 8 --lr 3e-3 "
        "--lr-warmup-iters 2 --lr-decay-style cosine --log-interval 1 --eval-iters 0 --hidden-dropout 0.1 "
        "--attention-dropout 0.1 --normalization RMSNorm --swiglu --position-embedding-type rope "
        "--disable-bias-linear --untie-embeddings-and-output-weights --distributed-backend gloo"
    ).split() + RESUME_LAYOUTS[layout]
    n = 4 if layout == "tp2-dp2" else 2

    def job(argv: list[str]) -> str:
        return torchrun(n, argv, tmp_path).stdout if layout in UNDER_TORCHRUN else pretrain_job(n, argv)

    ckpt = str(tmp_path / "ckpt")
    job([*args, "--save", ckpt, "--save-interval", "5", "--log-jsonl", str(tmp_path / "straight.jsonl")])
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "10"
    out = job([*args, "--load", ckpt, "--ckpt-step", "5", "--log-jsonl", str(tmp_path / "b.jsonl")])
    assert "loaded" in out and "iteration 5" in out
    straight, resumed = records(tmp_path / "straight.jsonl"), records(tmp_path / "b.jsonl")
    assert [r["iteration"] for r in straight] == list(range(1, 11))
    assert [r["iteration"] for r in resumed] == list(range(6, 11))
    for s, r in zip(straight[5:], resumed):
        assert s["lm_loss"] == r["lm_loss"] and s["grad_norm"] == r["grad_norm"], (s, r)
        assert s["lr"] == r["lr"] and s["global_batch_size"] == r["global_batch_size"], (s, r)
        assert s.get("moe_aux_loss") == r.get("moe_aux_loss")  # routing (and the expert bias) came back too
        assert s.get("mtp_1_loss") == r.get("mtp_1_loss")
    assert ("mtp_1_loss" in straight[-1]) == (layout == "mtp-pp2")


SCRIPTS = [
    "demo_cpu.sh",
    "mixtral_cpu_demo.sh",
    "mixtral_8x7b.sh",
    "qwen3_30b_a3b.sh",
    "deepseek_v3.sh",
    "llama3_8b.sh",
    "llama3_70b_multinode.sh",
    "llama3_70b.sbatch",
    "finetune_llama3_8b_lora.sh",
]


@pytest.mark.parametrize("script", SCRIPTS)
def test_shipped_script_dry_run(script):
    out = subprocess.run(
        ["bash", str(ROOT / "pretrain" / script)],
        env={**os.environ, "DRY_RUN": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dry run ok" in out.stdout


def test_every_script_is_covered():
    shipped = sorted(p.name for p in (ROOT / "pretrain").iterdir() if p.suffix in (".sh", ".sbatch"))
    assert shipped == sorted(SCRIPTS)


def test_demo_trains_logs_wandb_offline_and_checkpoints(tmp_path):
    env = {**os.environ, "RUN_DIR": str(tmp_path / "demo"), "TRAIN_ITERS": "40", "WANDB_MODE": "offline"}
    env.pop("WANDB_API_KEY", None)
    out = subprocess.run(
        ["bash", str(ROOT / "pretrain" / "demo_cpu.sh")], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    recs = records(tmp_path / "demo" / "metrics.jsonl")
    assert recs[-1]["iteration"] == 40 and recs[-1]["lm_loss"] < recs[0]["lm_loss"] - 1.0
    assert list((tmp_path / "demo" / "wandb").glob("offline-run-*"))
    assert (tmp_path / "demo" / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "40"


def test_mixtral_demo_logs_expert_load_to_jsonl_and_wandb(tmp_path):
    env = {**os.environ, "RUN_DIR": str(tmp_path / "mix"), "TRAIN_ITERS": "30", "WANDB_MODE": "offline"}
    env.pop("WANDB_API_KEY", None)
    out = subprocess.run(
        ["bash", str(ROOT / "pretrain" / "mixtral_cpu_demo.sh")], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = records(tmp_path / "mix" / "metrics.jsonl")[-1]
    assert last["iteration"] == 30 and last["moe_aux_loss"] > 0 and last["moe_max_imbalance"] >= 1.0
    per_layer = last["moe_tokens_per_expert"]
    assert sorted(per_layer) == ["0", "1", "2", "3"] and all(len(v) == 8 for v in per_layer.values())
    # every routed pair counted: batch 16 x seq 128 tokens, top-2
    assert all(sum(v) == 16 * 128 * 2 for v in per_layer.values())
    run = next((tmp_path / "mix" / "wandb").glob("offline-run-*"))
    blob = b"".join(p.read_bytes() for p in run.rglob("*.wandb"))
    assert b"comm_exposed_fraction" in blob  # the exposed-communication metric reaches W&B too
    for key in (b"moe_aux_loss", b"moe_max_imbalance", b"moe_layer0_imbalance", b"moe_dropped_fraction"):
        assert key in blob, key
