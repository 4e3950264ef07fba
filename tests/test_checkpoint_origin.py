"""How a checkpoint finds the Hugging Face model it came from (checkpoint/origin.py), as a new user's walkthrough
found it lost: a PEFT adapter trained on a fully fine-tuned base named the original model as its base (scoring
differently under AutoPeftModelForCausalLM); a resume into the same --save directory lost the way back (no
generation_config.json eos ids, config.json fields or PEFT base); a moved base checkpoint's tokenizer went missing
from the export without a word; --finetune's dropout note gave no values. Real transformers and PEFT models;
single-process runs of pretrain's main."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
ROOT = pathlib.Path(__file__).resolve().parents[1]
V = 128


def _convert(*args: str) -> int:
    spec = importlib.util.spec_from_file_location("convert_for_origin", ROOT / "tools/checkpoint/convert.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(list(args))


def _converted(tmp_path, monkeypatch) -> str:
    """A tiny Llama with a tokenizer and Llama-3-Instruct-like generation_config.json (two end ids), use_cache
    off, converted to `ckpt`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                                   initializer_range=0.2)  # fmt: skip
    hf = tmp_path / "hf"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(hf)
    words = ["<|endoftext|>", "[UNK]", *[f"w{i}" for i in range(60)]]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(hf / "tokenizer.json"))
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert _convert("--loader", "hf", "--saver", "megatron_lite", "--load-dir", str(hf), "--save-dir",
                    str(tmp_path / "ckpt")) == 0  # fmt: skip
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    return str(tmp_path / "ckpt")


def _train(load: str, save: str, iters: int, *extra: str) -> None:
    from megatron_lite.training.pretrain import main

    argv = ["--load", load, "--finetune", "--save", save, "--mock-data", "--seq-length", "16", "--micro-batch-size",
            "2", "--global-batch-size", "2", "--train-iters", str(iters), "--lr", "2e-2", "--lr-decay-style",
            "constant", "--eval-iters", "0", *extra]  # fmt: skip
    assert main(argv) == 0


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).logits


def test_lora_on_a_fine_tuned_base_names_no_original_model(tmp_path, capsys, monkeypatch):
    """HF -> convert -> full fine-tune -> LoRA on it: the adapter named the original HF directory as its base,
    which AutoPeftModelForCausalLM then loaded (other weights, other scores). It names none now, and says how to
    name the fine-tuned base: exported with --saver hf and given as --base-model-name-or-path, PEFT on it scores
    as our merged export does."""
    ckpt = _converted(tmp_path, monkeypatch)
    ft, lo = str(tmp_path / "ft"), str(tmp_path / "lora")
    _train(ckpt, ft, 2)
    _train(ft, lo, 2, "--lora-rank", "4")
    capsys.readouterr()
    assert _convert("--loader", "megatron_lite", "--saver", "hf-peft", "--load-dir", lo, "--save-dir",
                    str(tmp_path / "adapter")) == 0  # fmt: skip
    assert peft.PeftConfig.from_pretrained(tmp_path / "adapter").base_model_name_or_path is None
    out = capsys.readouterr().out
    assert "--saver hf" in out and "--base-model-name-or-path" in out, out
    # the way the message gives: the base exported, named; PEFT on it equals our merged export
    for args in ((ft, "base"), (lo, "merged", "--merge-lora")):
        assert _convert("--loader", "megatron_lite", "--saver", "hf", "--load-dir", args[0], "--save-dir",
                        str(tmp_path / args[1]), *args[2:]) == 0  # fmt: skip
    assert _convert("--loader", "megatron_lite", "--saver", "hf-peft", "--load-dir", lo, "--save-dir",
                    str(tmp_path / "named"), "--base-model-name-or-path", str(tmp_path / "base")) == 0  # fmt: skip
    ids = torch.randint(2, V, (2, 16), generator=torch.Generator().manual_seed(3))
    merged = _logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged"), ids)
    named = _logits(peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "named"), ids)
    assert (named - merged).abs().max() < 1e-4, (named - merged).abs().max()
    original = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf"), tmp_path / "named"
    )
    assert (_logits(original, ids) - merged).abs().max() > 1e-2  # (what the old base named would have scored)


def test_the_origin_survives_resumes_into_the_same_save(tmp_path, capsys, monkeypatch):
    """A run resumed into its own --save recorded --load as itself, so the walk back to the converted checkpoint
    stopped: generate.py lost generation_config.json's end ids, --saver hf its generation_config.json and
    config.json's fields, --saver hf-peft its base. The origin is now recorded in each checkpoint (--ckpt-keep-last
    pruning the first run's too). Then the converted checkpoint moved: the export says its tokenizer is gone."""
    from megatron_lite.checkpoint.checkpointing import find_checkpoint, read_metadata
    from megatron_lite.checkpoint.hf_convert import generation_eos_ids
    from megatron_lite.checkpoint.origin import run_origin

    ckpt = _converted(tmp_path, monkeypatch)
    ft, lo = str(tmp_path / "ft"), str(tmp_path / "lora")
    # (the weights stay the converted ones only under LoRA, frozen; an upcycling changes them too)
    kept = [
        run_origin(find_checkpoint(ckpt), *how)["converted_weights"]
        for how in ((True, False), (False, False), (True, True))
    ]
    assert kept == [True, False, False]
    capsys.readouterr()
    _train(ckpt, ft, 1, "--ckpt-keep-last", "1")
    first = capsys.readouterr().out
    _train(ckpt, ft, 2, "--ckpt-keep-last", "1")  # (auto-resume: --load becomes --save)
    assert "resuming from it" in capsys.readouterr().out
    _train(ckpt, lo, 1, "--lora-rank", "4")
    _train(ckpt, lo, 2, "--lora-rank", "4", "--async-save")  # (saved from a background thread)
    saved = read_metadata(find_checkpoint(ft))["config"]
    assert saved["checkpoint"]["load"] == ft  # (the resume's: the walk back through --load stopped here)
    assert generation_eos_ids(ft, saved) == [2, 5]
    assert _convert("--loader", "megatron_lite", "--saver", "hf", "--load-dir", ft, "--save-dir",
                    str(tmp_path / "out")) == 0  # fmt: skip
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == [2, 5]
    exported = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert exported.use_cache is False and (tmp_path / "out" / "tokenizer.json").is_file()
    assert _convert("--loader", "megatron_lite", "--saver", "hf-peft", "--load-dir", lo, "--save-dir",
                    str(tmp_path / "adapter")) == 0  # fmt: skip
    assert peft.PeftConfig.from_pretrained(tmp_path / "adapter").base_model_name_or_path == str(tmp_path / "hf")
    spec = importlib.util.spec_from_file_location("inspect_origin", ROOT / "tools/checkpoint/inspect_checkpoint.py")
    inspect = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(inspect)
    capsys.readouterr()
    assert inspect.main([lo]) == 0
    assert f"origin       {tmp_path / 'hf'} (hf/ files {ckpt}/hf; the weights as converted)" in capsys.readouterr().out
    # the conversion itself trained nothing: no training or optimizer settings shown as if a run had used them
    assert inspect.main([ckpt]) == 0
    out = capsys.readouterr().out
    assert "training     none: converted weights" in out and "optimizer    " not in out, out
    # the base moved: no tokenizer to copy, said with the path and the fix
    shutil.move(ckpt, tmp_path / "moved")
    capsys.readouterr()
    assert _convert("--loader", "megatron_lite", "--saver", "hf", "--load-dir", ft, "--save-dir",
                    str(tmp_path / "out2")) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert f"the checkpoint's tokenizer {ckpt}/hf/tokenizer.json no longer exists" in out, out
    assert "copy the tokenizer files" in out and "are gone" in out, out
    # (a review:) the experiment tree moved whole: the record finds hf/ where it lies relative to the checkpoint
    tree = tmp_path / "tree"
    tree.mkdir()
    shutil.move(tmp_path / "moved", tree / "ckpt")
    shutil.move(ft, tree / "ft")
    moved_ft = str(tree / "ft")
    assert generation_eos_ids(moved_ft, read_metadata(find_checkpoint(moved_ft))["config"]) == [2, 5]
    capsys.readouterr()
    assert _convert("--loader", "megatron_lite", "--saver", "hf", "--load-dir", moved_ft, "--save-dir",
                    str(tmp_path / "out3")) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "are gone" not in out and "no tokenizer written" not in out, out
    assert {"generation_config.json", "tokenizer.json"} <= set(os.listdir(tmp_path / "out3"))
    # --finetune's dropouts at Megatron's defaults, said with their values (the checkpoint's were 0.0)
    assert "--hidden-dropout 0.1 (the checkpoint: 0.0), --attention-dropout 0.1 (the checkpoint: 0.0)" in first, first


@pytest.mark.parametrize("recorded", [True, False])
def test_an_emptied_older_load_does_not_stop_a_resume(tmp_path, monkeypatch, recorded):
    """(From a review: the walk back through --load, for a checkpoint with no record, ran at every start and
    stopped a resume with the error of an older --load since emptied.) A from-scratch pretraining P, a fine-tune F
    of it, P's iterations deleted; F resumes into its own --save: with the record (None) nothing is walked, and
    without it (saved before the record) the walk finds nothing and the run goes on."""
    import glob

    from megatron_lite.training.pretrain import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    p, f = str(tmp_path / "p"), str(tmp_path / "f")
    common = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--mock-data",
              "--vocab-size", "127", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
              "--lr", "1e-3", "--eval-iters", "0"]  # fmt: skip
    assert main(["--save", p, "--train-iters", "1", *common]) == 0
    assert main(["--load", p, "--finetune", "--save", f, "--train-iters", "1", *common]) == 0
    for meta in glob.glob(f + "/iter_*/metadata.json"):
        data = json.load(open(meta))
        assert "origin" in data["config"] and data["config"]["origin"] is None
        if not recorded:  # (as a checkpoint saved before the record)
            del data["config"]["origin"]
            json.dump(data, open(meta, "w"))
    for d in glob.glob(p + "/iter_*"):
        shutil.rmtree(d)
    assert main(["--load", f, "--save", f, "--train-iters", "2", *common]) == 0


def test_a_fine_tunes_own_tokenizer_gone_is_not_replaced_by_the_originals(tmp_path, capsys, monkeypatch):
    """(From a review: a fine-tune trained with its own tokenizer (a token renamed), that tokenizer since deleted,
    exported the original model's from hf/ without a word.)"""
    ckpt = _converted(tmp_path, monkeypatch)
    mine = tmp_path / "mytok"
    mine.mkdir()
    tok = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
    tok["model"]["vocab"]["<|eot_id|>"] = tok["model"]["vocab"].pop("w59")
    (mine / "tokenizer.json").write_text(json.dumps(tok))
    ft = str(tmp_path / "ft")
    _train(ckpt, ft, 1, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(mine / "tokenizer.json"))
    # (and one in a directory named hf/ too: not the converted checkpoint's, so not replaced by it either)
    shutil.copytree(mine, mine / "hf")
    ft2 = str(tmp_path / "ft2")
    _train(
        ckpt, ft2, 1, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(mine / "hf/tokenizer.json")
    )
    shutil.rmtree(mine)
    capsys.readouterr()
    assert _convert("--loader", "megatron_lite", "--saver", "hf", "--load-dir", ft, "--save-dir",
                    str(tmp_path / "out")) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert f"no tokenizer written: the checkpoint's tokenizer {mine / 'tokenizer.json'} no longer exists" in out, out
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    assert (tmp_path / "out" / "generation_config.json").exists()  # (the other files of hf/ still go along)
    assert _convert("--loader", "megatron_lite", "--saver", "hf", "--load-dir", ft2, "--save-dir",
                    str(tmp_path / "out2")) == 0  # fmt: skip
    assert "no tokenizer written" in capsys.readouterr().out
    assert not (tmp_path / "out2" / "tokenizer.json").exists()


def test_an_origin_out_of_reach_at_a_resume_is_looked_for_again(tmp_path, monkeypatch):
    """(From a review: a checkpoint saved before the record, resumed while its converted checkpoint was out of
    reach, recorded None, which was final: its exports lost the Hugging Face files for good.) The resumed run
    records where to look again; once the converted checkpoint is back, the origin is found."""
    import glob

    from megatron_lite.checkpoint.lookup import find_checkpoint, read_metadata
    from megatron_lite.checkpoint.origin import checkpoint_origin
    from megatron_lite.training.pretrain import main

    ckpt = _converted(tmp_path, monkeypatch)
    ft = str(tmp_path / "ft")
    _train(ckpt, ft, 1)
    for meta in glob.glob(ft + "/iter_*/metadata.json"):  # (as saved before the record)
        data = json.load(open(meta))
        del data["config"]["origin"]
        json.dump(data, open(meta, "w"))
    (tmp_path / "tok").mkdir()
    shutil.copy(ckpt + "/hf/tokenizer.json", tmp_path / "tok")
    shutil.move(ckpt, ckpt + ".away")  # (its volume not mounted for one resume)
    argv = ["--load", ft, "--save", ft, "--mock-data", "--seq-length", "16", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "2", "--lr", "2e-2", "--eval-iters", "0",
            "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(tmp_path / "tok/tokenizer.json")]  # fmt: skip
    assert main(argv) == 0
    shutil.move(ckpt + ".away", ckpt)
    new = find_checkpoint(ft)
    assert "walk_from" in read_metadata(new)["config"]["origin"]
    assert (checkpoint_origin(new, read_metadata(new)) or {}).get("hf_dir") == ckpt + "/hf"


def test_a_moved_trees_non_persistent_checkpoint_finds_its_hf_files(tmp_path):
    """(From a review: the record's hf/ path relative to --save was resolved against the checkpoint's own root,
    one level deeper for a global non-persistent checkpoint, <save>/non_persistent/iter_N.)"""
    from megatron_lite.checkpoint.origin import checkpoint_origin

    old, new = tmp_path / "exp", tmp_path / "moved"
    (old / "conv" / "hf").mkdir(parents=True)
    (old / "conv" / "hf" / "config.json").write_text("{}")
    record = {"hf_dir": str(old / "conv" / "hf"), "converted_from": None, "converted": None,
              "converted_weights": False, "hf_dir_rel": "../conv/hf"}  # fmt: skip
    shutil.move(old, new)
    for it in ("ft/iter_0000010", "ft/non_persistent/iter_0000010"):
        assert checkpoint_origin(str(new / it), {"config": {"origin": record}})["hf_dir"] == str(new / "conv/hf"), it


def test_generation_says_when_the_converted_models_files_are_gone(tmp_path, capsys, monkeypatch):
    """(Noticed in session 31: with the converted checkpoint's hf/ directory moved away, tools/generate.py dropped
    generation_config.json's end ids without a word.) Found: nothing said; gone: one note naming the directory."""
    spec = importlib.util.spec_from_file_location("generate_for_origin", ROOT / "tools/generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    ckpt = _converted(tmp_path, monkeypatch)
    ft = str(tmp_path / "ft")
    _train(ckpt, ft, 1)
    argv = ["--load", ft, "--prompt-ids", "7,8,9", "--max-new-tokens", "2", "--greedy"]
    capsys.readouterr()
    assert generate.main(argv) == 0
    assert "are gone" not in capsys.readouterr().err
    shutil.move(ckpt, ckpt + ".away")
    assert generate.main(argv) == 0
    err = capsys.readouterr().err
    note = f"the Hugging Face files this checkpoint was converted with ({ckpt}/hf) are gone: the model's "
    assert err.count(note) == 1 and "; --stop-ids gives the ids to stop at" in err, err
    assert generate.main([*argv, "--stop-ids", "2"]) == 0
    assert "--stop-ids gives" not in capsys.readouterr().err
    shutil.copytree(ckpt + ".away/hf", ft + "/hf")  # (the files copied beside the checkpoint: read, nothing said)
    assert generate.main(argv) == 0
    assert "are gone" not in capsys.readouterr().err
