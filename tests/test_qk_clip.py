"""QK-clip (Megatron's --qk-clip, --qk-clip-alpha, --qk-clip-threshold, --log-max-attention-logit; models/qk_clip.py
and optimizer/qk_clip.py): one step's max logit per head and clipped QKV rows against q and k worked out by hand,
the layouts (TP, DP, the distributed optimizer, dist_muon, FSDP2) against one process, a threshold above every
logit changing nothing, and the refusals."""

from __future__ import annotations

import dataclasses
import math
import warnings
from functools import reduce

import pytest
import torch

from megatron_lite import kernels as K
from megatron_lite.arguments import parse_args
from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.data.mock import MockGPTDataset, collate
from megatron_lite.data.samplers import micro_batch_indices
from megatron_lite.layout_validation import validate_layout
from megatron_lite.models import qk_clip as qk_clip_model
from megatron_lite.models.attention import CoreAttention, SelfAttention
from megatron_lite.models.gpt_model import build_model
from megatron_lite.models.mla import MultiLatentAttention
from megatron_lite.models.qk_clip import group_eta, max_attention_logits
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.optimizer.lr_scheduler import LRScheduler
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.training.step import train_step
from megatron_lite.training.wrap import wrap_for_training

from dist_pool import get_context
from models import llama_config, needs_triton_on_cpu

ITERS, GBS, SEQ = 3, 4, 16
MUON = OptimizerConfig(
    optimizer="muon", lr=3e-2, lr_warmup_iters=0, lr_decay_style="constant", weight_decay=0.1, clip_grad=1.0,
    muon_fp32_matmul_prec="low", muon_use_nesterov=True, muon_tp_mode="duplicated",
)  # fmt: skip
# (the tiny model's query groups' max logits are 0.07-0.15 in the first steps: a threshold of 0.085 clips some of
# them and not others)
CLIP = dict(qk_clip=True, qk_clip_threshold=0.085, qk_clip_alpha=0.3)


def _model(parallel=None, optim=MUON, dtype=torch.float32, **kw):
    parallel = parallel or ParallelConfig()
    ctx = get_context(parallel) if torch.distributed.is_initialized() else ParallelContext.virtual(parallel)
    config = llama_config(**kw)
    ctx.seed(1234)
    model = build_model(config, ctx, seed=1234, dtype=dtype)
    ddp, opt = wrap_for_training(model, ctx, optim)
    return config, ctx, model, ddp, opt


def _batches(config, ctx, it: int, mbs: int):
    data = MockGPTDataset(config.vocab_size, SEQ, seed=7)
    idx = micro_batch_indices(it * GBS, GBS, mbs, ctx.dp.rank, ctx.dp.size)
    return [collate([data[i] for i in ix], ctx.device) for ix in idx]


def _train(parallel, mbs, optim=MUON, **kw):
    """Per iteration (lm_loss, grad_norm, max_attention_logit)."""
    config, ctx, _, ddp, opt = _model(parallel, optim, **kw)
    sched = LRScheduler(optim, ITERS)
    out = []
    for it in range(ITERS):
        m = train_step(ddp, opt, sched, _batches(config, ctx, it, mbs), ctx)
        out.append((m.lm_loss, m.grad_norm, m.max_attention_logit))
    return out


def _qkv_weights(model) -> list[torch.Tensor]:
    return [m.linear_qkv.weight.detach().clone() for m in model.modules() if isinstance(m, SelfAttention)]


def _step_by_hand(threshold: float, **kw):
    """One clipped step and the same step without --qk-clip: (config, the step's metrics, the clipped model, the
    unclipped model, per layer the max logit per head worked out from the q and k the core attention received:
    max over the micro-batches, the batch and the causal pairs j <= i of q_i.k_j / sqrt(head dim))."""
    config, ctx, model, ddp, opt = _model(**CLIP | {"qk_clip_threshold": threshold}, **kw)
    seen: dict[int, list] = {}
    for i, core in enumerate(m for m in model.modules() if isinstance(m, CoreAttention)):
        core.register_forward_hook(lambda mod, args, out, i=i: seen.setdefault(i, []).append(args[:2]))
    metrics = train_step(ddp, opt, LRScheduler(MUON, 1), _batches(config, ctx, 0, 2), ctx)
    _, ctx2, plain, ddp2, opt2 = _model(**kw)
    train_step(ddp2, opt2, LRScheduler(MUON, 1), _batches(config, ctx2, 0, 2), ctx2)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    best = []
    for layer in range(config.num_layers):
        top = torch.full((config.num_attention_heads,), -math.inf)
        for q, k in seen[layer]:
            k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)  # query head h reads key head h // (h / kv)
            s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
            top = torch.maximum(top, s.masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3)).float())
        best.append(top)
    return config, metrics, model, plain, best


def _weights(model, *names: str) -> list[torch.Tensor]:
    """Each attention layer's named weights (a dotted path), in order."""
    layers = [m for m in model.modules() if isinstance(m, (SelfAttention, MultiLatentAttention))]
    return [reduce(getattr, name.split("."), layer).detach().clone() for layer in layers for name in names]


@pytest.mark.parametrize("gated, bias", [(False, False), (True, False), (False, True)])
def test_one_step_clips_the_rows_worked_out_by_hand(gated, bias):
    """Per query group eta = threshold / its heads' max logit where that exceeds the threshold; the group's query
    rows of the updated fused QKV weight are scaled by eta^alpha, its key rows by eta^(1 - alpha), values (and
    --attention-output-gate's gate rows) untouched; --add-qkv-bias: the bias entries with their rows (so q and k
    are scaled exactly; Megatron leaves the bias). The update itself is the run without --qk-clip's."""
    threshold, alpha = 0.085, CLIP["qk_clip_alpha"]
    config, m, model, plain, best = _step_by_hand(threshold, attention_output_gate=gated, add_qkv_bias=bias)
    heads, groups, d = config.num_attention_heads, config.query_groups, config.head_dim
    names = ["linear_qkv.weight", *(["linear_qkv.bias"] if bias else [])]
    per_layer = len(names)
    clipped = 0
    ours_all, want_all = _weights(model, *names), _weights(plain, *names)
    pairs = [(best[i // per_layer], ours_all[i], want_all[i]) for i in range(len(ours_all))]
    assert not bias or all(w.abs().min() > 0 for w in want_all[1::2])  # (a step has moved the biases off zero)
    for top, ours, want in pairs:
        n = heads // groups  # (each group's rows: its n query heads, n gate heads when gated, its key, its value)
        want = want.view(groups, n * (2 if gated else 1) + 2, d, -1).clone()
        for g in range(groups):
            eta = min(threshold / top[g * n : (g + 1) * n].max().item(), 1.0)
            clipped += eta < 1
            want[g, :n] *= eta**alpha
            want[g, -2] *= eta ** (1 - alpha)
        torch.testing.assert_close(ours, want.view_as(ours), rtol=1e-5, atol=1e-7)
    assert 0 < clipped < groups * len(pairs)  # (some groups clipped, some not)
    assert m.max_attention_logit == pytest.approx(max(t.max().item() for t in best), rel=1e-5)


MLA = dict(num_query_groups=None, multi_latent_attention=True, qk_layernorm=True, kv_lora_rank=16, qk_head_dim=12,
           qk_pos_emb_head_dim=8, v_head_dim=10)  # fmt: skip


@pytest.mark.parametrize("q_lora_rank", [None, 32])
def test_one_step_clips_multi_latent_attention_by_hand(q_lora_rank):
    """Multi-latent attention, per head (Megatron-Core's MLASelfAttention.clip_qk): the query projection's rows of
    a head without position by eta^alpha and its RoPE rows by eta (the key's RoPE part is shared by the heads), the
    key/value up-projection's key rows by eta^(1 - alpha); values and the down-projections untouched."""
    threshold, alpha = 0.04, CLIP["qk_clip_alpha"]
    config, m, model, plain, best = _step_by_hand(threshold, **MLA, q_lora_rank=q_lora_rank)
    q_name = "linear_q_proj.weight" if q_lora_rank is None else "linear_q_up_proj.weight"
    names = (q_name, "linear_kv_up_proj.weight", "linear_kv_down_proj.weight")
    ours, want = _weights(model, *names), _weights(plain, *names)
    heads, nope, pe, dv = config.num_attention_heads, 12, 8, 10
    clipped = 0
    for layer, top in enumerate(best):
        eta = (threshold / top).clamp(max=1.0).view(heads, 1, 1)
        clipped += int((eta < 1).sum())
        q, kv, down = (w.clone() for w in want[3 * layer : 3 * layer + 3])
        q = q.view(heads, nope + pe, -1)
        q[:, :nope] *= eta**alpha
        q[:, nope:] *= eta
        kv = kv.view(heads, nope + dv, -1)
        kv[:, :nope] *= eta ** (1 - alpha)
        for got, expected in zip(ours[3 * layer : 3 * layer + 3], (q, kv, down)):
            torch.testing.assert_close(got, expected.view_as(got), rtol=1e-5, atol=1e-7)
    assert 0 < clipped < heads * config.num_layers
    assert m.max_attention_logit == pytest.approx(max(t.max().item() for t in best), rel=1e-5)


def test_main_weights_are_clipped_with_the_model():
    """bf16 model, fp32 main weights: the main weights are clipped (they differ from the same step's without
    --qk-clip: the next step starts from the clipped weights), and the model's weights are the unclipped step's
    bf16 weights scaled by the same row factors in fp32, rounded once (Megatron's clip_qk scales weight.data and
    main_param apart)."""
    mains, models = [], []
    for kw in ({}, CLIP):
        optim = dataclasses.replace(MUON, bf16=True)
        config, ctx, model, ddp, opt = _model(optim=optim, dtype=torch.bfloat16, **kw)
        train_step(ddp, opt, LRScheduler(MUON, 1), _batches(config, ctx, 0, 2), ctx)
        qkv = [m.linear_qkv.weight for m in model.modules() if isinstance(m, SelfAttention)]
        mains.append([opt.main_of[id(w)].clone() for w in qkv])
        models.append([w.detach().clone() for w in qkv])
    for plain, clipped, w_plain, w in zip(*mains, *models):
        assert clipped.dtype == torch.float32 and not torch.equal(plain, clipped)
        assert torch.equal(plain.to(w_plain.dtype), w_plain)
        factor = (clipped / plain)[:, :1]  # (each row's factor, to an fp32 rounding)
        torch.testing.assert_close(w.float(), (w_plain.float() * factor).to(w.dtype).float(), rtol=2**-8, atol=0)


def _bf16_qkv(optimizer: str) -> list[torch.Tensor]:
    optim = dataclasses.replace(MUON, optimizer=optimizer, bf16=True)
    config, ctx, model, ddp, opt = _model(DP2, optim, dtype=torch.bfloat16, **CLIP)
    m = train_step(ddp, opt, LRScheduler(optim, 1), _batches(config, ctx, 0, 2), ctx)
    assert m.max_attention_logit > CLIP["qk_clip_threshold"]
    return _qkv_weights(model)


def test_dist_muon_bf16_replicas_are_clipped_alike(dist):
    """bf16 weights under dist_muon, DP=2: after a clipped step both ranks' QKV weights are bit-equal, and equal
    plain muon's (every rank scales its bf16 copy alike; the owner had cast its scaled main weights instead)."""
    ranks = dist(2, _bf16_qkv, "dist_muon")
    want = dist(2, _bf16_qkv, "muon")[0]
    for got in ranks:
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def _overlapped(overlap: bool):
    """Distributed Adam, DP=2, small buckets: per step (lm_loss, grad_norm, gathers still in flight, buckets),
    then the QKV weights once every gather has landed."""
    optim = OptimizerConfig(lr=3e-2, clip_grad=1.0, use_distributed_optimizer=True, overlap_param_gather=overlap)
    ctx, config = get_context(DP2), llama_config(**CLIP)
    ctx.seed(1234)
    model = build_model(config, ctx, seed=1234, dtype=torch.float32)
    ddp, opt = wrap_for_training(model, ctx, optim, bucket_size=2000, overlap_grad_reduce=True)
    sched, out = LRScheduler(optim, 2), []
    buckets = sum(len(buf.buckets) for buf in ddp.buffers)
    for it in range(2):
        m = train_step(ddp, opt, sched, _batches(config, ctx, it, 2), ctx)
        assert m.max_attention_logit > CLIP["qk_clip_threshold"]
        out.append((m.lm_loss, m.grad_norm, len(opt._in_flight), buckets))
    opt.finish_param_sync()
    return out, _qkv_weights(model)


def test_a_clip_leaves_the_other_buckets_gathers_in_flight(dist):
    """--overlap-param-gather: after a clipped step every bucket's all-gather is still in flight (the scale waits
    for its bucket's gather to land; waiting for all of them had exposed the whole gather: 0 in flight), and the
    losses, grad norms and clipped weights are the non-overlapped run's."""
    (over, w), _ = dist(2, _overlapped, True)
    (plain, want), _ = dist(2, _overlapped, False)
    assert all(n == buckets > 2 for *_, n, buckets in over), over
    assert [o[:2] for o in over] == [p[:2] for p in plain]
    assert all(torch.equal(a, b) for a, b in zip(w, want))


def test_a_non_finite_max_logit_clips_nothing():
    """eta per group by hand: +inf, NaN and a max below the threshold keep 1 (+inf had given eta 0, zeroing the
    group's query and key rows); 4 over a threshold of 2 gives 0.5."""
    found = torch.tensor([math.inf, 0.0, math.nan, 1.0, 1.5, 4.0, -math.inf, 0.5])
    assert group_eta(found, 4, 2.0).tolist() == [1.0, 1.0, 0.5, 1.0]


@needs_triton_on_cpu
def test_torch_and_triton_paths_record_the_same_max_logits():
    """SDPA with the logits recomputed beside it, and the flash kernel's running row max (Triton interpreter):
    the same max logit per layer and head over two micro-batches."""
    found, launches = {}, K.LAUNCHES["flash_attention_fwd"]
    for impl in ("torch", "triton"):
        config, ctx, model, ddp, opt = _model(kernel_impl=impl, **CLIP)
        cores = [m for m in model.modules() if isinstance(m, CoreAttention)]
        model.train()
        for mb in _batches(config, ctx, 0, 2):
            model(mb["tokens"], labels=mb["labels"])
        found[impl] = [c.take_max_logits() for c in cores]
    assert K.LAUNCHES["flash_attention_fwd"] == launches + 4  # (2 layers x 2 micro-batches, the triton run's)
    for a, b in zip(found["torch"], found["triton"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_max_logit_under_masks_is_brute_force():
    """A sliding window and documents: the max over the visible pairs only (masked logits may be larger)."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 8, 4, 8, generator=gen), torch.randn(2, 8, 2, 8, generator=gen)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1, 1, 1]])
    visible = (docs[:, :, None] == docs[:, None, :]) & torch.ones(8, 8, dtype=torch.bool).tril()
    visible &= torch.ones(8, 8, dtype=torch.bool).triu(-2)  # window 3
    want = torch.full((4,), -math.inf)
    for b, i, j, h in ((b, i, j, h) for b in range(2) for i in range(8) for j in range(8) for h in range(4)):
        if visible[b, i, j]:
            want[h] = max(want[h], float(q[b, i, h] @ k[b, j, h // 2]) * 0.3)
    torch.testing.assert_close(max_attention_logits(q, k, 0.3, visible.unsqueeze(1)), want)
    everything = max_attention_logits(q, k, 0.3, torch.ones(8, 8, dtype=torch.bool))
    assert (everything >= want).all() and (everything > want).any()


@pytest.mark.parametrize("mask", ["causal", "window-documents", "kv-cache"])
def test_tiled_max_logit_is_brute_force(monkeypatch, mask):
    """Tiles of 16 x 16 logits over 40 queries (partial tiles, the causal square's skipped and diagonal tiles, a
    mask's empty tiles, a bottom-right causal mask over 52 keys), fp64 brute force per head; bf16 inputs within
    the flash kernel's bf16 tolerance."""
    for budget in ("MAX_LOGIT_ELEMENTS", "CPU_LOGIT_ELEMENTS"):
        monkeypatch.setattr(qk_clip_model, budget, 16 * 16 * 2 * 4)
    gen = torch.Generator().manual_seed(1)
    sk = 52 if mask == "kv-cache" else 40
    q, k = torch.randn(2, 40, 4, 8, generator=gen), torch.randn(2, sk, 2, 8, generator=gen)
    visible = torch.ones(40, sk, dtype=torch.bool).tril(sk - 40)
    if mask == "window-documents":
        docs = (torch.arange(40) >= torch.tensor([[17], [30]])).long()
        visible = (visible & torch.ones(40, 40, dtype=torch.bool).triu(-20)) & (docs[:, :, None] == docs[:, None, :])
        visible = visible.unsqueeze(1)
    logits = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.repeat_interleave(2, dim=2).double()) * 0.3
    vis = visible if visible.dim() == 4 else visible[None, None]
    want = logits.masked_fill(~vis, -math.inf).amax(dim=(0, 2, 3)).float()
    arg = None if mask == "causal" else visible
    torch.testing.assert_close(max_attention_logits(q, k, 0.3, arg), want)
    got = max_attention_logits(q.bfloat16(), k.bfloat16(), 0.3, arg)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    # fp16: q.k = 8 x 100^2 = 80000 unscaled, past fp16's 65504; scaled by 0.3, 24000 (a review: the max came out
    # +inf, which clips nothing)
    q16, k16 = (
        torch.full((2, 4, 4, 8), 100.0, dtype=torch.float16),
        torch.full((2, 4, 2, 8), 100.0, dtype=torch.float16),
    )
    torch.testing.assert_close(max_attention_logits(q16, k16, 0.3, None), torch.full((4,), 24000.0))


def test_a_recompute_does_not_recompute_the_max_logit(monkeypatch):
    """Full recomputation: the logits' max is taken once per layer and micro-batch (the backward's recompute sees
    the same logits: it had taken them again), and the clipped step is the one without recomputation."""
    from megatron_lite.models import attention

    calls = []
    counted = lambda *a: calls.append(1) or max_attention_logits(*a)  # noqa: E731
    monkeypatch.setattr(attention, "max_attention_logits", counted)
    runs = []
    for kw in (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), {}):
        config, ctx, model, ddp, opt = _model(**CLIP | kw)
        m = train_step(ddp, opt, LRScheduler(MUON, 1), _batches(config, ctx, 0, 2), ctx)
        runs.append((m.lm_loss, m.grad_norm, m.max_attention_logit, _qkv_weights(model)))
        assert len(calls) == 2 * 2 * len(runs)  # (2 layers x 2 micro-batches per run)
    assert runs[0][:3] == runs[1][:3] and all(torch.equal(a, b) for a, b in zip(runs[0][3], runs[1][3]))


def test_a_threshold_above_every_logit_changes_nothing():
    """Bit-equal losses, grad norms and weights to a run without --qk-clip; the logged max logit is below it."""
    runs = []
    for kw in ({}, dict(qk_clip=True, qk_clip_threshold=1e4)):
        config, ctx, model, ddp, opt = _model(**kw)
        sched, hist = LRScheduler(MUON, ITERS), []
        for it in range(ITERS):
            m = train_step(ddp, opt, sched, _batches(config, ctx, it, 2), ctx)
            hist.append((m.lm_loss, m.grad_norm))
        runs.append((hist, [p.detach().clone() for p in model.parameters()], m.max_attention_logit))
    (plain, plain_w, none), (clip, clip_w, logit) = runs
    assert plain == clip and all(torch.equal(a, b) for a, b in zip(plain_w, clip_w))
    assert none is None and 0 < logit < 1e4


TP2 = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
DP2 = ParallelConfig()
LAYOUTS = {  # (parallel, optimizer, model)
    "tp2": (TP2, MUON, {}),
    "pp2": (ParallelConfig(pipeline_model_parallel_size=2), MUON, {}),
    "dp2-dist_muon": (DP2, dataclasses.replace(MUON, optimizer="dist_muon"), {}),
    "dp2-distributed-adam": (
        DP2,
        OptimizerConfig(lr=3e-2, clip_grad=1.0, use_distributed_optimizer=True, overlap_param_gather=True),
        {},
    ),
    "dp2-fsdp2-adam": (DP2, OptimizerConfig(lr=3e-2, clip_grad=1.0, use_torch_fsdp2=True), {}),
    "mla-tp2": (TP2, MUON, dict(MLA, q_lora_rank=32, qk_clip_threshold=0.04)),
    **{  # context parallelism: each rank's queries over every key block, or its heads over the whole sequence
        f"cp2-{kind}": (ParallelConfig(context_parallel_size=2, cp_comm_type=kind), MUON, {})
        for kind in ("p2p", "a2a", "allgather")
    },
    **{
        f"cp2-a2a+p2p-{a}x{p}": (
            ParallelConfig(context_parallel_size=2, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=(a, p)),
            MUON,
            {},
        )
        for a, p in ((2, 1), (1, 2))
    },
}


@pytest.mark.parametrize("what", LAYOUTS)
def test_layouts_clip_like_one_process(dist, what):
    """TP=2 with Muon (each rank clips its own query groups), PP=2 (the logged max over both stages), DP=2 (the
    max over replicas) with dist_muon (the owner's main weights), the distributed optimizer (its flat parts' rows,
    with --overlap-param-gather's all-gather of the unclipped weights in flight), FSDP2 (its dim-0 shards) and
    multi-latent attention under TP=2 (each rank its heads' rows of both up-projections), context parallelism of
    each kind (the ring's blocks, the all-to-all's head shards): per iteration the one-process lm_loss, grad_norm
    and max logit, with clipping active."""
    parallel, optim, model = LAYOUTS[what]
    one = dataclasses.replace(optim, use_distributed_optimizer=False, use_torch_fsdp2=False, overlap_param_gather=False)
    one = dataclasses.replace(one, optimizer="muon") if one.optimizer == "dist_muon" else one
    ref = _train(ParallelConfig(), GBS, one, **CLIP | model)
    assert all(r[2] > (CLIP | model)["qk_clip_threshold"] for r in ref), ref  # (clipping at every step)
    mbs = GBS // (2 // parallel.tensor_model_parallel_size)
    for history in dist(2, _train, parallel, mbs, optim, **CLIP | model):
        for it, (got, want) in enumerate(zip(history, ref)):
            assert got == pytest.approx(want, rel=1e-4), (what, it + 1, got, want)


@pytest.mark.parametrize(
    "flags, says",
    [
        ("--qk-clip --qk-clip-alpha 1", "--qk-clip-alpha 1.0 must be in (0, 1)"),
        ("--qk-clip --qk-clip-alpha 0", "--qk-clip-alpha 0.0 must be in (0, 1)"),
        ("--qk-clip --qk-clip-threshold 0", "--qk-clip-threshold 0.0 must be > 0"),
        ("--qk-clip --lora-rank 4", "--qk-clip with --lora-rank 4 is not supported: the clip scales the QKV weight"),
    ],
)
def test_refusals_are_one_line(flags, says):
    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-iters 4 --mock-data"
    with pytest.raises(ConfigError) as err:
        _, job = parse_args([*base.split(), "--vocab-size", "100", *flags.split()])
        validate_layout(job.model, job.parallel, 2, job.training)  # (as pretrain does, before any collective)
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("norm", ["--qk-layernorm", "--qk-l2-norm"])
def test_a_qk_norm_under_the_clip_is_warned_of(norm):
    """Accepted as Megatron accepts it (its users run the pair), with a one-line warning: the per-head norm undoes
    the row scale, so the clip bounds no logit. Multi-latent attention's norms (on the latents) are not warned of."""
    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-iters 4 --mock-data"
    from megatron_lite.megatron_flags import accepted_no_ops

    with warnings.catch_warnings():  # (a start-up line, once: it was a Python warning, printed twice)
        warnings.simplefilter("error")
        said = accepted_no_ops(parse_args([*base.split(), "--vocab-size", "100", "--qk-clip", norm])[0])
        assert sum(line.startswith(f"--qk-clip with {norm}: the norm undoes") for line in said) == 1, said
        said = accepted_no_ops(parse_args([*base.split(), "--vocab-size", "100", "--qk-clip"])[0])
        assert not any("the norm undoes" in line for line in said), said


def test_the_max_logit_is_logged_each_iteration(tmp_path, pretrain_job):
    """--log-max-attention-logit alone: Megatron's max_attention_logit in the console line and every JSONL record
    (and as the W&B / TensorBoard key), the weights left alone; without it, no such metric."""
    from test_pretrain_torchrun import records

    from megatron_lite.training.logger import _megatron_key

    job = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-iters 2 --micro-batch-size 2 "
        "--global-batch-size 4 --lr 3e-3 --log-interval 1 --eval-iters 0 --mock-data --vocab-size 100 "
        "--distributed-backend gloo --attention-dropout 0 --hidden-dropout 0"
    ).split()
    for flag in ("--log-max-attention-logit", None):
        log = tmp_path / f"{flag}.jsonl"
        out = pretrain_job(1, [*job, *([flag] if flag else []), "--log-jsonl", str(log)])
        recs = records(log)
        assert len(recs) == 2 and all((r.get("max_attention_logit", 0) > 0) == bool(flag) for r in recs), recs
        assert ("max_attention_logit: " in out) == bool(flag)
    assert _megatron_key("max_attention_logit") == "max_attention_logit"
