"""Whole jobs (flags, data, loop, logging: pretrain_gpt.py's main) under parallel layouts log what one process
logs. Each rank runs in a persistent pool, started as torchrun starts its workers (tests/pretrain_jobs.py);
the launcher itself (restarts, signals, rendezvous) is tested in tests/test_fault_tolerance.py."""

from __future__ import annotations

import pytest
from test_pretrain_torchrun import records

pytestmark = pytest.mark.slow


RESUME_LAYOUTS = {
    "tp2-dp2": "--tensor-model-parallel-size 2".split(),
    "pp2-vp2": "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --num-layers 4".split(),
    "moe-ep2": (
        "--num-experts 4 --expert-model-parallel-size 2 --moe-aux-loss-coeff 1e-2 "
        "--moe-router-score-function sigmoid --moe-router-enable-expert-bias"
    ).split(),
    # stopped mid-ramp (batches 4 x 6 then 8): the batch size and the schedule's sample position come back (a
    # ramp is sample-based: its 56 samples are the same 10 iterations)
    "rampup-dp2": "--rampup-batch-size 4 4 24".split(),
    # multi-token prediction on the last stage, with its copy of the word embeddings (never stored: the first
    # stage's comes back into it)
    "mtp-pp2": "--pipeline-model-parallel-size 2 --mtp-num-layers 1".split(),
    # fp8's delayed scaling: each linear's amax history and scales come back (a resume starting them afresh
    # quantized its first iteration with scale 1)
    "fp8-delayed-tp2": (
        "--fp8-format hybrid --fp8-amax-history-len 4 --fp8-amax-compute-algo max --tensor-model-parallel-size 2 "
        "--sequence-parallel"
    ).split(),
    # and the experts' (each expert's state written by one of its expert-data-parallel replicas)
    "fp8-delayed-moe-ep2": (
        "--fp8-format hybrid --fp8-amax-history-len 4 --num-experts 4 --expert-model-parallel-size 2 "
        "--moe-aux-loss-coeff 1e-2"
    ).split(),
    # Megatron's --ckpt-fully-parallel-load through the command line: the two replicas each read half of every
    # weight and Adam moment, then all-gather them (checkpoint/parallel_load.py)
    "fully-parallel-load-dp2": ["--ckpt-fully-parallel-load"],
    # --data-parallel-random-init: each data-parallel rank's own dropout stream comes back to it
    "dp-random-init-dp2": "--data-parallel-random-init".split(),
    # bf16 Adam moments, sharded by the distributed optimizer, saved and restored in their dtype
    "bf16-moments-dp2": (
        "--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --use-distributed-optimizer"
    ).split(),
}


@pytest.mark.parametrize("layout", list(RESUME_LAYOUTS))
def test_resume_is_exact(tmp_path, layout, pretrain_job):
    """10 iterations straight (saving at 5) vs --load --ckpt-step 5 + 5: identical lm_loss (and grad norm) at
    6-10, with dropout on, so RNG states, data position, optimizer moments and schedule must all come back.
    (Stopping with --exit-interval and resuming from the newest checkpoint: tests/test_cli_resume.py; a
    restart in new processes, torchrun's own and after SIGTERM: tests/test_fault_tolerance.py.)"""
    args = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-iters 10 "
        "--micro-batch-size 1 --global-batch-size 8 --lr 3e-3 "
        "--lr-warmup-iters 2 --lr-decay-style cosine --log-interval 1 --eval-iters 0 --hidden-dropout 0.1 "
        "--attention-dropout 0.1 --normalization RMSNorm --swiglu --position-embedding-type rope "
        "--disable-bias-linear --untie-embeddings-and-output-weights --distributed-backend gloo"
    ).split() + RESUME_LAYOUTS[layout]
    if layout.startswith("rampup"):  # in samples: the ramp's 4 x 6 + 8 x 4 are the same 10 iterations
        swap = {"--train-iters": ("--train-samples", "56"), "--lr-warmup-iters": ("--lr-warmup-samples", "16")}
        for i in [i for i, a in enumerate(args) if a in swap]:
            args[i : i + 2] = swap[args[i]]
    n = 4 if layout == "tp2-dp2" else 2
    ckpt = str(tmp_path / "ckpt")
    pretrain_job(n, [*args, "--save", ckpt, "--save-interval", "5", "--log-jsonl", str(tmp_path / "straight.jsonl")])
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "10"
    out = pretrain_job(n, [*args, "--load", ckpt, "--ckpt-step", "5", "--log-jsonl", str(tmp_path / "b.jsonl")])
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


def test_cli_tp2_dp2_equals_single_process(tmp_path, pretrain_job):
    """The whole job (flags, data, loop, logging) at TP=2 x DP=2 with sequence parallelism and gradient
    accumulation, and under context parallelism, logs the same per-iteration lm_loss and grad_norm as one
    process (embedded corpus)."""
    args = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
        "--seq-length 32 --train-iters 10 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 2 "
        "--lr-decay-style cosine --log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0 "
        "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear "
        "--untie-embeddings-and-output-weights --distributed-backend gloo --log-params-norm --log-num-zeros-in-grad"
    ).split()
    pretrain_job(1, [*args, "--micro-batch-size", "8", "--log-jsonl", str(tmp_path / "one.jsonl")])
    tp2_sp = "--micro-batch-size 1 --tensor-model-parallel-size 2 --sequence-parallel".split()
    pretrain_job(4, [*args, *tp2_sp, "--log-jsonl", str(tmp_path / "four.jsonl")])
    one, four = records(tmp_path / "one.jsonl"), records(tmp_path / "four.jsonl")
    assert len(one) == len(four) == 10
    for a, b in zip(one, four):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-4 * a["lm_loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (a, b)
        assert abs(a["params_norm"] - b["params_norm"]) <= 1e-4 * a["params_norm"], (a, b)
        _same_zeros(a, b, "tp2_sp_dp2")
    # Context parallelism from the command line: CP=2 (ring) x DP=2 and CP=2 (all-to-all), the same run.
    for name, n, extra in (
        ("cp2_p2p_dp2", 4, ["--micro-batch-size", "2", "--context-parallel-size", "2"]),
        ("cp2_a2a", 2, ["--micro-batch-size", "4", "--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
        # ZeRO-2 with overlapped bucket reduce-scatters, and ZeRO-3 through FSDP2, both under TP=2 + SP.
        (
            "zero2",
            4,
            "--micro-batch-size 2 --tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer "
            "--zero-stage 2 --overlap-grad-reduce --ddp-bucket-size 20000".split(),
        ),
        (
            "fsdp2",
            4,
            "--micro-batch-size 2 --tensor-model-parallel-size 2 --sequence-parallel --use-torch-fsdp2".split(),
        ),
        # FSDP2 under pipeline parallelism (one layer per stage), each stage sharded over DP=2
        ("fsdp2_pp2", 4, "--micro-batch-size 2 --pipeline-model-parallel-size 2 --use-torch-fsdp2".split()),
    ):
        pretrain_job(n, [*args, *extra, "--log-jsonl", str(tmp_path / f"{name}.jsonl")])
        cp = records(tmp_path / f"{name}.jsonl")
        assert len(cp) == 10
        for a, b in zip(one, cp):
            assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-4 * a["lm_loss"], (name, a, b)
            # (1e-5: the norm sums squares in fp64; in fp32 one process's whole embedding was 3e-5 off the shards')
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (name, a, b)
            assert abs(a["params_norm"] - b["params_norm"]) <= 1e-4 * a["params_norm"], (name, a, b)
            _same_zeros(a, b, name)


def _same_zeros(a: dict, b: dict, name: str) -> None:
    """Zero gradient entries: the input embedding rows no token reached, the same set under every layout (the
    vocabulary's padding, which TP=2 makes larger, is left out: an exploratory run's TP=2 counted 4960 for one
    process's 864, all of it padding). Within one row's 64 entries: elsewhere an entry may sum to exactly 0.0 in
    one order of additions and not another (FSDP2 x PP=2 counted one more, reproducibly, on a fresh machine
    whose earlier checkout had counted the same)."""
    assert b["num_zeros_in_grad"] > 0 and abs(a["num_zeros_in_grad"] - b["num_zeros_in_grad"]) < 64, (name, a, b)


def test_fsdp2_after_evaluations_equals_single_process(tmp_path, pretrain_job):
    """An evaluation (a forward with no backward) left FSDP2's root units gathered: the next step added its
    gradient to the last one for the embeddings, final norm and output layer, and a save right after wrote
    them without their Adam moments. Evaluating every 2 iterations and saving at 4, FSDP2 at DP=2 equals one
    process per iteration, and a run resumed from 4 equals the straight one. With Megatron's
    --torch-fsdp2-no-reshard-after-forward (layers stay gathered from forward to backward) too, and with
    --overlap-grad-reduce, which Megatron's FSDP2 takes without effect (it was refused: such a script did not
    port)."""
    args = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-iters 6 "
        "--global-batch-size 4 --micro-batch-size 2 --lr 3e-3 --lr-decay-style constant --log-interval 1 "
        "--eval-interval 2 --eval-iters 1 --hidden-dropout 0 --attention-dropout 0 --normalization RMSNorm "
        "--swiglu --position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
        "--distributed-backend gloo"
    ).split()
    pretrain_job(1, [*args, "--log-jsonl", str(tmp_path / "one.jsonl")])
    ckpt = str(tmp_path / "ckpt")
    fsdp = [*args, "--use-torch-fsdp2"]
    pretrain_job(2, [*fsdp, "--save", ckpt, "--save-interval", "4", "--log-jsonl", str(tmp_path / "fsdp.jsonl")])
    pretrain_job(2, [*fsdp, "--load", ckpt, "--ckpt-step", "4", "--log-jsonl", str(tmp_path / "resumed.jsonl")])
    kept = [*fsdp, "--torch-fsdp2-no-reshard-after-forward", "--log-jsonl", str(tmp_path / "kept.jsonl")]
    log = pretrain_job(2, [*kept, "--overlap-grad-reduce"])
    assert "--overlap-grad-reduce has no effect with --use-torch-fsdp2 (as in Megatron)" in log, log[-2000:]
    one, sharded, resumed, gathered = (records(tmp_path / f"{n}.jsonl") for n in ("one", "fsdp", "resumed", "kept"))
    assert len(one) == len(sharded) == len(gathered) == 6 and [r["iteration"] for r in resumed] == [5, 6]
    for a, b, c in zip(one, sharded, gathered):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-4 * a["lm_loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], (a, b)
        assert abs(a["lm_loss"] - c["lm_loss"]) <= 1e-4 * a["lm_loss"], (a, c)
        assert abs(a["grad_norm"] - c["grad_norm"]) <= 1e-4 * a["grad_norm"], (a, c)
    for s, r in zip(sharded[4:], resumed):
        assert s["lm_loss"] == r["lm_loss"] and s["grad_norm"] == r["grad_norm"], (s, r)


def test_rampup_batch_size_at_dp2_equals_single_process(tmp_path, pretrain_job):
    """--rampup-batch-size 4 4 16 with a global batch of 8: Megatron's ramp (the batch is START until the
    consumed samples pass SAMPLES / increments, then grows by INCREMENT), the same samples at DP=2 as on one
    process, and the schedule counted in samples (the ramp is sample-based, as Megatron requires: its decay ends
    at --train-samples)."""
    import math

    args = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-samples 32 "
        "--global-batch-size 8 --rampup-batch-size 4 4 16 --lr 3e-3 --lr-warmup-samples 16 --lr-decay-style cosine "
        "--log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0 --distributed-backend gloo"
    ).split()
    pretrain_job(1, [*args, "--micro-batch-size", "4", "--log-jsonl", str(tmp_path / "one.jsonl")])
    pretrain_job(2, [*args, "--micro-batch-size", "2", "--log-jsonl", str(tmp_path / "two.jsonl")])
    one, two = records(tmp_path / "one.jsonl"), records(tmp_path / "two.jsonl")

    def megatron_batch(consumed, start=4, increment=4, ramp=16, final=8):
        per_increment = ramp / ((final - start) // increment)
        return final if consumed > ramp else start + int(consumed / per_increment) * increment

    consumed, batches, positions = 0, [], []
    for _ in range(6):
        positions.append(consumed)
        batches.append(megatron_batch(consumed))
        consumed += batches[-1]
    assert [r["global_batch_size"] for r in one] == batches == [4, 4, 4, 4, 8, 8]
    assert [r["consumed_samples"] for r in one] == [sum(batches[: i + 1]) for i in range(6)]

    def lr(p, warmup=16, decay=32):
        return (
            3e-3 * p / warmup if p <= warmup else 3e-3 * 0.5 * (math.cos(math.pi * (p - warmup) / (decay - warmup)) + 1)
        )

    assert [r["lr"] for r in one] == pytest.approx([lr(p) for p in positions])
    for a, b in zip(one, two, strict=True):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-4 * a["lm_loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], (a, b)


def test_document_masks_under_hierarchical_context_parallelism_equal_single_process(tmp_path, pretrain_job):
    """From the command line: packed documents (--reset-position-ids --reset-attention-mask --eod-mask-loss) on
    an indexed dataset of short documents, CP=4 as Megatron's a2a+p2p 2 x 2, log what one process logs; the
    flags change the run."""
    import numpy as np

    from megatron_lite.data.indexed import IndexedDatasetWriter

    vocab = 100  # NullTokenizer: the EOD id is --vocab-size
    prefix = str(tmp_path / "docs_text_document")
    w = IndexedDatasetWriter(prefix, vocab_size=vocab + 1)
    rng = np.random.default_rng(0)
    for _ in range(300):
        w.add_document(np.append(rng.integers(0, vocab, size=int(rng.integers(2, 14))), vocab))
    w.finalize()
    args = (
        f"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-iters 6 "
        f"--global-batch-size 8 --micro-batch-size 4 --lr 3e-3 --log-interval 1 --eval-iters 0 --hidden-dropout 0 "
        f"--attention-dropout 0 --normalization RMSNorm --swiglu --position-embedding-type rope "
        f"--disable-bias-linear --distributed-backend gloo --data-path {prefix} --tokenizer-type NullTokenizer "
        f"--vocab-size {vocab} --split 100,0,0"
    ).split()
    documents = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
    hierarchical = "--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2"
    runs = {
        "one": (1, documents),
        "cp4": (4, [*documents, *hierarchical.split()]),
        "plain": (1, []),
    }
    for name, (n, extra) in runs.items():
        pretrain_job(n, [*args, *extra, "--log-jsonl", str(tmp_path / f"{name}.jsonl")])
    one, cp4, plain = (records(tmp_path / f"{name}.jsonl") for name in runs)
    assert len(one) == len(cp4) == 6
    for a, b in zip(one, cp4):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-4 * a["lm_loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], (a, b)
    assert any(abs(a["lm_loss"] - b["lm_loss"]) > 1e-3 * b["lm_loss"] for a, b in zip(one, plain))


def test_sliding_window_under_context_parallelism_equals_single_process(tmp_path, pretrain_job):
    """--window-size under --cp-comm-type a2a and allgather (Transformer Engine's context-parallel types for a
    sliding window; it was refused with any CP): CP=2 logs what one process logs (with the a2a head split
    under TP=2 too), and the window changes the run. The ring is still refused, in one line."""
    args = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-iters 4 "
        "--global-batch-size 4 --micro-batch-size 2 --lr 3e-3 --log-interval 1 --eval-iters 0 --hidden-dropout 0 "
        "--attention-dropout 0 --normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear "
        "--distributed-backend gloo"
    ).split()
    window = ["--window-size", "5,0"]
    pretrain_job(1, [*args, *window, "--log-jsonl", str(tmp_path / "one.jsonl")])
    pretrain_job(1, [*args, "--log-jsonl", str(tmp_path / "full.jsonl")])
    one, full = records(tmp_path / "one.jsonl"), records(tmp_path / "full.jsonl")
    assert abs(one[-1]["lm_loss"] - full[-1]["lm_loss"]) > 1e-3  # (the window hides keys the run would see)
    for name, n, extra in (
        ("a2a", 2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
        ("allgather", 2, ["--context-parallel-size", "2", "--cp-comm-type", "allgather"]),
        ("tp2_a2a", 4, "--context-parallel-size 2 --cp-comm-type a2a --tensor-model-parallel-size 2".split()),
    ):
        pretrain_job(n, [*args, *window, *extra, "--log-jsonl", str(tmp_path / f"{name}.jsonl")])
        cp = records(tmp_path / f"{name}.jsonl")
        assert len(cp) == len(one) == 4, name
        for a, b in zip(one, cp):
            assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-5 * a["lm_loss"], (name, a, b)
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (name, a, b)
    from megatron_lite.arguments import parse_args
    from megatron_lite.config import ConfigError
    from megatron_lite.layout_validation import validate_layout

    _, job = parse_args([*args, *window, "--context-parallel-size", "2", "--mock-data", "--vocab-size", "100"])
    with pytest.raises(ConfigError, match="--window-size with --cp-comm-type p2p is not supported"):
        validate_layout(job.model, job.parallel, 2, job.training)
