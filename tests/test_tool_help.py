"""Every flag of the tools the README walks a new user through says what it does in --help (preprocess_data.py's
--tokenizer-model, --append-eod and --workers, generate.py's --temperature, --seed and --output-json were bare)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _undescribed(help_text: str) -> list[str]:
    """The options of an argparse --help whose entry has no description (its line, then the next option)."""
    lines = help_text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("options:"))
    bare = []
    for i, line in enumerate(lines[start + 1 :], start + 1):
        m = re.match(r"^  (-[-\w]+)(.*)$", line)
        if not m or m.group(1) == "-h":
            continue
        described = re.search(r"\S {2,}\S", line.strip())  # (its text on the same line)
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if not described and not re.match(r"^ {20,}\S", nxt):  # (or on the next, indented)
            bare.append(m.group(1))
    return bare


@pytest.mark.parametrize("tool", ["tools/preprocess_data.py", "tools/generate.py"])
def test_every_flag_of_the_tool_is_described_in_its_help(tool):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, tool), "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "--output-prefix" in out.stdout or "--output-json" in out.stdout
    assert _undescribed(out.stdout) == []


def test_every_pretrain_flag_says_what_it_does_in_help():
    """(From a review porting Megatron's example scripts: 36 flags, --save, --load, --train-iters and
    --global-batch-size among them, had no --help text; --load's differs from Megatron's: flags not given take the
    checkpoint's values.) Checked on the parser (the help groups its flags; argparse's layout is not parsed)."""
    from megatron_lite.flag_parser import build_parser

    bare = [a.option_strings[0] for a in build_parser()._actions if a.option_strings and not (a.help or "").strip()]
    assert bare == []
    (load,) = [a for a in build_parser()._actions if "--load" in a.option_strings]
    assert "flags not given take the checkpoint's values" in load.help
