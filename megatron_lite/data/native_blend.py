"""The blend's order (gpt_dataset.blending_indices) in C, as Megatron's helpers.cpp builds it: the rule is a
sequential scan (each choice depends on the counts so far), so numpy cannot vectorise it, and Python takes
about an hour for a 500M-sample blend of 50 datasets where C takes two minutes.

Compiled once with the system C compiler ($CC, else cc or gcc: triton needs one on a GPU machine too) into
the cache folder and loaded with ctypes; no build step at install. Where there is no compiler, or the cache
cannot be written, `load()` returns None with the reason, and the caller runs the same rule in Python.

The arithmetic is that of the Python loop, IEEE double, `w * m - count` rounded after the product and after
the difference: -ffp-contract=off keeps the compiler from fusing them into one FMA (aarch64 would), which
rounds once and could flip a near tie, so both paths give the same order bit for bit."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import numpy as np

SOURCE = r"""
#include <stdint.h>

#define BLEND(NAME, T)                                                                          \
void NAME(const double *w, int64_t n, int64_t size, int64_t *counts, T *dataset, int64_t *sample) { \
    for (int64_t i = 0; i < size; ++i) {                                                        \
        double m = i > 1 ? (double)i : 1.0;                                                     \
        int64_t best = 0;                                                                       \
        double top = w[0] * m - (double)counts[0];                                              \
        for (int64_t k = 1; k < n; ++k) {                                                       \
            double v = w[k] * m - (double)counts[k];                                            \
            if (v > top) { best = k; top = v; }                                                 \
        }                                                                                       \
        dataset[i] = (T)best;                                                                   \
        sample[i] = counts[best];                                                               \
        counts[best] += 1;                                                                      \
    }                                                                                           \
}

BLEND(blend_int16, int16_t)
BLEND(blend_int64, int64_t)
"""
FLAGS = ["-O2", "-shared", "-fPIC", "-ffp-contract=off"]

_loaded: tuple[ctypes.CDLL | None, str] | None = None


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _build() -> tuple[ctypes.CDLL | None, str]:
    from megatron_lite.data.embedded import cache_root  # (embedded imports gpt_dataset, which imports this)

    cc = _compiler()
    if cc is None:
        return None, "no C compiler ($CC, cc, gcc or clang) on PATH"
    # (the machine and the compiler's target in the name: a cache shared by x86-64 and aarch64 nodes, or written
    # by a cross-compiler, held a library the other could not load, and the job fell back to Python for good)
    try:
        target = subprocess.run([cc, "-dumpmachine"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        target = ""
    key = "\n".join([SOURCE, " ".join(FLAGS), platform.machine(), sys.platform, shutil.which(cc) or cc, target])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    folder = os.path.join(cache_root(), "native")
    lib = os.path.join(folder, f"blend-{digest}.so")
    handle = None
    if os.path.exists(lib):
        try:
            handle = ctypes.CDLL(lib)
        except OSError:  # (damaged, or not this machine's after all: built again below, over it)
            pass
    if handle is None:
        try:
            os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                src = os.path.join(tmp, "blend.c")
                with open(src, "w") as f:
                    f.write(SOURCE)
                out = os.path.join(tmp, "blend.so")
                run = subprocess.run([cc, *FLAGS, "-o", out, src], capture_output=True, text=True, timeout=120)
                if run.returncode != 0:
                    return None, f"{cc} failed: {run.stderr.strip()[-300:]}"
                os.replace(out, lib)  # (atomic: ranks compiling at once each publish a whole library)
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"could not build it in {folder}: {e}"
        try:
            handle = ctypes.CDLL(lib)
        except OSError as e:
            return None, f"could not load {lib}: {e}"
    for name in ("blend_int16", "blend_int64"):
        fn = getattr(handle, name)
        fn.restype = None
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr]
    return handle, ""


def load() -> tuple[ctypes.CDLL | None, str]:
    """(the compiled library, "") or (None, why not); built at most once per process."""
    global _loaded
    if _loaded is None:
        _loaded = _build()
    return _loaded


def native_blending_indices(weights: list[float], size: int, dtype: type) -> tuple[np.ndarray, np.ndarray] | None:
    """The C scan over normalised `weights`, or None where the library is unavailable."""
    handle, _ = load()
    if handle is None:
        return None
    w = np.ascontiguousarray(weights, dtype=np.float64)
    counts = np.zeros(len(w), dtype=np.int64)
    dataset = np.empty(size, dtype=dtype)
    sample = np.empty(size, dtype=np.int64)
    fn = handle.blend_int16 if dataset.dtype == np.int16 else handle.blend_int64
    fn(w.ctypes.data, len(w), size, counts.ctypes.data, dataset.ctypes.data, sample.ctypes.data)
    return dataset, sample
