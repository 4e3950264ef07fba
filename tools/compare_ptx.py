"""Compare the GPU code of the Triton kernels between two versions of this repository, on any machine, GPU or not.

    python tools/compare_ptx.py --rev HEAD~1                 # that commit against the working tree
    python tools/compare_ptx.py --rev v0.1 --to HEAD --kernels norms swiglu

Every case of kernels/*.py's COMPILE_CASES (the kernels' Hopper compile checks) is compiled for sm_90 on both
sides, as the JIT compiles it at aligned shapes (pointers 16-byte aligned, sizes and strides multiples of 16,
as at Llama's), and its PTX summarised: global loads and stores (and how many of them move 16-byte vectors),
barriers, warp shuffles, shared memory. One line per case that exists on both sides; exit status 1 when any
differs.

What it is for: a kernel edited for the CPU interpreter's sake (or any change meant to leave the GPU path alone)
can be checked without a GPU. Equal counts mean the same memory traffic and synchronisation; they do not prove
equal speed (instruction order, registers and occupancy can still move), so timing stays with
tools/bench_kernels.py on a GPU."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("ld.global", "ld.global 16B", "cp.async", "st.global", "st.global 16B", "barriers", "shuffles", "shared bytes")


def ptx_counts(ptx: str) -> dict[str, int]:
    """The memory and synchronisation instructions of one kernel's PTX."""
    lines = ptx.splitlines()
    loads = [s for s in lines if re.search(r"\bld\.global\b", s)]
    stores = [s for s in lines if re.search(r"\bst\.global\b", s)]
    wide = re.compile(r"\.v4\.(b32|f32|u32|s32)|\.v2\.(b64|f64|u64)")  # 16 bytes a thread
    return {
        "ld.global": len(loads),
        "ld.global 16B": sum(1 for s in loads if wide.search(s)),
        "cp.async": sum(1 for s in lines if re.search(r"\bcp\.async\.(ca|cg)\b", s)),  # loads pipelined to shared
        "st.global": len(stores),
        "st.global 16B": sum(1 for s in stores if wide.search(s)),
        "barriers": sum(1 for s in lines if re.search(r"\bbar\.sync\b|\bbarrier\.sync\b", s)),
        "shuffles": sum(1 for s in lines if re.search(r"\bshfl\.sync\b", s)),
    }


def compare(old: dict, new: dict) -> tuple[list[str], bool]:
    """Report lines for the cases on both sides, and whether all of them are equal (and there is at least one:
    cases only on one side, renamed ones among them, are listed but prove nothing)."""
    out, same = [], bool(set(old) & set(new))
    for name in sorted(set(old) & set(new)):
        a, b = old[name], new[name]
        if "error" in a or "error" in b:
            out.append(f"{name}: does not compile ({a.get('error') or b.get('error')})")
            same = False
            continue
        diff = [f"{k} {a[k]} -> {b[k]}" for k in KEYS if a.get(k) != b.get(k)]
        same &= not diff
        out.append(f"{name}: {'same' if not diff else 'DIFFERS: ' + ', '.join(diff)}")
    for name in sorted(set(old) ^ set(new)):
        out.append(f"{name}: only in the {'old' if name in old else 'new'} version")
    return out, same


def _compile(kernel, signature: dict, constexprs: dict, capability: int, options: dict | None):
    """As the JIT compiles at aligned shapes (Llama's: every size and stride a multiple of 16): pointers 16-byte
    aligned and integer arguments divisible by 16, so loads vectorise as they do on the GPU (the suite's compile
    check assumes neither, which keeps it general but vectorises nothing). Not kernels._common.compile_for_gpu:
    the old revision's copy of it may not take the alignment."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    # pointers and integers (not constexprs, not floats), by argument position
    aligned = {
        (i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t != "constexpr" and t[:2] != "fp"
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)


def _counts_here(capability: int, kernels: list[str] | None) -> dict:
    """Compile this interpreter's megatron_lite.kernels (whichever tree PYTHONPATH put first)."""
    import importlib

    from megatron_lite.kernels import check_compile

    tree = Path(os.environ["PYTHONPATH"]).resolve()
    out = {}
    for module in kernels or check_compile.MODULES:
        try:
            mod = importlib.import_module(f"megatron_lite.kernels.{module}")
        except ModuleNotFoundError:
            continue
        # a module this version lacks would come from the editable install (the working tree): not its cases
        if not Path(mod.__file__).parent.parent.resolve().is_relative_to(tree):
            continue
        for name, kernel, signature, constexprs, *options in mod.COMPILE_CASES:
            try:
                compiled = _compile(kernel, signature, constexprs, capability, options[0] if options else None)
            except Exception as e:  # a case that fails to compile is reported, not fatal
                out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
                continue
            out[name] = ptx_counts(compiled.asm["ptx"]) | {"shared bytes": compiled.metadata.shared}
    return out


def _tree(src: Path, dst: Path) -> None:
    """dst/megatron_lite as the installed package lays it out: megatron_lite/ with kernels/ inside it."""
    pkg = dst / "megatron_lite"
    pkg.mkdir(parents=True)
    for entry in (src / "megatron_lite").iterdir():
        (pkg / entry.name).symlink_to(entry)
    (pkg / "kernels").symlink_to(src / "kernels")


def _counts_of(rev: str | None, capability: int, kernels: list[str] | None, tmp: Path) -> dict:
    """Counts for a git revision (None: the working tree), compiled in a fresh interpreter on that tree."""
    src = ROOT
    if rev is not None:
        src = tmp / "src"
        src.mkdir()
        try:
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", rev, "megatron_lite", "kernels"], capture_output=True, check=True
            ).stdout
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"compare_ptx: --rev {rev}: git archive failed: {e.stderr.decode().strip()}") from None
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    tree = tmp / "tree"
    _tree(src, tree)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler trips on its patches
    env["PYTHONPATH"] = str(tree)
    out = tmp / "counts.json"
    cmd = [sys.executable, __file__, "--counts-json", str(out), "--capability", str(capability)]
    cmd += ["--kernels", *kernels] if kernels else []
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"compare_ptx: compiling {rev or 'the working tree'} failed:\n{proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", help="the old version: a git revision (commit, tag, HEAD~1)")
    ap.add_argument("--to", help="the new version: a git revision (default: the working tree)")
    ap.add_argument("--kernels", nargs="+", help="kernel modules to compare (default: all; e.g. norms swiglu)")
    ap.add_argument("--capability", type=int, default=90, help="CUDA compute capability (default 90, Hopper)")
    ap.add_argument("--json", help="also write both versions' counts here ({'old': {case: counts}, 'new': ...})")
    ap.add_argument("--counts-json", help=argparse.SUPPRESS)  # the per-tree worker
    args = ap.parse_args(argv)
    if args.counts_json:
        import megatron_lite.kernels as K

        here = Path(os.environ.get("PYTHONPATH", "")).resolve()
        if not Path(K.__file__).parent.parent.resolve().is_relative_to(here):
            print(f"compare_ptx: imported {K.__file__}, not the tree under {here}", file=sys.stderr)
            return 2
        Path(args.counts_json).write_text(json.dumps(_counts_here(args.capability, args.kernels)))
        return 0
    if not args.rev:
        ap.error("--rev is required (the version to compare against), e.g. --rev HEAD~1")
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        old = _counts_of(args.rev, args.capability, args.kernels, Path(a))
        new = _counts_of(args.to, args.capability, args.kernels, Path(b))
    if args.json:
        Path(args.json).write_text(json.dumps({"old": old, "new": new}, indent=1))
    lines, same = compare(old, new)
    print(f"PTX for sm_{args.capability}: {args.rev} -> {args.to or 'the working tree'}")
    print("\n".join(lines))
    shared, one_side = len(set(old) & set(new)), len(set(old) ^ set(new))
    extra = f"; {one_side} only in one version" if one_side else ""
    print((f"all {shared} shared cases the same" if same else "some cases differ (or none are shared)") + extra)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
