"""The distributed optimizer (--use-distributed-optimizer, ZeRO-1): training equals one process per iteration
(lm_loss, grad_norm within 1e-4) at DP=2 and 4, with TP=2, PP=2 with virtual stages, EP=2 and gradient
accumulation, and CP=2; optimizer-state bytes per rank fall to 1/DP; its checkpoints load without it, and back."""

from __future__ import annotations

import dataclasses

import pytest
from test_train_equivalence import _compare, train_run

from megatron_lite.config import ParallelConfig

from dist_pool import get_context

P = ParallelConfig

LAYOUTS = {
    "dp2": (2, P(), 4, 2, 2),
    "dp4": (4, P(), 8, 2, 2),
    "dp2-accumulate": (2, P(), 8, 1, 2),
    "tp2-sp-dp2": (4, P(tensor_model_parallel_size=2, sequence_parallel=True), 4, 1, 2),
    "pp2-vp2-dp2": (8, P(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), 8, 1, 4),
    "cp2-dp2": (4, P(context_parallel_size=2), 4, 1, 2),  # state sharded over DP x CP
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_distributed_optimizer_equals_single_process(dist, layout):
    world, parallel, gbs, mbs, layers = LAYOUTS[layout]
    ref = train_run("llama", P(), gbs, gbs, layers=layers)
    for history in dist(world, train_run, "llama", parallel, gbs, mbs, layers=layers, distributed_optimizer=True):
        _compare(history, ref)


def test_distributed_optimizer_with_experts(dist):
    """EP=2 inside DP=4: dense state sharded over DP=4, expert state over the expert-data-parallel group; ZeRO-1,
    with --overlap-param-gather, and ZeRO-2."""
    from test_moe import ITERS, OPTIM, moe_config, moe_run
    from test_moe import _compare as moe_compare

    config = moe_config()
    ref = moe_run(config, P(), 8, 2)
    zero1 = dataclasses.replace(OPTIM, use_distributed_optimizer=True)
    for history in dist(4, moe_run, config, P(expert_model_parallel_size=2), 8, 2, optim=zero1, bucket_size=3000):
        moe_compare(history, ref)
    # --overlap-param-gather: expert weights are read by the MoE layer, never by their own modules.
    overlapped = dataclasses.replace(zero1, overlap_param_gather=True)
    for history in dist(4, moe_run, config, P(expert_model_parallel_size=2), 8, 2, ITERS, 0.0, overlapped, True, 3000):
        moe_compare(history, ref)
    # ZeRO-2 with overlapped reduce-scatters: expert buckets freed over the expert-data-parallel group (2 ranks),
    # dense ones over DP=4
    zero2 = dataclasses.replace(zero1, zero_stage=2)
    for history in dist(4, moe_run, config, P(expert_model_parallel_size=2), 8, 2, ITERS, 0.0, zero2, True, 3000):
        moe_compare(history, ref)


def one_zero_step(zero_stage: int, overlap: bool = True) -> tuple[int, int, int, int]:
    """On this rank after one step with the distributed optimizer (2000-element buckets): optimizer-state
    bytes, persistent gradient bytes, the peak of transient full-bucket gradient bytes, and the bytes of the
    two largest buckets."""
    import torch
    import torch.distributed as dist
    from test_train_equivalence import OPTIM

    from megatron_lite.data.mock import MockGPTDataset, collate
    from megatron_lite.data.samplers import micro_batch_indices
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.optimizer.lr_scheduler import LRScheduler
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.training.step import train_step
    from megatron_lite.training.wrap import wrap_for_training

    from models import llama_config

    ctx = get_context(P()) if dist.is_initialized() else ParallelContext.virtual(P(), device=torch.device("cpu"))
    model = build_model(llama_config(num_layers=2), ctx, seed=1)
    optim = dataclasses.replace(OPTIM, use_distributed_optimizer=True, zero_stage=zero_stage)
    ddp, opt = wrap_for_training(model, ctx, optim, overlap_grad_reduce=overlap, bucket_size=2000)
    data = MockGPTDataset(250, 16, seed=1)
    idx = micro_batch_indices(0, 8, 2, ctx.dp.rank, ctx.dp.size)
    train_step(ddp, opt, LRScheduler(OPTIM, 10), [collate([data[i] for i in ix]) for ix in idx], ctx)
    two = sum(sorted((b.hi - b.lo) * 4 for buffer in ddp.buffers for b in buffer.buckets)[-2:])
    return opt.state_bytes(), ddp.grad_bytes(), max(b.peak_transient for b in ddp.buffers), two


def test_zero_stage_2_holds_one_bucket_whole_without_overlap_too():
    """Without --overlap-grad-reduce ZeRO-2 still reduces bucket by bucket: only the bucket being produced
    exists whole (one bucket per buffer had held every gradient at once: ZeRO-1's peak)."""
    whole = one_zero_step(1, overlap=False)[1]  # stage 1 on one rank keeps the whole buffer
    peak = one_zero_step(2, overlap=False)[2]
    assert peak == one_zero_step(2)[2] and peak < whole / 4, (peak, whole)


def test_optimizer_state_per_rank_falls_to_a_quarter_at_dp4(dist):
    """... of plain Adam's two fp32 moments a parameter: an fp32 weight's main part is a view of it (from a review:
    a copy of it had kept 12 bytes a parameter at DP 1, 1.5x plain Adam's, and 3/4 of plain Adam's at DP 2)."""
    import torch

    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    from models import llama_config

    ctx = ParallelContext.virtual(P(), device=torch.device("cpu"))
    adam = 8 * sum(p.numel() for p in build_model(llama_config(num_layers=2), ctx, seed=1).parameters())
    one = one_zero_step(1)[0]
    assert abs(one - adam) <= 0.01 * adam, (one, adam)
    per_rank = [r[0] for r in dist(4, one_zero_step, 1)]
    for b in per_rank:
        assert abs(b - one / 4) <= 0.05 * one / 4, (b, one)
    assert sum(per_rank) >= one  # nothing is lost: the parts cover every parameter (plus padding)


def test_an_fp32_weight_of_a_bf16_model_keeps_its_small_updates():
    """(From a review: with the fp32 main part a view of an fp32 weight, --bf16's learnable softmax offsets, fp32
    weights in a bucket gathered in bf16, were rounded back to bf16 at every gather and never moved: Adam's ~1e-4
    steps are below bf16's resolution at 1.0.) 60 steps of a constant gradient move them as the plain optimizer
    does, to the same fp32 values: DDP keeps them in a buffer of their own dtype, gathered in fp32 (they had
    shared a bucket with bf16 weights, so the forward read their bf16 rounding), and their main part is the
    weight itself (no fp32 copy in the optimizer's bytes)."""
    import torch

    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.optimizer.config import OptimizerConfig
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.training.wrap import wrap_for_training

    from models import CONFIGS

    def offsets_after(dist_opt: bool) -> torch.Tensor:
        ctx = ParallelContext.virtual(P(), device=torch.device("cpu"))
        model = build_model(CONFIGS["sinks-full"](), ctx, seed=1, dtype=torch.bfloat16)
        (off,) = [
            p
            for n, p in model.named_parameters()
            if n.endswith("layers.0.self_attention.core_attention.softmax_offset")
        ]
        assert off.dtype == torch.float32
        with torch.no_grad():
            off.fill_(1.0)
        cfg = OptimizerConfig(lr=1e-4, bf16=True, use_distributed_optimizer=dist_opt, clip_grad=0.0, weight_decay=0.0)
        ddp, opt = wrap_for_training(model, ctx, cfg)
        for _ in range(60):
            for p in model.parameters():
                ddp.main_grad(p).fill_(1.0)
            opt.step(1e-4)
        if dist_opt:
            (shard,) = [s for s in opt.shards if s.p is off]
            assert shard.aliased and all(
                p.dtype == torch.float32 for p in ddp.buffer_of[id(off)].bucket_of[id(off)].params
            )
        return off.detach().clone()

    plain, sharded = offsets_after(False), offsets_after(True)
    assert (plain < 0.995).all(), plain
    assert torch.equal(plain, sharded), (plain - sharded).abs().max()


TIED = {
    "zero1": dict(),
    "zero1-overlap": dict(overlap=True, bucket_size=20_000),
    "zero2": dict(zero_stage=2),
    "zero2-overlap-vp2": dict(zero_stage=2, overlap=True, bucket_size=20_000, vp=2),
    "zero1-overlap-vp2": dict(overlap=True, bucket_size=20_000, vp=2),
    # and the updated weights' all-gathers waited on module by module in the next forward, chunk by chunk
    "zero1-overlap-vp2-param-gather": dict(overlap=True, bucket_size=20_000, vp=2, overlap_param_gather=True),
    "zero2-overlap-param-gather": dict(zero_stage=2, overlap=True, bucket_size=20_000, overlap_param_gather=True),
}


@pytest.mark.parametrize("case", list(TIED))
def test_distributed_optimizer_with_tied_embeddings_across_stages(dist, case):
    """GPT-2 (tied embeddings) at PP=2 x DP=2: the first stage's embedding and the last stage's copy sit at
    different places in their stages' buffers, so their gradients are summed before the reduce-scatter, also
    when the other buckets are reduced under the backward (--overlap-grad-reduce) or every micro-batch
    (ZeRO-2)."""
    kw = dict(TIED[case])
    parallel = P(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=kw.pop("vp", None))
    ref = train_run("gpt2", P(), 8, 8, layers=4)
    for history in dist(4, train_run, "gpt2", parallel, 8, 2, layers=4, distributed_optimizer=True, **kw):
        _compare(history, ref)


def tied_nan_report(distributed_optimizer: bool, zero_stage: int, overlap: bool):
    """GPT-2 at PP2 x DP2 with a NaN put into the last stage's tied copy on one rank: what each rank's NaN
    check names as the first non-finite local gradient."""
    import torch
    from test_train_equivalence import CONFIGS, OPTIM, _dataset

    from megatron_lite.data.mock import collate
    from megatron_lite.data.samplers import micro_batch_indices
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.optimizer.lr_scheduler import LRScheduler
    from megatron_lite.training.step import train_step
    from megatron_lite.training.wrap import wrap_for_training

    ctx = get_context(P(pipeline_model_parallel_size=2))
    config = CONFIGS["gpt2"](num_layers=4)
    model = build_model(config, ctx, seed=1234)
    flags = dict(use_distributed_optimizer=distributed_optimizer, zero_stage=zero_stage)
    optim = dataclasses.replace(OPTIM, check_for_nan_in_loss_and_grad=True, **flags)
    bucket = 20_000 if overlap else None
    ddp, opt = wrap_for_training(model, ctx, optim, overlap_grad_reduce=overlap, bucket_size=bucket)
    if ctx.pp.rank == 1 and ctx.dp.rank == 0:
        for name, p in model.named_parameters():
            if name.endswith("output_layer.weight"):
                p.register_hook(lambda g: torch.full_like(g, float("nan")))
    data = _dataset("mock", config.vocab_size)
    idx = micro_batch_indices(0, 8, 2, ctx.dp.rank, ctx.dp.size)
    train_step(ddp, opt, LRScheduler(optim, 3), [collate([data[i] for i in ix]) for ix in idx], ctx)
    return (ctx.pp.rank, ctx.dp.rank), ddp.first_nonfinite_param()


@pytest.mark.parametrize(
    "distributed_optimizer,zero_stage,overlap", [(False, 1, True), (True, 1, False), (True, 1, True), (True, 2, False)]
)
def test_nan_in_the_tied_copy_is_reported_by_its_own_rank_only(dist, distributed_optimizer, zero_stage, overlap):
    """The tied gradient is checked before the first and last stage sum it, so the first stage's ranks, whose
    own gradients are finite, do not report the other stage's NaN."""
    reports = dict(dist(4, tied_nan_report, distributed_optimizer, zero_stage, overlap))
    assert reports == {(0, 0): None, (0, 1): None, (1, 0): "embedding.word_embeddings.weight", (1, 1): None}


@pytest.mark.parametrize(
    "world,name,parallel,mtp",
    [(2, "llama", P(), 0), (4, "llama", P(), 0), (2, "nemotron", P(pipeline_model_parallel_size=2), 1)],
    ids=["dp2", "dp4", "tied-mtp-pp2"],
)
def test_overlap_param_gather_equals_single_process(dist, world, name, parallel, mtp):
    """--overlap-param-gather: the weights' all-gathers are waited on module by module in the next forward. With
    tied embeddings, MTP and PP=2 the last stage's output layer multiplies by its embedding copy, waited for
    only when MTP embedded its inputs: the loss read last step's weight (an in-place error in the backward)."""
    ref = train_run(name, P(), 8, 8, mtp=mtp)
    kw = dict(distributed_optimizer=True, overlap_param_gather=True, bucket_size=3000, overlap=True, mtp=mtp)
    for history in dist(world, train_run, name, parallel, 8, 2, **kw):
        _compare([h[:3] for h in history], [h[:3] for h in ref])


ZERO2 = {
    "dp2": (2, P(), 4, 2, None),
    "dp4-accumulate-buckets": (4, P(), 8, 1, 2000),
    "tp2-sp-dp2": (4, P(tensor_model_parallel_size=2, sequence_parallel=True), 4, 1, 3000),
    "cp2-dp2-buckets": (4, P(context_parallel_size=2), 4, 1, 2000),
    # buckets without --overlap-grad-reduce: each reduced, blocking, once its gradients are in
    "dp2-buckets-no-overlap": (2, P(), 4, 1, 2000),
}


@pytest.mark.parametrize("layout", list(ZERO2))
def test_zero_stage_2_equals_single_process(dist, layout):
    world, parallel, gbs, mbs, bucket = ZERO2[layout]
    ref = train_run("llama", P(), gbs, gbs)
    overlap = bucket is not None and not layout.endswith("no-overlap")
    kw = dict(distributed_optimizer=True, zero_stage=2, bucket_size=bucket, overlap=overlap)
    for history in dist(world, train_run, "llama", parallel, gbs, mbs, **kw):
        _compare(history, ref)


def zero2_reduce_scatters(overlap: bool) -> list[bool]:
    """One ZeRO-2 step at DP=2: whether each gradient reduce-scatter was launched asynchronously."""
    from megatron_lite.distributed import ddp

    calls, real = [], ddp.reduce_scatter_tensor

    def counted(*args, **kwargs):
        calls.append(bool(kwargs.get("async_op")))
        return real(*args, **kwargs)

    ddp.reduce_scatter_tensor = counted
    try:
        one_zero_step(2, overlap=overlap)
    finally:
        ddp.reduce_scatter_tensor = real
    return calls


def test_zero_stage_2_overlaps_its_reduce_scatters_with_the_backward(dist):
    """From a review: ZeRO-2 reduce-scattered every bucket blocking, --overlap-grad-reduce or not, so all of it
    was exposed. With the flag the buckets' reduce-scatters are launched under the backward (the equivalence
    tests above hold with them) and landed in launch order; without it they block."""
    for overlapped, blocking in zip(dist(2, zero2_reduce_scatters, True), dist(2, zero2_reduce_scatters, False)):
        assert len(overlapped) >= 4 and all(overlapped), overlapped
        assert blocking and not any(blocking), blocking


def test_zero_stage_2_gradient_bytes_per_rank_fall_to_a_quarter(dist):
    import torch

    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    from models import llama_config

    model = build_model(llama_config(num_layers=2), ParallelContext.virtual(P(), device=torch.device("cpu")))
    params = sum(p.numel() for p in model.parameters()) * 4  # one fp32 gradient per parameter
    full = one_zero_step(1)[1]  # stage 1 on one rank keeps the whole buffer
    assert full >= params
    for _, persistent, transient, two_buckets in dist(4, one_zero_step, 2):
        assert abs(persistent - params / 4) <= 0.10 * params / 4, (persistent, params)
        # the full gradient exists two buckets at a time at most (one reduce-scattered under the next one's
        # backward, --overlap-grad-reduce), never whole
        assert transient <= two_buckets < params / 2, (transient, two_buckets, params)


def test_fsdp2_with_data_parallel_size_one(dist):
    """TP=2 x DP=1 under FSDP2: singleton data-parallel groups created alike on every rank."""
    ref = train_run("llama", P(), 4, 4)
    for history in dist(2, train_run, "llama", P(tensor_model_parallel_size=2), 4, 4, fsdp2=True):
        _compare(history, ref)


FSDP2 = {  # world, layout, global batch, micro-batch, model, layers
    "dp2": (2, P(), 4, 2, "llama", 2),
    "tp2-sp-dp2": (4, P(tensor_model_parallel_size=2, sequence_parallel=True), 4, 1, "llama", 2),
    "pp2-dp2": (4, P(pipeline_model_parallel_size=2), 8, 1, "llama", 2),
    "pp2-vp2-dp2": (4, P(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), 8, 1, "llama", 4),
    "pp2-dp2-tied": (4, P(pipeline_model_parallel_size=2), 8, 2, "gpt2", 4),  # the two copies' shards summed
    "cp2-dp2": (4, P(context_parallel_size=2), 4, 1, "llama", 2),  # parameters sharded over DP x CP
    # DeepSeek-shaped: the aux-loss-free expert bias, left out of the sharding, updated alike on every rank
    "dp2-deepseek": (2, P(), 4, 2, "deepseek", 2),
}


@pytest.mark.parametrize("layout", list(FSDP2))
def test_fsdp2_equals_single_process(dist, layout):
    world, parallel, gbs, mbs, name, layers = FSDP2[layout]
    ref = train_run(name, P(), gbs, gbs, layers=layers)
    for history in dist(world, train_run, name, parallel, gbs, mbs, fsdp2=True, layers=layers):
        _compare(history, ref)


@pytest.mark.parametrize("overlap_dispatch", [False, True])
def test_fsdp2_with_experts(dist, overlap_dispatch):
    """EP=2 inside DP=4 under FSDP2: dense parameters sharded over DP=4, each rank's experts over the ranks
    holding the same experts (expert-data-parallel, 2); also with the chunked, overlapped all-to-all, which
    calls the experts once per chunk."""
    from test_moe import OPTIM, moe_config, moe_run
    from test_moe import _compare as moe_compare

    config = moe_config()
    ref = moe_run(config, P(), 8, 2)
    fsdp2 = dataclasses.replace(OPTIM, use_torch_fsdp2=True)
    parallel = P(expert_model_parallel_size=2, overlap_moe_expert_parallel_comm=overlap_dispatch)
    for history in dist(4, moe_run, config, parallel, 8, 2, optim=fsdp2):
        moe_compare(history, ref)


def fsdp2_bf16_losses(pp: int) -> list[float]:
    """Three steps of FSDP2 computing in bf16 (fp32 sharded weights) on two ranks: PP=2 or DP=2."""
    import torch
    from test_train_equivalence import CONFIGS, OPTIM, _dataset

    from megatron_lite.data.mock import collate
    from megatron_lite.data.samplers import micro_batch_indices
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.optimizer.lr_scheduler import LRScheduler
    from megatron_lite.training.step import train_step
    from megatron_lite.training.wrap import wrap_for_training

    ctx = get_context(P(pipeline_model_parallel_size=pp))
    config = CONFIGS["llama"](num_layers=2)
    model = build_model(config, ctx, seed=1234)
    optim = dataclasses.replace(OPTIM, use_torch_fsdp2=True, bf16=True)
    ddp, opt = wrap_for_training(model, ctx, optim, compute_dtype=torch.bfloat16)
    data, sched, losses = _dataset("mock", config.vocab_size), LRScheduler(optim, 3), []
    for it in range(3):
        idx = micro_batch_indices(it * 4, 4, 1, ctx.dp.rank, ctx.dp.size)
        losses.append(train_step(ddp, opt, sched, [collate([data[i] for i in ix]) for ix in idx], ctx).lm_loss)
    return losses


def test_fsdp2_bf16_under_pipelining_sends_what_it_computes(dist):
    """Activations travel between stages in the compute dtype (bf16), not the fp32 of FSDP2's parameters:
    PP=2 repeats itself exactly and agrees with DP=2."""
    pp2 = dist(2, fsdp2_bf16_losses, 2)[0]
    assert dist(2, fsdp2_bf16_losses, 2)[0] == pp2
    dp2 = dist(2, fsdp2_bf16_losses, 1)[0]
    assert abs(pp2[0] - dp2[0]) <= 1e-5 * dp2[0], (pp2, dp2)  # the same first forward
    for a, b in zip(pp2, dp2):
        assert abs(a - b) <= 1e-2 * b, (pp2, dp2)


def fsdp2_bf16_router_bias() -> list:
    """The expert bias each router adds in its forward under FSDP2 computing in bf16."""
    import torch

    from megatron_lite.distributed.fsdp import FSDP2Model
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.moe.router import TopKRouter

    from models import llama_config

    ctx = get_context(P())
    config = llama_config(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_router_score_function="sigmoid",
                          moe_router_enable_expert_bias=True)  # fmt: skip
    model = build_model(config, ctx, seed=1)
    seen = []
    for m in model.modules():
        if isinstance(m, TopKRouter):
            with torch.no_grad():
                m.expert_bias.copy_(torch.tensor([0.5, 0.501, 0.502, 0.503]))
            m.register_forward_pre_hook(lambda mod, _: seen.append(mod.expert_bias.detach().clone()))
    wrapped = FSDP2Model(model, ctx, torch.bfloat16)
    tokens = torch.randint(0, config.vocab_size, (1, 8))
    wrapped(tokens, labels=tokens).sum().backward()
    return [(t.dtype, t.tolist()) for t in seen]


def test_fsdp2_in_bf16_routes_with_the_fp32_expert_bias(dist):
    """Megatron keeps the expert bias fp32 whatever the model computes in: its updates (1e-3) are below bf16's
    resolution at 0.5, where FSDP2's bf16 copy rounded 0.501 to 0.5 and 0.503 to 0.50390625."""
    import torch

    for seen in dist(2, fsdp2_bf16_router_bias):
        assert seen and all(t == (torch.float32, torch.tensor([0.5, 0.501, 0.502, 0.503]).tolist()) for t in seen)


def fsdp2_param_bytes() -> int:
    import torch.distributed as dist

    from megatron_lite.distributed.fsdp import FSDP2Model
    from megatron_lite.models.gpt_model import build_model

    from models import llama_config

    ctx = get_context(P())
    model = FSDP2Model(build_model(llama_config(num_layers=2), ctx, seed=1), ctx, None)
    local = sum(p.to_local().numel() * 4 for p in model.module.parameters())
    dist.barrier()
    return local


def test_fsdp2_parameter_bytes_per_rank_fall_to_a_quarter(dist):
    import torch

    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    from models import llama_config

    full = sum(
        p.numel() * 4
        for p in build_model(
            llama_config(num_layers=2), ParallelContext.virtual(P(), device=torch.device("cpu"))
        ).parameters()
    )
    for local in dist(4, fsdp2_param_bytes):
        assert abs(local - full / 4) <= 0.10 * full / 4, (local, full)


def fsdp2_view_warnings() -> list[str]:
    import warnings

    import torch

    from megatron_lite.distributed.fsdp import FSDP2Model
    from megatron_lite.models.gpt_model import build_model

    from models import llama_config

    ctx = get_context(P())
    model = FSDP2Model(build_model(llama_config(num_layers=2), ctx, seed=1), ctx, None)
    tokens = torch.randint(0, 64, (2, 8))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model(tokens, labels=tokens).sum().backward()
    return [str(w.message) for w in seen if "returned a view tensor" in str(w.message)]


def test_fsdp2_runs_without_torchs_view_warning(dist):
    """(From a review: every --use-torch-fsdp2 run warned on every rank that its output, a view, could give
    wrong gradients; the loss is copied out of the view, so nothing is left to warn about.)"""
    for seen in dist(2, fsdp2_view_warnings):
        assert seen == [], seen


DECOUPLED = {  # world, layout, global batch, micro-batch, model, layers, sharding
    "dist-opt-pp2-dp2-tied": (4, P(pipeline_model_parallel_size=2), 8, 2, "gpt2", 4, "dist-opt"),
    "fsdp2-dp2": (2, P(), 4, 2, "llama", 2, "fsdp2"),
}


@pytest.mark.parametrize("case", list(DECOUPLED))
def test_decoupled_lr_under_sharded_optimizers_equals_single_process(dist, case):
    """--decoupled-lr: the embeddings (and the last stage's tied copy) and the output layer take their own rate
    in the distributed optimizer's shards and in FSDP2's, as in one process; and it changes the run."""
    from test_train_equivalence import OPTIM

    world, parallel, gbs, mbs, name, layers, sharding = DECOUPLED[case]
    optim = dataclasses.replace(OPTIM, decoupled_lr=3 * OPTIM.lr, decoupled_min_lr=OPTIM.min_lr)
    ref = train_run(name, P(), gbs, gbs, layers=layers, optim=optim)
    plain = train_run(name, P(), gbs, gbs, layers=layers)
    assert any(abs(a[0] - b[0]) > 1e-3 * abs(b[0]) for a, b in zip(ref, plain))
    kw = dict(distributed_optimizer=True) if sharding == "dist-opt" else dict(fsdp2=True)
    for history in dist(world, train_run, name, parallel, gbs, mbs, layers=layers, optim=optim, **kw):
        _compare(history, ref)


@pytest.mark.parametrize("sharding", ["dist-opt", "zero2", "fsdp2"])
def test_sgd_under_sharded_optimizers_equals_single_process(dist, sharding):
    """--optimizer sgd: momentum on each rank's shard (distributed optimizer, ZeRO-2) or on FSDP2's sharded
    weights, as in one process; and it is another optimizer than Adam."""
    from test_train_equivalence import OPTIM

    sgd = dataclasses.replace(OPTIM, optimizer="sgd", sgd_momentum=0.9, lr=0.05, min_lr=0.005)
    ref = train_run("llama", P(), 4, 4, optim=sgd)
    assert any(abs(a[0] - b[0]) > 1e-3 * b[0] for a, b in zip(ref, train_run("llama", P(), 4, 4)))
    kw = {"dist-opt": dict(distributed_optimizer=True), "zero2": dict(distributed_optimizer=True, zero_stage=2)}
    for history in dist(2, train_run, "llama", P(), 4, 2, optim=sgd, **kw.get(sharding, {"fsdp2": True})):
        _compare(history, ref)


@pytest.mark.parametrize("sharding", ["dist-opt", "fsdp2"])
def test_weight_decay_increment_under_sharded_optimizers_equals_single_process(dist, sharding):
    """--weight-decay-incr-style cosine reaches each rank's shard of the decaying groups, as in one process
    (where it is checked against torch.optim in test_train_hf_reference); and it changes the run."""
    from test_train_equivalence import OPTIM

    wd = dataclasses.replace(
        OPTIM, weight_decay_incr_style="cosine", start_weight_decay=0.0, end_weight_decay=5.0, lr=0.02
    )
    ref = train_run("llama", P(), 4, 4, optim=wd)
    constant = train_run("llama", P(), 4, 4, optim=dataclasses.replace(OPTIM, lr=0.02))
    assert any(abs(a[1] - b[1]) > 1e-3 * b[1] for a, b in zip(ref, constant))
    kw = dict(distributed_optimizer=True) if sharding == "dist-opt" else dict(fsdp2=True)
    for history in dist(2, train_run, "llama", P(), 4, 2, optim=wd, **kw):
        _compare(history, ref)


def test_grad_norm_sums_squares_in_fp64():
    """A review found one process's grad_norm 2.7e-5 off TP=2's and the distributed optimizer's (whose per-tensor
    gradients agreed to 2e-7): an fp32 norm of the whole 4096-row tied embedding gradient erred by 1.8e-4 on its
    square, the shards' smaller norms less. Summed in fp64, whole and sharded agree with the exact sum."""
    import torch

    from megatron_lite.optimizer.optimizer import squared_norm

    g = torch.randn(4096 * 64 * 4, generator=torch.Generator().manual_seed(0)) * 1e-3 + 2e-3
    exact = float((g.double() ** 2).sum())
    assert abs(squared_norm([g.view(-1, 64), torch.zeros(0)], "cpu") / exact - 1) < 1e-12
    assert abs(squared_norm(list(g.chunk(3)), "cpu") / exact - 1) < 1e-12
    assert squared_norm([], "cpu") == 0.0
