"""Compile every Triton kernel for a GPU target on this machine, GPU or not:

    python -m megatron_lite.kernels.check_compile [--capability 90]

Each kernel module lists its cases in COMPILE_CASES: (name, kernel, signature, constexprs[, options]), options
being num_warps / num_stages where an autotuning config sets them. Run without
TRITON_INTERPRET (the interpreter patches parts of triton.language that the compiler then trips over).
Prints one line per case and exits non-zero if any fails."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

MODULES = ("norms", "swiglu", "quick_geglu", "rope", "cross_entropy", "flash_attention", "moe", "gemm", "nf4")


def all_cases() -> list[tuple]:
    cases = []
    for name in MODULES:
        cases += importlib.import_module(f"megatron_lite.kernels.{name}").COMPILE_CASES
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capability", type=int, default=90)
    ap.add_argument("--json", help="write {case: 'ok' | error} here")
    args = ap.parse_args(argv)
    from megatron_lite.kernels._common import compile_for_gpu

    results = {}
    for name, kernel, signature, constexprs, *options in all_cases():
        try:
            compiled = compile_for_gpu(kernel, signature, constexprs, args.capability, *options)
            ok = len(compiled.asm["cubin"]) > 0 and f".target sm_{args.capability}" in compiled.asm["ptx"]
            results[name] = "ok" if ok else "no cubin"
        except Exception as e:  # report every failure, not just the first
            results[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(f"{name}: {results[name]}", flush=True)
    if args.json:
        json.dump(results, open(args.json, "w"), indent=1)
    return 0 if all(v == "ok" for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
