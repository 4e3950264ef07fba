"""Prompt/response records for supervised fine-tuning: the loss mask covers the response (and its closing
end-of-document token) only, never the prompt or the padding; bad records are one-line errors."""

from __future__ import annotations

import json

import pytest

from megatron_lite.config import ConfigError
from megatron_lite.data.sft import SFTDataset


class Words:
    """Ids as text, like NullTokenizer: prompt and response are encoded apart ("1 2" + "3" is not "1 2 3")."""

    eod = 0
    separate_texts = True

    def encode(self, text: str) -> list[int]:
        return [int(w) for w in text.split()]


def test_loss_mask_covers_the_response_only(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "5 6 7", "response": "8 9"}) + "\n")
    s = SFTDataset(str(path), Words(), seq_length=8, seed=0)[0]
    assert s["tokens"].tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert s["labels"].tolist() == [6, 7, 8, 9, 0, 0, 0, 0]
    # labels 8, 9 and the closing end-of-document count; the prompt's own next tokens and the padding do not
    assert s["loss_mask"].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]


def test_long_records_are_cut_and_epochs_reshuffle(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}", "response": "1 2 3 4 5 6 7 8 9"}) + "\n" for i in range(5)))
    d = SFTDataset(str(path), Words(), seq_length=4, seed=0)
    assert d[0]["tokens"].numel() == 4 and d[0]["loss_mask"].tolist() == [1, 1, 1, 1]
    first, second = [int(d[i]["tokens"][0]) for i in range(5)], [int(d[5 + i]["tokens"][0]) for i in range(5)]
    assert sorted(first) == sorted(second) == list(range(5)) and first != second


def test_a_long_prompt_loses_its_start_not_the_response(tmp_path):
    """From a review: a prompt reaching --seq-length left no response token in the sample (no loss, silently);
    Megatron-Bridge cuts the input. The prompt keeps its BOS and its end, and the cut records are counted."""

    class Bos(Words):
        prefix, suffix = [1], []

        def encode(self, text: str) -> list[int]:
            return [1, *super().encode(text)]

    path = tmp_path / "d.jsonl"
    records = [("10 11 12 13 14 15 16 17 18 19", "7 8"), ("10 11", "7 8"), ("10", " ".join(["5"] * 12))]
    path.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in records))
    d = SFTDataset(str(path), Bos(), seq_length=8, seed=0)
    assert d.record(0) == ([1, 15, 16, 17, 18, 19], [7, 8, 0])  # BOS, the prompt's end, the whole response
    assert d.record(1) == ([1, 10, 11], [7, 8, 0])  # fits: as is
    assert d.record(2) == ([1, 10], [5] * 7)  # a response alone too long keeps the prompt (half) and its start
    assert d.cut == (1, 1)
    by_prompt = {tuple(s["tokens"].tolist()[:2]): s for s in (d[i] for i in range(3))}
    assert by_prompt[(1, 15)]["loss_mask"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    # TRL's "completion" names the response; a prompt rendered by a chat template starts with the BOS's text,
    # which the tokenizer reads as BOS before adding its own: one is kept (they were two)
    path.write_text(json.dumps({"prompt": "1 10", "completion": "7"}) + "\n")
    assert SFTDataset(str(path), Bos(), seq_length=8, seed=0).record(0) == ([1, 10], [7, 0])


@pytest.mark.parametrize(
    "record,message",
    [
        ('{"prompt": "1"}', r"d.jsonl:1: expected a JSON object with \"prompt\" and \"response\""),
        ('{"prompt": "1", "response": null}', r"d.jsonl:1: expected .* strings, got str and NoneType"),
        ('{"prompt": "1", "response": "two"}', r"d.jsonl:1: the tokenizer cannot encode it \(ValueError"),
        # (an exploratory run's: each ended in Python's own words, the last trained the turn's end alone)
        ('{"prompt": "1"}', r'd.jsonl:1: .* it has no "response" key$'),
        ('[{"prompt": "1", "response": "2"}]', r"d.jsonl:1: expected .* on each line, got a JSON list$"),
        ('{"prompt": "1", "response": "2"', r"d.jsonl:1: expected .* \(not JSON: Expecting ',' delimiter at column"),
        # (Megatron's conversations need the chat template beside a tokenizer file)
        (
            '{"messages": [{"role": "user", "content": "1"}]}',
            r'd.jsonl:1: "messages" records need a chat template, '
            r"and the Words has none: use --tokenizer-type HuggingFaceTokenizer",
        ),
        ('{"prompt": "1", "response": ""}', r"d.jsonl:1: the response is empty: drop the record or give its answer"),
    ],
)
def test_bad_records_are_refused(tmp_path, record, message):
    path = tmp_path / "d.jsonl"
    path.write_text(record + "\n")
    with pytest.raises(ConfigError, match=message):
        SFTDataset(str(path), Words(), seq_length=4, seed=0)


def test_a_tokenizer_adding_bos_and_eos_around_every_text_gives_one_of_each(tmp_path):
    """A tokenizer.json whose post-processor is "<s> $A </s>" (Llama saved with add_eos_token): the sample is
    <s> prompt response </s>, the loss on the response and </s> only (it was <s> prompt </s> <s> response </s>
    </s>, training on the response's <s> and a doubled </s>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from megatron_lite.data.tokenizers import build_tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "answer": 5, "yes": 6}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> <s> $B </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer("HuggingFaceTokenizer", model=str(tmp_path / "tokenizer.json"))
    assert tok.encode("answer yes") == [1, 5, 6, 2]  # the tokenizer does add both each time
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "hello world", "response": " answer yes"}) + "\n")
    s = SFTDataset(str(path), tok, seq_length=8, seed=0)[0]
    assert s["tokens"].tolist() == [1, 3, 4, 5, 6, 2, 2, 2]
    assert [lab for lab, m in zip(s["labels"].tolist(), s["loss_mask"].tolist()) if m] == [5, 6, 2]
    # generate.py prompts with the ids the prompt trained as (an exploratory run's: its plain encode doubled a
    # rendered prompt's BOS and kept the tokenizer's </s>, ids the model never saw before its response)
    from megatron_lite.data.sft import prompt_ids

    hf.add_special_tokens(["<s>", "</s>"])  # (as a real tokenizer.json lists them: "<s>" in a text is the token)
    (tmp_path / "chat").mkdir()
    hf.save(str(tmp_path / "chat" / "tokenizer.json"))
    chat = build_tokenizer("HuggingFaceTokenizer", model=str(tmp_path / "chat" / "tokenizer.json"))
    assert chat.encode("<s> hello world") == [1, 1, 3, 4, 2]
    assert prompt_ids(chat, "<s> hello world") == prompt_ids(chat, "hello world") == [1, 3, 4]


def test_a_bos_adding_tokenizer_puts_one_bos_per_sample(tmp_path):
    """Llama2Tokenizer starts every encode with <s>; the sample is
    <s> prompt response </s>: one BOS, and the loss only on the response and </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from megatron_lite.data.tokenizers import build_tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "answer": 5, "yes": 6}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<unk>", "<s>", "</s>"])  # (as a converted Llama tokenizer.json lists them)
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x00")
    tok = build_tokenizer("Llama2Tokenizer", model=str(tmp_path / "tokenizer.model"))
    assert tok.encode("answer yes") == [1, 5, 6]  # the tokenizer does add a BOS each time
    path = tmp_path / "d.jsonl"
    # the second prompt as a chat template renders it, starting with the BOS's text: SentencePiece reads that as
    # text ("<", "s", ">"), so the BOS's text is dropped before encoding and the sample holds one BOS
    records = [{"prompt": "hello world", "response": " answer yes"}, {"prompt": "<s>hello world", "response": " yes"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    d = SFTDataset(str(path), tok, seq_length=8, seed=0)
    assert [d.record(i) for i in range(d.num_records)] == [([1, 3, 4], [5, 6, 2]), ([1, 3, 4], [6, 2])]
    s = d[[i for i in range(2) if d[i]["tokens"].tolist()[3] == 5][0]]
    assert s["tokens"].tolist() == [1, 3, 4, 5, 6, 2, 2, 2]
    assert [lab for lab, m in zip(s["labels"].tolist(), s["loss_mask"].tolist()) if m] == [5, 6, 2]


def _llama2_style_tokenizer(folder) -> str:
    """A SentencePiece-converted tokenizer.json as Llama-2's (Prepend("▁") + spaces as "▁", "<s> $A"), a chat
    template in tokenizer_config.json as Llama-2-chat's, and a tokenizer.model beside them (for Llama2Tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors

    pieces = ["<unk>", "<s>", "</s>", "▁", "▁[INST]", "▁hello", "▁[/INST]", "▁yes", "▁answer", "▁again",
              "[INST]", "hello", "[/INST]", "yes", "[", "]", "I", "N", "S", "T", "/", "h", "e", "l", "o", "y", "s",
              "<", ">"]  # fmt: skip
    vocab = [(p, 0.0 if i < 3 else -1.0 if len(p) > 1 else -10.0) for i, p in enumerate(pieces)]
    hf = Tokenizer(models.Unigram(vocab, unk_id=0))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens(["<unk>", "<s>", "</s>"])
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer.model").write_bytes(b"")
    _llama2_style_tokenizer_config(folder, tokenizer_class="PreTrainedTokenizerFast")
    return str(folder)


def _llama2_style_tokenizer_config(folder, **fields) -> None:
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + "
                "' [/INST]' }}{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% if not loop.last %}"
                "{{ bos_token }}{% endif %}{% endif %}{% endfor %}")  # fmt: skip
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": template, **fields}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _llama2_bpe_tokenizer(folder) -> str:
    """Llama-2's tokenizer as its repositories ship it: a byte-fallback BPE tokenizer.json as SentencePiece's
    conversion writes it (Prepend("▁") + spaces as "▁"), and tokenizer_config.json naming LlamaTokenizerFast with
    legacy false, whose pipeline transformers 5 builds its own way (no normalizer, "▁" before the first piece)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    hf = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *bytes_])
    hf.train_from_iterator(["hello again [INST] yes answer [/INST] " * 3, "the quick brown fox jumps"], trainer)
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])  # fmt: skip
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer.model").write_bytes(b"")
    _llama2_style_tokenizer_config(folder, tokenizer_class="LlamaTokenizerFast", legacy=False)
    return str(folder)


@pytest.mark.parametrize("style", ["unigram", "bpe"])
@pytest.mark.parametrize("kind", ["HuggingFaceTokenizer", "Llama2Tokenizer"])
def test_a_chat_rendered_record_tokenizes_as_transformers_chat_template(tmp_path, kind, style):
    """From the SFT review: prompt and response were encoded apart, so SentencePiece opened every response with a
    lone "▁" token (its dummy prefix), trained on; and Llama2Tokenizer read the template's "</s>" and "<s>" as
    text ("</", "s", ">"), training the model to write a literal "</s>". The sample's ids must be those of
    transformers' apply_chat_template on the whole conversation, the loss on the last answer's tokens only."""
    from transformers import AutoTokenizer

    from megatron_lite.data.tokenizers import build_tokenizer

    folder = (_llama2_style_tokenizer if style == "unigram" else _llama2_bpe_tokenizer)(tmp_path)
    reference = AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "answer"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "yes"}]  # fmt: skip
    text = reference.apply_chat_template(chat, tokenize=False)
    prompt = reference.apply_chat_template(chat[:3], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt)
    expected = reference.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    alone = reference.apply_chat_template(chat[:3], tokenize=True, add_generation_prompt=True, return_dict=True)
    # (the answer: what follows the prompt's own tokens; a merge across the boundary, BPE's "]▁", goes to it)
    answer = next(i for i, (a, b) in enumerate(zip([*alone["input_ids"], -1], expected)) if a != b)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "response": text[len(prompt) :]}) + "\n")
    model = folder + ("/tokenizer.json" if kind == "HuggingFaceTokenizer" else "/tokenizer.model")
    s = SFTDataset(str(path), build_tokenizer(kind, model=model), seq_length=len(expected) + 2, seed=0)[0]
    assert s["tokens"].tolist()[: len(expected)] == expected, reference.convert_ids_to_tokens(s["tokens"].tolist())
    trained = [lab for lab, m in zip(s["labels"].tolist(), s["loss_mask"].tolist()) if m]
    assert trained == expected[answer:], reference.convert_ids_to_tokens(trained)


def test_records_are_held_compactly(tmp_path):
    """(From a review at scale: every rank held every record as lists of Python ints, 33 bytes a token.) The
    records' tokens take about 4 bytes each, and read back as written."""
    import tracemalloc

    path = tmp_path / "d.jsonl"
    words = " ".join(str(i % 50 + 1000) for i in range(100))  # (ids past Python's cached small ints, as a vocabulary's)
    path.write_text("".join(json.dumps({"prompt": words, "response": words}) + "\n" for _ in range(200)))
    tracemalloc.start()
    d = SFTDataset(str(path), Words(), seq_length=256, seed=0)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    tokens = 200 * 201
    assert held < 8 * tokens, held / tokens
    assert d.record(199) == ([i % 50 + 1000 for i in range(100)], [i % 50 + 1000 for i in range(100)] + [0])


def test_a_llama_tokenizer_encodes_text_as_the_installed_transformers_does(tmp_path):
    """--tokenizer-type HuggingFaceTokenizer is Megatron's AutoTokenizer: for a tokenizer_config.json naming
    LlamaTokenizerFast (legacy false, as Llama-2's), transformers 5 reads no "▁" after a <s> or </s> in the text,
    nor a doubled one before a leading space, where tokenizer.json's pipeline as written does."""
    from transformers import AutoTokenizer

    from megatron_lite.data.tokenizers import build_tokenizer

    folder = _llama2_bpe_tokenizer(tmp_path)
    reference = AutoTokenizer.from_pretrained(folder)
    ours = build_tokenizer("HuggingFaceTokenizer", model=folder)
    for text in ("<s>[INST] hello [/INST]", "yes</s>again", " hello", "héllo\nthe fox", ""):
        assert ours.encode(text) == reference(text).input_ids, (
            text,
            reference.convert_ids_to_tokens(ours.encode(text)),
        )
