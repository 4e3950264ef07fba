"""Norms, SwiGLU and RoPE kernels, forward and backward, against their PyTorch references and against the
transformers modules, on odd shapes (not powers of two, a single row, more rows than one block); each test
proves a Triton kernel ran. On a CPU the kernels run under TRITON_INTERPRET=1 (see conftest.py).

Tolerances (fp32, per tensor ||a-b||/||b||) follow Liger-Kernel's: 1e-5. bf16 needs a GPU: the interpreter
has no bf16 arithmetic."""

from __future__ import annotations

import pytest
import torch
import transformers

from megatron_lite import kernels as K

from models import DEVICE, needs_triton_on_cpu, rel

SHAPES = [(1, 7), (5, 33), (3, 4, 100), (130, 48)]
TOL = 1e-5
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="bf16 needs a GPU: the Triton interpreter has no bf16 arithmetic"
)


def _rand(*shape, seed=0, dtype=torch.float32, device=DEVICE):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def _grads(fn, *inputs, seed=9):
    ins = [t.clone().requires_grad_(True) for t in inputs]
    out = fn(*ins)
    outs = out if isinstance(out, tuple) else (out,)
    gs = [_rand(*o.shape, seed=seed + i, dtype=o.dtype, device=o.device) for i, o in enumerate(outs)]
    torch.autograd.backward(outs, gs)
    return [o.detach() for o in outs], [t.grad for t in ins]


def _check(name, fn, ref, inputs, tol=TOL):
    before = K.LAUNCHES[f"{name}_fwd"], K.LAUNCHES[f"{name}_bwd"]
    outs, grads = _grads(fn, *inputs)
    r_outs, r_grads = _grads(ref, *inputs)
    assert K.LAUNCHES[f"{name}_fwd"] > before[0] and K.LAUNCHES[f"{name}_bwd"] > before[1], "no kernel ran"
    for a, b in zip(outs + grads, r_outs + r_grads):
        assert rel(a.float(), b.float()) < tol, (name, rel(a.float(), b.float()))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(shape, residual):
    x, w = _rand(*shape), _rand(shape[-1], seed=1) + 1
    r = _rand(*shape, seed=2)
    if residual:
        _check(
            "rms_norm",
            lambda a, b, c: K.rms_norm(a, b, 1e-6, residual=c),
            lambda a, b, c: K.rms_norm_reference(a, b, 1e-6, residual=c),
            [x, w, r],
        )
    else:
        _check("rms_norm", lambda a, b: K.rms_norm(a, b, 1e-6), lambda a, b: K.rms_norm_reference(a, b, 1e-6), [x, w])


def test_rms_norm_equals_transformers():
    x = _rand(4, 9, 64)
    hf = transformers.models.llama.modeling_llama.LlamaRMSNorm(64, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        hf.weight.copy_(_rand(64, seed=3))
    assert rel(K.rms_norm(x, hf.weight.detach(), 1e-5), hf(x).detach()) < TOL


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("residual", [False, True])
def test_layer_norm(shape, residual):
    x, w, b = _rand(*shape), _rand(shape[-1], seed=1) + 1, _rand(shape[-1], seed=5)
    r = _rand(*shape, seed=2)
    if residual:
        _check(
            "layer_norm",
            lambda a, w_, b_, c: K.layer_norm(a, w_, b_, 1e-5, residual=c),
            lambda a, w_, b_, c: K.layer_norm_reference(a, w_, b_, 1e-5, residual=c),
            [x, w, b, r],
        )
    else:
        _check(
            "layer_norm",
            lambda a, w_, b_: K.layer_norm(a, w_, b_, 1e-5),
            lambda a, w_, b_: K.layer_norm_reference(a, w_, b_, 1e-5),
            [x, w, b],
        )


@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("wide", [False, True])
def test_norms_on_no_rows(norm, wide, monkeypatch):
    """An empty input (no tokens) gives an empty output and zero weight gradients, as the reference does (the
    backward divided the rows among zero programs before; the wide-row kernel, which writes its partial sums
    inside its row loop, left them as allocated)."""
    from megatron_lite.kernels import norms

    if wide:
        monkeypatch.setattr(norms, "BWD_WIDE_FROM", 16)
        monkeypatch.setattr(norms, "BWD_WIDE_FROM_RMS", 16)
    for _ in range(4):  # memory the partial sums may be given next, left holding NaN
        del_me = torch.full((1, 24), float("nan"), device=DEVICE)
        del del_me
    x, w, b = _rand(0, 24), _rand(24, seed=1) + 1, _rand(24, seed=5)
    if norm == "rms_norm":
        _check(norm, lambda a, w_: K.rms_norm(a, w_, 1e-6), lambda a, w_: K.rms_norm_reference(a, w_, 1e-6), [x, w])
    else:
        fn, ref = K.layer_norm, K.layer_norm_reference
        _check(norm, lambda a, w_, b_: fn(a, w_, b_, 1e-5), lambda a, w_, b_: ref(a, w_, b_, 1e-5), [x, w, b])


@pytest.mark.parametrize("view", ["strided", "broadcast"])
@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
def test_norm_weights_of_any_layout(norm, view):
    """A weight (and bias) that is a strided or broadcast view: the kernels read them by column index, and had
    read a stride-2 view's gaps (and past a stride-0 view's one value)."""

    def lay(t):
        if view == "strided":
            return torch.stack([t, torch.zeros_like(t)], 1)[:, 0]  # the same values, stride 2
        return t[:1].expand(t.shape[0])  # stride 0

    x, w, b = _rand(5, 33), _rand(33, seed=1) + 1, _rand(33, seed=5)
    if norm == "rms_norm":
        fn, ref = K.rms_norm, K.rms_norm_reference
        _check(norm, lambda a, w_: fn(a, lay(w_), 1e-6), lambda a, w_: ref(a, lay(w_), 1e-6), [x, w])
    else:
        fn, ref = K.layer_norm, K.layer_norm_reference
        _check(
            norm,
            lambda a, w_, b_: fn(a, lay(w_), lay(b_), 1e-5),
            lambda a, w_, b_: ref(a, lay(w_), lay(b_), 1e-5),
            [x, w, b],
        )


def test_layer_norm_without_bias():
    """layer_norm(x, w, None): no bias, as F.layer_norm (the kernel had added the weight as the bias, and the
    reference raised)."""
    x, w = _rand(7, 40), _rand(40, seed=1) + 1
    fn, ref = K.layer_norm, K.layer_norm_reference
    _check("layer_norm", lambda a, w_: fn(a, w_, None, 1e-5), lambda a, w_: ref(a, w_, None, 1e-5), [x, w])
    assert rel(K.layer_norm(x, w, None, 1e-5), torch.nn.functional.layer_norm(x, (40,), w, None, 1e-5)) < TOL


def test_rms_norm_output_takes_the_wider_dtype_of_input_and_weight():
    """fp16 rows with an fp32 weight give fp32, as the reference and LlamaRMSNorm do (weight * x_hat.to(fp16));
    the kernel had returned fp16."""
    x, w = _rand(6, 48, dtype=torch.float16), _rand(48, seed=1) + 1
    hf = transformers.models.llama.modeling_llama.LlamaRMSNorm(48, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        hf.weight.copy_(w)
    before = K.LAUNCHES["rms_norm_fwd"]
    y = K.rms_norm(x, w, 1e-6)
    assert K.LAUNCHES["rms_norm_fwd"] > before
    expected = hf(x).detach()
    assert y.dtype == K.rms_norm_reference(x, w, 1e-6).dtype == expected.dtype == torch.float32
    assert rel(y, expected) < 1e-6  # (both round x_hat to fp16 before the weight)


@pytest.mark.parametrize("rows_per_step,stages", [(2, 1), (4, 1), (1, 3)])
@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
def test_norm_backward_several_rows_per_step(norm, rows_per_step, stages, monkeypatch):
    """The backward's other tilings (the benchmark times them): rows that no step size divides, programs whose
    share ends inside a step; and the pipelined row loop (the interpreter runs it as a plain loop: this checks
    the code path, the Hopper compile check the pipelining)."""
    from megatron_lite.kernels import norms

    monkeypatch.setattr(norms, "BWD_ROWS_PER_STEP", rows_per_step)
    monkeypatch.setattr(norms, "BWD_STAGES", stages)
    x, w, b = _rand(37, 48), _rand(48, seed=1) + 1, _rand(48, seed=5)
    if norm == "rms_norm":
        _check(norm, lambda a, w_: K.rms_norm(a, w_, 1e-6), lambda a, w_: K.rms_norm_reference(a, w_, 1e-6), [x, w])
    else:
        _check(
            norm,
            lambda a, w_, b_: K.layer_norm(a, w_, b_, 1e-5),
            lambda a, w_, b_: K.layer_norm_reference(a, w_, b_, 1e-5),
            [x, w, b],
        )


@pytest.mark.parametrize("rows_per_step,stages", [(1, 1), (2, 3), (4, 1)])
@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("residual", [False, True])
def test_wide_rows_take_the_two_pass_backward(norm, rows_per_step, stages, residual, monkeypatch):
    """Rows at least BWD_WIDE_FROM columns wide take _norm_bwd_wide (LayerNorm from 16384 columns, where its
    one-pass kernel spilled registers; RMSNorm from BWD_WIDE_FROM_RMS): here from 32, in chunks of 16 over 40
    columns (the last chunk partial), 37 rows over programs whose share ends inside a step; the partial weight
    (and bias) gradients accumulated step after step in each program's own rows; with the fused residual's
    gradient too."""
    from megatron_lite.kernels import norms

    monkeypatch.setattr(norms, "BWD_WIDE_FROM", 32)
    monkeypatch.setattr(norms, "BWD_WIDE_FROM_RMS", 32)
    monkeypatch.setattr(norms, "BWD_WIDE_CHUNK", 16)
    monkeypatch.setattr(norms, "BWD_ROWS_PER_STEP", rows_per_step)
    monkeypatch.setattr(norms, "BWD_STAGES", stages)
    x, w, b, r = _rand(37, 40), _rand(40, seed=1) + 1, _rand(40, seed=5), _rand(37, 40, seed=2)
    before = K.LAUNCHES["norm_bwd_wide"]
    if norm == "rms_norm":
        fn, ref = (lambda a, w_, *r_, f=f: f(a, w_, 1e-6, *r_) for f in (K.rms_norm, K.rms_norm_reference))
        _check(norm, fn, ref, [x, w, r] if residual else [x, w])
    else:
        fn, ref = (lambda a, w_, b_, *r_, f=f: f(a, w_, b_, 1e-5, *r_) for f in (K.layer_norm, K.layer_norm_reference))
        _check(norm, fn, ref, [x, w, b, r] if residual else [x, w, b])
    assert K.LAUNCHES["norm_bwd_wide"] > before


def test_layer_norm_takes_the_wide_backward_from_12288_columns_and_rms_norm_does_not():
    """The launcher's rule, as measured on an H200 (kernels/norms.py): LayerNorm rows of 12288 columns (GPT-3's
    width, a 16384-column block) take the two-pass kernel; RMSNorm rows keep the one-pass kernel."""
    x, w, b = _rand(2, 12288), _rand(12288, seed=1) + 1, _rand(12288, seed=5)
    before = K.LAUNCHES["norm_bwd_wide"]
    _check(
        "layer_norm",
        lambda a, w_, b_: K.layer_norm(a, w_, b_, 1e-5),
        lambda a, w_, b_: K.layer_norm_reference(a, w_, b_, 1e-5),
        [x, w, b],
    )
    assert K.LAUNCHES["norm_bwd_wide"] == before + 1
    _check("rms_norm", lambda a, w_: K.rms_norm(a, w_, 1e-6), lambda a, w_: K.rms_norm_reference(a, w_, 1e-6), [x, w])
    assert K.LAUNCHES["norm_bwd_wide"] == before + 1


@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
def test_norm_partial_gradients_summed_in_one_launch(norm, monkeypatch):
    """The backward programs' partial weight (and bias) gradients are summed and cast by one kernel launch: here
    5 partial rows, taken 2 at a time, and 40 columns in blocks of 16 (neither divides)."""
    from megatron_lite.kernels import norms

    monkeypatch.setattr(norms, "_tiling", lambda rows, block, device, row_bytes: (5, 8, 1))
    monkeypatch.setattr(norms, "SUM_BLOCK_G", 2)
    monkeypatch.setattr(norms, "SUM_BLOCK_N", 16)
    x, w, b = _rand(37, 40), _rand(40, seed=1) + 1, _rand(40, seed=5)
    before = K.LAUNCHES["norm_partials_sum"]
    if norm == "rms_norm":
        _check(norm, lambda a, w_: K.rms_norm(a, w_, 1e-6), lambda a, w_: K.rms_norm_reference(a, w_, 1e-6), [x, w])
    else:
        fn, ref = K.layer_norm, K.layer_norm_reference
        _check(norm, lambda a, w_, b_: fn(a, w_, b_, 1e-5), lambda a, w_, b_: ref(a, w_, b_, 1e-5), [x, w, b])
    assert K.LAUNCHES["norm_partials_sum"] == before + 1


@pytest.mark.parametrize("shape", [(1, 5), (7, 130), (2, 3, 1500)])
def test_swiglu(shape):
    _check("swiglu", K.swiglu, K.swiglu_reference, [_rand(*shape), _rand(*shape, seed=1)])


@pytest.mark.parametrize("shape", [(1, 5), (7, 130), (2, 3, 1500)])
def test_swiglu_stacked(shape):
    """fc1's output [..., 2f] = [gate; up], the MLP's layout: its gradient comes back whole."""
    _check("swiglu", K.swiglu_stacked, K.swiglu_stacked_reference, [_rand(*shape[:-1], 2 * shape[-1])])


@pytest.mark.parametrize("layout", ["halves", "broadcast_up", "two_strides", "transposed"])
def test_swiglu_on_strided_inputs(layout):
    """Views are read through their row stride (the halves of fc1's output, a broadcast row, gate and up
    with different row strides); a layout with no unit column stride is copied first. Same values and
    gradients as the reference either way."""
    if layout == "halves":
        inputs, make = [_rand(2, 3, 2 * 70)], lambda t: t.chunk(2, dim=-1)
    elif layout == "broadcast_up":
        inputs, make = [_rand(2, 3, 70), _rand(70, seed=1)], lambda g, u: (g, u.expand_as(g))
    elif layout == "two_strides":
        inputs, make = [_rand(2, 3, 100), _rand(2, 3, 70, seed=1)], lambda g, u: (g[..., 10:80], u)
    else:
        inputs, make = [_rand(2, 3, 70, 2)], lambda t: (t[..., 0].transpose(0, 1), t[..., 1].transpose(0, 1))
    _check("swiglu", lambda *t: K.swiglu(*make(*t)), lambda *t: K.swiglu_reference(*make(*t)), inputs)


def test_swiglu_takes_a_broadcast_gradient():
    """A loss like (y.sum(0) * w).sum() hands the backward a gradient expanded over rows (row stride 0)."""
    h, w = _rand(5, 2 * 40), _rand(40, seed=1)
    seen = []
    grads = []
    for fn in (K.swiglu_stacked, K.swiglu_stacked_reference):
        x = h.clone().requires_grad_(True)
        y = fn(x)
        y.register_hook(lambda g: seen.append(g.stride()))
        (y.sum(0) * w).sum().backward()
        grads.append(x.grad)
    assert seen[0] == (0, 1), seen  # the case this test is about
    assert rel(*grads) < TOL


@pytest.mark.parametrize("shape", [(3, 0), (0, 8), ()])
def test_swiglu_on_empty_and_scalar_inputs(shape):
    g, u = torch.randn(shape), torch.randn(shape)
    assert torch.equal(K.swiglu(g, u), K.swiglu_reference(g, u))
    if shape and shape[-1] % 2 == 0:
        assert torch.equal(K.swiglu_stacked(g), K.swiglu_stacked_reference(g))


def test_swiglu_saves_fc1_output_in_place():
    """The kernels keep only fc1's output for the backward: no contiguous copies of gate and up (an extra
    2 x tokens x f written and held per layer)."""
    h = _rand(4, 2 * 96).requires_grad_(True)
    for fn in (K.swiglu_stacked, lambda t: K.swiglu(*t.chunk(2, dim=-1))):
        saved = []

        def pack(t, saved=saved):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(h * 1.0)
        assert saved, "nothing saved"
        storages = {t.untyped_storage().data_ptr() for t in saved}
        assert len(storages) == 1 and sum(t.untyped_storage().nbytes() for t in saved[:1]) == h.numel() * 4


def test_swiglu_equals_llama_mlp_activation():
    g, u = _rand(6, 40), _rand(6, 40, seed=1)
    act = transformers.activations.ACT2FN["silu"]
    assert rel(K.swiglu(g, u), act(g) * u) < TOL


@pytest.mark.parametrize("b,s,h,d", [(1, 1, 1, 8), (2, 7, 3, 20), (3, 5, 4, 64)])
@pytest.mark.parametrize("per_batch", [False, True])
def test_rope(b, s, h, d, per_batch):
    x = _rand(b, s, h, d)
    ang = _rand(b if per_batch else 1, s, d // 2, seed=4).repeat(1, 1, 2)
    cos, sin = ang.cos(), ang.sin()
    if not per_batch:
        cos, sin = cos[0], sin[0]
    _check("rope", lambda t: K.apply_rope(t, cos, sin), lambda t: K.apply_rope_reference(t, cos, sin), [x])


def test_rope_equals_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = _rand(2, 3, 5, 16), _rand(2, 2, 5, 16, seed=1)  # transformers: [batch, heads, seq, dim]
    ang = _rand(2, 5, 8, seed=2).repeat(1, 1, 2)
    hq, hk = apply_rotary_pos_emb(q, k, ang.cos(), ang.sin())
    ours_q = K.apply_rope(q.transpose(1, 2), ang.cos(), ang.sin()).transpose(1, 2)
    ours_k = K.apply_rope(k.transpose(1, 2), ang.cos(), ang.sin()).transpose(1, 2)
    assert rel(ours_q, hq) < TOL and rel(ours_k, hk) < TOL


@pytest.mark.parametrize("loss", ["sum", "permuted"])
def test_rope_backward_takes_a_gradient_not_unit_stride_in_its_last_dimension(loss):
    """y.sum() hands the backward an expanded gradient (every stride 0) and a product with a permuted view one
    of last stride h; the kernel read the last dimension at stride 1 (relative error 0.94 or inf, and 1.2)."""
    x = _rand(2, 5, 3, 8)
    ang = _rand(5, 4, seed=4).repeat(1, 2)
    w = _rand(2, 5, 8, 3, seed=5).permute(0, 1, 3, 2)  # (a view of last stride 3)
    grads, seen = [], []
    before = K.LAUNCHES["rope_bwd"]
    for fn in (K.apply_rope, K.apply_rope_reference):
        t = x.clone().requires_grad_(True)
        y = fn(t, ang.cos(), ang.sin())
        y.register_hook(lambda g: seen.append(g.stride(-1)))
        (y.sum() if loss == "sum" else (y * w).sum()).backward()
        grads.append(t.grad)
    assert K.LAUNCHES["rope_bwd"] > before, "no kernel ran"
    assert seen[0] != 1, seen  # the case this test is about
    assert rel(*grads) < TOL, rel(*grads)


@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
def test_a_residual_norm_normalises_the_sum_it_returns(norm):
    """fp16: y is the norm of the returned (rounded) s = x + r, as the reference, transformers and Megatron
    compute it; the kernel had normalised the unrounded fp32 sum (3.9e-4 from the reference)."""
    x, r, w, b = _rand(64, 96, dtype=torch.float16), _rand(64, 96, seed=1, dtype=torch.float16), _rand(96, seed=2), None
    args = (w, 1e-5) if norm == "rms_norm" else (w, b, 1e-5)
    refs = {"rms_norm": K.rms_norm_reference, "layer_norm": K.layer_norm_reference}
    before = K.LAUNCHES[f"{norm}_fwd"]
    y, s = getattr(K, norm)(x, *args, residual=r)
    assert K.LAUNCHES[f"{norm}_fwd"] > before
    ry, rs = refs[norm](x, *args, residual=r)
    assert torch.equal(s, rs)
    alone = getattr(K, norm)(s, *args)  # the kernel on the sum returned: the same arithmetic, so the same bits
    assert rel(y.float(), alone.float()) < 1e-6, rel(y.float(), alone.float())
    assert rel(y.float(), ry.float()) < 1e-3  # (fp16: the reference rounds once less before the weight)


@pytest.mark.parametrize("residual", [False, True])
def test_layer_norm_in_half_precision_rounds_once_as_the_reference(residual):
    """fp16 LayerNorm: (x - mean) * rstd * w + b in fp32, rounded once, as F.layer_norm; the kernel had rounded
    x_hat to fp16 before the weight (as RMSNorm does, after LlamaRMSNorm), which moved 23% of the outputs by up to
    2 ulp. (fp16, not bf16: the interpreter rounds fp16 to nearest but truncates bf16.)"""
    x = _rand(64, 80, dtype=torch.float16) * 3
    w, b = _rand(80, seed=1, dtype=torch.float16), _rand(80, seed=2, dtype=torch.float16)
    r = _rand(64, 80, seed=3, dtype=torch.float16) if residual else None
    before = K.LAUNCHES["layer_norm_fwd"]
    y = K.layer_norm(x, w, b, 1e-5, residual=r)
    ref = K.layer_norm_reference(x, w, b, 1e-5, residual=r)
    assert K.LAUNCHES["layer_norm_fwd"] > before, "no kernel ran"
    if residual:
        (y, _), (ref, _) = y, ref
    differ = (y != ref).float().mean().item()
    assert differ < 0.01, differ  # (a reduction's order may move an element by an ulp, rarely)


def test_inputs_of_two_dtypes_give_torchs_promoted_result():
    """swiglu(fp16, fp32) and a norm of fp16 x with an fp32 residual: the reference's (torch's) promoted dtype,
    where the kernels had rounded to the first input's dtype."""
    g, u = _rand(4, 40, dtype=torch.float16), _rand(4, 40, seed=1)
    assert K.swiglu(g, u).dtype == K.swiglu_reference(g, u).dtype == torch.float32
    assert rel(K.swiglu(g, u), K.swiglu_reference(g, u)) < TOL
    x, r, w = _rand(4, 40, dtype=torch.float16), _rand(4, 40, seed=1), _rand(40, seed=2)
    y, s = K.rms_norm(x, w, 1e-5, residual=r)
    ry, rs = K.rms_norm_reference(x, w, 1e-5, residual=r)
    assert s.dtype == rs.dtype == torch.float32 and torch.equal(s, rs) and rel(y, ry) < TOL


@needs_gpu
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "swiglu", "rope"])
def test_bf16_on_gpu(op):
    dev, bf = "cuda", torch.bfloat16
    x = _rand(64, 4096, dtype=bf, device=dev)
    w = _rand(4096, seed=1, dtype=bf, device=dev) + 1
    if op == "rms_norm":
        a, b = K.rms_norm(x, w, 1e-5), K.rms_norm_reference(x, w, 1e-5)
    elif op == "layer_norm":
        a, b = K.layer_norm(x, w, w * 0, 1e-5), K.layer_norm_reference(x, w, w * 0, 1e-5)
    elif op == "swiglu":
        a, b = K.swiglu(x, w.expand_as(x)), K.swiglu_reference(x, w.expand_as(x))
    else:
        t = _rand(2, 128, 8, 128, dtype=bf, device=dev)
        ang = _rand(128, 64, seed=2, device=dev).repeat(1, 2)
        a, b = K.apply_rope(t, ang.cos(), ang.sin()), K.apply_rope_reference(t, ang.cos(), ang.sin())
    assert rel(a.float(), b.float()) < 2e-2


@needs_triton_on_cpu  # (on a GPU each program takes one row)
@pytest.mark.parametrize(
    "op,shape,rows_per_program",
    [
        ("rms_norm", (37, 48), 4),  # 10 programs of 4 rows, the last holding 1
        ("rms_norm_residual", (3, 5, 100), 2),
        ("layer_norm", (37, 48), 4),
        ("layer_norm_residual", (13, 30), 8),
        ("rope", (2, 7, 3, 20), 4),  # positions per program: 14 positions of 3 (of 4) heads x 10 (of 16) dims
        ("rope_per_batch", (3, 5, 4, 16), 8),  # 15 positions: 8 and 7
        ("swiglu", (7, 130), 1),  # a 256-column block: one row at a time
        ("swiglu_stacked", (2, 9, 20), 16),  # 18 rows: 16 and 2
    ],
)
def test_row_kernels_take_several_rows_per_program_under_the_interpreter(op, shape, rows_per_program, monkeypatch):
    """Under the interpreter the norms, RoPE and SwiGLU take as many whole rows per program as fit in
    INTERPRETER_BLOCK elements (the model-level tests run that way); here at 256 elements, with row counts no
    program size divides, against the references."""
    from megatron_lite.kernels import _common

    monkeypatch.setattr(_common, "INTERPRETER_BLOCK", 256)
    x = _rand(*shape)
    w, b = _rand(shape[-1], seed=1) + 1, _rand(shape[-1], seed=5)
    if op.startswith("rope"):
        b_, s_, h_, d_ = shape
        block = _common.next_pow2(d_ // 2) * _common.next_pow2(h_)
        assert _common.rows_per_program(block, b_ * s_) == rows_per_program
        ang = _rand(b_ if op == "rope_per_batch" else 1, s_, d_ // 2, seed=4).repeat(1, 1, 2)
        cos, sin = (ang.cos(), ang.sin()) if op == "rope_per_batch" else (ang.cos()[0], ang.sin()[0])
        _check("rope", lambda t: K.apply_rope(t, cos, sin), lambda t: K.apply_rope_reference(t, cos, sin), [x])
        return
    rows = x.numel() // shape[-1]
    if op.startswith("swiglu"):
        cols = shape[-1] // 2 if op == "swiglu_stacked" else shape[-1]
        assert _common.rows_per_program(max(16, _common.next_pow2(cols)), rows) == rows_per_program
        if op == "swiglu":
            _check("swiglu", K.swiglu, K.swiglu_reference, [x, _rand(*shape, seed=1)])
        else:
            _check("swiglu", K.swiglu_stacked, K.swiglu_stacked_reference, [x])
        return
    assert _common.rows_per_program(_common.next_pow2(shape[-1]), rows) == rows_per_program
    r = _rand(*shape, seed=2)
    if op == "rms_norm":
        _check(op, lambda a, w_: K.rms_norm(a, w_, 1e-6), lambda a, w_: K.rms_norm_reference(a, w_, 1e-6), [x, w])
    elif op == "rms_norm_residual":
        fn, ref = K.rms_norm, K.rms_norm_reference
        _check(
            "rms_norm",
            lambda a, w_, c: fn(a, w_, 1e-6, residual=c),
            lambda a, w_, c: ref(a, w_, 1e-6, residual=c),
            [x, w, r],
        )
    elif op == "layer_norm":
        fn, ref = K.layer_norm, K.layer_norm_reference
        _check(op, lambda a, w_, b_: fn(a, w_, b_, 1e-5), lambda a, w_, b_: ref(a, w_, b_, 1e-5), [x, w, b])
    else:
        fn, ref = K.layer_norm, K.layer_norm_reference
        _check(
            "layer_norm",
            lambda a, w_, b_, c: fn(a, w_, b_, 1e-5, residual=c),
            lambda a, w_, b_, c: ref(a, w_, b_, 1e-5, residual=c),
            [x, w, b, r],
        )
