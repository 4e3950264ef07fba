"""--sft's tokenized records kept for the next run, as Megatron keeps a dataset's sample indices: in
--data-cache-path, or a cache/ folder beside the JSONL file. Tokenizing is most of an SFT job's start-up (20k
chat lines took 35 s on every rank, every launch); the cache is read mapped, its pages shared by the ranks and
the DataLoader workers of a node. One process builds it while the others wait on its lock, then all map it; where
that process could not keep it (a full disk), the others tokenize at once, not one after another.

A cache is found by what the records depend on: the file (path, size, modification time and inode), the
sequence length, the tokenizer (its type, ids and the files it and its chat template come from), the installed
transformers/tokenizers/jinja2, and the code that reads the records (a changed reading never meets an old
cache). A folder that cannot be written or locked costs the cache only: the records are tokenized as before,
said once; a damaged cache is said and built again. Not in the key: the file's bytes (a rewrite of the same size
and modification time in place reads the old cache; hashing a large file on every start would cost a read)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from importlib import metadata

import numpy as np

from megatron_lite.checkpoint.atomic import atomic_write
from megatron_lite.data.gpt_dataset import _save_npy, held_lock

ARRAYS = ("tokens", "starts", "prompt_lens", "trained", "cuts")
# the code an SFT record's tokens come from, digested into the cache's name
_SOURCES = ("sft.py", "sft_messages.py", "sft_cache.py", "tokenizers.py", "tiktokenizer.py")
# beside a tokenizer file: what transformers reads into the tokenizer and its chat template
_BESIDE = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def _digest(h, path: str) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)


def _tokenizer_files(tokenizer) -> list[str]:
    """Every file the tokenizer was built from (its attributes naming files), and those transformers reads beside
    them (the chat template)."""
    files = {os.path.abspath(v) for v in vars(tokenizer).values() if isinstance(v, str) and os.path.isfile(v)}
    for folder in {os.path.dirname(f) for f in files}:
        files |= {os.path.join(folder, n) for n in _BESIDE if os.path.isfile(os.path.join(folder, n))}
    return sorted(files)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cache_key(path: str, tokenizer, seq_length: int) -> str:
    """The digest naming the cache of `path`'s records read with `tokenizer` at `seq_length`."""
    st = os.stat(path)
    h = hashlib.md5()
    # every plain setting the tokenizer holds (its ids, TikTokenizer's special tokens and legacy mode, ...: a
    # review found a changed --tokenizer-special-tokens reading an old cache)
    plain = (str, int, float, bool, type(None))
    ids = {
        k: v
        for k, v in sorted(vars(tokenizer).items())
        if isinstance(v, plain) or (isinstance(v, list | tuple) and all(isinstance(x, plain) for x in v))
    }
    head = [os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ino, seq_length, type(tokenizer).__name__, ids]
    versions = [_version(p) for p in ("transformers", "tokenizers", "jinja2")]
    h.update(json.dumps([head, versions], default=str).encode())
    for f in _tokenizer_files(tokenizer):
        h.update(f.encode())
        _digest(h, f)
    # the pipelines as built (the installed transformers' reading of a file, tokens added, ...)
    for pipeline in (getattr(tokenizer, "_tok", None), getattr(tokenizer, "_chat", None)):
        if hasattr(pipeline, "to_str"):
            h.update(pipeline.to_str().encode())
    here = os.path.dirname(os.path.abspath(__file__))
    for name in _SOURCES:
        _digest(h, os.path.join(here, name))
    return h.hexdigest()


def _paths(cache_dir: str, key: str) -> tuple[str, dict[str, str]]:
    base = os.path.join(cache_dir, f"sft_{key}")
    return base + ".json", {a: f"{base}.{a}.npy" for a in ARRAYS}


def _load(meta_path: str, files: dict[str, str], say) -> tuple[dict[str, np.ndarray], bool] | None:
    """The cache, or None where it is missing or damaged (a truncated file: built again, said)."""
    if not (os.path.exists(meta_path) and all(os.path.exists(p) for p in files.values())):
        return None
    try:
        with open(meta_path, encoding="utf-8") as f:
            packed = bool(json.load(f)["packed"])
        arrays = {a: np.load(p, mmap_mode="r", allow_pickle=False) for a, p in files.items()}
    except (OSError, ValueError, EOFError, KeyError, TypeError) as e:  # (it was a traceback: a review)
        say(f"note: the tokenized cache {meta_path} is damaged ({type(e).__name__}: {e}); tokenizing again")
        return None
    return arrays, packed


def _save(meta_path: str, files: dict[str, str], arrays: dict[str, np.ndarray], packed: bool, source: str) -> None:
    for a, p in files.items():
        _save_npy(p, np.asarray(arrays[a]))
    meta = {"source": os.path.abspath(source), "records": len(arrays["prompt_lens"]), "packed": packed}
    meta["built"] = time.strftime("%Y-%m-%d %H:%M:%S")

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(meta, f)

    atomic_write(meta_path, write)  # (last: the arrays are all there once it is)


def cached_records(path: str, tokenizer, seq_length: int, cache_dir: str, read, log=None):
    """read(path, tokenizer, seq_length, log) -> (arrays, packed), from the cache where it was built before, else
    read and cached. `log`: notes (the first rank's)."""
    key = cache_key(path, tokenizer, seq_length)
    meta_path, files = _paths(cache_dir, key)
    say = log or (lambda _msg: None)

    def hit(found):
        say(f"--sft {path}: {len(found[0]['prompt_lens'])} records read from the tokenized cache {meta_path}")
        return found

    # (complete: read without a lock, as a read-only folder needs; a damaged one is said once, under the lock)
    if (found := _load(meta_path, files, lambda _m: None)) is not None:
        return hit(found)
    with contextlib.ExitStack() as held:
        try:
            waited = held.enter_context(held_lock(os.path.join(cache_dir, f"sft_{key}.lock")))
        except OSError as e:  # (a folder that cannot be made, written or locked)
            say(f"note: --sft {path}: {cache_dir} cannot hold its tokenized records ({e.strerror}), so they are "
                "tokenized on every start: pass --data-cache-path DIR, a writable directory on a file system with "
                "locks")  # fmt: skip
            return read(path, tokenizer, seq_length, log)
        if (found := _load(meta_path, files, say)) is not None:  # (built while this process waited)
            return hit(found)
        if waited:  # (the process before could not keep them: tokenized here at once, not one rank after another)
            held.close()
            return read(path, tokenizer, seq_length, log)
        began = time.monotonic()
        arrays, packed = read(path, tokenizer, seq_length, log)
        try:
            _save(meta_path, files, arrays, packed, path)
        except OSError as e:
            say(f"note: --sft {path}: its tokenized records could not be kept in {cache_dir} ({e.strerror}); they "
                "are tokenized again on the next start: pass --data-cache-path DIR, a writable directory")  # fmt: skip
            return arrays, packed
        say(f"--sft {path}: {len(arrays['prompt_lens'])} records tokenized in {time.monotonic() - began:.1f} s, "
            f"kept for the next run in {meta_path}")  # fmt: skip
        return arrays, packed
