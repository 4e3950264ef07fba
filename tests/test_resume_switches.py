"""A switch a checkpoint carries can be turned off on resume: `--load` alone takes the checkpoint's switches
(--eod-mask-loss, --fp32-residual-connection, --qk-clip...), and a review found one left on there could never be
turned off (a checkpoint with an fp32 residual stream could not resume under FSDP2: there is no flag for it in
Megatron, which takes no switch from a checkpoint). Each switch has an off form (--no-X), not in --help."""

from __future__ import annotations

import pytest
from test_pretrain_cli import TINY, _run

from megatron_lite.arguments import parse_args
from megatron_lite.config import ConfigError
from megatron_lite.flag_parser import build_parser

SWITCHES = ["--fp32-residual-connection", "--qk-clip", "--eod-mask-loss", "--untie-embeddings-and-output-weights"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("switches") / "ckpt")
    mp = pytest.MonkeyPatch()

    class _Quiet:  # (capsys is function-scoped: the run's output is read and dropped here)
        def readouterr(self):
            return type("o", (), {"out": "", "err": ""})()

    rc, _, err = _run(["--mock-data", "--vocab-size", "64", "--bf16", *SWITCHES, "--train-iters", "1", "--save",
                       ckpt], _Quiet(), mp)  # fmt: skip
    mp.undo()
    assert rc == 0, err
    return ckpt


def test_the_checkpoints_switches_come_back_and_their_off_forms_turn_them_off(checkpoint):
    ns, _ = parse_args([*TINY, "--load", checkpoint])
    assert ns.fp32_residual_connection and ns.qk_clip and ns.eod_mask_loss
    off = "a switch taken from the checkpoint is turned off by its off form: "
    assert any(n.startswith(off) and "--no-eod-mask-loss" in n and "--no-fp32-residual-connection" in n
               and "--no-qk-clip" in n for n in ns.schedule_notes), ns.schedule_notes  # fmt: skip
    assert not any("--no-untie" in n for n in ns.schedule_notes), ns.schedule_notes  # (the weights' own: refused)
    off = ["--no-fp32-residual-connection", "--no-qk-clip", "--no-eod-mask-loss"]
    ns, job = parse_args([*TINY, "--load", checkpoint, *off])
    assert not (ns.fp32_residual_connection or ns.qk_clip or ns.eod_mask_loss)
    assert not job.model.fp32_residual_connection


def test_a_refusal_of_a_switch_taken_from_the_checkpoint_names_its_off_form(checkpoint):
    with pytest.raises(ConfigError, match=r"--fp32-residual-connection with --use-torch-fsdp2 .*"
                       r"\(--fp32-residual-connection: not given, the checkpoint's value, .*; "
                       r"--no-fp32-residual-connection turns it off\)"):  # fmt: skip
        parse_args([*TINY, "--load", checkpoint, "--use-torch-fsdp2"])
    parse_args([*TINY, "--load", checkpoint, "--use-torch-fsdp2", "--no-fp32-residual-connection"])


def test_off_forms_are_out_of_help_and_a_no_switch_turns_off_by_its_plain_name():
    parser = build_parser()
    assert "--no-eod-mask-loss" not in parser.format_help()
    assert parser.parse_args(["--no-eod-mask-loss"]).eod_mask_loss is False
    assert parser.parse_args(["--no-eod-mask-loss", "--eod-mask-loss"]).eod_mask_loss is True  # (the last given wins)
    assert parser.parse_args([]).eod_mask_loss is False  # (the switch's own default stays)


def test_an_off_form_is_not_taken_for_its_switch_turned_on(checkpoint):
    """A review's: an off form counted as its switch given, so checks meant for the switch turned on fired (a
    refusal of --accumulate-allreduce-grads-in-fp32 the user had turned off; --no-fp16 dropped the checkpoint's
    bf16), and an architecture switch's off form was named as "--X False"."""
    parse_args([*TINY, "--mock-data", "--vocab-size", "64", "--bf16", "--main-grads-dtype", "bf16",
                "--use-precision-aware-optimizer", "--no-accumulate-allreduce-grads-in-fp32"])  # fmt: skip
    ns, _ = parse_args([*TINY, "--load", checkpoint, "--no-fp16"])
    assert ns.bf16 and not any("replaces the checkpoint" in n for n in ns.schedule_notes), ns.schedule_notes
    with pytest.raises(ConfigError, match=r"^--no-untie-embeddings-and-output-weights conflicts with the checkpoint"):
        parse_args([*TINY, "--load", checkpoint, "--no-untie-embeddings-and-output-weights"])


def test_a_no_switch_in_the_middle_and_each_spelling_get_their_undoing_form():
    parser = build_parser()
    assert parser.parse_args(["--muon-no-split-qkv", "--muon-split-qkv"]).muon_split_qkv is True
    ns = parser.parse_args(["--override-opt-param-scheduler", "--no-override-opt-param-scheduler"])
    assert ns.override_opt_param_scheduler is False
