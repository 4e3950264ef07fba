"""--sft's tokenized records are kept for the next run (data/sft_cache.py): a second start reads them mapped
instead of tokenizing again, the same arrays and samples as a fresh read; a changed file, sequence length or chat
template is tokenized again; an unwritable cache folder costs the cache only; a bad record is still refused and
leaves nothing cached; processes starting together tokenize once."""

from __future__ import annotations

import json
import multiprocessing
import os

import numpy as np
import pytest
import torch
from test_sft_messages import CHATML, QWEN, TALK, _tokenizer, _write

from megatron_lite.config import ConfigError
from megatron_lite.data import sft_cache
from megatron_lite.data.sft import SFTDataset, read_records
from megatron_lite.data.tokenizers import build_tokenizer

OTHER = [{"role": "user", "content": "again?"}, {"role": "assistant", "content": "yes"}]


def _build(path, tok, cache, seq_length=64):
    said = []
    d = SFTDataset(path, tok, seq_length=seq_length, seed=0, log=said.append, cache_dir=str(cache))
    return d, said


def _same(a: SFTDataset, b: SFTDataset) -> None:
    for name in ("tokens", "starts", "prompt_lens", "trained", "_cuts"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.packed == b.packed
    for i in range(4):
        x, y = a[i], b[i]
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("packed", [False, True])
def test_second_start_reads_the_cache(tmp_path, packed):
    folder = _tokenizer(tmp_path / "tok", CHATML)
    tok = build_tokenizer("HuggingFaceTokenizer", model=folder)
    lines = [TALK + TALK, OTHER] if packed else [TALK, OTHER]  # (a line of two conversations: document ids)
    path = _write(tmp_path / "d.jsonl", *lines, *lines)
    fresh = SFTDataset(path, tok, seq_length=64, seed=0)  # (no cache_dir: tokenized, nothing kept)
    first, said = _build(path, tok, tmp_path / "cache")
    assert any("tokenized in" in m and "kept for the next run" in m for m in said), said
    second, said = _build(path, tok, tmp_path / "cache")
    assert any("read from the tokenized cache" in m for m in said), said
    assert isinstance(second.tokens, np.memmap)  # (mapped: a node's ranks and workers share its pages)
    assert second.packed == packed
    _same(fresh, first)
    _same(fresh, second)
    assert second.num_records == fresh.num_records and second.cut == fresh.cut
    assert second.part(1, 3).record(0) == fresh.part(1, 3).record(0)


def test_what_the_records_depend_on_is_tokenized_again(tmp_path):
    folder = _tokenizer(tmp_path / "tok", CHATML)
    tok = build_tokenizer("HuggingFaceTokenizer", model=folder)
    path = _write(tmp_path / "d.jsonl", TALK, OTHER)
    cache = tmp_path / "cache"
    _build(path, tok, cache)
    # another sequence length
    _, said = _build(path, tok, cache, seq_length=32)
    assert any("tokenized in" in m for m in said), said
    # the file grown by a record
    with open(path, "a") as f:
        f.write(json.dumps({"messages": OTHER}) + "\n")
    d, said = _build(path, tok, cache)
    assert any("tokenized in" in m for m in said) and d.num_records == 3
    # another chat template beside the same tokenizer.json (Qwen's default system turn: other ids)
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN}))
    d, said = _build(path, build_tokenizer("HuggingFaceTokenizer", model=folder), cache)
    assert any("tokenized in" in m for m in said), said
    _same(d, SFTDataset(path, build_tokenizer("HuggingFaceTokenizer", model=folder), seq_length=64, seed=0))


def test_a_folder_that_cannot_hold_it_costs_the_cache_only(tmp_path):
    folder = _tokenizer(tmp_path / "tok", CHATML)
    tok = build_tokenizer("HuggingFaceTokenizer", model=folder)
    path = _write(tmp_path / "d.jsonl", TALK, OTHER)
    (tmp_path / "blocked").write_text("a file where the folder would be")
    d, said = _build(path, tok, tmp_path / "blocked")
    assert any("--data-cache-path" in m and "tokenized on every start" in m for m in said), said
    _same(d, SFTDataset(path, tok, seq_length=64, seed=0))


def test_a_bad_record_is_refused_and_nothing_is_kept(tmp_path):
    folder = _tokenizer(tmp_path / "tok", CHATML)
    tok = build_tokenizer("HuggingFaceTokenizer", model=folder)
    path = _write(tmp_path / "d.jsonl", TALK, [{"role": "user", "content": "no reply"}])
    with pytest.raises(ConfigError, match=r"d\.jsonl:2: the conversation has no assistant turn"):
        _build(path, tok, tmp_path / "cache")
    assert not [n for n in os.listdir(tmp_path / "cache") if n.endswith((".json", ".npy"))]


def _start(path, folder, cache, out):
    tok = build_tokenizer("HuggingFaceTokenizer", model=folder)
    reads = []

    def read(*args):
        reads.append(1)
        return read_records(*args)

    arrays, _ = sft_cache.cached_records(path, tok, 64, cache, read)
    with open(out, "w") as f:
        json.dump({"reads": len(reads), "tokens": np.asarray(arrays["tokens"]).tolist()}, f)


def test_processes_starting_together_tokenize_once(tmp_path):
    folder = _tokenizer(tmp_path / "tok", CHATML)
    path = _write(tmp_path / "d.jsonl", *([TALK, OTHER] * 50))
    fork = multiprocessing.get_context("fork")
    procs = [fork.Process(target=_start, args=(path, folder, str(tmp_path / "cache"), tmp_path / f"{i}.json"))
             for i in range(3)]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    got = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(3)]
    assert sum(g["reads"] for g in got) == 1, got
    expected = read_records(path, build_tokenizer("HuggingFaceTokenizer", model=folder), 64)[0]["tokens"].tolist()
    assert all(g["tokens"] == expected for g in got)


def test_the_job_keeps_it_in_data_cache_path_or_beside_the_file(tmp_path):
    """As Megatron keeps a dataset's indices: --data-cache-path, else cache/ beside the data."""
    from megatron_lite.data.builder import build_datasets, resolve_data
    from megatron_lite.data.config import DataConfig

    path = tmp_path / "data" / "r.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps({"prompt": f"{i} 2 3", "response": f"{i + 1} 5"}) + "\n" for i in range(20)))
    for cache, where in ((str(tmp_path / "elsewhere"), tmp_path / "elsewhere"), (None, tmp_path / "data" / "cache")):
        data = DataConfig(data_path=(str(path),), split="80,20,0", sft=True, tokenizer_type="NullTokenizer",
                          vocab_size=100, data_cache_path=cache)  # fmt: skip
        for seen in ("tokenized in", "read from the tokenized cache"):
            said = []
            train, valid, _ = build_datasets(resolve_data(data, log=said.append), data, (8, 8, 0), 16, 0, said.append)
            assert any(seen in m and str(where) in m for m in said), said
            assert train.num_records == 16 and valid.record(0) == ([16, 2, 3], [17, 5, 100])


def test_a_tokenizer_setting_outside_its_files_is_in_the_key(tmp_path):
    """Every plain setting the tokenizer holds names the cache (a review: TikTokenizer's special tokens, changed by
    --tokenizer-special-tokens, read an old cache). Here one attribute stands for them."""
    folder = _tokenizer(tmp_path / "tok", CHATML)
    tok = build_tokenizer("HuggingFaceTokenizer", model=folder)
    path = _write(tmp_path / "d.jsonl", TALK)
    before = sft_cache.cache_key(path, tok, 64)
    tok.specials = ["<unk>", "<s>", "</s>", "<|user|>"]
    assert sft_cache.cache_key(path, tok, 64) != before


def test_a_damaged_cache_is_said_and_built_again(tmp_path):
    folder = _tokenizer(tmp_path / "tok", CHATML)
    tok = build_tokenizer("HuggingFaceTokenizer", model=folder)
    path = _write(tmp_path / "d.jsonl", TALK, OTHER)
    _build(path, tok, tmp_path / "cache")
    tokens = next((tmp_path / "cache").glob("*.tokens.npy"))
    tokens.write_bytes(tokens.read_bytes()[:-8])  # (truncated: it was a traceback)
    d, said = _build(path, tok, tmp_path / "cache")
    assert any("is damaged" in m and "tokenizing again" in m for m in said), said
    assert any("kept for the next run" in m for m in said), said
    _same(d, SFTDataset(path, tok, seq_length=64, seed=0))


def test_after_a_process_that_could_not_keep_it_the_others_tokenize_at_once(tmp_path):
    """The process holding the lock left no cache (a full disk): one that waited for it tokenizes without
    taking its turn to build (the node's ranks had tokenized one after another: a review)."""
    import fcntl
    import threading

    folder = _tokenizer(tmp_path / "tok", CHATML)
    tok = build_tokenizer("HuggingFaceTokenizer", model=folder)
    path = _write(tmp_path / "d.jsonl", TALK, OTHER)
    cache = tmp_path / "cache"
    cache.mkdir()
    lock = open(cache / f"sft_{sft_cache.cache_key(path, tok, 64)}.lock", "a")
    fcntl.flock(lock, fcntl.LOCK_EX)  # (another process building: released with nothing kept)
    threading.Timer(0.5, lock.close).start()
    arrays, packed = sft_cache.cached_records(path, tok, 64, str(cache), read_records)
    assert np.array_equal(arrays["tokens"], read_records(path, tok, 64)[0]["tokens"]) and not packed
    assert not list(cache.glob("*.json"))  # (tokenized, not built in its turn)
