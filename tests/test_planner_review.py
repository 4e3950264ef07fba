"""An exploratory review of the planner as a user booking a cluster would run it: fp32 plans priced at the fp32
rate, a script's plain assignments read (and nothing else run), TP groups kept inside a node of any size."""

from __future__ import annotations

import pytest
from test_planner import ROOT, _tool

from models import llama_config


def _top(argv: list[str], tmp_path, name: str) -> dict:
    import json

    out = tmp_path / f"{name}.json"
    _tool().main(["--script", str(ROOT / "pretrain" / "llama3_8b.sh"), "--top", "1", "--json", str(out), *argv])
    return json.loads(out.read_text())["fits"][0]


def test_an_fp32_plan_runs_at_the_fp32_rate(tmp_path, capsys):
    """Every GEMM and the attention were priced at the bf16 tensor-core peak whatever the precision: Llama-3-8B in
    fp32 on H100s came out at 384 TFLOP/s a GPU and 39% MFU, 1.2x the bf16 step, where the plain fp32 peak, which
    pretrain's fp32 matmuls run at (no TF32), is 67 TFLOP/s."""
    from megatron_lite.planner.hardware import ACCELERATORS

    bf16, fp32 = _top([], tmp_path, "bf16"), _top(["--fp32"], tmp_path, "fp32")
    peak = ACCELERATORS["H100"].fp32_rate
    assert peak == 67e12  # (the training log's fp32 peak of an H100, training/flops.py)
    assert fp32["tflops_per_gpu"] * 1e12 < peak and 0 < fp32["mfu"] < 1, fp32
    assert fp32["mfu"] == pytest.approx(fp32["tflops_per_gpu"] * 1e12 / peak)  # (against the fp32 peak)
    assert fp32["step_seconds"] > 5 * bf16["step_seconds"], (fp32["step_seconds"], bf16["step_seconds"])


def test_a_scripts_plain_assignments_are_read(tmp_path):
    """Only VAR=${VAR:-...} and numbers were read from a script: PRECISION="--bf16" in ARGS expanded to nothing and
    the plan was fp32, unsaid; SEQ="512" was "--seq-length: expected one argument". A variable set by a command is
    one line naming it."""
    script = tmp_path / "run.sh"
    body = 'GPUS_PER_NODE=8\nexport PRECISION="--bf16"\nSEQ="512"\n'
    body += "ARGS=(\n    --num-layers 2 --seq-length $SEQ $PRECISION\n)\n"
    script.write_text(body)
    argv, world, per_node = _tool().script_args(str(script))
    assert argv == ["--num-layers", "2", "--seq-length", "512", "--bf16"] and (world, per_node) == (8, 8), argv
    script.write_text(body.replace('SEQ="512"', "SEQ=$(cat seq.txt)"))
    with pytest.raises(SystemExit, match=r"its ARGS use \$SEQ, which it sets by running a command; set it in the"):
        _tool().script_args(str(script))


def test_tp_groups_stay_inside_a_node_of_any_size():
    """TP 4 on nodes of 6 GPUs put the group of ranks 4-7 across two nodes, priced as NVLink: TP sizes now divide
    the node's GPUs."""
    from megatron_lite.planner.search import layouts

    six = {lay.tp for lay in layouts(llama_config(), 12, 6, 12)}
    four = {lay.tp for lay in layouts(llama_config(), 12, 4, 12)}
    assert 4 not in six and {1, 2} <= six and 4 in four, (six, four)


def test_a_scripts_layout_the_cluster_cannot_hold_is_said(capsys):
    """Llama-3-8B's script (TP 4) on one node of 2 GPUs planned with no word of the script's own layout."""
    _tool().main(["--script", str(ROOT / "pretrain" / "llama3_8b.sh"), "--gpus-per-node", "2", "--nodes", "1",
                  "--top", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert "your layout (TP4 PP1 CP1) needs a multiple of 4 GPUs; the cluster's 2 is not one" in out, out


def test_a_scripts_command_lines_are_not_run(tmp_path):
    """`CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun ...` passed for a plain assignment: planning a script launched its
    training job (and waited for it). Only lines that are nothing but assignments are read now."""
    marker = tmp_path / "launched"
    script = tmp_path / "run.sh"
    body = "GPUS_PER_NODE=2\nNNODES=1\nARGS=(\n    --num-layers 2 --seq-length 512\n)\n"
    body += f"CUDA_DEVICE_MAX_CONNECTIONS=1 touch {marker}\nX=1; touch {marker}\nY=2 && touch {marker}\n"
    body += f"Z=3 >{marker}\nA=1 B=2\n"
    script.write_text(body)
    argv, world, per_node = _tool().script_args(str(script))
    assert not marker.exists()
    assert argv == ["--num-layers", "2", "--seq-length", "512"] and (world, per_node) == (2, 2), argv


def test_a_variable_the_script_never_sets_is_said_so(tmp_path):
    """A variable ARGS uses that the script does not set at all was said to be "set by running a command"."""
    script = tmp_path / "run.sh"
    script.write_text('ARGS=(\n    --num-layers 2 --data-path "$DATA_PATH_NEVER_SET"\n)\n')
    with pytest.raises(SystemExit, match=r"its ARGS use \$DATA_PATH_NEVER_SET, which it does not set; set it in the"):
        _tool().script_args(str(script))
