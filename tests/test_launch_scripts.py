"""The shipped launch scripts' shell logic (an exploratory run: flags after a script's own were dropped without a
word, a multi-node script ignored MASTER_ADDR and every node waited alone on its own localhost, a DATA_PATH blend
reached pretrain_gpt.py as one word, DRY_RUN=0 ran a dry run). `torchrun` is a stand-in on PATH that prints what
it was given: these scripts launch 8-GPU jobs this machine cannot run."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRINTS_ITS_ARGS = '#!/bin/bash\nprintf "%s\\n" "$@"\n'


@pytest.fixture
def launched(tmp_path):
    """Run a script with a torchrun that prints its arguments: (exit code, its arguments as a list, stderr)."""
    (tmp_path / "torchrun").write_text(PRINTS_ITS_ARGS)
    (tmp_path / "torchrun").chmod(0o755)

    def run(script: str, *args: str, **env: str):
        clean = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "RDZV_HOST", "NNODES", "DRY_RUN")}
        full = {**clean, "PATH": f"{tmp_path}:{os.environ['PATH']}", **env}
        out = subprocess.run(["bash", str(ROOT / "pretrain" / script), *args], capture_output=True, text=True,
                             env=full, timeout=60)  # fmt: skip
        return out.returncode, out.stdout.splitlines(), out.stderr

    return run


def _after(argv: list[str], flag: str, n: int = 1) -> list[str]:
    i = len(argv) - 1 - argv[::-1].index(flag)  # (the last: the one argparse takes)
    return argv[i + 1 : i + 1 + n]


def test_flags_after_the_scripts_go_on_and_a_blend_is_split_into_words(launched):
    rc, argv, err = launched("llama3_8b.sh", "--train-iters", "7", "--lr", "1e-5", DATA_PATH="0.3 /d/a 0.7 /d/b")
    assert rc == 0, err
    assert _after(argv, "--train-iters") == ["7"] and _after(argv, "--lr") == ["1e-5"]
    assert _after(argv, "--data-path", 4) == ["0.3", "/d/a", "0.7", "/d/b"]
    rc, argv, err = launched("llama3_8b.sh", DRY_RUN="0")  # (0 is off: it launched, not a dry run)
    assert rc == 0 and "--dry-run" not in argv and "pretrain/pretrain_gpt.py" in argv, err


def test_a_multi_node_script_needs_the_first_nodes_address_and_takes_master_addr(launched):
    rc, argv, err = launched("mixtral_8x7b.sh", NNODES="2")
    assert rc == 2 and argv == [] and "error: NNODES=2 needs RDZV_HOST (or MASTER_ADDR)" in err, err
    rc, argv, err = launched("mixtral_8x7b.sh", NNODES="2", MASTER_ADDR="node0")
    assert rc == 0 and _after(argv, "--rdzv-endpoint") == ["node0:29500"], err
    rc, argv, err = launched("mixtral_8x7b.sh", NNODES="2", MASTER_ADDR="node0", RDZV_HOST="node1")
    assert rc == 0 and _after(argv, "--rdzv-endpoint") == ["node1:29500"], err
    rc, argv, err = launched("mixtral_8x7b.sh", NNODES="1")  # (one node: its own localhost)
    assert rc == 0 and _after(argv, "--rdzv-endpoint") == ["localhost:29500"], err
