"""Mixture of experts: training under expert parallelism equals one process (lm_loss, auxiliary loss and
grad norm per iteration within 1e-4), dropped tokens match under a capacity factor, and the aux-loss-free
expert bias balances load identically on every replica.

The auxiliary loss is a statistic of each micro-batch (as in Megatron), so the single-process reference
runs the same micro-batch size: the global batch is then cut into the same micro-batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_lite.config import ParallelConfig
from megatron_lite.data.mock import MockGPTDataset, collate
from megatron_lite.data.samplers import micro_batch_indices
from megatron_lite.models.gpt_model import build_model
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.optimizer.lr_scheduler import LRScheduler
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.training.step import train_step
from megatron_lite.training.wrap import wrap_for_training

from dist_pool import get_context
from models import llama_config, rel

ITERS, SEQ, TOL = 10, 16, 1e-4
OPTIM = OptimizerConfig(lr=3e-3, lr_warmup_iters=2, lr_decay_style="cosine", min_lr=3e-4, weight_decay=0.1)
MOE = dict(
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=48,
    moe_aux_loss_coeff=1e-2,
    moe_z_loss_coeff=1e-3,
    num_layers=2,
)


def moe_config(**kw):
    return llama_config(**{**MOE, **kw})


def moe_run(config, parallel, gbs, mbs, iters=ITERS, skew=0.0, optim=OPTIM, overlap=False, bucket_size=None):
    ctx = (
        get_context(parallel)
        if dist.is_initialized()
        else ParallelContext.virtual(parallel, device=torch.device("cpu"))
    )
    ctx.seed(1234)
    model = build_model(config, ctx, seed=1234)
    if skew:  # push every token towards expert 0, so the expert bias has work to do
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "router"):
                    m.router.weight[0] += skew
    ddp, opt = wrap_for_training(model, ctx, optim, overlap_grad_reduce=overlap, bucket_size=bucket_size)
    sched = LRScheduler(optim, iters)
    data = MockGPTDataset(config.vocab_size, SEQ, seed=3)
    out = []
    for it in range(iters):
        idx = micro_batch_indices(it * gbs, gbs, mbs, ctx.dp.rank, ctx.dp.size)
        m = train_step(ddp, opt, sched, [collate([data[i] for i in ix]) for ix in idx], ctx)
        biases = [
            mod.router.expert_bias.clone()
            for mod in model.modules()
            if hasattr(mod, "router") and mod.router.expert_bias is not None
        ]
        # (the shared-expert gates, replicated across TP: a gradient left partial moves them apart from one
        # process's while barely touching the loss or the grad norm)
        gates = [
            mod.gate_weight.detach().clone() for mod in model.modules() if getattr(mod, "gate_weight", None) is not None
        ]
        out.append(
            {
                "lm_loss": m.lm_loss,
                "grad_norm": m.grad_norm,
                "aux": m.moe["aux_loss"],
                "z": m.moe["z_loss"],
                "dropped": m.moe["dropped_fraction"],
                "layers": m.moe["layers"],
                "bias": biases,
                "gates": gates,
            }
        )
    return out


def _close(a, b, what, it):
    assert abs(a - b) <= TOL * max(abs(b), 1e-8), f"iteration {it + 1}: {what} {a} vs {b}"


def _compare(history, ref):
    for it, (h, r) in enumerate(zip(history, ref)):
        for key in ("lm_loss", "grad_norm", "aux", "z"):
            _close(h[key], r[key], key, it)
        assert h["layers"].keys() == r["layers"].keys(), f"iteration {it + 1}: other MoE layers"
        for layer, st in r["layers"].items():
            got = h["layers"][layer]
            assert got["tokens_per_expert"] == st["tokens_per_expert"], f"iteration {it + 1}: tokens per expert differ"
            for key in ("aux_loss", "z_loss"):  # (each layer's, which --moe-per-layer-logging writes)
                _close(got[key], st[key], f"layer {layer} {key}", it)
        assert h["dropped"] == r["dropped"]
        assert len(h["gates"]) == len(r["gates"])
        for g, rg in zip(h["gates"], r["gates"]):
            assert rel(g, rg) <= TOL, f"iteration {it + 1}: shared-expert gate weights differ ({rel(g, rg):.2e})"


P = ParallelConfig
LAYOUTS = {
    "ep2": (2, P(expert_model_parallel_size=2)),
    "ep4": (4, P(expert_model_parallel_size=4)),
    "ep2-tp2-sp": (4, P(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)),
    "ep2-dp2": (4, P(expert_model_parallel_size=2)),  # EP=2 inside DP=4: two copies of each expert
    "pp2-ep2": (4, P(expert_model_parallel_size=2, pipeline_model_parallel_size=2)),
}


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_equals_single_process(dist, layout, dispatcher):
    world, parallel = LAYOUTS[layout]
    config = moe_config(moe_token_dispatcher_type=dispatcher)
    ref = moe_run(config, ParallelConfig(), 8, 2)
    results = dist(world, moe_run, config, parallel, 8, 2)
    for history in results:
        _compare(history, ref)
    assert ref[0]["aux"] > 0 and ref[0]["z"] > 0  # both losses are really in play


ETP1 = dict(expert_tensor_parallel_size=1, sequence_parallel=True)
ETP_LAYOUTS = {
    # expert-TP below TP (Megatron's DeepSeek-V3 and MoE functional tests use ETP=1): each expert-TP group sends its
    # slice of the sequence, whole experts (ETP=1; inside DP=2: two copies of each) or split over two ranks (ETP=2)
    "ep2-tp2-etp1-sp": (2, P(expert_model_parallel_size=2, tensor_model_parallel_size=2, **ETP1)),
    "ep2-tp2-etp1-dp2-sp": (4, P(expert_model_parallel_size=2, tensor_model_parallel_size=2, **ETP1)),
    "ep2-tp4-etp2-sp": (
        4,
        P(expert_model_parallel_size=2, tensor_model_parallel_size=4, **{**ETP1, "expert_tensor_parallel_size": 2}),
    ),
}


@pytest.mark.parametrize(
    "layout,dispatcher",
    [("ep2-tp2-etp1-sp", "alltoall"), ("ep2-tp2-etp1-sp", "allgather"), ("ep2-tp2-etp1-dp2-sp", "alltoall"),
     ("ep2-tp4-etp2-sp", "alltoall")],
)  # fmt: skip
def test_expert_tp_below_tp_equals_single_process(dist, layout, dispatcher):
    """The grad norm counts each expert on its expert-TP rank 0 (it counted them on TP rank 0 only: 1.9420 for
    1.9437 at ETP=1, TP=2)."""
    world, parallel = ETP_LAYOUTS[layout]
    config = moe_config(moe_token_dispatcher_type=dispatcher)
    ref = moe_run(config, ParallelConfig(), 8, 2, iters=3)
    for history in dist(world, moe_run, config, parallel, 8, 2, 3):
        _compare(history, ref)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_the_same_tokens_as_one_process(dist, policy):
    config = moe_config(moe_expert_capacity_factor=1.0, moe_token_drop_policy=policy)
    ref = moe_run(config, ParallelConfig(), 8, 2, iters=4, skew=0.5)
    assert ref[0]["dropped"] > 0  # the skew makes experts overflow
    for history in dist(2, moe_run, config, P(expert_model_parallel_size=2), 8, 2, 4, 0.5):
        _compare(history, ref)


def test_expert_bias_moves_load_towards_balance():
    """A deliberately skewed sigmoid router (expert 0 scores highest for every token) and the training
    step's bias update: the load evens out."""
    from megatron_lite.moe.router import TopKRouter
    from megatron_lite.moe.stats import update_expert_bias

    config = moe_config(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
    )
    router = TopKRouter(config, tp_size=1)
    gen = torch.Generator().manual_seed(0)
    shared = torch.randn(64, generator=gen)
    x = torch.randn(512, 64, generator=gen) + 2 * shared  # tokens share a common direction
    with torch.no_grad():
        router.weight.normal_(0, 0.02, generator=gen)
        router.weight[0] += shared / shared.norm()  # ... which expert 0 prefers
        router.expert_bias.zero_()
    imbalance = []
    for _ in range(100):
        counts = router(x, (512, 1)).counts.double()
        imbalance.append(float(counts.max() / counts.mean()))
        update_expert_bias(router.expert_bias, counts, rate=0.01)
    assert imbalance[0] == 2.0  # expert 0 takes every token (top-2 of 4)
    # Sign updates settle into a small oscillation around balance.
    assert max(imbalance[-10:]) <= 1.35 and sum(imbalance[-20:]) / 20 < 1.2, imbalance
    assert router.expert_bias[0] < 0 < router.expert_bias[1:].max()


def test_expert_bias_follows_the_tokens_each_expert_kept():
    """Under a capacity factor the bias update counts the tokens each expert processed, after dropping (Megatron's
    local_tokens_per_expert): capping the overloaded experts lowers the mean, which can flip an expert's update
    (counting the tokens routed before dropping moved one the other way)."""
    from megatron_lite.moe.layer import MoELayer
    from megatron_lite.moe.stats import finish_step

    config = moe_config(num_experts=8, moe_router_topk=2, moe_router_score_function="sigmoid",
                        moe_router_enable_expert_bias=True, moe_expert_capacity_factor=1.0, moe_aux_loss_coeff=0.0,
                        moe_z_loss_coeff=None, moe_router_bias_update_rate=0.01)  # fmt: skip
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    layer = MoELayer(config, ctx)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.router.weight.copy_(torch.randn(8, config.hidden_size, generator=gen))
        layer.router.expert_bias.zero_()
    x = torch.randn(32, 2, config.hidden_size, generator=gen)
    layer(x)
    routed, kept = layer.stats["counts"], layer.stats["kept"]
    capacity = -(-64 * 2 // 8)  # ceil(tokens * k / experts * 1.0)
    assert kept.max() <= capacity < routed.max() and kept.sum() == routed.sum() - layer.stats["dropped"]
    finish_step({0: layer}, config, 1, ctx)
    expected = 0.01 * torch.sign(kept.mean() - kept).float()
    assert torch.equal(layer.router.expert_bias, expected)
    assert not torch.equal(torch.sign(routed.mean() - routed), torch.sign(kept.mean() - kept))  # the case in point


def _deepseek_v3_router(norm_topk_prob=True):
    """transformers' DeepSeek-V3 router (an independent reference) and ours with the same weights and bias."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from megatron_lite.moe.router import TopKRouter

    hf_config = transformers.DeepseekV3Config(
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=norm_topk_prob,
    )
    hf = DeepseekV3TopkRouter(hf_config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(16, 32, generator=gen))
        hf.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=gen))
    config = moe_config(
        hidden_size=32,
        num_experts=16,
        moe_router_topk=4,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5,
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
    )
    ours = TopKRouter(config, tp_size=1)
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
        ours.expert_bias.copy_(hf.e_score_correction_bias)
    return hf, ours, torch.randn(64, 32, generator=gen)


def test_group_limited_routing_equals_deepseek_v3():
    """Group-limited top-k with expert bias and scaled weights selects transformers' DeepSeek-V3 experts and
    gives them its weights; and the groups matter (plain top-k of the same scores differs)."""
    hf, ours, x = _deepseek_v3_router()
    _, hf_weights, hf_indices = hf(x)
    r = ours(x, (64, 1))
    order_hf, order_ours = hf_indices.sort(-1), r.indices.sort(-1)
    assert torch.equal(order_ours.values, order_hf.values)
    theirs = hf_weights.gather(1, order_hf.indices)
    assert torch.allclose(r.probs.gather(1, order_ours.indices), theirs, rtol=1e-6, atol=1e-7)
    assert abs(float(r.probs.sum(-1).mean()) - 2.5) < 1e-5  # normalised, then scaled
    select = torch.sigmoid(x @ ours.weight.t()) + ours.expert_bias
    plain = select.topk(4, dim=-1).indices.sort(-1).values
    assert not torch.equal(plain, order_ours.values)


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_balance_losses_count_a_plain_top_k_of_the_unbiased_scores(kind):
    """With an expert bias and group-limited routing, the balance losses count each expert's tokens by a plain
    top-k of the unbiased, normalised scores (Megatron's compute_routing_scores_for_aux_loss), not by the
    routing the bias and groups chose: Megatron's switch loss, E * coeff * sum_e f_e P_e, computed here by hand."""
    from megatron_lite.moe.router import TopKRouter

    _, _, x = _deepseek_v3_router()
    config = dataclasses.replace(
        _deepseek_v3_router()[1].config, moe_aux_loss_coeff=0.01, moe_router_load_balancing_type=kind
    )
    router = TopKRouter(config, tp_size=1)
    with torch.no_grad():
        router.weight.copy_(_deepseek_v3_router()[1].weight)
        router.expert_bias.copy_(3.0 * torch.arange(16.0) / 16)  # strong enough to change the routing
    s, b = (64, 1) if kind == "aux_loss" else (16, 4)
    r = router(x, (s, b))
    scores = torch.sigmoid(x @ router.weight.t())
    scores = scores / scores.sum(-1, keepdim=True)
    plain = scores.topk(4, dim=-1).indices
    assert not torch.equal(plain.sort(-1).values, r.indices.sort(-1).values)  # the bias did change the routing
    one_hot = torch.zeros(64, 16).scatter(1, plain, 1.0)
    if kind == "aux_loss":
        expected = 0.01 * 16 * (one_hot.sum(0) / (64 * 4) * scores.sum(0) / 64).sum()
    else:  # per sequence j (tokens i * b + j), then the mean over sequences
        f = one_hot.view(s, b, 16).sum(0) / (s * 4)
        expected = (0.01 * 16 * (f * scores.view(s, b, 16).sum(0) / s).sum(-1)).mean()
    assert float(r.aux_loss) == pytest.approx(float(expected), rel=1e-5)


def test_capacity_ranks_by_probability_beyond_fp32_resolution_near_one():
    """The probs drop policy keeps each expert's most probable tokens even when the probabilities are tiny (ranked
    as probs + 1 in fp32, 1e-14 and 1e-37 both rounded to 1.0 and tied)."""
    from megatron_lite.moe.router import TopKRouter

    config = moe_config(num_experts=2, moe_router_topk=1, moe_expert_capacity_factor=0.5, moe_aux_loss_coeff=0.0,
                        moe_z_loss_coeff=None)  # fmt: skip
    router = TopKRouter(config, tp_size=1)
    for tiny, small in ((0, 1), (1, 0)):  # either order (how topk breaks ties is not ours to rely on)
        probs = torch.tensor([[0.0], [0.0], [0.9], [0.8]])
        probs[tiny], probs[small] = 1e-37, 1e-14
        indices = torch.tensor([[0], [0], [1], [1]])
        keep = router._capacity_keep(probs, indices, 4)  # capacity ceil(4 * 1 / 2 * 0.5) = 1 per expert
        assert keep[small] and not keep[tiny] and keep.view(-1)[2:].tolist() == [True, False], (tiny, keep)


def test_an_fp64_router_ranks_capacity_in_fp64():
    """--moe-router-dtype fp64 with the probs drop policy: two probabilities 1e-12 apart (tied in fp32) keep the
    larger; the ranking cast them to fp32 (a review of the router)."""
    from megatron_lite.moe.router import TopKRouter

    config = moe_config(num_experts=2, moe_router_topk=1, moe_expert_capacity_factor=0.5, moe_aux_loss_coeff=0.0,
                        moe_z_loss_coeff=None, moe_router_dtype="fp64")  # fmt: skip
    router = TopKRouter(config, tp_size=1)
    for low, high in ((0, 1), (1, 0)):
        probs = torch.tensor([[0.0], [0.0], [0.9], [0.8]], dtype=torch.float64)
        probs[low], probs[high] = 0.5, 0.5 + 1e-12
        keep = router._capacity_keep(probs, torch.tensor([[0], [0], [1], [1]]), 4)
        assert keep[high] and not keep[low], (low, keep)


def test_fp64_router_routes_in_fp64():
    """--moe-router-dtype fp64: the routing matches a float64 computation of it (to fp64 precision before the
    final cast), where the fp32 router is only fp32-close; the probabilities handed to the experts are fp32."""
    from megatron_lite.moe.router import TopKRouter

    config = moe_config(hidden_size=64, num_experts=8, moe_router_topk=2, moe_router_pre_softmax=True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(128, 64, generator=gen)
    routers = {}
    for dtype in ("fp32", "fp64"):
        routers[dtype] = TopKRouter(dataclasses.replace(config, moe_router_dtype=dtype), tp_size=1)
        with torch.no_grad():
            routers[dtype].weight.copy_(torch.randn(8, 64, generator=torch.Generator().manual_seed(1)))
    exact = torch.softmax(x.double() @ routers["fp64"].weight.double().t(), dim=-1).topk(2, dim=-1).values
    r64, r32 = routers["fp64"](x, (128, 1)), routers["fp32"](x, (128, 1))
    assert r64.probs.dtype == torch.float32
    assert torch.equal(r64.probs, exact.float())  # rounded once, from the fp64 result
    assert not torch.equal(r32.probs, exact.float())  # fp32 arithmetic differs in the last bits


def test_expert_bias_is_identical_on_every_replica(dist):
    """At EP=2 x DP=2 the bias, updated from token counts over the whole data-parallel domain, is the
    same on every rank and equal to the one-process run's after each step."""
    config = moe_config(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.01,
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
    )
    ref = moe_run(config, ParallelConfig(), 8, 2, iters=6)
    assert any(b.abs().sum() > 0 for b in ref[-1]["bias"])
    for history in dist(4, moe_run, config, P(expert_model_parallel_size=2), 8, 2, 6):
        for it, (h, r) in enumerate(zip(history, ref)):
            _compare([h], [r])
            for b, rb in zip(h["bias"], r["bias"]):
                assert torch.equal(b, rb), f"iteration {it + 1}: expert bias differs from one process"


GPT_OSS_MLP = dict(
    activation="quick_geglu", glu_linear_offset=1.0, activation_func_clamp_value=7.0, add_bias_linear=True
)
VARIANTS = {
    "seq-aux-pre-softmax": (
        2,
        P(expert_model_parallel_size=2),
        dict(moe_router_load_balancing_type="seq_aux_loss", moe_router_pre_softmax=True),
    ),
    "shared-expert-pattern-sigmoid-tp2-sp": (
        4,
        P(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True),
        dict(moe_shared_expert_intermediate_size=32, moe_layer_freq=(0, 1), moe_router_score_function="sigmoid"),
    ),
    # Qwen2-MoE's gated shared expert (--moe-shared-expert-gate): the gate reads each rank's sequence shard, so its
    # gradient is summed over TP
    "shared-expert-gate-tp2-sp": (
        2,
        P(tensor_model_parallel_size=2, sequence_parallel=True),
        dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True, moe_router_pre_softmax=True),
    ),
    # DeepSeek-V3's router: sigmoid, expert bias, group-limited top-k, scaled weights; groups span EP ranks
    "deepseek-v3-router-ep2": (
        2,
        P(expert_model_parallel_size=2),
        dict(
            num_experts=8,
            moe_router_topk=4,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_num_groups=4,
            moe_router_group_topk=2,
            moe_router_topk_scaling_factor=2.5,
        ),
    ),
    "fp64-router-ep2-tp2": (
        4,
        P(expert_model_parallel_size=2, tensor_model_parallel_size=2),
        dict(moe_router_dtype="fp64"),
    ),
    # Context parallelism: each CP rank routes its zigzag part of the sequences; the auxiliary and z losses are
    # its shares of the whole sequences' losses (expert counts summed over CP), adding up over CP.
    "cp2": (2, P(context_parallel_size=2), {}),
    "cp2-ep2-seq-aux": (
        4,
        P(context_parallel_size=2, expert_model_parallel_size=2),
        dict(moe_router_load_balancing_type="seq_aux_loss"),
    ),
    "tp2-sp-cp2-expert-bias": (
        4,
        P(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2),
        dict(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_shared_expert_intermediate_size=32,
        ),
    ),  # fmt: skip
    # gpt-oss's MLP: biases on every linear (the router's, each expert's fc1 and fc2, added once over expert-TP),
    # quick-GEGLU with its offset and clamp; a dense layer first, its MLP split over TP
    "gpt-oss-mlp-ep2-tp2-sp": (
        4,
        P(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True),
        dict(GPT_OSS_MLP, moe_layer_freq=(0, 1)),
    ),  # fmt: skip
    # ... at expert-TP 2 under TP 4: fc2's bias, whole on each expert-TP rank 0, is summed over expert-TP (over TP
    # it added the other expert-TP group's slice, which the expert-DP reduction adds as well: start-up refused it)
    "gpt-oss-mlp-ep2-tp4-etp2-sp": (4, ETP_LAYOUTS["ep2-tp4-etp2-sp"][1], GPT_OSS_MLP),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moe_variants_equal_single_process(dist, variant):
    world, parallel, kw = VARIANTS[variant]
    config = moe_config(**kw)
    ref = moe_run(config, ParallelConfig(), 8, 2, iters=5)
    for history in dist(world, moe_run, config, parallel, 8, 2, 5):
        _compare(history, ref)
    if "moe_layer_freq" in kw:
        assert list(ref[0]["layers"]) == [1]  # only layer 1 is MoE


def test_moe_losses_are_logged_as_megatron_logs_them():
    """Megatron's load_balancing_loss and z_loss: each MoE layer's loss before its coefficient, the mean over the
    MoE layers and micro-batches (MoEAuxLossAutoScaler's tracker). They were logged times the coefficient and
    summed over the layers (about 0.04 for 1.0 on four balanced layers at --moe-aux-loss-coeff 1e-2)."""
    from megatron_lite.moe.router import TopKRouter

    config = moe_config(num_layers=3, moe_layer_freq=(1, 0, 1))
    ctx = ParallelContext.virtual(P(), device=torch.device("cpu"))
    ctx.seed(1)
    model = build_model(config, ctx, seed=1)
    seen = []
    for m in model.modules():
        if isinstance(m, TopKRouter):
            m.register_forward_hook(lambda mod, args, out: seen.append((float(out.aux_loss), float(out.z_loss))))
    ddp, opt = wrap_for_training(model, ctx, OPTIM)
    data = MockGPTDataset(config.vocab_size, SEQ, seed=3)
    batches = [collate([data[0], data[1]]), collate([data[2], data[3]])]  # two micro-batches
    moe = train_step(ddp, opt, LRScheduler(OPTIM, 10), batches, ctx).moe
    assert len(seen) == 4  # two MoE layers, two micro-batches
    aux = sum(a for a, _ in seen) / len(seen) / config.moe_aux_loss_coeff
    z = sum(z for _, z in seen) / len(seen) / config.moe_z_loss_coeff
    assert moe["aux_loss"] == pytest.approx(aux, rel=1e-6) and 0.5 < aux < 4
    assert moe["z_loss"] == pytest.approx(z, rel=1e-6)


def test_moe_under_virtual_pipeline_stages_equals_single_process(dist):
    """From the pipeline review: interleaved 1F1B with EP, capacity dropping and the expert bias (the only pipelined
    MoE case was pp2-ep2, one layer a stage)."""
    config = moe_config(
        num_layers=4,
        moe_expert_capacity_factor=1.0,
        moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid",
    )
    parallel = P(expert_model_parallel_size=2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    ref = moe_run(config, ParallelConfig(), 8, 2, iters=4, skew=0.5)
    assert ref[0]["dropped"] > 0 and ref[0]["aux"] > 0
    for history in dist(4, moe_run, config, parallel, 8, 2, 4, 0.5):
        _compare(history, ref)  # (each layer's tokens per expert, which the expert bias steers, included)


def test_training_gradients_are_those_of_the_documented_objective(monkeypatch):
    """An independent check of the scales (the layout tests compare the code with itself at PP=1): train_step's
    gradients equal autograd's of the objective written out, sum(token losses) / N + (aux + z) summed over the
    MoE layers and averaged over the micro-batches + (f / D) sum_k sum(depth k's token losses) / N_k, with
    micro-batches of unequal token counts, MoE layers in the decoder and in two MTP depths (from the pipeline
    review)."""
    import megatron_lite.models.mtp as mtp_module
    import megatron_lite.moe.layer as moe_layer
    from megatron_lite.models.mtp import mtp_inputs
    from megatron_lite.moe.router import TopKRouter
    from megatron_lite.tensor_parallel.cross_entropy import counted_labels

    config = moe_config(moe_aux_loss_coeff=1.0, moe_z_loss_coeff=0.1, mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    data = MockGPTDataset(config.vocab_size, SEQ, seed=3)
    mbs = [collate([data[2 * i], data[2 * i + 1]]) for i in range(3)]
    mbs[1]["loss_mask"][:, :5] = 0

    def build():
        ctx.seed(1234)
        return build_model(config, ctx, seed=1234)

    model = build()
    ddp, opt = wrap_for_training(model, ctx, dataclasses.replace(OPTIM, clip_grad=0.0))
    train_step(ddp, opt, LRScheduler(OPTIM, 3), [dict(m) for m in mbs], ctx)
    got = {n: ddp.main_grad(p).clone() for n, p in model.named_parameters()}

    # the same model, its losses no longer attached to the backward by the library but added up here
    depth_sums = []
    monkeypatch.setattr(mtp_module, "attach_loss", lambda main, loss_sum, scale: depth_sums.append(loss_sum) or main)
    monkeypatch.setattr(moe_layer, "attach_loss", lambda y, loss, scale: y)
    reference = build()
    router_losses = []
    for m in reference.modules():
        if isinstance(m, TopKRouter):
            m.register_forward_hook(lambda mod, args, out: router_losses.append(out.aux_loss + out.z_loss))
    depths = config.mtp_num_layers
    full = [mtp_inputs(m, depths) for m in mbs]
    n = sum(float(m["loss_mask"].sum()) for m in full)
    n_k = [sum(float(m["mtp_loss_mask"][:, k].sum()) for m in full) for k in range(depths)]
    objective = 0.0
    for m in full:
        out = reference[0](m["tokens"], None, labels=counted_labels(m["labels"], m["loss_mask"]),
                           mtp={k: v for k, v in m.items() if k.startswith("mtp_")})  # fmt: skip
        objective = objective + (out.float() * m["loss_mask"]).sum() / n
    weight = config.mtp_loss_scaling_factor / depths
    objective = objective + sum(weight * t / n_k[i % depths] for i, t in enumerate(depth_sums))
    objective = objective + sum(router_losses) / len(mbs)
    assert len(router_losses) == len(mbs) * 4 and len(depth_sums) == len(mbs) * depths  # 2 decoder + 2 MTP routers
    objective.backward()
    for name, p in reference.named_parameters():
        assert rel(got[name], p.grad) < 1e-5, (name, rel(got[name], p.grad))


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_the_statistics_add_no_host_sync(monkeypatch, dispatcher):
    """From the pipeline review: each MoE layer copied its statistics to the host after every micro-batch (five
    reads of device values), so on a GPU the next layer could not be queued before this one's experts finished.
    They now add up on the device: a training forward reads no more device values than one that records nothing
    (the dispatch's own reads of the expert counts aside), and the step's statistics are unchanged."""
    from host_reads import HostReads

    import megatron_lite.tensor_parallel.random as tp_random

    config = moe_config(moe_token_dispatcher_type=dispatcher, moe_expert_capacity_factor=1.0)
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    ctx.seed(0)
    layer = next(m for m in build_model(config, ctx, seed=1).modules() if hasattr(m, "router")).train()
    x = torch.randn(SEQ, 2, config.hidden_size)
    reads = []
    for recomputing in (True, False):  # (a recomputed forward records nothing)
        monkeypatch.setattr(tp_random, "_RECOMPUTING", [int(recomputing)])
        with HostReads() as meter:
            layer(x)
        reads.append(meter.reads)
    assert reads[1] == reads[0], reads
    st = layer.stats
    assert st["counts"].sum() == st["routed"] == SEQ * 2 * config.moe_router_topk and st["aux_loss"] > 0
    assert st["kept"].sum() == st["routed"] - st["dropped"]
