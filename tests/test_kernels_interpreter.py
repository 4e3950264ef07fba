"""The interpreter speed-up (kernels/_interpreter.py): a launch patches triton.language once however many
@triton.jit helpers its programs call, the launch's patch is undone when it ends, and results are unchanged."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.kernels import _interpreter
from megatron_lite.kernels._common import HAVE_TRITON, interpreting

pytestmark = pytest.mark.skipif(
    not (HAVE_TRITON and interpreting()), reason="the speed-up applies to Triton's CPU interpreter only"
)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _twice(x):
        return x + x

    @triton.jit
    def _row_sums(X, Y, cols, BLOCK: tl.constexpr, REPEATS: tl.constexpr):
        # REPEATS calls of our helper and of tl.sum (itself a @triton.jit function) per program
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        x = tl.load(X + row * cols + offs, mask=offs < cols, other=0.0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for _ in tl.static_range(REPEATS):
            acc += _twice(x)
            tl.store(Y + row, tl.sum(acc, axis=0))


def test_a_launch_patches_the_language_once_and_restores_it():
    assert _interpreter.skip_repeated_patching()  # installed on the triton this suite pins
    add_before = tl.tensor.__add__
    x = torch.randn(5, 7)
    y = torch.empty(5)
    patches = _interpreter.PATCHES
    _row_sums[(5,)](x, y, 7, BLOCK=8, REPEATS=6)
    # 5 programs x 6 repeats x 2 helper calls would be 60 patches unskipped: the launch's own patch, plus the
    # first call into triton.language's standard library (its module globals name tl.core, not tl)
    assert _interpreter.PATCHES - patches <= 2
    torch.testing.assert_close(y, 2 * 6 * x.sum(1), rtol=1e-6, atol=1e-5)
    assert tl.tensor.__add__ is add_before  # the launch's patch was undone when it ended


def test_kernel_unit_tests_cross_tile_boundaries_on_16_wide_tiles():
    """tests/conftest.py shrinks the interpreter's tiles for the kernel unit tests (their odd shapes are sized for
    16-wide tiles); the kernels read the setting at each launch."""
    import importlib

    from megatron_lite.kernels import _common

    flash_attention = importlib.import_module("megatron_lite.kernels.flash_attention")  # the package exports
    moe = importlib.import_module("megatron_lite.kernels.moe")  # functions of these names
    assert _common.INTERPRETER_TILE == 16
    assert flash_attention._kernel(None, None, torch.float32)[1] == {"BLOCK_M": 16, "BLOCK_N": 16}
    assert moe._cfg() == (16, 16, 16)
