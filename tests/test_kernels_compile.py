"""Every Triton kernel compiles for Hopper (sm_90) on this machine, GPU or not: catches code the interpreter
accepts but the GPU compiler rejects. Runs megatron_lite.kernels.check_compile in a process without
TRITON_INTERPRET (the interpreter patches triton.language in ways the compiler trips over)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import head_start
import pytest

from megatron_lite import kernels as K

ROOT = pathlib.Path(__file__).resolve().parents[1]


head_start.register(
    "compile_for_hopper",
    lambda out: [sys.executable, "-m", "megatron_lite.kernels.check_compile", "--capability", "90", "--json",
                 os.path.join(out, "r.json")],
    env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
)  # fmt: skip


@pytest.mark.skipif(not K.HAVE_TRITON, reason="needs triton (Linux)")
@pytest.mark.head_start("compile_for_hopper")
def test_every_kernel_compiles_for_hopper():
    """(Minutes of compiling on a 2-core machine: started ahead in the background, tests/head_start.py.)"""
    out, out_dir = head_start.result("compile_for_hopper")
    found = pathlib.Path(out_dir) / "r.json"
    results = json.loads(found.read_text()) if found.exists() else {}
    failed = {k: v for k, v in results.items() if v != "ok"}
    assert out.returncode == 0 and not failed, (failed, out.stderr[-2000:])
    assert len(results) >= 20  # every module's cases were found


def _compare_ptx():
    sys.path.insert(0, str(ROOT / "tools"))
    import compare_ptx

    return compare_ptx


NORM_SMEM = """
import json
from megatron_lite.kernels import norms
from megatron_lite.kernels._common import compile_for_gpu, warps_for
out = {}
for t, size in (("bf16", 2), ("fp32", 4)):
    for n in (4096, 8192, 16384):
        step, stages = norms._bounds(n, 3 * n * size)
        _, fn, sig, consts, _ = next(c for c in norms.COMPILE_CASES if c[0] == f"norm_bwd_{t}_rmsTrue_dsTrue_rows1")
        consts = dict(consts, BLOCK=n, ROWS=step, STAGES=stages)
        kernel = compile_for_gpu(fn, sig, consts, options={"num_warps": warps_for(n * step)})
        out[f"{t} {n}: {step} rows x {stages} stages"] = kernel.metadata.shared
print(json.dumps(out))
"""


@pytest.mark.skipif(not K.HAVE_TRITON, reason="needs triton (Linux)")
def test_norm_backward_settings_fit_in_shared_memory():
    """The norms' backward pipelines its row loop (up to 2 rows a step, 3 stages by default), and the compiler may
    buffer the coming rows in shared memory: the launcher lowers rows and stages by the row's size, so every hidden
    size and dtype compiles for Hopper within the 227 KB a program may have (fp32 rows of 16384 at 3 stages took
    384 KB, and would fail to launch)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", NORM_SMEM], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    shared = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(shared) == 6 and all(v <= 227 * 1024 for v in shared.values()), shared


def test_ptx_counts_read_memory_and_synchronisation_instructions():
    """tools/compare_ptx.py's summary of a kernel's PTX: global loads and stores (16-byte ones apart), barriers,
    shuffles; a difference in any of them is reported and fails the comparison."""
    cp = _compare_ptx()
    ptx = """
        ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
        @%p1 ld.global.b16 { %rs1 }, [ %rd2 + 0 ];
        st.global.v4.b32 [ %rd3 + 0 ], { %r1, %r2, %r3, %r4 };
        st.global.b32 [ %rd4 + 0 ], { %r5 };
        bar.sync 0;
        shfl.sync.bfly.b32 %r6, %r7, 16, 31, -1;
        ld.shared.b32 %r8, [ %r9 + 0 ];
    """
    counts = cp.ptx_counts(ptx)
    assert counts == {
        "ld.global": 2,
        "ld.global 16B": 1,
        "cp.async": 0,
        "st.global": 2,
        "st.global 16B": 1,
        "barriers": 1,
        "shuffles": 1,
    }
    old = {"k": counts | {"shared bytes": 16}, "gone": counts | {"shared bytes": 0}}
    lines, same = cp.compare(old, {"k": counts | {"shared bytes": 16}})
    assert same and lines == ["k: same", "gone: only in the old version"]
    lines, same = cp.compare(old, {"k": counts | {"ld.global 16B": 0, "shared bytes": 16}})
    assert not same and lines[0] == "k: DIFFERS: ld.global 16B 1 -> 0"
    assert cp.compare({"a": counts}, {"b": counts})[1] is False  # nothing shared: nothing shown the same
    assert cp.ptx_counts("cp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 16, %r2;")["cp.async"] == 1


@pytest.mark.skipif(not K.HAVE_TRITON, reason="needs triton (Linux)")
def test_compare_ptx_compiles_two_versions_of_the_kernels(tmp_path):
    """End to end: a revision's kernels (git archive) and the same revision again, compiled for Hopper in two
    fresh interpreters; aligned as the JIT compiles them, SwiGLU's loads and stores are 16-byte vectors."""
    tool = str(ROOT / "tools" / "compare_ptx.py")
    cmd = [sys.executable, tool, "--rev", "HEAD", "--to", "HEAD", "--kernels", "swiglu", "--json", str(tmp_path / "c")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "swiglu_fwd_bf16: same" in done.stdout and "all 4 shared cases the same" in done.stdout
    fwd = json.loads((tmp_path / "c").read_text())["new"]["swiglu_fwd_bf16"]
    assert fwd["ld.global 16B"] == fwd["ld.global"] > 0 and fwd["st.global 16B"] == fwd["st.global"] > 0


CRASHING_CASE = """
import json, os, sys
from megatron_lite.kernels import check_compile as cc
cc.MODULES = ("swiglu",)
def compile_case(index, capability):  # (case 1's compiler aborts its process, as an LLVM ERROR does)
    if index == 1:
        os.abort()
    return cc.all_cases()[index][0], "ok"
cc._compile_case = compile_case
sys.exit(cc.main(["--jobs", "2", "--json", sys.argv[1]]))
"""


@pytest.mark.skipif(not K.HAVE_TRITON, reason="needs triton (Linux)")
def test_a_case_that_kills_its_compiler_is_named_and_the_rest_are_checked(tmp_path):
    """(From a review of the parallel compile: one case whose compiler aborted broke the process pool, and every
    case was lost in a BrokenProcessPool traceback, the crashing one unnamed.)"""
    import importlib

    swiglu = importlib.import_module("megatron_lite.kernels.swiglu")  # (the package's `swiglu` is the function)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, "-c", CRASHING_CASE, str(out)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    results = json.loads(out.read_text())
    names = [c[0] for c in swiglu.COMPILE_CASES]
    assert list(results) == names and len(names) > 2
    assert results[names[1]].startswith("crashed") and all(results[n] == "ok" for n in names if n != names[1])
