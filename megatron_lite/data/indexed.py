"""Megatron's memory-mapped indexed dataset (`PREFIX.bin` + `PREFIX.idx`), read and written compatibly, so
data preprocessed for Megatron-LM trains here and the other way round.

.idx: b"MMIDIDX\\x00\\x00", version <Q = 1, dtype code <B, sequence count <Q, document count <Q, then
sequence lengths (int32), sequence byte offsets into .bin (int64), document boundaries (int64, indices
into the sequences, starting with 0). .bin: the token ids of every sequence, back to back.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from megatron_lite.checkpoint.atomic import hold_temp, private_temp, remove_stale_temps
from megatron_lite.config import ConfigError

HEADER = b"MMIDIDX\x00\x00"
DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


class IndexedDatasetWriter:
    """Append documents, then `finalize()`; the files appear only when complete (written to temporary
    names and renamed)."""

    def __init__(self, prefix: str, vocab_size: int) -> None:
        self.prefix = prefix
        self.dtype = token_dtype(vocab_size)
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        # (what a killed writer of this prefix on this host left: said by the preprocessing tool)
        self.removed_stale = [p for ext in (".bin", ".idx") for p in remove_stale_temps(prefix + ext)]
        self._tmp = {ext: private_temp(prefix + ext) for ext in (".bin", ".idx")}
        self._bin = open(self._tmp[".bin"], "wb")
        self._hold = hold_temp(self._tmp[".bin"])  # (until the files are in place: no other run takes it as stale)
        self._lengths: list[int] = []
        self._docs = [0]  # document boundaries, indices into the sequences

    def add_document(self, ids, lengths: list[int] | None = None) -> None:
        """One document: its tokens, as one sequence or as sequences of `lengths` (Megatron's sentences;
        `[]` for an empty document, which then adds a document boundary and no sequence, as Megatron's)."""
        arr = np.asarray(ids, dtype=self.dtype)
        lengths = [len(arr)] if lengths is None else [int(n) for n in lengths]
        if sum(lengths) != len(arr):
            raise ValueError(f"sequence lengths {lengths} do not add up to the document's {len(arr)} tokens")
        self._bin.write(arr.tobytes(order="C"))
        self._lengths.extend(lengths)
        self._docs.append(len(self._lengths))

    def discard(self) -> None:
        """Drop what was written (an input error stopped the run): no partial file stays behind."""
        self._bin.close()
        for path in self._tmp.values():
            if os.path.exists(path):
                os.remove(path)
        self._release()

    def _release(self) -> None:
        if self._hold is not None:
            self._hold.close()
            self._hold = None

    def finalize(self) -> None:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64)) * self.dtype.itemsize
        docs = np.asarray(self._docs, dtype=np.int64)
        with open(self._tmp[".idx"], "wb") as f:
            f.write(HEADER)
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<B", CODES[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(docs)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(docs.tobytes(order="C"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._tmp[".bin"], self.prefix + ".bin")
        os.replace(self._tmp[".idx"], self.prefix + ".idx")
        self._release()


def _missing_hint(prefix: str, flag: str) -> str:
    """What to give instead of a missing `prefix`: preprocess_data.py writes PREFIX_{json key}_document.bin/.idx,
    so a --data-path given as its --output-prefix is told the name of the files it wrote."""
    folder, name = os.path.dirname(prefix), os.path.basename(prefix)
    if name.endswith((".bin", ".idx")):  # (X.bin was told "missing X.bin.idx")
        stripped = prefix[: -len(".bin")]
        if os.path.isfile(stripped + ".bin") and os.path.isfile(stripped + ".idx"):
            return f"; {flag} takes the prefix of the .bin/.idx pair, without the extension: give {flag} {stripped}"
        return f" ({flag} takes the prefix of the .bin/.idx pair, without the extension)"
    try:
        files = os.listdir(folder or ".")
    except OSError:
        files = []
    ends = "_document.idx"
    written = sorted(
        os.path.join(folder, f[: -len(".idx")]) for f in files if f.startswith(name + "_") and f.endswith(ends)
    )
    if not written:
        return " (run tools/preprocess_data.py)"
    return f"; preprocess_data.py wrote {written[0]}.bin/.idx for --output-prefix {prefix}: give {flag} {written[0]}"


class IndexedDataset:
    """Documents of token ids, memory-mapped. Every inconsistency in the files is a one-line error naming
    the file."""

    def __init__(self, prefix: str, flag: str = "--data-path") -> None:
        self.prefix, self.flag = prefix, flag  # (the flag that named it, as errors name it)
        idx, bin_ = prefix + ".idx", prefix + ".bin"
        for path in (idx, bin_):
            if not os.path.isfile(path):
                raise ConfigError(f"{flag} {prefix}: missing {path}{_missing_hint(prefix, flag)}")
        size = os.path.getsize(idx)
        with open(idx, "rb") as f:
            head = f.read(34)
        if head[:8] == b"TNTIDX\x00\x00":  # (old Megatron's --dataset-impl lazy/cached: read by nothing current)
            raise ConfigError(
                f"{idx} is an index of old Megatron's lazy/cached format (TNTIDX), not the mmap format Megatron-Core "
                "reads: preprocess the data again (tools/preprocess_data.py)"
            )
        if len(head) < 34 or head[:9] != HEADER:
            raise ConfigError(f"{idx} is not a Megatron indexed-dataset index (bad header)")
        version, code = struct.unpack("<Q", head[9:17])[0], head[17]
        if version != 1:
            raise ConfigError(f"{idx}: index version {version}, where Megatron's format is version 1")
        if code not in DTYPES:
            raise ConfigError(f"{idx}: dtype code {code} is none of Megatron's ({', '.join(map(str, DTYPES))})")
        n_seq, n_doc = struct.unpack("<Q", head[18:26])[0], struct.unpack("<Q", head[26:34])[0]
        expected = 34 + n_seq * 4 + n_seq * 8 + n_doc * 8
        # (Megatron's multimodal builder appends an int8 mode per sequence, which its text reader skips too)
        if size not in (expected, expected + n_seq):
            raise ConfigError(f"{idx} is truncated or corrupt: {size} bytes, expected {expected}")
        self.dtype = np.dtype(DTYPES[code])
        index = np.memmap(idx, mode="r", dtype=np.uint8)
        self.lengths = np.frombuffer(index, dtype=np.int32, count=n_seq, offset=34)
        self.pointers = np.frombuffer(index, dtype=np.int64, count=n_seq, offset=34 + 4 * n_seq)
        self.document_indices = np.frombuffer(index, dtype=np.int64, count=n_doc, offset=34 + 12 * n_seq)
        bin_size = os.path.getsize(bin_)
        need = int(self.pointers[-1] + self.lengths[-1] * self.dtype.itemsize) if n_seq else 0
        if bin_size < need:
            raise ConfigError(f"{bin_} is truncated: {bin_size} bytes, the index needs {need}")
        if need and bin_size in (2 * need, 4 * need, 8 * need):
            # (the tokens written in a wider dtype than the index says: read as this one's, ids and zeros
            # alternating; a .bin merely longer than its index is read as Megatron reads it, up to what it covers)
            raise ConfigError(
                f"{bin_} does not match {idx}: {bin_size} bytes, {bin_size // need} times what the index describes "
                f"({need} bytes of {self.dtype}); the tokens were written in another dtype: give the pair "
                "preprocess_data.py wrote together"
            )
        self._bin = np.memmap(bin_, mode="r", dtype=np.uint8) if bin_size else np.zeros(0, np.uint8)

    def __getstate__(self) -> dict:
        # (a DataLoader worker started by spawn or forkserver gets the dataset pickled: the path, not a copy of
        # the whole .bin, as Megatron's IndexedDataset; the worker maps the files again)
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `index`."""
        n = int(self.lengths[index]) - offset if length is None else length
        start = int(self.pointers[index]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=n, offset=start)

    def max_token(self) -> int:
        if not len(self):
            return -1
        # the bytes the index covers (Megatron reads nothing else: a longer .bin may end in anything)
        end = int(self.pointers[-1]) + int(self.lengths[-1]) * self.dtype.itemsize
        return int(np.frombuffer(self._bin[:end], dtype=self.dtype).max()) if end else -1
