"""tools/preprocess_data.py: JSONL and text files to an indexed dataset that decodes back to the input."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from megatron_lite.data.embedded import build_embedded_corpus
from megatron_lite.data.indexed import IndexedDataset
from megatron_lite.data.tokenizers import HuggingFaceTokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [{"text": f"def f{i}(x):\n    return x * {i}  # doc {i} é", "meta": i} for i in range(300)]


@pytest.mark.parametrize("workers", [1, 2])
def test_jsonl_round_trip(tmp_path, workers):
    _, tok_path = build_embedded_corpus()
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(d) for d in DOCS) + "\n")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "preprocess_data.py"),
            "--input",
            str(src),
            "--output-prefix",
            str(tmp_path / "out"),
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            tok_path,
            "--append-eod",
            "--workers",
            str(workers),
            "--log-interval",
            "100",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "processed 100 documents" in out.stderr
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    tok = HuggingFaceTokenizer(tok_path)
    assert len(ds) == len(DOCS)
    for i in (0, 17, 299):
        ids = list(ds.get(i))
        assert ids[-1] == tok.eod and tok.decode(ids[:-1]) == DOCS[i]["text"]


def test_bad_json_key_is_one_line(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"body": "x"}) + "\n")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "preprocess_data.py"),
            "--input",
            str(src),
            "--output-prefix",
            str(tmp_path / "o"),
            "--tokenizer-type",
            "ByteLevelTokenizer",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.strip().startswith("error:") and "--json-keys" in out.stderr
