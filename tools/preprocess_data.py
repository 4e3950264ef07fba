#!/usr/bin/env python
"""Turn JSONL or text files into a Megatron-style indexed dataset (PREFIX_{key}_document.bin/.idx).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json --append-eod --workers 8

--input takes JSONL files (one document per line, text under --json-keys) or, with --text-files, plain
text files (one document per file); several files or a glob may be given. Flags follow Megatron-LM's
tools/preprocess_data.py; the output trains under megatron_lite and Megatron-LM alike.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import zlib

from megatron_lite.config import ConfigError
from megatron_lite.data.config import TOKENIZER_TYPES, tokenizer_type_flag
from megatron_lite.data.indexed import IndexedDatasetWriter
from megatron_lite.data.tokenizers import tokenizer_from_flags
from megatron_lite.flag_parser import OneLineErrorParser
from megatron_lite.training.configs import check_output_path

_TOK = None
_ARGS = None


def _init(args: argparse.Namespace) -> None:
    global _TOK, _ARGS
    _ARGS = args
    _TOK = tokenizer_from_flags(args)


def _encode(item: tuple[str, str, str]) -> tuple[dict | None, int, str | None]:
    """(each key's (token ids, sentence lengths), bytes read, None), or (None, 0, "file:line: what went wrong"):
    the main process reports it in input order (a worker's exception surfaced at the first document of its
    chunk)."""
    where, kind, payload = item
    if kind == "error":
        return None, 0, f"{where}: {payload}"
    try:
        return _encode_document(kind, payload), len(payload.encode("utf-8")), None
    except (KeyError, TypeError, ValueError, UnicodeError) as e:
        return None, 0, f"{where}: {_explain(e)}"


def _explain(e: Exception) -> str:
    if isinstance(e, KeyError):
        return f"no key {e} in the document (check --json-keys)"
    if isinstance(e, json.JSONDecodeError):
        return f"not a JSON object ({e})"
    if isinstance(e, UnicodeEncodeError):  # json.loads takes an escaped lone surrogate ("\\ud83d") as text
        return f"the text is not valid Unicode ({e.reason}: {e.object[e.start : e.end]!r}); fix the document"
    return f"{type(e).__name__}: {e}"  # the tokenizer's (NullTokenizer: text that is not ids of the vocabulary)


def _encode_document(kind: str, payload: str) -> dict[str, tuple[list[int], list[int]]]:
    """Each key's (token ids, sentence lengths), as Megatron's Encoder.encode: a list-valued text is the
    document's sentences, one sequence each; empty sentences are dropped; an empty document gets no EOD and
    writes no sequence."""
    if kind == "text":
        texts = {"text": payload}
    else:
        doc = json.loads(payload)
        if not isinstance(doc, dict):
            raise TypeError(f"the line holds a JSON {type(doc).__name__}, expected an object")
        texts = {k: doc[k] for k in _ARGS.json_keys}
    out = {}
    for key, text in texts.items():
        ids: list[int] = []
        lens: list[int] = []
        for sentence in text if isinstance(text, list) else [text]:
            if not isinstance(sentence, str):
                raise TypeError(f'"{key}" holds {type(sentence).__name__}, expected a string or a list of strings')
            if not getattr(_TOK, "takes_lone_surrogates", False):  # (TikTokenizer: tiktoken replaces them)
                sentence.encode("utf-8")  # (raises on a lone surrogate, which the tokenizer reports as a TypeError)
            sentence_ids = _TOK.encode(sentence)
            if sentence_ids:
                ids.extend(sentence_ids)
                lens.append(len(sentence_ids))
        if ids and _ARGS.append_eod:
            ids.append(_TOK.eod)
            lens[-1] += 1
        out[key] = (ids, lens)
    return out


def _items(args: argparse.Namespace):
    """(where, kind, payload) per document. JSONL lines are decoded one by one, so text that is not UTF-8 is
    reported at its own line and column. With --partitions P (without --keep-sequential-samples) in Megatron's
    order: it deals the input lines round-robin into P files (line i of them all, blank ones counted, into
    partition i % P) and concatenates their outputs; here P passes over the inputs, pass k keeping lines k + jP
    (so a malformed line is found in that order too: the first in a later partition after an earlier one's)."""
    passes = 1 if args.keep_sequential_samples or args.text_files else max(1, args.partitions)
    for k in range(passes):
        line = 0
        for path in args.files:
            try:
                for item in _file_items(args, path):
                    line += item[1] != "error"
                    if item[1] == "error" or ((line - 1) % passes == k and item[1] != "blank"):
                        yield item
            except (OSError, EOFError, zlib.error) as e:  # (a damaged or truncated .gz)
                yield path, "error", f"cannot be read: {e}"
                return


def _file_items(args: argparse.Namespace, path: str):
    """One file's items (gzipped where its name ends in .gz)."""
    opener = gzip.open if path.endswith(".gz") else open  # (Megatron's reads gzipped JSONL too)
    if args.text_files:
        with opener(path, "rb") as f:
            raw = f.read()
        try:  # (bytes that are not UTF-8 became U+FFFD without a word, and a BOM was tokenized as text)
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            line = raw.count(b"\n", 0, e.start) + 1
            column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
            why = f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {column}); convert the file to UTF-8"
            yield f"{path}:{line}", "error", why
            return
        yield path, "text", text
        return
    with opener(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                # an item like any document's, so errors are reported in the order documents are (as the first)
                why = f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); convert the file to UTF-8"
                yield f"{path}:{n}", "error", why
                return
            yield f"{path}:{n}", "json" if line.strip() else "blank", line


def _stop_on_sigterm(signum, frame) -> None:
    print("stopped by SIGTERM: the partial output is removed", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input")
    g.add_argument("--input", nargs="+", required=True, help="files or globs")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="the JSON keys tokenized, one dataset each")
    g.add_argument("--text-files", action="store_true", help="inputs are plain text, one document per file")
    g.add_argument(
        "--split-sentences",
        action="store_true",
        help="Megatron's NLTK sentence split: not here (give a JSON list of sentences: one sequence each)",
    )
    g.add_argument("--keep-newlines", action="store_true", help="with --split-sentences (Megatron's)")
    g.add_argument("--lang", help="with --split-sentences (Megatron's)")
    g.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="documents in Megatron's order for that many partitions (its input lines dealt round-robin; "
        "--workers parallelises here)",
    )
    g.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="with --partitions: documents keep the input order (Megatron's contiguous partitions)",
    )
    g = p.add_argument_group("tokenizer")
    g.add_argument(
        "--tokenizer-type",
        required=True,
        type=tokenizer_type_flag,
        metavar="{" + ",".join(TOKENIZER_TYPES) + "}",
        help="Megatron's tokenizer names",
    )
    g.add_argument(
        "--tokenizer-model",
        help="a tokenizer.json, or a model directory holding one (its eos from special_tokens_map.json or "
        "tokenizer_config.json); Llama2Tokenizer / GPTSentencePieceTokenizer: a tokenizer.model with its "
        "tokenizer.json beside it",
    )
    g.add_argument("--vocab-file", help="GPT2BPETokenizer's vocab.json")
    g.add_argument("--merge-file", help="GPT2BPETokenizer's merges.txt")
    g.add_argument(
        "--vocab-size", type=int, help="NullTokenizer's vocabulary (its end-of-document id); TikTokenizer's (2^17)"
    )
    g.add_argument("--tiktoken-pattern", choices=["v1", "v2"], help="TikTokenizer: Megatron's split into words")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000, help="TikTokenizer: ids 0..N-1")
    g.add_argument(
        "--tiktoken-special-tokens", nargs="+", help="TikTokenizer, --legacy-tokenizer: default <unk> <s> </s>"
    )
    g.add_argument(
        "--tokenizer-special-tokens", nargs="+", help="TikTokenizer: default <unk> <s> </s> <mask> <pad> ..."
    )
    g.add_argument("--legacy-tokenizer", action="store_true", help="TikTokenizer as Megatron's CustomTikTokenizer")
    g.add_argument("--append-eod", action="store_true", help="end each document with the end-of-document token")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin and .idx")
    g.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    args = p.parse_args(argv)
    try:
        # (--keep-newlines and --lang only shape Megatron's split: without it they do nothing there, and its
        # scripts pass --lang english, its default, anyway)
        if args.split_sentences:
            flag = "--split-sentences"
            raise ConfigError(
                f"{flag}: Megatron's NLTK sentence split is not implemented here; split the text yourself and give "
                'each document\'s sentences as a JSON list ({"text": ["First.", "Second."]}): one sequence each, in '
                "PREFIX_text_document (Megatron names its split output PREFIX_text_sentence)"
            )
        if args.partitions < 1:
            raise ConfigError(f"--partitions {args.partitions} must be >= 1")
        if args.workers < 1:  # (a negative count was taken as one)
            raise ConfigError(f"--workers {args.workers} must be >= 1 (tokenising processes)")
        if args.output_prefix.endswith(("/", os.sep)):  # (it wrote DIR/_text_document.bin)
            raise ConfigError(
                f"--output-prefix {args.output_prefix} ends in a directory separator: give a file name prefix, "
                f"e.g. {os.path.join(args.output_prefix, 'corpus')} (the files are PREFIX_text_document.bin/.idx)"
            )
        if args.log_interval < 1:  # (0 was a ZeroDivisionError traceback at the first document)
            raise ConfigError(f"--log-interval {args.log_interval} must be >= 1 (documents between progress lines)")
        if args.partitions > 1 and not args.keep_sequential_samples and not args.text_files:
            print(
                f"note: --partitions {args.partitions}: documents in Megatron's order (its input lines dealt "
                f"round-robin into {args.partitions} partitions, written one partition after another); "
                "--keep-sequential-samples keeps the input order"
            )
        # the files in the order given (a glob's own matches sorted): it decides which documents --split makes
        # validation and test; a file given twice is read once
        matches = [f for pattern in args.input for f in (sorted(glob.glob(pattern)) or [pattern])]
        args.files = list(dict.fromkeys(matches))
        if len(args.files) < len(matches):
            print(f"note: --input names {len(matches) - len(args.files)} file(s) more than once: each read once")
        for f in args.files:
            if not os.path.isfile(f):
                raise ConfigError(f"--input {f}: no such file")
        keys = ["text"] if args.text_files else args.json_keys
        for k in keys:  # (before any tokenising)
            check_output_path("--output-prefix", f"{args.output_prefix}_{k}_document.bin")
        _init(args)
        writers = {}
        for k in keys:
            try:
                writers[k] = IndexedDatasetWriter(f"{args.output_prefix}_{k}_document", _TOK.vocab_size)
            except OSError as e:  # (what os.access cannot tell: a read-only mount, /proc)
                raise ConfigError(
                    f"--output-prefix {args.output_prefix}: cannot write {args.output_prefix}_{k}_document.bin "
                    f"({e.strerror}); choose a writable directory"
                ) from None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for w in writers.values():
        for path in w.removed_stale:
            print(f"removed {path}, left by an earlier run that was killed", file=sys.stderr)
    # SIGTERM (a scheduler's time limit) stops like Ctrl-C: the partial output is removed, the workers stopped
    # (the default action left a file as large as the output so far and the pool's semaphores)
    # (only the main thread may set it: main() called from another thread raised, its .partial files left)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm) if main_thread else None
    try:
        return _write(args, writers)
    finally:
        if main_thread:  # (main() called in-process leaves its caller's handler)
            signal.signal(signal.SIGTERM, previous)


def _write(args: argparse.Namespace, writers: dict) -> int:
    """Tokenize every input into `writers`, then finalize them: 0, or 2 on an input's error (nothing written)."""
    start, docs, nbytes = time.time(), 0, 0
    pool = mp.get_context("spawn").Pool(args.workers, initializer=_init, initargs=(args,)) if args.workers > 1 else None
    finished = False
    try:
        results = pool.imap(_encode, _items(args), chunksize=64) if pool else map(_encode, _items(args))
        for encoded, size, error in results:
            if error is not None:
                print(f"error: {error}", file=sys.stderr)
                return 2
            for key, (ids, lens) in encoded.items():
                writers[key].add_document(ids, lens)
            docs += 1
            nbytes += size
            if docs % args.log_interval == 0:
                dt = time.time() - start
                print(
                    f"processed {docs} documents ({docs / dt:.0f} docs/s, {nbytes / dt / 1e6:.2f} MB/s)",
                    file=sys.stderr,
                    flush=True,
                )
        finished = True
    except ConfigError as e:  # (the input's, raised while reading it)
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if pool:  # on an error, stop the workers now: they would tokenize the rest of the corpus first
            if finished:
                pool.close()
            else:
                pool.terminate()
            pool.join()
        if not finished:  # (no half-written .partial files left beside the output)
            for w in writers.values():
                w.discard()
    try:  # (a signal during the final fsync, minutes on a large output: what is not yet in place goes too)
        for key, w in writers.items():
            w.finalize()
            print(f"wrote {args.output_prefix}_{key}_document.bin/.idx: {docs} documents", file=sys.stderr)
    except BaseException:
        for w in writers.values():
            w.discard()
        raise
    if docs == 0:  # (training refuses an empty dataset: better said here, where the input is named)
        print(f"warning: --input {' '.join(args.files)} held no documents: the dataset written is empty",
              file=sys.stderr)  # fmt: skip
    print(f"done in {time.time() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
