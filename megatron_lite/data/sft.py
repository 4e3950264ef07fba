"""Supervised fine-tuning data: a JSONL file of {"prompt": ..., "response": ...} records ("completion" for
"response", as TRL's prompt-completion data), or of Megatron's {"messages": [...]} conversations, rendered by
the tokenizer's chat template with every assistant turn trained (data/sft_messages.py). Of a prompt/response
record only the response is trained: in a multi-turn conversation rendered
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
permutation, epoch after epoch.

As Megatron's --sft (its SFTDataset built by BlendedMegatronDatasetBuilder like GPTDataset), --split divides each
file's records into train/valid/test: split i is the contiguous records [round(c_i x N), round(c_(i+1) x N)),
c the running sum of the normalised weights, each split in its own seeded order; or each split reads files of its
own (--train/valid/test-data-path), whole. Several files in a split are blended by their weights (Megatron's
blend), or by their records where no weights are given. (Megatron's SFTDataset reads a split's records in file
order, cycling; ours in a seeded permutation per epoch, as before.)"""

from __future__ import annotations

import copy
import functools
import json
import os
import time
from array import array

import numpy as np
import torch

from megatron_lite.config import ConfigError
from megatron_lite.data.documents import ids_from_starts, positions_from_starts
from megatron_lite.data.gpt_dataset import BlendedDataset, normalize, split_document_ranges
from megatron_lite.data.sft_cache import cached_records
from megatron_lite.data.sft_messages import (
    ChatTemplate,
    check_messages,
    common_prefix,
    conversation_ids,
    split_conversations,
)

OPENS = 2  # (a flag beside "trained": this token opens a conversation packed into its line)


def _strip(ids: list[int], head: list[int], tail: list[int]) -> list[int]:
    if head and ids[: len(head)] == head:
        ids = ids[len(head) :]
    if tail and ids[-len(tail) :] == tail:
        ids = ids[: -len(tail)]
    return ids


def _one_bos(ids: list[int], prefix: list[int]) -> list[int]:
    """A chat template's rendered BOS, then the tokenizer's own: one kept."""
    return ids[len(prefix) :] if prefix and ids[: 2 * len(prefix)] == prefix + prefix else ids


def prompt_ids(tokenizer, text: str) -> list[int]:
    """A prompt's ids as --sft trains on them (tools/generate.py prompts with these): a chat template's special
    tokens read as the tokens they name, one BOS where the text and the tokenizer both bring one, no end-of-text
    the tokenizer appends. An exploratory run's: generate.py's plain encode read a Llama-2 chat prompt's <s> as
    text, and doubled a Llama-3 one's BOS, so the model was prompted with ids it was never trained on."""
    prefix, suffix = getattr(tokenizer, "prefix", []), getattr(tokenizer, "suffix", [])
    encode = getattr(tokenizer, "encode_chat", tokenizer.encode)
    return _one_bos(_strip(encode(text), [], suffix), prefix)


def chat_ids(tokenizer, text: str) -> list[int]:
    """A conversation the chat template rendered, as transformers' apply_chat_template(tokenize=True) and
    Megatron's SFTTokenizer read it: the template's text alone, its special tokens as tokens, none added (the BOS
    is the template's to write: a tokenizer that adds one to every text, under a template that writes none, as
    TinyLlama-Chat's and Zephyr's, put one before every conversation, which transformers never does)."""
    encode = getattr(tokenizer, "encode_chat", tokenizer.encode)
    return _strip(encode(text), getattr(tokenizer, "prefix", []), getattr(tokenizer, "suffix", []))


def chat_prompt_ids(tokenizer, template: ChatTemplate, messages, where: str) -> list[int]:
    """A {"messages": [...]} conversation as a prompt for its next reply: rendered by the chat template with its
    generation prompt (the assistant header), then read as chat_ids reads it."""
    return chat_ids(tokenizer, template.render(check_messages(messages, where, prompt=True), True, where))


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


def read_records(path: str, tokenizer, seq_length: int, log=None) -> tuple[dict[str, np.ndarray], bool]:
    """The file's records tokenized: (arrays, packed). arrays: every record's tokens in one array (tokens, starts),
    per record its prompt's length and what was cut (prompt_lens, cuts), per token its flags (trained); packed:
    a line holds several conversations. `log`: where a file that takes long to read says how far it got."""
    # every record's tokens in one int32 array, not lists of Python ints (33 bytes a token on every rank:
    # a billion-token set took 33 GB a rank, and DataLoader workers copied the pages the lists' counts touch)
    tokens, starts, prompt_lens = array("i"), array("q", [0]), array("i")
    cuts = array("b")  # per record: 1 its prompt was cut, 2 its response (both: 3); 4 nothing is left trained
    # what the tokenizer puts around every text: one BOS per sequence, the prompt's (a mid-sequence <s>
    # would be trained on), and no EOS after the prompt or doubling the closing end-of-document
    prefix, suffix = getattr(tokenizer, "prefix", []), getattr(tokenizer, "suffix", [])
    encode = getattr(tokenizer, "encode_chat", tokenizer.encode)
    separate = getattr(tokenizer, "separate_texts", False)
    # per token: 1 where, as a label, it carries loss (a response's, an assistant turn's); OPENS where a
    # conversation packed into a line after another starts (its own positions and attention)
    trained = array("b")
    packed = False  # (a line of several conversations: samples carry document ids; see build_sft_datasets)
    template = None  # (the chat template, read at the first "messages" record)
    read = functools.partial(chat_ids, tokenizer)  # (a rendered conversation's ids)

    with open(path, "rb") as f:  # (decoded line by line: a byte that is not UTF-8 is named with its line)
        began = said = time.monotonic()
        for n, raw in enumerate(f, 1):
            if log is not None and time.monotonic() - said > 30:  # (20k chat lines took 35 s, unsaid)
                said = time.monotonic()
                log(f"--sft {path}: {n - 1} lines read and tokenized ({said - began:.0f} s)")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}:{n}: not UTF-8 text ({e.reason} at byte {e.start} of the line); "
                                  "SFT records are JSON lines in UTF-8") from None  # fmt: skip
            if not line.strip():
                continue
            expected = 'a JSON object with "prompt" and "response" (or TRL\'s "completion") strings'
            either = expected + ' (or Megatron\'s "messages" list)'
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: expected {either} (not JSON: {e.msg} at column {e.colno})") from e
            if not isinstance(r, dict):  # (a JSON array file, say: one record a line here)
                raise ConfigError(f"{path}:{n}: expected {either} on each line, got a JSON {type(r).__name__}")
            if "messages" in r and ({"prompt", "response", "completion"} & set(r)):
                both = sorted({"prompt", "response", "completion"} & set(r))[0]
                raise ConfigError(f'{path}:{n}: the record has both "messages" and "{both}": give one of them '
                                  '(a conversation, or a prompt/response record)')  # fmt: skip
            if "messages" in r:  # (Megatron's SFTDataset's conversations)
                where = f"{path}:{n}"
                if template is None:
                    template = ChatTemplate(tokenizer, where)
                ids, flags = [], []
                conversations = split_conversations(check_messages(r["messages"], where))
                for conversation in conversations:
                    more, marks = conversation_ids(conversation, template, read, where)
                    if more[-1:] != [tokenizer.eod]:  # (as Megatron's SFT dataset: unless it is already there)
                        more, marks = more + [tokenizer.eod], marks + [1]
                    ids, flags = ids + more, flags + [marks[0] | OPENS] + marks[1:]
                packed = packed or len(conversations) > 1
                # (cut on the right, as Megatron's SFTDataset cuts a pack: the last replies lose their end)
                # (4: no reply is left within the sequence, a sample that trains nothing)
                lost, kept = (
                    any(f & 1 for f in flags[seq_length + 1 :]),
                    any(f & 1 for f in flags[1 : seq_length + 1]),
                )
                cuts.append(2 * int(lost) + 4 * int(not kept))
                ids, flags = ids[: seq_length + 1], flags[: seq_length + 1]
                tokens.extend(ids)
                trained.extend(flags)
                starts.append(len(tokens))
                prompt_lens.append(next((i for i, f in enumerate(flags) if f & 1), len(flags)))
                continue
            if "prompt" not in r or not ({"response", "completion"} & set(r)):
                missing = "prompt" if "prompt" not in r else "response"
                raise ConfigError(f'{path}:{n}: expected {either}; it has no "{missing}" key')
            prompt = r["prompt"]
            response = r["response"] if "response" in r or "completion" not in r else r["completion"]
            if not isinstance(prompt, str) or not isinstance(response, str):
                kinds = f"{type(prompt).__name__} and {type(response).__name__}"
                raise ConfigError(f"{path}:{n}: expected {expected}, got {kinds}")
            if not response:  # (it trained the turn's end alone; Megatron refuses an empty assistant turn)
                raise ConfigError(f"{path}:{n}: the response is empty: drop the record or give its answer")
            try:  # (the prompt, and the whole text, read as prompt_ids reads a prompt)
                p = prompt_ids(tokenizer, prompt)
                other = encode(response) if separate else prompt_ids(tokenizer, prompt + response)
            except Exception as e:  # (NullTokenizer's ids, text the tokenizer rejects)
                raise ConfigError(f"{path}:{n}: the tokenizer cannot encode it ({type(e).__name__}: {e})") from e
            if separate:
                ids = _strip(other, prefix, suffix)
            else:  # the response: what follows the prompt's tokens (a merge across the boundary goes to it)
                at = common_prefix(p, other)
                p, ids = other[:at], other[at:]
            if ids[-1:] != [tokenizer.eod]:  # (as Megatron's SFT dataset: unless it is already there)
                ids = ids + [tokenizer.eod]
            p, ids, cut_prompt, cut_response = _fit(
                p, ids, seq_length + 1, len(prefix) if p[: len(prefix)] == prefix else 0
            )
            cuts.append(int(cut_prompt) + 2 * int(cut_response))
            tokens.extend(p + ids)
            trained.extend([0] * len(p) + [1] * len(ids))
            starts.append(len(tokens))
            prompt_lens.append(len(p))
    if not prompt_lens:
        raise ConfigError(f"{path} holds no prompt/response or messages records")
    arrays = {
        "tokens": np.frombuffer(tokens, dtype=np.int32),
        "starts": np.frombuffer(starts, dtype=np.int64),
        "prompt_lens": np.frombuffer(prompt_lens, dtype=np.int32),
        "trained": np.frombuffer(trained, dtype=np.int8),
        "cuts": np.frombuffer(cuts, dtype=np.int8),
    }
    return arrays, packed


class SFTDataset:
    def __init__(
        self, path: str, tokenizer, seq_length: int, seed: int, pad_id: int | None = None, log=None, cache_dir=None
    ) -> None:
        """`log`: where a file that takes long to read says how far it got (every 30 s); `cache_dir`: where its
        tokenized records are kept for the next run (data/sft_cache.py), None to tokenize every time."""
        arrays, self.packed = (
            read_records(path, tokenizer, seq_length, log)
            if cache_dir is None
            else cached_records(path, tokenizer, seq_length, cache_dir, read_records, log)
        )
        self.tokens, self.starts, self.prompt_lens = arrays["tokens"], arrays["starts"], arrays["prompt_lens"]
        self.trained, self._cuts = arrays["trained"], arrays["cuts"]
        self.first, self.count = 0, len(self.prompt_lens)  # the records this dataset reads: all, or a split's
        self.seq_length, self.seed, self.eod = seq_length, seed, tokenizer.eod
        self.pad = self.eod if pad_id is None else pad_id
        self._order = (None, None)  # (epoch, its permutation of the records)

    def __len__(self) -> int:
        return 1 << 40  # epochs repeat

    @property
    def num_records(self) -> int:
        return self.count

    @property
    def cut(self) -> tuple[int, int]:
        """(records whose prompt, and whose response, was cut) among this dataset's."""
        part = self._cuts[self.first : self.first + self.count]
        return int(np.count_nonzero(part & 1)), int(np.count_nonzero(part & 2))

    @property
    def untrained(self) -> int:
        """Records (conversations cut on the right) with no trained token left within the sequence."""
        return int(np.count_nonzero(self._cuts[self.first : self.first + self.count] & 4))

    def part(self, lo: int, hi: int) -> SFTDataset:
        """Records [lo, hi) of the file, in an order of their own (the same seed: each split's own records), the
        tokens shared, not copied."""
        view = copy.copy(self)
        view.first, view.count, view._order = lo, hi - lo, (None, None)
        return view

    def record(self, r: int) -> tuple[list[int], list[int]]:
        """Record r's prompt and response tokens (the response ending in the end-of-document token)."""
        r += self.first
        ids, p = self.tokens[self.starts[r] : self.starts[r + 1]].tolist(), int(self.prompt_lens[r])
        return ids[:p], ids[p:]

    def _record(self, index: int) -> tuple[list[int], list[int]]:
        """The index-th sample's record: its tokens and, per token, whether it is trained as a label."""
        n = self.num_records
        epoch, i = divmod(index, n)
        if self._order[0] != epoch:  # one permutation per epoch, drawn once
            self._order = (epoch, np.random.default_rng(self.seed + epoch).permutation(n))
        r = self.first + int(self._order[1][i])
        lo, hi = self.starts[r], self.starts[r + 1]
        return self.tokens[lo:hi].tolist(), self.trained[lo:hi].tolist()

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, trained = self._record(index)
        ids = ids[: self.seq_length + 1]
        # label j is ids[j + 1]: trained where that token is a response's (or the closing end-of-document)
        mask = [float(t & 1) for t in trained[1 : len(ids)]]
        pad = self.seq_length + 1 - len(ids)
        ids = ids + [self.pad] * pad
        mask = mask + [0.0] * pad
        seq = torch.tensor(ids, dtype=torch.long)
        sample = {
            "tokens": seq[:-1].clone(),
            "labels": seq[1:].clone(),
            "loss_mask": torch.tensor(mask, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length),
        }
        if self.packed:  # each conversation its own positions and attention (the padding goes with the last)
            opens = torch.zeros(self.seq_length, dtype=torch.bool)
            marks = [t & OPENS > 0 for t in trained[: self.seq_length]]
            opens[: len(marks)] = torch.tensor(marks, dtype=torch.bool)
            sample["document_ids"], sample["position_ids"] = ids_from_starts(opens), positions_from_starts(opens)
        return sample


class _Blend(BlendedDataset):
    """SFT datasets blended (several files in a split), with their records' counts for start-up's note."""

    @property
    def num_records(self) -> int:
        return sum(d.num_records for d in self.datasets)

    @property
    def cut(self) -> tuple[int, int]:
        return tuple(sum(c) for c in zip(*(d.cut for d in self.datasets)))

    @property
    def untrained(self) -> int:
        return sum(d.untrained for d in self.datasets)


def build_sft_datasets(source, data, num_samples: tuple[int, int, int], seq_length: int, seed: int, log=None) -> tuple:
    """(train, valid, test) from the JSONL files: --data-path's records divided by --split, as Megatron's builder
    divides documents (data/gpt_dataset.py split_document_ranges), or each split's own files, whole. A split with
    no samples requested, or no records, is None. Each file is read and tokenized once."""
    if source.per_split is not None:
        blends = [[(w, p, False) for w, p in b] for b in source.per_split]
    else:
        blends = [[(w, p, True) for w, p in source.prefixes]] * 3
    first = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0  # (said once)
    opened: dict[str, SFTDataset] = {}
    out = []
    for s, blend in enumerate(blends):
        live = []
        for w, path, by_split in blend:
            if not num_samples[s]:  # (a split never read: its own files are not tokenized, nor refused if empty)
                continue
            if path not in opened:
                # (kept where Megatron keeps a dataset's indices: --data-cache-path, else cache/ beside the data)
                cache = data.data_cache_path or os.path.join(os.path.dirname(os.path.abspath(path)), "cache")
                said = log if first else None
                opened[path] = SFTDataset(path, source.tokenizer, seq_length, seed, log=said, cache_dir=cache)
            records = opened[path]
            lo, hi = (
                split_document_ranges(records.num_records, data.split_weights)[s]
                if by_split
                else (0, records.num_records)
            )
            # (weights not given: each file in proportion to its records in the split)
            w = float(hi - lo) if w is None else w
            if hi > lo and w > 0:
                live.append((w, records.part(lo, hi)))
        if not live:
            out.append(None)
        elif len(live) == 1:
            out.append(live[0][1])
        else:  # (given weights normalised twice, as the builder's blend of --data-path: see data/builder.py)
            by_size = all(w is None for w, *_ in blend)
            weights = [w for w, _ in live]
            out.append(_Blend([d for _, d in live], weights if by_size else normalize(weights), num_samples[s]))
    if any(d.packed for d in opened.values()):  # (every sample then has document ids: batches stack them)
        for ds in out:
            for d in getattr(ds, "datasets", [ds]) if ds is not None else []:
                d.packed = True
    if source.per_split is None and log is not None and first:  # (--split holds records back from training)
        for path, records in opened.items():
            a, b, c = (hi - lo for lo, hi in split_document_ranges(records.num_records, data.split_weights))
            keep = "; --split 100,0,0 trains on every record" if b or c else ""  # (not said when it does)
            log(f"--sft {path}: {records.num_records} records, {a} for training, {b} validation, {c} test "
                f"(--split {data.split}{keep})")  # fmt: skip
    return tuple(out)
