"""Megatron's TikTokenizer (`--tokenizer-type TikTokenizer`): a tiktoken vocabulary stored
as a JSON list of ranks (`{"rank", "token_bytes", "token_str"}`, the token's bytes in base64), the form NeMo and
Nemotron ship, read without the tiktoken package. The ranks become a byte-level BPE of the `tokenizers` library:
tiktoken merges the adjacent pair whose join has the lowest rank, so each token's merges are its splits into two
tokens, ordered by its rank (the conversion transformers uses for tiktoken vocabularies).

As in Megatron, ids 0..N-1 are the special tokens (then `<SPECIAL_i>` fillers up to `--tiktoken-num-special-tokens`
N), rank r is id N + r, the vocabulary is `--vocab-size` ids (2^17 when not given: the first --vocab-size - N
ranks), and the end of document is `</s>`. Megatron has two implementations, and so do we:
- by default (Megatron-Core's tokenizers library, TikTokenTokenizer): the special tokens are
  `--tokenizer-special-tokens`, by default <unk> <s> </s> <mask> <pad> <cls> <sep> (the pad id, whose labels
  carry no loss in the dataset, is <pad>'s), and a special token written in the text is that token
  (tiktoken's encode with allowed_special="all");
- with `--legacy-tokenizer` (megatron/training/tokenizer, CustomTikTokenizer): `--tiktoken-special-tokens`, by
  default <unk> <s> </s>, no pad, and text encoded as tiktoken's encode_ordinary: a special token written in it
  is text."""

from __future__ import annotations

import base64
import binascii
import json
import os
import re

from megatron_lite.config import ConfigError

# Megatron's PATTERN_TIKTOKEN (v1) and PATTERN_TIKTOKEN_V2, the pre-tokenizer's split of text into words
PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# The special tokens each implementation requires and starts from (Megatron's SPECIAL_TOKENS of each)
REQUIRED_SPECIAL_TOKENS = {
    False: ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"),  # megatron.core.tokenizers
    True: ("<unk>", "<s>", "</s>"),  # --legacy-tokenizer
}
DEFAULT_VOCAB_SIZE = 2**17


def _byte_symbols() -> list[str]:
    """The byte-level alphabet (GPT-2's): byte b as one printable character, which the `tokenizers` library's
    ByteLevel pre-tokenizer maps text's bytes to."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b], extra = chr(256 + extra), extra + 1
    return [symbols[b] for b in range(256)]


def read_ranks(path: str, count: int, flag: str, specials: int = 0) -> list[bytes]:
    """The first `count` tokens of a tiktoken rank list, by rank (Megatron's reload_mergeable_ranks); `specials`:
    the ids before them (for the message when the list is short)."""
    where = f"{flag} {path}"
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise ConfigError(f"{where} is not JSON: {e}") from None
    if isinstance(entries, dict) and isinstance(entries.get("vocab"), list):
        raise ConfigError(
            f'{where} is a tekken.json (its ranks under "vocab"); TikTokenizer reads, as Megatron\'s does, the '
            'JSON list of ranks itself: write that list to a file of its own (json.dump(json.load(f)["vocab"], out))'
        )
    if not isinstance(entries, list):
        raise ConfigError(f'{where}: expected a JSON list of {{"rank", "token_bytes", "token_str"}} entries')
    if len(entries) < count:
        raise ConfigError(
            f"{where} holds {len(entries)} ranks, and a vocabulary of {count + specials} ids ({specials} special "
            f"tokens) needs {count}: give --vocab-size {len(entries) + specials} or less (without it the "
            f"vocabulary is Megatron's 2^17)"
        )
    ranks, seen = [], set()
    for i, entry in enumerate(entries[:count]):
        try:
            rank, token = entry["rank"], base64.b64decode(entry["token_bytes"], validate=True)
        except (TypeError, KeyError, binascii.Error, ValueError):
            raise ConfigError(f"{where}: entry {i} is not a {{rank, token_bytes (base64)}} object") from None
        if rank != i:
            raise ConfigError(f"{where}: entry {i} has rank {rank}; the list must be in rank order from 0")
        if (i < 256 and token != bytes([i])) or (i >= 256 and len(token) < 2):
            raise ConfigError(f"{where}: rank {i} is {token!r}; ranks 0-255 must be the single bytes, in order")
        if token in seen:
            raise ConfigError(f"{where}: rank {i} repeats the token {token!r}")
        seen.add(token)
        ranks.append(token)
    return ranks


def _utf8(text: str) -> str:
    """Text that is UTF-8, as tiktoken's encode_ordinary makes it: json.loads reads an escaped surrogate ("\\ud83d")
    as a lone one, which tiktoken joins to its pair through UTF-16 and replaces by U+FFFD where it has none (the
    tokenizers library refuses such text)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


class TikTokenizer:
    """The tokenizer of `--tokenizer-type TikTokenizer`; the interface of HuggingFaceTokenizer (encode,
    encode_batch, decode, token, eod, vocab_size)."""

    bos: int | None = None  # (Megatron's tokenize adds none by default)
    pad: int | None = None  # (the legacy CustomTikTokenizer has none: Megatron-core's GPTDataset then masks none)
    prefix: list[int] = []
    suffix: list[int] = []
    takes_lone_surrogates = True  # (encode reads them as tiktoken does; preprocess_data.py refuses them otherwise)

    def __init__(
        self,
        path: str | None,
        pattern: str = "v2",
        vocab_size: int | None = None,
        num_special_tokens: int = 1000,
        special_tokens: list[str] | tuple[str, ...] | None = None,
        legacy: bool = False,
    ) -> None:
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

        flag = "--tokenizer-type TikTokenizer --tokenizer-model"
        if not path:
            raise ConfigError("--tokenizer-type TikTokenizer needs --tokenizer-model (a tiktoken JSON rank list)")
        if not os.path.isfile(path):
            raise ConfigError(f"{flag} {path}: no such file (expected a tiktoken JSON rank list)")
        if pattern not in PATTERNS:
            raise ConfigError(f"--tiktoken-pattern {pattern}: choose v1 or v2 (Megatron's two patterns)")
        required = REQUIRED_SPECIAL_TOKENS[legacy]
        specials = list(special_tokens or required)
        size = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
        given = "--tiktoken-special-tokens" if legacy else "--tokenizer-special-tokens"
        if len(set(specials)) != len(specials) or not set(required) <= set(specials):
            which = " (with --legacy-tokenizer)" if legacy else " (without --legacy-tokenizer)"
            raise ConfigError(
                f"{given} {' '.join(specials)}: they must be distinct and include {' '.join(required)}, as "
                f"Megatron's TikTokenizer{which} requires"
            )
        if not len(specials) <= num_special_tokens < size:
            raise ConfigError(
                f"--tiktoken-num-special-tokens {num_special_tokens} must be at least the {len(specials)} "
                f"special tokens and below the vocabulary (--vocab-size {size})"
            )
        specials += [f"<SPECIAL_{i}>" for i in range(len(specials), num_special_tokens)]
        ranks = read_ranks(path, size - num_special_tokens, flag, num_special_tokens)
        self.path, self.vocab_size, self.num_special_tokens = path, size, num_special_tokens
        self.specials, self.legacy = specials, legacy
        self.eod = specials.index("</s>")
        self.pad = None if legacy else specials.index("<pad>")
        # (the default implementation reads special tokens in the text; longest first, where one begins another)
        by_length = sorted(specials, key=len, reverse=True)
        self._special = None if legacy else re.compile("|".join(re.escape(s) for s in by_length))
        self._special_id = {s: i for i, s in enumerate(specials)}
        # Decoding is tiktoken's: the tokens' bytes joined, then read as UTF-8 with replacement characters
        self._bytes = [s.encode("utf-8") for s in specials] + ranks
        symbols = _byte_symbols()
        text = ["".join(symbols[b] for b in token) for token in ranks]
        rank_of = {token: r for r, token in enumerate(ranks)}
        merges = []  # (each token's splits into two tokens, in the order of its rank, then of theirs)
        for token in ranks[256:]:
            splits = ((rank_of.get(token[:i]), rank_of.get(token[i:])) for i in range(1, len(token)))
            merges += [(text[a], text[b]) for a, b in sorted(s for s in splits if None not in s)]
        vocab = {t: num_special_tokens + r for r, t in enumerate(text)}
        # ignore_merges: a word that is one token is that token, as tiktoken looks a word up whole first
        tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PATTERNS[pattern]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Legacy: the texts' ids. Otherwise the pieces between the special tokens written in them encoded (all
        in one batch), the special tokens' ids between them."""
        texts = [_utf8(t) for t in texts]
        if self._special is None:
            return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]
        plans, pieces = [], []  # (per text: piece indexes and special ids, in order)
        for text in texts:
            plan, at = [], 0
            for m in self._special.finditer(text):
                if m.start() > at:
                    plan.append(len(pieces))
                    pieces.append(text[at : m.start()])
                plan.append(-1 - self._special_id[m.group()])
                at = m.end()
            if at < len(text) or not plan:
                plan.append(len(pieces))
                pieces.append(text[at:])
            plans.append(plan)
        encoded = [e.ids for e in self._tok.encode_batch(pieces, add_special_tokens=False)]
        return [[i for step in plan for i in (encoded[step] if step >= 0 else [-1 - step])] for plan in plans]

    def decode(self, ids: list[int]) -> str:
        # (an id past the vocabulary, a padded row a model sampled, is skipped, as the tokenizers library skips it)
        size = len(self._bytes)
        return b"".join(self._bytes[i] for i in ids if 0 <= i < size).decode("utf-8", errors="replace")

    def token(self, id_: int) -> str | None:
        """The text of one token (a special token's name: "</s>")."""
        return self.decode([id_]) if 0 <= id_ < self.vocab_size else None

    def hf_files(self, folder: str) -> bool:
        """Write a Hugging Face tokenizer.json and tokenizer_config.json of this tokenizer into `folder` (the
        special tokens as its added tokens at their ids, so transformers encodes plain text to these ids); False,
        writing nothing, where a special token's name is also a rank's text (one name, two ids)."""
        spec = json.loads(self._tok.to_str())
        vocab = spec["model"]["vocab"]
        if any(name in vocab for name in self.specials):
            return False
        vocab.update({name: i for i, name in enumerate(self.specials)})
        spec["added_tokens"] = [
            {"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": True}
            for i, name in enumerate(self.specials)
        ]  # fmt: skip
        with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(spec, f, ensure_ascii=False)
        # (clean_up_tokenization_spaces false: transformers 4.x cleaned " ." to "." when decoding by default)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
                  "eos_token": "</s>", "clean_up_tokenization_spaces": False}  # fmt: skip
        with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        return True
