"""A checkpoint converted from Hugging Face holds weights alone: continuing from it (no --finetune) must not
claim its random-number states were left out for a layout change, nor that its optimizer is "as saved"."""

from __future__ import annotations

import torch
import transformers
from test_convert import convert  # (the tool, loaded by path once)


def test_continuing_a_converted_checkpoint_says_what_it_holds(tmp_path, capsys, monkeypatch):
    from megatron_lite.training.pretrain import main

    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf_dir, ours = str(tmp_path / "hf"), str(tmp_path / "ours")
    transformers.LlamaForCausalLM(cfg).save_pretrained(hf_dir)
    assert convert.main(["--loader", "hf", "--saver", "megatron_lite", "--load-dir", hf_dir, "--save-dir", ours]) == 0
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    argv = ["--load", ours, "--mock-data", "--vocab-size", "100", "--train-iters", "1", "--seq-length", "16"]
    argv += ["--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3", "--eval-iters", "0"]
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "saved under another layout" not in out, out
    assert "a converted checkpoint: weights only" in out, out
