"""Shared pieces of the kernels: whether Triton can run here, a launch counter (tests prove a kernel really
ran rather than a silent fallback), and compiling a kernel for a GPU target without a GPU.

On a CPU, Triton runs its kernels through the interpreter when TRITON_INTERPRET=1 was set before triton was
imported (the test suite does this); without it, the functional entries use the PyTorch references.
"""

from __future__ import annotations

import functools
import os
from collections import Counter

import torch

try:
    import triton  # noqa: F401 - Linux only; elsewhere every op uses its PyTorch reference
    import triton.language as tl  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - macOS laptops, dry runs
    HAVE_TRITON = False

LAUNCHES: Counter = Counter()

# The edge of the fixed tiles flash attention and the grouped GEMM use under the interpreter. The interpreter's
# cost is per operation, not per element, so a model runs faster on bigger tiles; the kernel unit tests set 16
# (tests/conftest.py) so that their small, odd shapes cross many tile boundaries.
INTERPRETER_TILE = 32
# Elements per program of the element-wise kernels under the interpreter: NF4 dequantisation's flat blocks, and
# the whole rows the norms, RoPE and SwiGLU take at once (rows_per_program). A GPU's 1024-element blocks and one
# row per program make a model's step thousands of programs, each paying the interpreter's per-operation cost;
# the kernel unit tests set smaller values back (tests/conftest.py) so that their shapes span many programs. At or
# below a kernel's GPU block (1 gives one row per program) the kernels run the GPU's tiling.
INTERPRETER_BLOCK = 16384


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def rows_per_program(row_elements: int, rows: int) -> int:
    """Rows one program of a row-wise kernel (norms, RoPE, SwiGLU) takes: one on a GPU, where the kernels were
    tuned that way; under the interpreter as many whole rows as fit in INTERPRETER_BLOCK elements (a power of
    two, at least one, at most the rows there are), since its cost is per operation, not per element."""
    if not interpreting():
        return 1
    fit = max(1, INTERPRETER_BLOCK // max(1, row_elements))
    return max(1, min(next_pow2(rows), 1 << (fit.bit_length() - 1)))


if HAVE_TRITON and interpreting():
    from ._interpreter import skip_repeated_patching

    skip_repeated_patching()


def triton_usable(*tensors: torch.Tensor) -> bool:
    """Triton kernels run on CUDA tensors, or anywhere under the interpreter."""
    if not HAVE_TRITON:
        return False
    return all(t.is_cuda for t in tensors) or interpreting()


def on_tensor_device(fn):
    """A functional entry that launches on its first tensor's CUDA device. Triton launches on the current device
    (its context and stream) whatever the pointers: a model on cuda:1 without torch.cuda.set_device ran its
    kernels on device 0 with cuda:1's addresses (from a kernel review). The backward needs nothing: autograd
    runs a device's backward on a thread set to that device."""

    @functools.wraps(fn)
    def entry(*args, **kwargs):
        values = (*args, *kwargs.values())
        # (the first tensor among the arguments, or inside one: dequantize_nf4's NF4Weight)
        inner = (v for a in values if hasattr(a, "__dataclass_fields__") for v in vars(a).values())
        t = next((a for a in (*values, *inner) if isinstance(a, torch.Tensor)), None)
        if t is not None and t.is_cuda and t.device.index != torch.cuda.current_device():
            with torch.cuda.device(t.device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    entry.on_tensor_device = True
    return entry


def offsets_fit_int32(*tensors: torch.Tensor) -> bool:
    """Whether every element of each tensor lies less than 2^31 elements past its first: kernels that address
    rows and columns as int32 index x stride products (the GEMMs' inner loops) would wrap past that."""
    return all(t.numel() == 0 or sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) < 2**31 for t in tensors)


def require(ok: torch.Tensor, message) -> None:
    """A check of tensor contents: on the host, a ValueError with `message()`; on a GPU an asynchronous device
    assert (no synchronisation, so no message: a failure stops the process at a later launch), where the
    kernels would otherwise read or write out of bounds, or return a plausible wrong number."""
    if ok.is_cuda:
        torch._assert_async(ok.all())
    elif not bool(ok.all()):
        raise ValueError(message())


def no_interpreted_bf16_dot(name: str, *tensors: torch.Tensor) -> None:
    """The interpreter's tl.dot on bf16 returns garbage without an error (flash attention ~1e9 off): the kernels
    that multiply refuse bf16 there. The element-wise kernels compute bf16 under it, but the interpreter stores
    fp32 into bf16 by truncating, not rounding to nearest as a GPU does: one bf16 step apart at most."""
    if interpreting() and any(t.dtype == torch.bfloat16 for t in tensors):
        raise ValueError(
            f"{name}: the Triton interpreter (TRITON_INTERPRET=1) computes bf16 dot products wrongly; run bf16 on a "
            "GPU, or fp32 here"
        )


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory `a` spans may meet `b`'s (by their extents in one storage: conservative)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def launched(name: str) -> None:
    LAUNCHES[name] += 1


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def warps_for(block: int) -> int:
    """Warps for a program that holds one row of `block` elements: enough threads that each keeps a few
    16-byte vectors in registers (Liger-Kernel's calculate_settings uses the same steps)."""
    return 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4


def compile_for_gpu(kernel, signature: dict, constexprs: dict, capability: int = 90, options: dict | None = None):
    """Compile a @triton.jit kernel for a CUDA target (Hopper by default) on any machine, GPU or not:
    catches code the interpreter accepts but the GPU compiler rejects. `options`: num_warps, num_stages (as
    an autotuning config sets them). Returns the compiled kernel (its `asm` holds ptx and cubin)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)  # interpreter wraps the function
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)
