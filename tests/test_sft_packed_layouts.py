"""Megatron's packed SFT conversations (a line of several, each its own positions and attention: document ids)
under context, pipeline and tensor parallelism: per-iteration lm_loss and grad_norm equal one process. Context
parallelism splits a sample's document ids with its tokens (zigzag), the pipeline carries them to every stage."""

from __future__ import annotations

import pytest
from test_sft_messages import CHATML, TALK, _tokenizer, _write

SHORT = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "fox?"},
    {"role": "assistant", "content": "quick"},
]
LONG = [
    {"role": "system", "content": "hello there"},
    {"role": "user", "content": "the quick brown fox again?"},
    {"role": "assistant", "content": "yes, the brown fox"},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "brief"},
]
# lines of two or three conversations, of other lengths (so the documents' boundaries fall everywhere)
LINES = [SHORT + LONG, LONG + SHORT, SHORT + SHORT + SHORT, TALK + SHORT, LONG + SHORT + SHORT, SHORT + TALK]


@pytest.mark.slow
def test_packed_conversations_under_cp_pp_tp_equal_one_process(tmp_path, pretrain_job):
    from test_pretrain_torchrun import records

    folder = _tokenizer(tmp_path / "tok", CHATML)
    data = _write(tmp_path / "d.jsonl", *LINES)
    common = ["--sft", "--data-path", data, "--split", "100,0,0", "--tokenizer-type", "HuggingFaceTokenizer",
              "--tokenizer-model", folder, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
              "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
              "--disable-bias-linear", "--seq-length", "128", "--max-position-embeddings", "128",
              "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3", "--log-interval", "1",
              "--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0",
              "--distributed-backend", "gloo", "--kernel-impl", "torch"]  # fmt: skip
    layouts = {
        "one": (1, []),
        "cp2": (2, ["--context-parallel-size", "2"]),
        "cp2a2a": (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
        "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
        "tp2sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    }
    runs = {}
    for name, (world, flags) in layouts.items():
        log = str(tmp_path / f"{name}.jsonl")
        pretrain_job(world, [*common, *flags, "--log-jsonl", log])
        runs[name] = [x for r in records(log) for x in (r["lm_loss"], r["grad_norm"])]
    assert len(runs["one"]) == 6
    for name in layouts:
        assert runs[name] == pytest.approx(runs["one"], rel=1e-5), name
