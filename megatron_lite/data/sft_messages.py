"""Megatron's SFT conversations: a JSONL record {"messages": [{"role": ..., "content": ...}, ...]} rendered by the
tokenizer's own chat template (tokenizer_config.json's "chat_template", or chat_template.jinja, beside the
tokenizer file), through transformers' apply_chat_template as Megatron's SFTTokenizer renders it. Every assistant
turn carries loss, as in Megatron's SFTDataset; the system and user turns, and the assistant header the template
writes before a reply (its generation prompt), do not. An assistant turn is the whole text the template adds for
it: render(turns up to it) minus render(turns before it, with the generation prompt), as Megatron's SFTTokenizer
trains a turn's tokens; transformers' return_assistant_tokens_mask marks the same span where a template's
{% generation %} block covers the whole turn (one that leaves the turn's closing newline out of it trains that
newline here). A token merged across the boundary goes to the reply, as in prompt/response records. The
end-of-document token closes the conversation and is trained (Megatron's SFTDataset, unless the template
already ended on it).

A line may hold several conversations, each opened by a system turn, as Megatron's SFTDataset packs them: each is
rendered alone and closed by its end-of-document token, and they share the sample with positions restarting and
attention kept inside each (Megatron's cu_seqlens; here the sample's document ids). Refused, with the line: a
template that does not render a conversation turn by turn (an earlier turn's text changes once a later one
follows), where no span is the reply's alone."""

from __future__ import annotations

import os

from megatron_lite.config import ConfigError

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplate:
    """The chat template beside a tokenizer file, rendered by transformers (imported on first use)."""

    def __init__(self, tokenizer, where: str) -> None:
        path = getattr(tokenizer, "path", None)
        kind = type(tokenizer).__name__
        if not path:
            raise ConfigError(
                f'{where}: "messages" records need a chat template, and the {kind} has none: use '
                '--tokenizer-type HuggingFaceTokenizer with a tokenizer_config.json holding "chat_template"'
            )
        self.folder = os.path.dirname(os.path.abspath(path))
        try:
            from transformers import AutoTokenizer
        except ImportError:  # (Megatron's SFTTokenizer needs it too)
            msg = f'{where}: "messages" records are rendered by transformers: pip install transformers'
            raise ConfigError(msg) from None
        try:
            self._hf = AutoTokenizer.from_pretrained(self.folder)
        except Exception as e:  # (a folder transformers cannot read)
            raise ConfigError(f"{where}: transformers cannot read the tokenizer in {self.folder} ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None  # fmt: skip
        if not getattr(self._hf, "chat_template", None):
            raise ConfigError(
                f'{where}: "messages" records need a chat template, and {self.folder} has none (tokenizer_config.json '
                '"chat_template" or chat_template.jinja): add the model\'s, or give "prompt"/"response" records'
            )

    def render(self, messages: list[dict], generation_prompt: bool = False, where: str = "") -> str:
        if not messages:
            return ""
        try:
            return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # (a template's raise_exception: Gemma's on a system turn, Llama-2's on roles that
            # do not alternate; it was a jinja2 traceback naming no line)
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"{where}: the chat template refuses this conversation: {msg}") from None


def check_messages(messages, where: str, prompt: bool = False) -> list[dict]:
    """The conversation as a list of {"role", "content"} turns, or a one-line error naming the line. `prompt`: a
    conversation to generate the next reply to (tools/generate.py), which needs no reply of its own."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} turns')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConfigError(f'{where}: turn {i} of "messages" is not a {{"role": str, "content": str}} object')
        if m["role"] not in ROLES:
            raise ConfigError(f'{where}: turn {i} has role "{m["role"]}"; expected one of {", ".join(ROLES)}')
        if m["role"] == "assistant" and not m["content"]:  # (Megatron's SFTTokenizer refuses it too)
            raise ConfigError(f"{where}: turn {i} is an empty assistant turn: drop it or give its answer")
    if messages[0]["role"] == "assistant" and not prompt:
        # (what the template puts before it, a default system turn or the assistant header, was trained: from an
        # exploratory run; transformers renders no conversation of no turns, and Megatron asserts a user turn)
        raise ConfigError(f"{where}: the conversation opens with an assistant turn: give the user turn it answers")
    if not prompt and not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where}: the conversation has no assistant turn, so nothing in it would be trained")
    return messages


def split_conversations(messages: list[dict]) -> list[list[dict]]:
    """Megatron's SFTDataset._split_conversations: a line holds conversations packed together, each opened by a
    system turn (the first may have none)."""
    out: list[list[dict]] = []
    for m in messages:
        if m["role"] == "system" or not out:
            out.append([])
        out[-1].append(m)
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids a and b share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def conversation_ids(messages: list[dict], template: ChatTemplate, encode, where: str) -> tuple[list[int], list[int]]:
    """(ids, trained): the rendered conversation's ids (by `encode`, which reads a rendered text as --sft reads a
    prompt) and, per token, 1 where it belongs to an assistant turn."""
    text = template.render(messages, where=where)
    ids = encode(text)
    trained = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, upto = template.render(messages[:i], True, where), template.render(messages[: i + 1], where=where)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ConfigError(
                f"{where}: the chat template does not render this conversation turn by turn (turn {i}'s text changes "
                'once later turns follow), so its replies cannot be marked: give "prompt"/"response" records'
            )
        start = common_prefix(encode(before), ids) if before else 0
        head = encode(upto)
        end = common_prefix(head, ids)
        end = end + 1 if end < len(head) else end  # (the token merged across the reply's end is the reply's)
        trained[start:end] = [1] * (end - start)
    return ids, trained
