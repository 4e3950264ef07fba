"""GPTDataset's index arrays against Megatron-core's rules: the --split document ranges
(convert_split_vector_to_split_matrix + _build_megatron_dataset_splits), the separate final epoch
(_build_document_sample_shuffle_indices), and an index cache that never outlives the files it was built from."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from megatron_lite.data.config import DataConfig
from megatron_lite.data.gpt_dataset import GPTDataset, split_document_ranges
from megatron_lite.data.indexed import IndexedDataset, IndexedDatasetWriter


@pytest.mark.parametrize(
    "split, n, expected",
    [
        # cumulative .969/.999/1: [0, round(47.481)), [47, round(48.951)), [49, 49)
        ("969,30,1", 49, [(0, 47), (47, 49), (49, 49)]),
        # cumulative .25/.5/1 of 3: round(.75) = 1, round(1.5) = 2 (Python's round, half to even)
        ("1,1,2", 3, [(0, 1), (1, 2), (2, 3)]),
        # round(.98 * 25 = 24.5) = 24; a zero weight is an empty part
        ("98,2,0", 25, [(0, 24), (24, 25), (0, 0)]),
        ("90,5,5", 5, [(0, 4), (4, 5), (5, 5)]),
    ],
)
def test_split_ranges_follow_megatron_core(split, n, expected):
    assert split_document_ranges(n, DataConfig(split=split).split_weights) == expected


@pytest.mark.parametrize("split", ["98,2,0", "98/2/0", "98 2 0", "'98, 2, 0'", " 98  2 0 "])
def test_split_reads_the_numbers_as_megatron_does(split):
    """Megatron's parse_and_normalize_split reads the numbers out of the string: "98 2 0" was refused here."""
    assert DataConfig(split=split).split_weights == (0.98, 0.02, 0.0)


@pytest.mark.parametrize("split", ["98,-2", "a,b", "1,2,3,4", "0,0,0", ""])
def test_a_split_that_is_not_up_to_three_weights_is_refused(split):
    from megatron_lite.config import ConfigError

    with pytest.raises(ConfigError, match="must be up to three non-negative weights"):
        DataConfig(split=split, mock_data=True)


def test_split_ranges_are_the_rounded_cumulative_weights():
    """For every size: part i is [round(cum[i] * N), round(cum[i + 1] * N)), so the parts tile [0, N)."""
    for split in ("969,30,1", "98,2,0", "1,1,2", "90,5,5", "8,1,1"):
        w = DataConfig(split=split).split_weights
        cum = [0.0, w[0], w[0] + w[1], w[0] + w[1] + w[2]]
        for n in range(1, 2000):
            got = split_document_ranges(n, w)
            want = [(round(cum[i] * n), round(cum[i + 1] * n)) for i in range(3)]
            assert [r for r in got if r[1] > r[0]] == [r for r in want if r[1] > r[0]], (split, n)


def _write(prefix: str, docs: list[list[int]]) -> IndexedDataset:
    w = IndexedDatasetWriter(prefix, 1000)
    for d in docs:
        w.add_document(d)
    w.finalize()
    return IndexedDataset(prefix)


def _is_prefix_permutation(shuffle: np.ndarray, k: int) -> bool:
    return sorted(int(x) for x in shuffle[:k]) == list(range(k))


def test_a_short_final_epoch_is_read_after_every_document(tmp_path):
    """200 documents of 65 tokens (every token of document i is i), 64-token samples: one epoch is
    (200 * 65 - 1) // 64 = 203 samples. A run of 213 samples (1.05 epochs) must read every document before it
    reads one twice: Megatron shuffles the full epochs' samples apart from the final epoch's, first, when the
    final epoch contributes fewer than int(0.8 * 203) = 162 samples."""
    ndoc, length, seq = 200, 65, 64
    ix = _write(str(tmp_path / "c"), [[i] * length for i in range(ndoc)])
    per_epoch = (ndoc * length - 1) // seq
    assert per_epoch == 203
    n = 213
    ds = GPTDataset(ix, (0, ndoc), n, seq, 1234, str(tmp_path / "cache"), 999)
    read = set()
    for i in range(n):
        read |= set(ds.tokens(i)[:-1].tolist())
    assert read == set(range(ndoc))
    assert _is_prefix_permutation(ds.shuffle_index, per_epoch)


@pytest.mark.parametrize("final, separate", [(1, True), (161, True), (162, False), (203, False)])
def test_the_final_epoch_threshold_is_megatrons(tmp_path, final, separate):
    """separate iff samples from the final epoch < int(0.80 * samples per epoch) (= 162 here), two epochs."""
    ndoc, length, seq = 200, 65, 64
    ix = _write(str(tmp_path / "c"), [[i] * length for i in range(ndoc)])
    n = 203 + final
    ds = GPTDataset(ix, (0, ndoc), n, seq, 7, str(tmp_path / "cache"), 999)
    assert len(ds) == (2 * ndoc * length - 1) // seq  # two epochs
    assert _is_prefix_permutation(ds.shuffle_index, 203) == separate
    assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))


def test_a_reprocessed_corpus_of_the_same_size_rebuilds_the_indices(tmp_path):
    """The same documents written again in another order: same .bin size, other document lengths in each place.
    The dataset must read what a fresh build on the new files reads, not the old files' cached indices."""
    rng = np.random.RandomState(0)
    docs = [[*rng.randint(0, 255, n), 256] for n in rng.randint(1, 60, 40)]
    prefix = str(tmp_path / "corpus_text_document")
    cache = str(tmp_path / "cache")
    GPTDataset(_write(prefix, docs), (0, 40), 50, 16, 1, cache, 256)
    ix = _write(prefix, [docs[i] for i in rng.permutation(40)])
    ds = GPTDataset(ix, (0, 40), 50, 16, 1, cache, 256)
    fresh = GPTDataset(ix, (0, 40), 50, 16, 1, str(tmp_path / "fresh"), 256)
    assert len(ds) == len(fresh)
    for i in range(len(ds)):
        assert np.array_equal(ds.tokens(i), fresh.tokens(i)), i
    # and the stream itself: sample j is tokens [j * 16, j * 16 + 17) of the documents in doc_index order
    stream = np.concatenate([ix.get(int(k)) for k in ds.doc_index])
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        assert np.array_equal(ds.tokens(i), stream[j * 16 : j * 16 + 17]), i


def test_the_vocabulary_check_rescans_a_rewritten_corpus(tmp_path):
    """The largest-token cache is keyed by more than the .bin size: a corpus rewritten with the same size but a
    token beyond the vocabulary is refused, not passed on the old file's cached maximum."""
    from megatron_lite.config import ConfigError
    from megatron_lite.data.builder import DataSource, build_datasets
    from megatron_lite.data.tokenizers import NullTokenizer

    prefix = str(tmp_path / "c")
    data = DataConfig(data_path=(prefix,), tokenizer_type="NullTokenizer", vocab_size=100)
    tok = NullTokenizer(100)
    source = DataSource(tok, tok.vocab_size, data.blend, "")
    _write(prefix, [[1] * 30 + [100] for _ in range(10)])
    build_datasets(source, data, (4, 0, 0), 8, 1)
    _write(prefix, [[150] * 30 + [100] for _ in range(10)])  # same size, token 150 > vocabulary 101
    with pytest.raises(ConfigError, match="holds token id 150"):
        build_datasets(source, data, (4, 0, 0), 8, 1)


def test_a_split_shorter_than_one_sample_repeats_its_documents_as_megatrons_does(tmp_path, capsys, monkeypatch):
    """From a review: a split that cannot fill one sample stopped the run, where Megatron-core repeats its
    documents (a 1000-document corpus's 0.1% test split is one document); start-up now says so, naming the split
    and the flag that gave it. A split of empty documents is one line; so are a missing --valid-data-path (it
    was named --data-path) and a negative --num-workers (a DataLoader traceback after the model was built)."""
    from test_pretrain_cli import _one_line_error, _run

    short = str(tmp_path / "short_text_document")
    _write(short, [list(range(1, 13))])
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--seq-length", "16", "--train-iters", "2"]
    rc, out, err = _run([*flags, "--data-path", short, "--split", "100,0,0"], capsys, monkeypatch)
    assert rc == 0, err
    note = f"note: --data-path {short}: the train split's 1 documents hold 12 tokens, fewer than one sample of "
    assert note + "--seq-length 16 + 1: each of its samples repeats them" in out, out
    corpus = str(tmp_path / "corpus_text_document")
    _write(corpus, [[1 + (i + j) % 90 for j in range(40)] + [99] for i in range(8)])
    per_split = [*flags, "--train-data-path", corpus, "--eval-iters", "1", "--eval-interval", "2"]
    rc, out, err = _run([*per_split, "--valid-data-path", short], capsys, monkeypatch)
    assert rc == 0 and f"--valid-data-path {short}: the validation split's 1 documents hold 12" in out, err
    assert "validation loss at iteration 2" in out, out
    rc, _, err = _run([*per_split, "--valid-data-path", str(tmp_path / "nope")], capsys, monkeypatch)
    _one_line_error(rc, err, f"--valid-data-path {tmp_path / 'nope'}: missing")
    # --split with per-split paths (Megatron asserts they are incompatible) trained on the whole of the train path
    # and evaluated nothing, saying only that the validation split was empty
    rc, _, err = _run([*per_split, "--split", "90,10,0"], capsys, monkeypatch)
    _one_line_error(rc, err, "--split 90,10,0 divides --data-path; with --train-data-path each split has its own")
    empty = str(tmp_path / "empty_text_document")
    _write(empty, [[], []])
    rc, _, err = _run([*flags, "--data-path", empty, "--split", "100,0,0"], capsys, monkeypatch)
    _one_line_error(rc, err, f"--data-path {empty}: the train split's 2 documents hold no tokens")
    rc, _, err = _run([*flags, "--data-path", corpus, "--num-workers", "-1"], capsys, monkeypatch)
    _one_line_error(rc, err, "--num-workers -1 must be >= 0")


def test_a_complete_index_cache_is_read_without_writing(tmp_path, capsys, monkeypatch):
    """From a review: the cache's lock file was opened for writing before the cache was found complete, so a
    finished cache on a read-only mount was refused; a cache hit now writes nothing (no lock file made)."""
    from test_pretrain_cli import _run

    corpus = str(tmp_path / "corpus_text_document")
    _write(corpus, [[1 + (i + j) % 90 for j in range(40)] + [99] for i in range(8)])
    flags = ["--data-path", corpus, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--train-iters", "2"]
    blend = ["--data-path", "1", corpus, "1", corpus]  # (a blend's indices too)
    for argv in ([*flags], [*flags[2:], *blend]):
        rc, _, err = _run(argv, capsys, monkeypatch)
        assert rc == 0, err
    cache = tmp_path / "cache"
    built = sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))
    assert any(n.startswith("blend-") for n in built) and any(n.startswith("max_token") for n in built), built
    for lock in cache.glob("*.lock"):
        lock.unlink()
    for argv in ([*flags], [*flags[2:], *blend]):
        rc, _, err = _run(argv, capsys, monkeypatch)
        assert rc == 0, err
    assert sorted(p.name for p in cache.iterdir()) == built


def test_a_split_without_validation_documents_says_there_is_no_evaluation(tmp_path, capsys, monkeypatch):
    """--split 100,0,0 with --eval-iters > 0: evaluation is skipped and start-up says why (it said nothing)."""
    from test_pretrain_cli import _run

    prefix = str(tmp_path / "corpus_text_document")
    _write(prefix, [[1 + (i + j) % 90 for j in range(40)] + [100] for i in range(8)])
    flags = ["--data-path", prefix, "--split", "100,0,0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    rc, out, err = _run([*flags, "--eval-iters", "1", "--eval-interval", "2"], capsys, monkeypatch)
    assert rc == 0, err
    assert "no validation evaluation: the validation split holds no documents (--split 100,0,0)" in out
    assert "no test evaluation: the test split holds no documents (--split 100,0,0)" in out
    assert "validation loss at iteration" not in out


def test_the_vocabulary_check_survives_its_cache_and_long_paths(tmp_path):
    """Its cache is named by a hash (a prefix of 258 characters made a name past the file system's 255-byte
    limit) and written atomically; an unreadable one (a write cut short) is scanned again, not a traceback.
    The scan reads only what the index covers: a .bin longer than that may end in anything (Megatron ignores
    it too)."""
    from megatron_lite.data.builder import DataSource, build_datasets
    from megatron_lite.data.tokenizers import NullTokenizer

    folder = tmp_path / ("d" * 200)
    folder.mkdir()
    prefix = str(folder / ("c" * 50))
    data = DataConfig(data_path=(prefix,), tokenizer_type="NullTokenizer", vocab_size=100)
    tok = NullTokenizer(100)
    source = DataSource(tok, tok.vocab_size, data.blend, "")
    _write(prefix, [[1] * 30 + [100] for _ in range(10)])
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\xff\xff\xff")  # not indexed (odd length: not even a whole uint16)
    assert IndexedDataset(prefix).max_token() == 100
    build_datasets(source, data, (4, 0, 0), 8, 1)
    caches = list((folder / "cache").glob("max_token_*.json"))
    assert len(caches) == 1, list((folder / "cache").iterdir())
    caches[0].write_text("{")  # cut short
    build_datasets(source, data, (4, 0, 0), 8, 1)
    assert caches[0].read_text().startswith('{"size"')


def test_blend_indices_are_cached_and_a_train_split_without_documents_is_one_line(tmp_path, capsys, monkeypatch):
    """The blend's indices are built once and read back from --data-cache-path (a Python loop per sample:
    minutes for a real run's, at every start); a --split giving training nothing is one line (it was a
    TypeError once the model was built)."""
    from test_data_blend import _Endless
    from test_pretrain_cli import _one_line_error, _run

    from megatron_lite.data.gpt_dataset import BlendedDataset

    first = BlendedDataset([_Endless(), _Endless()], [0.3, 0.7], 1000, str(tmp_path))
    assert len(list(tmp_path.glob("blend-*.npy"))) == 2  # (the dataset and sample indices, each its dtype)
    # an older version's cache (one stacked array) is read, not rebuilt (minutes for a real run's)
    old = tmp_path / "old"
    old.mkdir()
    digest = next(tmp_path.glob("blend-*-sample.npy")).name.split("-")[1]
    np.save(old / f"blend-{digest}.npy", np.stack([first.dataset_index, first.sample_index]).astype(np.int64))
    monkeypatch.setattr("megatron_lite.data.gpt_dataset.blending_indices", lambda *a: 1 / 0)
    migrated = BlendedDataset([_Endless(), _Endless()], [0.3, 0.7], 1000, str(old))
    assert migrated.dataset_index.dtype == np.int16 and np.array_equal(migrated.sample_index, first.sample_index)
    monkeypatch.undo()
    again = BlendedDataset([_Endless(), _Endless()], [0.3, 0.7], 1000, str(tmp_path))
    plain = BlendedDataset([_Endless(), _Endless()], [0.3, 0.7], 1000)
    assert isinstance(again.dataset_index, np.memmap) and not isinstance(plain.dataset_index, np.memmap)
    for b in (first, again):
        assert np.array_equal(b.dataset_index, plain.dataset_index)
        assert np.array_equal(b.sample_index, plain.sample_index)
    prefix = str(tmp_path / "c")
    _write(prefix, [[1] * 30 + [100] for _ in range(10)])
    flags = ["--data-path", prefix, "--split", "0,100,0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    rc, _, err = _run(flags, capsys, monkeypatch)
    _one_line_error(rc, err, "the train split holds no documents (--split 0,100,0", "--skip-train")


def test_a_blend_reads_on_past_its_samples_after_a_rollback_skipped_a_batch(tmp_path, capsys, monkeypatch):
    """A rollback skips the offending global batch, so the run reads one batch past --train-iters x the
    global batch, which is all a blend holds: those samples are its first ones again (an IndexError)."""
    from test_pretrain_cli import _run

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for k, prefix in enumerate((a, b)):
        _write(prefix, [[k + 1] * 30 + [100] for _ in range(10)])
    monkeypatch.setenv("MEGATRON_LITE_INJECT_FAULT", "nan,rank=0,iteration=3")
    flags = ["--data-path", "0.5", a, "0.5", b, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    rc, out, err = _run([*flags, "--save", str(tmp_path / "ck"), "--save-interval", "1", "--nan-policy",
                         "rollback"], capsys, monkeypatch)  # fmt: skip
    assert rc == 0, err
    assert "skipping the batch at sample 8" in out and f"consumed samples: {16:12d} |" in out


def _megatron_samples(docs: list[list[int]], doc_range, num_samples: int, seq: int, seed: int) -> list[list[int]]:
    """Each sample's tokens as Megatron-core orders them, transcribed from megatron/core/datasets/gpt_dataset.py
    apart from our code: _get_num_epochs, the separate final epoch, _build_document_index (the epochs' documents
    tiled and shuffled together by one RandomState(seed), the final epoch apart when separate), the sample index
    (sample j is tokens [j * seq, j * seq + seq + 1) of the documents in that order) and _build_shuffle_index."""
    documents = np.arange(*doc_range)
    per_epoch_tokens = sum(len(docs[d]) for d in documents)
    epochs = 1
    while epochs * per_epoch_tokens < num_samples * seq + 1:
        epochs += 1
    separate = False
    if epochs > 1:
        sans_final = ((epochs - 1) * per_epoch_tokens - 1) // seq
        separate = num_samples - sans_final < int(0.80 * ((per_epoch_tokens - 1) // seq))

    rs = np.random.RandomState(seed)

    def document_index(n: int) -> np.ndarray:
        index = np.mgrid[0:n, 0 : len(documents)][1]
        index[:] = documents
        index = index.reshape(-1).astype(np.int32)
        rs.shuffle(index)
        return index

    order = np.concatenate([document_index(epochs - 1), document_index(1)]) if separate else document_index(epochs)
    stream = np.concatenate([np.asarray(docs[d]) for d in order])
    total = (epochs * per_epoch_tokens - 1) // seq
    first = np.arange(sans_final if separate else total)
    rs.shuffle(first)
    last = np.arange(len(first), total)
    if separate:
        rs.shuffle(last)
    shuffle = np.concatenate([first, last])
    return [stream[j * seq : j * seq + seq + 1].tolist() for j in shuffle], epochs, separate


def _docs(n: int = 7, seed: int = 0) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [rng.randint(0, 250, rng.randint(9, 17)).tolist() for _ in range(n)]


@pytest.mark.parametrize("num_samples, epochs, separate", [(5, 1, False), (14, 2, True), (20, 2, False),
                                                           (27, 3, True), (31, 3, False)])  # fmt: skip
def test_the_sample_order_over_several_epochs_is_megatrons(tmp_path, num_samples, epochs, separate):
    """From a review: each epoch's documents were shuffled on their own, where Megatron shuffles every epoch's
    together (the final one apart where it is separate): from the same seed, a split read over two or more epochs
    gave other samples than Megatron's (none equal in the review's case)."""
    docs = _docs()
    expected, e, s = _megatron_samples(docs, (0, len(docs)), num_samples, 8, 1234)
    assert (e, s) == (epochs, separate)  # (the case the parameters mean)
    ds = GPTDataset(_write(str(tmp_path / "c"), docs), (0, len(docs)), num_samples, 8, 1234, str(tmp_path), 999)
    assert [ds.tokens(i).tolist() for i in range(len(ds))] == expected


def _byte_build(data: DataConfig, sizes: tuple[int, int, int], seq: int = 8) -> tuple:
    from megatron_lite.data.builder import DataSource, build_datasets
    from megatron_lite.data.tokenizers import ByteLevelTokenizer

    tok = ByteLevelTokenizer()
    return build_datasets(DataSource(tok, tok.vocab_size, data.blend, ""), data, sizes, seq, 1234)


def test_every_split_draws_from_the_run_seed_as_megatrons(tmp_path):
    """From a review: the validation and test splits were shuffled with seed + 1 and seed + 2; Megatron gives
    every split the run's --seed (random_seed in its dataset config)."""
    docs = _docs(12)
    prefix = str(tmp_path / "c")
    _write(prefix, docs)
    data = DataConfig(data_path=(prefix,), split="50,25,25", data_cache_path=str(tmp_path / "cache"))
    _, valid, test = _byte_build(data, (3, 9, 9))
    for ds, docs_range in ((valid, (6, 9)), (test, (9, 12))):
        expected, *_ = _megatron_samples(docs, docs_range, 9, 8, 1234)
        assert [ds.tokens(i).tolist() for i in range(9)] == expected[:9]


def test_one_weighted_prefix_is_a_blend_of_one_as_megatrons(tmp_path):
    """`--data-path 1.0 PREFIX` is a blend in Megatron (get_blend_from_list gives it a weight): its dataset is
    built for ceil(N * 1.005) samples, the margin of _get_size_per_split_per_dataset, and read in order; where that
    adds an epoch the order differs from `--data-path PREFIX`'s N samples, which stays as it was."""
    docs = _docs()
    prefix = str(tmp_path / "c")
    _write(prefix, docs)
    n = 11  # one epoch holds 11 samples of 8: the margin's 12th takes a second
    weighted, e, _ = _megatron_samples(docs, (0, len(docs)), math.ceil(n * 1.005), 8, 1234)
    plain, e_plain, _ = _megatron_samples(docs, (0, len(docs)), n, 8, 1234)
    assert (e, e_plain) == (2, 1) and weighted[:n] != plain[:n]
    cache = str(tmp_path / "cache")
    for data_path, expected in (((prefix,), plain), (("1.0", prefix), weighted)):
        train, _, _ = _byte_build(DataConfig(data_path=data_path, split="1,0,0", data_cache_path=cache), (n, 0, 0))
        assert [train.tokens(i).tolist() for i in range(n)] == expected[:n], data_path


def test_indices_cached_under_the_old_document_order_are_not_reused(tmp_path):
    """From the diff review: the cache key held nothing of the order's rule, so a multi-epoch split cached before
    the documents of every epoch were shuffled together kept the old order (and ranks with caches of different
    ages would read different samples). Indices under the old key are ignored; the order is Megatron's."""
    import hashlib
    import json
    import os

    from megatron_lite.data.gpt_dataset import index_signature

    docs = _docs()
    prefix = str(tmp_path / "c")
    ix = _write(prefix, docs)
    n, cache = 27, str(tmp_path / "cache")
    old_key = [os.path.abspath(prefix), os.path.getsize(prefix + ".bin"), index_signature(ix, (0, len(docs))),
               [0, len(docs)], n, 8, 1234]  # fmt: skip
    digest = hashlib.md5(json.dumps(old_key).encode()).hexdigest()
    os.makedirs(cache)
    stale = {"doc": np.arange(3 * len(docs)) % len(docs), "sample": np.zeros((40, 2), dtype=np.int64),
             "shuffle": np.arange(39)}  # fmt: skip
    for k, arr in stale.items():
        np.save(os.path.join(cache, f"{digest}-{k}.npy"), arr)
    ds = GPTDataset(ix, (0, len(docs)), n, 8, 1234, cache, 999)
    expected, *_ = _megatron_samples(docs, (0, len(docs)), n, 8, 1234)
    assert [ds.tokens(i).tolist() for i in range(len(ds))] == expected


def test_the_index_cache_is_written_and_read_safely_by_many_nodes(tmp_path):
    """(From a review of the data pipeline at scale.) Each writer publishes through a temporary file of its own:
    where file locks hold on one node only, nodes building the same cache at once truncated each other's one
    shared temporary file. A damaged cache file is one line naming it (it was a traceback, or samples from
    nowhere). A .bin written in a wider dtype than its index says is refused (it read as ids and zeros)."""
    from megatron_lite.config import ConfigError
    from megatron_lite.data.gpt_dataset import _save_npy

    target = tmp_path / "x-doc.npy"
    other = tmp_path / "x-doc.npy.partial.npy"  # (another node's write in flight, under the old shared name)
    other.write_bytes(b"another node's bytes")
    _save_npy(str(target), np.arange(5))
    assert other.read_bytes() == b"another node's bytes" and np.load(target).tolist() == list(range(5))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial.npy") and p != other]

    prefix, cache = str(tmp_path / "c"), str(tmp_path / "cache")
    ix = _write(prefix, [[1, 2, 3, 4, 5]] * 40)
    GPTDataset(ix, (0, 40), 20, 8, 1, cache, 999)
    sample = next(p for p in (tmp_path / "cache").iterdir() if p.name.endswith("-sample.npy"))
    sample.write_bytes(sample.read_bytes()[:-40])  # cut short
    with pytest.raises(ConfigError, match=f"the cached index {re.escape(str(sample))} is damaged .*delete it"):
        GPTDataset(ix, (0, 40), 20, 8, 1, cache, 999)
    np.save(sample, np.zeros(7, dtype=np.int64))  # whole, but not a sample index
    with pytest.raises(ConfigError, match=r"is damaged \(shape \(7,\), not \(samples \+ 1, 2\)\)"):
        GPTDataset(ix, (0, 40), 20, 8, 1, cache, 999)

    wide = np.fromfile(prefix + ".bin", dtype=np.uint16).astype(np.int32)
    wide.tofile(prefix + ".bin")
    with pytest.raises(ConfigError, match=r"c.bin does not match .*c.idx: .* 2 times .*another dtype"):
        IndexedDataset(prefix)
    # (an exploratory run: an unknown dtype code was called an unsupported version 1, and old Megatron's
    # lazy/cached index was "a bad header" with no way out)
    head = bytearray(open(prefix + ".idx", "rb").read())
    head[17] = 9
    open(prefix + ".idx", "wb").write(bytes(head))
    with pytest.raises(ConfigError, match=r"c.idx: dtype code 9 is none of Megatron's \(1, 2, 3, 4, 5, 6, 7, 8\)"):
        IndexedDataset(prefix)
    open(prefix + ".idx", "wb").write(b"TNTIDX\x00\x00" + bytes(head[8:]))
    with pytest.raises(ConfigError, match=r"old Megatron's lazy/cached format \(TNTIDX\).*preprocess the data again"):
        IndexedDataset(prefix)


def test_a_cached_dataset_starts_without_copying_the_document_lengths(tmp_path):
    """(From a review at scale: every rank copied the split's lengths three times on every start, cached indices
    or not: gigabytes a rank for a billion documents.) A start from the cache allocates far less than the
    lengths themselves."""
    import tracemalloc

    prefix, cache, n = str(tmp_path / "c"), str(tmp_path / "cache"), 200_000
    w = IndexedDatasetWriter(prefix, 1000)
    w.add_document(list(range(1, 7)) * n, [6] * n)  # (n sequences of 6 tokens in one call)
    w.finalize()
    ix = IndexedDataset(prefix)
    assert len(ix.lengths) == n
    GPTDataset(ix, (0, n), 1000, 8, 1, cache, 999)
    tracemalloc.start()
    GPTDataset(ix, (0, n), 1000, 8, 1, cache, 999)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < ix.lengths.nbytes / 4, (peak, ix.lengths.nbytes)


def test_a_data_path_given_as_the_output_prefix_names_the_files_written(tmp_path):
    """preprocess_data.py --output-prefix data/x writes data/x_text_document.bin/.idx: a --data-path given as the
    prefix itself is told the name to give, not to run the tool it has just run (from a README walkthrough)."""
    from megatron_lite.config import ConfigError

    for ext in ("bin", "idx"):
        (tmp_path / f"x_text_document.{ext}").write_bytes(b"")
    with pytest.raises(ConfigError) as e:
        IndexedDataset(str(tmp_path / "x"))
    assert f"give --data-path {tmp_path / 'x_text_document'}" in str(e.value), e.value
    assert "run tools/preprocess_data.py" not in str(e.value)


def test_a_missing_dataset_still_points_at_the_tool(tmp_path):
    from megatron_lite.config import ConfigError

    with pytest.raises(ConfigError, match=r"missing .*nope\.idx \(run tools/preprocess_data\.py\)"):
        IndexedDataset(str(tmp_path / "nope"))
    # a file's name given for the prefix (it said "missing X.bin.idx"): the prefix to give
    for ext in ("bin", "idx"):
        (tmp_path / f"x_text_document.{ext}").write_bytes(b"")
    with pytest.raises(ConfigError) as e:
        IndexedDataset(str(tmp_path / "x_text_document.bin"))
    assert str(e.value).endswith(
        "--data-path takes the prefix of the .bin/.idx pair, without the extension: give --data-path "
        f"{tmp_path / 'x_text_document'}"
    ), e.value


def test_a_lock_held_long_is_said_not_waited_on_silently(tmp_path, monkeypatch, capsys):
    """From a failure review: a cache lock another live process held (another job's on a shared --data-cache-path,
    a stuck build) kept every rank waiting without a word, forever. A wait past a minute (shortened here) says
    which lock and why; the lock is taken once it is free."""
    import fcntl
    import multiprocessing
    import os
    import time

    from megatron_lite.data import gpt_dataset

    lock = str(tmp_path / "cache" / "x.lock")
    os.makedirs(os.path.dirname(lock))
    ready = multiprocessing.get_context("fork").Event()

    def hold():
        with open(lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            ready.set()
            time.sleep(1.5)

    holder = multiprocessing.get_context("fork").Process(target=hold)
    holder.start()
    assert ready.wait(10)
    monkeypatch.setattr(gpt_dataset, "LOCK_NOTE_AFTER_S", (0.3, 60.0))
    with gpt_dataset.file_lock(lock):
        err = capsys.readouterr().err
    holder.join()
    assert f"waiting 0 s for the lock on {lock}: another process is building this cache" in err, err
    assert err.count("waiting") == 1, err  # once after 0.3 s (the next a minute later); then the holder let go


@pytest.mark.parametrize("pad", [None, 3])
def test_the_pad_id_carries_no_loss_and_reads_as_zero_as_in_megatron(tmp_path, pad):
    """Megatron-core's GPTDataset.__getitem__ (megatron/core/datasets/gpt_dataset.py), after the masks and positions
    from the tokens as read: loss_mask[labels == pad] = 0, then tokens[tokens == pad] = 0 and labels[labels == pad]
    = 0, with pad the tokenizer's (MegatronDataset._pad_token_id; none where it is the EOD). Ours trained on them.
    One 6-token document [4, 3, 999, 3, 5, 6], EOD 999, --seq-length 5: the one sample is tokens [4, 3, 999, 3, 5],
    labels [3, 999, 3, 5, 6]; --eod-mask-loss drops position 2 (the input is the EOD), the pad 3 as a label drops
    positions 0 and 2; --reset-position-ids restarts after the EOD: [0, 1, 2, 0, 1]."""
    from megatron_lite.data.builder import DataSource, build_datasets

    _write(str(tmp_path / "d"), [[4, 3, 999, 3, 5, 6]])

    class Tok:  # (the pad id as HuggingFaceTokenizer reads it from the tokenizer's config)
        eod, vocab_size = 999, 1000

    Tok.pad = pad
    data = DataConfig(data_path=(str(tmp_path / "d"),), split="1,0,0", eod_mask_loss=True, reset_position_ids=True)
    train, _, _ = build_datasets(DataSource(Tok(), 1000, data.blend, ""), data, (1, 0, 0), 5, 1234)
    s = train[0]
    assert s["position_ids"].tolist() == [0, 1, 2, 0, 1]
    if pad is None:
        assert (s["tokens"].tolist(), s["labels"].tolist()) == ([4, 3, 999, 3, 5], [3, 999, 3, 5, 6])
        assert s["loss_mask"].tolist() == [1, 1, 0, 1, 1]
    else:
        assert (s["tokens"].tolist(), s["labels"].tolist()) == ([4, 0, 999, 0, 5], [0, 999, 0, 5, 6])
        assert s["loss_mask"].tolist() == [0, 1, 0, 1, 1]
