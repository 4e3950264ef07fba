"""The data flags (Megatron's names and defaults): where samples come from, how they are tokenized, and which
validation the job runs. flag_parser.build_parser adds them as its "data" and "validation" groups."""

from __future__ import annotations

import argparse

from megatron_lite.data.config import TOKENIZER_TYPES, tokenizer_type_flag


def _bool(p: argparse._ArgumentGroup, flag: str, help: str) -> None:
    p.add_argument(flag, action="store_true", help=help)


def add_data_flags(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument_group("data")
    a.add_argument(
        "--data-path",
        nargs="+",
        help="PREFIX, W1 PREFIX1 W2 PREFIX2 ..., or PREFIX1 PREFIX2 ... (weighted by size); default: embedded corpus",
    )
    for split in ("train", "valid", "test"):
        a.add_argument(
            f"--{split}-data-path",
            nargs="+",
            help=f"the {split} split's own datasets (as --data-path), used whole; instead of --data-path and --split",
        )
    a.add_argument("--data-args-path", help="a file holding the --data-path words (for blends too long to type)")
    a.add_argument(
        "--per-split-data-args-path",
        help='a JSON file {"train": [...], "valid": [...], "test": [...]}: the --{train,valid,test}-data-path words',
    )
    a.add_argument("--split", default="969,30,1")
    a.add_argument(
        "--mid-level-dataset-surplus",
        type=float,
        default=0.005,
        help="a weighted blend builds each dataset for this share more samples than it draws from it",
    )
    _bool(a, "--mock-data", "synthetic tokens (needs --vocab-size)")
    a.add_argument("--tokenizer-type", type=tokenizer_type_flag, metavar="{" + ",".join(TOKENIZER_TYPES) + "}")
    a.add_argument(
        "--tokenizer-model",
        help="tokenizer.json for HuggingFaceTokenizer; for Llama2Tokenizer / GPTSentencePieceTokenizer the "
        "tokenizer.model (the tokenizer.json beside it is read) or that tokenizer.json",
    )
    a.add_argument("--vocab-file")
    a.add_argument("--merge-file")
    a.add_argument("--vocab-size", type=int)
    a.add_argument(
        "--tiktoken-pattern",
        choices=["v1", "v2"],
        help="TikTokenizer (--tokenizer-model: a tiktoken JSON rank list): Megatron's split of text into words",
    )
    a.add_argument(
        "--tiktoken-num-special-tokens",
        type=int,
        default=1000,
        help="TikTokenizer: ids 0..N-1 are special tokens, the ranks follow",
    )
    a.add_argument(
        "--tiktoken-special-tokens",
        nargs="+",
        help="TikTokenizer with --legacy-tokenizer: the first special tokens (default <unk> <s> </s>)",
    )
    a.add_argument(
        "--tokenizer-special-tokens",
        nargs="+",
        help="TikTokenizer: the first special tokens (default <unk> <s> </s> <mask> <pad> <cls> <sep>; </s> ends "
        "documents)",
    )
    _bool(a, "--legacy-tokenizer", "TikTokenizer as Megatron's CustomTikTokenizer (special tokens in text are text)")
    a.add_argument("--data-cache-path")
    a.add_argument("--num-workers", type=int, default=0)
    _bool(a, "--eod-mask-loss", "no loss on end-of-document tokens")
    a.add_argument(
        "--dataloader-type",
        choices=["single", "cyclic", "external"],
        help="single (the default) and cyclic read the dataset's own seeded shuffle in order; external is refused",
    )
    _bool(a, "--reset-position-ids", "positions restart at 0 after each end-of-document token")
    _bool(
        a,
        "--reset-attention-mask",
        "tokens attend only within their own document (the flash kernel skips other documents' blocks; "
        "--kernel-impl torch: SDPA with a [batch, 1, seq, seq] mask)",
    )
    _bool(
        a,
        "--sft",
        "--data-path (divided by --split) or --train/valid/test-data-path are JSONL files of {prompt, response} "
        "records (TRL's completion for response); loss on the responses only",
    )

    v = parser.add_argument_group("validation")
    _bool(v, "--full-validation", "each evaluation covers the whole validation split once (not --eval-iters batches)")
    _bool(
        v,
        "--multiple-validation-sets",
        "with --full-validation: each --valid-data-path prefix (no weights) is a validation set of its own, "
        "logged with its own loss (validation-0, validation-1, ...)",
    )
