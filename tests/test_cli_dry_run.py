"""The dry run: the memory it counts per sharding, the activations the run saves, and the same checks as the run.
(Split from tests/test_pretrain_cli.py.)"""

from __future__ import annotations

import json
import re

import pytest
from test_pretrain_cli import TINY, _run

from megatron_lite.data.indexed import IndexedDatasetWriter
from megatron_lite.training.pretrain import main

from models import decilm_block


def _dry_run_state_bytes(argv, world, capsys, monkeypatch) -> dict[int, float]:
    """--dry-run's per-rank weights+gradients+optimizer bytes, by pipeline-first rank of each printed group."""

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert main([*TINY, *argv, "--dry-run"]) == 0
    out = {}
    for line in capsys.readouterr().out.splitlines():
        m = re.search(r"ranks \[(\d+)[^\]]*\].*?, ([\d.]+) (GiB|MiB) weights\+gradients\+optimizer", line)
        if m:
            out[int(m.group(1))] = float(m.group(2)) * 2 ** (30 if m.group(3) == "GiB" else 20)
    return out


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "flags,sharding",
    [
        ([], "none"),
        (["--use-distributed-optimizer"], "dist-opt"),
        (["--use-distributed-optimizer", "--zero-stage", "2"], "zero2"),
        (["--use-torch-fsdp2"], "fsdp2"),
        (["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
          "--exp-avg-sq-dtype", "bf16"], "dist-opt"),
    ],
)  # fmt: skip
def test_dry_run_memory_follows_the_sharding(flags, sharding, bf16, capsys, monkeypatch):
    """The dry run's weights + gradients + optimizer per rank equal the planner's, whose estimates the planner
    tests hold within 10% of measured bytes: the distributed optimizer shards the main weights and moments over
    DP, ZeRO-2 the gradients too, FSDP2 everything (dense over DP, experts over expert-DP)."""
    from megatron_lite.arguments import parse_args
    from megatron_lite.planner.layout import Layout
    from megatron_lite.planner.memory import rank_memory

    model = "--num-experts 4 --expert-model-parallel-size 2 --disable-bias-linear --vocab-size 64 --mock-data"
    argv = [*model.split(), "--global-batch-size", "8", *flags, *(["--bf16"] if bf16 else [])]
    printed = _dry_run_state_bytes(argv, 4, capsys, monkeypatch)
    _, job = parse_args([*TINY, *argv])
    layout = Layout(dp=4, ep=2, sharding=sharding, micro_batch_size=2)
    state = 4 if "--exp-avg-dtype" in flags else 8
    est = rank_memory(job.model, layout, 16, 8, bf16, 0, state_bytes=state)
    expected = est.params + est.grads + est.optimizer
    assert printed and all(abs(v - expected) <= 0.01 * expected + 2**20 / 20 for v in printed.values()), (
        printed,
        expected,
    )


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
def test_dry_run_prices_dist_muons_busiest_rank(bf16, capsys, monkeypatch):
    """--optimizer dist_muon at DP=4 with a vocabulary (padded to 2048 with the mock data's end-of-document) whose
    tied embedding outweighs a quarter of the state: the dry run's weights + gradients + optimizer equal the
    planner's (the busiest rank of the real split, which tests/test_planner.py -k dist_muon holds to the measured
    bytes); it priced an even split."""
    from megatron_lite.arguments import parse_args
    from megatron_lite.planner.layout import Layout
    from megatron_lite.planner.memory import rank_memory
    from megatron_lite.training import dry_run

    monkeypatch.setattr(dry_run, "_bytes", lambda n: f"{n / 2**20:.6f} MiB")  # (to the byte)
    argv = ["--optimizer", "dist_muon", "--vocab-size", "2000", "--mock-data", "--global-batch-size", "8",
            *(["--bf16"] if bf16 else [])]  # fmt: skip
    printed = _dry_run_state_bytes(argv, 4, capsys, monkeypatch)
    _, job = parse_args([*TINY, *argv])
    est = rank_memory(job.model, Layout(dp=4, sharding="layer-wise", micro_batch_size=2), 16, 8, bf16, 0)
    expected = est.params + est.grads + est.optimizer
    assert printed and all(abs(v - expected) <= 0.01 * expected for v in printed.values()), (printed, expected)


def test_dry_run_prices_dist_muons_weight_gather(capsys, monkeypatch):
    """After each step dist_muon all-gathers the updated weights in place into one buffer (the largest group's,
    padded to the largest rank's width), which tests/test_planner_layer_wise.py holds to the bytes it allocates:
    the dry run's activations plus what the step adds are the larger of the activations and that gather. It added
    nothing (the gather is about a stage's weights again: 57 of 539 Llama-3 8B layouts it 'fit' on 8xH100 did not)."""
    from megatron_lite.arguments import parse_args
    from megatron_lite.planner.layout import Layout
    from megatron_lite.planner.memory import layer_wise_split_of
    from megatron_lite.training import dry_run

    monkeypatch.setattr(dry_run, "_bytes", lambda n: f"{n / 2**20:.6f} MiB")  # (to the byte)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    argv = ["--optimizer", "dist_muon", "--vocab-size", "2000", "--mock-data", "--global-batch-size", "8"]
    assert main([*TINY, *argv, "--dry-run"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "weights+gradients+optimizer" in x)
    saved, extra = (
        float(x) * 2**20 for x in re.search(r"~([\d.]+) MiB activations.*?~([\d.]+) MiB rebuilt", line).groups()
    )
    _, job = parse_args([*TINY, *argv])
    widths = layer_wise_split_of(job.model, Layout(dp=4, sharding="layer-wise"), 0, False).widths
    gather = 4 * max(w * g for g, w in widths)
    assert gather > saved and saved + extra == pytest.approx(gather, abs=2), line


LLAMA_LIKE = "--swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope"
ALL_SEVEN = "q_proj k_proj v_proj o_proj gate_proj up_proj down_proj"
# Heterogeneous layers (4 heads): 2 query groups and an FFN of 64; a no-op attention and a linear MLP; two identities;
# 1 query group and a no-op MLP; a linear attention and the model's MLP; an identity. In runs of two under uniform
# recomputation: one of identities alone (it keeps nothing), one whose checkpoint starts with an identity.
_N, _I = decilm_block("normal", 2, "normal", ffn_hidden_size=64), decilm_block("no_op", None, "no_op")
BLOCKS = [_N, decilm_block("no_op", None, "linear"), _I, _I, _I, decilm_block("normal", 4, "no_op"),
          decilm_block("linear", None, "normal"), _I]  # fmt: skip
HETERO = (
    f"{LLAMA_LIKE} --num-layers 8 --group-query-attention --num-query-groups 2 "
    f"--heterogeneous-layers-config-encoded-json {json.dumps({'block_configs': BLOCKS}, separators=(',', ':'))}"
)


def _priced_and_measured(argv, printed: str, tmp_path, capsys, monkeypatch) -> tuple[int, dict]:
    """The byte count --dry-run prints (the regex `printed`'s group, in bytes), and the memory breakdown of one
    iteration of the same job (--log-memory-breakdown's last JSONL record)."""
    from megatron_lite.training import dry_run

    monkeypatch.setattr(dry_run, "_bytes", lambda n: f"{n:.0f} B")
    rc, out, err = _run([*argv, "--dry-run"], capsys, monkeypatch)
    assert rc == 0, err
    predicted = int(re.search(printed, out).group(1))
    jsonl = tmp_path / "m.jsonl"
    rc, _, err = _run([*argv, "--train-iters", "1", "--log-memory-breakdown", "--log-jsonl", str(jsonl)],
                      capsys, monkeypatch)  # fmt: skip
    assert rc == 0, err
    return predicted, [json.loads(line) for line in jsonl.read_text().splitlines()][-1]


@pytest.mark.parametrize(
    "flags",
    [
        "--seq-length 256 --max-position-embeddings 256",
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
        "--recompute-granularity selective --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 48 "
        "--disable-bias-linear",
        f"--lora-rank 4 --lora-target-modules q_proj v_proj {LLAMA_LIKE}",
        f"--lora-rank 4 --lora-dropout 0.1 --lora-target-modules {ALL_SEVEN} {LLAMA_LIKE}",
        f"--lora-rank 4 --lora-target-modules {ALL_SEVEN} {LLAMA_LIKE} --recompute-granularity full "
        "--recompute-method uniform --recompute-num-layers 1",
        f"--lora-rank 4 --lora-dropout 0.1 --lora-target-modules q_proj v_proj o_proj down_proj {LLAMA_LIKE} "
        "--position-embedding-type rope --recompute-granularity selective",
        # (the MTP depths have no adapters; a depth is one checkpoint under uniform full recomputation, none under
        # block, and its hidden input is apart from a frozen output layer's loss, which keeps no input)
        f"--lora-rank 4 --lora-target-modules {ALL_SEVEN} {LLAMA_LIKE} --mtp-num-layers 2 --lora-dropout 0.1",
        f"--lora-rank 4 --lora-target-modules {ALL_SEVEN} {LLAMA_LIKE} --mtp-num-layers 2 "
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
        f"{LLAMA_LIKE} --mtp-num-layers 2 --recompute-granularity full --recompute-method block "
        "--recompute-num-layers 1",  # (the first layer of the two checkpointed)
        HETERO,
        f"{HETERO} --recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
    ],
    ids=[
        "seq256",
        "full-recompute",
        "moe",
        "lora-qv",
        "lora-dropout",
        "lora-full-recompute",
        "lora-rope-selective",
        "lora-mtp",
        "lora-mtp-full-recompute",
        "mtp-block-recompute",
        "heterogeneous",
        "heterogeneous-full-recompute",
    ],  # fmt: skip
)
def test_the_dry_runs_activations_are_what_the_run_saves(tmp_path, capsys, monkeypatch, flags):
    """From the memory review: --dry-run priced activations with Korthikanti et al.'s GPT formula, whose attention
    scores no flash kernel or SDPA keeps (1.5x here at 256 tokens, 7x at 1024), which leaves out MoE's routed copies
    (0.4x) and, under full recomputation, the output layer and loss (0.3x; 0.02x for a LoRA job). It now prices
    them with the planner's model: within 5% of what the activation meter measures in a real iteration (the
    dropout masks are the activations' dtype on a CPU: bool on a GPU, as the planner counted them). LoRA: a
    frozen linear keeps no input, a frozen RMSNorm no normalised input, the frozen output layer none (it priced LoRA
    as full training: 1.29x with adapters on q and v, 1.11x on all seven projections)."""
    fixtures = (tmp_path, capsys, monkeypatch)
    argv = ["--hidden-size", "64", "--num-attention-heads", "4", "--mock-data", "--vocab-size", "512",
            "--attention-dropout", "0", *flags.split()]  # fmt: skip
    predicted, mem = _priced_and_measured(argv, r"~(\d+) B activations at the schedule's peak", *fixtures)
    measured = mem["mem_activations_bytes"]
    assert abs(predicted / measured - 1) < 0.05, (predicted, measured)


def test_the_dry_run_checks_what_the_run_checks_and_the_run_checks_data_first(tmp_path, capsys, monkeypatch):
    """From the validation review: the dry run said "ok" to what the run refuses (data whose token ids exceed the
    vocabulary), and the run found a missing dataset only after building the
    model and loading the checkpoint. A dataset absent from the planning machine is a note."""

    prefix = str(tmp_path / "docs")
    w = IndexedDatasetWriter(prefix, vocab_size=501)
    for i in range(20):
        w.add_document([(13 * i + j) % 500 for j in range(40)] + [500])
    w.finalize()
    data = ["--data-path", prefix, "--tokenizer-type", "NullTokenizer"]
    # a dry run scans no .bin (hours on a large corpus): before the run has scanned it, a note
    rc, out, err = _run([*data, "--vocab-size", "100", "--dry-run"], capsys, monkeypatch)
    assert rc == 0 and f"note: the token ids of {prefix} (and any others) are checked by the run's first" in out
    rc, out, err = _run([*data, "--vocab-size", "100"], capsys, monkeypatch)
    assert rc == 2 and "holds token id 500" in err and "parameters" not in out, (out, err)
    rc, _, err = _run([*data, "--vocab-size", "100", "--dry-run"], capsys, monkeypatch)  # (now from its cache)
    assert rc == 2 and f"--data-path {prefix} holds token id 500 but the vocabulary has 101 ids" in err, err
    missing = ["--data-path", str(tmp_path / "nope"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "500"]
    rc, out, err = _run([*missing, "--dry-run"], capsys, monkeypatch)
    assert rc == 0 and f"note: on this machine the run would stop: {tmp_path / 'nope'}.idx/.bin not found" in out
    rc, out, err = _run(missing, capsys, monkeypatch)
    assert rc == 2 and "missing" in err and "parameters" not in out, (out, err)
    # a GPU job's Nsight profile is planned on a machine without a GPU (the diff review: refused there)
    nsys = ["--mock-data", "--vocab-size", "100", "--distributed-backend", "nccl", "--profile", "--dry-run"]
    rc, _, err = _run(nsys, capsys, monkeypatch)
    assert rc == 0, err


@pytest.mark.parametrize("optimizer", ["adam", "muon"])
def test_the_dry_runs_parameter_state_is_what_the_run_holds(tmp_path, capsys, monkeypatch, optimizer):
    """--dry-run's weights + gradients + optimizer bytes equal what the run's --log-memory-breakdown counts of its
    tensors after a step: under --optimizer muon the matrices keep Muon's one momentum (4 bytes) and the
    embeddings, output layer, norms and biases Adam's two moments (8); it priced them all at 8 (1.54x the
    optimizer state here)."""
    argv = ["--hidden-size", "64", "--num-attention-heads", "4", "--mock-data", "--vocab-size", "512",
            "--optimizer", optimizer]  # fmt: skip
    printed = r"(\d+) B weights\+gradients\+optimizer"
    predicted, mem = _priced_and_measured(argv, printed, tmp_path, capsys, monkeypatch)
    measured = sum(mem[f"mem_{k}_bytes"] for k in ("params", "grads", "optimizer"))
    assert abs(predicted / measured - 1) < 1e-3, (predicted, measured, mem)
