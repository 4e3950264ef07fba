"""Resuming through the entry point: checkpoints and the flags that conflict with them, schedules on resume, --load
alone, --no-save-optim, sample-based runs, --finetune. (Split from tests/test_pretrain_cli.py.)"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from test_pretrain_cli import TINY, _dataset, _one_line_error, _run

from megatron_lite.data.indexed import IndexedDatasetWriter
from megatron_lite.training.pretrain import main


def test_flag_conflicting_with_checkpoint(tmp_path, capsys, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    rc, _, err = _run(["--mock-data", "--vocab-size", "100", "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    argv = ["--mock-data", "--vocab-size", "100", "--load", ckpt, "--train-iters", "5"]
    rc, _, err = _run([*argv, "--hidden-size", "64"], capsys, monkeypatch)
    _one_line_error(rc, err, "--hidden-size 64", "conflicts with the checkpoint", "(32)", "--use-checkpoint-args")
    # a value the parser converts is shown as given, then as read (it said "--window-size 8" for 7,0); a switch
    # as it is (not with the next flag as its text)
    rc, _, err = _run([*argv, "--window-size", "7,0"], capsys, monkeypatch)
    _one_line_error(rc, err, "--window-size 7,0 (read as 8) conflicts with the checkpoint")
    rc, _, err = _run([*argv, "--swiglu", "--lr", "1e-3"], capsys, monkeypatch)
    _one_line_error(rc, err, "--swiglu conflicts with the checkpoint")
    # another vocabulary padding is a layout, not an architecture: the same run continues (it was refused)
    curves = []
    for extra in ([], ["--make-vocab-size-divisible-by", "7"]):
        rc, out, err = _run([*argv, *extra], capsys, monkeypatch)
        assert rc == 0, err
        curves.append([line.split("lm loss")[1].split("| number")[0] for line in out.splitlines() if "lm loss" in line])
    assert len(curves[0]) == 2 and curves[0] == curves[1]
    # With --use-checkpoint-args the checkpoint's architecture wins and training continues from it.
    rc, out, err = _run([*argv, "--hidden-size", "64", "--use-checkpoint-args"], capsys, monkeypatch)
    assert rc == 0, err
    assert "loaded" in out and "iteration 3" in out


def test_gradient_precision_comes_back_with_the_run_and_can_be_turned_back(tmp_path, capsys, monkeypatch):
    """--grad-reduce-in-bf16 is part of the arguments a checkpoint restores; Megatron's
    --accumulate-allreduce-grads-in-fp32 takes a resumed run back to fp32 gradients (there is no --no- form)."""
    ckpt = str(tmp_path / "ckpt")
    flags = ["--mock-data", "--vocab-size", "100", "--bf16", "--grad-reduce-in-bf16", "--save", ckpt]
    rc, out, err = _run(flags, capsys, monkeypatch)
    assert rc == 0 and "gradients reduced in bfloat16" in out, err
    assert main(["--load", ckpt, "--train-iters", "4"]) == 0
    assert "gradients reduced in bfloat16" in capsys.readouterr().out
    assert main(["--load", ckpt, "--train-iters", "5", "--accumulate-allreduce-grads-in-fp32"]) == 0
    out = capsys.readouterr().out
    assert "gradients reduced in float32" in out and "overrides --grad-reduce-in-bf16" in out


def _lrs(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"\| learning rate: ([0-9.E+-]+) \|", out)]


def test_schedule_flags_on_resume_follow_megatron(tmp_path, capsys, monkeypatch):
    """Resuming with other schedule flags: they apply, with a line saying so (Megatron stops unless
    --override-opt_param-scheduler, which says the same and is silent); --use-checkpoint-opt_param-scheduler
    keeps the checkpoint's schedule whatever the flags say; both at once are refused."""
    ckpt = str(tmp_path / "ckpt")
    first = ["--mock-data", "--vocab-size", "100", "--save", ckpt, "--lr-decay-style", "cosine", "--train-iters", "8"]
    rc, _, err = _run([*first, "--exit-interval", "3"], capsys, monkeypatch)  # saved at iteration 3 of 8
    assert rc == 0, err
    assert main(["--load", ckpt]) == 0
    same = _lrs(capsys.readouterr().out)
    schedule = ["--lr", "5e-3", "--min-lr", "1e-4", "--lr-decay-style", "linear"]
    assert main(["--load", ckpt, *schedule, "--use-checkpoint-opt_param-scheduler"]) == 0
    out = capsys.readouterr().out
    assert _lrs(out) == same and len(same) == 5, (_lrs(out), same)
    assert main(["--load", ckpt, "--lr", "5e-3"]) == 0
    out = capsys.readouterr().out
    assert _lrs(out) != same and "--lr 0.005 differs from the checkpoint's 0.001" in out
    assert main(["--load", ckpt, "--lr", "5e-3", "--override-opt_param-scheduler"]) == 0
    out = capsys.readouterr().out
    assert _lrs(out) != same and "differs from the checkpoint" not in out
    # a longer run under the checkpoint's schedule: its decay ends where it did (iteration 8), held at --min-lr
    assert main(["--load", ckpt, "--train-iters", "10", "--use-checkpoint-opt_param-scheduler"]) == 0
    longer = _lrs(capsys.readouterr().out)
    assert longer[:5] == same and longer[5:] == [0.0, 0.0], longer
    rc = main(["--load", ckpt, "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"])
    _one_line_error(
        rc, capsys.readouterr().err, "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"
    )


def test_ckpt_step_loads_that_iteration_or_names_the_ones_there(tmp_path, capsys, monkeypatch):
    """Megatron's --ckpt-step: the checkpoint of that iteration instead of the newest; one that is not there, or
    no --load, is a one-line error naming what is."""
    ckpt = str(tmp_path / "ckpt")
    data = ["--mock-data", "--vocab-size", "100"]
    rc, _, err = _run([*data, "--save", ckpt, "--save-interval", "2"], capsys, monkeypatch)
    assert rc == 0 and sorted(os.listdir(ckpt))[:2] == ["iter_0000002", "iter_0000003"], err
    rc, out, err = _run([*data, "--load", ckpt, "--ckpt-step", "2"], capsys, monkeypatch)
    assert rc == 0 and "iteration 2," in out and "iteration        3/" in out, err
    rc, _, err = _run([*data, "--load", ckpt, "--ckpt-step", "1"], capsys, monkeypatch)
    _one_line_error(rc, err, "--ckpt-step 1", "no complete checkpoint of iteration 1", "[2, 3]")
    rc, _, err = _run([*data, "--ckpt-step", "2"], capsys, monkeypatch)
    _one_line_error(rc, err, "--ckpt-step 2", "give --load DIR")


def test_a_rollback_goes_back_to_a_checkpoint_not_past_the_iteration(tmp_path, capsys, monkeypatch):
    """Started from iteration 1 (--ckpt-step) in a directory that also holds 2 to 4 of an earlier run, a NaN at
    iteration 3 rolls back to 1, where this job started: never forward to 4, nor to the earlier run's 2 (the run
    the job went back from; tests/test_run_control.py)."""
    ckpt = str(tmp_path / "ckpt")
    data = ["--mock-data", "--vocab-size", "100", "--train-iters", "4", "--save", ckpt]
    rc, _, err = _run([*data, "--save-interval", "1"], capsys, monkeypatch)
    assert rc == 0, err
    monkeypatch.setenv("MEGATRON_LITE_INJECT_FAULT", "nan,rank=0,iteration=3")
    rc, out, err = _run([*data, "--load", ckpt, "--ckpt-step", "1", "--nan-policy", "rollback"], capsys, monkeypatch)
    assert rc == 0 and "rolled back to" in out, out + err
    assert "rolled back to " + ckpt + "/iter_0000001: iteration 1" in out and "iter_0000004: iteration 4" not in out


def test_weight_decay_increment_flags(capsys, monkeypatch):
    rc, out, err = _run(
        ["--mock-data", "--vocab-size", "100", "--weight-decay-incr-style", "linear"]
        + ["--start-weight-decay", "0.0", "--end-weight-decay", "0.1"],
        capsys,
        monkeypatch,
    )
    assert rc == 0, err
    rc, _, err = _run(["--mock-data", "--vocab-size", "100", "--start-weight-decay", "0.0"], capsys, monkeypatch)
    _one_line_error(rc, err, "--start-weight-decay", "--weight-decay-incr-style linear|cosine")
    rc, _, err = _run(
        ["--mock-data", "--vocab-size", "100", "--weight-decay-incr-style", "cosine", "--end-weight-decay", "0.1"],
        capsys,
        monkeypatch,
    )
    _one_line_error(rc, err, "--weight-decay-incr-style cosine", "--start-weight-decay")


def test_load_alone_rebuilds_the_run(tmp_path, capsys, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    rc, _, err = _run(
        ["--mock-data", "--vocab-size", "100", "--save", ckpt, "--swiglu", "--normalization", "RMSNorm"]
        + ["--qk-layernorm"],
        capsys,
        monkeypatch,
    )
    assert rc == 0, err
    rc = main(["--load", ckpt, "--train-iters", "5"])  # no model, data or batch flags at all
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "loaded" in out.out and "iteration 3" in out.out and "iteration        5/       5 |" in out.out


def test_load_alone_resumes_from_another_directory(tmp_path, capsys, monkeypatch):
    """From a README walkthrough: a run given relative --data-path and --tokenizer-model, resumed with --load
    alone from another directory, stopped on "--tokenizer-model tok/tokenizer.json: no such file", a flag the
    user never gave. The checkpoint records the files by their absolute paths."""
    import tokenizers

    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (run / "data").mkdir(parents=True)
    (run / "tok").mkdir()
    elsewhere.mkdir()
    vocab = {f"w{i}": i for i in range(99)} | {"</s>": 99}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(run / "tok" / "tokenizer.json"))
    writer = IndexedDatasetWriter(str(run / "data" / "x"), 100)
    rng = torch.Generator().manual_seed(0)
    for _ in range(16):
        writer.add_document(torch.randint(1, 100, (40,), generator=rng).tolist())
    writer.finalize()
    monkeypatch.chdir(run)
    flags = ["--data-path", "data/x", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"]
    rc, _, err = _run([*flags, "tok/tokenizer.json", "--save", "ckpt", "--split", "100,0,0"], capsys, monkeypatch)
    assert rc == 0, err
    monkeypatch.chdir(elsewhere)
    rc = main(["--load", str(run / "ckpt"), "--train-iters", "4"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "iteration        4/       4 |" in out.out


def test_num_query_groups_without_gqa_is_said_and_resumes(tmp_path, capsys, monkeypatch):
    """--num-query-groups without --group-query-attention has no effect (as in Megatron): start-up says so, and
    the same flags resume its checkpoint (they were refused, the checkpoint's groups read as 1)."""
    flags = ["--mock-data", "--vocab-size", "100", "--num-query-groups", "2"]
    rc, out, err = _run([*flags, "--save", str(tmp_path / "c")], capsys, monkeypatch)
    assert rc == 0, err
    assert "--num-query-groups 2 has no effect without --group-query-attention" in out
    rc, out, err = _run([*flags, "--load", str(tmp_path / "c"), "--train-iters", "4"], capsys, monkeypatch)
    assert rc == 0, err
    assert "iteration        4/       4 |" in out


def test_sgd_run(capsys, monkeypatch):
    flags = ["--mock-data", "--vocab-size", "100", "--optimizer", "sgd", "--sgd-momentum", "0.5"]
    rc, out, err = _run(flags, capsys, monkeypatch)
    assert rc == 0 and "iteration        3/       3 |" in out, err


def test_no_save_optim_and_rng(tmp_path, capsys, monkeypatch):
    """--no-save-optim writes the weights alone and --no-save-rng no RNG files; resuming such a checkpoint asks
    for --no-load-optim (or --finetune) in one line instead of silently starting Adam over."""
    from megatron_lite.checkpoint.checkpointing import read_metadata

    ckpt = tmp_path / "ckpt"
    flags = ["--mock-data", "--vocab-size", "100", "--save", str(ckpt), "--no-save-optim", "--no-save-rng"]
    rc, _, err = _run(flags, capsys, monkeypatch)
    assert rc == 0, err
    saved = ckpt / "iter_0000003"
    assert not list(saved.glob("rng_r*")) and read_metadata(str(saved))["optimizer_saved"] is False
    index = json.loads((saved / "index_r00000.json").read_text())["tensors"]
    assert index and all(k.startswith("model/") for k in index)
    rc = main(["--load", str(ckpt), "--train-iters", "5"])
    _one_line_error(rc, capsys.readouterr().err, "--no-save-optim", "--no-load-optim")
    assert main(["--load", str(ckpt), "--train-iters", "5", "--no-load-optim"]) == 0
    assert "iteration        5/       5 |" in capsys.readouterr().out
    # and a full checkpoint keeps both
    rc, _, err = _run(["--mock-data", "--vocab-size", "100", "--save", str(tmp_path / "full")], capsys, monkeypatch)
    full = tmp_path / "full" / "iter_0000003"
    assert list(full.glob("rng_r*")) and read_metadata(str(full))["optimizer_saved"] is True
    # a job restarted on its own --save (auto-resume) goes on from the weights, as --no-load-optim would
    rc, out, err = _run([*flags, "--train-iters", "5"], capsys, monkeypatch)
    assert (
        rc == 0
        and "resuming from the weights with fresh optimizer state" in out
        and "iteration        5/       5 |" in out
    )


def test_no_save_optim_saves_the_current_weights_under_overlapped_gathers(tmp_path, capsys, monkeypatch):
    """--overlap-param-gather leaves the last step's weights in flight until the next forward: a weights-only
    checkpoint waits for them like a full one (it saved the weights before the last step)."""
    from safetensors.torch import load_file

    zero = ["--mock-data", "--vocab-size", "100", "--use-distributed-optimizer", "--overlap-param-gather"]
    weights = {}
    for name, extra in (("full", []), ("weights", ["--no-save-optim"])):
        rc, _, err = _run([*zero, *extra, "--save", str(tmp_path / name)], capsys, monkeypatch)
        assert rc == 0, err
        tensors = load_file(str(tmp_path / name / "iter_0000003" / "tensors_r00000.safetensors"))
        weights[name] = {k: v for k, v in tensors.items() if k.startswith("model/")}
    assert weights["full"].keys() == weights["weights"].keys()
    assert all(torch.equal(weights["full"][k], weights["weights"][k]) for k in weights["full"])


def test_sample_based_run(tmp_path, capsys, monkeypatch):
    """--train-samples 10 at a global batch of 4: 2 iterations (Megatron's samples // batch), the warmup over 6
    samples ending inside the second step."""
    import json

    log = tmp_path / "m.jsonl"
    tiny = [a for a in TINY if a not in ("--train-iters", "3")]
    argv = [*tiny, "--train-samples", "10", "--lr-warmup-samples", "6", "--lr-decay-style", "constant",
            "--mock-data", "--vocab-size", "100", "--log-jsonl", str(log),
            "--save", str(tmp_path / "ckpt")]  # fmt: skip
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert main(argv) == 0, capsys.readouterr().err
    assert "--train-samples 10: 2 iterations of 4 samples" in capsys.readouterr().out
    train = [json.loads(line) for line in log.read_text().splitlines() if '"lm_loss"' in line]
    assert [r["iteration"] for r in train] == [1, 2]
    assert train[0]["lr"] == 0.0 and train[1]["lr"] == pytest.approx(1e-3 * 4 / 6)
    # --load alone continues it, sample-based (12 more samples: 3 more iterations); --train-iters switches unit
    assert main(["--load", str(tmp_path / "ckpt"), "--train-samples", "22"]) == 0
    assert "iteration        5/       5 |" in capsys.readouterr().out
    assert main(["--load", str(tmp_path / "ckpt"), "--train-iters", "6"]) == 0
    assert "iteration        6/       6 |" in capsys.readouterr().out
    for extra, fragment in (
        (["--train-iters", "3"], "--train-iters and --train-samples are exclusive"),
        (["--lr-warmup-iters", "2"], "--lr-warmup-iters 2 does not go with --train-samples"),
        (["--global-batch-size", "16"], "--train-samples 10 is less than one global batch"),
    ):
        rc = main([*argv, *extra])
        _one_line_error(rc, capsys.readouterr().err, fragment)


def test_a_run_length_in_either_unit_keeps_the_rest_of_the_checkpoints_run(tmp_path, capsys, monkeypatch):
    """Resuming with --train-iters or --train-samples replaces the run's length and schedule lengths, nothing
    else: the data paths (--train-data-path was dropped, with the embedded corpus trained on instead) and
    --eval-iters (dropped by --train-samples, for ending in "iters") stay the checkpoint's."""
    from megatron_lite.arguments import parse_args

    prefix, ckpt = _dataset(tmp_path), str(tmp_path / "ckpt")
    argv = ["--train-data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
            "--eval-iters", "0", "--save", ckpt]  # fmt: skip
    rc, _, err = _run([*argv, "--train-iters", "1"], capsys, monkeypatch)
    assert rc == 0, err
    for length in (["--train-iters", "9"], ["--train-samples", "40"], []):
        ns, _ = parse_args(["--load", ckpt, *length])
        assert ns.train_data_path == [prefix] and ns.eval_iters == 0, (length, ns.train_data_path, ns.eval_iters)


def test_checkpoint_holds_only_safetensors_and_json(tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "ckpt"
    rc, _, err = _run(["--mock-data", "--vocab-size", "100", "--save", str(ckpt), "--bf16"], capsys, monkeypatch)
    assert rc == 0, err
    files = [p for p in ckpt.rglob("*") if p.is_file()]
    assert {p.suffix for p in files} == {".safetensors", ".json", ".txt"}
    for p in files:
        head = p.read_bytes()[:2]
        assert head != b"\x80\x04" and head[:1] != b"\x80", f"{p} looks like a pickle"
    import json

    from safetensors import safe_open

    index = json.loads((ckpt / "iter_0000003" / "index_r00000.json").read_text())["tensors"]
    kinds = {name.split("/")[0] for name in index}
    assert kinds == {"model", "main", "exp_avg", "exp_avg_sq"}  # bf16 weights, fp32 main weights, moments
    with safe_open(str(ckpt / "iter_0000003" / "tensors_r00000.safetensors"), framework="pt") as f:
        dtypes = {k.split("/")[0]: str(f.get_tensor(k).dtype) for k in f.keys()}
    assert dtypes["model"] == "torch.bfloat16" and dtypes["main"] == "torch.float32"
    # The vocabulary is stored unpadded (100 + the NullTokenizer's end-of-document id), whatever the padding.
    assert index["model/embedding.word_embeddings.weight"]["shape"] == [101, 32]


def test_finetune_and_no_load_optim(tmp_path, capsys, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    rc, _, err = _run(["--mock-data", "--vocab-size", "100", "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    rc, out, err = _run(["--mock-data", "--vocab-size", "100", "--load", ckpt, "--finetune"], capsys, monkeypatch)
    assert rc == 0, err
    assert "loaded" in out and "iteration 0" in out and "iteration        3/       3 |" in out  # trained 3 more from 0
    rc, out, err = _run(
        ["--mock-data", "--vocab-size", "100", "--load", ckpt, "--no-load-optim", "--train-iters", "5"],
        capsys,
        monkeypatch,
    )
    assert rc == 0, err
    assert "iteration 3" in out and "iteration        5/       5 |" in out
    # From a review: with --save the same directory as --load, --finetune overwrote the base's checkpoints with its
    # own (iterations from 0) and a restart fine-tuned from the base again: refused; --no-load-optim there is
    # applied again by every restart of the command: said
    same = ["--mock-data", "--vocab-size", "100", "--load", ckpt, "--save", ckpt]
    rc, _, err = _run([*same, "--finetune"], capsys, monkeypatch)
    _one_line_error(rc, err, "--finetune with --save the same directory as --load", "give --save another directory")
    rc, out, err = _run([*same, "--no-load-optim", "--train-iters", "6"], capsys, monkeypatch)
    assert rc == 0 and "--no-load-optim with --save the same directory as --load: a restart of this command" in out


def test_a_checkpoint_records_its_files_by_absolute_path_and_leaves_weights_and_names(tmp_path, monkeypatch):
    """(From the diff review) an SFT job's JSONL, the data cache and a blend's prefixes become absolute; a blend's
    weights stay numbers even where a file of that name exists, and a Hub tokenizer name stays as given."""
    import dataclasses

    from megatron_lite.arguments import parse_args

    monkeypatch.chdir(tmp_path)
    for f in ("1.idx", "pre.idx", "pre.bin", "train.jsonl"):
        (tmp_path / f).write_text("")
    (tmp_path / "cache").mkdir()
    _, job = parse_args([*TINY, "--vocab-size", "100", "--data-path", "1", "pre", "--data-cache-path", "cache"])
    job = dataclasses.replace(job, data=dataclasses.replace(job.data, tokenizer_model="org/model"))
    data = job.checkpoint_dict()["data"]
    assert list(data["data_path"]) == ["1", str(tmp_path / "pre")]
    assert data["data_cache_path"] == str(tmp_path / "cache") and data["tokenizer_model"] == "org/model"
    sft = dataclasses.replace(job, data=dataclasses.replace(job.data, data_path=("train.jsonl",), sft=True))
    assert list(sft.checkpoint_dict()["data"]["data_path"]) == [str(tmp_path / "train.jsonl")]


def test_a_run_with_nothing_to_train_saves_nothing(tmp_path, capsys, monkeypatch):
    """A rerun already at its --train-iters trains nothing and writes nothing into --save: the final save of
    iteration 3 again rewrote the finished checkpoint with this command's flags (--train-iters 2), which a
    later --load alone inherited."""
    ckpt = tmp_path / "ckpt"
    argv = ["--mock-data", "--vocab-size", "100", "--save", str(ckpt), "--load", str(ckpt)]
    rc, _, err = _run(argv, capsys, monkeypatch)
    assert rc == 0, err
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in ckpt.rglob("*") if p.is_file()}
    rc, out, err = _run([*argv, "--train-iters", "2"], capsys, monkeypatch)
    assert rc == 0, err
    assert "already at iteration 3 of --train-iters 2: nothing to train" in out and "] saved " not in out, out
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in ckpt.rglob("*") if p.is_file()}
    assert after == before
    assert "already holds iteration 3: nothing saved" in out, out
    # a checkpoint loaded from elsewhere is still saved into --save, as Megatron saves it (from a review: --load A
    # --save B left B empty, and a run whose last iteration was saved only non-persistently never saved it)
    other = tmp_path / "other"
    rc, out, err = _run(["--mock-data", "--vocab-size", "100", "--load", str(ckpt), "--save", str(other)],
                        capsys, monkeypatch)  # fmt: skip
    assert rc == 0 and "nothing to train" in out and (other / "iter_0000003" / "metadata.json").exists(), out
    np_run = [
        "--mock-data",
        "--vocab-size",
        "100",
        "--save",
        str(tmp_path / "np"),
        "--save-interval",
        "100",
        "--non-persistent-save-interval",
        "2",
        "--non-persistent-ckpt-type",
        "global",
        "--train-iters",
        "4",
    ]
    rc, out, err = _run([*np_run, "--exit-interval", "4"], capsys, monkeypatch)  # fmt: skip
    assert rc == 0 and "no exit save" in out and not (tmp_path / "np" / "iter_0000004").exists(), out
    rc, out, err = _run(np_run, capsys, monkeypatch)
    assert rc == 0 and "nothing to train" in out and (tmp_path / "np" / "iter_0000004" / "metadata.json").exists()


def test_a_vocabulary_larger_than_the_checkpoints_names_its_source_and_the_value_that_works(
    tmp_path, capsys, monkeypatch
):
    """A checkpoint of vocabulary 101 (NullTokenizer: --vocab-size 100 + the end-of-document id). --mock-data
    --vocab-size 101 was told "the tokenizer/--vocab-size gives a vocabulary of 102", not the --vocab-size that
    works; with no data flags, "a vocabulary of 4096" without saying it is the built-in corpus's tokenizer."""
    from megatron_lite.arguments import parse_args
    from megatron_lite.checkpoint.checkpointing import find_checkpoint
    from megatron_lite.config import ConfigError
    from megatron_lite.training.resume import start_from

    ckpt = str(tmp_path / "ckpt")
    rc, _, err = _run(["--mock-data", "--vocab-size", "100", "--save", ckpt, "--train-iters", "1"], capsys, monkeypatch)
    assert rc == 0, err
    rc, _, err = _run(["--mock-data", "--vocab-size", "101", "--load", ckpt], capsys, monkeypatch)
    _one_line_error(rc, err, "--vocab-size 101 gives a vocabulary of 102 (Megatron's NullTokenizer adds an end-of-",
                    "has 101; give --vocab-size 100")  # fmt: skip
    _, job = parse_args(TINY)  # (no data flags: the built-in corpus, whose tokenizer has 4096 ids)
    with pytest.raises(ConfigError) as e:
        start_from(job, find_checkpoint(ckpt), 4096, 1, lambda *_: None)
    assert "with no data flags the built-in corpus's tokenizer gives a vocabulary of 4096" in str(e.value)
    assert "has 101; give the data and tokenizer it was trained with" in str(e.value)
    assert "--mock-data --vocab-size 100" in str(e.value)


# The ModelConfig fields a resume does not take from the checkpoint, and why: precision, initialisation,
# recomputation, kernels and QK-clip are the run's choices (Megatron reads none of them from a checkpoint either).
# (the same math either way, or only the initialisation, which a loaded checkpoint replaces; fp8, --qk-clip, an fp32
# residual stream and --embedding-init-method-std, whose weight decay it turns off, were listed here: a resume
# dropped them without a word)
NOT_RESTORED = {
    "init_method_xavier_uniform", "recompute_granularity", "recompute_method", "recompute_num_layers",
    "recompute_modules", "kernel_impl",
}  # fmt: skip


def test_every_model_setting_with_a_flag_comes_back_with_the_checkpoint(tmp_path, capsys, monkeypatch):
    """Each ModelConfig field a flag sets is restored by --load, but the listed run choices: --rotary-interleaved
    was not, so a converted Llama 4 (or any interleaved run) resumed rotating halves (logits 39% off transformers'),
    saying nothing. A --rotary-interleaved run's checkpoint, loaded with no model flag, rotates interleaved."""
    import dataclasses

    from megatron_lite.arguments import parse_args
    from megatron_lite.checkpoint_flags import defaults_from_checkpoint
    from megatron_lite.config import ModelConfig
    from megatron_lite.flag_parser import build_parser

    ckpt = str(tmp_path / "ckpt")
    rc, _, err = _run(["--mock-data", "--vocab-size", "100", "--save", ckpt, "--rotary-interleaved"], capsys,
                      monkeypatch)  # fmt: skip
    assert rc == 0, err
    ns, job = parse_args(["--load", ckpt])
    assert job.model.rotary_interleaved
    dests = {a.dest for a in build_parser()._actions}
    restored = defaults_from_checkpoint(job.to_dict())
    missing = [f.name for f in dataclasses.fields(ModelConfig) if f.name in dests and f.name not in restored]
    assert set(missing) == NOT_RESTORED, sorted(set(missing) ^ NOT_RESTORED)


def test_a_checkpoints_model_config_reads_back_equal_and_hashable():
    """Through JSON every tuple field comes back a list; the reader turned three of them back, so a config with a
    window pattern or fp8's bf16 layers read back unequal and unhashable (a conversion's cached lookups failed)."""
    import dataclasses
    import json

    from megatron_lite.checkpoint.compatibility import model_config_from_dict

    from models import llama_config

    config = llama_config(sliding_window=4, window_attn_skip_freq=(1, 0), fp8_bf16_layers=(1, 0), no_rope_freq=(0, 1))
    back = model_config_from_dict(json.loads(json.dumps(dataclasses.asdict(config))))
    assert back == config and hash(back) == hash(config)


def test_precision_and_training_settings_come_back_and_a_precision_given_replaces_fp8(tmp_path, capsys, monkeypatch):
    """From an exploratory review: `--load CKPT` alone continued an fp8 run in plain bf16 (its amax histories
    ignored), a --qk-clip run unclipped, an --fp32-residual-connection run in bf16 (lm loss 7e-6, grad norm 6e-4 off
    the straight run), and an --embedding-init-method-std run with the embedding's weight decay back on. They come
    back, said at start-up; a precision given (--bf16 alone) replaces the checkpoint's fp8, as it replaces fp16."""
    from megatron_lite.arguments import parse_args

    ckpt = str(tmp_path / "ckpt")
    flags = ["--mock-data", "--vocab-size", "100", "--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "4",
             "--fp8-amax-compute-algo", "max", "--no-fp8-wgrad", "--first-last-layers-bf16",
             "--num-layers-at-start-in-bf16", "1", "--num-layers-at-end-in-bf16", "0", "--fp32-residual-connection",
             "--qk-clip", "--qk-clip-threshold", "50", "--embedding-init-method-std", "0.01",
             "--save", ckpt]  # fmt: skip
    rc, _, err = _run(flags, capsys, monkeypatch)
    assert rc == 0, err
    ns, job = parse_args(["--load", ckpt])
    m = job.model
    assert (m.fp8, m.fp8_amax_history_len, m.fp8_amax_compute_algo, m.fp8_wgrad, m.fp8_bf16_layers) == (
        "hybrid",
        4,
        "max",
        False,
        (1, 0),
    ), m
    assert (
        m.fp32_residual_connection and m.qk_clip and m.qk_clip_threshold == 50 and m.embedding_init_method_std == 0.01
    )
    assert job.optimizer.skip_embedding_weight_decay
    assert any("--fp8-format hybrid" in n and "--qk-clip" in n for n in ns.schedule_notes), ns.schedule_notes
    ns, job = parse_args(["--load", ckpt, "--bf16"])
    assert job.model.fp8 is None and job.model.fp8_bf16_layers == (0, 0) and job.model.fp32_residual_connection
    # (a review's: dropped without a word)
    said = " ".join(ns.schedule_notes)
    assert "--bf16 replaces the checkpoint's fp8 (--fp8-format hybrid)" in said, said


def test_a_resume_at_another_seq_length_is_said(tmp_path, capsys, monkeypatch):
    """Accepted, as Megatron accepts it (the samples consumed go on, now of the new length), and said at start-up
    as the schedule's changes are (an exploratory run: silent); not for --finetune, which starts the data over."""
    from megatron_lite.arguments import parse_args

    ckpt = str(tmp_path / "ckpt")
    rc, out, err = _run(["--mock-data", "--vocab-size", "100", "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    # (and the run says its padded vocabulary, as Megatron prints it: a flag-defaults review)
    assert "vocabulary 101, padded to 128 (--make-vocab-size-divisible-by x TP)" in out, out
    ns, _ = parse_args(["--load", ckpt, "--train-iters", "5", "--seq-length", "8"])
    said = " ".join(ns.schedule_notes)
    assert "--seq-length 8 differs from the checkpoint's 16: training goes on after its consumed samples" in said
    for same in (["--seq-length", "16"], ["--seq-length", "8", "--finetune"], []):
        ns, _ = parse_args(["--load", ckpt, "--train-iters", "5", *same])
        assert "differs from the checkpoint's 16" not in " ".join(ns.schedule_notes), same
