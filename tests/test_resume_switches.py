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

SWITCHES = ["--fp32-residual-connection", "--qk-clip", "--eod-mask-loss"]


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
    assert parser.parse_args(["--no-fp8-wgrad", "--fp8-wgrad"]).no_fp8_wgrad is False  # (the last one given wins)
    assert parser.parse_args([]).eod_mask_loss is False  # (the switch's own default stays)
