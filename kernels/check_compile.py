"""Compile every Triton kernel for a GPU target on this machine, GPU or not:

    python -m megatron_lite.kernels.check_compile [--capability 90]

Each kernel module lists its cases in COMPILE_CASES: (name, kernel, signature, constexprs[, options]), options
being num_warps / num_stages where an autotuning config sets them. Run without
TRITON_INTERPRET (the interpreter patches parts of triton.language that the compiler then trips over).
Prints one line per case and exits non-zero if any fails."""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import json
import multiprocessing
import os
import sys

MODULES = ("norms", "swiglu", "quick_geglu", "rope", "cross_entropy", "flash_attention", "moe", "gemm", "nf4")


def all_cases() -> list[tuple]:
    cases = []
    for name in MODULES:
        cases += importlib.import_module(f"megatron_lite.kernels.{name}").COMPILE_CASES
    return cases


def _compile_case(index: int, capability: int) -> tuple[str, str]:
    """(the case's name, 'ok' or its error): run in a worker process, which finds the case by its index."""
    from megatron_lite.kernels._common import compile_for_gpu

    name, kernel, signature, constexprs, *options = all_cases()[index]
    try:
        compiled = compile_for_gpu(kernel, signature, constexprs, capability, *options)
        ok = len(compiled.asm["cubin"]) > 0 and f".target sm_{capability}" in compiled.asm["ptx"]
        return name, "ok" if ok else "no cubin"
    except Exception as e:  # report every failure, not just the first
        return name, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _compile_all(indices: list[int], jobs: int, capability: int) -> dict[int, tuple[str, str]]:
    """{index: (name, result)} of the cases, each printed as it is known. A case whose compiler ends its process
    (an LLVM abort) breaks the pool: the cases left are then compiled one process each, so that one is named
    'crashed' and the rest are still checked."""
    out: dict[int, tuple[str, str]] = {}
    # (forked workers: the kernels are not picklable, and a fork inherits the modules already imported)
    try:
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            for i, (name, result) in zip(indices, pool.map(_compile_case, indices, [capability] * len(indices))):
                out[i] = name, result
                print(f"{name}: {result}", flush=True)
    except concurrent.futures.process.BrokenProcessPool:
        left = [i for i in indices if i not in out]
        if len(left) == 1:
            name = all_cases()[left[0]][0]
            out[left[0]] = name, "crashed: the compiler ended its process"
            print(f"{name}: {out[left[0]][1]}", flush=True)
        else:
            for i in left:
                out.update(_compile_all([i], 1, capability))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capability", type=int, default=90)
    ap.add_argument("--json", help="write {case: 'ok' | error} here")
    ap.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="cases compiled at once, each in its own process (default: the CPU count; a cold Triton cache "
        "takes minutes on one core)",
    )
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs} must be >= 1")
    results = dict(_compile_all(list(range(len(all_cases()))), args.jobs, args.capability).values())
    if args.json:
        json.dump(results, open(args.json, "w"), indent=1)
    return 0 if all(v == "ok" for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
