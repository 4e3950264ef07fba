"""Kernels on tensors of more than 2^31 elements (GPU only: each needs several GB). A program id times a
row or batch stride is int32 arithmetic in Triton, which wraps past 2^31 and reads or writes elsewhere; the
kernels widen those products to int64. Each test checks the rows beyond the 2^31st element against the
reference computed on those rows alone, and the first rows too."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_lite import kernels as K
from megatron_lite.kernels.cross_entropy import fused_linear_cross_entropy_reference
from megatron_lite.kernels.moe import moe_permute_reference, moe_unpermute_reference
from megatron_lite.kernels.nf4 import NF4_LEVELS, NF4Weight

# A dry run of the tests' own logic on the CPU (interpreter, fp32): LARGE_KERNEL_TESTS_ON_CPU=16384 stands that
# many elements in for 2^31.
DRY = int(os.environ.get("LARGE_KERNEL_TESTS_ON_CPU", "0"))
DEV, DT, BIG = ("cpu", torch.float32, DRY) if DRY else ("cuda", torch.bfloat16, 2**31)
pytestmark = [
    pytest.mark.skipif(not DRY and not torch.cuda.is_available(), reason="needs a CUDA GPU with ~40 GB free"),
    # Under pytest-xdist with --dist loadgroup (tools/device_checks.sh) the three run one after another on one
    # worker: side by side they would hold ~60 GB beside the other kernel tests.
    pytest.mark.xdist_group("large_kernels"),
]


@pytest.fixture(autouse=True)
def _release_memory():
    """Give the cached blocks back after each test: other xdist workers are other processes, and cannot use
    what this one's caching allocator holds."""
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def test_flash_attention_past_2_31_elements():
    s, h, d = 64, 1, 64
    b = BIG // (s * h * d) + 2  # the last two sequences start past element 2^31
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v, do = (torch.randn(b, s, h, d, device=DEV, dtype=DT, generator=g) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    before = K.LAUNCHES["flash_attention_fwd"], K.LAUNCHES["flash_attention_bwd"]
    o = K.flash_attention(*leaves, causal=True)
    o.backward(do)
    assert (K.LAUNCHES["flash_attention_fwd"], K.LAUNCHES["flash_attention_bwd"]) == (before[0] + 1, before[1] + 1)
    for i in (0, b - 1):
        ref = [t[i : i + 1].detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v)]
        ro = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True)
        ro.backward(do[i : i + 1].float().transpose(1, 2))
        assert _rel(o[i : i + 1], ro.transpose(1, 2)) < 1e-2, i
        for leaf, r in zip(leaves, ref):
            assert _rel(leaf.grad[i : i + 1], r.grad.transpose(1, 2)) < 2e-2, i


def test_moe_permute_and_unpermute_past_2_31_elements():
    hidden, topk = 4096, 8
    tokens = BIG // (hidden * topk) + 64  # permuted rows x hidden pass 2^31
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(tokens, hidden, device=DEV, dtype=DT, generator=g)
    indices = torch.randint(0, 16, (tokens, topk), device=DEV, generator=g)
    before = K.LAUNCHES["moe_permute"], K.LAUNCHES["moe_unpermute"]
    y, row_map = K.moe_permute(x, indices)
    ref, ref_map = moe_permute_reference(x, indices)
    assert torch.equal(row_map, ref_map) and torch.equal(y[:64], ref[:64]) and torch.equal(y[-64:], ref[-64:])
    del y, ref, x, indices, row_map, ref_map

    tokens = BIG // hidden + 64  # tokens x hidden pass 2^31: the combine's own rows
    out = torch.randn(tokens, hidden, device=DEV, dtype=DT, generator=g).requires_grad_()
    row_map = torch.arange(tokens, device=DEV).flip(0).view(tokens, 1)
    probs = torch.rand(tokens, 1, device=DEV, generator=g).requires_grad_()
    got = K.moe_unpermute(out, row_map, probs)
    dy = torch.randn_like(got)
    got.backward(dy)
    assert K.LAUNCHES["moe_permute"] == before[0] + 1 and K.LAUNCHES["moe_unpermute"] == before[1] + 1
    for rows in (slice(0, 64), slice(tokens - 64, tokens)):
        src = row_map[rows, 0]
        o = out.detach()[src].requires_grad_()
        p = probs.detach()[rows].requires_grad_()
        expect = moe_unpermute_reference(o, torch.arange(64, device=DEV).view(64, 1), p)
        expect.backward(dy[rows])
        assert _rel(got[rows], expect) < 1e-2
        assert _rel(out.grad[src], o.grad) < 1e-2 and _rel(probs.grad[rows], p.grad) < 1e-2


def test_fused_cross_entropy_past_2_31_logits():
    """One chunk of logits (an explicit chunk_size x the vocabulary) past 2^31 elements: the row kernels'
    row x stride offsets. Per-token losses and hidden-state gradients of the first and last rows against the
    reference on those rows alone."""
    vocab, h = min(65536, BIG // 64), 64
    tokens = BIG // vocab + 64  # the last 64 rows of logits start past element 2^31
    g = torch.Generator(device=DEV).manual_seed(0)
    hidden = (torch.randn(tokens, h, device=DEV, dtype=DT, generator=g) / h**0.5).requires_grad_()
    weight = torch.randn(vocab, h, device=DEV, dtype=DT, generator=g)
    labels = torch.randint(0, vocab, (tokens,), device=DEV, generator=g)
    dy = torch.rand(tokens, device=DEV, generator=g)  # a different gradient per token: the scale rows too
    before = K.LAUNCHES["cross_entropy_stats"], K.LAUNCHES["cross_entropy_grad"]
    losses = K.fused_linear_cross_entropy(hidden, weight, labels, reduction="none", chunk_size=tokens)
    losses.backward(dy)
    # the backward recomputes the statistics (this reduction's gradients are not made in the forward)
    assert K.LAUNCHES["cross_entropy_stats"] > before[0] and K.LAUNCHES["cross_entropy_grad"] == before[1] + 1
    for rows in (slice(0, 64), slice(tokens - 64, tokens)):
        x = hidden.detach()[rows].float().requires_grad_()
        expect = fused_linear_cross_entropy_reference(x, weight.float(), labels[rows], reduction="none")
        expect.backward(dy[rows])
        assert _rel(losses[rows], expect) < 1e-2, rows
        assert _rel(hidden.grad[rows], x.grad) < 2e-2, rows


def test_grouped_gemm_weight_gradient_past_2_31_elements():
    """Stacked expert weights of more than 2^31 elements: the weight-gradient kernel's expert x stride offset.
    The last expert's output and gradients against the reference on its rows alone, and the first's."""
    n = k = min(4096, int(BIG**0.5) // 4)
    experts, per = BIG // (n * k) + 2, 4  # the last two experts' weights start past element 2^31
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(experts * per, k, device=DEV, dtype=DT, generator=g).requires_grad_()
    w = (torch.randn(experts, n, k, device=DEV, dtype=DT, generator=g) / k**0.5).requires_grad_()
    counts = torch.full((experts,), per, device=DEV)
    before = K.LAUNCHES["grouped_gemm_fwd"], K.LAUNCHES["grouped_gemm_bwd"]
    y = K.grouped_gemm(x, w, counts)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert (K.LAUNCHES["grouped_gemm_fwd"], K.LAUNCHES["grouped_gemm_bwd"]) == (before[0] + 1, before[1] + 1)
    for e in (0, experts - 1):
        rows = slice(e * per, (e + 1) * per)
        xe, we = x.detach()[rows].float().requires_grad_(), w.detach()[e].float().requires_grad_()
        (xe @ we.t()).backward(dy[rows].float())
        assert _rel(y[rows], xe @ we.t()) < 1e-2, e
        assert _rel(x.grad[rows], xe.grad) < 2e-2 and _rel(w.grad[e], we.grad) < 2e-2, e


def test_nf4_dequantisation_past_2_31_values():
    n = BIG + 4096
    blocks = n // 64
    g = torch.Generator(device=DEV).manual_seed(0)
    q = NF4Weight(
        packed=torch.randint(0, 256, (n // 2,), device=DEV, dtype=torch.uint8, generator=g),
        shape=torch.Size([n]),
        dtype=DT,
        blocksize=64,
        absmax=torch.rand(blocks, device=DEV, generator=g) + 0.5,
    )
    before = K.LAUNCHES["nf4_dequant"]
    w = K.dequantize_nf4(q)
    assert K.LAUNCHES["nf4_dequant"] == before + 1  # the kernel ran, not the reference
    levels = torch.tensor(NF4_LEVELS, device=DEV)
    for start in (0, n - 4096):
        packed = q.packed[start // 2 : (start + 4096) // 2]
        codes = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1).long()
        scale = q.absmax[start // q.blocksize : (start + 4096) // q.blocksize].repeat_interleave(q.blocksize)
        assert torch.equal(w[start : start + 4096], (levels[codes] * scale).to(DT)), start
