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
import json
import multiprocessing as mp
import os
import sys
import time

from megatron_lite.config import ConfigError
from megatron_lite.data.config import TOKENIZER_TYPES
from megatron_lite.data.indexed import IndexedDatasetWriter
from megatron_lite.data.tokenizers import tokenizer_from_flags
from megatron_lite.flag_parser import OneLineErrorParser

_TOK = None
_ARGS = None


def _init(args: argparse.Namespace) -> None:
    global _TOK, _ARGS
    _ARGS = args
    _TOK = tokenizer_from_flags(args)


def _encode(item: tuple[str, str]) -> tuple[dict[str, tuple[list[int], list[int]]], int]:
    """Each key's (token ids, sentence lengths), as Megatron's Encoder.encode: a list-valued text is the
    document's sentences, one sequence each; empty sentences are dropped; an empty document gets no EOD and
    writes no sequence."""
    kind, payload = item
    if kind == "text":
        texts = {"text": payload}
    else:
        doc = json.loads(payload)
        texts = {k: doc[k] for k in _ARGS.json_keys}
    out = {}
    for key, text in texts.items():
        ids: list[int] = []
        lens: list[int] = []
        for sentence in text if isinstance(text, list) else [text]:
            if not isinstance(sentence, str):
                raise TypeError(f'"{key}" holds {type(sentence).__name__}, expected a string or a list of strings')
            sentence_ids = _TOK.encode(sentence)
            if sentence_ids:
                ids.extend(sentence_ids)
                lens.append(len(sentence_ids))
        if ids and _ARGS.append_eod:
            ids.append(_TOK.eod)
            lens[-1] += 1
        out[key] = (ids, lens)
    return out, len(payload.encode("utf-8"))


def _items(args: argparse.Namespace):
    for path in args.files:
        if args.text_files:
            yield "text", open(path, encoding="utf-8", errors="replace").read()
        else:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        yield "json", line


def main(argv: list[str] | None = None) -> int:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input")
    g.add_argument("--input", nargs="+", required=True, help="files or globs")
    g.add_argument("--json-keys", nargs="+", default=["text"])
    g.add_argument("--text-files", action="store_true", help="inputs are plain text, one document per file")
    g = p.add_argument_group("tokenizer")
    g.add_argument(
        "--tokenizer-type",
        required=True,
        choices=list(TOKENIZER_TYPES),
    )
    g.add_argument("--tokenizer-model")
    g.add_argument("--vocab-file")
    g.add_argument("--merge-file")
    g.add_argument("--vocab-size", type=int)
    g.add_argument("--append-eod", action="store_true")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True)
    g.add_argument("--workers", type=int, default=1)
    g.add_argument("--log-interval", type=int, default=1000)
    args = p.parse_args(argv)
    try:
        args.files = sorted({f for pattern in args.input for f in (glob.glob(pattern) or [pattern])})
        for f in args.files:
            if not os.path.isfile(f):
                raise ConfigError(f"--input {f}: no such file")
        _init(args)
        writers = {
            k: IndexedDatasetWriter(f"{args.output_prefix}_{k}_document", _TOK.vocab_size)
            for k in (["text"] if args.text_files else args.json_keys)
        }
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start, docs, nbytes = time.time(), 0, 0
    pool = mp.get_context("spawn").Pool(args.workers, initializer=_init, initargs=(args,)) if args.workers > 1 else None
    try:
        results = pool.imap(_encode, _items(args), chunksize=64) if pool else map(_encode, _items(args))
        for encoded, size in results:
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
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        print(f"error: input document {docs + 1}: {type(e).__name__}: {e} (check --json-keys)", file=sys.stderr)
        return 2
    except UnicodeDecodeError as e:  # (read in this process: the document number is the last one read)
        print(f"error: input after document {docs}: not UTF-8 ({e}); convert the file to UTF-8", file=sys.stderr)
        return 2
    except ValueError as e:  # the tokenizer's (NullTokenizer: text that is not ids of the vocabulary)
        print(f"error: input document {docs + 1}: {e}", file=sys.stderr)
        return 2
    finally:
        if pool:
            pool.close()
            pool.join()
    for key, w in writers.items():
        w.finalize()
        print(f"wrote {args.output_prefix}_{key}_document.bin/.idx: {docs} documents", file=sys.stderr)
    print(f"done in {time.time() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
