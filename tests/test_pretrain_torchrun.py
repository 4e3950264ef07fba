"""Whole jobs under torchrun: the shipped scripts' dry runs and the demos. (Restarts in fresh processes under
torchrun: tests/test_fault_tolerance.py; exact resume under each layout: tests/test_pretrain_layouts.py.)"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess

import head_start
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def records(path) -> list[dict]:
    return [json.loads(line) for line in open(path) if "lm_loss" in json.loads(line)]


SCRIPTS = [
    "demo_cpu.sh",
    "mixtral_cpu_demo.sh",
    "mixtral_8x7b.sh",
    "qwen3_30b_a3b.sh",
    "gpt_oss_20b.sh",
    "deepseek_v3.sh",
    "llama3_8b.sh",
    "llama3_70b_multinode.sh",
    "llama3_70b.sbatch",
    "finetune_llama3_8b_lora.sh",
]


for _script in SCRIPTS:  # (one process each: started ahead in the background, tests/head_start.py)
    head_start.register(
        f"dry_run:{_script}", lambda _, s=_script: ["bash", str(ROOT / "pretrain" / s)],
        env={**os.environ, "DRY_RUN": "1"}, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.head_start(f"dry_run:{s}")) for s in SCRIPTS])
def test_shipped_script_dry_run(script):
    out, _ = head_start.result(f"dry_run:{script}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dry run ok" in out.stdout


def _hf_count(config) -> tuple[int, int]:
    """Parameters of a transformers model of `config` (built on the meta device) and those of its routed experts."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return sum(p.numel() for p in model.parameters()), experts


@pytest.mark.head_start(*(f"dry_run:{s}" for s in ("llama3_70b_multinode.sh", "mixtral_8x7b.sh", "gpt_oss_20b.sh")))
def test_the_dry_run_counts_the_models_parameters_as_transformers():
    """(From a review of the scripts) the headline count is the model's, as transformers counts it, not the
    layout's padded vocabulary (the 70B said 70.57B for 70.55B), and an MoE's active parameters are said. The
    configs are the published config.json values, written out here."""
    transformers = pytest.importorskip("transformers")

    def said(script: str) -> str:  # (test_shipped_script_dry_run's runs)
        out, _ = head_start.result(f"dry_run:{script}")
        return next(line for line in out.stdout.splitlines() if line.startswith("dry run ok"))

    llama70 = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, tie_word_embeddings=False,
    )  # fmt: skip
    total, _ = _hf_count(llama70)
    assert f", {total / 1e9:.2f}B parameters (" in said("llama3_70b_multinode.sh")
    mixtral = transformers.MixtralConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    total, experts = _hf_count(mixtral)
    active = total - experts + experts * 2 / 8
    assert f", {total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active" in said("mixtral_8x7b.sh")
    gpt_oss = transformers.GptOssConfig(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, tie_word_embeddings=False,
    )  # fmt: skip
    total, experts = _hf_count(gpt_oss)  # (sinks, the router's and experts' biases included)
    active = total - experts + experts * 4 / 32
    assert f", {total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active" in said("gpt_oss_20b.sh")


def test_qlora_script_dry_run_on_a_machine_without_the_base():
    """From a review: the LoRA script's QLORA=1 dry run stopped where its base checkpoint is absent (the script
    says a dry run validates on any machine), naming --load as if it had not been given."""
    out = subprocess.run(
        ["bash", str(ROOT / "pretrain" / "finetune_llama3_8b_lora.sh")],
        env={**os.environ, "DRY_RUN": "1", "QLORA": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and "dry run ok" in out.stdout, out.stdout + out.stderr
    assert "note: on this machine the run would stop: --qlora with no base checkpoint loaded" in out.stdout
    assert ": no such directory)" in out.stdout


def test_every_script_is_covered():
    shipped = sorted(p.name for p in (ROOT / "pretrain").iterdir() if p.suffix in (".sh", ".sbatch"))
    assert shipped == sorted(SCRIPTS)


def _register_demo(script: str, iters: int) -> None:
    """The demo `script` run for `iters` iterations, its W&B run offline, into the check's directory (started
    ahead in the background: tests/head_start.py)."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    env.update(TRAIN_ITERS=str(iters), WANDB_MODE="offline")
    argv = lambda out: ["env", f"RUN_DIR={out}", "bash", str(ROOT / "pretrain" / script)]  # noqa: E731
    head_start.register(f"demo:{script}", argv, env=env)


def _demo(script: str) -> pathlib.Path:
    out, run_dir = head_start.result(f"demo:{script}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return pathlib.Path(run_dir)


_register_demo("demo_cpu.sh", 30)
# (one log interval: what is asked of it is logged there; the loss curve is the dense demo's test)
_register_demo("mixtral_cpu_demo.sh", 10)


@pytest.mark.head_start("demo:demo_cpu.sh")
def test_demo_trains_logs_wandb_offline_and_checkpoints():
    run = _demo("demo_cpu.sh")
    recs = records(run / "metrics.jsonl")
    assert recs[-1]["iteration"] == 30 and recs[-1]["lm_loss"] < recs[0]["lm_loss"] - 1.0
    assert list((run / "wandb").glob("offline-run-*"))
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "30"


@pytest.mark.head_start("demo:mixtral_cpu_demo.sh")
def test_mixtral_demo_logs_expert_load_to_jsonl_and_wandb():
    run = _demo("mixtral_cpu_demo.sh")
    last = records(run / "metrics.jsonl")[-1]
    assert last["iteration"] == 10 and last["moe_aux_loss"] > 0 and last["moe_max_imbalance"] >= 1.0
    per_layer = last["moe_tokens_per_expert"]
    assert sorted(per_layer) == ["0", "1", "2", "3"] and all(len(v) == 8 for v in per_layer.values())
    # every routed pair counted: batch 16 x seq 128 tokens, top-2
    assert all(sum(v) == 16 * 128 * 2 for v in per_layer.values())
    wandb_run = next((run / "wandb").glob("offline-run-*"))
    blob = b"".join(p.read_bytes() for p in wandb_run.rglob("*.wandb"))
    assert b"comm_exposed_fraction" in blob  # the exposed-communication metric reaches W&B too
    for key in (b"load_balancing_loss", b"moe_max_imbalance", b"moe_layer0_imbalance", b"moe_dropped_fraction"):
        assert key in blob, key


@pytest.mark.parametrize("bad_flag", [["--num-layers", "-1"], ["--num-layers", "2", "--bogus", "1"]])
def test_a_start_up_error_is_torchruns_root_cause(tmp_path, bad_flag):
    """torchrun's summary of a failed start-up said only "traceback : To enable traceback see: https://pytorch.org/
    docs/stable/elastic/errors.html" under "Root Cause", 45-53 lines burying our one line: each rank leaves its
    line in torch elastic's error file, which the summary shows (an unknown flag's too, from the parser)."""
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    bad = [str(ROOT / "pretrain" / "pretrain_gpt.py"), "--mock-data", "--vocab-size", "100", *bad_flag]
    bad += "--hidden-size 32 --num-attention-heads 4 --seq-length 16 --train-iters 1".split()
    res = subprocess.run([*cmd, *bad], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    root_cause = res.stderr.split("Root Cause (first observed failure):")[-1]
    # (the root cause is the rank whose error file is oldest: its exit code is 2, or -15 where torchrun's SIGTERM,
    # sent when the other rank exited first, reached it after it wrote the file and before it exited; seen under load)
    assert re.search(r"exitcode  : (2|-15) ", root_cause), res.stderr[-3000:]
    assert "To enable traceback" not in root_cause, res.stderr[-3000:]
    said = "--num-layers -1 must be" if "-1" in bad_flag else "--bogus: no such flag in"
    assert re.search(rf"traceback : error( \(rank 1\))?: {said}", root_cause), res.stderr[-3000:]
