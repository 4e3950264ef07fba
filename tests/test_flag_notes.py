"""The reasons printed for Megatron flags we accept without effect or refuse name only flags a user can give:
each flag they point to exists here, and is neither refused nor a no-op itself (a note said --spike-policy,
which is no flag: the user following it was refused)."""

from __future__ import annotations

import re

import pytest

from megatron_lite.flag_parser import build_parser
from megatron_lite.megatron_flags import ACCEPTED_NO_OPS, REFUSED

REASONS = {**{k: why for k, (_, why) in ACCEPTED_NO_OPS.items()}, **REFUSED}


@pytest.mark.parametrize("name", sorted(REASONS))
def test_a_reason_names_only_working_flags(name):
    ours = {s for a in build_parser()._actions for s in a.option_strings}
    inert = {"--" + n.replace("_", "-") for n in (*ACCEPTED_NO_OPS, *REFUSED)}
    named = [f.rstrip("-") for f in re.findall(r"--[a-z0-9][a-z0-9-]*", REASONS[name])]
    bad = [f for f in named if f not in ours or f in inert]
    assert not bad, f"--{name.replace('_', '-')}: its reason names {bad}, which cannot be given here"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_flags_line_gives_its_advice_once(name):
    """'--use-legacy-models is not supported: ... (drop the flag); remove the flag' said it twice, and '--batch-size
    ...; use --micro-batch-size; remove the flag' gave two instructions: a line ends in one."""
    from megatron_lite.config import ConfigError
    from megatron_lite.megatron_flags import refuse_unsupported

    ns = build_parser().parse_args([])
    setattr(ns, name, "x")
    with pytest.raises(ConfigError) as e:
        refuse_unsupported(ns)
    said = str(e.value)
    assert said.startswith(f"--{name.replace('_', '-')} is not supported: "), said
    advice = re.findall(r"remove the flag|drop the flag|(?:^|[:;] )(?:use|give) ", said)
    assert len(advice) == 1, said


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--qk-clip-threshold", "50"], "--qk-clip-threshold has no effect without --qk-clip"),
        (["--qk-clip-alpha", "0.9"], "--qk-clip-alpha has no effect without --qk-clip"),
        (["--muon-momentum", "0.5"], "--muon-momentum has no effect without --optimizer muon"),
        (["--optimizer", "sgd", "--muon-scale-mode", "unit_rms_norm"], "--muon-scale-mode has no effect without"),
    ],
)
def test_a_features_settings_without_its_switch_are_said(flags, said):
    """(From a review of the optimizers: accepted and unused without a word, as fp8's were before their line.)"""
    from megatron_lite.arguments import parse_args
    from megatron_lite.megatron_flags import accepted_no_ops

    base = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
    base += "--train-iters 3 --lr 1e-3 --mock-data --vocab-size 100"
    lines = accepted_no_ops(parse_args([*base.split(), *flags])[0])
    assert any(line.startswith(said) for line in lines), lines
    switch = ["--qk-clip"] if "qk" in flags[0] else ["--optimizer", "muon"]
    on = accepted_no_ops(
        parse_args([*base.split(), *[f for f in flags if f not in ("--optimizer", "sgd")], *switch])[0]
    )
    assert not any("without" in line and flags[-2] in line for line in on), on
