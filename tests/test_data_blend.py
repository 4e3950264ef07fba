"""Blends of indexed datasets (--data-path W1 P1 W2 P2 ... or P1 P2 ...), checked against Megatron-core's rules:
helpers.cpp build_blending_indices for the order, get_blend_from_list and the builder's by-size weights for
prefixes without weights, and every component sized for what the blend draws from it."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from megatron_lite.config import ConfigError
from megatron_lite.data import native_blend
from megatron_lite.data.builder import DataSource, build_datasets
from megatron_lite.data.config import DataConfig
from megatron_lite.data.gpt_dataset import BlendedDataset, GPTDataset
from megatron_lite.data.indexed import IndexedDatasetWriter
from megatron_lite.data.tokenizers import ByteLevelTokenizer


class _Endless:
    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, i: int) -> int:
        return i


def _corpus(prefix: str, ndocs: int, lo: int, hi: int, length: int = 20, seed: int = 0) -> str:
    """ndocs documents of `length` tokens (the last one EOD = 256), the others drawn from [lo, hi)."""
    rng = np.random.RandomState(seed)
    w = IndexedDatasetWriter(prefix, 257)
    for _ in range(ndocs):
        w.add_document([*rng.randint(lo, hi, length - 1), 256])
    w.finalize()
    return prefix


def _build(data: DataConfig, sizes: tuple[int, int, int], seq: int = 8) -> tuple:
    tok = ByteLevelTokenizer()
    return build_datasets(DataSource(tok, tok.vocab_size, data.blend, ""), data, sizes, seq, 1234)


def _origin(sample: dict, ranges: dict[str, tuple[int, int]]) -> str:
    """Which dataset a sample's tokens come from (each dataset draws its tokens from its own id range)."""
    toks = sample["tokens"][sample["tokens"] != 256]
    names = [n for n, (lo, hi) in ranges.items() if bool(((toks >= lo) & (toks < hi)).all())]
    assert len(names) == 1, names
    return names[0]


def test_blending_order_follows_megatron():
    """Hand-worked helpers.cpp rule for weights 0.3/0.7: sample i goes to argmax w * max(i, 1) - count (first on
    ties). i=0,1 both use max(i, 1) = 1: errors (.3, .7) -> 1, then (.3, -.3) -> 0; i=2: (-.4, .4) -> 1; i=3:
    (-.1, .1) -> 1; i=4: (.2, -.2) -> 0; ..."""
    b = BlendedDataset([_Endless(), _Endless()], [0.3, 0.7], 10)
    assert b.dataset_index.tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert b.sample_index.tolist() == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]


def _scan(native: bool, monkeypatch) -> None:
    """Run the blend's scan in C (native_blend, compiled here: a machine with a C compiler must use it) or,
    with the library made unavailable, in Python."""
    if not native:
        monkeypatch.setattr(native_blend, "_loaded", (None, "turned off by the test"))
    elif native_blend._compiler() is None:
        pytest.skip("no C compiler on this machine: the Python scan runs instead")
    else:
        assert native_blend.load()[0] is not None, native_blend.load()[1]


def _normalize(weights) -> list[float]:
    """Megatron's normalize() (megatron/core/datasets/utils.py)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def _megatron_order(w: list[float], size: int) -> list[int]:
    counts, out = [0] * len(w), []
    for i in range(size):
        errors = [w[k] * max(i, 1.0) - counts[k] for k in range(len(w))]
        best = max(range(len(w)), key=lambda k: (errors[k], -k))  # (the first maximum)
        out.append(best)
        counts[best] += 1
    return out


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
def test_blend_weights_are_normalised_twice_as_megatron_does(native, tmp_path, monkeypatch):
    """From a data review against Megatron: its builder normalises a --data-path blend's weights and its
    BlendedDataset normalises them again ("redundant normalization for bitwise identical comparison"); the second
    pass moves their last bits and so which dataset wins a tie. Normalised once, 278 of the first 2000 samples of
    a 0.6/0.3/0.1 blend came from another dataset. (Weights by size, none given, are normalised once there.)"""
    _scan(native, monkeypatch)
    weights, n = [0.6, 0.3, 0.1], 2000
    twice, once = _megatron_order(_normalize(_normalize(weights)), n), _megatron_order(_normalize(weights), n)
    assert twice != once  # (the case tells the two rules apart)
    paths = [_corpus(str(tmp_path / k), 400, 80 * i, 80 * i + 80, seed=i) for i, k in enumerate("abc")]
    data = DataConfig(data_path=tuple(x for w, p in zip(weights, paths) for x in (str(w), p)), split="1,0,0",
                      tokenizer_type="ByteLevelTokenizer")  # fmt: skip
    train, _, _ = _build(data, (n, 0, 0))
    assert train.dataset_index.tolist() == twice


def test_blend_parts_are_built_for_megatrons_sample_counts(tmp_path, monkeypatch):
    """What each part of a blend is built for (its epochs, so its sample order, follow), as Megatron's builder:
    weighted, ceil(ceil(N x share) x (1 + --mid-level-dataset-surplus)) (ours was ceil(N x share x 1.005): 34
    and 67 for 1:2 of 100, Megatron's 35 and 68); without weights one epoch each where N fits in one (ours took
    N's share plus the margin, a second epoch's order); one prefix of a split's own paths, weighted or not, N."""
    import math

    from megatron_lite.data import builder

    from models import record_calls

    calls = record_calls(monkeypatch, builder, "GPTDataset")  # (indexed, doc_range, num_samples, ...)
    a = _corpus(str(tmp_path / "a"), 300, 0, 80, seed=1)
    b = _corpus(str(tmp_path / "b"), 100, 80, 160, seed=2)
    tok = "ByteLevelTokenizer"

    def sizes(n, **kw):
        calls.clear()
        data = DataConfig(tokenizer_type=tok, **kw)
        t = ByteLevelTokenizer()
        per_split = data.blend_per_split
        prefixes = [wp for b in per_split for wp in b] if per_split else data.blend
        build_datasets(DataSource(t, t.vocab_size, prefixes, "", per_split), data, (n, 0, 0), 8, 1234)
        return [args[2] for args in calls]

    share = _normalize([1, 2])
    for surplus in (0.005, 0.0):
        megatron = [math.ceil(math.ceil(100 * w) * (1 + surplus)) for w in share]
        got = sizes(100, data_path=("1", a, "2", b), split="1,0,0", mid_level_dataset_surplus=surplus)
        assert got == megatron, (surplus, got, megatron)
    assert megatron == [34, 67] and sizes(100, data_path=("1", a, "2", b), split="1,0,0") == [35, 68]
    # one epoch each: (300 x 20 - 1) // 8 = 749 and (100 x 20 - 1) // 8 = 249 samples
    assert sizes(900, data_path=(a, b), split="1,0,0") == [749, 249]
    assert sizes(1200, data_path=(a, b), split="1,0,0") == [math.ceil(math.ceil(1200 * w) * 1.005)
                                                           for w in _normalize([749, 249])]  # fmt: skip
    assert sizes(100, train_data_path=("1.0", a)) == [100]
    assert sizes(100, data_path=("1.0", a), split="1,0,0") == [101]  # (--data-path blends a weighted one)


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
@pytest.mark.parametrize("weights", [[1, 2, 3], [0.2, 0.3, 0.5], [5, 1]])
def test_blending_order_matches_the_reference_loop(weights, native, monkeypatch):
    """Megatron's build_blending_indices written out (a strict > scan, so the first maximum wins); built in
    chunks (7 samples here) into typed arrays, 10 bytes per sample as Megatron's (Python lists took 64)."""
    from megatron_lite.data import gpt_dataset

    _scan(native, monkeypatch)
    monkeypatch.setattr(gpt_dataset, "BLEND_CHUNK", 7)
    w = _normalize(weights)  # (Megatron's BlendedDataset normalises what it is given)
    counts = [0] * len(w)
    expected = []
    for i in range(50):
        errors = [w[k] * max(i, 1.0) - counts[k] for k in range(len(w))]
        best = 0
        for k in range(1, len(w)):
            if errors[k] > errors[best]:
                best = k
        expected.append(best)
        counts[best] += 1
    blend = BlendedDataset([_Endless() for _ in w], weights, 50)
    assert blend.dataset_index.tolist() == expected
    assert blend.dataset_index.dtype == np.int16 and blend.sample_index.dtype == np.int64
    assert blend.sample_index.tolist() == [expected[:i].count(k) for i, k in enumerate(expected)]


@pytest.mark.parametrize("case", ["random", "ties", "many"])
def test_the_c_scan_gives_the_python_scans_order_bit_for_bit(case, monkeypatch):
    """The C scan (seconds for a 500M-sample blend, where Python takes about an hour) against the Python one:
    random weights over many datasets, exact ties (equal weights: the first wins), and more datasets than
    int16 holds (the int64 dataset index)."""
    from megatron_lite.data import gpt_dataset

    _scan(True, monkeypatch)
    rng = np.random.default_rng(7)
    weights, size = {
        "random": (rng.random(37).tolist(), 50_000),
        "ties": ([1.0, 1.0, 1.0, 2.0, 2.0, 0.1], 20_000),
        "many": ((rng.random(2**15 + 3) + 0.5).tolist(), 80),
    }[case]
    ran, real = [], native_blend.native_blending_indices
    monkeypatch.setattr(native_blend, "native_blending_indices", lambda *a: ran.append(real(*a)) or ran[-1])
    c = gpt_dataset.blending_indices(weights, size)
    assert len(ran) == 1 and ran[0] is not None  # (the C scan built it)
    monkeypatch.setattr(native_blend, "_loaded", (None, "turned off by the test"))
    py = gpt_dataset.blending_indices(weights, size)
    assert c[0].dtype == py[0].dtype == (np.int64 if case == "many" else np.int16)
    assert np.array_equal(c[0], py[0]) and np.array_equal(c[1], py[1])


def test_a_damaged_cached_library_is_built_again(monkeypatch, tmp_path):
    """A library in the cache that does not load (cut short, or another machine's on a shared file system) is
    compiled again over it; the job had fallen back to the Python scan for good."""
    import subprocess
    import sys

    monkeypatch.setenv("MEGATRON_LITE_CACHE", str(tmp_path))
    monkeypatch.setattr(native_blend, "_loaded", None)
    _scan(True, monkeypatch)
    lib = native_blend.load()[0]._name
    # (a new file over the name, as another writer would: this process keeps the library it mapped, and the
    # next process meets the damaged one)
    with open(lib + ".bad", "wb") as f:
        f.write(b"not a library")
    os.replace(lib + ".bad", lib)
    code = "from megatron_lite.data import native_blend as n; import numpy as np; "
    code += "print(n.load()[1] or n.native_blending_indices([0.3, 0.7], 10, np.int16)[0].tolist())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "[1, 0, 1, 1, 0, 1, 1, 0, 1, 1]", out.stdout + out.stderr[-2000:]
    assert open(lib, "rb").read(4) == b"\x7fELF"  # (built again over it)


def test_without_a_c_compiler_the_blend_is_built_in_python_and_says_so(monkeypatch, tmp_path):
    from megatron_lite.data import gpt_dataset

    monkeypatch.setattr(native_blend, "_loaded", None)
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))  # (nothing on it)
    monkeypatch.setattr(gpt_dataset, "BLEND_SLOW", 20)
    lines: list[str] = []
    blend = BlendedDataset([_Endless(), _Endless()], [0.3, 0.7], 10, log=lines.append)
    assert blend.dataset_index.tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert native_blend.load() == (None, "no C compiler ($CC, cc, gcc or clang) on PATH")
    assert len(lines) == 1 and "in Python" in lines[0] and "no C compiler" in lines[0], lines


def test_a_component_with_an_empty_split_drops_out_and_the_others_fill_it(tmp_path):
    """B has 100 documents: under --split 969,30,1 its test part is [round(.999 * 100), round(1.0 * 100)) =
    empty. The test split blends A and C alone, 1:2, and every one of its samples must be readable."""
    a = _corpus(str(tmp_path / "a"), 1000, 0, 80, seed=1)
    b = _corpus(str(tmp_path / "b"), 100, 80, 160, seed=2)
    c = _corpus(str(tmp_path / "c"), 1000, 160, 240, seed=3)
    data = DataConfig(data_path=("1", a, "1", b, "2", c), tokenizer_type="ByteLevelTokenizer")
    n = 60
    _, _, test = _build(data, (n, n, n))
    assert len(test) >= n
    origins = [_origin(test[i], {"a": (0, 80), "b": (80, 160), "c": (160, 240)}) for i in range(n)]
    assert "b" not in origins
    # the renormalised shares: C gets 2/3 of the samples, within the one sample the greedy rule allows
    assert abs(origins.count("c") - 2 * n / 3) <= 1


def test_a_two_way_blend_with_one_empty_split_is_the_other_dataset(tmp_path):
    a = _corpus(str(tmp_path / "a"), 1000, 0, 80, seed=1)
    b = _corpus(str(tmp_path / "b"), 100, 80, 160, seed=2)
    data = DataConfig(data_path=("0.5", a, "0.5", b), tokenizer_type="ByteLevelTokenizer")
    _, _, test = _build(data, (40, 40, 40))
    assert isinstance(test, GPTDataset) and len(test) >= 40
    assert {_origin(test[i], {"a": (0, 80), "b": (80, 160)}) for i in range(40)} == {"a"}


def test_prefixes_without_weights_blend_by_size(tmp_path):
    """Megatron's `--data-path A B` (get_blend_from_list: weights None): each dataset weighs its samples in one
    epoch of the split; A holds 3x B's tokens, so 3/4 of the samples come from A."""
    a = _corpus(str(tmp_path / "a"), 300, 0, 80, seed=1)
    b = _corpus(str(tmp_path / "b"), 100, 80, 160, seed=2)
    data = DataConfig(data_path=(a, b), tokenizer_type="ByteLevelTokenizer", split="1,0,0")
    assert data.blend == [(None, a), (None, b)]
    n = 200
    train, valid, test = _build(data, (n, 0, 0))
    assert valid is None and test is None
    origins = [_origin(train[i], {"a": (0, 80), "b": (80, 160)}) for i in range(n)]
    # one-epoch samples: (300 * 20 - 1) // 8 = 749 and (100 * 20 - 1) // 8 = 249
    assert abs(origins.count("a") - n * 749 / (749 + 249)) <= 1
    assert train.dataset_index.tolist() == _megatron_order(_normalize([749, 249]), n)  # (the sizes, once normalised)
    # the same for the per-split flags
    data = DataConfig(train_data_path=(a, b), tokenizer_type="ByteLevelTokenizer")
    assert data.blend_per_split[0] == [(None, a), (None, b)]


@pytest.mark.parametrize(
    "paths, words",
    [
        (("0.3", "/d/a", "/d/b"), ["--data-path", "'0.3' looks like a weight"]),
        (("0.3", "/d/a", "/d/b", "0.7"), ["--data-path", "'0.3' looks like a weight"]),
        (("1", "/d/a", "-2", "/d/b"), ["--data-path weight '-2'"]),
        (("0", "/d/a", "0", "/d/b"), ["--data-path weights 0 0 sum to 0"]),
    ],
)
def test_malformed_blends_are_one_line_errors(paths, words):
    with pytest.raises(ConfigError) as e:
        DataConfig(data_path=paths)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_datasets_pickle_as_paths_not_contents(tmp_path):
    """From a review: a DataLoader worker started by spawn or forkserver (macOS's default, Linux's from Python
    3.14) got the dataset pickled, the whole .bin and every index with it (38 MiB for a 38 MiB .bin); now the
    paths, mapped again in the worker, as Megatron's IndexedDataset pickles. Samples are unchanged."""
    import pickle

    a = _corpus(str(tmp_path / "a"), 2000, 0, 80, length=200, seed=1)
    b = _corpus(str(tmp_path / "b"), 500, 80, 160, seed=2)
    data = DataConfig(data_path=("1", a, "1", b), tokenizer_type="ByteLevelTokenizer")
    train, _, _ = _build(data, (3000, 0, 0))
    assert isinstance(train, BlendedDataset) and os.path.getsize(a + ".bin") > 400_000
    blob = pickle.dumps(train)
    assert len(blob) < 20_000, len(blob)
    again = pickle.loads(blob)
    for i in (0, 1, 1234, 2999):
        assert torch.equal(again[i]["tokens"], train[i]["tokens"])


def test_a_weighted_part_without_documents_in_a_split_is_named(tmp_path):
    """An exploratory run's finding: a weighted --data-path part with no documents in the train split (one document
    cut by --split 50,50,0; an empty shard) was left out, the others' weights filling its share, unsaid: one empty
    shard of a many-shard blend changed the mixture. The job now says so, once per part and split."""
    a = _corpus(str(tmp_path / "a"), 40, 0, 80, seed=1)
    one = _corpus(str(tmp_path / "one"), 1, 80, 160, seed=2)
    data = DataConfig(tokenizer_type="ByteLevelTokenizer", data_path=("0.7", a, "0.3", one), split="50,50,0")
    t = ByteLevelTokenizer()
    notes = []
    train, valid, _ = build_datasets(
        DataSource(t, t.vocab_size, data.blend, ""), data, (20, 4, 0), 8, 1234, None, notes
    )
    assert notes == [
        f"--data-path {one} (weight 0.3) has no documents in the train split (--split 50,50,0): the other parts' "
        "weights fill its share"
    ]
    ranges = {"a": (0, 80), "one": (80, 160)}
    assert {_origin(train[i], ranges) for i in range(20)} == {"a"}  # (as said)
    assert "one" in {_origin(valid[i], ranges) for i in range(4)}  # (its validation document is used)
    notes.clear()
    data = DataConfig(tokenizer_type="ByteLevelTokenizer", data_path=("0.7", a, "0.3", one), split="100,0,0")
    build_datasets(DataSource(t, t.vocab_size, data.blend, ""), data, (20, 0, 0), 8, 1234, None, notes)
    assert notes == []
