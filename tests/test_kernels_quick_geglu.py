"""gpt-oss's activation kernel (Megatron's --quick-geglu with --glu-linear-offset and --activation-func-clamp-value),
forward and backward, against the plain-PyTorch reference (kernels.quick_geglu_reference, whose gradient is
autograd's) and the formula written out by hand: odd shapes (widths no power of two, one row, more rows than a
program takes, more columns than a block), values on both sides of the clamps and exactly on them, and a launch
count proving the kernel ran. On a CPU the kernel runs under TRITON_INTERPRET=1 (conftest.py); bf16 needs a GPU.
Tolerance (fp32, per tensor ||a-b||/||b||): 1e-5, as the other element-wise kernels'."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_lite import kernels as K
from megatron_lite.config import ModelConfig
from megatron_lite.moe.experts import ExpertMLP
from megatron_lite.parallel_context import Group

from models import DEVICE, needs_triton_on_cpu, rel

TOL = 1e-5
GPT_OSS = (1.0, 7.0)  # offset, clamp


def _rand(*shape, seed=0, scale=1.0, dtype=torch.float32):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
    return t.to(device=DEVICE, dtype=dtype)


def _run(fn, h, offset, clamp, seed=9):
    x = h.clone().requires_grad_(True)
    y = fn(x, offset, clamp)
    y.backward(_rand(*y.shape, seed=seed, dtype=y.dtype))
    return y.detach(), x.grad


def _check(h, offset, clamp, tol=TOL):
    before = K.LAUNCHES["quick_geglu_fwd"], K.LAUNCHES["quick_geglu_bwd"]
    y, dh = _run(K.quick_geglu, h, offset, clamp)
    assert K.LAUNCHES["quick_geglu_fwd"] > before[0] and K.LAUNCHES["quick_geglu_bwd"] > before[1], "no kernel ran"
    ry, rdh = _run(K.quick_geglu_reference, h, offset, clamp)
    assert y.shape == ry.shape and dh.shape == h.shape and dh.dtype == h.dtype
    assert rel(y, ry) < tol and rel(dh, rdh) < tol, (rel(y, ry), rel(dh, rdh))
    # the clamps pass no gradient to a clamped entry: the same entries are zero as autograd's
    assert torch.equal(dh == 0, rdh == 0)
    return dh


@pytest.mark.parametrize("shape", [(1, 5), (7, 130), (130, 48), (2, 3, 1500)])  # (1500: two column blocks)
@pytest.mark.parametrize("offset,clamp", [GPT_OSS, (0.0, None), (-0.5, 1.5)])
def test_quick_geglu_equals_reference(shape, offset, clamp):
    """Scaled so that a clamp of 7 bites too (about one entry in ten is past +-7), and in every row a gate entry
    past the clamp and up entries past it on both sides."""
    h = _rand(*shape[:-1], 2 * shape[-1], scale=4.0)
    f = shape[-1]
    h[..., 0], h[..., f], h[..., -1] = 10.0, -10.0, 10.0
    _check(h, offset, clamp)


def test_quick_geglu_is_the_formula_written_out():
    """The oracle itself against the activation written out by hand in fp64 (Megatron-Core's unfused GLU: glu
    clamped from above, linear on both sides, quick_gelu(glu) * (linear + offset)), with its derivative."""
    h = _rand(9, 2 * 37, scale=4.0, seed=3)
    g, u = h.double().chunk(2, dim=-1)
    gc, uc = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
    s = 1 / (1 + torch.exp(-1.702 * gc))
    want = gc * s * (uc + 1.0)
    dy = _rand(9, 37, seed=9).double()
    dg = dy * (uc + 1.0) * (s + 1.702 * gc * s * (1 - s)) * (g <= 7.0)
    du = dy * gc * s * ((u >= -7.0) & (u <= 7.0))
    y, dh = _run(K.quick_geglu, h, *GPT_OSS)
    assert rel(y, want) < TOL and rel(dh, torch.cat([dg, du], dim=-1)) < TOL


@pytest.mark.parametrize("clamp", [7.0, 7.3])  # (7.3 is no float32: the bound is float32(7.3), as torch's)
def test_gradient_at_and_around_the_clamps_is_autograds(clamp):
    """torch.clamp's backward passes the gradient where min <= x <= max: an entry exactly on a bound keeps its
    gradient, one a float past it gets none. Every gate and up entry here is on a bound, just inside or just
    outside it, or far outside; then NaNs (clamp keeps a NaN and passes it no gradient)."""
    c = torch.tensor(clamp, dtype=torch.float32)
    up_c, down_c = torch.nextafter(c, c + 1), torch.nextafter(c, c - 1)
    values = torch.stack([c, up_c, down_c, -c, -up_c, -down_c, c * 3, -c * 3, torch.tensor(0.5)])
    n = len(values)
    gate = values.repeat(n)  # every gate value beside every up value
    up = values.repeat_interleave(n)
    h = torch.cat([gate, up]).view(1, -1).repeat(3, 1).to(DEVICE)
    dh = _check(h, 1.0, clamp)
    f = n * n
    dgate, dup = dh[:, :f].cpu(), dh[:, f:].cpu()
    gate_passes = gate <= c  # on the bound: passes
    up_passes = (up >= -c) & (up <= c)
    assert torch.equal(dgate[0] != 0, gate_passes), "the gate's clamp gradient is not autograd's"
    assert torch.equal(dup[0] != 0, up_passes), "the up half's clamp gradient is not autograd's"
    # NaN in a gate and in an up entry: the outputs are NaN; neither NaN gets a gradient, and the up entry beside
    # the NaN gate gets NaN (its product with the gate's NaN), as from autograd
    h[:, 0], h[:, f + 1] = float("nan"), float("nan")
    y, dh = _run(K.quick_geglu, h, 1.0, clamp)
    ry, rdh = _run(K.quick_geglu_reference, h, 1.0, clamp)
    assert torch.equal(y.isnan(), ry.isnan()) and y[:, 0].isnan().all() and y[:, 1].isnan().all()
    assert torch.equal(dh.isnan(), rdh.isnan()) and torch.equal(dh == 0, rdh == 0)
    assert (dh[:, 0] == 0).all() and (dh[:, f + 1] == 0).all() and dh[:, f].isnan().all()


def test_quick_geglu_saves_only_its_input():
    """The kernel keeps fc1's output for the backward and recomputes the rest (PyTorch's ops keep the clamped
    halves, the sigmoid and products: several [tokens, f] tensors)."""
    h = _rand(4, 2 * 96).requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        K.quick_geglu(h * 1.0, *GPT_OSS)
    assert saved and len({t.untyped_storage().data_ptr() for t in saved}) == 1
    assert saved[0].untyped_storage().nbytes() == h.numel() * 4


def test_strided_input_and_broadcast_gradient():
    """fc1's output as a view with a wider row (read in place), and a gradient expanded over rows (stride 0)."""
    wide = _rand(6, 2 * 40 + 7, scale=4.0)
    outs = []
    for fn in (K.quick_geglu, K.quick_geglu_reference):
        x = wide.clone().requires_grad_(True)
        y = fn(x[:, 3 : 3 + 80], *GPT_OSS)
        (y.sum(0) * _rand(40, seed=1)).sum().backward()
        outs.append((y.detach(), x.grad))
    assert rel(outs[0][0], outs[1][0]) < TOL and rel(outs[0][1], outs[1][1]) < TOL


@pytest.mark.parametrize("shape", [(3, 0), (0, 8)])
def test_empty_inputs_and_bad_arguments(shape):
    h = torch.randn(shape)
    assert torch.equal(K.quick_geglu(h, *GPT_OSS), K.quick_geglu_reference(h, *GPT_OSS))
    with pytest.raises(ValueError, match=r"the last dimension of \(2, 5\) is odd"):
        K.quick_geglu(torch.randn(2, 5), *GPT_OSS)
    for clamp in (0.0, -7.0, float("nan")):  # (the flag refuses them at start-up; the entry too)
        with pytest.raises(ValueError, match=rf"quick_geglu: clamp {clamp} must be a finite number > 0"):
            K.quick_geglu(torch.randn(2, 4), 1.0, clamp)


@needs_triton_on_cpu  # (on a GPU each program takes one row)
def test_several_rows_per_program_under_the_interpreter(monkeypatch):
    """37 rows of 20 columns at 256 elements a program: 8 rows each, the last program holding 5."""
    from megatron_lite.kernels import _common

    monkeypatch.setattr(_common, "INTERPRETER_BLOCK", 256)
    assert _common.rows_per_program(32, 37) == 8
    _check(_rand(37, 40, scale=4.0), *GPT_OSS)


def test_experts_one_by_one_run_the_kernel_under_triton():
    """An expert computed on its own (NF4 or fp8 experts under --kernel-impl triton) runs the kernel too."""
    config = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=4, vocab_size=10, ffn_hidden_size=12,
                         num_experts=2, activation="quick_geglu", glu_linear_offset=1.0,
                         activation_func_clamp_value=0.5, add_bias_linear=True)  # fmt: skip
    x = _rand(5, 16, seed=2)
    got = []
    for impl in ("triton", "torch"):
        torch.manual_seed(0)
        expert = ExpertMLP(dataclasses.replace(config, kernel_impl=impl), Group((0,), 0), device=DEVICE)
        with torch.no_grad():
            for p in expert.parameters():
                p.copy_(_rand(*p.shape, seed=p.numel()))
        before = K.LAUNCHES["quick_geglu_bwd"]
        xi = x.clone().requires_grad_(True)
        y = expert(xi)
        y.square().sum().backward()
        assert (K.LAUNCHES["quick_geglu_bwd"] > before) == (impl == "triton")
        got.append((y.detach(), xi.grad))
    assert rel(got[0][0], got[1][0]) < TOL and rel(got[0][1], got[1][1]) < TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 needs a GPU: the Triton interpreter has no bf16")
def test_gpu_bf16_clamp_bound_is_torchs_bf16_bound():
    """In bf16 torch.clamp rounds the bound to bf16 (7.3 -> 7.3125) and compares there: an entry of 7.3125 is on the
    bound and keeps its gradient. The kernel's gradient is zero exactly where torch's bf16 autograd's is."""
    c = torch.tensor(7.3, dtype=torch.bfloat16)
    values = torch.stack([c, -c, c * 2, -c * 2, torch.tensor(0.5, dtype=torch.bfloat16)])
    gate, up = values.repeat(5), values.repeat_interleave(5)
    h = torch.cat([gate, up]).view(1, -1).repeat(300, 1).cuda()
    y, dh = _run(K.quick_geglu, h, 1.0, 7.3)
    ry, rdh = _run(K.quick_geglu_reference, h, 1.0, 7.3)
    assert torch.equal(dh == 0, rdh == 0) and rel(y.float(), ry.float()) < 2e-2 and rel(dh.float(), rdh.float()) < 2e-2


COMPILE = """
import importlib, json
from megatron_lite.kernels import check_compile
from megatron_lite.kernels._common import compile_for_gpu
out = {"listed": "quick_geglu" in check_compile.MODULES}
for name, kernel, signature, constexprs in importlib.import_module("megatron_lite.kernels.quick_geglu").COMPILE_CASES:
    ptx = compile_for_gpu(kernel, signature, constexprs, 90).asm["ptx"]
    out[name] = ".target sm_90" in ptx
print(json.dumps(out))
"""


@pytest.mark.skipif(not K.HAVE_TRITON, reason="needs triton (Linux)")
def test_kernels_compile_for_hopper():
    """Forward and backward, bf16 and fp32, with and without the clamp, compiled for sm_90 on this machine, GPU or
    not (outside the interpreter, which patches triton.language); and the full check (check_compile, run by
    tests/test_kernels_compile.py) lists the module."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(out) == 9 and all(out.values()), out
