"""Data settings: where samples come from and how they are tokenized."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field

from megatron_lite.config import ConfigError

TOKENIZER_TYPES = (
    "NullTokenizer",
    "HuggingFaceTokenizer",
    "ByteLevelTokenizer",
    "GPT2BPETokenizer",
    "Llama2Tokenizer",  # read through the tokenizer.json beside its tokenizer.model (data/tokenizers.py)
    "GPTSentencePieceTokenizer",
    "TikTokenizer",  # a tiktoken JSON rank list, read without tiktoken (data/tiktokenizer.py)
)
# The settings that make a tokenizer (as a checkpoint records them, and generate.py reads them back)
TOKENIZER_FIELDS = (
    "tokenizer_type",
    "tokenizer_model",
    "vocab_file",
    "merge_file",
    "vocab_size",
    "tiktoken_pattern",
    "tiktoken_num_special_tokens",
    "tiktoken_special_tokens",
    "tokenizer_special_tokens",
    "legacy_tokenizer",
)


# Megatron's other --tokenizer-type values, each with why it is not taken and what to use
UNSUPPORTED_TOKENIZERS = {
    "SentencePieceTokenizer": "megatron_lite reads no SentencePiece .model files; use HuggingFaceTokenizer with the "
    "tokenizer.json converted from it (GPTSentencePieceTokenizer and Llama2Tokenizer read that one too)",
    "BertWordPieceLowerCase": "BERT's tokenizers are for BERT models, which megatron_lite does not train",
    "BertWordPieceCase": "BERT's tokenizers are for BERT models, which megatron_lite does not train",
    "MultimodalTokenizer": "multimodal models are not supported",
    "NullMultimodalTokenizer": "multimodal models are not supported",
    "SFTTokenizer": "use --sft with HuggingFaceTokenizer: prompt/response JSONL records, or Megatron's "
    '"messages" conversations rendered by the chat template beside the tokenizer (Megatron\'s built-in Nemotron '
    "prompt formats are not applied)",
}


def tokenizer_type_flag(value: str) -> str:
    """argparse type of --tokenizer-type: one of ours, else one line saying why not."""
    if value in TOKENIZER_TYPES:
        return value
    why = UNSUPPORTED_TOKENIZERS.get(value, f"not a tokenizer type; choose from {', '.join(TOKENIZER_TYPES)}")
    raise argparse.ArgumentTypeError(f"{value}: {why}")


def _split_weights(split: str) -> list[float]:
    """--split's weights ("969,30,1", "969/30/1" or "98 2 0": Megatron reads only the numbers out of the string).
    Quotes around the whole are dropped: Megatron's example scripts put `--split '99,1,0'` in a bash array
    expanded unquoted, which hands the quotes over too."""
    return [float(x) for x in re.split(r"[,/\s]+", split.strip().strip("'\"")) if x]


@dataclass(frozen=True)
class DataConfig:
    # Megatron's --data-path: "PREFIX", "W1 PREFIX1 W2 PREFIX2 ..." (weights need not sum to 1), or
    # "PREFIX1 PREFIX2 ..." (blended in proportion to their sizes).
    data_path: tuple[str, ...] = field(default_factory=tuple)
    # Megatron's --train-data-path / --valid-data-path / --test-data-path: each split from datasets of its own
    # (same syntax as --data-path), used whole; instead of --data-path and --split
    train_data_path: tuple[str, ...] = field(default_factory=tuple)
    valid_data_path: tuple[str, ...] = field(default_factory=tuple)
    test_data_path: tuple[str, ...] = field(default_factory=tuple)
    split: str = "969,30,1"
    mock_data: bool = False
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None  # a tokenizer.json (HuggingFaceTokenizer)
    vocab_file: str | None = None  # GPT2BPETokenizer
    merge_file: str | None = None
    vocab_size: int | None = None  # NullTokenizer / --mock-data; TikTokenizer's vocabulary (2^17 if not given)
    # TikTokenizer (Megatron's flags): the v1 or v2 split of text into words (required, as in Megatron), the
    # special tokens at ids 0..N-1 (<unk> <s> </s> by default, then <SPECIAL_i> fillers up to N)
    tiktoken_pattern: str | None = None
    tiktoken_num_special_tokens: int = 1000
    tiktoken_special_tokens: tuple[str, ...] | None = None
    # Megatron's --tokenizer-special-tokens (TikTokenizer's special tokens, without --legacy-tokenizer) and
    # --legacy-tokenizer (its older CustomTikTokenizer: data/tiktokenizer.py)
    tokenizer_special_tokens: tuple[str, ...] | None = None
    legacy_tokenizer: bool = False
    data_cache_path: str | None = None
    mid_level_dataset_surplus: float = 0.005  # (Megatron's: each part of a weighted blend is built this much larger)
    num_workers: int = 0
    eod_mask_loss: bool = False
    # Megatron's document flags: positions restart after each end-of-document token, and attention stays
    # inside each document (data/documents.py)
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    # --data-path (or --train/valid/test-data-path) are JSONL files of prompt/response records (loss on responses
    # only), divided by --split as Megatron's builder divides documents (data/sft.py)
    sft: bool = False
    # Megatron's --full-validation: each evaluation reads every sample of the validation split once (one epoch of
    # each of its datasets), not --eval-iters global batches; --multiple-validation-sets: with it, each prefix of
    # --valid-data-path is a set of its own with its own loss (data/validation_sets.py)
    full_validation: bool = False
    multiple_validation_sets: bool = False

    def __post_init__(self) -> None:
        if self.tokenizer_special_tokens and self.tokenizer_type != "TikTokenizer":
            raise ConfigError(
                "--tokenizer-special-tokens is taken with --tokenizer-type TikTokenizer only (adding special tokens "
                f"to {self.tokenizer_type or 'the tokenizer'} is not implemented: add them to its tokenizer.json)"
            )
        if self.tokenizer_type is not None and self.tokenizer_type not in TOKENIZER_TYPES:
            raise ConfigError(
                f"--tokenizer-type {self.tokenizer_type} is not supported; use one of {', '.join(TOKENIZER_TYPES)}"
            )
        if self.mock_data and self.data_path:
            raise ConfigError("--mock-data and --data-path are exclusive; drop one")
        if self.num_workers < 0:
            raise ConfigError(f"--num-workers {self.num_workers} must be >= 0 (0 loads in the training process)")
        if not self.mid_level_dataset_surplus >= 0:
            raise ConfigError(
                f"--mid-level-dataset-surplus {self.mid_level_dataset_surplus} must be >= 0 (0.005 is 0.5%)"
            )
        try:
            weights = _split_weights(self.split)
        except ValueError:
            weights = []
        if not weights or len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ConfigError(f"--split {self.split!r} must be up to three non-negative weights, e.g. 969,30,1")
        if self.sft and self.mock_data:  # (it read no records: "the train split holds no documents")
            raise ConfigError("--sft reads JSONL prompt/response records (--data-path FILE); drop --mock-data")
        per_split = [f for f in ("train_data_path", "valid_data_path", "test_data_path") if getattr(self, f)]
        if per_split and (self.data_path or self.mock_data):
            other = "--data-path" if self.data_path else "--mock-data"
            raise ConfigError(
                f"--{per_split[0].replace('_', '-')} gives each split its own datasets; drop {other} (or use "
                "--data-path with --split)"
            )
        if per_split and not self.train_data_path:
            raise ConfigError(f"--{per_split[0].replace('_', '-')} needs --train-data-path too")
        self._check_validation_sets()
        for flag, paths in (
            ("--data-path", self.data_path),
            ("--train-data-path", self.train_data_path),
            ("--valid-data-path", self.valid_data_path),
            ("--test-data-path", self.test_data_path),
        ):
            _check_blend(flag, paths)

    def _check_validation_sets(self) -> None:
        """--full-validation needs a validation split of known size read once; --multiple-validation-sets needs
        --full-validation (Megatron raises NotImplementedError without it) and --valid-data-path prefixes."""
        if self.full_validation and (self.mock_data or self.sft):
            # (an --sft split's records repeat in epochs, a new order each: not a pass of known size, as Megatron's
            # SFTDataset, whose length is the samples asked for)
            why = "--mock-data's samples never end" if self.mock_data else "--sft's records repeat epoch after epoch"
            raise ConfigError(f"--full-validation reads the whole validation split once and {why}; drop it")
        # (one weighted prefix of a split's own paths is that split's dataset, whole: it has its pass)
        weighted = [
            (flag, paths)
            for flag, paths in (("--data-path", self.data_path), ("--valid-data-path", self.valid_data_path))
            if paths and _blend(paths)[0][0] is not None and (flag == "--data-path" or len(_blend(paths)) > 1)
        ]
        if self.full_validation and weighted:
            flag, paths = weighted[0]
            raise ConfigError(
                f"--full-validation with the weighted blend {flag} {' '.join(paths)}: a weighted blend has no one "
                "pass over its samples (Megatron's builder fails on it); give the validation prefixes without "
                "weights (blended by size), or drop --full-validation"
            )
        if not self.multiple_validation_sets:
            return
        if not self.full_validation:
            raise ConfigError(
                "--multiple-validation-sets needs --full-validation (as in Megatron: each set is evaluated whole)"
            )
        if not self.valid_data_path:
            raise ConfigError(
                "--multiple-validation-sets evaluates each prefix of --valid-data-path on its own: give "
                "--train-data-path and --valid-data-path P1 P2 ..."
            )

    @property
    def split_weights(self) -> tuple[float, float, float]:
        w = _split_weights(self.split)
        w += [0.0] * (3 - len(w))
        total = sum(w)
        return (w[0] / total, w[1] / total, w[2] / total)

    @property
    def blend(self) -> list[tuple[float | None, str]]:
        """(weight, prefix) pairs of --data-path; weight None: by size (prefixes given without weights)."""
        return _blend(self.data_path)

    @property
    def blend_per_split(self) -> tuple[list[tuple[float | None, str]], ...] | None:
        """(weight, prefix) pairs of --train/valid/test-data-path; None when --data-path and --split are used."""
        if not self.train_data_path:
            return None
        return tuple(_blend(p) for p in (self.train_data_path, self.valid_data_path, self.test_data_path))


def _number(token: str) -> float | None:
    try:
        return float(token)
    except ValueError:
        return None


def _blend(paths: tuple[str, ...]) -> list[tuple[float | None, str]]:
    """Megatron's get_blend_from_list: "W1 P1 W2 P2 ..." when every other item is a number, else prefixes only,
    whose weight None means: in proportion to their sizes."""
    weights = [_number(w) for w in paths[0::2]]
    if len(paths) % 2 or any(w is None for w in weights):
        return [(None, p) for p in paths]
    return [(float(w), p) for w, p in zip(weights, paths[1::2])]


def _check_blend(flag: str, paths: tuple[str, ...]) -> None:
    if len(paths) <= 1:
        return
    blend = _blend(paths)
    if blend[0][0] is None:
        # prefixes only; a number among them is a weight whose prefix (or the other weights) went missing
        stray = next((p for _, p in blend if _number(p) is not None), None)
        if stray is not None:
            raise ConfigError(
                f"{flag} {' '.join(paths)}: {stray!r} looks like a weight; give a weight before every prefix "
                "(W1 PREFIX1 W2 PREFIX2 ...) or prefixes only"
            )
        return
    for (w, _), raw in zip(blend, paths[0::2]):
        if not (0 <= w < math.inf):
            raise ConfigError(f"{flag} weight {raw!r} is not a non-negative number")
    if sum(w for w, _ in blend) <= 0:
        raise ConfigError(f"{flag} weights {' '.join(paths[0::2])} sum to 0; give at least one a positive weight")
