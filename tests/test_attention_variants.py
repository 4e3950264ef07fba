"""Megatron's --window-attn-skip-freq (windows on some layers only) and --softmax-type (a softmax with an extra
logit per head: off-by-one's fixed 0, gpt-oss's learned attention sinks), against Megatron-Core's rules and
Hugging Face's gpt-oss attention."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.config import ConfigError

MODEL = "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --train-iters 2".split()
MODEL += ["--mock-data", "--vocab-size", "100", "--position-embedding-type", "rope", "--disable-bias-linear"]
MODEL += ["--group-query-attention", "--num-query-groups", "2", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _model(flags: list[str], seed: int = 5):
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    _, job = parse_args([*MODEL, *flags])
    return build_model(job.model, ParallelContext.virtual(job.parallel, 1), seed=seed)[0]


@pytest.mark.parametrize(
    "freq, windows",
    [
        ("2", [5, None, 5, None]),  # (1-based layer numbers 2 and 4 attend fully: Megatron's layer % N == 0)
        ("3", [5, 5, None, 5]),
        ("1", [None] * 4),
        ("[1,0,0,1]", [5, None, None, 5]),
        ("([1]*2+[0]*2)", [5, 5, None, None]),
    ],
)
def test_window_attn_skip_freq_windows_the_layers_megatron_windows(freq, windows):
    """Megatron-Core's is_layer_window_attention: an integer N leaves layer numbers N, 2N, ... (1-based) with
    full attention; a pattern's 1s window. The built layers attend as the rule says."""
    _, job = parse_args([*MODEL, "--window-size", "4,0", "--window-attn-skip-freq", freq])
    assert [job.model.layer_window(i) for i in range(4)] == windows
    model = _model(["--window-size", "4,0", "--window-attn-skip-freq", freq])
    assert [layer.self_attention.core_attention.window for layer in model.decoder.layers] == windows


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_layers_without_a_window_compute_full_attention(kernels):
    """A model whose pattern spares every layer equals the model without a window, one that windows every layer
    equals --window-size alone, and the mixed pattern differs from both (the sequence of 16 is longer than the
    window of 5, so the window changes the result)."""
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    k = ["--kernel-impl", kernels]
    with torch.no_grad():
        full = _model(k)(tokens)
        windowed = _model([*k, "--window-size", "4,0"])(tokens)
        spared = _model([*k, "--window-size", "4,0", "--window-attn-skip-freq", "[0,0,0,0]"])(tokens)
        everywhere = _model([*k, "--window-size", "4,0", "--window-attn-skip-freq", "[1,1,1,1]"])(tokens)
        mixed = _model([*k, "--window-size", "4,0", "--window-attn-skip-freq", "2"])(tokens)
    torch.testing.assert_close(spared, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(everywhere, windowed, rtol=1e-5, atol=1e-5)
    assert (mixed - full).abs().max() > 1e-3 and (mixed - windowed).abs().max() > 1e-3


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--window-attn-skip-freq", "0"], "--window-attn-skip-freq 0 must be >= 1"),
        (["--window-attn-skip-freq", "[1,0,2,1]"], "may hold only 0 .full. and 1 .window."),
        (["--window-attn-skip-freq", "[1,0]"], "pattern has 2 entries for --num-layers 4"),
        (["--window-attn-skip-freq", "[1,0,1,0]", "--mtp-num-layers", "1"], "pattern with --mtp-num-layers"),
    ],
)
def test_bad_skip_frequencies_are_refused_at_start_up(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args([*MODEL, "--window-size", "4,0", *flags])


def test_an_unreadable_skip_frequency_is_one_line(capsys):
    with pytest.raises(SystemExit):
        parse_args([*MODEL, "--window-size", "4,0", "--window-attn-skip-freq", "1,x"])
    err = capsys.readouterr().err.strip()
    assert "--window-attn-skip-freq '1,x' must be an integer" in err and "\n" not in err


def test_a_checkpoint_keeps_its_softmax_offsets_and_windows(tmp_path, capsys, monkeypatch):
    """--load brings back --softmax-type and --window-attn-skip-freq (the offsets are tensors of the checkpoint: a
    model without them would leave them unread); the same values given again are no conflict, other values are."""
    from test_pretrain_cli import _one_line_error, _run

    ckpt = str(tmp_path / "ckpt")
    flags = ["--mock-data", "--vocab-size", "100", "--window-size", "3,0", "--window-attn-skip-freq", "[1,0]"]
    rc, _, err = _run([*flags, "--softmax-type", "learnable", "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    again = ["--mock-data", "--vocab-size", "100", "--load", ckpt, "--train-iters", "4"]
    rc, out, err = _run([*again, "--window-attn-skip-freq", "1,0"], capsys, monkeypatch)
    assert rc == 0 and "loaded" in out, err
    rc, _, err = _run([*again, "--softmax-type", "vanilla"], capsys, monkeypatch)
    _one_line_error(rc, err, "--softmax-type vanilla conflicts with the checkpoint", "(learnable)")
    rc, _, err = _run([*again, "--window-attn-skip-freq", "2"], capsys, monkeypatch)
    _one_line_error(rc, err, "--window-attn-skip-freq 2 conflicts with the checkpoint")


def _hf_sink_attention(q, k, v, sinks, window):
    """Hugging Face's gpt-oss eager attention (GptOssAttention's eager_attention_forward), its additive mask
    built as transformers builds a causal (sliding-window) one: key j visible to query i when j <= i and
    i - j < window."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    b, s, h, d = q.shape
    module = SimpleNamespace(num_key_value_groups=h // k.shape[2], sinks=sinks, training=False)
    i, j = torch.arange(s).unsqueeze(1), torch.arange(s).unsqueeze(0)
    visible = (j <= i) & ((i - j < window) if window else True)
    mask = torch.zeros(s, s).masked_fill(~visible, float("-inf")).expand(b, 1, s, s)
    out, _ = eager_attention_forward(
        module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scaling=d**-0.5
    )
    return out  # [b, s, h, d]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("window", [None, 6])
def test_learnable_softmax_offset_is_hugging_faces_gpt_oss_sinks(kernels, window):
    """--softmax-type learnable: each head's offset is a logit beside its scores, as gpt-oss's sinks. The core
    attention's output and its gradients (q, k, v and the sinks) equal Hugging Face's eager gpt-oss attention,
    through our flash kernel (interpreted here) and through plain PyTorch."""
    flags = ["--softmax-type", "learnable", "--kernel-impl", kernels]
    flags += ["--window-size", f"{window - 1},0"] if window else []
    core = _model(flags).decoder.layers[0].self_attention.core_attention
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 13, n, 16, generator=g, requires_grad=True) for n in (4, 2, 2))
    with torch.no_grad():
        core.softmax_offset.copy_(torch.tensor([-1.0, 0.5, 2.0, 4.0]))  # (a large one takes most probability)
    sinks = core.softmax_offset.detach().clone().requires_grad_(True)
    ours = core(q, k, v).view(2, 13, 4, 16)
    ref = _hf_sink_attention(q, k, v, sinks, window)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    dout = torch.randn(ours.shape, generator=g)
    got = torch.autograd.grad(ours, (q, k, v, core.softmax_offset), dout)
    want = torch.autograd.grad(ref, (q, k, v, sinks), dout)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want):
        err = (a - b).norm() / b.norm()
        assert err < 1e-5, (name, err.item())


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_off_by_one_softmax_adds_one_to_the_denominator(kernels):
    """--softmax-type off-by-one (Evan Miller's softmax_1): exp(s_j) / (1 + sum_i exp(s_i)), worked out here from
    the scores directly; no parameter is added."""
    core = _model(["--softmax-type", "off-by-one", "--kernel-impl", kernels]).decoder.layers[0]
    core = core.self_attention.core_attention
    assert not list(core.parameters())
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 9, n, 16, generator=g) for n in (4, 2, 2))
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, kk) / math.sqrt(16)
    scores = scores.masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf"))
    p = scores.exp() / (1 + scores.exp().sum(-1, keepdim=True))
    want = torch.einsum("bhij,bjhd->bihd", p, vv)
    with torch.no_grad():
        torch.testing.assert_close(core(q, k, v).view(1, 9, 4, 16), want, rtol=1e-5, atol=1e-6)


def test_the_learnable_offset_is_a_tensor_parallel_parameter_without_weight_decay():
    """Megatron-Core's softmax_offset: one per head, split over TP ranks with the heads, drawn normal(0,
    init_method_std) (its init_method), and one-dimensional, so Megatron's rule gives it no weight decay."""
    from megatron_lite.optimizer.config import OptimizerConfig
    from megatron_lite.optimizer.optimizer import takes_weight_decay

    model = _model(["--softmax-type", "learnable", "--init-method-std", "0.5"])
    names = [n for n, _ in model.named_parameters() if n.endswith("softmax_offset")]
    assert names == [f"decoder.layers.{i}.self_attention.core_attention.softmax_offset" for i in range(4)]
    offsets = torch.cat([p.detach() for n, p in model.named_parameters() if n.endswith("softmax_offset")])
    assert 0.2 < offsets.std().item() < 1.0 and offsets.shape == (16,)
    assert not takes_weight_decay(names[0], 1, OptimizerConfig())


def test_softmax_offsets_are_refused_where_they_do_not_compose():
    from megatron_lite.models.hf import check_exportable

    for flags, what in (
        (["--softmax-type", "off-by-one"], r"attention sinks \(--softmax-type off-by-one\)"),
        (["--window-size", "4,0", "--window-attn-skip-freq", "2"], "full-attention layers between the windowed"),
    ):
        with pytest.raises(ConfigError, match=what):
            check_exportable(parse_args([*MODEL, *flags])[1].model, "MistralForCausalLM")


def _sinks_under_cp(comm: str, sizes=None, window=None, triton: bool = False):
    """This rank's output and q/k/v gradient errors against one device's attention with the sink column (fp64
    oracle, zigzag-split), and its share of the offsets' gradient with the whole one (the shares sum over CP)."""
    import functools

    import torch.distributed as dist

    from megatron_lite.config import ParallelConfig
    from megatron_lite.context_parallel.attention import IMPLEMENTATIONS
    from megatron_lite.context_parallel.zigzag import split_sequence

    from dist_pool import get_context

    cp = dist.get_world_size()
    ctx = get_context(ParallelConfig(context_parallel_size=cp, hierarchical_context_parallel_sizes=sizes))
    attend = IMPLEMENTATIONS[comm]
    if sizes is not None:
        attend = functools.partial(attend, inner=ctx.cp_inner, outer=ctx.cp_outer)
    g = torch.Generator().manual_seed(0)
    b, s, h, kvh, d = 2, 16, 4, 2, 8
    q, k, v, do = (torch.randn(b, s, n, d, generator=g, dtype=torch.float64) for n in (h, kvh, kvh, h))
    offset = torch.randn(h, generator=g, dtype=torch.float64) * 2
    full = [t.clone().requires_grad_() for t in (q, k, v, offset)]
    i = torch.arange(s)
    visible = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < window) if window else True)
    from megatron_lite.models.attention_variants import attention_with_offset

    attention_with_offset(*full[:3], full[3], None, visible).double().backward(do)
    mine = [split_sequence(t, 1, cp, ctx.cp.rank).float().requires_grad_() for t in (q, k, v)]
    off = offset.float().requires_grad_()
    extra = {"window_size": window} if window else {}
    o = attend(*mine, ctx.cp, True, triton=triton, offset=off, **extra)
    o.backward(split_sequence(do, 1, cp, ctx.cp.rank).float())
    want = [attention_with_offset(q, k, v, offset, None, visible)] + [t.grad for t in full[:3]]
    errs = []
    for a, ref in zip([o, *(m.grad for m in mine)], want):
        ref = split_sequence(ref.detach(), 1, cp, ctx.cp.rank)
        errs.append(float((a.detach().double() - ref).norm() / ref.norm()))
    return errs, off.grad.double(), full[3].grad


@pytest.mark.parametrize(
    "comm, world, sizes, window",
    [("p2p", 2, None, None), ("p2p", 4, None, None), ("a2a+p2p", 4, (2, 2), None), ("a2a", 4, None, 5),
     ("allgather", 2, None, 5)],
)  # fmt: skip
def test_sinks_under_context_parallelism_equal_one_device(dist, comm, world, sizes, window):
    """Every --cp-comm-type with learned sinks: the ring applies the offset once each row is merged (its gradient
    from the merged output and log-sum-exp), a2a gives each rank its heads' offsets; the offsets' gradient shares
    sum over CP to the one device's."""
    results = dist(world, _sinks_under_cp, comm, sizes, window)
    for errs, _, _ in results:
        assert max(errs) < 1e-5, (comm, errs)
    total, whole = sum(r[1] for r in results), results[0][2]
    assert float((total - whole).norm() / whole.norm()) < 1e-5, (comm, total, whole)
