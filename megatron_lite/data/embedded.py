"""The default corpus: real text every machine with Python already has, the standard library's own
sources, with a byte-level BPE tokenizer trained on it. Built once (a minute or less) and cached, so the
main command trains on real data with no download.

Cache: $MEGATRON_LITE_CACHE or ~/.cache/megatron_lite, one folder per Python version and vocabulary
size. Concurrent ranks wait on a file lock while the first one builds.
"""

from __future__ import annotations

import os
import random
import sys
import sysconfig
import time

from megatron_lite.checkpoint.atomic import atomic_write, atomic_write_json
from megatron_lite.data.gpt_dataset import file_lock
from megatron_lite.data.indexed import IndexedDatasetWriter

EOD = "<|endoftext|>"


def cache_root() -> str:
    return os.environ.get("MEGATRON_LITE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "megatron_lite"))


SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings"}
CORPUS_VERSION = 2  # bump when the corpus recipe changes, so caches are rebuilt


def _stdlib_files(max_bytes: int) -> list[str]:
    """Standard-library modules (not tests, not codec tables), in a fixed shuffled order, so that the
    train/valid/test split (consecutive document ranges) draws each split from the same kind of text."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    random.Random(1234).shuffle(files)
    out, total = [], 0
    for f in files:
        size = os.path.getsize(f)
        if total + size > max_bytes:
            continue
        out.append(f)
        total += size
    return out


EMBEDDED_VOCAB = 4096  # the size of the tokenizer trained on the corpus


def trained_on_embedded_corpus(meta: dict, vocab_size: int) -> bool:
    """Whether a checkpoint's job trained on this corpus (its tokenizer is then the corpus's, which the checkpoint
    does not name): a job given no data nor tokenizer flags, with the corpus's vocabulary, and not a conversion
    from Hugging Face (whose checkpoint names no data either, its vocabulary being the model's own)."""
    data = meta["config"].get("data") or {}
    named = data.get("data_path") or data.get("train_data_path") or data.get("mock_data") or data.get("sft")
    return (
        not named and data.get("tokenizer_type") is None and not meta.get("converted_from")
        and vocab_size == EMBEDDED_VOCAB
    )  # fmt: skip


def build_embedded_corpus(
    vocab_size: int = EMBEDDED_VOCAB, max_bytes: int = 12_000_000, root: str | None = None, log=print
) -> tuple[str, str]:
    """(dataset prefix, tokenizer.json path), building them first if needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = os.path.join(
        root or cache_root(),
        f"embedded{CORPUS_VERSION}-py{sys.version_info[0]}{sys.version_info[1]}-v{vocab_size}-b{max_bytes}",
    )
    prefix = os.path.join(folder, "stdlib_text_document")
    tok_path = os.path.join(folder, "tokenizer.json")
    done = os.path.join(folder, "done.json")
    with file_lock(os.path.join(folder, ".lock")):
        if os.path.exists(done):
            return prefix, tok_path
        t0 = time.time()
        files = _stdlib_files(max_bytes)
        texts = [open(f, encoding="utf-8", errors="replace").read() for f in files]
        log(
            f"embedded corpus: {len(files)} files, {sum(map(len, texts)) / 1e6:.1f} MB of Python's standard "
            f"library; training a {vocab_size}-token BPE tokenizer"
        )
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOD],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(texts, trainer=trainer)
        atomic_write(tok_path, tok.save)  # (the cache may be a home directory that nodes share)
        eod = tok.token_to_id(EOD)
        writer = IndexedDatasetWriter(prefix, tok.get_vocab_size())
        n_tokens = 0
        for start in range(0, len(texts), 256):
            for enc in tok.encode_batch(texts[start : start + 256]):
                writer.add_document(enc.ids + [eod])
                n_tokens += len(enc.ids) + 1
            log(f"embedded corpus: tokenized {min(start + 256, len(texts))}/{len(texts)} files")
        writer.finalize()
        atomic_write_json(done, {"files": len(files), "tokens": n_tokens, "vocab_size": tok.get_vocab_size()})
        log(f"embedded corpus: {n_tokens / 1e6:.2f}M tokens in {time.time() - t0:.0f} s, cached in {folder}")
    return prefix, tok_path
