"""Every differentiable kernel in bf16, forward and backward, against its fp32 reference on the same inputs
(the bf16 values upcast): what training on a GPU runs. The interpreter has no bf16 arithmetic, so bf16 runs on a
GPU only; the fp32 variant runs everywhere (the Triton interpreter on a CPU) and checks these tests' own logic.

Tolerance, per tensor ||a - b|| / ||b||: bf16 keeps 8 bits of mantissa (a relative rounding of 2^-9 per
element), and a kernel rounds its output and some intermediates (attention's probabilities before P V, the
fused cross-entropy's logits and chunked weight gradient). 2e-2 leaves room for that and still catches a wrong
scale, a missed mask or a dropped block, which give errors of order one."""

from __future__ import annotations

import pytest
import torch

from megatron_lite import kernels as K

from models import DEVICE, rel

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(
        torch.bfloat16,
        id="bf16",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="bf16 needs a GPU: the Triton interpreter has no bf16 arithmetic"
        ),
    ),
]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _rand(*shape, seed, dtype, scale=1.0):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    return t.to(DEVICE).to(dtype)


def _grads(fn, inputs, seed=99):
    """fn's outputs and the gradients of its floating inputs for a random upstream gradient."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    outs = fn(*leaves)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    floats = [o for o in outs if o.is_floating_point() and o.requires_grad]
    ups = [_rand(*o.shape, seed=seed + i, dtype=o.dtype) for i, o in enumerate(floats)]
    torch.autograd.backward(floats, ups)
    return [o.detach() for o in outs] + [t.grad for t in leaves if t.is_floating_point()]


def _check(ours_fn, ref_fn, inputs, dtype, launch: str, names):
    before = K.LAUNCHES[launch]
    ours = _grads(ours_fn, inputs)
    assert K.LAUNCHES[launch] > before, f"{launch}: the Triton kernel did not run"
    # The oracle: the reference in fp32 on the very same values, with the same upstream gradients.
    ref = _grads(ref_fn, [t.float() if t.is_floating_point() else t for t in inputs])
    assert len(ours) == len(ref) == len(names)
    n_out = len(names) - sum(t.is_floating_point() for t in inputs)
    for name, a, b in zip(names, ours, ref):
        if names.index(name) >= n_out:  # a gradient comes back in its input's dtype
            assert a.dtype == dtype, (name, a.dtype)
        assert torch.isfinite(a.float()).all(), name
        err = rel(a.float(), b.float())
        assert err < TOL[dtype], (name, err)


def _shape(dtype, gpu, cpu):
    return gpu if dtype == torch.bfloat16 else cpu


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
def test_norms(dtype, residual, norm):
    rows, n = _shape(dtype, (300, 4096), (37, 200))
    x, w, b = _rand(rows, n, seed=0, dtype=dtype), _rand(n, seed=1, dtype=dtype) + 1, _rand(n, seed=2, dtype=dtype)
    r = _rand(rows, n, seed=3, dtype=dtype)
    rms = norm == "rms_norm"
    params = [w] if rms else [w, b]
    fused, reference = (K.rms_norm, K.rms_norm_reference) if rms else (K.layer_norm, K.layer_norm_reference)

    def call(fn):  # inputs: x, the norm's parameters, then the residual when there is one
        return lambda x, *rest: fn(x, *rest[: len(params)], 1e-5, residual=rest[len(params)] if residual else None)

    inputs = [x, *params] + ([r] if residual else [])
    names = ["y", *(["sum"] if residual else []), "dx", "dw", *([] if rms else ["db"]), *(["dr"] if residual else [])]
    _check(call(fused), call(reference), inputs, dtype, f"{norm}_bwd", names)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype):
    rows, n = _shape(dtype, (256, 14336), (19, 300))
    gate, up = _rand(rows, n, seed=0, dtype=dtype), _rand(rows, n, seed=1, dtype=dtype)
    _check(K.swiglu, K.swiglu_reference, [gate, up], dtype, "swiglu_bwd", ["y", "dgate", "dup"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_stacked(dtype):
    rows, n = _shape(dtype, (256, 2 * 14336), (19, 2 * 150))
    h = _rand(rows, n, seed=0, dtype=dtype)
    _check(K.swiglu_stacked, K.swiglu_stacked_reference, [h], dtype, "swiglu_bwd", ["y", "dh"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_quick_geglu(dtype):
    """gpt-oss's activation (offset 1, clamp 7) at its expert width, 2880; values scaled so that the clamps bite."""
    rows, n = _shape(dtype, (256, 2 * 2880), (19, 2 * 150))
    h = _rand(rows, n, seed=0, dtype=dtype, scale=4.0)
    ours, ref = (lambda t, fn=fn: fn(t, 1.0, 7.0) for fn in (K.quick_geglu, K.quick_geglu_reference))
    _check(ours, ref, [h], dtype, "quick_geglu_bwd", ["y", "dh"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope(dtype):
    b, s, h, d = _shape(dtype, (2, 512, 32, 128), (2, 7, 3, 16))
    x = _rand(b, s, h, d, seed=0, dtype=dtype)
    ang = torch.randn(s, d // 2, generator=torch.Generator().manual_seed(1)).to(DEVICE).repeat(1, 2)
    cos, sin = ang.cos(), ang.sin()
    _check(
        lambda x: K.apply_rope(x, cos, sin),
        lambda x: K.apply_rope_reference(x, cos, sin),
        [x],
        dtype,
        "rope_bwd",
        ["y", "dx"],
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 300])
def test_flash_attention(dtype, window):
    # Grouped-query, a sequence that is not a multiple of any tile, seq_q < seq_k (bottom-right causal).
    b, sq, sk, h, hkv, d = _shape(dtype, (2, 1000, 1100, 16, 4, 128), (1, 40, 45, 4, 2, 16))
    window = None if window is None else _shape(dtype, window, 20)
    q, k, v = (_rand(b, s, n, d, seed=i, dtype=dtype) for i, (s, n) in enumerate([(sq, h), (sk, hkv), (sk, hkv)]))
    _check(
        lambda q, k, v: K.flash_attention(q, k, v, causal=True, window_size=window),
        lambda q, k, v: K.flash_attention_reference(q, k, v, causal=True, window_size=window),
        [q, k, v],
        dtype,
        "flash_attention_bwd",
        ["o", "dq", "dk", "dv"],
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 300])
def test_flash_attention_with_learned_sinks(dtype, window):
    """gpt-oss's attention sinks (--softmax-type learnable) through the flash kernel, its output times
    sigmoid(lse - offset), against the unfused softmax with the offset column (models/attention_variants.py),
    the offsets' gradient included; seq_q < seq_k (a KV cache's bottom-right causal mask)."""
    from megatron_lite.models.attention import attention_mask
    from megatron_lite.models.attention_variants import attention_with_offset, flash_attention_with_offset

    b, sq, sk, h, hkv, d = _shape(dtype, (2, 700, 800, 16, 4, 64), (1, 40, 45, 4, 2, 16))
    window = None if window is None else _shape(dtype, window, 20)
    q, k, v = (_rand(b, s, n, d, seed=i, dtype=dtype) for i, (s, n) in enumerate([(sq, h), (sk, hkv), (sk, hkv)]))
    offset = _rand(h, seed=7, dtype=torch.float32, scale=2.0)  # (fp32 as the model holds it)
    visible = attention_mask(sq, sk, window, q.device)
    _check(
        lambda q, k, v, o: flash_attention_with_offset(q, k, v, o, None, window, None),
        lambda q, k, v, o: attention_with_offset(q, k, v, o, None, visible),
        [q, k, v, offset],
        dtype,
        "flash_attention_bwd",
        ["o", "dq", "dk", "dv", "doffset"],
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_linear_cross_entropy(dtype):
    tokens, hidden, vocab = _shape(dtype, (1000, 512, 32000), (37, 24, 50))
    hid = _rand(tokens, hidden, seed=0, dtype=dtype)
    w = _rand(vocab, hidden, seed=1, dtype=dtype, scale=0.05)
    labels = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    labels[::7] = -100
    chunk = tokens // 3  # several chunks: the weight gradient accumulates across them in the weight's dtype
    _check(
        lambda h, w: K.fused_linear_cross_entropy(h, w, labels, chunk_size=chunk),
        lambda h, w: K.fused_linear_cross_entropy_reference(h, w, labels),
        [hid, w],
        dtype,
        "cross_entropy_grad",
        ["loss", "dhidden", "dweight"],
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_permute_unpermute_and_grouped_gemm(dtype):
    t, k, e, hdim, f = _shape(dtype, (2048, 2, 8, 1024, 768), (23, 2, 5, 20, 12))
    g = torch.Generator().manual_seed(0)
    indices = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(DEVICE)
    keep = (torch.rand(t, k, generator=g) > 0.2).to(DEVICE)
    x = _rand(t, hdim, seed=1, dtype=dtype)
    probs = torch.rand(t, k, generator=g).to(DEVICE).to(dtype)
    w = _rand(e, f, hdim, seed=2, dtype=dtype, scale=hdim**-0.5)
    flat = indices.reshape(-1)[keep.reshape(-1)]
    counts = torch.bincount(flat, minlength=e).cpu()

    def layer(permute, unpermute, gemm):
        def run(x, probs, w):
            permuted, row_map = permute(x, indices, keep)
            return unpermute(gemm(permuted, w, counts), row_map, probs)

        return run

    _check(
        layer(K.moe_permute, K.moe_unpermute, K.grouped_gemm),
        layer(K.moe_permute_reference, K.moe_unpermute_reference, K.grouped_gemm_reference),
        [x, probs, w],
        dtype,
        "grouped_gemm_bwd",
        ["y", "dx", "dprobs", "dw"],
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear(dtype):
    m, n, kdim = _shape(dtype, (1000, 768, 512), (19, 21, 33))
    x, w = _rand(m, kdim, seed=0, dtype=dtype), _rand(n, kdim, seed=1, dtype=dtype, scale=kdim**-0.5)
    _check(K.linear, K.linear_reference, [x, w], dtype, "gemm", ["y", "dx", "dw"])
