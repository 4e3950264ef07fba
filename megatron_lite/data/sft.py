"""Supervised fine-tuning data: a JSONL file of {"prompt": ..., "response": ...} records ("completion" for
"response", as TRL's prompt-completion data). Only the response is trained: in a multi-turn conversation rendered
into the prompt, earlier assistant turns are context. Prompt and response are tokenized as one text, as
transformers' chat template and TRL tokenize them, the response being what follows the prompt's own tokens (apart,
SentencePiece would open every response with a lone space token); special tokens a chat template wrote ("</s>",
"<s>", "<|eot_id|>") read as those tokens. A prompt rendered by a chat template whose text starts with the BOS the
tokenizer adds too keeps one. Each sample is the
prompt's tokens (with the tokenizer's BOS, if it adds one), the response's (without: one BOS per sequence, and
without an EOS the tokenizer adds after every text) and one end-of-document token, padded to the sequence
length. A record longer than that loses the start of its prompt (after its BOS), not its response, as
Megatron-Bridge's SFT data cuts the input; a response that alone fills the sequence keeps half of it for the
prompt and loses its own end. The loss mask is 1 only where the label
is a response (or the final end-of-document) token, so the prompt and the padding never count. The loss is
averaged over the response tokens of the whole global batch (as Megatron's --calculate-per-token-loss does),
so data parallelism equals one process however the masked tokens fall. Samples are visited in a seeded
permutation, epoch after epoch."""

from __future__ import annotations

import json
from array import array

import numpy as np
import torch

from megatron_lite.config import ConfigError


def _strip(ids: list[int], head: list[int], tail: list[int]) -> list[int]:
    if head and ids[: len(head)] == head:
        ids = ids[len(head) :]
    if tail and ids[-len(tail) :] == tail:
        ids = ids[: -len(tail)]
    return ids


def _one_bos(ids: list[int], prefix: list[int]) -> list[int]:
    """A chat template's rendered BOS, then the tokenizer's own: one kept."""
    return ids[len(prefix) :] if prefix and ids[: 2 * len(prefix)] == prefix + prefix else ids


def _fit(prompt: list[int], response: list[int], length: int, bos: int) -> tuple[list[int], list[int], bool, bool]:
    """(prompt, response, prompt cut, response cut) within `length` tokens. The prompt keeps its first `bos`
    tokens and its end (which the response follows), and at least one token, whose label is the response's
    first."""
    if len(prompt) + len(response) <= length:
        return prompt, response, False, False
    keep = max(1, min(len(prompt), length - len(response) if len(response) < length else length // 2))
    if bos and len(prompt) > bos:  # (the BOS and at least one token after it; the response gives way)
        keep = max(keep, bos + 1)
    cut_prompt = keep < len(prompt)
    if cut_prompt:
        head = prompt[:bos] if keep > bos else []
        prompt = head + prompt[len(prompt) - (keep - len(head)) :]
    return prompt, response[: length - len(prompt)], cut_prompt, len(prompt) + len(response) > length


class SFTDataset:
    def __init__(self, path: str, tokenizer, seq_length: int, seed: int, pad_id: int | None = None) -> None:
        # every record's tokens in one int32 array, not lists of Python ints (33 bytes a token on every rank:
        # a billion-token set took 33 GB a rank, and DataLoader workers copied the pages the lists' counts touch)
        tokens, starts, prompt_lens = array("i"), array("q", [0]), array("i")
        cut = (0, 0)
        # what the tokenizer puts around every text: one BOS per sequence, the prompt's (a mid-sequence <s>
        # would be trained on), and no EOS after the prompt or doubling the closing end-of-document
        prefix, suffix = getattr(tokenizer, "prefix", []), getattr(tokenizer, "suffix", [])
        # a chat template's rendered BOS ("<s>[INST] ..."): SentencePiece reads it as text, not as the BOS
        bos_text = tokenizer.token(prefix[0]) if len(prefix) == 1 and hasattr(tokenizer, "token") else None
        encode = getattr(tokenizer, "encode_chat", tokenizer.encode)
        separate = getattr(tokenizer, "separate_texts", False)
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                expected = 'a JSON object with "prompt" and "response" (or TRL\'s "completion") strings'
                try:
                    r = json.loads(line)
                    prompt, response = (
                        r["prompt"],
                        r["response"] if "response" in r or "completion" not in r else r["completion"],
                    )
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ConfigError(f"{path}:{n}: expected {expected} ({e})") from e
                if not isinstance(prompt, str) or not isinstance(response, str):
                    kinds = f"{type(prompt).__name__} and {type(response).__name__}"
                    raise ConfigError(f"{path}:{n}: expected {expected}, got {kinds}")
                if bos_text and prompt.startswith(bos_text):
                    prompt = prompt[len(bos_text) :]
                try:
                    p, other = encode(prompt), encode(response if separate else prompt + response)
                except Exception as e:  # (NullTokenizer's ids, text the tokenizer rejects)
                    raise ConfigError(f"{path}:{n}: the tokenizer cannot encode it ({type(e).__name__}: {e})") from e
                p = _one_bos(_strip(p, [], suffix), prefix)
                if separate:
                    ids = _strip(other, prefix, suffix)
                else:
                    whole = _one_bos(_strip(other, [], suffix), prefix)
                    # the response: what follows the prompt's tokens (a merge across the boundary goes to it)
                    at = next((i for i, (a, b) in enumerate(zip(p, whole)) if a != b), min(len(p), len(whole)))
                    p, ids = whole[:at], whole[at:]
                if ids[-1:] != [tokenizer.eod]:  # (as Megatron's SFT dataset: unless it is already there)
                    ids = ids + [tokenizer.eod]
                p, ids, cut_prompt, cut_response = _fit(
                    p, ids, seq_length + 1, len(prefix) if p[: len(prefix)] == prefix else 0
                )
                cut = (cut[0] + cut_prompt, cut[1] + cut_response)
                tokens.extend(p + ids)
                starts.append(len(tokens))
                prompt_lens.append(len(p))
        if not prompt_lens:
            raise ConfigError(f"{path} holds no prompt/response records")
        self.tokens, self.starts = np.frombuffer(tokens, dtype=np.int32), np.frombuffer(starts, dtype=np.int64)
        self.prompt_lens = np.frombuffer(prompt_lens, dtype=np.int32)
        self.cut = cut  # (records whose prompt, and whose response, was cut)
        self.seq_length, self.seed, self.eod = seq_length, seed, tokenizer.eod
        self.pad = self.eod if pad_id is None else pad_id
        self._order = (None, None)  # (epoch, its permutation of the records)

    def __len__(self) -> int:
        return 1 << 40  # epochs repeat

    @property
    def num_records(self) -> int:
        return len(self.prompt_lens)

    def record(self, r: int) -> tuple[list[int], list[int]]:
        """Record r's prompt and response tokens (the response ending in the end-of-document token)."""
        ids, p = self.tokens[self.starts[r] : self.starts[r + 1]].tolist(), int(self.prompt_lens[r])
        return ids[:p], ids[p:]

    def _record(self, index: int) -> tuple[list[int], list[int]]:
        n = self.num_records
        epoch, i = divmod(index, n)
        if self._order[0] != epoch:  # one permutation per epoch, drawn once
            self._order = (epoch, np.random.default_rng(self.seed + epoch).permutation(n))
        return self.record(int(self._order[1][i]))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        prompt, response = self._record(index)
        ids = (prompt + response)[: self.seq_length + 1]
        # label j is ids[j + 1]: a response token (or the closing end-of-document) when j + 1 >= len(prompt)
        mask = [1.0 if j + 1 >= len(prompt) else 0.0 for j in range(len(ids) - 1)]
        pad = self.seq_length + 1 - len(ids)
        ids = ids + [self.pad] * pad
        mask = mask + [0.0] * pad
        seq = torch.tensor(ids, dtype=torch.long)
        return {
            "tokens": seq[:-1].clone(),
            "labels": seq[1:].clone(),
            "loss_mask": torch.tensor(mask, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length),
        }
