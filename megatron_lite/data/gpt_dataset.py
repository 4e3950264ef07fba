"""GPT samples from indexed documents: seq_length + 1 tokens across document boundaries, in a seeded shuffle
whose index arrays are built once and cached; train/valid/test splits by document; weighted blends.

Sample j of an epoch-concatenated document stream starts at token j * seq_length and holds seq_length + 1
tokens (inputs and shifted labels). The document order (per epoch) and the sample order are seeded
permutations, so the dataset is a pure function of (files, split, seed, seq_length, num_samples).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os

import numpy as np
import torch

from megatron_lite.data.documents import document_ids, document_position_ids
from megatron_lite.data.indexed import IndexedDataset


@contextlib.contextmanager
def file_lock(path: str):
    """An exclusive lock across processes (ranks building the same cache wait for the first)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _save_npy(path: str, arr: np.ndarray) -> None:
    tmp = path + ".partial.npy"
    np.save(tmp, arr, allow_pickle=False)
    os.replace(tmp, path)


def split_document_ranges(num_docs: int, weights: tuple[float, float, float]) -> list[tuple[int, int]]:
    """Megatron's split: consecutive document ranges proportional to the weights."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * num_docs)))
    diff = bounds[-1] - num_docs
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


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
    ) -> None:
        self.indexed = indexed
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.seq_length = seq_length
        self.eod = eod
        self.eod_mask_loss = eod_mask_loss
        docs = np.arange(doc_range[0], doc_range[1], dtype=np.int64)
        if len(docs) == 0:
            raise ValueError(f"{indexed.prefix}: the split {doc_range} holds no documents")
        key = json.dumps(
            [
                os.path.abspath(indexed.prefix),
                os.path.getsize(indexed.prefix + ".bin"),
                list(doc_range),
                num_samples,
                seq_length,
                seed,
            ]
        )
        digest = hashlib.md5(key.encode()).hexdigest()
        paths = {k: os.path.join(cache_dir, f"{digest}-{k}.npy") for k in ("doc", "sample", "shuffle")}
        with file_lock(os.path.join(cache_dir, f"{digest}.lock")):
            if not all(os.path.exists(p) for p in paths.values()):
                for k, arr in zip(("doc", "sample", "shuffle"), self._build(docs, num_samples, seed)):
                    _save_npy(paths[k], arr)
        self.doc_index = np.load(paths["doc"], mmap_mode="r")
        self.sample_index = np.load(paths["sample"], mmap_mode="r")
        self.shuffle_index = np.load(paths["shuffle"], mmap_mode="r")

    def _build(self, docs: np.ndarray, num_samples: int, seed: int):
        lengths = self.indexed.lengths[docs].astype(np.int64)
        tokens_per_epoch = int(lengths.sum())
        if tokens_per_epoch <= self.seq_length:
            raise ValueError(f"{self.indexed.prefix}: {tokens_per_epoch} tokens cannot fill one sample")
        epochs = max(1, math.ceil((num_samples * self.seq_length + 1) / tokens_per_epoch))
        rng = np.random.RandomState(seed)
        doc_index = np.concatenate([rng.permutation(docs) for _ in range(epochs)])
        total = (epochs * tokens_per_epoch - 1) // self.seq_length
        ends = np.cumsum(self.indexed.lengths[doc_index].astype(np.int64))
        starts = np.arange(total + 1, dtype=np.int64) * self.seq_length
        pos = np.searchsorted(ends, starts, side="right")
        offset = starts - np.where(pos > 0, ends[np.maximum(pos - 1, 0)], 0)
        sample_index = np.stack([pos, offset], axis=1)
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
        return sample


class BlendedDataset:
    """Samples drawn from several datasets in proportion to their weights, deterministically: sample i
    comes from the dataset furthest behind its share (Megatron's greedy blending)."""

    def __init__(self, datasets: list, weights: list[float], num_samples: int) -> None:
        w = np.asarray(weights, dtype=np.float64)
        w = w / w.sum()
        counts = np.zeros(len(datasets), dtype=np.int64)
        self.dataset_index = np.zeros(num_samples, dtype=np.int64)
        self.sample_index = np.zeros(num_samples, dtype=np.int64)
        for i in range(num_samples):
            k = int(np.argmax(w * (i + 1) - counts))
            self.dataset_index[i] = k
            self.sample_index[i] = counts[k]
            counts[k] += 1
        self.datasets = datasets

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, index: int):
        return self.datasets[int(self.dataset_index[index])][int(self.sample_index[index])]
