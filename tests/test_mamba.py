"""Hybrid Mamba models (Nemotron-H; Megatron's MambaModel): the chunked SSD scan and the whole Mamba-2 mixer against
a sequential recurrence written out step by step, Megatron's layer allocation worked by hand, the start-up
refusals, and TP=2 / PP=2 training equal to one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.arguments import parse_args
from megatron_lite.config import ConfigError, ParallelConfig

BASE = (
    "--hidden-size 32 --num-attention-heads 4 --seq-length 16 --train-iters 2 --mock-data --vocab-size 100 "
    "--mamba-state-dim 8 --mamba-head-dim 8 --mamba-num-groups 2 --normalization RMSNorm "
    "--position-embedding-type none --hidden-dropout 0 --attention-dropout 0 --kernel-impl torch"
).split()


def _recurrence(x, dt, A, B, C):
    """The SSM one step at a time: S = exp(dt A) S + dt x B^T, y = S C (each head reads its group's B and C)."""
    b, s, h, p = x.shape
    rep = h // B.shape[2]
    S = torch.zeros(b, h, p, B.shape[-1], dtype=torch.float64)
    ys = []
    for t in range(s):
        Bt, Ct = B[:, t].repeat_interleave(rep, 1), C[:, t].repeat_interleave(rep, 1)  # [b, h, n]
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]
        S = decay * S + (dt[:, t, :, None, None] * x[:, t, :, :, None]) * Bt[:, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", S, Ct))
    return torch.stack(ys, 1)


@pytest.mark.parametrize("seq,chunk", [(13, 4), (16, 16), (9, 128), (24, 8)])
def test_chunked_ssd_scan_equals_the_sequential_recurrence(seq, chunk):
    from megatron_lite.models.mamba import ssd_scan

    g = torch.Generator().manual_seed(seq)
    b, h, p, groups, n = 2, 4, 3, 2, 5
    x = torch.randn(b, seq, h, p, generator=g, dtype=torch.float64)
    dt = F.softplus(torch.randn(b, seq, h, generator=g, dtype=torch.float64))
    A = -torch.rand(h, generator=g, dtype=torch.float64) * 4 - 0.5
    B, C = (torch.randn(b, seq, groups, n, generator=g, dtype=torch.float64) for _ in range(2))
    got = ssd_scan(x, dt, A, B, C, chunk_size=chunk)
    assert torch.allclose(got, _recurrence(x, dt, A, B, C), atol=1e-10, rtol=1e-10)


def test_mamba_mixer_equals_its_equations_written_token_by_token():
    """The mixer (in_proj's z x B C dt, the causal conv, softplus, the scan, D, the gated group norm, out_proj)
    against the same equations one token at a time, from the mixer's weights (chunk 4: several chunks)."""
    from megatron_lite.models.mamba import MambaMixer
    from megatron_lite.parallel_context import ParallelContext

    _, job = parse_args(["--num-layers", "1", "--hybrid-override-pattern", "M", *BASE])
    mixer = MambaMixer(job.model, ParallelContext.virtual(job.parallel, 1)).double()
    mixer.chunk_size = 4
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    s, b, hid = 11, 2, 32
    H, P, G, N, di = 8, 8, 2, 8, 64
    u = torch.randn(s, b, hid, generator=g, dtype=torch.float64)
    with torch.no_grad():
        got = mixer(u)
        W = mixer.in_proj.weight
        z, xbc, dtr = (u @ W.t()).split([di, di + 2 * G * N, H], dim=-1)
        w, cb = mixer.conv1d.weight[:, 0], mixer.conv1d.bias  # [channels, 4]
        conv = torch.stack([cb + sum(w[:, 3 - j] * xbc[t - j] for j in range(4) if t - j >= 0) for t in range(s)])
        conv = conv * torch.sigmoid(conv)
        x, B, C = conv.split([di, G * N, G * N], dim=-1)
        x, B, C = x.unflatten(-1, (H, P)), B.unflatten(-1, (G, N)), C.unflatten(-1, (G, N))
        dt = torch.log1p(torch.exp(dtr + mixer.dt_bias))
        A = -torch.exp(mixer.A_log)
        y = _recurrence(*(t.transpose(0, 1) for t in (x, dt)), A, B.transpose(0, 1), C.transpose(0, 1))
        y = y.transpose(0, 1) + x * mixer.D[:, None]
        gated = (y.flatten(-2) * z * torch.sigmoid(z)).unflatten(-1, (G, di // G))
        normed = gated / torch.sqrt(gated.pow(2).mean(-1, keepdim=True) + 1e-5)
        want = (normed.flatten(-2) * mixer.norm.weight) @ mixer.out_proj.weight.t()
    assert torch.allclose(got, want, atol=1e-10, rtol=1e-9), (got - want).abs().max()


@pytest.mark.parametrize(
    "layers,attention,mlp,pattern",
    [
        # Megatron's allocation, worked by hand: 2 attention layers in 10 split the 8 Mamba layers into sections of
        # 8/3; each layer spends 1 of the running 8/3 and one under 0.5 is attention (then 8/3 more)
        (10, 0.2, 0.0, "MMM*MM*MMM"),
        (10, 0.2, 0.2, "MMM*-M*MM-"),
        (8, 0.25, 0.5, "M-*-M*--"),
        (4, 0.0, 0.0, "MMMM"),
    ],
)
def test_megatron_layer_allocation(layers, attention, mlp, pattern):
    flags = ["--num-layers", str(layers), "--is-hybrid-model", *BASE]
    flags += ["--hybrid-attention-ratio", str(attention), "--hybrid-mlp-ratio", str(mlp)]
    assert "".join(parse_args(flags)[1].model.layer_types) == pattern


def test_hybrid_model_builds_each_layer_as_its_symbol_with_megatrons_names():
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    flags = ["--num-layers", "4", "--hybrid-override-pattern", "M*-E", "--num-experts", "2", *BASE]
    _, job = parse_args(flags)
    model = build_model(job.model, ParallelContext.virtual(job.parallel, 1), seed=1)
    names: dict[str, set[str]] = {}
    for n, _ in model.named_parameters():
        if ".layers." in n:
            names.setdefault(n.split(".")[3], set()).add(n.split(".")[4])
    mlp = {"pre_mlp_layernorm", "mlp"}
    assert names == {"0": {"norm", "mixer"}, "1": {"input_layernorm", "self_attention"}, "2": mlp, "3": mlp}
    kinds = [
        type(getattr(layer, a)).__name__
        for layer, a in zip(model[0].decoder.layers, "mixer,self_attention,mlp,mlp".split(","))
    ]
    assert kinds == ["MambaMixer", "SelfAttention", "MLP", "MoELayer"]
    A = -torch.exp(model[0].decoder.layers[0].mixer.A_log)  # (Megatron's init: -A uniform in [1, 16])
    assert ((A <= -1) & (A >= -16)).all()
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(tokens, labels=tokens).mean()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if "router" not in p.__class__.__name__)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--num-layers", "3", "--hybrid-override-pattern", "M*"], r"--hybrid-override-pattern 'M\*' has 2 layers but "
         "--num-layers is 3: give --num-layers 2"),
        (["--num-layers", "2", "--hybrid-override-pattern", "MX"], r"has 'X': use M \(Mamba\), \* \(attention\)"),
        (["--num-layers", "2", "--hybrid-override-pattern", "ME"], r"has MoE layers \(E\): give --num-experts"),
        (["--num-layers", "2", "--is-hybrid-model", "--mamba-num-heads", "5"], "--mamba-num-groups 2 does not divide "
         "the 5 Mamba heads"),
        (["--num-layers", "2", "--is-hybrid-model", "--mamba-head-dim", "7"], "--mamba-head-dim 7 does not divide"),
        (["--num-layers", "4", "--hybrid-attention-ratio", "0.5", "--hybrid-override-pattern", "MMM*"],
         "does not have the layer counts of --hybrid-attention-ratio 0.5"),
        (["--num-layers", "2", "--is-hybrid-model", "--tensor-model-parallel-size", "4"],
         "--mamba-num-groups 2 is not divisible by --tensor-model-parallel-size 4"),
        (["--num-layers", "2", "--is-hybrid-model", "--context-parallel-size", "2"],
         "--context-parallel-size 2 is not supported with Mamba layers"),
        (["--num-layers", "2", "--is-hybrid-model", "--reset-attention-mask"],
         "--reset-attention-mask is not supported with Mamba layers"),
        (["--num-layers", "2", "--is-hybrid-model", "--mtp-num-layers", "1"], "--mtp-num-layers is not supported "
         "with a hybrid Mamba model"),
        (["--num-layers", "2", "--is-hybrid-model", "--lora-rank", "4"], "--lora-rank 4 with Mamba layers is not "
         "supported"),
    ],
)  # fmt: skip
def test_hybrid_start_up_refusals_are_one_line(extra, message):
    from megatron_lite.layout_validation import validate_layout

    with pytest.raises(ConfigError, match=message) as e:
        _, job = parse_args([*BASE, *extra])
        p = job.parallel
        validate_layout(job.model, p, p.tp * p.pp * p.cp, job.training)
    assert "\n" not in str(e.value)


def test_a_mamba_layer_refuses_document_masks():
    """--reset-attention-mask is refused at start-up with Mamba layers (the scan would carry its state across
    documents); a model built around that check says so too. (Generation with a KV cache now runs Mamba layers:
    tests/test_generate_mamba.py.)"""
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    _, job = parse_args(["--num-layers", "1", "--is-hybrid-model", *BASE])
    model = build_model(job.model, ParallelContext.virtual(job.parallel, 1))
    with pytest.raises(ValueError, match="--reset-attention-mask is not supported with Mamba layers"):
        model(torch.zeros(1, 4, dtype=torch.long), document_ids=torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize(
    "world,parallel,mbs",
    [
        (2, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), 2),
        (2, ParallelConfig(pipeline_model_parallel_size=2), 1),
        (2, ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), 1),
    ],
    ids=["tp2-sp", "pp2", "pp2-vp2"],
)
def test_hybrid_training_at_tp2_and_pp2_equals_one_process(dist, world, parallel, mbs):
    """Mamba, attention and MoE layers (M*EM) trained at TP=2 with sequence parallelism (Mamba heads and groups
    split, each rank's gated norm over its own groups), at PP=2 (M* on one stage, EM on the other) and with two
    virtual stages a rank (M, *, E, M one a stage): the per-iteration lm_loss and grad_norm of one process."""
    from test_train_equivalence import _compare, train_run

    ref = train_run("nemotron_h", ParallelConfig(), 4, 4, layers=4, iters=4)
    for history in dist(world, train_run, "nemotron_h", parallel, 4, mbs, layers=4, iters=4):
        _compare(history, ref)
    assert ref[-1][0] < ref[0][0]  # (it trains)


def test_hybrid_training_with_tp_comm_overlap_equals_one_process(dist):
    """M* at TP=2 with sequence parallelism and --tp-comm-overlap, where the mixer's in_proj and out_proj run as
    the overlapped rings (the next test checks they do): the per-iteration lm_loss and grad_norm of one process."""
    from test_train_equivalence import _compare, train_run

    parallel = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, tp_comm_overlap=True)
    ref = train_run("nemotron_h", ParallelConfig(), 4, 4, iters=3)
    for history in dist(2, train_run, "nemotron_h", parallel, 4, 2, iters=3):
        _compare(history, ref)


@pytest.mark.parametrize("off", [None, "ag", "rs"])
def test_the_mixers_projections_overlap_their_collectives_under_tp_comm_overlap(off):
    """As Megatron's mixer (in_proj and out_proj built with tp_comm_buffer_name fc1 and fc2) and the MLP here:
    --tp-comm-overlap runs in_proj's all-gather and out_proj's reduce-scatter as rings (what the planner's overlap
    discount assumes of every layer), each switched off by its --disable-tp-comm-overlap-ag/-rs."""
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    flags = ["--num-layers", "2", "--hybrid-override-pattern", "M-", "--ffn-hidden-size", "48", *BASE]
    flags += ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"]
    _, job = parse_args(flags + ([f"--disable-tp-comm-overlap-{off}"] if off else []))
    layers = build_model(job.model, ParallelContext.virtual(job.parallel, 2), device="meta")[0].decoder.layers
    mixer, mlp = layers[0].mixer, layers[1].mlp
    seen = (mixer.in_proj.comm_overlap, mixer.out_proj.comm_overlap)
    assert seen == (mlp.linear_fc1.comm_overlap, mlp.linear_fc2.comm_overlap) == (off != "ag", off != "rs")
    assert mixer.in_proj.triton_gemm == mlp.linear_fc1.triton_gemm


def test_flops_count_each_hybrid_layer_as_its_kind():
    """Per token, worked by hand (h 32, 8 heads x 8 dims in 2 groups of state 8, so d 64; 4 attention heads of 8 in
    2 groups; MLP 48, squared ReLU; vocabulary 100; sequence 16, causal: 8 keys a query): 3 x the forward."""
    from megatron_lite.training.flops import flops_per_token

    flags = ["--num-layers", "3", "--hybrid-override-pattern", "M*-", "--ffn-hidden-size", "48", "--squared-relu"]
    flags += ["--group-query-attention", "--num-query-groups", "2"]
    model = parse_args([*BASE, *flags])[1].model
    mamba = 2 * 32 * (2 * 64 + 2 * 16 + 8) + 7 * 64 * 8 + 2 * 64 * 32
    attention = 2 * 32 * (4 + 2 * 2) * 8 + 4 * 8 * 4 * 8 + 2 * 4 * 8 * 32
    mlp = 2 * 32 * 48 * 2
    assert flops_per_token(model, 16) == 3 * (mamba + attention + mlp + 2 * 32 * 100)


def test_the_dry_run_prices_a_hybrid_models_activations(capsys):
    """(It said "activations not estimated"; tests/test_planner_hybrid.py holds the figure to the meter.)"""
    from megatron_lite.training.pretrain import main

    flags = ["--num-layers", "2", "--hybrid-override-pattern", "M*", *BASE, "--micro-batch-size", "2"]
    assert main([*flags, "--global-batch-size", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "activations not estimated" not in out and "dry run ok: 2 layers" in out


def test_a_checkpoint_carries_the_hybrid_flags():
    """`--load DIR` alone rebuilds the model that wrote it: the pattern and the mixer sizes come from the checkpoint
    (without them a hybrid checkpoint was rebuilt as a transformer and failed on a missing tensor)."""
    import json

    from megatron_lite.checkpoint_flags import defaults_from_checkpoint
    from megatron_lite.flag_parser import build_parser

    flags = ["--num-layers", "4", "--hybrid-override-pattern", "M*-E", "--num-experts", "2", "--mamba-num-heads", "4"]
    job = parse_args([*BASE, *flags])[1]
    saved = defaults_from_checkpoint(json.loads(json.dumps(job.to_dict())))  # (as the metadata file holds it)
    ns = build_parser().parse_args(["--seq-length", "16", "--mock-data", "--train-iters", "2"])
    for k, v in saved.items():
        setattr(ns, k, v)
    from megatron_lite.arguments import job_config_from_args

    model = job_config_from_args(ns).model
    fields = "is_hybrid_model hybrid_override_pattern mamba_state_dim mamba_head_dim mamba_num_groups mamba_num_heads"
    assert [getattr(model, f) for f in fields.split()] == [getattr(job.model, f) for f in fields.split()]
    assert model.layer_types == ("M", "*", "-", "E")


def test_a_hybrid_models_output_projections_start_at_std_over_sqrt_layers():
    """Each hybrid layer has one residual branch, so Megatron scales the projections writing into the residual
    stream (Mamba's out_proj, attention's linear_proj, the MLP's fc2) by 1 / sqrt(L), not a transformer's
    1 / sqrt(2 L) (TransformerConfig: multiplier 2.0 if not is_hybrid_model else 1.0)."""
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    flags = ["--num-layers", "8", "--hybrid-override-pattern", "MM*-MM*-", "--init-method-std", "0.02", *BASE]
    _, job = parse_args(flags)
    model = build_model(job.model, ParallelContext.virtual(job.parallel, 1), seed=1)
    layers = model[0].decoder.layers
    for w in (
        layers[0].mixer.out_proj.weight,
        layers[2].self_attention.linear_proj.weight,
        layers[3].mlp.linear_fc2.weight,
    ):
        assert abs(float(w.std()) / (0.02 / 8**0.5) - 1) < 0.05, float(w.std())
    assert abs(float(layers[0].mixer.in_proj.weight.std()) / 0.02 - 1) < 0.05  # (the input projections: std)
    # an MoE layer's shared expert too (its dense config drops the E layers, not the hybrid scaling)
    moe = "--num-experts 2 --moe-ffn-hidden-size 64 --moe-shared-expert-intermediate-size 64".split()
    moe.append("--disable-bias-linear")  # (a shared expert has no biases, as in Megatron)
    _, job = parse_args([*flags, *moe, "--hybrid-override-pattern", "MM*EMM*E"])
    model = build_model(job.model, ParallelContext.virtual(job.parallel, 1), seed=1)
    w = model[0].decoder.layers[3].mlp.shared_expert.linear_fc2.weight
    assert abs(float(w.std()) / (0.02 / 8**0.5) - 1) < 0.05, float(w.std())
