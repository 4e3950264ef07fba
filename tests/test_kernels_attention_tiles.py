"""Every tile the flash-attention autotuner may pick computes attention, each kernel on its own.

On a GPU the autotuner times its candidate tiles and keeps the fastest, so which tile runs changes from run to
run (one H200 run passed test_kernels_bf16's windowed attention, the next gave dK 7% off). A tile that is wrong
only at some shape would fail at random; here each candidate of each kernel (forward, dK/dV, dQ) is forced in
turn, with its warps and stages on a GPU, the other two kernels on one fixed small tile, and the outputs and
gradients compared with the fp32 reference. bf16 on a GPU at a size that spans many tiles; fp32 under the
interpreter on a CPU, where the tile logic (spans, masks, edges) is checked but warps and stages are not. The
window (200 keys on a CPU) is wide enough that every tile also meets key blocks its queries see whole. On a GPU
each tile also runs twice (TILE_REPEATS) and must give the same bits (the races seen there moved from run to run)."""

from __future__ import annotations

import contextlib
import importlib
import os
import re

import pytest
import torch

from megatron_lite import kernels as K

from models import DEVICE, rel

FA = importlib.import_module("megatron_lite.kernels.flash_attention")
GPU = torch.cuda.is_available()
REPEATS = int(os.environ.get("TILE_REPEATS", "2"))
KINDS = {"fwd": ("_fwd", "_FWD_TILES"), "dkdv": ("_bwd_dkdv", "_DKDV_TILES"), "dq": ("_bwd_dq", "_DQ_TILES")}
CASES = [
    pytest.param(kind, tile, id=f"{kind}-{'x'.join(map(str, tile))}")
    for kind, (_, tiles) in KINDS.items()
    for tile in (getattr(FA, tiles) if hasattr(FA, tiles) else [])
]
FIXED = {"BLOCK_M": 32, "BLOCK_N": 32}  # the other kernels' tile (the fp32 one, which the fp32 tests cover)


@pytest.mark.skipif(not CASES, reason="Triton is not installed")
@pytest.mark.parametrize("window", [None, "window"])
@pytest.mark.parametrize("kind,tile", CASES)
def test_every_autotuner_tile_computes_attention(kind, tile, window):
    dtype = torch.bfloat16 if GPU else torch.float32
    # Grouped-query, seq_q < seq_k (bottom-right causal), lengths no tile divides; a window shorter than both.
    b, sq, sk, h, hkv, d = (2, 1000, 1100, 16, 4, 128) if GPU else (1, 300, 330, 2, 1, 16)
    window = None if window is None else (300 if GPU else 200)
    gen = torch.Generator().manual_seed(0)
    q, k, v, up = (
        torch.randn(b, s, nh, d, generator=gen).to(DEVICE, dtype) for s, nh in ((sq, h), (sk, hkv), (sk, hkv), (sq, h))
    )

    def run(fn, dt):
        leaves = [t.detach().to(dt, copy=True).requires_grad_() for t in (q, k, v)]  # fresh leaves each run
        o = fn(*leaves, causal=True, window_size=window)
        o.backward(up.to(dt))
        return [o.detach()] + [t.grad for t in leaves]

    before = {name: K.LAUNCHES[name] for name in ("flash_attention_fwd", "flash_attention_bwd")}
    with FA.forced_tile(kind, tile, others=FIXED):
        ours = run(K.flash_attention, dtype)
        # The kernels use no atomics: the same inputs give the same bits, and anything else is a race (one passed
        # two runs on one machine and differed on the next: TILE_REPEATS=N runs each tile N times)
        for i in range(1, REPEATS if GPU else 1):
            again = run(K.flash_attention, dtype)
            assert all(torch.equal(a, b) for a, b in zip(ours, again)), (kind, tile, window, f"run {i} differs")
    assert all(K.LAUNCHES[name] > n for name, n in before.items()), "no kernel ran"
    ref = run(K.flash_attention_reference, torch.float32)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4  # as test_kernels_bf16.py argues
    errs = {name: rel(a.float(), r) for name, a, r in zip(("o", "dq", "dk", "dv"), ours, ref)}
    assert all(e < tol for e in errs.values()), (kind, tile, window, errs)


@pytest.mark.skipif(not CASES, reason="Triton is not installed")
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_forced_tile_is_the_one_that_runs_and_only_inside_its_block(kind):
    """forced_tile reaches the launch: a tile Triton cannot build (24 rows) fails inside the block, in the kernel
    named only (a backward kernel's tile leaves the forward running), the others take `others`, and the usual
    tiles run again after the block."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, 16, generator=gen).to(DEVICE, torch.float32) for _ in range(3))
    bad, good = (24, 32, 4, 3), {"BLOCK_M": 16, "BLOCK_N": 16}

    def forward():
        return K.flash_attention(*[t.detach().clone().requires_grad_() for t in (q, k, v)], causal=True)

    with FA.forced_tile(kind, bad, others=good):
        if kind == "fwd":
            with _unbuildable():
                forward()
        else:
            out = forward()  # the forward on `others`
            with _unbuildable():
                out.sum().backward()
    with FA.forced_tile(kind, (16, 16, 4, 3), others={"BLOCK_M": 24, "BLOCK_N": 32}), _unbuildable():
        forward().sum().backward()  # some other kernel runs on `others`
    forward().sum().backward()
    assert not FA._FORCED


@contextlib.contextmanager
def _unbuildable():
    """The block raises Triton's refusal of a tile size that is not a power of two. The interpreter says so in
    its message; a GPU compile (Triton 3.6, an H200 run) raises a CompilationError that points at the call in
    the kernel's source and carries the reason in its cause."""
    with pytest.raises(Exception) as info:
        yield
    chain, e = [], info.value
    while e is not None and len(chain) < 8:
        chain.append(str(e))
        e = e.__cause__ or e.__context__
    assert re.search("power of 2|power-of-2|power of two", " | ".join(chain)), chain
