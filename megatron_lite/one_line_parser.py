"""argparse with one-line errors: the start-up parser's base and the tools' (moved out of flag_parser.py,
which imports it from here)."""

from __future__ import annotations

import argparse
import sys


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse whose errors are one line (not the usage of every flag first), like every other start-up
    error; an unknown flag is named as such, Megatron flags we lack included. The tools use it too. Flags are
    never abbreviated (Megatron's allow_abbrev=False): `--save-d` would read as `--save-dir` until a new flag
    made it ambiguous and broke the script."""

    renamed: dict[str, str] = {}  # a flag of Megatron's older tools -> what to use here instead

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):
            flags = [a for a in message.removeprefix("unrecognized arguments: ").split() if a.startswith("--")]
            if flags:
                guesses = {f: self.spelled_as(f) for f in flags}
                if any(guesses.values()):  # (a user told to remove --append_eod loses its EOD tokens silently)
                    message = "; ".join(
                        f"{f}: no such flag in {self.prog}" + (f", {g}" if g else " (remove it)")
                        for f, g in guesses.items()
                    )
                else:
                    message = (
                        f"{', '.join(flags)}: no such flag in {self.prog} (Megatron-LM flags we implement keep "
                        "their names; remove it)"
                    )
        print(line := f"error: {message}; {self.prog} --help lists the flags", file=sys.stderr)
        from megatron_lite.start_up_error import record_for_launcher

        record_for_launcher(line)  # (torchrun's summary showed "To enable traceback see: ..." instead)
        sys.exit(2)

    def spelled_as(self, flag: str) -> str | None:
        """What to tell of an unknown flag: its spelling with dashes (--append_eod), that it is the default of
        a --no- flag we have (--load-optim), or a close one; None when there is none."""
        import difflib

        known = [o for o in self._option_string_actions if o.startswith("--")]
        name = flag.split("=", 1)[0]
        if name in self.renamed:
            return f"use {self.renamed[name]}"
        dashed = "--" + name[2:].replace("_", "-")
        if dashed in known:
            return f"did you mean {dashed}?"
        # (a close match here is often the opposite: --load-optim is one edit from --no-load-optim)
        opposite = "--" + dashed[5:] if dashed.startswith("--no-") else "--no-" + dashed[2:]
        if opposite in known:
            return f"it is the default ({opposite} is its opposite): remove it"
        close = difflib.get_close_matches(
            dashed, [k for k in known if k.startswith("--no-") == dashed.startswith("--no-")], n=1, cutoff=0.85
        )
        return f"did you mean {close[0]}?" if close else None
