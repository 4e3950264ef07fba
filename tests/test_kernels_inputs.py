"""Inputs the kernels' functional entries refuse, in one line, where the Triton path read or wrote out of bounds
or returned a plausible wrong number (the references raise on most of them too); and RoPE tables that need a
gradient get one. Found by a review of the kernels against fp64 (2026-12-03)."""

from __future__ import annotations

import pytest
import torch

from megatron_lite import kernels as K
from megatron_lite.kernels._common import interpreting

from models import DEVICE, rel


def _r(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).to(DEVICE)


@pytest.mark.parametrize("rows", [4, 64])  # shorter than the sequence (read past the end), longer
def test_rope_tables_of_another_length_are_refused(rows):
    x, ang = _r(1, 8, 2, 16), _r(rows, 16, seed=1)
    with pytest.raises(ValueError, match=rf"apply_rope: cos \({rows}, 16\) for x \(1, 8, 2, 16\)"):
        K.apply_rope(x, ang.cos(), ang.sin())


def test_rope_tables_of_half_the_head_dim_are_refused():
    x, ang = _r(1, 8, 2, 16), _r(8, 8, seed=1)
    with pytest.raises(ValueError, match="must be \\[seq, head_dim\\] = \\(8, 16\\)"):
        K.apply_rope(x, ang.cos(), ang.sin())


def test_rope_tables_that_need_a_gradient_get_the_references():
    """The kernel's backward returns x's gradient alone: tables that require grad (a learned rotation) had none."""
    x = _r(2, 8, 2, 16).requires_grad_()
    ang = _r(8, 16, seed=1)
    grads = []
    for fn in (K.apply_rope, K.apply_rope_reference):
        cos, sin = ang.cos().requires_grad_(), ang.sin().requires_grad_()
        (fn(x, cos, sin) * _r(2, 8, 2, 16, seed=2)).sum().backward()
        grads.append((cos.grad, sin.grad))
    assert grads[0][0] is not None and grads[0][1] is not None
    assert rel(grads[0][0], grads[1][0]) < 1e-6 and rel(grads[0][1], grads[1][1]) < 1e-6


@pytest.mark.parametrize("which", ["rms short", "rms long", "ln bias", "residual"])
def test_norm_weights_and_residuals_of_another_shape_are_refused(which):
    x = _r(4, 8)
    with pytest.raises(ValueError, match="norm (weight|bias|residual)"):
        if which == "rms short":  # (the kernel read past its end)
            K.rms_norm(x, torch.ones(4, device=DEVICE), 1e-5)
        elif which == "rms long":
            K.rms_norm(x, torch.ones(16, device=DEVICE), 1e-5)
        elif which == "ln bias":
            K.layer_norm(x, torch.ones(8, device=DEVICE), torch.zeros(3, device=DEVICE), 1e-5)
        else:
            K.rms_norm(x, torch.ones(8, device=DEVICE), 1e-5, residual=_r(4, 1))


def test_moe_unpermute_refuses_probs_not_shaped_as_the_row_map():
    out, row_map = _r(6, 8), torch.tensor([[0, 1], [2, 3], [4, 5]], device=DEVICE)
    with pytest.raises(ValueError, match=r"probs \(3,\) must be row_map's"):
        K.moe_unpermute(out, row_map, torch.rand(3, device=DEVICE))
    # (an exploratory run: a 3-D out was read with its second dimension as the row width, other elements)
    for bad in (_r(6, 8).view(3, 2, 8), _r(6)):
        with pytest.raises(ValueError, match=r"moe_unpermute: out .* must be the experts' rows \[rows, hidden\]"):
            K.moe_unpermute(bad, row_map, torch.rand(3, 2, device=DEVICE))


def test_fused_cross_entropy_refuses_hidden_and_weight_of_two_dtypes():
    """(it was torch's own 'expected m1 and m2 to have the same dtype' from deep inside, naming no function)"""
    hidden, weight = _r(4, 8).double(), _r(5, 8)
    with pytest.raises(ValueError, match=r"hidden \(torch.float64\) and weight \(torch.float32\) must share"):
        K.fused_linear_cross_entropy(hidden, weight, torch.zeros(4, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("counts", [[3, 2, 2], [5, 5, 5]])  # fewer rows than x's (left unwritten), more (past x)
def test_grouped_gemm_refuses_counts_that_do_not_sum_to_the_rows(counts):
    x, w = _r(10, 16), _r(3, 8, 16, seed=1)
    with pytest.raises(ValueError, match=f"counts sum to {sum(counts)}, not x's 10 rows"):
        K.grouped_gemm(x, w, torch.tensor(counts, device=DEVICE))
    with pytest.raises(ValueError, match="counts \\(2,\\) for 3 experts"):
        K.grouped_gemm(x, w, torch.tensor([5, 5], device=DEVICE))


@pytest.mark.parametrize(
    "label, ignore_index, vocab_size",
    [(40, -100, None), (-100, -1, None), (35, -100, 30)],  # >= V; HF's -100 with another ignore_index; padding
    ids=["past_the_vocabulary", "another_ignore_index", "a_padding_column"],
)
def test_fused_cross_entropy_refuses_labels_outside_the_vocabulary(label, ignore_index, vocab_size):
    """The kernel matched no column for such a label: its loss was the log-sum-exp alone, counted in the mean."""
    hidden, weight = _r(6, 16).requires_grad_(), _r(37, 16, seed=1)
    labels = torch.tensor([1, 2, label, 3, 4, 5], device=DEVICE)
    with pytest.raises(ValueError, match=rf"labels must be in \[0, {vocab_size or 37}\) or ignore_index"):
        K.fused_linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index, vocab_size=vocab_size)
    labels[2] = ignore_index  # (the same call with the label ignored runs)
    K.fused_linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index, vocab_size=vocab_size)


def test_flash_attention_refuses_a_document_id_that_comes_back():
    """Padding that reuses document 0 after document 1: each run was taken for a document of its own, where the
    reference (and the mask the ids mean) joins them (1.15 apart)."""
    q, k, v = (_r(1, 12, 2, 16, seed=s) for s in range(3))
    ids = torch.tensor([[0] * 4 + [1] * 4 + [0] * 4], device=DEVICE)
    with pytest.raises(ValueError, match="document_ids must keep each document's tokens together"):
        K.flash_attention(q, k, v, document_ids=ids)
    K.flash_attention(q, k, v, document_ids=torch.tensor([[2] * 4 + [1] * 4 + [0] * 4], device=DEVICE))


def test_flash_attention_refuses_q_k_v_of_different_dtypes():
    q, k, v = (_r(1, 8, 2, 16, seed=s) for s in range(3))
    with pytest.raises(ValueError, match="q, k and v must share a dtype"):
        K.flash_attention(q.half(), k, v)


# From the kernel API review of 2026-12-04 -------------------------------------------------------------------
def test_moe_unpermute_reads_a_row_map_of_any_layout():
    """The combine kernels read row_map as a contiguous [tokens, k]: the same map stored transposed gave other
    rows (1.03 off forward, 1.42 for dout), where the reference indexes it as a tensor."""
    from megatron_lite.kernels import _common

    x, probs = _r(6, 8).requires_grad_(), torch.rand(6, 2, device=DEVICE).requires_grad_()
    indices = torch.tensor([[0, 2], [1, 2], [0, 1], [2, 0], [1, 0], [2, 1]], device=DEVICE)
    out, row_map = K.moe_permute(x, indices)
    strided = row_map.t().contiguous().t()
    assert not strided.is_contiguous() and torch.equal(strided, row_map)
    dy = _r(6, 8, seed=3)
    results = []
    for fn, rm in ((K.moe_unpermute, strided), (K.moe_unpermute_reference, row_map)):
        before = _common.LAUNCHES["moe_unpermute"]
        y = fn(out, rm, probs)
        ran = _common.LAUNCHES["moe_unpermute"] > before
        results.append((y, *torch.autograd.grad(y, (x, probs), dy, retain_graph=True), ran))
    assert results[0][3] == K.triton_usable(x)  # (the kernel ran where it can)
    for a, b in zip(results[0][:3], results[1][:3]):
        assert rel(a, b) < 1e-6


def test_moe_unpermute_refuses_a_row_map_past_out():
    """Rows past out's were read beyond its end, without an error (the reference raises an IndexError)."""
    out, row_map = _r(5, 8), torch.tensor([[0, 7], [2, 3]], device=DEVICE)
    with pytest.raises((ValueError, IndexError), match="row_map names rows outside|out of bounds"):
        K.moe_unpermute(out, row_map, torch.rand(2, 2, device=DEVICE))


def test_moe_permute_refuses_an_integer_keep_mask():
    """A 0/1 int64 mask indexed the pairs instead of masking them: 8 rows for 5 kept, no error."""
    indices = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]], device=DEVICE)
    keep = torch.tensor([[1, 0], [1, 1], [0, 1], [1, 0]], device=DEVICE)
    with pytest.raises(ValueError, match="keep .* must be a bool mask"):
        K.moe_permute(_r(4, 8), indices, keep)
    out, _ = K.moe_permute(_r(4, 8), indices, keep.bool())
    assert out.shape[0] == 5


@pytest.mark.parametrize("case", ["wider x", "narrower x", "transposed weights", "uneven list", "dtypes"])
def test_grouped_gemm_refuses_weights_that_do_not_fit_x(case):
    """The kernels walk each expert's weight with x's width: a wider x read past the weights, a narrower one
    dropped their last columns (x @ w[:, :, :16]^T), weights laid out [E, K, N_out] gave garbage; no error."""
    counts = torch.tensor([5, 7], device=DEVICE)
    x, w = _r(12, 20), _r(2, 6, 20, seed=1)
    if case == "wider x":
        x = _r(12, 24)
    elif case == "narrower x":
        x = _r(12, 16)
    elif case == "transposed weights":
        w = _r(2, 20, 6, seed=1)
    elif case == "uneven list":
        w = [_r(6, 20, seed=1), _r(6, 24, seed=2)]
    else:
        x = x.half()
    with pytest.raises(ValueError, match="grouped_gemm: x"):
        K.grouped_gemm(x, w, counts)


@pytest.mark.parametrize("case", ["norm weight None", "rope 3-D", "rope odd", "ce 3-D", "ce labels"])
def test_other_inputs_of_the_wrong_form_are_one_line(case):
    """An AttributeError, an unpacking error or a broadcasting error deep in a launcher before; a ValueError that
    names the argument and the form it must have now."""
    with pytest.raises(ValueError, match=r"must be|pass a"):
        if case == "norm weight None":
            K.rms_norm(_r(4, 8), None, 1e-5)
        elif case == "rope 3-D":
            K.apply_rope(_r(8, 2, 16), _r(8, 16).cos(), _r(8, 16).sin())
        elif case == "rope odd":
            K.apply_rope(_r(1, 8, 2, 15), _r(8, 15).cos(), _r(8, 15).sin())
        elif case == "ce 3-D":
            K.fused_linear_cross_entropy(_r(2, 3, 16), _r(37, 16), torch.zeros(2, 3, dtype=torch.long, device=DEVICE))
        else:
            K.fused_linear_cross_entropy(_r(6, 16), _r(37, 16), torch.zeros(5, dtype=torch.long, device=DEVICE))


def test_every_op_launches_on_its_tensors_device():
    """Triton launches on the current CUDA device whatever the pointers; each functional entry enters its first
    tensor's device (from a kernel review: a model on cuda:1 without torch.cuda.set_device ran its kernels on
    device 0). Checked here by construction; a two-GPU machine runs them."""
    ops = [n for n in K.__all__ if not n.endswith("_reference")]
    ops = [n for n in ops if n not in ("NF4Weight", "HAVE_TRITON", "LAUNCHES", "compile_for_gpu", "triton_usable")]
    assert "document_bounds" in ops  # (a helper of plain torch ops: no launch)
    ops.remove("document_bounds")
    unguarded = [n for n in ops if not getattr(getattr(K, n), "on_tensor_device", False)]
    assert len(ops) > 10 and not unguarded, unguarded


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_an_op_on_the_second_gpu_runs_there():
    x = torch.randn(64, 256, device="cuda:1")
    w = torch.randn(256, device="cuda:1")
    with torch.cuda.device(0):
        y = K.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(y, K.rms_norm_reference(x, w, 1e-5), rtol=1e-5, atol=1e-5)


# From a second review (2026-12-07): the GEMM, the MoE permutation and the fused loss took inputs that read or
# wrote past their tensors, or returned plausible wrong numbers.
@pytest.mark.parametrize("case", ["K", "out rows", "out aliases x", "x 3-D", "dtypes"])
def test_matmul_into_refuses_what_does_not_fit(case):
    """Another K was read with x's width (a plausible wrong product); a smaller `out` was written past its end
    (the heap corrupted); `out` over x gave a wrong product (~116 off); a 3-D x an unpacking error."""
    x, w, out = _r(40, 8), _r(6, 8, seed=1), torch.zeros(40, 6, device=DEVICE)
    if case == "K":
        w = _r(6, 5, seed=1)
    elif case == "out rows":
        out = torch.zeros(100, 6, device=DEVICE)[:2]
    elif case == "out aliases x":
        x, w = _r(40, 40), _r(40, 40, seed=1)
        out = x
    elif case == "x 3-D":
        x = _r(2, 20, 8)
    else:
        w = w.double()
    with pytest.raises(ValueError, match="matmul_into: "):
        K.matmul_into(out, x, w)
    if case == "K":
        with pytest.raises(ValueError, match=r"linear: x \(40, 8\) and w \(6, 5\) must be"):
            K.linear(x, w)


def test_moe_permute_refuses_indices_of_other_tokens():
    """Indices for more tokens than x's rows gathered rows past x (values like -1e33); for fewer, the backward
    walked its row map past the end (a segmentation fault)."""
    for x, indices in (
        (_r(4, 8), torch.zeros(6, 2, dtype=torch.long)),
        (_r(600, 8), torch.zeros(4, 2, dtype=torch.long)),
    ):
        with pytest.raises(ValueError, match=r"moe_permute: indices .* must be \[tokens, k\] for x's"):
            K.moe_permute(x.requires_grad_(), indices.to(DEVICE))
    with pytest.raises(ValueError, match=r"moe_permute: indices .* must be \[tokens, k\]"):
        K.moe_permute(_r(4, 8), torch.zeros(4, dtype=torch.long, device=DEVICE))


def test_grouped_gemm_refuses_negative_counts():
    """[-2, 9] summed to x's 7 rows: a tile started two rows before x, expert 0's gradient was zero."""
    with pytest.raises(ValueError, match=r"grouped_gemm: counts must be >= 0"):
        K.grouped_gemm(_r(7, 16), _r(2, 8, 16, seed=1), torch.tensor([-2, 9], device=DEVICE))


def test_moe_unpermute_refuses_a_row_named_twice():
    """The combine's backward stores each token's gradient to its row: the last one written won (0.125 where the
    sum is 0.625). moe_permute's maps name each row once."""
    out, row_map = _r(3, 4).requires_grad_(), torch.tensor([[0, 1], [0, 2]], device=DEVICE)
    with pytest.raises(ValueError, match="moe_unpermute: row_map names a row twice"):
        K.moe_unpermute(out, row_map, torch.tensor([[0.5, 0.5], [0.125, 0.875]], device=DEVICE))


@pytest.mark.parametrize("case", ["chunk", "smoothing above", "smoothing below", "vocab past the rows"])
def test_fused_cross_entropy_refuses_arguments_out_of_range(case):
    """chunk_size -1 ran no chunk (loss -inf from an unwritten buffer, no gradient); label smoothing outside
    [0, 1] (F.cross_entropy refuses it) gave a number; a vocabulary past the weight's rows let a label without
    a column through (its loss the log-sum-exp alone)."""
    hidden, weight, labels = _r(6, 16).requires_grad_(), _r(5, 16, seed=1), torch.tensor([0, 1, 2, 3, 4, 0])
    kw = {
        "chunk": dict(chunk_size=-1),
        "smoothing above": dict(label_smoothing=1.5),
        "smoothing below": dict(label_smoothing=-0.1),
        "vocab past the rows": dict(vocab_size=9),
    }[case]
    with pytest.raises(ValueError, match="fused_linear_cross_entropy: "):
        K.fused_linear_cross_entropy(hidden, weight, labels.to(DEVICE), **kw)


@pytest.mark.parametrize("case", ["flash 3-D", "flash int", "norm 0-D", "unpermute float map"])
def test_more_inputs_of_the_wrong_form_are_one_line(case):
    with pytest.raises(ValueError, match=r"must be"):
        if case == "flash 3-D":
            K.flash_attention(_r(8, 2, 16), _r(8, 2, 16), _r(8, 2, 16))
        elif case == "flash int":
            q = torch.ones(1, 8, 2, 16, dtype=torch.long, device=DEVICE)
            K.flash_attention(q, q, q)
        elif case == "norm 0-D":
            K.rms_norm(torch.tensor(1.0, device=DEVICE), _r(1), 1e-5)
        else:
            K.moe_unpermute(_r(4, 8), torch.zeros(2, 2, device=DEVICE), torch.ones(2, 2, device=DEVICE))


@pytest.mark.skipif(not interpreting(), reason="the interpreter's bf16 dots")
@pytest.mark.parametrize("op", ["linear", "grouped_gemm", "flash", "cross_entropy"])
def test_bf16_dots_are_refused_under_the_interpreter(op):
    """The interpreter's tl.dot on bf16 returns garbage (flash attention ~1e9 off, no error): the kernels that
    multiply refuse bf16 there (the element-wise ones compute it right); --kernel-impl triton --bf16 was refused
    already."""
    b = torch.bfloat16
    with pytest.raises(ValueError, match="the Triton interpreter .* bf16"):
        if op == "linear":
            K.linear(_r(4, 8, dtype=b), _r(6, 8, dtype=b))
        elif op == "grouped_gemm":
            K.grouped_gemm(_r(4, 8, dtype=b), _r(2, 6, 8, dtype=b), torch.tensor([2, 2], device=DEVICE))
        elif op == "flash":
            K.flash_attention(*(_r(1, 8, 2, 16, seed=s, dtype=b) for s in range(3)))
        else:
            K.fused_linear_cross_entropy(_r(4, 8, dtype=b), _r(6, 8, dtype=b), torch.zeros(4, dtype=torch.long))
