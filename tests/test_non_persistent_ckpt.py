"""Megatron's non-persistent checkpoints (checkpoint/non_persistent.py): saved at multiples of
--non-persistent-save-interval that are not --save-interval's, only the newest kept, and at start-up taken when
newer than the persistent checkpoint. A run stopped after one continues as the uninterrupted run did (the oracle:
that run's own per-iteration lm_loss and grad norm)."""

from __future__ import annotations

import os
import shutil

import pytest
from test_pretrain_cli import TINY, _one_line_error, _run
from test_pretrain_torchrun import records

from megatron_lite.config import ConfigError


def _stop_after_iteration_7(ckpt) -> None:
    """What a run killed in iteration 7 or 8 leaves: the persistent checkpoint of 4 and the non-persistent one of 6
    (iteration 8's persistent save never happened)."""
    shutil.rmtree(ckpt / "iter_0000008")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")


def _inspect(argv: list[str]) -> str:
    import contextlib
    import importlib.util
    import io

    where = os.path.join(os.path.dirname(__file__), "..", "tools", "checkpoint", "inspect_checkpoint.py")
    spec = importlib.util.spec_from_file_location("inspect_checkpoint", where)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert tool.main(argv) == 0
    return out.getvalue()


def _same(a: list[dict], b: list[dict], rel: float = 0.0) -> None:
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b], (a, b)
    for x, y in zip(a, b):
        for k in ("lm_loss", "grad_norm"):
            assert abs(x[k] - y[k]) <= rel * abs(x[k]), (k, x, y)


def test_global_resumes_from_the_newer_one_and_keeps_only_the_newest(tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "ckpt"
    flags = ["--mock-data", "--vocab-size", "100", "--train-iters", "8", "--save", str(ckpt), "--save-interval", "4",
             "--non-persistent-save-interval", "3", "--non-persistent-ckpt-type", "global"]  # fmt: skip
    rc, out, err = _run([*flags, "--log-jsonl", str(tmp_path / "straight.jsonl")], capsys, monkeypatch)
    assert rc == 0, err
    # saved at 3 and 6 (not at 4 and 8: persistent saves there), each replacing the one before
    assert "non_persistent/iter_0000003 (non-persistent)" in out and "non_persistent/iter_0000006" in out
    assert "iter_0000004 (non-persistent)" not in out and "iter_0000008 (non-persistent)" not in out
    assert sorted(os.listdir(ckpt / "non_persistent")) == ["iter_0000006", "latest_checkpointed_iteration.txt"]
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("iter_")) == ["iter_0000004", "iter_0000008"]
    _stop_after_iteration_7(ckpt)
    # --ckpt-step 6 names the non-persistent checkpoint, which it does not look at under --save: said, and the
    # command it gives loads it (an exploratory run: it said only that 6 was not there)
    rc, _, err = _run([*flags, "--load", str(ckpt), "--ckpt-step", "6"], capsys, monkeypatch)
    hint = f"--load {ckpt / 'non_persistent'} --ckpt-step 6 --no-auto-resume loads it"
    _one_line_error(rc, err, "has no complete checkpoint of iteration 6 (it has [4])", hint)
    # (with the same --save, which holds checkpoints: a review found the hint without --no-auto-resume resumed
    # from the --save's newest instead, --ckpt-step dropped unsaid)
    given = [*flags, *hint.removesuffix(" loads it").split(), "--train-iters", "7", "--save-interval", "100"]
    rc, out, err = _run(given, capsys, monkeypatch)
    assert rc == 0 and "iteration 6, 24 samples consumed" in out, err
    shutil.rmtree(ckpt / "iter_0000007")  # (its save at the end)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    given = [a for a in given if a != "--no-auto-resume"]
    rc, out, err = _run([*given, "--train-iters", "5"], capsys, monkeypatch)
    assert rc == 0 and "(--ckpt-step 6 was for --load: --no-auto-resume keeps it)" in out, err
    # the same command again: the non-persistent checkpoint of 6 is newer than the persistent one of 4
    rc, out, err = _run([*flags, "--log-jsonl", str(tmp_path / "resumed.jsonl")], capsys, monkeypatch)
    assert rc == 0, err
    assert "resuming from the non-persistent checkpoint" in out and "iteration 6, 24 samples consumed" in out
    straight, resumed = records(tmp_path / "straight.jsonl"), records(tmp_path / "resumed.jsonl")
    assert len(straight) == 8
    _same(straight[6:], resumed)  # bit for bit
    # now the persistent one (8, saved at the end) is newer: it is taken, and said so
    rc, out, err = _run(
        [*flags[:-4], "--train-iters", "9", "--non-persistent-ckpt-type", "global"], capsys, monkeypatch
    )
    assert rc == 0, err
    assert "iteration 6) is older than" in out and "loaded " + str(ckpt / "iter_0000008") in out


def test_local_at_dp2_resumes_and_another_layout_takes_the_persistent_one(tmp_path, pretrain_job):
    """Each rank's own files (async, under the distributed optimizer): a DP=2 run stopped after a local save
    continues bit for bit, also when one rank holds a newer one the other never published (the newest both hold,
    as Megatron's find_latest); under other gradient buckets, or on one process, the local checkpoints are passed
    over for the persistent one, and that run equals the DP=2 one (a one-process run of the same global batch; no
    dropout, whose draws differ by rank)."""
    local, ckpt = tmp_path / "local", tmp_path / "ckpt"
    args = ["--mock-data", "--vocab-size", "100", *TINY, "--train-iters", "8", "--distributed-backend", "gloo",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            "--save", str(ckpt), "--save-interval", "4", "--non-persistent-save-interval", "3",
            "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", str(local),
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--async-save"]  # fmt: skip
    (local / "0" / "iter_0000002.tmp").mkdir(parents=True)  # a save killed part-way: swept by the next one
    out = pretrain_job(2, [*args, "--log-jsonl", str(tmp_path / "straight.jsonl")])
    assert "async non-persistent save started" in out
    for rank in (0, 1):  # each rank's own, the newest only
        assert sorted(os.listdir(local / str(rank))) == ["iter_0000006", "latest_checkpointed_iteration.txt"]
        assert sorted(os.listdir(local / str(rank) / "iter_0000006")) == [
            f"index_r0000{rank}.json", "metadata.json", f"rng_r0000{rank}.safetensors",
            f"tensors_r0000{rank}.safetensors",
        ]  # fmt: skip
    assert not (ckpt / "non_persistent").exists()
    # inspected, a rank's own files say they are its part (the optimizer's shard), not a whole checkpoint (from an
    # exploratory run: full shapes, parameters and 'checksums verified' were all it said)
    shown = _inspect([str(local / "0" / "iter_0000006"), "--verify"])
    assert "one rank's part of a local non-persistent checkpoint" in shown and "% held)" in shown, shown
    assert "partial" not in _inspect([str(ckpt / "iter_0000008")])
    from megatron_lite.checkpoint.checkpointing import read_metadata
    from megatron_lite.checkpoint.reader import Reader

    own = str(local / "0" / "iter_0000006")
    reader = Reader(own, read_metadata(own))
    import math

    def held(rec) -> int:
        return sum(math.prod(pc["box"][1]) for pc in rec["pieces"])

    # (a moment the rank holds only part of: its shard of the distributed optimizer's buckets)
    name, rec = next((n, r) for n, r in reader.index.items() if held(r) < math.prod(r["shape"]))
    with pytest.raises(ConfigError, match="one rank's part of a local non-persistent checkpoint"):
        reader.read_box(name, (0,) * len(rec["shape"]), tuple(rec["shape"]))
    _stop_after_iteration_7(ckpt)
    out = pretrain_job(2, [*args, "--log-jsonl", str(tmp_path / "resumed.jsonl")])
    assert "resuming from the non-persistent checkpoint" in out and "iteration 6, 24 samples consumed" in out
    straight = records(tmp_path / "straight.jsonl")
    _same(straight[6:], records(tmp_path / "resumed.jsonl"))  # bit for bit
    # rank 1 killed before publishing 9 (rank 0's, a copy standing in for it, is never read): both hold 6
    _stop_after_iteration_7(ckpt)
    shutil.copytree(local / "0" / "iter_0000006", local / "0" / "iter_0000009")
    (local / "0" / "latest_checkpointed_iteration.txt").write_text("9")
    out = pretrain_job(2, [*args, "--log-jsonl", str(tmp_path / "common.jsonl")])
    assert out.count("resuming from the non-persistent checkpoint") == 1
    assert "loaded " + str(local / "0" / "iter_0000006") in out
    _same(straight[6:], records(tmp_path / "common.jsonl"))
    shutil.rmtree(local / "0" / "iter_0000009")
    (local / "0" / "latest_checkpointed_iteration.txt").write_text("6")
    # a byte flipped in rank 0's own tensors (same size): its sha256 is checked by its rank (from a review: the
    # world's share split left rank 0 hashing only its RNG file, and the run resumed from the corrupted weights)
    tensors = local / "0" / "iter_0000006" / "tensors_r00000.safetensors"
    good = tensors.read_bytes()
    tensors.write_bytes(good[:-100] + bytes([good[-100] ^ 1]) + good[-99:])
    _stop_after_iteration_7(ckpt)
    out = pretrain_job(2, args, exit_code=2)
    assert "fails its sha256 check" in out or "sha256" in out, out[-3000:]
    tensors.write_bytes(good)
    # a rank without its own (a node's disk replaced): every rank starts from the persistent checkpoint
    # (the failed run above left iteration 8 unsaved, as _stop_after_iteration_7 does)
    shutil.rmtree(local / "1")
    out = pretrain_job(2, args)
    assert "the ranks hold no local non-persistent checkpoint of the same iteration (rank 0: [6]; rank 1: none)" in out
    assert "loaded " + str(ckpt / "iter_0000004") in out
    # other gradient buckets give each rank other parts of the distributed optimizer's state
    _stop_after_iteration_7(ckpt)
    out = pretrain_job(2, [*args, "--ddp-bucket-size", "500"])
    assert "another layout (ddp_bucket_size the default then, 500 now)" in out
    assert "loaded " + str(ckpt / "iter_0000004") in out
    _stop_after_iteration_7(ckpt)
    out = pretrain_job(1, [*args, "--log-jsonl", str(tmp_path / "one.jsonl")])
    assert "another layout (world_size 2 then, 1 now, ddp_bucket_size 500 then, the default now)" in out, out
    assert "loaded " + str(ckpt / "iter_0000004") in out
    _same(straight[4:], records(tmp_path / "one.jsonl"), rel=1e-5)


def test_global_exit_load_alone_and_rollback(tmp_path, capsys, monkeypatch):
    """An --exit-interval exit right after a non-persistent save makes no other save (Megatron's
    checkpoint_and_decide_exit); a --load holding that one beside a log (no tracker) loads it, as Megatron; a
    rollback after a later non-persistent save deleted the one the run started from goes back to that save."""
    s = tmp_path / "s"
    flags = ["--mock-data", "--vocab-size", "100", "--save-interval", "100", "--non-persistent-save-interval", "3",
             "--non-persistent-ckpt-type", "global"]  # fmt: skip
    rc, out, err = _run([*flags, "--save", str(s), "--train-iters", "12", "--exit-interval", "6"], capsys, monkeypatch)
    assert rc == 0, err
    assert "iteration 6 was just saved non-persistently: no exit save" in out
    assert sorted(os.listdir(s)) == ["non_persistent"] and os.listdir(s / "non_persistent")[0] == "iter_0000006"
    (s / "train.jsonl").write_text("{}\n")  # (a job's log)
    rc, out, err = _run(
        [*flags, "--load", str(s), "--save", str(tmp_path / "t"), "--train-iters", "6"], capsys, monkeypatch
    )
    assert rc == 0, err
    assert "loaded " + str(s / "non_persistent" / "iter_0000006") in out
    # resumed from 6 (auto-resume), which the save of 9 deletes; a NaN at 11 goes back to 9
    monkeypatch.setenv("MEGATRON_LITE_INJECT_FAULT", "nan,rank=0,iteration=11")
    rc, out, err = _run(
        [*flags, "--save", str(s), "--train-iters", "12", "--nan-policy", "rollback"], capsys, monkeypatch
    )
    assert rc == 0, err
    assert "rolled back to " + str(s / "non_persistent" / "iter_0000009") + ": iteration 9, sample 36" in out


def test_lora_never_records_a_non_persistent_base(tmp_path, capsys, monkeypatch):
    """A LoRA run from a base whose newest is a non-persistent checkpoint (tied with the persistent one) records
    the persistent one of that iteration, so it resumes after its run deleted the non-persistent one; without a
    persistent one it saves whole checkpoints, and QLoRA (adapters only) is refused in one line."""
    import json

    base, lora = tmp_path / "base", tmp_path / "lora"
    flags = ["--mock-data", "--vocab-size", "100", "--non-persistent-ckpt-type", "global"]
    pre = [*flags, "--save", str(base), "--save-interval", "4", "--non-persistent-save-interval", "3"]
    rc, out, err = _run([*pre, "--train-iters", "6"], capsys, monkeypatch)  # non-persistent 6; persistent 4 and 6
    assert rc == 0, err
    tune = [*flags, "--load", str(base), "--finetune", "--lora-rank", "4"]
    rc, out, err = _run([*tune, "--save", str(lora), "--train-iters", "2"], capsys, monkeypatch)
    assert rc == 0, err
    assert "loaded " + str(base / "non_persistent" / "iter_0000006") in out
    meta = json.loads((lora / "iter_0000002" / "metadata.json").read_text())
    assert meta["config"]["lora"]["base"] == str(base / "iter_0000006")
    shutil.rmtree(base / "non_persistent" / "iter_0000006")  # (the pretraining run's next save deletes it)
    rc, out, err = _run([*tune, "--save", str(lora), "--train-iters", "3"], capsys, monkeypatch)  # (auto-resume)
    assert rc == 0, err
    assert "loaded the LoRA base " + str(base / "iter_0000006") in out
    # only the non-persistent one of 6 (a fresh one; the persistent one set aside)
    rc, out, err = _run([*pre, "--train-iters", "6", "--no-auto-resume"], capsys, monkeypatch)
    assert rc == 0, err
    os.rename(base / "iter_0000006", tmp_path / "aside")
    (base / "latest_checkpointed_iteration.txt").write_text("4")
    rc, out, err = _run([*tune, "--save", str(tmp_path / "whole"), "--train-iters", "1"], capsys, monkeypatch)
    assert rc == 0, err
    assert "is a non-persistent checkpoint, which a later save of its run deletes" in out
    assert (
        json.loads((tmp_path / "whole" / "iter_0000001" / "metadata.json").read_text())["config"]["lora"]["base"]
        is None
    )
    rc, _, err = _run([*tune, "--qlora", "--save", str(tmp_path / "q")], capsys, monkeypatch)
    _one_line_error(rc, err, "--qlora: the base checkpoint", "holds no persistent checkpoint of iteration 6")


@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["--save", "S", "--non-persistent-save-interval", "5"], ["5 needs --non-persistent-ckpt-type"]),
        (["--non-persistent-save-interval", "5", "--non-persistent-ckpt-type", "global"], ["5 needs --save DIR"]),
        (["--non-persistent-ckpt-type", "local"], ["local needs --non-persistent-local-ckpt-dir"]),
        (["--non-persistent-ckpt-type", "in_memory"], ["--non-persistent-ckpt-type in_memory is not supported"]),
        (["--non-persistent-save-interval", "-1"], ["--non-persistent-save-interval -1 must be >= 0"]),
        (  # (checked before any process group: WORLD_SIZE 2 on one process)
            ["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "L",
             "--pipeline-model-parallel-size", "2", "--distributed-backend", "gloo"],
            ["--pipeline-model-parallel-size 2 and tied embeddings", "--untie-embeddings-and-output-weights"],
        ),
    ],
)  # fmt: skip
def test_bad_flags_are_one_line(extra, fragments, capsys, monkeypatch):
    world = 2 if "--pipeline-model-parallel-size" in extra else 1
    rc, _, err = _run(["--mock-data", "--vocab-size", "100", *extra], capsys, monkeypatch, world=world)
    _one_line_error(rc, err, *fragments)
