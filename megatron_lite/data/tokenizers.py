"""Tokenizers: a Hugging Face tokenizer.json (through the `tokenizers` library), Megatron's SentencePiece
tokenizers (Llama2Tokenizer, GPTSentencePieceTokenizer) through the tokenizer.json beside their .model, GPT-2
BPE from vocab.json + merges.txt, Megatron's TikTokenizer (data/tiktokenizer.py), a byte-level fallback, and
Megatron's NullTokenizer for --mock-data."""

from __future__ import annotations

import json
import os
import re

from megatron_lite.config import ConfigError

EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


class ByteLevelTokenizer:
    """UTF-8 bytes as tokens 0..255, end-of-document 256. Needs no files."""

    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class NullTokenizer:
    """Megatron's NullTokenizer: text is space-separated ids; the end-of-document id is vocab_size, so
    the model's vocabulary is --vocab-size + 1."""

    separate_texts = True  # (ids as text: "1 2" + "3" is not "1 2 3", so SFT encodes prompt and response apart)

    def __init__(self, vocab_size: int) -> None:
        self.eod = int(vocab_size)
        self.vocab_size = int(vocab_size) + 1

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError as e:
            raise ValueError(f"NullTokenizer reads space-separated token ids: {e}") from None
        if bad := [i for i in ids if not 0 <= i < self.vocab_size]:  # (the end-of-document id included)
            raise ValueError(f"NullTokenizer: token id {bad[0]} is outside --vocab-size {self.eod} (+1: the EOD)")
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


def _config_token(path: str, key: str = "eos_token") -> str | None:
    """A special token named beside a tokenizer.json (eos_token: the token transformers' eos_token_id names,
    Megatron's eod; pad_token: its pad_token_id): from special_tokens_map.json, which transformers lets override
    tokenizer_config.json, else from the latter; None without either."""
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        try:
            token = json.load(open(os.path.join(os.path.dirname(path) or ".", name), encoding="utf-8")).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        token = token.get("content") if isinstance(token, dict) else token
        if token:
            return token
    return None


def _as_transformers_reads(path: str):
    """The tokenizers pipeline the installed transformers' AutoTokenizer builds for the tokenizer.json at `path`
    (its backend tokenizer), where tokenizer_config.json beside it names a class of its own: transformers 5
    rebuilds a LlamaTokenizer's from the file's vocabulary and merges (no normalizer; a Metaspace that prepends
    "▁" to the text's first piece only, unless legacy), so Llama-2's tokenizer.json as written put a "▁" after
    every <s> that transformers' ids (and apply_chat_template's) do not have. None where transformers reads the
    file as written (PreTrainedTokenizerFast, no config), or is not installed (transformers 4 reads it so)."""
    if os.path.basename(path) != "tokenizer.json":  # (AutoTokenizer reads the folder's tokenizer.json)
        return None
    folder = os.path.dirname(path) or "."
    try:
        config = json.load(open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("tokenizer_class") in (None, "PreTrainedTokenizerFast"):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, local_files_only=True).backend_tokenizer
    except Exception:  # (no transformers, or a config it cannot build: the file as written, as before)
        return None


HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def _hub_id(path: str) -> bool:
    """Whether a --tokenizer-model that is no local path reads as a hub id (org/name), not a mistyped file."""
    return (
        not os.path.exists(path)
        and HUB_ID.fullmatch(path) is not None
        and not path.startswith((".", "~"))
        and not path.endswith((".json", ".model", ".txt"))
    )


def tokenizer_file(path: str | None) -> str | None:
    """A model directory given as --tokenizer-model (as Megatron takes one) stands for its tokenizer.json; so does
    a Hugging Face hub id (meta-llama/Llama-3.1-8B, as Megatron's scripts pass to AutoTokenizer) already in the
    local Hugging Face cache (nothing is downloaded here)."""
    if path and os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        return os.path.join(path, "tokenizer.json")
    if path and _hub_id(path):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "tokenizer.json")
        except (ImportError, ValueError):  # (no hub library; an id it finds invalid)
            return path
        if isinstance(cached, str):
            return cached
    return path


class HuggingFaceTokenizer:
    """Megatron's HuggingFaceTokenizer: text encoded as transformers' tokenizer(text).input_ids does, with the
    special tokens its post-processor adds (Llama-3's <|begin_of_text|>); the end-of-document id is the eos_token
    of special_tokens_map.json or tokenizer_config.json where there is one, else the first of EOD_CANDIDATES in
    the vocabulary."""

    bos: int | None = None  # the one token encode puts before the text, if any (SFT keeps one per sequence)
    # Megatron's tokenizer.pad (transformers' pad_token_id): its GPTDataset drops the loss where the label is this
    # id and reads it as id 0 (gpt_dataset.GPTDataset.__getitem__); None where there is none, or it is the EOD
    pad: int | None = None

    def __init__(self, path: str, as_transformers: bool = True) -> None:
        """`as_transformers`: the pipeline the installed transformers builds (_as_transformers_reads), where it
        differs from the file's; else the file's as written."""
        from tokenizers import Tokenizer

        path = tokenizer_file(path)
        if not os.path.isfile(path):
            hub = (
                "; as a Hugging Face hub id it is not in the local cache: download it first (huggingface-cli "
                f"download {path} tokenizer.json tokenizer_config.json special_tokens_map.json)"
                if _hub_id(path)
                else ""
            )
            raise ConfigError(
                f"--tokenizer-model {path}: no such file (expected a tokenizer.json, or a directory holding one){hub}"
            )
        self.path = path
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # (the tokenizers library raises a bare Exception on a malformed file)
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(
                f"--tokenizer-model {path} is not a tokenizer.json the tokenizers library reads: {msg}"
            ) from None
        if as_transformers:
            self._tok = _as_transformers_reads(path) or self._tok
        eos = _config_token(path)
        if eos is not None and eos not in self._tok.get_vocab(with_added_tokens=True):
            # transformers (so Megatron's HuggingFaceTokenizer) adds a configured eos_token the file lacks as a new
            # token, the next id, and ends documents with it; it fell back to another token here, silently
            from tokenizers import AddedToken

            self._tok.add_special_tokens([AddedToken(eos, special=True)])
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        eod = vocab[eos] if eos in vocab else next((vocab[t] for t in EOD_CANDIDATES if t in vocab), None)
        if eod is None:
            raise ConfigError(
                f"--tokenizer-model {path} has no end-of-document token (no eos_token in a special_tokens_map.json or "
                f"tokenizer_config.json beside it, and none of {EOD_CANDIDATES})"
            )
        self.eod = eod
        pad = _config_token(path, "pad_token")
        # (Megatron-core's MegatronDataset ignores a pad id that is the eos/eod: pad_token = eos_token, as Qwen's)
        self.pad = vocab[pad] if pad in vocab and vocab[pad] != eod else None
        # What the post-processor puts around every text (BOS before, some an EOS after: "<s> $A </s>"), found by
        # encoding with and without it
        plain, full = self._plain(["x"])[0], self._tok.encode("x").ids
        at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None)
        self.prefix = [] if at is None else full[:at]
        self.suffix = [] if at is None else full[at + len(plain) :]
        self.bos = self.prefix[0] if len(self.prefix) == 1 else None

    def _plain(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def token(self, id_: int) -> str | None:
        """The text of one token of the vocabulary (a special token's as written: "<s>")."""
        return self._tok.id_to_token(id_)


class SentencePieceFamilyTokenizer(HuggingFaceTokenizer):
    """Megatron's Llama2Tokenizer (a BOS before every document, EOD = </s>) and GPTSentencePieceTokenizer (no
    BOS), which read a SentencePiece tokenizer.model. We read the Hugging Face tokenizer.json converted from that
    model instead, which Llama and Mistral repositories ship beside it (the same ids for plain text): given the
    .model file, its directory, or the tokenizer.json itself."""

    def __init__(self, path: str | None, kind: str) -> None:
        flag = f"--tokenizer-type {kind} --tokenizer-model {path}"
        if not path:
            raise ConfigError(f"--tokenizer-type {kind} needs --tokenizer-model (tokenizer.model or tokenizer.json)")
        folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
        json_path = path if path.endswith(".json") else os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(json_path):
            raise ConfigError(
                f"{flag}: megatron_lite reads the Hugging Face tokenizer.json converted from a SentencePiece model "
                f"and found none at {json_path}; put the model's tokenizer.json there (Llama and Mistral "
                "repositories ship one) or use --tokenizer-type HuggingFaceTokenizer"
            )
        super().__init__(json_path, as_transformers=False)  # (SentencePiece's pieces for documents, as Megatron's)
        # Megatron's vocabulary is the SentencePiece model's pieces, which the tokenizer.json's model holds; a token
        # added beside them (a fine-tune's <pad> at 32000) made Llama-2's 32001, padded to 32128 instead of 32000.
        # Such tokens are not the model's: dropped, so text holding one is read as SentencePiece reads it (a
        # non-special one was matched in text, an id past the vocabulary)
        from tokenizers import Tokenizer

        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=False)

        def pieces_only(tok):
            spec = json.loads(tok.to_str())
            spec["added_tokens"] = [t for t in spec.get("added_tokens") or [] if t["id"] < self.vocab_size]
            return Tokenizer.from_str(json.dumps(spec))

        self._tok = pieces_only(self._tok)
        # a rendered chat is read as transformers reads it (apply_chat_template's ids), which for a LlamaTokenizer
        # transformers 5 builds its own way
        chat = _as_transformers_reads(json_path)
        self._chat = None if chat is None else pieces_only(chat)
        # SentencePiece never reads a control symbol from text: "</s>" in a document (HTML's strikethrough) is
        # text, where the tokenizers library would match it as the special token (an EOD mid-document)
        self._tok.encode_special_tokens = True
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # (Megatron's pad for these is the SentencePiece model's pad_id, -1 for Llama's and Mistral's: none; the
        # tokenizer_config.json's pad_token, a fine-tune's <pad> or <unk>, is not it)
        self.pad = None
        self.bos = vocab.get("<s>") if kind == "Llama2Tokenizer" else None
        if kind == "Llama2Tokenizer" and self.bos is None:
            raise ConfigError(f"{flag}: {json_path} has no <s> token for Llama2Tokenizer's BOS")
        self.prefix, self.suffix = ([] if self.bos is None else [self.bos]), []
        if "</s>" in vocab:
            self.eod = vocab["</s>"]  # SentencePiece's EOS, Megatron's EOD for these tokenizers
        elif self.eod >= self.vocab_size:  # (a configured eos_token that is no piece of the model)
            raise ConfigError(
                f"{flag}: the end-of-document token (id {self.eod}) is not among the SentencePiece model's "
                f"{self.vocab_size} pieces and there is no </s>; use --tokenizer-type HuggingFaceTokenizer"
            )

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._tok.encode_special_tokens = True  # (a pickled Tokenizer does not keep it)

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # (Megatron's SentencePiece tokenizers add their own BOS, not the tokenizer.json's post-processor's)
        return [ids if self.bos is None else [self.bos, *ids] for ids in self._plain(texts)]

    def encode_chat(self, text: str) -> list[int]:
        """Text a chat template rendered ("answer</s><s>[INST] ..."): its special tokens read as the tokens they
        name, as transformers' tokenizer (and so apply_chat_template) reads them, through transformers' pipeline
        where it builds its own; plain documents keep SentencePiece's rule, `encode`."""
        if self._chat is not None:
            ids = self._chat.encode(text, add_special_tokens=False).ids
            return ids if self.bos is None else [self.bos, *ids]
        self._tok.encode_special_tokens = False
        try:
            return self.encode(text)
        finally:
            self._tok.encode_special_tokens = True


class GPT2BPETokenizer(HuggingFaceTokenizer):
    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path:
                raise ConfigError(f"GPT2BPETokenizer needs --vocab-file and --merge-file: {flag} is not given")
            if not os.path.isfile(path):
                raise ConfigError(f"{flag} {path}: no such file (GPT2BPETokenizer needs --vocab-file and --merge-file)")
        # (swapped or damaged files were tracebacks, an exploratory run found: each is one line naming its flag)
        swapped = " (are --vocab-file and --merge-file swapped?)"
        try:
            vocab = json.load(open(vocab_file, encoding="utf-8"))  # (GPT-2's byte-level symbols: not ASCII)
        except (UnicodeDecodeError, ValueError) as e:
            raise ConfigError(f"--vocab-file {vocab_file} is not GPT-2's vocab.json: {e}{swapped}") from None
        if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
            raise ConfigError(f"--vocab-file {vocab_file} is not GPT-2's vocab.json (a JSON object of token: id)")
        # (as Megatron's and transformers' GPT-2 tokenizers read it: split("\n")[1:-1], the first line a version
        # header and the last dropped, which is the final merge itself in a file without a trailing newline)
        try:
            lines = open(merge_file, encoding="utf-8").read().split("\n")[1:-1]
        except UnicodeDecodeError as e:
            raise ConfigError(f"--merge-file {merge_file} is not GPT-2's merges.txt: {e}") from None
        merges = [tuple(line.split()) for line in lines if line.strip()]
        if bad := next((m for m in merges if len(m) != 2), None):
            raise ConfigError(
                f"--merge-file {merge_file} is not GPT-2's merges.txt: a line holds {' '.join(bad)[:60]!r}, not two "
                f"symbols{swapped if merge_file.endswith('.json') or bad[0].startswith('{') else ''}"
            )
        try:
            tok = Tokenizer(models.BPE(vocab, merges))
        except Exception as e:  # (the tokenizers library's own type: a merge whose parts or result it lacks)
            raise ConfigError(
                f"--vocab-file {vocab_file} and --merge-file {merge_file} do not belong together: {e}"
            ) from None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        self.path, self.merge_file = vocab_file, merge_file  # (both name what it reads: data/sft_cache.py)
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        if "<|endoftext|>" not in vocab:
            raise ConfigError(f"--vocab-file {vocab_file} has no <|endoftext|> token")
        self.eod = vocab["<|endoftext|>"]


def build_tokenizer(
    tokenizer_type: str | None,
    *,
    model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    vocab_size: int | None = None,
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int = 1000,
    tiktoken_special_tokens: list[str] | tuple[str, ...] | None = None,
    tokenizer_special_tokens: list[str] | tuple[str, ...] | None = None,
    legacy_tokenizer: bool = False,
):
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not model:
            raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH/tokenizer.json")
        return HuggingFaceTokenizer(model)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type in ("Llama2Tokenizer", "GPTSentencePieceTokenizer"):
        return SentencePieceFamilyTokenizer(model, tokenizer_type)
    if tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if tokenizer_type == "TikTokenizer":
        from megatron_lite.data.tiktokenizer import TikTokenizer

        if tiktoken_pattern is None:  # (Megatron asserts it is given)
            raise ConfigError("--tokenizer-type TikTokenizer needs --tiktoken-pattern v1 or v2 (as in Megatron)")
        # (Megatron's two implementations read different flags for the special tokens)
        specials = tiktoken_special_tokens if legacy_tokenizer else tokenizer_special_tokens
        return TikTokenizer(
            model, tiktoken_pattern, vocab_size, tiktoken_num_special_tokens, specials, legacy=legacy_tokenizer
        )
    raise ConfigError(f"--tokenizer-type {tokenizer_type} is not supported")


def tokenizer_from_flags(flags):
    """The tokenizer named by an object with Megatron's tokenizer flags as attributes (a DataConfig, or an
    argparse namespace): tokenizer_type, tokenizer_model, vocab_file, merge_file, vocab_size, and TikTokenizer's
    tiktoken_* (absent from checkpoints saved before it: their defaults)."""
    num_special = getattr(flags, "tiktoken_num_special_tokens", None)
    return build_tokenizer(
        flags.tokenizer_type,
        model=flags.tokenizer_model,
        vocab_file=flags.vocab_file,
        merge_file=flags.merge_file,
        vocab_size=flags.vocab_size,
        tiktoken_pattern=getattr(flags, "tiktoken_pattern", None),
        tiktoken_num_special_tokens=1000 if num_special is None else num_special,
        tiktoken_special_tokens=getattr(flags, "tiktoken_special_tokens", None),
        tokenizer_special_tokens=getattr(flags, "tokenizer_special_tokens", None),
        legacy_tokenizer=bool(getattr(flags, "legacy_tokenizer", False)),
    )


def tokenizer_from_saved(data: dict):
    """The tokenizer a checkpoint's recorded data settings name (settings it did not record: their defaults)."""
    from megatron_lite.data.config import TOKENIZER_FIELDS, DataConfig

    fields = {k: data[k] for k in TOKENIZER_FIELDS if data.get(k) is not None}
    for k in ("tiktoken_special_tokens", "tokenizer_special_tokens"):  # (JSON lists, DataConfig's tuples)
        if k in fields:
            fields[k] = tuple(fields[k])
    return tokenizer_from_flags(DataConfig(**fields))
