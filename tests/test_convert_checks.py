"""The converter's edges, from a review of real conversions: the Hub's own GPT-2 file names, directories that do
not hold what config.json describes (missing tensors were skipped, then exported as random weights), quantised
checkpoints, the files that travel with the weights, and what an export writes into config.json."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("convert_tool_checks", ROOT / "tools/checkpoint/convert.py")
convert = importlib.util.module_from_spec(spec)
spec.loader.exec_module(convert)


def _llama(path: pathlib.Path, **changes) -> str:
    changes = {"tie_word_embeddings": False, **changes}
    cfg = transformers.LlamaConfig(vocab_size=250, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   initializer_range=0.05, **changes)  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


def _to_ours(src: str, dst, capsys) -> tuple[int, str, str]:
    capsys.readouterr()  # (transformers' progress bars while the sources were written)
    rc = convert.main(["--loader", "hf", "--saver", "megatron_lite", "--load-dir", src, "--save-dir", str(dst)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _to_hf(src, dst, capsys, *extra: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = convert.main(["--loader", "megatron_lite", "--saver", "hf", "--load-dir", str(src), "--save-dir", str(dst),
                       *extra])  # fmt: skip
    out = capsys.readouterr()
    return rc, out.out, out.err


def _one_line(rc: int, err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def _rewrite(src: str, dst: pathlib.Path, edit=None, **config) -> str:
    """A copy of the HF directory `src` with its tensors passed through `edit` and config.json updated."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    save_file(edit(tensors) if edit else tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    return str(dst)


def test_the_hubs_gpt2_files_without_the_transformer_prefix_convert(tmp_path, capsys):
    """openai-community/gpt2 and distilgpt2 name their tensors `wte.weight`, `h.0.attn.c_attn.weight` and hold the
    `h.N.attn.bias` mask buffers; transformers loads them. They were a KeyError traceback."""
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")

    def hub_names(t):
        out = {k.removeprefix("transformer."): v for k, v in t.items() if k != "lm_head.weight"}
        # (the mask buffers in uint8, as some transformers releases stored them: not a quantised tensor)
        return {**out, **{f"h.{i}.attn.bias": torch.tril(torch.ones(1, 1, 32, 32)).to(torch.uint8) for i in range(2)}}

    hub = _rewrite(str(tmp_path / "gpt2"), tmp_path / "hub", hub_names)
    assert _to_ours(str(tmp_path / "gpt2"), tmp_path / "a", capsys)[0] == 0
    rc, _, err = _to_ours(hub, tmp_path / "b", capsys)
    assert rc == 0, err
    from megatron_lite.checkpoint.hf_convert import read_model_tensors

    a, b = read_model_tensors(str(tmp_path / "a"))[1], read_model_tensors(str(tmp_path / "b"))[1]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _drop(*names):
    return lambda t: {k: v for k, v in t.items() if k not in names}


QKV = (("q", 32), ("k", 16), ("v", 16))
CASES = {
    # skipped silently before: a checkpoint that failed at --load, or exported with random q/k/v weights
    "missing_q": (_drop("model.layers.1.self_attn.q_proj.weight"), {}, "lacks 1 tensor(s) the model needs"),
    "missing_norm": (_drop("model.norm.weight"), {}, "decoder.final_layernorm.weight"),
    "missing_lm_head": (_drop("lm_head.weight"), {}, "lacks the tensor lm_head.weight"),
    # config.json that does not describe the files: KeyError and RuntimeError tracebacks, or silently accepted
    "more_layers": (None, {"num_hidden_layers": 3}, "lacks the tensor model.layers.2."),
    # (named as the files name them: they were named as ours, decoder.layers.0.self_attention.linear_qkv.weight)
    "kv_heads": (
        None,
        {"num_key_value_heads": 4},
        "model.layers.0.self_attn.k_proj.weight (16, 32) (expected (32, 32))",
    ),
    "vocab": (None, {"vocab_size": 256}, "model.embed_tokens.weight (250, 32) (expected (256, 32))"),
    "ffn": (None, {"intermediate_size": 47}, "model.layers.0.mlp.down_proj.weight (32, 48) (expected (32, 47))"),
    # an integer weight was cast without a word
    "int32": (
        lambda t: {**t, "model.norm.weight": t["model.norm.weight"].to(torch.int32)},
        {},
        "model.norm.weight in int32",
    ),
    "bias_in_files": (
        lambda t: {**t, **{f"model.layers.0.self_attn.{p}_proj.bias": torch.zeros(n) for p, n in QKV}},
        {},
        "has no place for",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_files_that_config_json_does_not_describe_are_one_line(tmp_path, capsys, case):
    edit, config, fragment = CASES[case]
    src = _rewrite(_llama(tmp_path / "hf"), tmp_path / "edited", edit, **config)
    rc, _, err = _to_ours(src, tmp_path / "ours", capsys)
    _one_line(rc, err, fragment)
    assert not (tmp_path / "ours" / "iter_0000000").exists()


def test_a_malformed_config_json_and_an_hf_directory_given_to_pretrain_are_one_line(tmp_path, capsys, monkeypatch):
    src = _llama(tmp_path / "hf")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    (bad / "config.json").write_text("<html>404</html>")
    rc, _, err = _to_ours(str(bad), tmp_path / "o", capsys)
    _one_line(rc, err, "config.json is not JSON")

    from megatron_lite.training.pretrain import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    capsys.readouterr()
    rc = main(["--load", src, "--mock-data", "--vocab-size", "100", "--num-layers", "1", "--hidden-size", "32",
               "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1"])  # fmt: skip
    _one_line(rc, capsys.readouterr().err, "it is a Hugging Face model directory", "--loader hf --saver megatron_lite")


def test_quantised_checkpoints_are_refused_and_a_stale_quantization_config_is_dropped(tmp_path, capsys):
    """FP8 weights with block scales (DeepSeek-V3 on the Hub) were refused only after mapping, naming tensors, and
    FP8 without scales converted as unscaled weights; a dequantised checkpoint's leftover quantization_config was
    exported, so loaders would read bf16 weights as FP8."""
    src = _llama(tmp_path / "hf")
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}

    def to_fp8(t, scales=True):
        w = "model.layers.0.mlp.down_proj.weight"
        out = {**t, w: t[w].to(torch.float8_e4m3fn)}
        return {**out, w + "_scale_inv": torch.ones(1, 1)} if scales else out

    for name, edit in (("scaled", to_fp8), ("unscaled", lambda t: to_fp8(t, scales=False))):
        q = _rewrite(src, tmp_path / name, edit, quantization_config=fp8)
        rc, _, err = _to_ours(q, tmp_path / f"o_{name}", capsys)
        _one_line(rc, err, "is a quantised checkpoint (fp8;", "float8_e4m3fn", "dequantise it to bf16")
    stale = _rewrite(src, tmp_path / "dequantised", None, quantization_config=fp8)
    rc, out, err = _to_ours(stale, tmp_path / "ours", capsys)
    assert rc == 0 and "names quantization 'fp8' but the weights are not quantised" in out, out + err
    assert _to_hf(tmp_path / "ours", tmp_path / "back", capsys)[0] == 0
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert "quantization_config" not in back and back["initializer_range"] == 0.05  # (the base's, not 0.02)


def test_side_files_travel_and_a_reconversion_leaves_none_of_the_earlier_ones(tmp_path, capsys):
    """The chat template (its own file since transformers 4.47) and the licence were dropped both ways, so an
    exported Instruct model had no chat template; converting another model into the same --save-dir kept the
    first one's tokenizer, which the new checkpoint then named."""
    src = _llama(tmp_path / "hf")
    for f, text in (("chat_template.jinja", "{{ messages }}"), ("LICENSE", "terms"), ("tokenizer.json", "{}")):
        (pathlib.Path(src) / f).write_text(text)
    assert _to_ours(src, tmp_path / "ours", capsys)[0] == 0
    assert _to_hf(tmp_path / "ours", tmp_path / "back", capsys)[0] == 0
    for f in ("chat_template.jinja", "LICENSE", "tokenizer.json"):
        assert (tmp_path / "back" / f).read_text() == (pathlib.Path(src) / f).read_text(), f
    other = _llama(tmp_path / "other")
    assert _to_ours(other, tmp_path / "ours", capsys)[0] == 0
    assert sorted(os.listdir(tmp_path / "ours" / "hf")) == sorted(
        f for f in os.listdir(other) if "safetensors" not in f
    )
    meta = json.loads((tmp_path / "ours" / "iter_0000000" / "metadata.json").read_text())
    assert meta["config"]["data"]["tokenizer_model"] is None  # (it named the first model's tokenizer.json)


def test_an_export_into_its_tokenizers_own_directory_keeps_the_tokenizer(tmp_path):
    """An earlier export's side files are cleared first, but not where the directory is itself their source (a
    model trained on --tokenizer-model DIR/tokenizer.json exported into DIR lost its tokenizer)."""
    from megatron_lite.checkpoint.hf_files import TOKENIZER_FILES, write_hf_dir

    (tmp_path / "tokenizer.json").write_text("{}")
    write_hf_dir(str(tmp_path), {"w": torch.zeros(2)}, {"a": 1}, [(str(tmp_path), TOKENIZER_FILES)])
    assert (tmp_path / "tokenizer.json").read_text() == "{}"


def test_a_save_dir_holding_a_training_run_is_refused(tmp_path, capsys):
    src = _llama(tmp_path / "hf")
    assert _to_ours(src, tmp_path / "ours", capsys)[0] == 0
    shutil.copytree(tmp_path / "ours" / "iter_0000000", tmp_path / "ours" / "iter_0000100")
    (tmp_path / "ours" / "latest_checkpointed_iteration.txt").write_text("100")
    rc, _, err = _to_ours(src, tmp_path / "ours", capsys)
    _one_line(rc, err, "holds a training run's checkpoints (iterations [100])", "give an empty directory")


def test_a_model_trained_from_scratch_exports_its_tokenizers_ids(tmp_path, capsys, pretrain_job):
    """With no Hugging Face config to start from, bos/eos were null (transformers then took its class defaults,
    1 and 2) and the tokenizer directory's generation_config.json (another model's) was copied along."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["<|endoftext|>", "[UNK]", "<s>", *[f"w{i}" for i in range(60)]]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "generation_config.json").write_text(json.dumps({"eos_token_id": 99}))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": "w1 w2 w3 w4"}) + "\n" for _ in range(20)))
    pre = importlib.util.spec_from_file_location("pre_tool_checks", ROOT / "tools/preprocess_data.py")
    mod = importlib.util.module_from_spec(pre)
    pre.loader.exec_module(mod)
    assert mod.main(["--input", str(tmp_path / "docs.jsonl"), "--output-prefix", str(tmp_path / "d"),
                     "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                     str(tmp_path / "tok" / "tokenizer.json"), "--append-eod"]) == 0  # fmt: skip
    pretrain_job(1, ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
                     "--micro-batch-size", "1", "--train-iters", "1", "--data-path", str(tmp_path / "d_text_document"),
                     "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                     str(tmp_path / "tok" / "tokenizer.json"), "--normalization", "RMSNorm", "--swiglu",
                     "--position-embedding-type", "rope", "--disable-bias-linear", "--eval-iters", "0",
                     "--save", str(tmp_path / "ours")])  # fmt: skip
    rc, _, err = _to_hf(tmp_path / "ours", tmp_path / "back", capsys)
    assert rc == 0, err
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (2, 0)
    assert not (tmp_path / "back" / "generation_config.json").exists()
    assert (tmp_path / "back" / "tokenizer.json").exists()


def test_an_export_to_a_wider_dtype_casts_the_fp32_main_weights(tmp_path, capsys, pretrain_job):
    """A --bf16 run keeps fp32 main weights; --target-dtype fp32 wrote the bf16 model weights widened (their
    rounding). At --lr 0 the main weights are the converted source's exactly."""
    src = _llama(tmp_path / "hf")
    assert _to_ours(src, tmp_path / "ours", capsys)[0] == 0
    pretrain_job(1, ["--load", str(tmp_path / "ours"), "--mock-data", "--vocab-size", "249", "--train-iters", "1",
                     "--seq-length", "16", "--micro-batch-size", "1", "--lr", "0", "--bf16", "--eval-iters", "0",
                     "--save", str(tmp_path / "trained")])  # fmt: skip
    assert _to_hf(tmp_path / "trained", tmp_path / "fp32", capsys, "--target-dtype", "fp32")[0] == 0
    a, b = load_file(os.path.join(src, "model.safetensors")), load_file(tmp_path / "fp32" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _to_hf(tmp_path / "trained", tmp_path / "plain", capsys)[0] == 0  # as trained: bf16
    assert {t.dtype for t in load_file(tmp_path / "plain" / "model.safetensors").values()} == {torch.bfloat16}


def test_an_export_keeps_other_files_whole_and_an_interrupted_one_leaves_the_earlier(tmp_path, capsys, monkeypatch):
    """From the converter review: an export into a directory of the user's own files deleted the LICENSE and
    NOTICE it held (SIDE_FILES were cleared whoever wrote them): a directory that is not a Hugging Face model is
    now refused. An export cut short while its weights were written (Ctrl-C, a full disk) had already deleted the
    earlier export's weights and tokenizer; now they are whole until the new files are renamed into place. The
    same for --loader hf: an earlier conversion's hf/ (config, tokenizer) stays beside its checkpoint."""
    from megatron_lite.checkpoint import hf_convert, hf_files

    src = _llama(tmp_path / "hf")
    (pathlib.Path(src) / "tokenizer.json").write_text('{"first": 1}')
    assert _to_ours(src, tmp_path / "ours", capsys)[0] == 0
    mine = tmp_path / "mine"
    mine.mkdir()
    for f in ("LICENSE", "NOTICE", "notes.txt"):
        (mine / f).write_text("the user's")
    rc, _, err = _to_hf(tmp_path / "ours", mine, capsys)
    _one_line(rc, err, f"--save-dir {mine} holds files that are not a Hugging Face model (LICENSE, NOTICE, notes.txt)")
    assert sorted(os.listdir(mine)) == ["LICENSE", "NOTICE", "notes.txt"]

    assert _to_hf(tmp_path / "ours", tmp_path / "back", capsys)[0] == 0
    before = {f: (tmp_path / "back" / f).read_bytes() for f in os.listdir(tmp_path / "back")}

    def cut_short(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(hf_files, "save_file", cut_short)
        with pytest.raises(KeyboardInterrupt):
            _to_hf(tmp_path / "ours", tmp_path / "back", capsys, "--target-dtype", "bf16")
    assert {f: (tmp_path / "back" / f).read_bytes() for f in os.listdir(tmp_path / "back")} == before

    other = _llama(tmp_path / "other", rms_norm_eps=1e-5)
    (pathlib.Path(other) / "tokenizer.json").write_text('{"second": 2}')
    with monkeypatch.context() as m:
        m.setattr(hf_convert, "write_model_checkpoint", lambda *a, **k: cut_short())
        with pytest.raises(KeyboardInterrupt):
            _to_ours(other, tmp_path / "ours", capsys)
    assert (tmp_path / "ours" / "hf" / "tokenizer.json").read_text() == '{"first": 1}'
    assert json.loads((tmp_path / "ours" / "hf" / "config.json").read_text())["rms_norm_eps"] != 1e-5


def test_a_save_dir_under_a_file_is_one_line_before_any_work(tmp_path, capsys):
    """--save-dir under a regular file (a typo'd parent) was a NotADirectoryError traceback after the checkpoint
    had been read, both ways."""
    src = _llama(tmp_path / "hf")
    assert _to_ours(src, tmp_path / "ours", capsys)[0] == 0
    (tmp_path / "afile").write_text("")
    _one_line(*_to_hf(tmp_path / "ours", tmp_path / "afile" / "out", capsys)[::2], "--save-dir", "afile is a file")
    _one_line(*_to_ours(src, tmp_path / "afile" / "out", capsys)[::2], "--save-dir", "afile is a file")


def test_converter_command_lines_a_megatron_user_writes(tmp_path, capsys):
    """A --save-dir that is a file was a traceback both ways; --merge-lora on a checkpoint without adapters did
    nothing silently; flags were read abbreviated (`--target-d`, then ambiguous once a flag is added); Megatron-LM's
    convert.py flags were "no such flag", its loader names "invalid choice" without the one to use here."""
    src = _llama(tmp_path / "hf")
    assert _to_ours(src, tmp_path / "ours", capsys)[0] == 0
    (tmp_path / "afile").write_text("")
    _one_line(*_to_hf(tmp_path / "ours", tmp_path / "afile", capsys)[::2], "--save-dir", "is a file")
    _one_line(*_to_ours(src, tmp_path / "afile", capsys)[::2], "--save-dir", "is a file")
    _one_line(*_to_hf(tmp_path / "ours", tmp_path / "m", capsys, "--merge-lora")[::2], "holds no LoRA adapters")
    assert not (tmp_path / "m").exists()
    base = ["--loader", "megatron_lite", "--saver", "hf", "--load-dir", str(tmp_path / "ours")]
    with pytest.raises(SystemExit) as e:
        convert.main([*base, "--save-dir", str(tmp_path / "x"), "--target-d", "bf16"])
    assert e.value.code == 2 and "--target-d: no such flag" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert.main(["--model-type", "GPT", "--loader", "llama_mistral", "--saver", "mcore", "--load-dir", src,
                      "--save-dir", str(tmp_path / "x")])  # fmt: skip
    assert "'llama_mistral' is not one of hf, megatron_lite (Megatron-LM's loader" in capsys.readouterr().err
    megatron = ["--model-type", "GPT", "--target-tensor-parallel-size", "2", "--max-queue-size", "50"]
    assert convert.main([*base, "--save-dir", str(tmp_path / "back"), *megatron]) == 0
    out = capsys.readouterr().out
    assert "--target-tensor-parallel-size has no effect here: a megatron_lite checkpoint loads under any layout" in out
    assert "--max-queue-size has no effect here" in out


@pytest.mark.parametrize(
    "model_type, listed, window",
    [("mistral", "LlamaForCausalLM", 5), ("llama", "MistralForCausalLM", 4)],
)
def test_the_model_type_decides_the_class_as_in_transformers(tmp_path, capsys, model_type, listed, window):
    """(From an exploratory run) transformers' AutoModelForCausalLM builds the model_type's class whatever
    config.json's architectures lists; the converter went by architectures: a Mistral listing Llama lost its
    window, a Llama listing Mistral gained one, each without a word (logits 98-100% apart)."""
    from test_convert import _hf_logits, _load_ours, _rel

    from megatron_lite.config import ParallelConfig

    src = _rewrite(
        _llama(tmp_path / "hf"), tmp_path / "edited", model_type=model_type, architectures=[listed],
        sliding_window=window,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    rc, out, err = _to_ours(src, tmp_path / "ours", capsys)
    assert rc == 0, err
    built = type(model).__name__
    assert f"config.json lists {listed} but its model_type {model_type} builds {built}: converted as {built}" in out
    ours, _, config = _load_ours(str(tmp_path / "ours"), ParallelConfig())
    assert config.sliding_window == (window if model_type == "mistral" else None)
    ids = [(7 * i + 3) % 250 for i in range(24)]  # (longer than either window)
    with torch.no_grad():
        logits = ours(torch.tensor([ids]))[0].float()[..., :250]
    assert _rel(logits, _hf_logits(model, ids)) <= 1e-5


def test_a_tied_models_differing_lm_head_is_refused_and_an_equal_one_converts(tmp_path, capsys):
    """tie_word_embeddings with an lm_head.weight of other values: transformers 5 unties them and computes with it;
    the converter dropped it without a word (logits 132% apart). The embedding's exact copy is redundant."""
    src = _llama(tmp_path / "hf", tie_word_embeddings=True)

    def head(scale):
        return lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"] * scale}

    rc, _, err = _to_ours(_rewrite(src, tmp_path / "other", head(0.5)), tmp_path / "a", capsys)
    _one_line(rc, err, "ties the output layer to the word embeddings (tie_word_embeddings true) but its lm_head.weight "
              "differs from them")  # fmt: skip
    rc, _, err = _to_ours(_rewrite(src, tmp_path / "copy", head(1.0)), tmp_path / "b", capsys)
    assert rc == 0, err


def test_damaged_json_beside_the_weights_is_one_line_naming_the_file(tmp_path, capsys):
    """(From an exploratory run) a truncated model.safetensors.index.json, one without its weight_map, a config.json
    that is JSON but not an object, and a converted checkpoint's damaged hf/config.json or generation_config.json
    were tracebacks (JSONDecodeError, KeyError, AttributeError) or errors naming no file."""
    from megatron_lite.checkpoint.hf_convert import generation_eos_ids
    from megatron_lite.checkpoint.lookup import read_metadata
    from megatron_lite.config import ConfigError

    src = _llama(tmp_path / "hf")
    for name, text, fragment in (
        ("model.safetensors.index.json", "{", "model.safetensors.index.json is not JSON"),
        ("model.safetensors.index.json", '{"metadata": {}}', "has no weight_map of tensor names to files"),
        ("config.json", "[1, 2]", "config.json is not a JSON object of the model's settings"),
    ):
        bad = tmp_path / f"bad_{len(text)}"
        shutil.copytree(src, bad)
        (bad / name).write_text(text)
        rc, _, err = _to_ours(str(bad), tmp_path / f"o_{len(text)}", capsys)
        _one_line(rc, err, str(bad / name), fragment)
    ours = tmp_path / "ours"
    assert _to_ours(src, ours, capsys)[0] == 0
    (ours / "hf" / "config.json").write_text("{")
    rc, _, err = _to_hf(ours, tmp_path / "back", capsys)
    _one_line(rc, err, f"{ours / 'hf' / 'config.json'} is not JSON")
    shutil.copyfile(src + "/config.json", ours / "hf" / "config.json")
    saved = read_metadata(str(ours / "iter_0000000"))
    for text, fragment in (("{", "generation_config.json is not JSON"), ('{"eos_token_id": "x"}', "eos_token_id 'x'")):
        (ours / "hf" / "generation_config.json").write_text(text)
        with pytest.raises(ConfigError, match="generation_config.json") as e:
            generation_eos_ids(str(ours), saved)
        assert fragment in str(e.value), str(e.value)


def test_a_copied_checkpoint_reads_its_own_tokenizer(tmp_path):
    """A converted checkpoint records its hf/tokenizer.json by absolute path: a copy read the original's while it
    existed (found by an exploratory run), so another model converted into the original's directory since would
    have lent the copy its tokenizer. The checkpoint's own hf/ comes first; a tokenizer given by flag stays."""
    from megatron_lite.checkpoint_flags import tokenizer_beside

    for name in ("a", "b", "c"):
        (tmp_path / name / "hf").mkdir(parents=True)
        (tmp_path / name / "hf" / "tokenizer.json").write_text(name)
    recorded = str(tmp_path / "a" / "hf" / "tokenizer.json")
    own = str(tmp_path / "b" / "hf" / "tokenizer.json")
    assert tokenizer_beside(recorded, str(tmp_path / "b")) == own
    assert tokenizer_beside(recorded, str(tmp_path / "b" / "iter_0000000")) == own  # (the iteration given)
    assert tokenizer_beside(recorded, str(tmp_path / "a")) == recorded
    assert tokenizer_beside(recorded, str(tmp_path / "elsewhere")) == recorded  # (a copy without hf/)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("flag")
    given = str(tmp_path / "tok" / "tokenizer.json")  # (--tokenizer-model of a run trained from scratch)
    assert tokenizer_beside(given, str(tmp_path / "c")) == given


def test_a_deepseek_v3_without_shared_experts_converts(tmp_path, capsys):
    """n_shared_experts 0: transformers saves the shared expert's zero-width tensors, which were refused as
    "tensors the mapping does not use" (an exploratory run's). Empty tensors hold nothing; the logits are
    transformers'."""
    from test_convert import PROMPT, V, _configs, _hf_logits, _rel, ours_at

    from megatron_lite.config import ParallelConfig

    cfg = _configs()["deepseek_v3"]
    cfg.n_shared_experts = 0
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    assert any(t.numel() == 0 for k, t in model.state_dict().items() if "shared_experts" in k)
    model.save_pretrained(tmp_path / "hf")
    rc, _, err = _to_ours(str(tmp_path / "hf"), tmp_path / "ours", capsys)
    assert rc == 0, err
    logits, _ = ours_at(str(tmp_path / "ours"), ParallelConfig(), PROMPT)
    assert _rel(logits[0, :, :V] if logits.dim() == 3 else logits[:, :V], _hf_logits(model, PROMPT)) < 1e-5
