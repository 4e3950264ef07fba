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
