"""GPT samples from indexed documents: seq_length + 1 tokens across document boundaries, in a seeded shuffle
whose index arrays are built once and cached; train/valid/test splits by document; weighted blends.

Sample j of an epoch-concatenated document stream starts at token j * seq_length and holds seq_length + 1
tokens (inputs and shifted labels). The document order (every epoch's documents shuffled together, the final
epoch apart where it is separate) and the sample order are seeded permutations, so the dataset is a pure
function of (files, split, seed, seq_length, num_samples). Splits, blending and the final-epoch rule follow
Megatron-core, which draws the same order from the same seed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import sys
import time

import numpy as np
import torch

from megatron_lite.checkpoint.atomic import atomic_write
from megatron_lite.config import ConfigError
from megatron_lite.data import native_blend
from megatron_lite.data.documents import document_ids, document_position_ids
from megatron_lite.data.indexed import IndexedDataset

LOCK_NOTE_AFTER_S = (60.0, 300.0)  # the first note on a held lock, then one every so often


def _wait_for_lock(f, path: str) -> bool:
    """flock, saying so where it waits long (from a review: a lock another live process held, another job's on a
    shared --data-cache-path or a stuck build, kept every rank waiting without a word, forever). Ranks of one job
    building a cache wait a moment for the first: they stay quiet. Returns whether another process held it first
    (data/sft_cache.py: then that one could not keep what it built)."""
    start, said, other = time.monotonic(), 0.0, False
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return other
        except BlockingIOError:
            other = True
            waited = time.monotonic() - start
            if waited >= (LOCK_NOTE_AFTER_S[0] if not said else said + LOCK_NOTE_AFTER_S[1]):
                said = waited
                print(
                    f"note (rank {os.environ.get('RANK', '0')}): waiting {waited:.0f} s for the lock on {path}: "
                    "another process is building this cache (or holds it stuck; its own job's log says which)",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(0.05 if waited < 1 else 0.5)


@contextlib.contextmanager
def held_lock(path: str):
    """An exclusive lock across processes, yielding whether another process held it first; OSError where its
    folder cannot be made, written or locked (file_lock says so for the index caches; data/sft_cache.py tokenizes
    without one)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        other = _wait_for_lock(f, path)
        try:
            yield other
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def file_lock(path: str):
    """An exclusive lock across processes (ranks building the same cache wait for the first). A cache directory
    that cannot be made, written or locked (a read-only dataset directory, Lustre without flock) is one line
    naming it and --data-cache-path."""
    with contextlib.ExitStack() as held:
        try:
            other = held.enter_context(held_lock(path))
        except OSError as e:
            raise ConfigError(
                f"cannot use the index cache in {os.path.dirname(path)} ({e.strerror}): pass --data-cache-path DIR, "
                "a writable directory on a file system with locks (it holds the sample indices, built once)"
            ) from None
        yield other


def _lock_unless(paths: list[str], lock: str):
    """file_lock, or nothing where every file of a cache is there (published by renames, so complete: read
    without writing a lock file, as a read-only mount of a finished cache needs)."""
    return contextlib.nullcontext() if all(os.path.exists(p) for p in paths) else file_lock(lock)


def _save_npy(path: str, arr: np.ndarray) -> None:
    """Published whole: written under a name of this writer's own (where file locks hold on one node only,
    nodes sharing the cache build at once: they truncated each other's one temporary file) and synced before
    the rename (a crash after it left zeros under the final name)."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:  # (a file, not a name: np.save would add .npy to it)
            np.save(f, arr, allow_pickle=False)

    atomic_write(path, write)


def split_document_ranges(num_docs: int, weights: tuple[float, float, float]) -> list[tuple[int, int]]:
    """Megatron-core's split: part i is documents [round(cum[i] * N), round(cum[i + 1] * N)) with cum the
    running sum of the normalised weights (convert_split_vector_to_split_matrix), Python's round as there."""
    cum = [0.0]
    for w in weights:
        cum.append(cum[-1] + w)
    return [
        (int(round(cum[i] * float(num_docs))), int(round(cum[i + 1] * float(num_docs)))) if weights[i] > 0 else (0, 0)
        for i in range(3)
    ]


def index_signature(indexed: IndexedDataset, doc_range: tuple[int, int]) -> str:
    """A digest of the document lengths in `doc_range`: the sample indices depend on nothing else of the files,
    so a re-preprocessed corpus (same .bin size, other documents or order) never reuses stale indices."""
    lo, hi = doc_range
    return hashlib.md5(np.ascontiguousarray(indexed.lengths[lo:hi])).hexdigest()  # (the mapped bytes, no copy)


class GPTDataset:
    def __init__(
        self,
        indexed: IndexedDataset,
        doc_range: tuple[int, int],
        num_samples: int,
        seq_length: int,
        seed: int,
        cache_dir: str,
        eod: int,
        eod_mask_loss: bool = False,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        split: str = "train",
        log=None,
        flag: str | None = None,
        pad: int | None = None,
    ) -> None:
        """`split`: which one it is (train, validation or test), and `flag` what gave its data (the dataset's
        own by default), as messages name them; `log`: notes; `pad`: the tokenizer's pad id (see __getitem__)."""
        self.indexed = indexed
        self.pad = pad
        self.flag = flag or indexed.flag
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.seq_length = seq_length
        self.eod = eod
        self.eod_mask_loss = eod_mask_loss
        lo, hi = doc_range
        if hi <= lo:
            raise ValueError(f"{indexed.prefix}: the split {doc_range} holds no documents")
        key = json.dumps(
            [
                os.path.abspath(indexed.prefix),
                os.path.getsize(indexed.prefix + ".bin"),
                index_signature(indexed, doc_range),
                list(doc_range),
                num_samples,
                seq_length,
                seed,
                # the order's rule: indices cached before every epoch's documents were shuffled together (as
                # Megatron's) held another order for a split read over several epochs; they are not reused
                "documents-shuffled-across-epochs",
            ]
        )
        # (summed from the mapped lengths: every rank does this on every start, cached indices or not, and copies
        # of a billion documents' lengths took gigabytes a rank)
        tokens_per_epoch = int(indexed.lengths[lo:hi].sum(dtype=np.int64))
        where = f"{self.flag} {indexed.prefix}: the {split} split's {hi - lo} documents"
        if tokens_per_epoch == 0:
            # (every rank reads these lengths, so every rank raises: no collective is left waiting)
            fix = "or change --split" if self.flag == "--data-path" else "or give other data"
            raise ConfigError(f"{where} hold no tokens: add data {fix}")
        if tokens_per_epoch <= seq_length and log is not None:  # (said on every start, cached indices or not)
            # (Megatron-core repeats them too: a 1000-document corpus's 0.1% test split is one document)
            log(f"note: {where} hold {tokens_per_epoch} tokens, fewer than one sample of --seq-length "
                f"{seq_length} + 1: each of its samples repeats them")  # fmt: skip
        digest = hashlib.md5(key.encode()).hexdigest()
        paths = {k: os.path.join(cache_dir, f"{digest}-{k}.npy") for k in ("doc", "sample", "shuffle")}
        with _lock_unless(list(paths.values()), os.path.join(cache_dir, f"{digest}.lock")):
            if not all(os.path.exists(p) for p in paths.values()):
                docs = np.arange(lo, hi, dtype=np.int64)
                for k, arr in zip(("doc", "sample", "shuffle"), self._build(docs, tokens_per_epoch, num_samples, seed)):
                    _save_npy(paths[k], arr)
        self._paths, self._documents = paths, hi - lo
        self._map()
        self._check_cache()

    def _map(self) -> None:
        for k in ("doc", "sample", "shuffle"):
            try:
                setattr(self, f"{k}_index", np.load(self._paths[k], mmap_mode="r"))
            except (ValueError, OSError, EOFError) as e:  # (a truncated or overwritten cache file)
                self._corrupt(self._paths[k], str(e))

    def _check_cache(self) -> None:
        """The cached indices have the shapes this dataset's build gives (a truncated or foreign file was a
        traceback, or samples from nowhere)."""
        d, s, sh = self.doc_index, self.sample_index, self.shuffle_index
        if d.ndim != 1 or d.size == 0 or d.size % self._documents:
            self._corrupt(self._paths["doc"], f"{d.shape} is no whole number of epochs of {self._documents} documents")
        if s.ndim != 2 or s.shape[1] != 2 or s.shape[0] < 2:
            self._corrupt(self._paths["sample"], f"shape {s.shape}, not (samples + 1, 2)")
        if sh.ndim != 1 or sh.shape[0] != s.shape[0] - 1:
            self._corrupt(self._paths["shuffle"], f"{sh.shape[0]} entries for {s.shape[0] - 1} samples")

    def _corrupt(self, path: str, why: str):
        raise ConfigError(
            f"{self.flag} {self.indexed.prefix}: the cached index {path} is damaged ({why}); delete it and the run "
            "builds it again"
        )

    def __getstate__(self) -> dict:
        # (pickled for a spawned DataLoader worker: the cached index files' paths, not their contents)
        return {k: v for k, v in self.__dict__.items() if k not in ("doc_index", "sample_index", "shuffle_index")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._map()

    def _build(self, docs: np.ndarray, tokens_per_epoch: int, num_samples: int, seed: int):
        epochs = max(1, math.ceil((num_samples * self.seq_length + 1) / tokens_per_epoch))
        # Megatron-core's separate_final_epoch: when the last epoch is < 80% used, the samples of the full
        # epochs are shuffled among themselves and come first, so the run reads every document once before
        # any twice (else a 1.05-epoch run would skip ~1/5 of the corpus).
        full = (epochs - 1) * tokens_per_epoch
        sans_final = (full - 1) // self.seq_length if epochs > 1 else 0
        per_epoch = (tokens_per_epoch - 1) // self.seq_length
        separate = epochs > 1 and num_samples - sans_final < int(0.80 * per_epoch)
        rng = np.random.RandomState(seed)

        def shuffled_epochs(n: int) -> np.ndarray:  # Megatron's _build_document_index: n epochs shuffled together
            index = np.tile(docs, n)
            rng.shuffle(index)
            return index

        doc_index = (
            np.concatenate([shuffled_epochs(epochs - 1), shuffled_epochs(1)]) if separate else shuffled_epochs(epochs)
        )
        total = (epochs * tokens_per_epoch - 1) // self.seq_length
        ends = np.cumsum(self.indexed.lengths[doc_index].astype(np.int64))
        starts = np.arange(total + 1, dtype=np.int64) * self.seq_length
        pos = np.searchsorted(ends, starts, side="right")
        offset = starts - np.where(pos > 0, ends[np.maximum(pos - 1, 0)], 0)
        sample_index = np.stack([pos, offset], axis=1)
        if separate:  # samples [0, sans_final) end inside the full epochs (their extra label token too)
            shuffle_index = np.concatenate(
                [rng.permutation(sans_final), sans_final + rng.permutation(total - sans_final)]
            ).astype(np.int64)
        else:
            shuffle_index = rng.permutation(total).astype(np.int64)
        return doc_index, sample_index, shuffle_index

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def tokens(self, index: int) -> np.ndarray:
        j = int(self.shuffle_index[index])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        if d0 == d1:
            return self.indexed.get(int(self.doc_index[d0]), int(o0), self.seq_length + 1)
        parts = [self.indexed.get(int(self.doc_index[d0]), int(o0))]
        parts += [self.indexed.get(int(self.doc_index[d])) for d in range(d0 + 1, d1)]
        parts.append(self.indexed.get(int(self.doc_index[d1]), 0, int(o1) + 1))
        return np.concatenate(parts)[: self.seq_length + 1]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        seq = torch.from_numpy(self.tokens(index).astype(np.int64))
        labels = seq[1:].clone()
        mask = torch.ones(self.seq_length, dtype=torch.float32)
        tokens = seq[:-1].clone()
        if self.eod_mask_loss:  # Megatron's: no loss where the input is EOD (predicting the next document's start)
            mask[tokens == self.eod] = 0.0
        sample = {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": mask,
            "position_ids": (
                document_position_ids(tokens, self.eod) if self.reset_position_ids else torch.arange(self.seq_length)
            ),
        }
        if self.reset_attention_mask:
            sample["document_ids"] = document_ids(tokens, self.eod)
        if self.pad is not None:  # Megatron-core's GPTDataset.__getitem__: no loss where the label is the pad id,
            mask[labels == self.pad] = 0.0  # and the pad read as id 0 (after the masks and positions, from the
            tokens[tokens == self.pad] = 0  # tokens as they were)
            labels[labels == self.pad] = 0
        return sample


BLEND_CHUNK = 1 << 20
BLEND_SLOW = 10**9  # (samples x datasets past which the Python scan takes minutes: ~1e8 a minute)


def normalize(weights: list[float]) -> list[float]:
    """Megatron's normalize(): float64 weights over their numpy sum, as Python floats."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def blending_indices(weights: list[float], size: int, log=None) -> tuple[np.ndarray, np.ndarray]:
    """(dataset, sample within it) of each of `size` blended samples: sample i comes from the dataset furthest
    behind its share, w * max(i, 1) - count, the first on ties (Megatron's helpers.cpp build_blending_indices).
    Run in C where a compiler is at hand (native_blend), else in Python, the same order bit for bit. The weights
    are normalised here, as Megatron's BlendedDataset does (its builder gives it a --data-path blend's weights
    normalised already: see builder.build_datasets)."""
    w = normalize(weights)
    # Typed arrays: Python lists of the whole blend took 64 bytes per sample (31 GiB for 500M samples); these
    # take 10, as Megatron's (int16 dataset, int64 sample)
    dtype = np.int16 if len(w) < 2**15 else np.int64
    built = native_blend.native_blending_indices(w, size, dtype)
    if built is not None:
        return built
    if log is not None and size * len(w) >= BLEND_SLOW:
        log(
            f"blending {len(w)} datasets into {size} samples in Python, about "
            f"{size * len(w) / 1e8:.0f} min here (once; cached): {native_blend.load()[1]}"
        )
    counts = [0] * len(w)
    dataset_index = np.empty(size, dtype=dtype)
    sample_index = np.empty(size, dtype=np.int64)
    for start in range(0, size, BLEND_CHUNK):
        chosen, within = [], []
        for i in range(start, min(start + BLEND_CHUNK, size)):  # (Python floats: numpy's float64 arithmetic,
            m = i if i > 1 else 1  # ten times faster per step)
            best, top = 0, w[0] * m - counts[0]
            for k in range(1, len(w)):
                if (v := w[k] * m - counts[k]) > top:  # (strictly: the first on ties, as argmax)
                    best, top = k, v
            chosen.append(best)
            within.append(counts[best])
            counts[best] += 1
        dataset_index[start : start + len(chosen)] = chosen
        sample_index[start : start + len(chosen)] = within
    return dataset_index, sample_index


def exhaustive_blending_indices(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(dataset, sample within it) drawing exactly sizes[k] samples from dataset k, each once, in proportion to
    the sizes (Megatron's build_exhaustive_blending_indices, for a blend built without a size: its full
    validation): the rule of blending_indices over the datasets not yet spent, the first on ties."""
    total = sum(sizes)
    w = [n / total for n in sizes]
    counts = [0] * len(sizes)
    unspent = [k for k, n in enumerate(sizes) if n > 0]
    dataset_index = np.empty(total, dtype=np.int16 if len(sizes) < 2**15 else np.int64)
    sample_index = np.empty(total, dtype=np.int64)
    for i in range(total):
        m = i if i > 1 else 1
        best = max(unspent, key=lambda k: (w[k] * m - counts[k], -k))  # (the largest; the first of equals)
        dataset_index[i], sample_index[i] = best, counts[best]
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
    return dataset_index, sample_index


class BlendedDataset:
    """Samples drawn from several datasets in proportion to their weights, deterministically (see
    blending_indices); the indices are cached in `cache_dir` (they depend on the weights and size only), as
    Megatron caches its blend's."""

    def __init__(
        self,
        datasets: list,
        weights: list[float],
        num_samples: int,
        cache_dir: str | None = None,
        log=None,
        exhaustive: bool = False,
    ) -> None:
        """`exhaustive`: the weights are the datasets' sizes, each sample drawn once (exhaustive_blending_indices;
        num_samples is their sum)."""

        def build():
            if exhaustive:
                return exhaustive_blending_indices([int(x) for x in weights])
            return blending_indices(weights, num_samples, log)

        if cache_dir is None:
            self.dataset_index, self.sample_index = build()
        else:
            key = [[float(x) for x in weights], num_samples] + (["exhaustive"] if exhaustive else [])
            digest = hashlib.md5(json.dumps(key).encode()).hexdigest()
            # (two files, each its own dtype; an older cache's one stacked blend-{digest}.npy is not read)
            paths = [os.path.join(cache_dir, f"blend-{digest}-{k}.npy") for k in ("dataset", "sample")]
            with _lock_unless(paths, os.path.join(cache_dir, f"blend-{digest}.lock")):
                if not all(os.path.exists(p) for p in paths):
                    old = os.path.join(cache_dir, f"blend-{digest}.npy")  # (one stacked array, before: the same)
                    if os.path.exists(old):
                        stacked = np.load(old)
                        dtype = np.int16 if len(weights) < 2**15 else np.int64
                        built = (stacked[0].astype(dtype), stacked[1])
                    else:
                        built = build()
                    for p, arr in zip(paths, built):
                        _save_npy(p, arr)
            self._paths = paths
            self._map()
        self.datasets = datasets

    def _map(self) -> None:
        try:
            self.dataset_index, self.sample_index = (np.load(p, mmap_mode="r") for p in self._paths)
        except (ValueError, OSError, EOFError) as e:  # (a truncated or overwritten cache file)
            raise ConfigError(
                f"a cached blend index in {os.path.dirname(self._paths[0])} is damaged ({e}); "
                f"delete {' and '.join(self._paths)} and the run builds them again"
            ) from None

    def __getstate__(self) -> dict:
        if not hasattr(self, "_paths"):  # (built in memory: the arrays are the state)
            return self.__dict__
        return {k: v for k, v in self.__dict__.items() if k not in ("dataset_index", "sample_index")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if "_paths" in state:
            self._map()

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, index: int):
        return self.datasets[int(self.dataset_index[index])][int(self.sample_index[index])]
