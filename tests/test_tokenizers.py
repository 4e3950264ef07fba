"""Tokenizers as Megatron-LM builds them for the same flags and files (from a review of 2026-12-04): the
vocabulary a SentencePiece model has, the end-of-document token transformers adds where the tokenizer.json lacks
the configured eos, and GPT-2's merges file read as Megatron (and transformers) read it."""

from __future__ import annotations

import json
import re

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors

from megatron_lite.data.tokenizers import build_tokenizer


def _sentencepiece_json(path, extra: str | None = None) -> int:
    """A Llama-2-style tokenizer.json (BPE over SentencePiece pieces, <s> before each text); `extra`: a token
    added beside the pieces, as a fine-tune's <pad>. Returns the number of pieces."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: 3 + i for i, c in enumerate("▁abcdefgh")}}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    pieces = tok.get_vocab_size(with_added_tokens=False)
    if extra:
        tok.add_special_tokens([AddedToken(extra, normalized=False, special=True)])
    tok.save(str(path))
    return pieces


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "GPTSentencePieceTokenizer"])
def test_a_sentencepiece_vocabulary_is_its_pieces(tmp_path, kind):
    """Megatron's vocabulary for these types is the SentencePiece model's piece count; the tokenizer.json's added
    <pad> beside the pieces made it one larger (Llama-2's 32001, padded to 32128 instead of 32000)."""
    pieces = _sentencepiece_json(tmp_path / "tokenizer.json", extra="<pad>")
    tok = build_tokenizer(kind, model=str(tmp_path / "tokenizer.json"))
    assert tok.vocab_size == pieces == 12 and tok.eod == 2


def test_a_configured_eos_missing_from_the_tokenizer_is_added_as_transformers_adds_it(tmp_path):
    """tokenizer_config.json names an eos_token the tokenizer.json lacks: transformers adds it as the next id (so
    Megatron's HuggingFaceTokenizer ends documents with it, one token more in the vocabulary); ours fell back to
    another end token silently. Checked against transformers itself."""
    transformers = pytest.importorskip("transformers")
    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{c: 2 + i for i, c in enumerate("abcdefgh ")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens([AddedToken("<unk>", special=True), AddedToken("<|endoftext|>", special=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "unk_token": "<unk>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = build_tokenizer("HuggingFaceTokenizer", model=str(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert (ours.vocab_size, ours.eod) == (len(theirs), theirs.eos_token_id) == (12, 11)
    assert ours.encode("abc<|im_end|>") == theirs("abc<|im_end|>")["input_ids"]


@pytest.mark.parametrize("trailing_newline", [True, False])
def test_gpt2_merges_are_read_as_megatron_reads_them(tmp_path, trailing_newline):
    """Megatron's (and transformers') GPT-2 tokenizer reads merges.txt as read().split("\\n")[1:-1]: the version
    line off the top, and the last line off the end, which is the final merge itself in a file without a trailing
    newline. Ours kept it: other ids for any text that merge applies to."""
    vocab = {"<|endoftext|>": 0, **{c: 1 + i for i, c in enumerate("abcd")}, "ab": 5, "abc": 6}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    merges = "#version: 0.2\na b\nab c" + ("\n" if trailing_newline else "")
    (tmp_path / "merges.txt").write_text(merges)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                          merge_file=str(tmp_path / "merges.txt"))  # fmt: skip
    # with the newline both merges apply (abc); without it Megatron drops "ab c": ab, c
    assert tok.encode("abc") == ([6] if trailing_newline else [5, 3])


def test_gpt2_files_swapped_or_mismatched_are_one_line_errors(tmp_path):
    """An exploratory run's finding: --vocab-file and --merge-file given the wrong way round, or a merges.txt whose
    merge the vocab.json lacks, were a JSONDecodeError and a tokenizers exception, tracebacks at start-up."""
    from megatron_lite.config import ConfigError

    (tmp_path / "vocab.json").write_text(json.dumps({"<|endoftext|>": 0, "a": 1, "b": 2}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    vocab, merges = str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")
    cases = [
        (dict(vocab_file=merges, merge_file=vocab), f"--vocab-file {merges} is not GPT-2's vocab.json: "),
        (dict(vocab_file=vocab, merge_file=merges), f"--vocab-file {vocab} and --merge-file {merges} do not belong"),
    ]
    for files, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            build_tokenizer("GPT2BPETokenizer", **files)


def test_a_sentencepiece_tokenizer_reads_tokens_beside_its_pieces_as_text(tmp_path):
    """From the review of the change above: a non-special token added beside the pieces (a ChatML fine-tune's
    <|im_start|>) was still matched in text, an id past the (pieces-only) vocabulary; and a configured eos that no
    piece holds, without a </s>, left the end-of-document id past it. The first is read as SentencePiece reads
    text; the second is one line."""
    pieces = _sentencepiece_json(tmp_path / "tokenizer.json")
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["added_tokens"].append({"id": pieces, "content": "ab", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": False})  # fmt: skip
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = build_tokenizer("GPTSentencePieceTokenizer", model=str(tmp_path / "tokenizer.json"))
    ids = tok.encode("cab d")
    assert tok.vocab_size == pieces and max(ids) < pieces, ids
    # no </s> among the pieces, and an eos_token the file lacks
    spec["model"]["vocab"] = {("<eos>" if k == "</s>" else k): v for k, v in spec["model"]["vocab"].items()}
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in ("</s>", "ab")]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(Exception, match="not among the SentencePiece model's 12 pieces"):
        build_tokenizer("Llama2Tokenizer", model=str(tmp_path / "tokenizer.json"))


def test_a_gpt2_tokenizer_without_its_vocab_file_says_it_is_not_given():
    """From a failure review: the message read "--vocab-file None: no such file"."""
    from megatron_lite.config import ConfigError
    from megatron_lite.data.tokenizers import GPT2BPETokenizer

    with pytest.raises(ConfigError, match="^GPT2BPETokenizer needs --vocab-file and --merge-file: --vocab-file is not"):
        GPT2BPETokenizer(None, None)


@pytest.mark.parametrize("pad", [None, "<pad>", "<|endoftext|>"])
def test_the_pad_id_is_transformers_pad_token_id_unless_it_is_the_eod(tmp_path, pad):
    """Megatron's HuggingFaceTokenizer.pad is transformers' pad_token_id, and its GPTDataset drops the loss on that
    label (tests/test_data_gpt_dataset.py -k pad_id) unless it is the eos/eod (MegatronDataset: a pad id among the
    special tokens is not used). Ours had no pad. A SentencePiece-family tokenizer's pad is the .model's pad_id
    (-1 for Llama's and Mistral's), whatever tokenizer_config.json says: none."""
    transformers = pytest.importorskip("transformers")
    vocab = {"<unk>": 0, "<|endoftext|>": 1, "<pad>": 2, **{c: 3 + i for i, c in enumerate("abc ")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<|endoftext|>", "<pad>")])
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "unk_token": "<unk>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **({"pad_token": pad} if pad else {})}))
    ours = build_tokenizer("HuggingFaceTokenizer", model=str(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert theirs.pad_token_id == {None: None, "<pad>": 2, "<|endoftext|>": 1}[pad]
    assert ours.pad == (2 if pad == "<pad>" else None)  # (the eod's id as pad: not used)
    _sentencepiece_json(tmp_path / "tokenizer.json", extra="<pad>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<unk>"}))
    assert build_tokenizer("Llama2Tokenizer", model=str(tmp_path / "tokenizer.json")).pad is None
