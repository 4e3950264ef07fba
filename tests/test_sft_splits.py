"""--sft's train/valid/test splits, as Megatron's --sft builds its SFTDataset through BlendedMegatronDatasetBuilder:
--split divides a JSONL file's records into contiguous ranges by the rounded weights, or each split reads its own
files (--train/valid/test-data-path); validation and the final test evaluation run on them with the
response-only loss mask, per token (data/sft.py)."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from test_pretrain_cli import _one_line_error, _run

from megatron_lite.data.builder import build_datasets, resolve_data
from megatron_lite.data.config import DataConfig

EOD = 100  # NullTokenizer --vocab-size 100: ids are the text, the end-of-document id 100


def _records(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100) for _ in range(rng.randint(2, 6))], [rng.randrange(100) for _ in range(rng.randint(1, 5))])
        for _ in range(n)
    ]


def _write(path, records) -> str:
    path.write_text("".join(json.dumps({"prompt": " ".join(map(str, p)), "response": " ".join(map(str, r))}) + "\n"
                            for p, r in records))  # fmt: skip
    return str(path)


def _build(data: DataConfig, num_samples=(8, 8, 8)):
    return build_datasets(resolve_data(data, log=lambda m: None), data, num_samples, 16, 0)


@pytest.mark.parametrize(
    "n,split,ranges",
    [
        # Megatron's split matrix: cumulative weights x N, each end rounded (Python's round): 0.85 x 15 = 12.75 -> 13
        (15, "60,25,15", [(0, 9), (9, 13), (13, 15)]),
        # the default 969,30,1: 38.76 -> 39, 39.96 -> 40; the test split [40, 40) holds nothing
        (40, "969,30,1", [(0, 39), (39, 40), None]),
        (10, "1,1,0", [(0, 5), (5, 10), None]),
    ],
)
def test_split_gives_megatrons_record_ranges(tmp_path, n, split, ranges):
    records = _records(n)
    path = _write(tmp_path / "r.jsonl", records)
    data = DataConfig(data_path=(path,), split=split, sft=True, tokenizer_type="NullTokenizer", vocab_size=100)
    for ds, want in zip(_build(data), ranges):
        if want is None:
            assert ds is None
            continue
        lo, hi = want
        assert ds.num_records == hi - lo
        assert [ds.record(i) for i in range(hi - lo)] == [(p, r + [EOD]) for p, r in records[lo:hi]]
        # an epoch of the split visits each of its records once, in a seeded order
        first = sorted(tuple(ds[i]["tokens"].tolist()) for i in range(hi - lo))
        assert first == sorted(tuple(ds[hi - lo + i]["tokens"].tolist()) for i in range(hi - lo))
        assert len(set(first)) == hi - lo or len({tuple(p + r) for p, r in records[lo:hi]}) < hi - lo


def test_per_split_files_and_their_blends(tmp_path):
    """Each split reads its own files whole; several in a split are blended by their weights (or by their
    records when no weights are given), as --train/valid/test-data-path blend indexed datasets."""
    a, b, c = (
        _write(tmp_path / f"{k}.jsonl", _records(n, seed)) for k, n, seed in (("a", 6, 1), ("b", 3, 2), ("c", 9, 3))
    )
    kw = dict(sft=True, tokenizer_type="NullTokenizer", vocab_size=100, split="1,0,0")  # (--split is not read)
    train, valid, test = _build(DataConfig(train_data_path=(a,), valid_data_path=(b,), test_data_path=(c,), **kw))
    assert (train.num_records, valid.num_records, test.num_records) == (6, 3, 9)
    assert valid.record(0) == (_records(3, 2)[0][0], _records(3, 2)[0][1] + [EOD])
    train, valid, test = _build(DataConfig(train_data_path=(a,), valid_data_path=("3", b, "1", c), **kw), (4, 400, 0))
    assert test is None and valid.num_records == 12
    draws = [int(i) for i in valid.dataset_index]
    assert len(draws) == 400 and draws.count(0) == 300  # weights 3:1
    _, valid, _ = _build(DataConfig(train_data_path=(a,), valid_data_path=(b, c), **kw), (4, 120, 0))
    assert [int(i) for i in valid.dataset_index].count(0) == 30  # by records, 3:9


def _losses(log) -> dict[tuple[int, str], float]:
    out = {}
    for line in open(log):
        r = json.loads(line)
        for kind in ("validation", "test"):
            if kind in r:
                out.setdefault((r["iteration"], kind), r[kind]["lm_loss"])  # (the interval's, not the end's)
    return out


def _reference_loss(save_dir, records) -> float:
    """The response-token loss of `records` by a forward of each alone (no padding, no mask) through the saved
    model: summed over their response tokens and closing end-of-document tokens, over their count."""
    from megatron_lite.checkpoint.compatibility import model_config_from_dict
    from megatron_lite.checkpoint.hf_convert import read_model_tensors
    from megatron_lite.config import ParallelConfig
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    meta, tensors = read_model_tensors(str(save_dir))
    model = build_model(
        model_config_from_dict(meta["config"]["model"]), ParallelContext.virtual(ParallelConfig()), seed=1
    )
    model[0].load_full_state_dict(tensors)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt, response in records:
            ids = torch.tensor([prompt + response + [EOD]])
            logits = model(ids)[0, :, : EOD + 1].double()  # (the padded vocabulary's extra rows are no token)
            targets = ids[0, len(prompt) :]  # predicted from positions len(prompt) - 1 on
            total += F.cross_entropy(logits[len(prompt) - 1 : -1], targets, reduction="sum").item()
            count += len(targets)
    return total / count


def test_validation_and_test_losses_are_the_records_response_loss(tmp_path, capsys, monkeypatch):
    """--split 60,25,15 of 15 records: validation (records 9-12) at iteration 2 and the test set (13-14) at the
    end log the loss a forward of exactly those records gives through the trained model, on their response tokens
    only; the same records as three files given to --train/valid/test-data-path train and log the same."""
    records = _records(15)
    path = _write(tmp_path / "r.jsonl", records)
    files = [
        _write(tmp_path / f"{k}.jsonl", records[lo:hi]) for k, lo, hi in (("t", 0, 9), ("v", 9, 13), ("s", 13, 15))
    ]
    common = ["--sft", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--train-iters", "2",
              "--eval-interval", "2", "--eval-iters", "1", "--hidden-dropout", "0"]  # fmt: skip
    logged = {}
    for name, data in (
        ("split", ["--data-path", path, "--split", "60,25,15"]),
        ("files", ["--train-data-path", files[0], "--valid-data-path", files[1], "--test-data-path", files[2]]),
    ):
        log = tmp_path / f"{name}.jsonl"
        argv = [*common, *data, "--save", str(tmp_path / name), "--log-jsonl", str(log)]
        rc, out, err = _run(argv, capsys, monkeypatch)
        assert rc == 0, err
        logged[name] = _losses(log)
        # (a review: the records --split held back from training were not said; once, with the way to keep them)
        said = f"--sft {path}: 15 records, 9 for training, 4 validation, 2 test (--split 60,25,15; --split 100,0,0"
        assert out.count(said) == (name == "split"), out
    assert logged["split"] == logged["files"]
    assert set(logged["split"]) == {(2, "validation"), (2, "test")}
    # (the end's validation, after the interval's at iteration 2, reads the next epoch of the same 4 records)
    assert logged["split"][(2, "validation")] == pytest.approx(
        _reference_loss(tmp_path / "split", records[9:13]), rel=1e-6
    )
    assert logged["split"][(2, "test")] == pytest.approx(_reference_loss(tmp_path / "split", records[13:15]), rel=1e-6)


def test_a_resumed_run_continues_the_validation_records(tmp_path, capsys, monkeypatch):
    """Validation goes on where the last evaluation stopped, across a restart: 5 validation records read 4 at a
    time, so each evaluation reads other ones; a run stopped at 1 and resumed logs what the unbroken run does."""
    path = _write(tmp_path / "r.jsonl", _records(20))
    common = ["--sft", "--data-path", path, "--split", "75,25,0", "--tokenizer-type", "NullTokenizer",
              "--vocab-size", "100", "--eval-interval", "1", "--eval-iters", "1"]  # fmt: skip
    rc, _, err = _run(
        [*common, "--train-iters", "2", "--log-jsonl", str(tmp_path / "whole.jsonl")], capsys, monkeypatch
    )
    assert rc == 0, err
    ck = str(tmp_path / "ck")
    parts = [*common, "--save", ck, "--load", ck, "--log-jsonl", str(tmp_path / "parts.jsonl")]
    for iters in ("1", "2"):
        rc, _, err = _run([*parts, "--train-iters", iters], capsys, monkeypatch)
        assert rc == 0, err
    whole, resumed = _losses(tmp_path / "whole.jsonl"), _losses(tmp_path / "parts.jsonl")
    assert set(whole) == {(1, "validation"), (2, "validation")}
    # (the first part's end evaluated samples 4-7 after its save: the resumed evaluation at 2 reads them again)
    assert resumed == whole


@pytest.mark.parametrize(
    "flags,fragments",
    [
        (["--data-path", "missing.jsonl"], ["--sft --data-path missing.jsonl: no such file"]),
        (["--train-data-path", "t.jsonl", "--valid-data-path", "nothere.jsonl"], ["--valid-data-path nothere.jsonl"]),
        (["--valid-data-path", "t.jsonl"], ["--valid-data-path needs --train-data-path too"]),
        (["--data-path", "t.jsonl", "--train-data-path", "t.jsonl"], ["--train-data-path", "drop --data-path"]),
        (["--data-path", "t.jsonl", "--full-validation"], ["--full-validation", "--sft's records repeat"]),
        ([], ["--sft needs --data-path", "--train-data-path"]),
        (["--data-path", "t.jsonl", "--split", "0,1,0"], ["the train split holds no documents (--split 0,1,0"]),
        # (from a review: it read no records and blamed --data-path; a byte not UTF-8 was a traceback)
        (["--mock-data"], ["--sft reads JSONL prompt/response records", "drop --mock-data"]),
        (["--data-path", "latin1.jsonl"], ["latin1.jsonl:2: not UTF-8 text", "SFT records are JSON lines in UTF-8"]),
    ],
)
def test_bad_sft_data_flags_are_one_line(tmp_path, flags, fragments, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "t.jsonl", _records(4))
    (tmp_path / "latin1.jsonl").write_bytes(open(tmp_path / "t.jsonl", "rb").readline() + b'{"prompt": "caf\xe9"}\n')
    argv = ["--sft", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", *flags]
    rc, _, err = _run(argv, capsys, monkeypatch)
    _one_line_error(rc, err, *fragments)


def test_a_split_never_read_leaves_its_files_alone(tmp_path, capsys, monkeypatch):
    """(From a review: an empty --valid-data-path file stopped a run that evaluates nothing, and a large one was
    tokenized on every rank for nothing.)"""
    train, empty = _write(tmp_path / "t.jsonl", _records(4)), tmp_path / "empty.jsonl"
    empty.write_text("")
    argv = ["--sft", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--train-data-path", train,
            "--valid-data-path", str(empty), "--train-iters", "1", "--eval-iters", "0"]  # fmt: skip
    rc, _, err = _run(argv, capsys, monkeypatch)
    assert rc == 0, err


def test_sft_splits_under_data_parallelism_equal_one_process(tmp_path, pretrain_job):
    """--split's train, validation and test sets at DP=2 (one sample a rank per micro-batch, each rank's
    samples counting other numbers of response tokens) log one process's per-iteration lm_loss, grad_norm and
    validation and test losses."""
    from test_pretrain_torchrun import records

    path = _write(tmp_path / "r.jsonl", _records(24))
    common = ["--sft", "--data-path", path, "--split", "2,1,1", "--tokenizer-type", "NullTokenizer",
              "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
              "--seq-length", "16", "--global-batch-size", "4", "--lr", "1e-3", "--log-interval", "1",
              "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "2", "--hidden-dropout", "0",
              "--attention-dropout", "0", "--distributed-backend", "gloo"]  # fmt: skip
    runs = {}
    for world, mbs in ((1, 4), (2, 1)):
        log = str(tmp_path / f"w{world}.jsonl")
        pretrain_job(world, [*common, "--micro-batch-size", str(mbs), "--log-jsonl", log])
        runs[world] = [(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in records(log)], _losses(log)
    assert set(runs[1][1]) == set(runs[2][1]) == {(2, "validation"), (2, "test")}
    flat = {w: [x for r in runs[w][0] for x in r] + [runs[w][1][k] for k in sorted(runs[1][1])] for w in (1, 2)}
    assert len(flat[1]) == 8 and flat[2] == pytest.approx(flat[1], rel=1e-5)
