"""The Triton GEMM (writing into a strided output slice) against torch.matmul; CPU: interpreter, fp32."""

from __future__ import annotations

import pytest
import torch

from megatron_lite import kernels as K

from models import DEVICE, rel


def test_matmul_into_a_slice_of_a_larger_output():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 40, generator=g).to(DEVICE)
    w = torch.randn(24, 40, generator=g).to(DEVICE)
    out = torch.full((3, 37, 24), 7.0, device=DEVICE)
    before = K.LAUNCHES["gemm"]
    K.matmul_into(out[1], x, w)
    if K.HAVE_TRITON:
        assert K.LAUNCHES["gemm"] == before + 1  # the kernel ran, not the fallback
    assert rel(out[1], x @ w.t()) < 1e-6
    assert torch.all(out[0] == 7.0) and torch.all(out[2] == 7.0)  # nothing written outside the slice
    # Transposed operands (strides, not copies): dY W and dY^T X as the backward uses them.
    dy = torch.randn(37, 24, generator=g).to(DEVICE)
    assert rel(K.matmul_into(torch.empty(37, 40, device=DEVICE), dy, w.t()), dy @ w) < 1e-6
    assert rel(K.matmul_into(torch.empty(24, 40, device=DEVICE), dy.t(), x.t()), dy.t() @ x) < 1e-6


def test_linear_forward_and_backward():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(19, 33, generator=g).to(DEVICE).requires_grad_()
    w = torch.randn(21, 33, generator=g).to(DEVICE).requires_grad_()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    dy = torch.randn(19, 21, generator=g).to(DEVICE)
    K.linear(x, w).backward(dy)
    K.linear_reference(x2, w2).backward(dy)
    assert rel(x.grad, x2.grad) < 1e-6 and rel(w.grad, w2.grad) < 1e-6


def test_offsets_past_2_31_elements_are_detected():
    """The GEMM addresses rows and columns as int32 index x stride products; a tensor spanning 2^31 elements
    or more (counted from its strides: a transposed view spans as much as its base) must not reach it."""
    from megatron_lite.kernels._common import offsets_fit_int32

    meta = dict(device="meta")
    assert offsets_fit_int32(torch.empty(2**16, 2**15, **meta))  # 2^31 elements: the last is 2^31 - 1 in
    assert not offsets_fit_int32(torch.empty(2**16, 2**15 + 1, **meta))
    assert not offsets_fit_int32(torch.empty(2**16 + 1, 2**15, **meta).t())  # dY^T as the backward passes it
    assert not offsets_fit_int32(torch.empty(4, 4), torch.empty(3, 2**31, **meta)[:, :1])  # any of them
    assert offsets_fit_int32(torch.empty(0, 2**40, **meta))  # nothing to address


def test_matmul_into_falls_back_where_offsets_would_wrap(monkeypatch):
    """Past 2^31 elements matmul_into takes torch.matmul (here forced on small tensors), into a contiguous
    output and into a strided one."""
    from megatron_lite.kernels import gemm

    monkeypatch.setattr(gemm, "offsets_fit_int32", lambda *t: False)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(9, 8, generator=g).to(DEVICE), torch.randn(5, 8, generator=g).to(DEVICE)
    before = K.LAUNCHES["gemm"]
    out = torch.full((2, 9, 5), 7.0, device=DEVICE)
    K.matmul_into(out[1], x, w)
    strided = torch.full((5, 9), 7.0, device=DEVICE)
    K.matmul_into(strided.t(), x, w)
    assert K.LAUNCHES["gemm"] == before  # the kernel did not run
    assert rel(out[1], x @ w.t()) < 1e-6 and torch.all(out[0] == 7.0)
    assert rel(strided.t(), x @ w.t()) < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 needs a GPU: the interpreter has no bf16 arithmetic")
def test_bf16_on_gpu():
    x = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(2000, 768, device="cuda", dtype=torch.bfloat16)
    K.matmul_into(out[500:1500], x, w)
    assert rel(out[500:1500].float(), x.float() @ w.float().t()) < 1e-2
