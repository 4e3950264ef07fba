"""Inputs the kernels' functional entries refuse, in one line, where the Triton path read or wrote out of bounds
or returned a plausible wrong number (the references raise on most of them too); and RoPE tables that need a
gradient get one. Found by a review of the kernels against fp64 (2026-12-03)."""

from __future__ import annotations

import pytest
import torch

from megatron_lite import kernels as K

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
