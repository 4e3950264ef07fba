"""The pretraining entry point: --help, bad input that stops with one line before any collective, and a
real single-process run. (Multi-rank runs: tests/test_pretrain_layouts.py and tests/test_pretrain_torchrun.py.)"""

from __future__ import annotations

import json
import os

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
    # a file (a checkpoint's tensors, say) was said not to exist, and the run trained from scratch
    load = str(tmp_path / "ckpt" / "notes.txt")
    rc, out, err = _run(["--mock-data", "--vocab-size", "100", "--load", load], capsys, monkeypatch)
    _one_line_error(rc, err, f"--load {load} is a file; give the directory of checkpoints that holds it")


def test_missing_load_dir_starts_from_scratch_unless_told_otherwise(tmp_path, capsys, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    rc, out, err = _run(["--mock-data", "--vocab-size", "100", "--load", ckpt, "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    # (a path that does not exist is said so, with the flag that refuses it: a mistyped --load trained from scratch)
    said = f"no checkpoint in --load {ckpt}: the directory does not exist; starting from scratch "
    assert said + "(--exit-on-missing-checkpoint makes that an error)" in out, out
    assert os.path.exists(os.path.join(ckpt, "latest_checkpointed_iteration.txt"))
    rc, _, err = _run(
        ["--mock-data", "--vocab-size", "100", "--load", str(tmp_path / "other"), "--exit-on-missing-checkpoint"],
        capsys,
        monkeypatch,
    )
    _one_line_error(rc, err, f"--load {tmp_path / 'other'} does not exist and --exit-on-missing-checkpoint is set")


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
    # (a --save nothing can be written to, as on a read-only mount, is not refused: --skip-train saves nothing)
    rc = main(["--load", ckpt, "--save", "/proc/nope", "--skip-train", "--train-iters", "6", "--eval-iters", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "--skip-train" in out


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
