"""--sft reads Megatron's {"messages": [...]} conversations (data/sft_messages.py): rendered by the tokenizer's
chat template, every assistant turn trained and nothing else, checked against transformers' own
apply_chat_template and its return_assistant_tokens_mask (a template with {% generation %} blocks marks the
replies independently of our prefix rendering)."""

from __future__ import annotations

import json

import pytest

from megatron_lite.config import ConfigError
from megatron_lite.data.sft import SFTDataset
from megatron_lite.data.tokenizers import build_tokenizer

CHATML = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}{% else %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama-2-chat's shape: a BOS the template writes, replies closed by the EOS (</s>) the tokenizer ends documents with
LLAMA2 = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{% generation %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endgeneration %}{% if not loop.last %}"
    "{{ bos_token }}{% endif %}{% endif %}{% endfor %}"
)
TALK = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "yes, hello"},
    {"role": "user", "content": "again?"},
    {"role": "assistant", "content": "the quick brown fox"},
]


def _tokenizer(folder, template: str, style: str = "chatml") -> str:
    """A byte-level BPE tokenizer.json (as Qwen's and Llama-3's) with the template in tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"] if style == "llama2" else ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    hf.train_from_iterator(["You are brief. hello there yes, hello again? the quick brown fox [INST] [/INST]"] * 4,
                           trainer)  # fmt: skip
    if style == "llama2":  # (Llama-2's "<s> $A": a BOS on every text the tokenizer encodes)
        hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template}
    config |= {"bos_token": "<s>", "eos_token": "</s>"} if style == "llama2" else {"eos_token": "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def _oracle(folder: str, messages: list[dict]) -> tuple[list[int], list[int]]:
    """transformers' ids of the rendered conversation and its assistant mask from the {% generation %} blocks."""
    from transformers import AutoTokenizer

    out = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def _write(path, *conversations) -> str:
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return str(path)


# Qwen's shape: a default system turn where the conversation brings none
QWEN = CHATML.replace(
    "{% for m in messages %}",
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}",
)


@pytest.mark.parametrize("style", ["chatml", "llama2", "ends-on-user", "qwen", "llama2-template-no-bos"])
def test_every_assistant_turn_is_trained_and_nothing_else(tmp_path, style):
    """`qwen`: a template writing a default system turn; `llama2-template-no-bos`: a tokenizer adding a BOS to
    every text under a template that writes none (TinyLlama-Chat's, Zephyr's): transformers' ids have no BOS (ours
    had one, from an exploratory run)."""
    template = {"llama2": LLAMA2, "llama2-template-no-bos": LLAMA2.replace("{{ bos_token }}{% for", "{% for", 1)}
    folder = _tokenizer(tmp_path / "tok", template.get(style, QWEN if style == "qwen" else CHATML),
                        "llama2" if style.startswith("llama2") else "chatml")  # fmt: skip
    tok = build_tokenizer("HuggingFaceTokenizer", model=folder)
    messages = TALK[1:] if style.startswith("llama2") else TALK  # (Llama-2's template has no system turn)
    if style == "ends-on-user":  # (the EOD after it is trained all the same, as Megatron's SFTDataset has it)
        messages = TALK + [{"role": "user", "content": "hello"}]
    if style == "qwen":
        messages = TALK[1:]
    ids, replies = _oracle(folder, messages)
    # (ChatML's last reply ends "<|im_end|>\n": an EOD follows; Llama-2's ends on the EOD itself)
    assert sum(replies) > 0 and (ids[-1] == tok.eod) == style.startswith("llama2")
    assert (ids[0] == tok.bos) == (style == "llama2")
    if ids[-1] != tok.eod:  # (Megatron's SFTDataset closes the conversation with a trained EOD)
        ids, replies = ids + [tok.eod], replies + [1]
    n = len(ids) - 1
    s = SFTDataset(_write(tmp_path / "d.jsonl", messages), tok, seq_length=n + 3, seed=0)[0]
    assert s["tokens"].tolist()[:n] == ids[:-1]  # the rendering, one BOS where the template writes one
    assert s["labels"].tolist()[:n] == ids[1:]
    assert s["loss_mask"].tolist() == [float(r) for r in replies[1:]] + [0.0] * 3  # (label j is token j + 1)


class _Plain:
    """A template with no markers between turns: a user turn is "?" + its text, a reply its text alone."""

    def render(self, messages, generation_prompt=False, where=""):
        return "".join(("?" if m["role"] == "user" else "") + m["content"] for m in messages)


def _merging(text: str) -> list[int]:
    """Characters' codes, "o?" merged into one token (100), as BPE merges across a reply's end."""
    ids, i = [], 0
    while i < len(text):
        ids.append(100 if text[i : i + 2] == "o?" else ord(text[i]))
        i += 2 if ids[-1] == 100 else 1
    return ids


def test_a_token_merged_across_a_replys_end_is_the_replys():
    """As transformers' assistant mask marks a token that starts inside the reply (and as a prompt/response
    record gives the merged token to the response)."""
    from megatron_lite.data.sft_messages import conversation_ids

    talk = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "go"},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]  # fmt: skip
    ids, trained = conversation_ids(talk, _Plain(), _merging, "x")
    assert ids == [ord("?"), ord("a"), ord("g"), 100, ord("b"), ord("c")]
    assert trained == [0, 0, 1, 1, 0, 1]


def test_a_long_conversation_loses_its_end_as_megatrons_does(tmp_path):
    folder = _tokenizer(tmp_path / "tok", CHATML)
    tok = build_tokenizer("HuggingFaceTokenizer", model=folder)
    ids, replies = _oracle(folder, TALK)
    fits = len(_oracle(folder, TALK[:3])[0]) + 1  # (and its EOD)
    assert fits < len(ids)
    path = _write(tmp_path / "d.jsonl", TALK, TALK[:3])
    d = SFTDataset(path, tok, seq_length=fits - 1, seed=0)
    assert d.cut == (0, 1)  # (the first lost its last reply and EOD; the second fits exactly)
    assert d.untrained == 0
    prompt, response = d.record(0)
    assert prompt + response == ids[:fits]
    first = next(i for i, r in enumerate(replies) if r)
    # (a sequence that ends before the first reply's first label: nothing trained in either)
    assert SFTDataset(path, tok, seq_length=first - 1, seed=0).untrained == 2
    assert len(prompt) == first


def test_the_entry_point_trains_on_messages_and_generate_prompts_with_them(tmp_path, capsys, monkeypatch):
    """The whole entry point on a messages file, --tokenizer-model naming the tokenizer's folder; then
    tools/generate.py prompts the trained model with a conversation: the template's rendering with its
    generation prompt, transformers' apply_chat_template(add_generation_prompt=True) ids."""
    from test_convert import generate_cli
    from test_pretrain_cli import _run
    from transformers import AutoTokenizer

    folder = _tokenizer(tmp_path / "tok", CHATML)
    data = _write(tmp_path / "d.jsonl", *[TALK, TALK[:3], TALK[1:3]] * 4)
    log, ckpt = tmp_path / "log.jsonl", str(tmp_path / "ckpt")
    rc, out, err = _run(
        ["--sft", "--data-path", data, "--split", "100,0,0", "--tokenizer-type", "HuggingFaceTokenizer",
         "--tokenizer-model", folder, "--train-iters", "2", "--seq-length", "64", "--log-jsonl", str(log),
         "--save", ckpt],
        capsys, monkeypatch,
    )  # fmt: skip
    assert rc == 0, err
    assert f"--sft {data}: 12 records, 12 for training" in out
    losses = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["iteration"] for r in losses] == [1, 2] and all(r["lm_loss"] > 0 for r in losses), losses
    asked = TALK[:2]
    prompts, result = tmp_path / "p.jsonl", tmp_path / "out.json"
    prompts.write_text(json.dumps({"messages": asked}) + "\n" + json.dumps({"messages": [{"role": "bot"}]}) + "\n")
    argv = ["--load", ckpt, "--prompts-file", str(prompts), "--max-new-tokens", "2", "--output-json", str(result)]
    assert generate_cli.main(argv) == 2  # (the second line's turn, named with its line)
    assert f'--prompts-file {prompts} line 2: turn 0 of "messages" is not a' in capsys.readouterr().err
    prompts.write_text(json.dumps({"messages": asked}) + "\n")
    assert generate_cli.main(argv) == 0
    want = AutoTokenizer.from_pretrained(folder).apply_chat_template(asked, tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert json.loads(result.read_text())[0]["prompt_ids"] == want


@pytest.mark.parametrize(
    "messages,message",
    [
        ([{"role": "user", "content": "hi"}], "the conversation has no assistant turn, so nothing in it would be"),
        # (a default system turn and the assistant header before it were trained, from an exploratory run)
        (TALK[2:], "the conversation opens with an assistant turn: give the user turn it answers"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}],
         "turn 1 is an empty assistant turn"),
        ([{"role": "bot", "content": "hi"}], 'turn 0 has role "bot"; expected one of system, user, assistant, tool'),
        ([{"role": "user", "text": "hi"}], 'turn 0 of "messages" is not a {"role": str, "content": str} object'),
        ([], '"messages" must be a non-empty list'),
    ],
)  # fmt: skip
def test_bad_conversations_are_refused_with_their_line(tmp_path, messages, message):
    folder = _tokenizer(tmp_path / "tok", CHATML)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": TALK}) + "\n" + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(ConfigError, match="^" + str(path).replace(".", r"\.") + ":2: " + _escape(message)):
        SFTDataset(str(path), build_tokenizer("HuggingFaceTokenizer", model=folder), seq_length=64, seed=0)


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    """A template that renders the last reply apart (as some strip earlier replies' reasoning): no span of the
    whole is the reply's alone."""
    template = CHATML.replace("{% generation %}", "{% if loop.last %}FINAL {% endif %}{% generation %}")
    folder = _tokenizer(tmp_path / "tok", template)
    path = _write(tmp_path / "d.jsonl", TALK)
    with pytest.raises(ConfigError, match=r"d\.jsonl:1: the chat template does not render this conversation turn by"):
        SFTDataset(path, build_tokenizer("HuggingFaceTokenizer", model=folder), seq_length=64, seed=0)


def test_a_template_raising_on_a_conversation_is_one_line_naming_it(tmp_path):
    """Gemma's and Llama-2's templates raise_exception on a system turn or roles that do not alternate: a jinja2
    traceback naming no line, from a review."""
    template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    folder = _tokenizer(tmp_path / "tok", template + CHATML)
    path = _write(tmp_path / "d.jsonl", TALK[1:], TALK)
    with pytest.raises(ConfigError, match=r"d\.jsonl:2: the chat template refuses this conversation: System role not"):
        SFTDataset(path, build_tokenizer("HuggingFaceTokenizer", model=folder), seq_length=64, seed=0)


def test_a_tokenizer_without_a_chat_template_is_named(tmp_path):
    folder = _tokenizer(tmp_path / "tok", CHATML)
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    path = _write(tmp_path / "d.jsonl", TALK)
    with pytest.raises(ConfigError, match=r'd\.jsonl:1: "messages" records need a chat template, and .*tok has none'):
        SFTDataset(path, build_tokenizer("HuggingFaceTokenizer", model=folder), seq_length=64, seed=0)


OTHER = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "the fox?"},
    {"role": "assistant", "content": "quick brown"},
]


def test_conversations_packed_into_a_line_keep_their_own_positions_and_attention(tmp_path):
    """Megatron's SFTDataset splits a line at each system turn and packs the conversations into one sample, each
    closed by its EOD, positions restarting, attention inside each (its cu_seqlens; here document ids)."""
    folder = _tokenizer(tmp_path / "tok", CHATML)
    tok = build_tokenizer("HuggingFaceTokenizer", model=folder)
    (a, ra), (b, rb) = _oracle(folder, TALK), _oracle(folder, OTHER)
    a, ra, b, rb = a + [tok.eod], ra + [1], b + [tok.eod], rb + [1]
    ids, replies = a + b, ra + rb
    n = len(ids) - 1
    s = SFTDataset(_write(tmp_path / "d.jsonl", TALK + OTHER), tok, seq_length=n + 2, seed=0)[0]
    assert s["tokens"].tolist()[:n] == ids[:-1]
    assert s["loss_mask"].tolist() == [float(r) for r in replies[1:]] + [0.0] * 2
    # (the padding goes with the last conversation, after its tokens: no real token attends to it)
    assert s["document_ids"].tolist() == [0] * len(a) + [1] * (len(b) + 1)
    assert s["position_ids"].tolist() == list(range(len(a))) + list(range(len(b) + 1))
    # one conversation a line, in a file that packs none: no document ids (plain causal attention, as before)
    assert "document_ids" not in SFTDataset(_write(tmp_path / "e.jsonl", TALK), tok, seq_length=n, seed=0)[0]


def test_a_packed_line_trains_as_its_conversations_apart(tmp_path, capsys, monkeypatch):
    """One step on a line packing two conversations (global batch 1) equals one step on the two as lines of
    their own (global batch 2): the same trained tokens with the same logits, the loss per token over the batch."""
    from test_pretrain_cli import _run

    folder = _tokenizer(tmp_path / "tok", CHATML)
    common = ["--sft", "--split", "100,0,0", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", folder,
              "--train-iters", "1", "--seq-length", "128", "--micro-batch-size", "1", "--hidden-dropout", "0",
              "--attention-dropout", "0"]  # fmt: skip
    logged = []
    for name, lines, gbs in (("packed", [TALK + OTHER], "1"), ("apart", [TALK, OTHER], "2")):
        log = tmp_path / f"{name}.jsonl"
        data = _write(tmp_path / f"{name}_d.jsonl", *lines)
        argv = [*common, "--data-path", data, "--global-batch-size", gbs, "--log-jsonl", str(log)]
        rc, _, err = _run(argv, capsys, monkeypatch)
        assert rc == 0, err
        logged.append(json.loads(log.read_text().splitlines()[0]))
    packed, apart = logged
    assert packed["lm_loss"] == pytest.approx(apart["lm_loss"], rel=1e-6), logged
    assert packed["grad_norm"] == pytest.approx(apart["grad_norm"], rel=1e-5), logged


def test_a_blend_with_one_packed_file_gives_every_sample_document_ids(tmp_path):
    """Batches stack their samples' fields: a file of one conversation a line blended with a packed one gets
    document ids too (one document a sample), in every split."""
    from megatron_lite.data.builder import build_datasets, resolve_data
    from megatron_lite.data.config import DataConfig

    folder = _tokenizer(tmp_path / "tok", CHATML)
    plain, packed = _write(tmp_path / "a.jsonl", *[TALK] * 6), _write(tmp_path / "b.jsonl", *[TALK + OTHER] * 6)
    data = DataConfig(data_path=("1", plain, "1", packed), split="50,50,0", sft=True,
                      tokenizer_type="HuggingFaceTokenizer", tokenizer_model=folder)  # fmt: skip
    train, valid, _ = build_datasets(resolve_data(data, log=lambda m: None), data, (8, 8, 0), 128, 0)
    for ds in (train, valid):
        samples = [ds[i] for i in range(8)]
        assert all("document_ids" in s for s in samples)
        assert {int(s["document_ids"].max()) for s in samples} == {0, 1}  # (plain ones: one document)


@pytest.mark.parametrize("bos", [True, False])
def test_a_prompt_conversation_is_what_transformers_renders(tmp_path, bos):
    """tools/generate.py's {"messages": [...]} prompts: apply_chat_template(add_generation_prompt=True)'s ids,
    whether the template writes the BOS or only the tokenizer would add one (it then had one transformers has not)."""
    from transformers import AutoTokenizer

    from megatron_lite.data.sft import chat_prompt_ids
    from megatron_lite.data.sft_messages import ChatTemplate

    folder = _tokenizer(tmp_path / "tok", LLAMA2 if bos else LLAMA2.replace("{{ bos_token }}{% for", "{% for", 1),
                        "llama2")  # fmt: skip
    tok = build_tokenizer("HuggingFaceTokenizer", model=folder)
    asked = TALK[1:4]
    want = AutoTokenizer.from_pretrained(folder).apply_chat_template(asked, tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert chat_prompt_ids(tok, ChatTemplate(tok, "x"), asked, "x") == want
    assert (want[0] == tok.bos) == bos


def test_a_record_with_both_forms_is_refused(tmp_path):
    """A line with "messages" and "prompt"/"response" trained one of them without a word (an exploratory run)."""
    folder = _tokenizer(tmp_path / "tok", CHATML)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": TALK, "prompt": "a", "response": "b"}) + "\n")
    with pytest.raises(ConfigError, match=r'd\.jsonl:1: the record has both "messages" and "prompt": give one'):
        SFTDataset(str(path), build_tokenizer("HuggingFaceTokenizer", model=folder), seq_length=64, seed=0)


def test_flags_sft_data_ignores_say_so_once(tmp_path, capsys, monkeypatch):
    """--reset-attention-mask with --sft said attention ran through a document mask, then that the flag had no
    effect (the latter is so); --eod-mask-loss read as if it acted (Megatron's SFTDataset ignores both)."""
    from test_pretrain_cli import _run

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": "1 2 3", "response": "4 5"}) + "\n" for _ in range(8)))
    argv = ["--sft", "--data-path", str(data), "--split", "100,0,0", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "100", "--train-iters", "1", "--reset-attention-mask", "--eod-mask-loss"]  # fmt: skip
    rc, out, err = _run(argv, capsys, monkeypatch)
    assert rc == 0, err
    assert "document mask" not in out and "have no effect on mock or --sft data" in out, out
    assert "--eod-mask-loss has no effect on --sft data" in out + err, out + err
