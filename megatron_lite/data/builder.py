"""From the data flags to a tokenizer and train/valid/test datasets.

Three sources: --mock-data (synthetic, NullTokenizer), --data-path (indexed datasets split by --split, a
tokenizer from the flags) or --train/valid/test-data-path (each split its own datasets, used whole; with --sft
JSONL files of prompt/response records either way: data/sft.py), or none:
the embedded corpus and its trained tokenizer. The model's vocabulary is
--vocab-size when given, else the tokenizer's; a dataset holding a token id beyond it is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from dataclasses import dataclass

from megatron_lite.checkpoint.atomic import atomic_write
from megatron_lite.config import ConfigError
from megatron_lite.data.config import DataConfig
from megatron_lite.data.embedded import build_embedded_corpus
from megatron_lite.data.gpt_dataset import BlendedDataset, GPTDataset, file_lock, normalize, split_document_ranges
from megatron_lite.data.indexed import IndexedDataset
from megatron_lite.data.mock import MockGPTDataset
from megatron_lite.data.tokenizers import HuggingFaceTokenizer, NullTokenizer, tokenizer_from_flags


@dataclass
class DataSource:
    tokenizer: object
    vocab_size: int
    prefixes: list[tuple[float | None, str]]  # (weight, prefix), weight None: by size; empty for mock data
    description: str
    per_split: tuple[list[tuple[float | None, str]], ...] | None = None  # --train/valid/test-data-path blends


def check_vocabulary_flags(data: DataConfig) -> None:
    """What resolve_data needs to know the vocabulary, checked before anything is read (the dry run, which
    reads nothing, checks the same)."""
    if data.mock_data:
        if data.tokenizer_type in (None, "NullTokenizer") and data.vocab_size is None:
            raise ConfigError("--mock-data needs --vocab-size N (or a tokenizer)")
    elif data.sft:
        if not (data.data_path or data.train_data_path) or data.tokenizer_type is None:
            raise ConfigError(
                "--sft needs --data-path (JSONL files of prompt/response records, divided by --split) or "
                "--train-data-path (and --valid/test-data-path), and --tokenizer-type"
            )
    elif (data.data_path or data.train_data_path) and data.tokenizer_type is None:
        flag = "--data-path" if data.data_path else "--train-data-path"
        raise ConfigError(f"{flag} needs --tokenizer-type (and its files) to know the vocabulary")
    elif not (data.data_path or data.train_data_path) and (data.vocab_size or data.tokenizer_type):
        # (they were dropped silently: the model took the embedded corpus's 4096-token vocabulary)
        flag = f"--vocab-size {data.vocab_size}" if data.vocab_size else f"--tokenizer-type {data.tokenizer_type}"
        raise ConfigError(
            f"{flag} without data: with no --data-path or --mock-data the job trains on the embedded corpus with "
            "its own 4096-token tokenizer; add --mock-data (random tokens) or --data-path, or drop the flag"
        )
    files = [f for f in ("tokenizer_model", "vocab_file", "merge_file") if getattr(data, f, None)]
    if files and data.tokenizer_type is None:  # (dropped without a word: the job used another tokenizer)
        flag = f"--{files[0].replace('_', '-')} {getattr(data, files[0])}"
        if not (data.mock_data or data.data_path or data.train_data_path):  # (adding --tokenizer-type was then
            raise ConfigError(  # refused as a tokenizer without data: a loop)
                f"{flag} without data: with no --data-path or --mock-data the job trains on the embedded corpus "
                "with its own 4096-token tokenizer; add --data-path or --mock-data with --tokenizer-type, or drop "
                "the flag"
            )
        raise ConfigError(
            f"{flag} needs --tokenizer-type to be read (HuggingFaceTokenizer for a tokenizer.json, GPT2BPETokenizer "
            "for --vocab-file and --merge-file); add it, or drop the flag"
        )


def _tokenizers_vocabulary(data: DataConfig, tok, log) -> int:
    """Megatron reads --vocab-size for NullTokenizer alone; with any other tokenizer the vocabulary is the
    tokenizer's (padded after), whatever --vocab-size says: say so where they differ (the flag had won here)."""
    if data.vocab_size and not isinstance(tok, NullTokenizer) and data.vocab_size != tok.vocab_size:
        log(
            f"--vocab-size {data.vocab_size} has no effect with --tokenizer-type {data.tokenizer_type}: the "
            f"vocabulary is the tokenizer's {tok.vocab_size} (then padded to --make-vocab-size-divisible-by x TP), "
            "as in Megatron"
        )
    return tok.vocab_size


def resolve_data(data: DataConfig, log=print) -> DataSource:
    check_vocabulary_flags(data)
    if data.mock_data:
        tok = (
            tokenizer_from_flags(data)
            if data.tokenizer_type not in (None, "NullTokenizer")
            else NullTokenizer(data.vocab_size)
        )
        return DataSource(tok, _tokenizers_vocabulary(data, tok, log), [], "mock data")
    if data.sft:
        tok = tokenizer_from_flags(data)
        per_split = data.blend_per_split
        prefixes = data.blend if per_split is None else [wp for b in per_split for wp in b]
        files = " ".join(dict.fromkeys(p for _, p in prefixes))  # (a file in two splits named once)
        how = f"--split {data.split}" if per_split is None else "--train/valid/test-data-path"
        return DataSource(
            tok, _tokenizers_vocabulary(data, tok, log), prefixes, f"SFT records {files} ({how})", per_split
        )
    if data.data_path or data.train_data_path:
        tok = tokenizer_from_flags(data)
        vocab = _tokenizers_vocabulary(data, tok, log)
        per_split = data.blend_per_split
        if per_split is None:
            return DataSource(tok, vocab, data.blend, f"{len(data.blend)} indexed dataset(s)")
        counts = "/".join(str(len(b)) for b in per_split)
        prefixes = [wp for b in per_split for wp in b]
        return DataSource(tok, vocab, prefixes, f"train/valid/test from {counts} indexed dataset(s)", per_split)
    prefix, tok_path = build_embedded_corpus(log=log)
    tok = HuggingFaceTokenizer(tok_path)
    return DataSource(tok, tok.vocab_size, [(1.0, prefix)], f"embedded corpus {prefix}")


def _cached_max_token(key: str, size: list) -> dict | None:
    try:
        with open(key) as f:
            cached = json.load(f)
    except (OSError, ValueError):  # none yet, or unreadable (a write cut short before they were atomic)
        return None
    return cached if isinstance(cached, dict) and cached.get("size") == size else None


def _dump_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def _check_vocab(indexed: IndexedDataset, vocab_size: int, cache_dir: str, log=None, scan: bool = True) -> bool:
    """The largest token id of a dataset (cached by the .bin's size, mtime and inode: a re-preprocessed corpus
    of the same size is scanned again) must fit the vocabulary. `scan=False`: only from the cache; False when
    there is none (not checked)."""
    # (named by a hash of the path: the path itself can pass the file system's 255-byte limit on a name)
    key = os.path.join(cache_dir, f"max_token_{hashlib.md5(os.path.abspath(indexed.prefix).encode()).hexdigest()}.json")
    st = os.stat(indexed.prefix + ".bin")
    size = [st.st_size, st.st_mtime_ns, st.st_ino]
    fresh = _cached_max_token(key, size)  # (a cache hit writes nothing: it may be on a read-only mount)
    if fresh is None and not scan:
        return False
    with contextlib.nullcontext() if fresh is not None else file_lock(key + ".lock"):
        cached = fresh or _cached_max_token(key, size)
        if cached is None:
            if log is not None:  # (at disk speed on a cold multi-TB corpus: not a hang)
                log(
                    f"scanning {indexed.prefix}.bin ({st.st_size / 2**30:.2f} GiB) for its largest token id, once "
                    f"(cached in {cache_dir})"
                )
            cached = {"size": size, "max_token": indexed.max_token()}
            atomic_write(key, lambda tmp: _dump_json(tmp, cached))
    if cached["max_token"] >= vocab_size:
        raise ConfigError(
            f"{indexed.flag} {indexed.prefix} holds token id {cached['max_token']} but the vocabulary has {vocab_size} "
            f"ids (--vocab-size / tokenizer); use the tokenizer the data was made with"
        )
    return True


def _cache_dir(data: DataConfig, prefix: str) -> str:
    return data.data_cache_path or os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")


def check_data(source: DataSource, data: DataConfig, log=None, scan: bool = True) -> list[str]:
    """Every indexed dataset's files are there and readable and its token ids fit the vocabulary: checked at
    start-up, before any process group or model (a missing .idx was found after the model was built and the
    checkpoint loaded, said once per rank). The largest token id is cached: build_datasets reads it again.
    `scan=False` (a dry run): ids only where a scan is cached; returns the prefixes whose ids were not checked."""
    flags = ("--train-data-path", "--valid-data-path", "--test-data-path")
    unchecked = []
    for s, blend in enumerate(source.per_split if source.per_split is not None else [source.prefixes]):
        for _, prefix in blend:
            if data.sft and not os.path.isfile(prefix):  # (it was a traceback once the model was built)
                flag = flags[s] if source.per_split is not None else "--data-path"
                raise ConfigError(f"--sft {flag} {prefix}: no such file (a JSONL file of prompt/response records)")
            if data.sft or not prefix:
                continue
            indexed = IndexedDataset(prefix, flags[s] if source.per_split is not None else "--data-path")
            if not _check_vocab(indexed, source.vocab_size, _cache_dir(data, prefix), log, scan):
                unchecked.append(prefix)
    return unchecked


def build_datasets(
    source: DataSource,
    data: DataConfig,
    num_samples: tuple[int, int, int],
    seq_length: int,
    seed: int,
    log=None,
    notes: list[str] | None = None,
) -> tuple:
    """(train, valid, test); a split with no samples requested is None. `log`: says what takes long (any rank);
    `notes` gets what the job should say once (a weighted part left out of a split it has no documents in).
    --full-validation: the validation split is one epoch of each of its datasets, blended exhaustively (each
    sample once); with --multiple-validation-sets it is a list, one whole dataset per --valid-data-path prefix."""
    if data.sft:
        from megatron_lite.data.sft import build_sft_datasets

        return build_sft_datasets(source, data, num_samples, seq_length, seed, log)
    if not source.prefixes:  # (a split --split gives no weight has none, as Megatron's mock builder: it was
        # evaluated anyway, an exploratory run found)
        return tuple(
            MockGPTDataset(source.vocab_size, seq_length, seed=seed + 1000 * i) if n and weight > 0 else None
            for i, (n, weight) in enumerate(zip(num_samples, data.split_weights))
        )
    eod_mask = data.eod_mask_loss
    # Each split's blend: (weight, prefix, use the --split part of it) — or, per split, whole datasets.
    if source.per_split is not None:
        blends = [[(w, p, False) for w, p in b] for b in source.per_split]
    else:
        blends = [[(w, p, True) for w, p in source.prefixes]] * 3
    opened: dict[str, tuple] = {}  # prefix -> (dataset, its cache directory, its --split document ranges)
    out = []
    flags = ("--train-data-path", "--valid-data-path", "--test-data-path")
    for s, blend in enumerate(blends):
        full = s == 1 and data.full_validation  # (one pass over the split, whatever was requested)
        # The components with documents in this split, found before sizing any: one whose split is empty
        # (a small dataset's test part) drops out and the others' shares grow to fill the split.
        live = []
        for w, prefix, by_split in blend:
            if prefix not in opened:
                indexed = IndexedDataset(prefix, flags[s] if source.per_split is not None else "--data-path")
                cache_dir = _cache_dir(data, prefix)
                _check_vocab(indexed, source.vocab_size, cache_dir, log)
                opened[prefix] = (indexed, cache_dir, split_document_ranges(len(indexed), data.split_weights))
            indexed, cache_dir, ranges = opened[prefix]
            lo, hi = ranges[s] if by_split else (0, len(indexed))
            if (num_samples[s] == 0 and not full) or hi <= lo:
                if num_samples[s] and w and len(blend) > 1 and notes is not None:  # (its share went to the others
                    # unsaid, an exploratory run found: one empty shard of a weighted blend changed the mixture)
                    where = f"--split {data.split}" if by_split else "an empty dataset"
                    notes.append(
                        f"{flags[s] if source.per_split is not None else '--data-path'} {prefix} (weight {w:g}) has no "
                        f"documents in the {('train', 'validation', 'test')[s]} split ({where}): the other parts' "
                        "weights fill its share"
                    )
                continue
            if full:  # its samples in one epoch (Megatron's GPTDataset built without a size); weights refused
                w = _one_epoch(indexed, (lo, hi), seq_length, flags[s] if source.per_split else "--data-path")
            elif w is None and len(blend) == 1:  # one prefix without a weight: the dataset itself
                w = 1.0
            elif w is None:  # prefixes without weights: Megatron weighs each by its samples in one epoch of the split
                w = max(int(indexed.lengths[lo:hi].sum()) - 1, 0) // seq_length
            if w > 0:
                live.append((w, indexed, cache_dir, (lo, hi)))
        # Megatron blends whatever carries weights, one weighted prefix of --data-path too (`--data-path 1.0 P`),
        # building each part for ceil(ceil(N x share) x (1 + --mid-level-dataset-surplus)) samples (a blend of one
        # reads its part's first samples in order); one prefix of a split's own paths is that split's dataset, N
        # samples, weight or not, as is one prefix without a weight. Prefixes without weights are built for one
        # epoch each (their weights), as Megatron's, where N fits in it; past it, beyond what Megatron does, for N.
        weighted = (len(live) > 1 or any(w is not None for w, _, _ in blend)) and not (
            source.per_split is not None and len(blend) == 1
        )
        by_size = all(w is None for w, _, _ in blend)  # (no weights given)
        one_epoch = by_size and num_samples[s] <= sum(w for w, *_ in live)
        shares = normalize([w for w, *_ in live]) if live else []
        parts = []
        for (w, indexed, cache_dir, doc_range), share in zip(live, shares):
            if full:
                n = w
            elif not weighted:
                n = num_samples[s]
            elif one_epoch:
                n = w
            else:
                n = math.ceil(math.ceil(num_samples[s] * share) * (1 + data.mid_level_dataset_surplus))
            parts.append(
                GPTDataset(
                    indexed,
                    doc_range,
                    n,
                    seq_length,
                    seed,  # (every split's, as Megatron's random_seed)
                    cache_dir,
                    source.tokenizer.eod,
                    eod_mask,
                    data.reset_position_ids,
                    data.reset_attention_mask,
                    ("train", "validation", "test")[s],
                    log,
                    flags[s] if source.per_split is not None else "--data-path",
                    getattr(source.tokenizer, "pad", None),
                )
            )
        if full and data.multiple_validation_sets:
            out.append(parts)  # (each set alone, in --valid-data-path's order)
        elif not parts:
            out.append(None)
        elif full and len(parts) > 1:  # every sample of every part once (Megatron's exhaustive blend)
            out.append(BlendedDataset(parts, [w for w, *_ in live], sum(w for w, *_ in live), live[0][2], log, True))
        elif len(parts) == 1:
            out.append(parts[0])
        else:
            # Megatron's builder normalises given weights before its BlendedDataset normalises them again ("redundant
            # normalization for bitwise identical comparison"): the second pass moves their last bits, and with them
            # which dataset wins a tie (once only, 278 of a 0.6/0.3/0.1 blend's first 2000 samples came from another
            # dataset). Weights by size (no weights given) reach it as they are, normalised once.
            weights = [w for w, *_ in live] if by_size else shares
            out.append(BlendedDataset(parts, weights, num_samples[s], live[0][2], log))
    return tuple(out)


def _one_epoch(indexed: IndexedDataset, doc_range: tuple[int, int], seq_length: int, flag: str) -> int:
    """The samples one epoch of these documents holds (seq_length + 1 tokens each, overlapping by one); none is
    refused: a validation set that --full-validation could not read once would be left out without a word."""
    lo, hi = doc_range
    n = max(int(indexed.lengths[lo:hi].sum()) - 1, 0) // seq_length
    if n == 0:
        raise ConfigError(
            f"--full-validation: {flag} {indexed.prefix}'s validation documents hold fewer than --seq-length "
            f"{seq_length} + 1 tokens, not one sample; give it more data (or a larger validation --split)"
        )
    return n
