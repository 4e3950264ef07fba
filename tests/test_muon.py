"""--optimizer muon (optimizer/muon.py): the update against torch.optim.Muon and against Newton-Schulz worked out
in fp64 here, the fused QKV's split, training under TP (each --muon-tp-mode), DP and EP against one process,
a resume, and the refusals."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.data.mock import MockGPTDataset, collate
from megatron_lite.data.samplers import micro_batch_indices
from megatron_lite.models.gpt_model import build_model
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.optimizer.lr_scheduler import LRScheduler
from megatron_lite.optimizer.muon import MuonParam, MuonWithAdam
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.training.step import train_step
from megatron_lite.training.wrap import wrap_for_training

from dist_pool import get_context
from models import llama_config, specs

# Keller Jordan's modded-nanogpt quintic coefficient sets (train_gpt_medium.py), as published: one per step
QUINTIC = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]


def _muon(p: torch.Tensor, **kw) -> MuonWithAdam:
    args = dict(
        momentum=0.9,
        nesterov=False,
        num_ns_steps=5,
        scale_mode="spectral",
        extra_scale_factor=1.0,
        fp32_matmul_prec="low",
        tp_mode="blockwise",
    )
    args.update(kw)
    split = args.pop("qkv_split", None)
    lr, wd = args.pop("lr", 0.02), args.pop("weight_decay", 0.0)
    groups = [{"params": [p], "lr": lr, "weight_decay": wd, "muon": True}]
    return MuonWithAdam(groups, None, {id(p): MuonParam("w", qkv_split=split)}, **args)


@pytest.mark.parametrize("shape", [(16, 64), (64, 16)])
def test_one_step_equals_torch_muon(shape):
    """torch.optim.Muon runs Newton-Schulz in bf16 with Keller Jordan's coefficients: with those ("simple") and
    --muon-fp32-matmul-prec medium (bf16), a gradient whose normalization is exact in both (entries +-0.5, a
    Frobenius norm that is a power of 2 times 3/4 after Nesterov), Nesterov momentum 0.5 and shape_scaling
    (torch's "original" lr adjustment), one step gives the same weights bit for bit; spectral with an extra
    0.2 is torch's "match_rms_adamw", and decoupled weight decay is torch's, to rounding."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(shape, generator=gen)
    g = (torch.randint(0, 2, shape, generator=gen) * 2 - 1).float() * 0.5
    for ours, theirs, wd, exact in (
        (dict(scale_mode="shape_scaling"), "original", 0.0, True),
        (dict(scale_mode="shape_scaling"), "original", 0.1, False),
        (dict(scale_mode="spectral", extra_scale_factor=0.2), "match_rms_adamw", 0.1, False),
    ):
        a, b = w0.clone(), w0.clone()
        a.grad, b.grad = g.clone(), g.clone()
        opt = _muon(a, momentum=0.5, nesterov=True, fp32_matmul_prec="medium", weight_decay=wd, lr=2**-4, **ours)
        opt.coefficients = "simple"
        opt.step()
        torch.optim.Muon([b], lr=2**-4, weight_decay=wd, momentum=0.5, nesterov=True, adjust_lr_fn=theirs).step()
        assert not torch.equal(a, w0)
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _ns_fp64(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Newton-Schulz by hand in fp64: X / ||X||_F on the wide side, then X <- aX + (bA + cA^2)X, A = XX^T."""
    x = x.double()
    tall = x.shape[0] > x.shape[1]
    X = x.T if tall else x
    X = X / X.norm()
    for a, b, c in (QUINTIC * steps)[:steps]:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("mode", ["spectral", "unit_rms_norm", "shape_scaling"])
def test_three_steps_equal_the_update_worked_out_in_fp64(nesterov, mode):
    """Megatron's update (emerging_optimizers' OrthogonalizedOptimizer): w -= lr wd w; buf = 0.9 buf + 0.1 g;
    u = Nesterov ? 0.1 g + 0.9 buf : buf; w -= lr * NS(u) * scale * extra, with the quintic sets and each scale
    mode's factor by hand (spectral sqrt(max(r, c)), unit_rms_norm sqrt(r / c), shape_scaling sqrt(max(1, r / c)))."""
    rows, cols = 24, 40
    scale = {"spectral": max(rows, cols) ** 0.5, "unit_rms_norm": (rows / cols) ** 0.5, "shape_scaling": 1.0}[mode]
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(rows, cols, generator=gen)
    ref, buf = w.double(), torch.zeros(rows, cols, dtype=torch.float64)
    opt = _muon(w, nesterov=nesterov, scale_mode=mode, extra_scale_factor=0.5, weight_decay=0.1, lr=0.01)
    for _ in range(3):
        g = torch.randn(rows, cols, generator=gen)
        w.grad = g.clone()
        opt.step()
        ref = ref - 0.01 * 0.1 * ref
        buf = 0.9 * buf + 0.1 * g.double()
        u = 0.1 * g.double() + 0.9 * buf if nesterov else buf
        ref = ref - 0.01 * _ns_fp64(u) * scale * 0.5
        torch.testing.assert_close(w.double(), ref, rtol=0, atol=2e-6)
    assert set(opt.state[w]) == {"momentum_buffer"}


@pytest.mark.parametrize("gated", [False, True])
def test_fused_qkv_is_orthogonalized_part_by_part(gated):
    """Per query group the fused rows are [its queries, (gates,) its key, its value] (models/attention.py):
    each part's rows of every group form one matrix, orthogonalized and scaled by its own shape. Without the
    split (--muon-no-split-qkv) the whole matrix is one."""
    groups, heads, d, hidden = 2, 2, 4, 16
    parts = [heads * d, heads * d, d, d] if gated else [heads * d, d, d]
    rows = groups * sum(parts)
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(rows, hidden, generator=gen)
    expected = torch.empty(rows, hidden, dtype=torch.float64)
    idx = torch.arange(rows).view(groups, sum(parts))
    for rows_of_part in idx.split(parts, dim=1):
        r = rows_of_part.reshape(-1)  # this part's rows, group by group
        expected[r] = _ns_fp64(g[r]) * max(len(r), hidden) ** 0.5
    for split, want in ((tuple(parts), expected), (None, _ns_fp64(g) * max(rows, hidden) ** 0.5)):
        w = torch.zeros(rows, hidden)
        w.grad = g.clone()
        _muon(w, momentum=0.0, qkv_split=split, lr=1.0).step()
        torch.testing.assert_close(-w.double(), want, rtol=1e-5, atol=1e-5)  # (fp32 against fp64)


ITERS, GBS = 5, 4
MODELS = {  # GQA (8 heads, 4 groups) and SwiGLU; with 4 experts (top-2) in each layer
    "llama": llama_config,
    "moe": lambda: llama_config(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24),
}
MUON = OptimizerConfig(
    optimizer="muon", lr=3e-3, lr_warmup_iters=1, lr_decay_style="cosine", weight_decay=0.1, clip_grad=1.0,
    muon_fp32_matmul_prec="low", muon_use_nesterov=True,
)  # fmt: skip


def _train(name, parallel, mbs, optim=MUON, blockwise_oracle=None):
    """Per iteration (lm_loss, grad_norm). `blockwise_oracle` (one process): the layout whose TP shards each
    TP-split matrix is orthogonalized by, a shard at a time, as --muon-tp-mode blockwise does on its ranks."""
    ctx = get_context(parallel) if torch.distributed.is_initialized() else ParallelContext.virtual(parallel)
    config = MODELS[name]()
    ctx.seed(1234)
    model = build_model(config, ctx, seed=1234)
    ddp, opt = wrap_for_training(model, ctx, optim)
    if blockwise_oracle is not None:
        shard_of, whole = specs(config, blockwise_oracle, 2), opt.inner.orthogonalize

        def by_shard(p, update):
            spec = shard_of[opt.inner.info[id(p)].name.removeprefix("0.")]  # (the model chunk's index)
            if spec is None or spec.tp_size == 1:
                return whole(p, update)
            return spec.unshard([whole(p, spec.shard(update, r)) for r in range(spec.tp_size)])

        opt.inner.orthogonalize = by_shard
    sched = LRScheduler(optim, ITERS)
    data = MockGPTDataset(config.vocab_size, 16, seed=7)
    history = []
    for it in range(ITERS):
        idx = micro_batch_indices(it * GBS, GBS, mbs, ctx.dp.rank, ctx.dp.size)
        m = train_step(ddp, opt, sched, [collate([data[i] for i in ix], ctx.device) for ix in idx], ctx)
        history.append((m.lm_loss, m.grad_norm))
    return history


def _close(history, ref, what):
    for it, ((loss, norm), (rloss, rnorm)) in enumerate(zip(history, ref)):
        assert abs(loss - rloss) <= 1e-4 * rloss and abs(norm - rnorm) <= 1e-4 * rnorm, (what, it + 1, loss, rloss)


TP2 = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)


@pytest.mark.slow
def test_layouts_train_like_one_process(dist):
    """TP=2 duplicated and distributed, DP=2 and EP=2 (MoE): the one-process run's lm_loss and grad_norm; TP=2
    blockwise: the one-process run whose TP-split matrices are orthogonalized by TP=2's shards (not TP=1's math,
    by design). The GQA model's fused QKV is split, and its SwiGLU fc1 shards are [gate; up] slices."""
    ref = _train("llama", ParallelConfig(), GBS)
    runs = {
        "duplicated": ("llama", TP2, dataclasses.replace(MUON, muon_tp_mode="duplicated"), ref),
        "distributed": ("llama", TP2, dataclasses.replace(MUON, muon_tp_mode="distributed"), ref),
        "blockwise": ("llama", TP2, MUON, _train("llama", ParallelConfig(), GBS, blockwise_oracle=TP2)),
        "dp2": ("llama", ParallelConfig(), MUON, ref),
    }
    moe_ref = _train("moe", ParallelConfig(), GBS)
    runs["moe-ep2"] = ("moe", ParallelConfig(expert_model_parallel_size=2), MUON, moe_ref)
    # experts split over the expert TP group (TP=2 here), gathered for their update
    runs["moe-etp2"] = ("moe", TP2, dataclasses.replace(MUON, muon_tp_mode="duplicated"), moe_ref)
    for what, (name, parallel, optim, expected) in runs.items():
        mbs = GBS // (2 // parallel.tensor_model_parallel_size)
        for history in dist(2, _train, name, parallel, mbs, optim):
            _close(history, expected, what)
    with pytest.raises(AssertionError):  # blockwise is another update than one process's
        _close(_train("llama", ParallelConfig(), GBS, blockwise_oracle=TP2), ref, "blockwise")


JOB = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--seq-length 32 --train-iters 6 --micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --lr-warmup-iters 1 "
    "--lr-decay-style cosine --log-interval 1 --eval-iters 0 --normalization RMSNorm --swiglu "
    "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
    "--distributed-backend gloo --optimizer muon --muon-use-nesterov --muon-tp-mode duplicated "
    "--tensor-model-parallel-size 2"
).split()


@pytest.mark.slow
def test_resume_is_exact(tmp_path, pretrain_job):
    """6 iterations straight (saving at 3) vs --load --ckpt-step 3 + 3 at TP=2: identical lm_loss and grad_norm
    at 4-6, so Muon's momentum buffers (and Adam's moments for the rest) come back from the checkpoint."""
    from test_pretrain_torchrun import records

    ckpt = str(tmp_path / "ckpt")
    pretrain_job(2, [*JOB, "--save", ckpt, "--save-interval", "3", "--log-jsonl", str(tmp_path / "straight.jsonl")])
    out = pretrain_job(2, [*JOB, "--load", ckpt, "--ckpt-step", "3", "--log-jsonl", str(tmp_path / "resumed.jsonl")])
    assert "loaded" in out and "iteration 3" in out
    straight, resumed = records(tmp_path / "straight.jsonl"), records(tmp_path / "resumed.jsonl")
    assert [r["iteration"] for r in resumed] == [4, 5, 6]
    for s, r in zip(straight[3:], resumed):
        assert s["lm_loss"] == r["lm_loss"] and s["grad_norm"] == r["grad_norm"], (s, r)
    # an Adam run is told what the checkpoint holds, in one line
    adam = [*JOB[: JOB.index("--optimizer")], "--optimizer", "adam", "--load", ckpt, "--ckpt-step", "3"]
    out = pretrain_job(1, adam, exit_code=2)
    assert "holds Muon momentum and Adam moments (--optimizer muon); this run keeps Adam moments" in out


BASE = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-iters 4 --mock-data".split()


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--optimizer muon --use-distributed-optimizer", "--optimizer muon with --use-distributed-optimizer is not"),
        ("--optimizer muon --fp16", "--optimizer muon with --fp16 is not supported"),
        ("--optimizer muon --use-torch-fsdp2", "--optimizer muon with --use-torch-fsdp2 is not supported"),
        ("--optimizer muon --use-apex-adam", "--optimizer muon with --use-apex-adam is not supported"),
        ("--optimizer muon --muon-num-ns-steps 3", "--muon-num-ns-steps 3 must be a positive multiple of 5"),
        ("--optimizer muon --muon-momentum 1", "--muon-momentum 1.0 must be in [0, 1)"),
        (
            "--optimizer muon --use-precision-aware-optimizer",
            "--use-precision-aware-optimizer is our Adam's: drop it with --optimizer muon",
        ),
    ],
)
def test_refusals_are_one_line(flags, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)) as e:
        parse_args([*BASE, *flags.split()])
    assert "\n" not in str(e.value)


def test_flags_reach_the_config():
    """Megatron-LM's defaults (its --muon-momentum is 0.9), and each flag's value."""
    cfg = parse_args([*BASE, "--optimizer", "muon"])[1].optimizer
    assert (cfg.muon_momentum, cfg.muon_split_qkv, cfg.muon_use_nesterov) == (0.9, True, False)
    assert (cfg.muon_num_ns_steps, cfg.muon_extra_scale_factor) == (5, 1.0)
    assert (cfg.muon_scale_mode, cfg.muon_fp32_matmul_prec, cfg.muon_tp_mode) == ("spectral", "medium", "blockwise")
    flags = (
        "--optimizer muon --muon-momentum 0.95 --muon-no-split-qkv --muon-use-nesterov --muon-scale-mode "
        "unit_rms_norm --muon-fp32-matmul-prec high --muon-num-ns-steps 10 --muon-tp-mode duplicated "
        "--muon-extra-scale-factor 0.2"
    ).split()
    cfg = parse_args([*BASE, *flags])[1].optimizer
    assert (cfg.muon_momentum, cfg.muon_split_qkv, cfg.muon_use_nesterov) == (0.95, False, True)
    assert (cfg.muon_num_ns_steps, cfg.muon_extra_scale_factor) == (10, 0.2)
    assert (cfg.muon_scale_mode, cfg.muon_fp32_matmul_prec, cfg.muon_tp_mode) == ("unit_rms_norm", "high", "duplicated")
