"""The pretraining entry point: --help, bad input that stops with one line before any collective, and a
real single-process run. (Multi-rank runs: tests/test_pretrain_layouts.py and tests/test_pretrain_torchrun.py.)"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_lite.data.indexed import IndexedDatasetWriter
from megatron_lite.training.pretrain import main

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 1e-3 --log-interval 1 --eval-iters 0 --train-iters 3"
).split()


def _run(argv, capsys, monkeypatch, world=1):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    rc = main([*TINY, *argv])
    out = capsys.readouterr()
    assert not dist.is_initialized()  # nothing here may ever join a process group
    return rc, out.out, out.err


def _one_line_error(rc, err, *fragments):
    assert rc == 2, err
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def _dataset(tmp_path, max_id=99, docs=40):
    prefix = str(tmp_path / "data" / "toy_text_document")
    w = IndexedDatasetWriter(prefix, vocab_size=max_id + 1)
    rng = np.random.default_rng(0)
    for _ in range(docs):
        w.add_document(rng.integers(0, max_id + 1, size=int(rng.integers(20, 60))))
    w.finalize()
    return prefix


def test_help_groups_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for group in ("model:", "distributed:", "training:", "mixed precision:", "data:", "checkpointing:", "logging:"):
        assert group in out
    assert "--use-distributed-optimizer" in out and "--tensor-model-parallel-size" in out


@pytest.mark.parametrize(
    "argv,fragments",
    [
        (["--frobnicate", "0.01"], ["--frobnicate: no such flag", "remove it"]),
        (["--lr-warmup-ratio", "0.01"], ["--lr-warmup-ratio: no such flag", "did you mean --lr-warmup-fraction?"]),
        # a spelling of one we have is named (a user told to remove it lost what it did; from a review)
        (["--save_interval", "5"], ["--save_interval: no such flag in pretrain_gpt.py, did you mean --save-interval?"]),
        (["--hiden-size", "8"], ["--hiden-size: no such flag in pretrain_gpt.py, did you mean --hidden-size?"]),
        # (not "did you mean --no-load-optim?", one edit away and its opposite: from a review of the hint)
        (["--load-optim"], ["--load-optim: no such flag in pretrain_gpt.py, it is the default (--no-load-optim is"]),
        (["--num-layers", "x"], ["--num-layers", "invalid int value: 'x'"]),
        (["--kernel-impl", "cuda"], ["--kernel-impl", "invalid choice: 'cuda'"]),
        # Megatron's other tokenizer types: why not, and what to use (it was argparse's "invalid choice")
        (["--tokenizer-type", "BertWordPieceCase"], ["BertWordPieceCase: BERT's tokenizers are for BERT models"]),
        (["--tokenizer-type", "SentencePieceTokenizer"], ["reads no SentencePiece .model files; use HuggingFace"]),
        (["--tokenizer-type", "Tik"], ["Tik: not a tokenizer type; choose from NullTokenizer, HuggingFaceTokenizer"]),
    ],
)
def test_flag_parsing_errors_are_one_line(argv, fragments, capsys):
    """argparse's own errors (an unknown flag, a bad value) are one line too, not the usage of every flag."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    _one_line_error(e.value.code, capsys.readouterr().err, *fragments, "--help lists the flags")


def test_a_start_up_error_is_said_once_per_node(capsys, monkeypatch):
    """Before any process group every rank finds the same error: the node's first local rank says it, the others
    exit quietly with the same code (torchrun showed it once per rank, in two forms)."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    rc, _, err = _run(["--mock-data"], capsys, monkeypatch, world=2)
    assert rc == 2 and err == ""
    monkeypatch.setenv("LOCAL_RANK", "0")
    rc, _, err = _run(["--mock-data"], capsys, monkeypatch, world=2)
    _one_line_error(rc, err, "--mock-data needs --vocab-size")


def test_a_start_up_error_of_one_local_rank_alone_is_said(capsys, monkeypatch):
    """Under torchrun a local rank other than the first keeps quiet only where the first said the same error (it
    leaves it in the launcher's store). A file only it could not read, a cache directory of its own: its error
    was never said, torchrun showing its exit code 2 alone."""
    from datetime import timedelta

    from megatron_lite.config import ConfigError
    from megatron_lite.start_up_error import report_error

    from pretrain_jobs import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    for k, v in dict(TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    report_error(ConfigError("--data-path d: missing d.idx"), False)  # the first local rank found none
    assert capsys.readouterr().err == "error (rank 1): --data-path d: missing d.idx\n"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    report_error(ConfigError("--num-layers -1 must be a positive integer"), False)
    assert capsys.readouterr().err == "error: --num-layers -1 must be a positive integer\n"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    report_error(ConfigError("--num-layers -1 must be a positive integer"), False)  # said once, by the first
    assert capsys.readouterr().err == ""
    del store


GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:2472: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
)


def _peer_lost_cases() -> list:
    from megatron_lite.training.saving import peer_lost

    errors = [RuntimeError(GLOO_RESET), RuntimeError("mat1 and mat2 shapes cannot be multiplied"), BrokenPipeError()]
    return [peer_lost(e) for e in errors]


def test_a_lost_peer_is_recognised_by_its_transport_words(dist):
    """In a world of 2, gloo's reset connection is a lost peer, in its own words; an error of this rank's own (a
    shape, a closed stdout) is not; outside a process group nothing is (a world-1 run's closed pipe was blamed on
    a peer)."""
    for got in dist(2, _peer_lost_cases):
        assert got == ["Read error [127.0.0.1]:2472: Connection reset by peer", None, None]
    assert _peer_lost_cases() == [None, None, None]


def test_missing_data_files(tmp_path, capsys, monkeypatch):
    rc, _, err = _run(
        ["--data-path", str(tmp_path / "nope"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"],
        capsys,
        monkeypatch,
    )
    _one_line_error(rc, err, "--data-path", "missing", "nope.idx")


def test_truncated_bin(tmp_path, capsys, monkeypatch):
    prefix = _dataset(tmp_path)
    size = os.path.getsize(prefix + ".bin")
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(size - 10)
    rc, _, err = _run(
        ["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"], capsys, monkeypatch
    )
    _one_line_error(rc, err, prefix + ".bin", "truncated")


def test_truncated_idx(tmp_path, capsys, monkeypatch):
    prefix = _dataset(tmp_path)
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(50)
    rc, _, err = _run(
        ["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"], capsys, monkeypatch
    )
    _one_line_error(rc, err, prefix + ".idx", "truncated or corrupt")


def test_data_vocabulary_exceeds_vocab_size(tmp_path, capsys, monkeypatch):
    prefix = _dataset(tmp_path, max_id=150)
    rc, _, err = _run(
        ["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"], capsys, monkeypatch
    )
    _one_line_error(rc, err, "--data-path", "token id 150", "vocabulary has 101")


def test_load_directory_that_is_not_a_checkpoint(tmp_path, capsys, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "notes.txt").write_text("hello")
    rc, _, err = _run(["--mock-data", "--vocab-size", "100", "--load", str(tmp_path / "ckpt")], capsys, monkeypatch)
    _one_line_error(rc, err, "--load", "not a megatron_lite checkpoint")


def test_missing_load_dir_starts_from_scratch_unless_told_otherwise(tmp_path, capsys, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    rc, out, err = _run(["--mock-data", "--vocab-size", "100", "--load", ckpt, "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    assert f"no checkpoint in --load {ckpt}: starting from scratch" in out
    assert os.path.exists(os.path.join(ckpt, "latest_checkpointed_iteration.txt"))
    rc, _, err = _run(
        ["--mock-data", "--vocab-size", "100", "--load", str(tmp_path / "other"), "--exit-on-missing-checkpoint"],
        capsys,
        monkeypatch,
    )
    _one_line_error(rc, err, "--load", "--exit-on-missing-checkpoint")


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
    _one_line_error(rc, err, "--swiglu True conflicts with the checkpoint")
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

    from megatron_lite.data.indexed import IndexedDatasetWriter

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


@pytest.mark.parametrize(
    "argv,fragments",
    [
        (["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"], ["--fp8-recipe blockwise is not implemented"]),
        # every refused flag in one line (a script with four refused flags was refused four times over)
        (
            ["--fp8-format", "hybrid", "--fp8-param-gather", "--enable-cuda-graph"],
            ["--fp8-param-gather --enable-cuda-graph are not supported", "CUDA graphs are not implemented"],
        ),
        (["--grad-reduce-in-bf16", "--fp16"], ["--grad-reduce-in-bf16", "--fp16", "use --bf16"]),
        (["--hierarchical-context-parallel-sizes", "2", "2"], ["--hierarchical-context-parallel-sizes", "a2a+p2p"]),
        (["--bf16", "--fp16"], ["--bf16", "--fp16"]),
        (["--dataloader-type", "external"], ["--dataloader-type external", "single or cyclic"]),
        (["--optimizer", "sgd", "--sgd-momentum", "1.5"], ["--sgd-momentum 1.5", "[0, 1)"]),
        (
            ["--mock-data", "--vocab-size", "100", "--no-save-optim", "--nan-policy", "rollback", "--save", "x"],
            ["--nan-policy rollback", "--no-save-optim"],
        ),
        (["--mock-data"], ["--mock-data needs --vocab-size"]),
        # adapters-only checkpoints whose base was random could never be loaded again
        (
            ["--mock-data", "--vocab-size", "100", "--lora-rank", "4", "--qlora", "--save", "x"],
            ["--qlora with no base checkpoint loaded", "--save x", "add --load BASE --finetune"],
        ),
        (
            ["--mock-data", "--vocab-size", "100", "--lora-rank", "4", "--qlora", "--save", "x", "--dry-run"],
            ["--qlora with no base checkpoint loaded (--load None: not given)", "--save x", "add --load BASE"],
        ),
        # with no data the embedded corpus's own tokenizer was used and these dropped silently
        (["--vocab-size", "32000"], ["--vocab-size 32000 without data", "add --mock-data"]),
        (["--tokenizer-type", "GPT2BPETokenizer"], ["--tokenizer-type GPT2BPETokenizer without data"]),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--num-virtual-stages-per-pipeline-rank",
                "2",
            ],
            ["--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank"],
        ),  # fmt: skip
        (["--lr-warmup-iters", "10", "--lr-warmup-fraction", "0.3"], ["--lr-warmup-fraction and --lr-warmup-iters"]),
        (["--mock-data", "--vocab-size", "100", "--swiglu", "--squared-relu"], ["--swiglu and --squared-relu"]),
        (
            ["--mock-data", "--vocab-size", "100", "--position-embedding-type", "rope", "--rotary-percent", "1.5"],
            ["--rotary-percent 1.5 must be in (0, 1]"],
        ),
    ],
)
def test_refused_flags(argv, fragments, capsys, monkeypatch):
    rc, _, err = _run(argv, capsys, monkeypatch)
    _one_line_error(rc, err, *fragments)


def test_megatron_moe_and_fusion_flags_are_taken_and_explained():
    """Flags every Megatron MoE script passes (--moe-grouped-gemm was refused while a Triton grouped GEMM
    already ran the experts): accepted, each with the line start-up prints."""
    from megatron_lite.arguments import build_parser
    from megatron_lite.megatron_flags import accepted_no_ops

    flags = ["--moe-grouped-gemm", "--use-flash-attn", "--no-rope-fusion", "--cross-entropy-loss-fusion"]
    lines = accepted_no_ops(build_parser().parse_args(["--num-layers", "2", *flags]))
    assert sorted(line.split()[0] for line in lines) == sorted(flags) and all("--kernel-impl" in line for line in lines)
    # Megatron's Mixtral example passes --sequence-parallel at TP=1: said, not silently kept
    sp = accepted_no_ops(build_parser().parse_args(["--sequence-parallel"]))
    assert sp == ["--sequence-parallel has no effect at --tensor-model-parallel-size 1 (Megatron turns it off)"]
    # --grad-reduce-in-bf16 in an fp32 run: said, not silently kept; with --bf16 it acts (no line)
    fp32 = accepted_no_ops(build_parser().parse_args(["--grad-reduce-in-bf16"]))
    assert fp32 == ["--grad-reduce-in-bf16 has no effect without --bf16: fp32 gradients are reduced in fp32"]
    assert accepted_no_ops(build_parser().parse_args(["--grad-reduce-in-bf16", "--bf16"])) == []


# Megatron-LM's examples/llama/train_llama3_8b_h200_bf16.sh, mock-data branch, its flags unchanged (the
# `--split '99,1,0'` quotes included, as the script's unquoted array hands them over) except the model and run
# sizes; CKPT stands for its checkpoint directory.
MEGATRON_LLAMA3_8B_H200_BF16 = """--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 224
    --num-attention-heads 4 --group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 32
    --max-position-embeddings 32 --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0
    --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused
    --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1
    --global-batch-size 4 --train-samples 24 --lr-decay-samples 20 --lr-warmup-samples 4 --lr 0.00015
    --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion
    --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1 --exit-duration-in-mins 235
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --tensor-model-parallel-size 1
    --context-parallel-size 1 --sequence-parallel --mock-data --tokenizer-type NullTokenizer --vocab-size 1000
    --data-cache-path CKPT/cache --tiktoken-pattern v2 --split '99,1,0' --no-create-attention-mask-in-dataloader
    --no-mmap-bin-files --num-workers 1 --log-interval 1 --save-interval 1000 --log-throughput --profile
    --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
    --save CKPT --load CKPT --tensorboard-dir CKPT/tb --wandb-project megatron-lm-training
    --wandb-exp-name llama3x-8b-bf16-tp1 --wandb-save-dir CKPT/wandb --log-params-norm --log-num-zeros-in-grad
    --log-timers-to-tensorboard"""


def test_megatron_llama3_h200_bf16_example_runs(tmp_path, capsys, monkeypatch):
    """Megatron's Llama-3 8B H200 bf16 script ports by changing its entry point: every flag is taken, and it
    trains with gradients reduced in bf16 through the distributed optimizer. Three of its flags need what a
    CPU test machine lacks: --profile (Nsight Systems, refused without CUDA), --tensorboard-dir (the tensorboard
    package, refused at start-up when absent) and the W&B flags (W&B runs in tests/test_pretrain_torchrun.py)."""
    import importlib.util

    from megatron_lite.arguments import parse_args

    flags = MEGATRON_LLAMA3_8B_H200_BF16.replace("CKPT", str(tmp_path / "ckpt")).split()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    if importlib.util.find_spec("tensorboard") is None:
        assert main(flags) == 2
        _one_line_error(2, capsys.readouterr().err, "--tensorboard-dir", "pip install tensorboard")
    else:
        _, job = parse_args(flags)
        assert job.logging.tensorboard_dir
    drop = {"--profile": 0, "--profile-step-start": 1, "--profile-step-end": 1, "--tensorboard-dir": 1}
    drop |= {"--wandb-project": 1, "--wandb-exp-name": 1, "--wandb-save-dir": 1}
    kept, skip = [], 0
    for f in flags:
        if skip:
            skip -= 1
        elif f in drop:
            skip = drop[f]
        else:
            kept.append(f)
    _, job = parse_args(kept)
    assert job.optimizer.grad_reduce_in_bf16 and job.optimizer.use_distributed_optimizer
    assert job.data.split_weights == (0.99, 0.01, 0.0)
    assert main(kept) == 0
    out = capsys.readouterr().out
    assert "gradients reduced in bfloat16" in out
    assert "--tiktoken-pattern has no effect without --tokenizer-type TikTokenizer" in out
    assert "iteration        6/       6 |" in out and "saved" in out


# Megatron-LM's examples/llama/train_llama3.sh (AMD's), its flags unchanged (the `--eval-iters '-1'` of its
# default written without quotes) except the model and run sizes and data: NullTokenizer on mock data in place
# of a Hugging Face tokenizer download.
MEGATRON_LLAMA3_AMD = """--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 4 --seq-length 32
    --max-position-embeddings 131072 --untie-embeddings-and-output-weights --position-embedding-type rope
    --no-position-embedding --swiglu --disable-bias-linear --init-method-std 0.02 --attention-dropout 0.0
    --hidden-dropout 0.0 --normalization RMSNorm --micro-batch-size 1 --global-batch-size 8 --train-iters 3
    --no-async-tensor-model-parallel-allreduce --bf16 --no-masked-softmax-fusion --tokenizer-type NullTokenizer
    --vocab-size 1000 --dataloader-type cyclic --save-interval 200000 --log-interval 1 --eval-interval 320000
    --eval-iters 10 --num-workers 0 --mock-data --log-interval 1 --log-throughput --no-save-optim --no-save-rng
    --eval-iters -1 --group-query-attention --num-query-groups 2 --no-gradient-accumulation-fusion
    --distributed-backend gloo --distributed-timeout-minutes 120 --overlap-grad-reduce --rerun-mode disabled
    --use-distributed-optimizer --overlap-param-gather --use-flash-attn --sequence-parallel --use-mcore-models
    --lr 1e-4 --min-lr 1e-5 --lr-decay-iters 320000 --lr-decay-style cosine --weight-decay 1.0e-1 --clip-grad 1.0
    --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95"""


def test_megatron_llama3_amd_example_runs(tmp_path, capsys, monkeypatch):
    """The flags Megatron's Llama-3 example passes that nothing else here did: --dataloader-type cyclic,
    --no-save-optim, --no-save-rng, --rerun-mode, --no-async-tensor-model-parallel-allreduce, and --save-interval
    without --save (ignored by Megatron, said here). NCCL is its backend; gloo on this CPU."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert main(MEGATRON_LLAMA3_AMD.split()) == 0
    out = capsys.readouterr().out
    for line in (
        "--dataloader-type cyclic has no effect",
        "--rerun-mode has no effect",
        "--no-async-tensor-model-parallel-allreduce has no effect",
        "--save-interval 200000 has no effect without --save",
    ):
        assert line in out, line
    assert "iteration        3/       3 |" in out


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


def test_profile_window_writes_a_torch_profiler_trace(tmp_path, capsys, monkeypatch):
    """--profile --use-pytorch-profiler --profile-step-start 1 --profile-step-end 2: iteration 2 alone is traced,
    into --profile-dir (--tensorboard-dir by default); the Nsight Systems form needs CUDA and is refused on a CPU
    job."""
    import json

    tb = tmp_path / "tb"
    flags = ["--mock-data", "--vocab-size", "100", "--profile", "--profile-step-start", "1", "--profile-step-end", "2"]
    rc, out, err = _run([*flags, "--use-pytorch-profiler", "--profile-dir", str(tb)], capsys, monkeypatch)
    assert rc == 0, err
    assert "profiling iterations 2..2" in out and "profiling done" in out
    traces = list(tb.rglob("*.pt.trace.json"))
    assert len(traces) == 1
    names = {e.get("name", "") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert any(n.startswith("aten::") for n in names)  # the step's operators were recorded
    rc, _, err = _run(flags, capsys, monkeypatch)
    _one_line_error(rc, err, "--profile without --use-pytorch-profiler", "needs CUDA")
    rc, _, err = _run([*flags, "--use-pytorch-profiler"], capsys, monkeypatch)
    _one_line_error(rc, err, "--use-pytorch-profiler writes its trace to --tensorboard-dir (or --profile-dir)")


def test_bad_layout_stops_before_any_process_group(capsys, monkeypatch):
    rc, _, err = _run(
        ["--mock-data", "--vocab-size", "100", "--tensor-model-parallel-size", "3"], capsys, monkeypatch, world=4
    )
    _one_line_error(rc, err, "world size 4", "--tensor-model-parallel-size 3")


def test_document_flags_say_what_they_do(tmp_path, capsys, monkeypatch):
    """--reset-position-ids / --reset-attention-mask: the SDPA document mask is announced; on mock data, which
    packs no documents, both are said to have no effect. (What they compute: tests/test_documents.py.)"""
    flags = [
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "100",
        "--reset-position-ids",
        "--reset-attention-mask",
    ]
    rc, out, err = _run(["--data-path", _dataset(tmp_path), *flags], capsys, monkeypatch)
    assert rc == 0, err
    assert "--reset-attention-mask: attention runs through SDPA with a [batch, 1, seq, seq] document mask" in out
    assert "no effect" not in out
    rc, out, err = _run(["--mock-data", *flags[2:]], capsys, monkeypatch)
    assert rc == 0, err
    assert "--reset-position-ids / --reset-attention-mask have no effect on mock or --sft data" in out


def test_single_process_run_with_indexed_data(tmp_path, capsys, monkeypatch):
    prefix = _dataset(tmp_path)
    log = tmp_path / "m.jsonl"
    rc, out, err = _run(
        [
            "--data-path",
            prefix,
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "100",
            "--log-jsonl",
            str(log),
            "--use-mcore-models",
            "--split",
            "90,10,0",
            "--eval-interval",
            "3",
            "--eval-iters",
            "1",
        ],
        capsys,
        monkeypatch,
    )
    assert rc == 0, err
    assert "--use-mcore-models has no effect" in out
    import json

    records = [json.loads(line) for line in log.read_text().splitlines()]
    train = [r for r in records if "lm_loss" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3]
    keys = {
        "lm_loss",
        "lr",
        "grad_norm",
        "loss_scale",
        "iteration_time",
        "tokens_per_sec",
        "tflops_per_gpu",
        "mfu",
        "data_time_fraction",
        "comm_exposed_fraction",
        "peak_memory_bytes",
        "consumed_samples",
    }
    assert keys <= set(train[0])
    assert train[0]["mfu"] is None  # no known peak on a CPU
    assert any("validation" in r for r in records)


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


def _losses(out: str) -> dict[int, float]:
    return {
        int(m[1]): float(m[2]) for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*? \| lm loss: ([\d.E+-]+) \|", out)
    }


def test_a_lora_run_resumed_with_load_alone_keeps_its_adapters(tmp_path, capsys, monkeypatch):
    """--load DIR alone rebuilds the run that wrote it, LoRA included (its adapters were dropped without a word
    and the whole base trained on): iterations 3-4 equal a straight 4-iteration LoRA run. A model without
    adapters refuses a checkpoint that holds them, and an explicit other --lora-rank is a one-line error."""
    from megatron_lite.checkpoint.checkpointing import find_checkpoint, load_checkpoint, read_metadata
    from megatron_lite.checkpoint.hf_convert import model_config_from_dict
    from megatron_lite.config import ConfigError, ParallelConfig
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    data = ["--mock-data", "--vocab-size", "100", "--lr-decay-style", "constant"]
    base, lora, straight = (str(tmp_path / n) for n in ("base", "lora", "straight"))
    rc, _, err = _run([*data, "--train-iters", "1", "--save", base], capsys, monkeypatch)
    assert rc == 0, err
    adapt = [*data, "--load", base, "--finetune", "--lora-rank", "4"]
    rc, _, err = _run([*adapt, "--train-iters", "2", "--save", lora], capsys, monkeypatch)
    assert rc == 0, err
    rc, out, err = _run(["--load", lora, "--save", lora, "--train-iters", "4"], capsys, monkeypatch)
    assert rc == 0, err
    assert "LoRA rank 4" in out and "iteration 2" in out, out
    resumed = _losses(out)
    rc, out, err = _run([*adapt, "--train-iters", "4", "--save", straight], capsys, monkeypatch)
    assert rc == 0, err
    assert sorted(resumed) == [3, 4] and resumed == {k: v for k, v in _losses(out).items() if k > 2}, (resumed, out)

    rc, _, err = _run(["--load", lora, "--lora-rank", "8"], capsys, monkeypatch)
    _one_line_error(rc, err, "--lora-rank 8 conflicts with the rank-4 LoRA adapters")
    path = find_checkpoint(lora)
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    plain = build_model(model_config_from_dict(read_metadata(path)["config"]["model"]), ctx)
    with pytest.raises(ConfigError, match="holds LoRA adapters .* and this model has none"):
        load_checkpoint(path, plain, None, None, ctx, load_rng=False)


def _tensor_files(root: str) -> dict[str, int]:
    """key -> bytes of a checkpoint's tensor files (its newest under `root`)."""
    from safetensors import safe_open

    from megatron_lite.checkpoint.checkpointing import find_checkpoint

    path = find_checkpoint(root)
    out = {}
    for f in sorted(os.listdir(path)):
        if f.startswith("tensors_") and f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as t:
                out.update({k: t.get_slice(k).get_shape() for k in t.keys()})
    return {k: int(np.prod(shape)) for k, shape in out.items()}


def test_lora_checkpoints_hold_the_adapters_and_name_their_base(tmp_path, capsys, monkeypatch):
    """A LoRA run's checkpoints hold the adapters alone and record their base, as Megatron-Bridge's PEFT
    checkpoints do (the whole frozen base was written at every save). A resume loads that base first (the test
    above equals a straight run through one); with the base gone it is one line naming it. A base inside the
    run's own --save, which it adds to and may delete from, gives whole checkpoints, and start-up says so."""
    from megatron_lite.checkpoint.checkpointing import find_checkpoint, read_metadata

    data = ["--mock-data", "--vocab-size", "100", "--lr-decay-style", "constant"]
    base, lora = str(tmp_path / "base"), str(tmp_path / "lora")
    rc, _, err = _run([*data, "--train-iters", "1", "--save", base], capsys, monkeypatch)
    assert rc == 0, err
    adapt = [*data, "--lora-rank", "4", "--train-iters", "2"]
    rc, out, err = _run([*adapt, "--load", base, "--finetune", "--save", lora], capsys, monkeypatch)
    assert rc == 0, err
    assert read_metadata(find_checkpoint(lora))["config"]["lora"]["base"] == find_checkpoint(base)
    adapters, whole = _tensor_files(lora), _tensor_files(base)
    assert adapters and all(".lora." in k for k in adapters), [k for k in adapters if ".lora." not in k][:3]

    os.rename(base, base + "_moved")
    rc, _, err = _run(["--load", lora, "--save", lora, "--train-iters", "3"], capsys, monkeypatch)
    _one_line_error(rc, err, f"holds LoRA adapters trained on the base checkpoint '{base}/iter_0000001'", "is gone")
    # the adapters alone (a PEFT export) read without their base; the whole model not
    from megatron_lite.checkpoint.hf_convert import read_model_tensors
    from megatron_lite.config import ConfigError

    assert all(".lora." in k for k in read_model_tensors(lora, base=False)[1])
    with pytest.raises(ConfigError, match="is gone"):
        read_model_tensors(lora)
    # a base trained again into the same directory (other weights, the same path) is not taken for the one the
    # adapters were trained on
    rc, _, err = _run([*data, "--train-iters", "1", "--save", base, "--seed", "7"], capsys, monkeypatch)
    assert rc == 0, err
    rc, _, err = _run(["--load", lora, "--save", lora, "--train-iters", "3"], capsys, monkeypatch)
    _one_line_error(rc, err, f"trained on the base checkpoint {base}/iter_0000001, which has been rewritten since")
    with pytest.raises(ConfigError, match="rewritten since"):
        read_model_tensors(lora)
    shutil.rmtree(base)
    os.rename(base + "_moved", base)

    rc, out, err = _run([*adapt, "--load", base, "--save", base], capsys, monkeypatch)
    assert rc == 0, err
    assert f"the base {base}/iter_0000001 lies in --save {base}" in out + err, out + err
    saved = _tensor_files(base)
    assert read_metadata(find_checkpoint(base))["config"]["lora"]["base"] is None
    assert {k for k in whole if k.startswith("model/")} < set(saved) and {k for k in saved if ".lora." in k} == set(
        adapters
    )  # (the same adapters)


@pytest.mark.slow
def test_data_loader_workers_give_the_same_run(tmp_path, capsys, monkeypatch):
    import json

    prefix = _dataset(tmp_path)
    base = ["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--train-iters", "4"]
    for workers in (0, 2):
        rc, _, err = _run(
            [*base, "--num-workers", str(workers), "--log-jsonl", str(tmp_path / f"w{workers}.jsonl")],
            capsys,
            monkeypatch,
        )
        assert rc == 0, err
    runs = [[json.loads(x)["lm_loss"] for x in (tmp_path / f"w{w}.jsonl").read_text().splitlines()] for w in (0, 2)]
    assert runs[0] == runs[1] and len(runs[0]) == 4


def test_kernel_impl_triton_where_it_cannot_run_is_refused(capsys, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU can run the kernels")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rc, _, err = _run(["--mock-data", "--vocab-size", "100", "--kernel-impl", "triton"], capsys, monkeypatch)
    _one_line_error(rc, err, "--kernel-impl triton needs a CUDA GPU", "--kernel-impl torch")
    # (from the generation review) the interpreter runs fp32 only: bf16 trained on garbage matmuls without a word
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    argv = ["--mock-data", "--vocab-size", "100", "--kernel-impl", "triton", "--bf16"]
    rc, _, err = _run(argv, capsys, monkeypatch)
    _one_line_error(rc, err, "has no half-precision arithmetic", "use --kernel-impl torch, or fp32")


def test_kernel_impl_follows_the_tensors_device_not_only_the_machine(monkeypatch):
    """On a GPU machine a gloo job runs on CPU tensors: the default is then the PyTorch path, and an explicit
    --kernel-impl triton is refused with the reason (before, the default was triton and the TP loss raised)."""
    import torch

    from megatron_lite.arguments import ConfigError, resolve_kernel_impl

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # this machine's only stand-in for a GPU
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_kernel_impl(None, None) == "triton" and resolve_kernel_impl(None, "nccl") == "triton"
    assert resolve_kernel_impl(None, "gloo") == "torch"
    with pytest.raises(ConfigError, match="--distributed-backend gloo runs on CPU tensors"):
        resolve_kernel_impl("triton", "gloo")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs CPU tensors: an explicit request stands
    assert resolve_kernel_impl("triton", "gloo") == "triton"
    # ... in fp32 only, on a GPU's tensors too (it interprets every kernel): bf16 was refused under gloo alone
    for backend, requested in (("nccl", None), ("nccl", "triton"), ("gloo", "triton")):
        with pytest.raises(ConfigError, match="no half-precision arithmetic"):
            resolve_kernel_impl(requested, backend, half=True)


def test_memory_breakdown_is_logged(tmp_path, capsys, monkeypatch):
    import json

    jsonl = tmp_path / "m.jsonl"
    argv = ["--mock-data", "--vocab-size", "100", "--log-memory-breakdown", "--log-jsonl", str(jsonl)]
    rc, _, err = _run([*argv, "--use-distributed-optimizer"], capsys, monkeypatch)
    assert rc == 0, err
    rec = [json.loads(line) for line in jsonl.read_text().splitlines()][-1]
    params = rec["mem_params_bytes"]
    # fp32 on one rank: 2 layers x (QKV + proj + fc1 + fc2 = 12 h^2) + tied embedding, biases and norms.
    assert params >= (2 * 12 * 32 * 32 + 101 * 32) * 4
    # One fp32 gradient per parameter (buckets unpadded at DP=1); ZeRO-1 reduces this rank's part in place.
    assert rec["mem_grads_bytes"] == params
    assert rec["mem_optimizer_bytes"] == 3 * params  # fp32 main weights + two Adam moments
    assert rec["mem_activations_bytes"] > 0


def _wandb_history(run_dir) -> list[dict]:
    """The history rows of an offline W&B run."""
    return [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
        for record in _wandb_records(run_dir)
        if record.WhichOneof("record_type") == "history"
    ]


def _wandb_records(run_dir) -> list:
    """The records of an offline W&B run, read back from its .wandb file (a LevelDB-style log of protobuf
    records: 32 KiB blocks, each piece behind a 7-byte header, after the 7-byte file header)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = next(run_dir.glob("*.wandb")).read_bytes()
    pos, piece, rows = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # a block's zero-filled tail
            pos += left
            continue
        piece, pos = piece + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a whole record, or its last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(piece)
            rows.append(record)
            piece = b""
    return rows


def test_a_halted_run_is_not_a_finished_one_in_wandb_and_its_config_has_the_layout(tmp_path):
    """From a logging review: W&B marked a run that halted (or raised) as finished with exit code 0, since
    finish() was called without the outcome; and its config lacked world_size, data_parallel_size and the
    resolved ffn_hidden_size / kv_channels / num_query_groups (null), which runs are grouped by."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [*TINY, "--mock-data", "--vocab-size", "100", "--wandb-project", "p", "--check-for-nan-in-loss-and-grad"]
    env = {**os.environ, "WANDB_MODE": "offline", "WORLD_SIZE": "1", "RANK": "0"}
    codes, jobs = {}, {}
    for name, fault in (("ok", None), ("halted", "nan,rank=0,iteration=2")):  # (both at once: W&B's start-up waits)
        run_env = {**env, "MEGATRON_LITE_INJECT_FAULT": fault} if fault else env
        jobs[name] = subprocess.Popen([sys.executable, os.path.join(root, "pretrain", "pretrain_gpt.py"), *argv,
                                       "--wandb-save-dir", str(tmp_path / name)], env=run_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=tmp_path)  # fmt: skip
    for name, job in jobs.items():
        job.communicate(timeout=300)
        out = job
        run = next((tmp_path / name / "wandb").glob("offline-run-*"))
        exits = [r.exit.exit_code for r in _wandb_records(run) if r.WhichOneof("record_type") == "exit"]
        codes[name] = (out.returncode, exits)
        config = {i.key: json.loads(i.value_json) for r in _wandb_records(run) if r.WhichOneof("record_type") ==
                  "run" for i in r.run.config.update}  # fmt: skip
        assert config.get("world_size") == 1 and config.get("data_parallel_size") == 1, sorted(config)[:20]
        assert (config["ffn_hidden_size"], config["kv_channels"], config["num_query_groups"]) == (128, 8, 4)
    assert codes == {"ok": (0, [0]), "halted": (3, [3])}, codes


def test_wandb_mode_follows_a_self_hosted_servers_login(tmp_path, monkeypatch):
    """`wandb login --host` stores the key under the server's host: the run went offline (no upload, one word in
    the log) because only api.wandb.ai was looked for."""
    from megatron_lite.training.logger import _wandb_mode

    (tmp_path / ".netrc").write_text("machine wandb.example.org\n  login user\n  password k\n")
    os.chmod(tmp_path / ".netrc", 0o600)
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert _wandb_mode() == "online"
    monkeypatch.delenv("WANDB_BASE_URL")
    assert _wandb_mode() == "offline"


def test_wandb_entity_and_validation_perplexity(tmp_path):
    """--wandb-entity reaches the (offline, real) W&B run, written under --save as Megatron's default
    --wandb-save-dir (it was the working directory, on every node); validation logs Megatron's perplexity
    exp(lm_loss). As Megatron's training_log, W&B gets each iteration's own loss, grad norm and learning rate
    (--tensorboard-log-interval, default 1) while the console and JSONL show --log-interval's window means (W&B
    had the window's, every --log-interval only)."""
    import math
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [*TINY, "--mock-data", "--vocab-size", "100", "--eval-iters", "2", "--eval-interval", "3"]
    argv += ["--log-interval", "3"]
    argv += ["--wandb-project", "p", "--wandb-entity", "team-x", "--save", str(tmp_path / "ckpt")]
    argv += ["--log-jsonl", str(tmp_path / "m.jsonl")]
    env = {**os.environ, "WANDB_MODE": "offline", "WORLD_SIZE": "1", "RANK": "0"}
    env.pop("WANDB_API_KEY", None)
    out = subprocess.run(
        [sys.executable, os.path.join(root, "pretrain", "pretrain_gpt.py"), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert not (tmp_path / "wandb").exists()
    logs = list((tmp_path / "ckpt" / "wandb" / "wandb").glob("offline-run-*/logs/debug.log"))
    assert len(logs) == 1 and "finishing run team-x/p/" in logs[0].read_text()  # entity/project/run id
    valid = [json.loads(line)["validation"] for line in open(tmp_path / "m.jsonl") if '"validation"' in line]
    assert valid and all(abs(v["ppl"] - math.exp(v["lm_loss"])) < 1e-9 * v["ppl"] for v in valid)
    # Megatron's W&B keys (a dashboard built on its runs shows ours), ours-only metrics under train/, and its
    # flat arguments as the run's config (runs filter on num_layers)
    run = next((tmp_path / "ckpt" / "wandb" / "wandb").glob("offline-run-*"))
    blob = b"".join(p.read_bytes() for p in run.rglob("*.wandb"))
    for key in (
        b"lm loss",
        b"learning-rate",
        b"grad-norm",
        b"batch-size",
        b"lm loss validation",
        b"train/tokens_per_sec",
    ):
        assert key in blob, key
    assert b"train/lm_loss" not in blob
    config = b"".join(p.read_bytes() for p in run.rglob("config.yaml")) or blob
    assert b"num_layers" in config and b"tensor_model_parallel_size" in config
    rows = {r["_step"]: r for r in _wandb_history(run)}
    assert sorted(rows) == [1, 2, 3] and all("lm loss" in r and "grad-norm" in r for r in rows.values())
    (window,) = [r for r in map(json.loads, open(tmp_path / "m.jsonl")) if "lm_loss" in r]
    assert window["lm_loss"] == pytest.approx(sum(r["lm loss"] for r in rows.values()) / 3, rel=1e-6)
    assert window["grad_norm"] == pytest.approx(rows[3]["grad-norm"]) != pytest.approx(rows[2]["grad-norm"])
    assert "iteration-time" in rows[3] and "lm loss validation" in rows[3] and "iteration-time" not in rows[2]


def test_wandb_config_names_the_vocabulary_as_megatron(monkeypatch):
    """W&B's flat config has Megatron's vocab_size (the tokenizer's) and padded_vocab_size (the embedding's rows,
    a multiple of 128 x TP); it had data.vocab_size (the --vocab-size flag, None with a real tokenizer) and
    model.vocab_size, and no padded size."""
    from megatron_lite.arguments import parse_args
    from megatron_lite.training.logger import _flat_config

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    _, job = parse_args([*TINY, "--mock-data", "--vocab-size", "1000", "--tensor-model-parallel-size", "2"])
    flat = _flat_config(job)
    assert (flat["vocab_size"], flat["padded_vocab_size"]) == (1000, 1024)
    assert not [k for k in flat if k.endswith(".vocab_size")]


# Megatron's training_log and evaluate_and_print_results, as a parser written for its logs reads them
MEGATRON_TRAIN_LINE = re.compile(
    r" iteration\s+(\d+)/\s+(\d+) \| consumed samples:\s+(\d+) \| elapsed time per iteration \(ms\): ([\d.]+) \| "
    r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \| learning rate: ([\d.E+-]+) \| global batch size:\s+(\d+) \| "
    r"lm loss: ([\d.E+-]+) \| loss scale: ([\d.]+) \| grad norm: ([\d.]+) \| num zeros: (\d+) \| "
    r"params norm: ([\d.]+) \| number of skipped iterations:\s+(\d+) \|"
)
MEGATRON_VALID_LINE = re.compile(
    r" validation loss at iteration (\d+)( on (?:validation|test) set)? \| lm loss value: ([\d.E+-]+) \| "
    r"lm loss PPL: ([\d.E+-]+) \| "
)


def test_the_decoupled_rate_is_logged_as_megatron_logs_it(tmp_path, capsys, monkeypatch):
    """--decoupled-lr trained the embeddings at its rate but was never logged (Megatron: "decoupled learning
    rate" after "learning rate", W&B's decoupled-learning-rate)."""
    log = tmp_path / "m.jsonl"
    argv = ["--mock-data", "--vocab-size", "100", "--decoupled-lr", "5e-4", "--log-jsonl", str(log)]
    rc, out, err = _run(argv, capsys, monkeypatch)
    assert rc == 0, err
    rates = [json.loads(line)["decoupled_lr"] for line in log.read_text().splitlines()]
    shown = re.findall(r"\| learning rate: [\d.E+-]+ \| decoupled learning rate: ([\d.E+-]+) \| global batch", out)
    assert len(rates) == 3 and [float(x) for x in shown] == pytest.approx(rates, rel=1e-6) and rates[0] > 1e-4


def test_the_dry_run_says_what_the_run_would_of_the_flags(capsys, monkeypatch):
    """--dry-run, which users validate a script with, prints the start-up lines on flags without effect too."""
    argv = ["--mock-data", "--vocab-size", "100", "--dry-run", "--apply-query-key-layer-scaling"]
    rc, out, err = _run([*argv, "--moe-use-legacy-grouped-gemm"], capsys, monkeypatch)
    assert rc == 0, err
    assert "--apply-query-key-layer-scaling has no effect: the softmax runs in fp32" in out
    assert "--moe-use-legacy-grouped-gemm has no effect" in out


def test_gpt2_files_without_a_tokenizer_type_take_gpt2_bpe(tmp_path, capsys, monkeypatch):
    """Megatron's GPT-3 scripts give --vocab-file and --merge-file only (its pretrain_gpt.py defaults the type to
    GPT2BPETokenizer): they ran into "--mock-data needs --vocab-size"."""
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps({"<|endoftext|>": 0, "a": 1, "b": 2, "ab": 3}))
    merges.write_text("#version: 0.2\na b\n")
    rc, out, err = _run(["--mock-data", "--vocab-file", str(vocab), "--merge-file", str(merges)], capsys, monkeypatch)
    assert rc == 0, err
    assert "GPT2BPETokenizer reads them" in out and "iteration        3/       3 |" in out


def test_moe_losses_are_the_windows_mean(tmp_path, capsys, monkeypatch):
    """load_balancing_loss and z_loss over a log window are its steps' mean, as lm loss and as Megatron's (they
    were the window's last step)."""
    moe = ["--mock-data", "--vocab-size", "100", "--num-experts", "4", "--moe-aux-loss-coeff", "1e-2"]
    moe += ["--moe-z-loss-coeff", "1e-3", "--disable-bias-linear"]
    logged = {}
    for interval in (1, 3):
        log = tmp_path / f"m{interval}.jsonl"
        rc, out, err = _run([*moe, "--log-interval", str(interval), "--log-jsonl", str(log)], capsys, monkeypatch)
        assert rc == 0, err
        logged[interval] = [json.loads(line) for line in log.read_text().splitlines() if "lm_loss" in line]
    assert "load_balancing_loss: " in out and "z_loss: " in out
    for k in ("moe_aux_loss", "moe_z_loss"):
        each = [r[k] for r in logged[1]]
        assert len(set(each)) == 3 and logged[3][-1][k] == pytest.approx(sum(each) / 3, rel=1e-12), (k, each)


def test_moe_per_layer_losses_and_an_aux_loss_free_run(tmp_path, capsys, monkeypatch):
    """From an MoE review: --moe-per-layer-logging was a no-op (JSONL now holds each layer's losses, whose mean
    is the logged one), and an aux-loss-free run (--moe-aux-loss-coeff 0, the expert bias balancing) logged a
    load_balancing_loss of 0, which Megatron does not track."""
    moe = ["--mock-data", "--vocab-size", "100", "--num-experts", "4", "--disable-bias-linear", "--log-interval", "1"]
    log = tmp_path / "m.jsonl"
    rc, out, err = _run([*moe, "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--log-jsonl", str(log),
                         "--moe-per-layer-logging"], capsys, monkeypatch)  # fmt: skip
    assert rc == 0, err
    rec = [json.loads(line) for line in log.read_text().splitlines() if "lm_loss" in line][-1]
    layers = rec["moe_layer_losses"]
    assert sorted(layers) == ["0", "1"] and all(v["aux_loss"] > 0 and v["z_loss"] > 0 for v in layers.values())
    for k in ("aux_loss", "z_loss"):
        assert rec[f"moe_{k}"] == pytest.approx(sum(v[k] for v in layers.values()) / 2, rel=1e-12)
        assert [rec[f"moe_layer{i}_{k}"] for i in (0, 1)] == [layers[str(i)][k] for i in (0, 1)]  # (W&B's scalars)
    free = ["--moe-aux-loss-coeff", "0", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
    free_log = tmp_path / "free.jsonl"
    rc, out, err = _run([*moe, *free, "--moe-per-layer-logging", "--log-jsonl", str(free_log)], capsys, monkeypatch)
    assert rc == 0, err
    lines = [line for line in out.splitlines() if "] iteration " in line]
    assert len(lines) == 3 and not any("load_balancing_loss" in line for line in lines), lines
    rec = [json.loads(line) for line in free_log.read_text().splitlines() if "lm_loss" in line][-1]
    assert not any(k.endswith(("_aux_loss", "_z_loss")) for k in rec) and rec["moe_layer_losses"]["0"] == {}, rec


def test_moe_losses_go_under_the_names_megatron_tracks(capsys, monkeypatch):
    """seq_aux_loss is Megatron's seq_load_balancing_loss (it was logged as load_balancing_loss); the z loss is
    tracked only with --moe-z-loss-coeff; Megatron's number of nan iterations is there with the NaN check off."""
    moe = ["--mock-data", "--vocab-size", "100", "--num-experts", "4", "--moe-aux-loss-coeff", "1e-2"]
    moe += ["--disable-bias-linear", "--moe-router-load-balancing-type", "seq_aux_loss"]
    rc, out, err = _run([*moe, "--no-check-for-nan-in-loss-and-grad"], capsys, monkeypatch)
    assert rc == 0, err
    lines = [line for line in out.splitlines() if "] iteration " in line]
    assert len(lines) == 3 and all("| seq_load_balancing_loss: " in line for line in lines), lines
    assert not any("| load_balancing_loss" in line or "z_loss" in line for line in lines), lines
    assert all("| number of nan iterations:   0 |" in line for line in lines), lines


def test_tensorboard_plots_an_evaluation_at_the_samples_consumed_by_then():
    from megatron_lite.training.logger import MetricsLogger

    class Writer:
        calls: list = []

        def add_scalar(self, key, value, step):
            self.calls.append((key, step))

    from megatron_lite.training.configs import LoggingConfig

    logger = MetricsLogger.__new__(MetricsLogger)
    logger.enabled, logger.train_iters, logger._jsonl, logger._wandb, logger._tb = True, 9, None, None, Writer()
    logger._samples, logger.config = 0, LoggingConfig()
    logger.step(4, {"lm_loss": 1.0, "consumed_samples": 16})
    logger.log(4, {"lm_loss": 1.0, "consumed_samples": 16})
    logger.log(6, {"lm_loss": 1.0, "ppl": 2.7}, kind="validation", samples=24)  # (no training line at 6)
    assert ("lm loss validation vs samples", 24) in Writer.calls and ("lm loss vs samples", 16) in Writer.calls


def test_tensorboard_gets_each_iterations_values(tmp_path, capsys, monkeypatch):
    """A real TensorBoard event file (skipped where the package is absent, as in CI): each iteration's own lm loss
    and grad norm every --tensorboard-log-interval, the window's iteration time at --log-interval, the window's
    mean loss in the JSONL; --tensorboard-queue-size reaches the writer."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    queues = []
    real = SummaryWriter.__init__
    monkeypatch.setattr(SummaryWriter, "__init__", lambda self, *a, **k: queues.append(k) or real(self, *a, **k))
    argv = ["--mock-data", "--vocab-size", "100", "--train-iters", "4", "--log-interval", "4"]
    argv += ["--tensorboard-dir", str(tmp_path / "tb"), "--tensorboard-log-interval", "2"]
    rc, _, err = _run([*argv, "--tensorboard-queue-size", "7", "--log-jsonl", str(tmp_path / "m.jsonl")],
                      capsys, monkeypatch)  # fmt: skip
    assert rc == 0, err
    assert [q.get("max_queue") for q in queues] == [7]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    loss = {e.step: e.value for e in events.Scalars("lm loss")}
    assert sorted(loss) == [2, 4] and [e.step for e in events.Scalars("grad-norm")] == [2, 4]
    assert [e.step for e in events.Scalars("iteration-time")] == [4]
    (window,) = [r for r in map(json.loads, open(tmp_path / "m.jsonl")) if "lm_loss" in r]
    assert window["lm_loss"] != pytest.approx(loss[4], rel=1e-6)  # (the mean of iterations 1-4)


def test_the_console_reads_as_megatrons(tmp_path, capsys, monkeypatch):
    """The iteration line has Megatron's fields, labels, formats and order (a regex written for its logs reads
    ours), values equal to the JSONL record's; evaluations print its validation line, the run's end evaluating the
    validation set again (Megatron's pretrain(); it was skipped when just evaluated) and then the test set."""
    log = tmp_path / "m.jsonl"
    argv = ["--mock-data", "--vocab-size", "100", "--log-params-norm", "--log-num-zeros-in-grad", "--eval-iters", "1"]
    rc, out, err = _run([*argv, "--eval-interval", "3", "--log-jsonl", str(log)], capsys, monkeypatch)
    assert rc == 0, err
    records = [json.loads(line) for line in log.read_text().splitlines()]
    train = [r for r in records if "lm_loss" in r]
    lines = MEGATRON_TRAIN_LINE.findall(out)
    assert [int(m[0]) for m in lines] == [r["iteration"] for r in train] == [1, 2, 3]
    for m, r in zip(lines, train):
        assert (int(m[1]), int(m[2]), int(m[6])) == (3, r["consumed_samples"], r["global_batch_size"])
        assert float(m[7]) == pytest.approx(r["lm_loss"], rel=1e-6) and float(m[5]) == pytest.approx(r["lr"], rel=1e-6)
        assert float(m[3]) == pytest.approx(1000 * r["iteration_time"], abs=0.06)
        assert float(m[9]) == pytest.approx(r["grad_norm"], abs=6e-4) and int(m[10]) == r["num_zeros_in_grad"]
    evals = MEGATRON_VALID_LINE.findall(out)
    assert [(int(i), where) for i, where, _, _ in evals] == [(3, ""), (3, " on validation set"), (3, " on test set")]
    logged = [r.get("validation", r.get("test")) for r in records if "lm_loss" not in r]
    for (_, _, loss, ppl), r in zip(evals, logged):
        assert float(loss) == pytest.approx(r["lm_loss"], rel=1e-6) and float(ppl) == pytest.approx(r["ppl"], rel=1e-6)


def _ranged_dataset(tmp_path, name, lo, hi, docs=30):
    """An indexed dataset whose tokens all lie in [lo, hi)."""
    prefix = str(tmp_path / "data" / name)
    w = IndexedDatasetWriter(prefix, vocab_size=100)
    rng = np.random.default_rng(lo)
    for _ in range(docs):
        w.add_document(rng.integers(lo, hi, size=int(rng.integers(20, 60))))
    w.finalize()
    return prefix


def test_per_split_data_paths(tmp_path, capsys, monkeypatch):
    """--train-data-path / --valid-data-path (Megatron's): each split reads only its own datasets, whole (no
    --split); a split without datasets has none; mixing them with --data-path is refused."""
    from megatron_lite.data.builder import build_datasets, resolve_data
    from megatron_lite.data.config import DataConfig

    train_a, train_b = _ranged_dataset(tmp_path, "a", 0, 30), _ranged_dataset(tmp_path, "b", 30, 60)
    valid = _ranged_dataset(tmp_path, "v", 60, 98)
    data = DataConfig(
        train_data_path=("2", train_a, "1", train_b),
        valid_data_path=(valid,),
        tokenizer_type="NullTokenizer",
        vocab_size=100,
    )
    train_ds, valid_ds, test_ds = build_datasets(resolve_data(data), data, (60, 20, 10), 16, seed=1)
    assert test_ds is None
    train_tokens = torch.cat([torch.as_tensor(train_ds[i]["tokens"]) for i in range(60)])
    valid_tokens = torch.cat([torch.as_tensor(valid_ds[i]["tokens"]) for i in range(20)])
    assert int(train_tokens.max()) < 60 and bool((train_tokens >= 30).any()) and bool((train_tokens < 30).any())
    assert int(valid_tokens.min()) >= 60  # the whole validation set, none of the training data
    # The whole job, and the flags' errors.
    common = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--eval-interval", "3", "--eval-iters", "1"]
    rc, out, err = _run(["--train-data-path", train_a, "--valid-data-path", valid, *common], capsys, monkeypatch)
    assert rc == 0 and " validation loss at iteration 3 |" in out, err
    rc, _, err = _run(["--train-data-path", train_a, "--data-path", valid, *common], capsys, monkeypatch)
    _one_line_error(rc, err, "--train-data-path gives each split its own datasets", "drop --data-path")
    rc, _, err = _run(["--valid-data-path", valid, *common], capsys, monkeypatch)
    _one_line_error(rc, err, "--valid-data-path needs --train-data-path")
    # Megatron's files of the same words, for blends too long for a command line (they were "no such flag")
    from megatron_lite.arguments import parse_args

    (tmp_path / "blend.txt").write_text(f"2 {train_a}\n1 {train_b}\n")
    (tmp_path / "splits.json").write_text(json.dumps({"train": f"2 {train_a} 1 {train_b}", "valid": [valid]}))
    base = "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --train-iters 1".split()
    base += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    _, job = parse_args([*base, "--data-args-path", str(tmp_path / "blend.txt")])
    assert job.data.data_path == ("2", train_a, "1", train_b)
    _, job = parse_args([*base, "--per-split-data-args-path", str(tmp_path / "splits.json")])
    assert job.data.train_data_path == ("2", train_a, "1", train_b) and job.data.valid_data_path == (valid,)
    assert job.data.data_path == () and job.data.test_data_path == ()
    for flags, message in (
        (["--data-args-path", str(tmp_path / "blend.txt"), "--data-path", valid], "give the datasets one way"),
        (["--data-args-path", str(tmp_path / "nope.txt")], "nope.txt: No such file or directory"),
        (["--per-split-data-args-path", str(tmp_path / "blend.txt")], 'expected JSON {"train": [...]'),
    ):
        rc, _, err = _run([*flags, *common], capsys, monkeypatch)
        _one_line_error(rc, err, message)
    for bad, message in (("5", "a JSON int, not an object"), ('{"train": null}', '"train" holds null')):
        (tmp_path / "bad.json").write_text(bad)  # (tracebacks before)
        rc, _, err = _run(["--per-split-data-args-path", str(tmp_path / "bad.json"), *common], capsys, monkeypatch)
        _one_line_error(rc, err, message)


def test_the_index_cache_says_what_it_does_and_where_it_cannot(tmp_path, capsys, monkeypatch):
    """From a review: the first start scans each .bin for its largest token id without a word (at disk speed on
    a cold multi-TB corpus a rank looks hung); a cache directory that cannot be made (here: a file where it would
    go) was a FileExistsError traceback from the lock."""
    prefix = _ranged_dataset(tmp_path, "a", 0, 30)
    common = ["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--eval-iters", "0"]
    rc, out, err = _run(common, capsys, monkeypatch)
    assert rc == 0 and f"scanning {prefix}.bin" in out and "largest token id, once" in out, err
    rc, out, err = _run(common, capsys, monkeypatch)
    assert rc == 0 and "scanning" not in out  # (cached)
    other = _ranged_dataset(tmp_path / "b", "b", 0, 30)  # (in b/data, its default cache b/data/cache)
    (tmp_path / "b" / "data" / "cache").write_text("a file where the default cache directory goes")
    rc, _, err = _run([*common[2:], "--data-path", other], capsys, monkeypatch)
    _one_line_error(rc, err, f"cannot use the index cache in {tmp_path / 'b' / 'data' / 'cache'}", "--data-cache-path")


def test_skip_train_evaluates_the_loaded_model(tmp_path, capsys, monkeypatch):
    """Megatron's --skip-train: the loaded model's validation loss equals the one logged at the end of the run
    that saved it (same weights, and the same validation batches: that run's only evaluation read the set's first
    ones, where --skip-train starts); the test set is evaluated too; nothing is saved."""
    ckpt, log = str(tmp_path / "ckpt"), tmp_path / "m.jsonl"
    flags = ["--mock-data", "--vocab-size", "100", "--eval-iters", "2", "--eval-interval", "4", "--split", "8,1,1"]
    rc, out, err = _run([*flags, "--save", ckpt, "--log-jsonl", str(log)], capsys, monkeypatch)
    assert rc == 0, err
    records = [json.loads(line) for line in open(log)]
    final_valid = [r["validation"] for r in records if "validation" in r][-1]
    assert [r["iteration"] for r in records if "validation" in r] == [3]  # at the end
    assert any("test" in r for r in records)
    before = sorted(os.listdir(ckpt))
    rc = main(["--load", ckpt, "--skip-train", "--train-iters", "6", "--log-jsonl", str(tmp_path / "s.jsonl")])
    out = capsys.readouterr().out
    assert rc == 0 and "--skip-train" in out
    records = [json.loads(line) for line in open(tmp_path / "s.jsonl")]
    assert not any("lm_loss" in r for r in records)  # no training iteration
    valid = [r["validation"] for r in records if "validation" in r]
    assert len(valid) == 1 and abs(valid[0]["lm_loss"] - final_valid["lm_loss"]) < 1e-6 * final_valid["lm_loss"]
    assert any("test" in r for r in records)
    assert sorted(os.listdir(ckpt)) == before


@pytest.mark.parametrize(
    "text,expected",
    [
        ("([0]*3+[1]*5)", (0, 0, 0, 1, 1, 1, 1, 1)),
        ("[1,0]*2", (1, 0, 1, 0)),
        ("2*[1,0]", (1, 0, 1, 0)),  # (Python's eval, which Megatron runs, takes the count on either side)
        ("[0]+2*[1]*2", (0, 1, 1, 1, 1)),
        ("([0]+[1]*3)*2", (0, 1, 1, 1, 0, 1, 1, 1)),
        ("0,1,1", (0, 1, 1)),
        ("2", 2),
        ("[1]", (1,)),  # a one-layer pattern stays a pattern (as an int, [0] read as "every 0th layer")
    ],
)
def test_moe_layer_freq_takes_megatrons_list_expressions(text, expected):
    """Megatron scripts write per-layer patterns as list expressions (DeepSeek-V3: "([0]*3+[1]*58)"); they are
    parsed (never eval'd) into the same pattern."""
    from megatron_lite.flag_values import layer_freq as _layer_freq

    assert _layer_freq(text) == expected


@pytest.mark.parametrize(
    "text",
    ["[0]*", "([0]*3", "__import__('os')", "[0]*x", "[1]*9999999999", "(" * 40 + "[1]*2" + ")" * 40, "2*", "2*3"],
)
def test_bad_moe_layer_freq_is_one_line(text, capsys, monkeypatch):
    rc, _, err = _run(["--num-experts", "4", "--moe-layer-freq", text, "--disable-bias-linear"], capsys, monkeypatch)
    _one_line_error(rc, err, "--moe-layer-freq", "list expression")


@pytest.mark.parametrize(
    "text,fragment", [("0", "--moe-layer-freq 0 must be >= 1"), ("2,1", "may hold only 0 (dense) and 1 (MoE)")]
)
def test_a_moe_layer_freq_out_of_range_is_one_line(text, fragment, capsys, monkeypatch):
    """(--moe-layer-freq 0 divided by zero; a pattern entry of 2 counted as MoE)"""
    argv = ["--num-layers", "2", "--num-experts", "4", "--moe-layer-freq", text, "--disable-bias-linear"]
    rc, _, err = _run(argv, capsys, monkeypatch)
    _one_line_error(rc, err, fragment)


def test_lora_on_multi_latent_attention_runs_and_mla_targets_elsewhere_are_refused(tmp_path, capsys, monkeypatch):
    """linear_qkv (the default target) means MLA's latent projections on an MLA model, also when a resume names
    it again (it was refused as differing from the checkpoint's expanded targets); naming those on a model
    without MLA is a one-line error."""
    mla = "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 8"
    argv = [*mla.split(), "--v-head-dim", "8", "--position-embedding-type", "rope", "--disable-bias-linear"]
    argv += ["--lora-rank", "4", "--lora-target-modules", "linear_qkv", "--mock-data", "--vocab-size", "64"]
    rc, out, err = _run([*argv, "--save", str(tmp_path / "c")], capsys, monkeypatch)
    assert rc == 0, err
    assert "iteration        3/       3 |" in out
    rc, out, err = _run([*argv, "--load", str(tmp_path / "c"), "--train-iters", "4"], capsys, monkeypatch)
    assert rc == 0, err
    assert "iteration        4/       4 |" in out
    # inspect_checkpoint names the latent attention and the adapters (its summary had the dense fields only)
    import importlib.util
    import pathlib

    tool = pathlib.Path(__file__).parents[1] / "tools" / "checkpoint" / "inspect_checkpoint.py"
    spec = importlib.util.spec_from_file_location("inspect_checkpoint", tool)
    inspect = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(inspect)
    assert inspect.main([str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "MLA: q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8" in out
    # the sizes a user gives, not the derived groups (dp_cp, mp, emp, tp_cp_dp, embedding)
    assert "saved under  1 process(es): TP=1, PP=1, DP=1, CP=1, EP=1\n" in out, out
    assert "LoRA: rank 4, alpha 16 on linear_q_down_proj linear_q_up_proj linear_kv_down_proj linear_kv_up_proj" in out
    rc, _, err = _run(["--lora-rank", "4", "--lora-target-modules", "q_b_proj"], capsys, monkeypatch)
    _one_line_error(rc, err, "--lora-target-modules linear_q_up_proj", "--multi-latent-attention")


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--group-query-attention", "--num-query-groups", "2"], "--num-query-groups 2"),
        (["--qk-pos-emb-head-dim", "7"], "--qk-pos-emb-head-dim 7"),
        (["--tensor-model-parallel-size", "2", "--kv-lora-rank", "7"], "--kv-lora-rank + --qk-pos-emb-head-dim"),
    ],
)
def test_bad_multi_latent_attention_flags_are_one_line(argv, fragment, capsys, monkeypatch):
    mla = "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 8"
    base = [*mla.split(), "--v-head-dim", "8", "--position-embedding-type", "rope", "--disable-bias-linear"]
    rc, _, err = _run([*base, *argv], capsys, monkeypatch, world=2 if "--tensor-model-parallel-size" in argv else 1)
    _one_line_error(rc, err, fragment)


def test_multi_latent_attention_without_disable_bias_linear_says_so(capsys, monkeypatch):
    mla = "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 8"
    rc, _, err = _run([*mla.split(), "--v-head-dim", "8", "--position-embedding-type", "rope"], capsys, monkeypatch)
    _one_line_error(rc, err, "--disable-bias-linear")


MLA_FLAGS = (
    "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 8 "
    "--v-head-dim 8 --qk-layernorm --position-embedding-type rope --normalization RMSNorm --swiglu "
    "--disable-bias-linear --vocab-size 64"
).split()


def test_mla_yarn_flags_build_what_deepseeks_config_json_does():
    """Megatron's --rotary-scaling-factor / --mscale / --mscale-all-dim (YaRN, MLA's default RoPE) give the RoPE
    scaling and softmax scale that a DeepSeek config.json with the same YaRN converts to, which the
    transformers reference tests check against transformers itself."""
    import transformers

    from megatron_lite.arguments import parse_args
    from megatron_lite.models.hf import config_from_hf

    yarn = "--rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707".split()
    _, job = parse_args([*TINY, *MLA_FLAGS, *yarn])
    hf = transformers.DeepseekV3Config(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=8,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, first_k_dense_replace=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 0.707, "mscale_all_dim": 0.707},
    )  # fmt: skip
    ref = config_from_hf(hf)
    assert job.model.rope_scaling == ref.rope_scaling
    assert job.model.softmax_scale == pytest.approx(ref.softmax_scale, rel=1e-15)
    assert job.model.softmax_scale > (8 + 8) ** -0.5  # mscale_all_dim really scales it
    _, plain = parse_args([*TINY, *MLA_FLAGS])  # Megatron's default: YaRN with factor 1 is plain RoPE
    assert plain.model.rope_scaling is None and plain.model.softmax_scale == (8 + 8) ** -0.5


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--rope-type", "rope", "--rotary-scaling-factor", "4"], "--rotary-scaling-factor 4.0 with --rope-type rope"),
        (["--rotary-scaling-factor", "0"], "--rotary-scaling-factor 0.0 must be > 0"),
    ],
)
def test_bad_mla_rope_flags_are_one_line(argv, fragment, capsys, monkeypatch):
    rc, _, err = _run([*MLA_FLAGS, *argv], capsys, monkeypatch)
    _one_line_error(rc, err, fragment)


def test_rotary_scaling_factor_without_mla_is_reported_and_yarn_refused(capsys, monkeypatch):
    """Megatron scripts for Llama pass --rotary-scaling-factor, which Megatron reads for MLA only."""
    llama = "--position-embedding-type rope --normalization RMSNorm --swiglu --mock-data --vocab-size 64".split()
    rc, out, err = _run([*llama, "--rotary-scaling-factor", "8"], capsys, monkeypatch)
    assert rc == 0, err
    assert "--rotary-scaling-factor 8.0 has no effect without --multi-latent-attention" in out + err
    rc, _, err = _run([*llama, "--rope-type", "yarn"], capsys, monkeypatch)
    _one_line_error(rc, err, "--rope-type yarn is supported with --multi-latent-attention only")


def test_load_alone_rebuilds_a_multi_latent_attention_run_with_yarn(tmp_path, capsys, monkeypatch):
    """The MLA flags and the YaRN built from --rotary-scaling-factor / --mscale-all-dim come back from the
    checkpoint (the model-shape check would stop the job otherwise); a conflicting explicit factor is refused."""
    ckpt = str(tmp_path / "ckpt")
    yarn = "--rotary-scaling-factor 8 --mscale 0.707 --mscale-all-dim 0.707".split()
    rc, _, err = _run([*MLA_FLAGS, *yarn, "--mock-data", "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    from megatron_lite.arguments import parse_args

    _, saved_job = parse_args([*TINY, *MLA_FLAGS, *yarn])
    rc = main(["--load", ckpt, "--train-iters", "5"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "loaded" in out.out and "iteration        5/       5 |" in out.out
    ns, job = parse_args(["--load", ckpt, "--train-iters", "5"])
    assert job.model.rope_scaling == saved_job.model.rope_scaling and job.model.multi_latent_attention
    assert job.model.softmax_scale == saved_job.model.softmax_scale
    rc = main(["--load", ckpt, "--train-iters", "5", "--rotary-scaling-factor", "4"])
    _one_line_error(rc, capsys.readouterr().err, "--rotary-scaling-factor")


def test_the_group_score_rule_comes_back_from_the_checkpoint(tmp_path, capsys, monkeypatch):
    """A converted DeepSeek-V2 ranks expert groups by their best score (--moe-router-group-score-topn 1), not
    Megatron's top-k // group-topk: resuming with --load alone must keep routing that way."""
    from megatron_lite.arguments import parse_args

    ckpt = str(tmp_path / "ckpt")
    moe = "--num-experts 4 --moe-router-topk 2 --moe-router-num-groups 2 --moe-router-group-topk 1".split()
    argv = [*moe, "--moe-router-group-score-topn", "1", "--disable-bias-linear", "--mock-data", "--vocab-size", "64"]
    rc, _, err = _run([*argv, "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    _, job = parse_args(["--load", ckpt, "--train-iters", "5"])
    assert job.model.moe_router_group_score_topn == 1


def test_lora_targets_of_the_query_latent_follow_the_model(capsys, monkeypatch):
    mla = "--multi-latent-attention --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 8 --v-head-dim 8".split()
    argv = [*mla, "--position-embedding-type", "rope", "--disable-bias-linear", "--lora-rank", "4"]
    rc, _, err = _run([*argv, "--lora-target-modules", "q_a_proj"], capsys, monkeypatch)  # no --q-lora-rank
    _one_line_error(rc, err, "linear_q_down_proj", "no query latent")
    # PEFT's q_proj on an MLA model is its query projection(s) alone (it adapted the key/value latents too);
    # k_proj / v_proj name nothing there (v_proj adapted every projection)
    from megatron_lite.arguments import parse_args

    base = "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --train-iters 1 --mock-data"
    base = [*base.split(), "--vocab-size", "64", *argv]
    for extra, targets in (
        (["--q-lora-rank", "8"], ("linear_q_down_proj", "linear_q_up_proj")),
        ([], ("linear_q_proj",)),
    ):
        assert parse_args([*base, *extra, "--lora-target-modules", "q_proj"])[1].lora.target_modules == targets
    rc, _, err = _run([*argv, "--lora-target-modules", "v_proj"], capsys, monkeypatch)
    _one_line_error(rc, err, "a --multi-latent-attention model makes keys and values from one latent")


def test_explicit_yarn_flags_that_disagree_with_an_mla_checkpoint_are_refused(tmp_path, capsys, monkeypatch):
    """The checkpoint keeps YaRN's resolved factor, not --mscale: a different --mscale (or --rope-type rope) on
    resume would otherwise be ignored; the same --mscale is fine."""
    ckpt = str(tmp_path / "ckpt")
    yarn = "--rotary-scaling-factor 8 --mscale 0.707 --mscale-all-dim 0.707".split()
    rc, _, err = _run([*MLA_FLAGS, *yarn, "--mock-data", "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    from megatron_lite.arguments import parse_args

    parse_args(["--load", ckpt, "--train-iters", "5", "--mscale", "0.707"])  # the same: accepted
    rc = main(["--load", ckpt, "--train-iters", "5", "--mscale", "1.0"])
    _one_line_error(rc, capsys.readouterr().err, "--mscale 1.0 conflicts")
    rc = main(["--load", ckpt, "--train-iters", "5", "--rope-type", "rope"])
    _one_line_error(rc, capsys.readouterr().err, "--rope-type rope conflicts")


def test_load_alone_rebuilds_a_multi_token_prediction_run(tmp_path, capsys, monkeypatch):
    """--mtp-num-layers and --mtp-loss-scaling-factor come back from the checkpoint (its MTP weights need the
    depths); an explicit other depth count is refused, and a negative one is a one-line error."""
    ckpt = str(tmp_path / "ckpt")
    mtp = "--mtp-num-layers 2 --mtp-loss-scaling-factor 0.3".split()
    rc, out, err = _run([*MLA_FLAGS, *mtp, "--mock-data", "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    assert "mtp_2 loss: " in out
    from megatron_lite.arguments import parse_args

    _, job = parse_args(["--load", ckpt, "--train-iters", "5"])
    assert (job.model.mtp_num_layers, job.model.mtp_loss_scaling_factor) == (2, 0.3)
    rc = main(["--load", ckpt, "--train-iters", "5"])
    out = capsys.readouterr()
    assert rc == 0 and "loaded" in out.out and "mtp_1 loss: " in out.out, out.err
    rc = main(["--load", ckpt, "--train-iters", "5", "--mtp-num-layers", "1"])
    _one_line_error(rc, capsys.readouterr().err, "--mtp-num-layers")
    rc, _, err = _run([*MLA_FLAGS, "--mock-data", "--mtp-num-layers", "-1"], capsys, monkeypatch)
    _one_line_error(rc, err, "--mtp-num-layers -1 must be >= 0")
    # a checkpoint without MTP: an explicit --mtp-num-layers 0 agrees with it
    plain = str(tmp_path / "plain")
    rc, _, err = _run([*MLA_FLAGS, "--mock-data", "--save", plain], capsys, monkeypatch)
    assert rc == 0, err
    _, job = parse_args(["--load", plain, "--train-iters", "5", "--mtp-num-layers", "0"])
    assert job.model.mtp_num_layers == 0


# Megatron's DeepSeek-V3 recipe flags (model sizes and data scaled down to a CPU): MLA, sigmoid-routed MoE with the
# expert bias and groups, one MTP depth, selective recompute of MLA's up-projections, the experts' activation and the
# norms, the embedding and loss counted in the pipeline split, and fusion / logging switches that change nothing here.
MEGATRON_DEEPSEEK_V3 = """--num-layers 3 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 --kv-channels 16
    --multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 12 --qk-pos-emb-head-dim 8
    --v-head-dim 10 --qk-layernorm --seq-length 32 --max-position-embeddings 32 --normalization RMSNorm
    --norm-epsilon 1e-6 --swiglu --position-embedding-type rope --untie-embeddings-and-output-weights
    --disable-bias-linear --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 24
    --moe-shared-expert-intermediate-size 24 --moe-layer-freq ([0]*1+[1]*2) --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias --moe-router-num-groups 4 --moe-router-group-topk 2
    --moe-router-topk-scaling-factor 2.5 --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-permute-fusion --moe-router-fusion
    --moe-shared-expert-overlap --moe-per-layer-logging --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
    --recompute-granularity selective --recompute-modules mla_up_proj moe_act layernorm
    --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split
    --cross-entropy-loss-fusion --cross-entropy-fusion-impl te --manual-gc --manual-gc-interval 10
    --micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 1e-4 --log-interval 1 --eval-iters 0
    --mock-data --vocab-size 256 --tokenizer-type NullTokenizer --distributed-backend gloo"""


def test_megatron_deepseek_v3_recipe_flags_run(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert main(MEGATRON_DEEPSEEK_V3.split()) == 0
    out = capsys.readouterr().out
    for line in (
        "--moe-router-fusion has no effect",
        "--moe-shared-expert-overlap has no effect",
        "--cross-entropy-fusion-impl has no effect",
        "--manual-gc-interval has no effect",
    ):
        assert line in out, line
    assert "iteration        3/       3 |" in out and "mtp_1 loss: " in out


@pytest.mark.parametrize(
    "flag,fragment",
    [
        (["--enable-cuda-graph"], "CUDA graphs are not implemented"),
        (["--optimizer-cpu-offload"], "no CPU offload"),
        (["--moe-layer-recompute"], "--recompute-modules moe"),
    ],
)
def test_megatron_flags_we_lack_are_refused_with_the_reason(flag, fragment, capsys, monkeypatch):
    rc, _, err = _run(["--mock-data", "--vocab-size", "64", *flag], capsys, monkeypatch)
    _one_line_error(rc, err, fragment)


def _dry_run_state_bytes(argv, world, capsys, monkeypatch) -> dict[int, float]:
    """--dry-run's per-rank weights+gradients+optimizer bytes, by pipeline-first rank of each printed group."""
    import re

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


def test_generate_runs_a_capacity_factor_moe_one_prompt_at_a_time(tmp_path, capsys, monkeypatch):
    """From a review: batched prompts' tokens compete for the experts' capacity, so under a capacity factor each
    prompt's output depended on the others in its batch; such a model's prompts run one at a time, and start-up
    says so."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("generate_tool", os.path.join(root, "tools", "generate.py"))
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    ckpt = tmp_path / "ckpt"
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-expert-capacity-factor", "1.0", "--mock-data",
           "--disable-bias-linear", "--vocab-size", "100", "--train-iters", "1", "--save", str(ckpt)]  # fmt: skip
    rc, _, err = _run(moe, capsys, monkeypatch)
    assert rc == 0, err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [3 + i, 7, 11 + 2 * i, 5][: 2 + i]}) + "\n" for i in range(3)))
    argv = ["--load", str(ckpt), "--prompts-file", str(prompts), "--max-new-tokens", "3", "--greedy", "--ignore-eos"]
    outs = {}
    for n in (8, 1):
        capsys.readouterr()
        assert (
            generate.main([*argv, "--inference-max-requests", str(n), "--output-json", str(tmp_path / "o.json")]) == 0
        )
        said = capsys.readouterr().err
        assert ("the prompts run one at a time" in said) == (n > 1), said
        outs[n] = json.loads((tmp_path / "o.json").read_text())
    assert [r["generated_ids"] for r in outs[8]] == [r["generated_ids"] for r in outs[1]]


def test_generate_prompts_a_checkpoint_trained_on_the_embedded_corpus(tmp_path, capsys, monkeypatch):
    """The quick start's `generate.py --load runs/demo/checkpoints --prompt ...`: a job given no data flags
    trained with the embedded corpus's tokenizer, which generation now takes (it said the checkpoint names no
    tokenizer); a tokenizer path the checkpoint names but this machine lacks (relative to where training ran)
    is one line pointing at --tokenizer-model, which takes its place."""
    import importlib.util

    from megatron_lite.data.embedded import build_embedded_corpus

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("generate_tool", os.path.join(root, "tools", "generate.py"))
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    ckpt = tmp_path / "ckpt"
    rc, _, err = _run(["--train-iters", "1", "--save", str(ckpt)], capsys, monkeypatch)
    assert rc == 0, err
    argv = ["--load", str(ckpt), "--prompt", "def main(", "--max-new-tokens", "2", "--greedy"]
    out = tmp_path / "g.json"
    assert generate.main([*argv, "--output-json", str(out)]) == 0, capsys.readouterr().err
    assert len(json.loads(out.read_text())["generated_ids"]) == 2
    meta_path = next(ckpt.glob("iter_*")) / "metadata.json"
    meta = json.loads(meta_path.read_text())
    # a conversion's checkpoint names no data flags either, but its vocabulary is the model's: no guessing
    meta_path.write_text(json.dumps({**meta, "converted_from": {"path": "hf"}}))
    capsys.readouterr()
    assert generate.main(argv) == 2 and "names none; pass --tokenizer-model" in capsys.readouterr().err
    meta["config"]["data"].update(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="rel/tokenizer.json")
    meta_path.write_text(json.dumps(meta))
    capsys.readouterr()
    assert generate.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rel/tokenizer.json" in err and "pass --tokenizer-model" in err, err
    assert generate.main([*argv, "--tokenizer-model", build_embedded_corpus()[1]]) == 0


def test_a_model_trained_on_the_embedded_corpus_exports_its_tokenizer(tmp_path, capsys, monkeypatch):
    """The quick start's model exported to Hugging Face (from the checkpoint review): it went without a tokenizer
    and with transformers' class defaults for bos/eos (ids of other tokens, or past the 4096-token vocabulary);
    now with the corpus's tokenizer, which transformers loads and which encodes as ours, and its EOD as eos."""
    import importlib.util

    transformers = pytest.importorskip("transformers")
    from megatron_lite.data.embedded import EOD, build_embedded_corpus
    from megatron_lite.data.tokenizers import HuggingFaceTokenizer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "convert_tool", os.path.join(root, "tools", "checkpoint", "convert.py")
    )
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    rc, _, err = _run(["--train-iters", "1", "--save", str(ckpt)], capsys, monkeypatch)
    assert rc == 0, err
    assert (
        convert.main(["--loader", "megatron_lite", "--saver", "hf", "--load-dir", str(ckpt), "--save-dir", str(out)])
        == 0
    )
    assert "tokenizer: the embedded corpus's" in capsys.readouterr().out
    ours = HuggingFaceTokenizer(build_embedded_corpus()[1])
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    text = "def main(argv):\n    return sorted(argv)"
    assert theirs(text)["input_ids"] == ours.encode(text)
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == theirs.convert_tokens_to_ids(EOD) == ours.eod


def test_lora_on_a_pretraining_checkpoint_resumes_exactly(tmp_path, capsys, monkeypatch):
    """LoRA adapters started on a base run's checkpoint (no --finetune: the iteration goes on) and the run resumed
    from its own save equals the uninterrupted run: the adapters' Adam step count starts at 0, not at the base
    run's (saved as adam_step, a resume's bias correction had jumped ahead of the moments)."""
    base = ["--mock-data", "--vocab-size", "100", "--lr", "1e-2"]
    lora = [*base, "--lora-rank", "4", "--train-iters", "12", "--load", str(tmp_path / "base")]
    rc, _, err = _run([*base, "--train-iters", "5", "--save", str(tmp_path / "base")], capsys, monkeypatch)
    assert rc == 0, err
    straight, resumed = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl"
    assert _run([*lora, "--log-jsonl", str(straight)], capsys, monkeypatch)[0] == 0
    own = ["--save", str(tmp_path / "lora"), "--save-interval", "7"]
    assert _run([*lora, *own, "--exit-interval", "7"], capsys, monkeypatch)[0] == 0
    meta = json.loads((tmp_path / "lora" / "iter_0000007" / "metadata.json").read_text())
    assert meta["adam_step"] == 2  # iterations 6 and 7: the adapters' own steps
    assert (
        _run([*lora, *own, "--load", str(tmp_path / "lora"), "--log-jsonl", str(resumed)], capsys, monkeypatch)[0] == 0
    )

    def losses(path):
        return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in map(json.loads, open(path)) if "lm_loss" in r}

    a, b = losses(straight), losses(resumed)
    assert sorted(b) == list(range(8, 13)) and all(a[it] == b[it] for it in b), (a, b)


LLAMA_LIKE = "--swiglu --normalization RMSNorm --disable-bias-linear"
ALL_SEVEN = "q_proj k_proj v_proj o_proj gate_proj up_proj down_proj"


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
    import json
    import re

    from megatron_lite.training import dry_run

    argv = ["--hidden-size", "64", "--num-attention-heads", "4", "--mock-data", "--vocab-size", "512",
            "--attention-dropout", "0", *flags.split()]  # fmt: skip
    monkeypatch.setattr(dry_run, "_bytes", lambda n: f"{n:.0f} B")
    rc, out, err = _run([*argv, "--dry-run"], capsys, monkeypatch)
    assert rc == 0, err
    predicted = int(re.search(r"~(\d+) B activations at the schedule's peak", out).group(1))
    jsonl = tmp_path / "m.jsonl"
    rc, _, err = _run([*argv, "--train-iters", "1", "--log-memory-breakdown", "--log-jsonl", str(jsonl)],
                      capsys, monkeypatch)  # fmt: skip
    assert rc == 0, err
    measured = [json.loads(line) for line in jsonl.read_text().splitlines()][-1]["mem_activations_bytes"]
    assert abs(predicted / measured - 1) < 0.05, (predicted, measured)


def test_the_dry_run_checks_what_the_run_checks_and_the_run_checks_data_first(tmp_path, capsys, monkeypatch):
    """From the validation review: the dry run said "ok" to what the run refuses (data whose token ids exceed the
    vocabulary), and the run found a missing dataset only after building the
    model and loading the checkpoint. A dataset absent from the planning machine is a note."""
    from megatron_lite.data.indexed import IndexedDatasetWriter

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


def test_wandb_and_tensorboard_get_a_skipped_iterations_loss(capsys, monkeypatch):
    """From a logging review: Megatron's training_log writes each iteration's loss_dict to W&B and TensorBoard,
    skipped or not, so an fp16 run's loss-scale warm-up (every step skipped on an overflow) is plotted from iteration
    1; ours left the skipped steps' losses out. The console's window mean still leaves them out, as Megatron's."""
    from megatron_lite.training.logger import MetricsLogger

    steps = []
    real = MetricsLogger.step
    monkeypatch.setattr(MetricsLogger, "step", lambda self, i, m: (steps.append((i, dict(m))), real(self, i, m)))
    argv = ["--mock-data", "--vocab-size", "100", "--fp16", "--initial-loss-scale", "1e30"]  # (every step overflows)
    rc, out, err = _run(argv, capsys, monkeypatch)
    assert rc == 0, err
    assert out.count("number of skipped iterations:   1 |") == 3 and "lm loss:" not in out
    assert [i for i, m in steps if "lm_loss" in m] == [1, 2, 3], steps
    assert all(math.isfinite(m["lm_loss"]) and m["grad_norm"] is None for _, m in steps)


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_moe_per_layer_losses_go_to_wandb_every_iteration_under_megatrons_names(kind, capsys, monkeypatch):
    """From a logging review: Megatron's --moe-per-layer-logging writes each layer's losses every iteration as
    moe/<loss>_layer_<i> (load_balancing_loss, seq_load_balancing_loss, z_loss); ours went every --log-interval as
    train/moe_layer<i>_aux_loss, the sequence-level loss under the plain one's name."""
    from megatron_lite.training.logger import MetricsLogger, _megatron_key

    steps = []
    real = MetricsLogger.step
    monkeypatch.setattr(MetricsLogger, "step", lambda self, i, m: (steps.append((i, dict(m))), real(self, i, m)))
    moe = ["--mock-data", "--vocab-size", "100", "--num-experts", "4", "--disable-bias-linear", "--log-interval", "3"]
    moe += ["--moe-router-load-balancing-type", kind, "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]
    rc, out, err = _run([*moe, "--moe-per-layer-logging"], capsys, monkeypatch)
    assert rc == 0, err
    balancing = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}[kind]
    want = {f"moe/{name}_layer_{i}" for name in (balancing, "z_loss") for i in (0, 1)}
    assert [i for i, _ in steps] == [1, 2, 3]
    for _, m in steps:
        assert want <= {_megatron_key(k) for k in m}, m
        assert all(m[k] > 0 for k in m if k.startswith("moe_layer"))


def test_megatrons_report_memory_line_on_a_gpu(monkeypatch):
    """From a logging review: Megatron prints "[Rank N] (after K iterations) memory (MB) | allocated: ... | max
    allocated: ... | reserved: ... | max reserved: ..." once, which users grep; on a CPU there is no allocator to
    report (the allocator's numbers are faked here: the line's format is what is tested)."""
    from megatron_lite.training import memory

    assert memory.report_memory("(after 5 iterations)", torch.device("cpu")) is None
    values = {"memory_allocated": 1, "max_memory_allocated": 2, "memory_reserved": 3, "max_memory_reserved": 4}
    for name, mb in values.items():
        monkeypatch.setattr(torch.cuda, name, lambda device, mb=mb: mb * 1024 * 1024)
    line = memory.report_memory("(after 5 iterations)", torch.device("cuda", 0))
    assert line == (
        "(after 5 iterations) memory (MB) | allocated: 1.0 | max allocated: 2.0 | reserved: 3.0 | max reserved: 4.0"
    )


def _main_seeded_by_rank(argv: list[str], port: int) -> tuple[int, bool]:
    """pretrain's main on one rank of a bare pool, with a --seed of its own (a rank launched with other flags)."""
    from megatron_lite.resilience import flight_recorder

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rc = main([*argv, "--seed", str(1 + int(os.environ["RANK"]))])
    left = dist.is_initialized()
    if left:  # (the test's verdict; the process leaves with the pool)
        dist.destroy_process_group()
    return rc, left or bool(flight_recorder._INSTALLED)


@pytest.mark.slow
def test_a_configuration_refused_after_the_group_is_joined_leaves_it(capfd):
    """Ranks launched with other flags are refused once the group exists (the configuration check): main returns
    2 with the group destroyed. It was left to the interpreter's exit, which aborted at times, and torchrun named
    the rank's SIGABRT ("terminate called without an active exception") instead of its exit code 2."""
    from dist_pool import WorkerPool
    from pretrain_jobs import free_port

    pool = WorkerPool(2, init_group=False)
    try:
        got = pool.run(_main_seeded_by_rank, [*TINY, "--mock-data", "--vocab-size", "64"], free_port())
    finally:
        pool.close()
    assert got == [(2, False), (2, False)], got
    assert "launched with different configurations" in capfd.readouterr().err
