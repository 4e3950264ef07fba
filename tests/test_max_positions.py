"""--seq-length past --max-position-embeddings: refused for learned positions (their table is weights), said for
RoPE, whose positions past it were never trained (Megatron refuses both); --max-position-embeddings raised on a
RoPE checkpoint says the model is to learn them, and is no architecture conflict. From an exploratory run: a
converted Qwen2 (256 positions) fine-tuned at --seq-length 512 without a word."""

from __future__ import annotations

from test_pretrain_cli import _one_line_error, _run

ROPE = ["--mock-data", "--vocab-size", "100", "--position-embedding-type", "rope", "--train-iters", "1"]
NOTE = "--seq-length 32 is past --max-position-embeddings 16 (the model's): positions past it were never trained"


def test_rope_past_the_models_positions_is_said_and_can_be_raised(tmp_path, capsys, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    rc, _, err = _run([*ROPE, "--save", ckpt], capsys, monkeypatch)  # (TINY: --seq-length 16, positions 16)
    assert rc == 0, err
    tune = [*ROPE, "--load", ckpt, "--finetune", "--seq-length", "32", "--train-iters", "2"]
    rc, out, err = _run(tune, capsys, monkeypatch)
    assert rc == 0 and NOTE in out + err, out + err
    rc, out, err = _run([*tune, "--max-position-embeddings", "32"], capsys, monkeypatch)
    assert rc == 0 and NOTE not in out + err, out + err


def test_learned_positions_past_the_table_are_refused(tmp_path, capsys, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    learned = ["--mock-data", "--vocab-size", "100", "--train-iters", "1"]
    rc, _, err = _run([*learned, "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    rc, _, err = _run([*learned, "--load", ckpt, "--finetune", "--seq-length", "32"], capsys, monkeypatch)
    _one_line_error(rc, err, "--seq-length 32 exceeds --max-position-embeddings 16")
    rc, _, err = _run([*learned, "--load", ckpt, "--max-position-embeddings", "32"], capsys, monkeypatch)
    _one_line_error(rc, err, "--max-position-embeddings 32 conflicts with the checkpoint")
