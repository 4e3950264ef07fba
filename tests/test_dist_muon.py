"""--optimizer dist_muon (optimizer/layer_wise_optimizer.py): at DP=2, DP=4, TP=2 x DP=2 and EP=2 x EDP=2 the
per-iteration lm_loss and grad_norm are the one-process --optimizer muon run's (under --bf16: muon's at DP=2);
optimizer-state bytes per rank fall to a quarter at DP=4 (a half at DP=2 with bf16's main weights); a
checkpoint saved under dist_muon at DP=2 continues identically under muon on one process and under dist_muon
at DP=4, and back; the split of the parameters worked out by hand; the refusals."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from test_muon import GBS, MODELS, MUON, _close

from megatron_lite.arguments import parse_args
from megatron_lite.checkpoint.checkpointing import TrainState, find_checkpoint, load_checkpoint, save_checkpoint
from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.data.mock import MockGPTDataset, collate
from megatron_lite.data.samplers import micro_batch_indices
from megatron_lite.models.gpt_model import build_model
from megatron_lite.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer, layer_wise_split
from megatron_lite.optimizer.lr_scheduler import LRScheduler
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.planner.memory import parameter_state_bytes
from megatron_lite.training.step import train_step
from megatron_lite.training.wrap import wrap_for_training

from dist_pool import get_context

DIST = dataclasses.replace(MUON, optimizer="dist_muon")
TOTAL, SAVE_AT = 6, 3


def _run(name, parallel, mbs, optim=DIST, iters=5, save=None, load=None, dtype=torch.float32):
    """(per iteration (lm_loss, grad_norm), this rank's optimizer-state bytes); from the checkpoint in `load`
    if given (to iteration TOTAL), saving at SAVE_AT into `save`."""
    ctx = get_context(parallel) if torch.distributed.is_initialized() else ParallelContext.virtual(parallel)
    config = MODELS[name]()
    ctx.seed(1234)
    model = build_model(config, ctx, seed=1234 if load is None else 999, dtype=dtype)  # (loading overwrites it)
    ddp, opt = wrap_for_training(model, ctx, optim)
    assert isinstance(opt, LayerWiseDistributedOptimizer) == (optim.optimizer == "dist_muon")
    sched = LRScheduler(optim, TOTAL if save or load else iters)
    state = TrainState()
    if load is not None:
        state = load_checkpoint(find_checkpoint(load), model, opt, sched, ctx)
        assert state.iteration == SAVE_AT
    data = MockGPTDataset(config.vocab_size, 16, seed=7)
    history = []
    while state.iteration < (TOTAL if save or load else iters):
        idx = micro_batch_indices(state.consumed_samples, GBS, mbs, ctx.dp.rank, ctx.dp.size)
        m = train_step(ddp, opt, sched, [collate([data[i] for i in ix], ctx.device) for ix in idx], ctx)
        state.iteration += 1
        state.consumed_samples += GBS
        history.append((m.lm_loss, m.grad_norm))
        if save is not None and state.iteration == SAVE_AT:
            job = {"model": dataclasses.asdict(config), "optimizer": {"optimizer": optim.optimizer}}
            save_checkpoint(save, state, model, opt, sched, ctx, job)
    return history, opt.state_bytes()


TP2 = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)


@pytest.mark.slow
def test_data_parallel_layouts_train_like_one_process_muon(dist):
    """DP=4 and TP=2 x DP=2 (--muon-tp-mode duplicated: each matrix orthogonalized whole) give the one-process
    muon run's lm_loss and grad_norm at every iteration (so the norm counts every parameter, not only a rank's
    own); at DP=4 each rank holds a quarter of the optimizer state (within 10%), each parameter's on one rank.
    (DP=2: the checkpoint test's unbroken run.)"""
    ref, one_bytes = _run("llama", ParallelConfig(), GBS, MUON)
    per_rank = dist(4, _run, "llama", ParallelConfig(), GBS // 4)
    for history, state_bytes in per_rank:
        _close(history, ref, "dp4")
        assert abs(state_bytes - one_bytes / 4) <= 0.1 * one_bytes / 4, (state_bytes, one_bytes)
    assert sum(b for _, b in per_rank) == one_bytes
    duplicated = dataclasses.replace(DIST, muon_tp_mode="duplicated")
    for history, _ in dist(4, _run, "llama", TP2, GBS // 2, duplicated):
        _close(history, ref, "tp2-dp2")


@pytest.mark.slow
def test_experts_are_split_over_the_expert_data_parallel_group(dist):
    """EP=2 at DP=4: the experts are split over EDP=2, the rest over DP=4; the one-process muon run's
    lm_loss and grad_norm."""
    ref, _ = _run("moe", ParallelConfig(), GBS, MUON, iters=3)
    for history, _ in dist(4, _run, "moe", ParallelConfig(expert_model_parallel_size=2), GBS // 4, iters=3):
        _close(history, ref, "ep2-dp4")


def _bf16_pair(iters):
    """A bf16 muon run, then a bf16 dist_muon run, on the same ranks."""
    muon, dist_muon = (dataclasses.replace(o, bf16=True) for o in (MUON, DIST))
    return [_run("llama", ParallelConfig(), GBS // 2, o, iters, dtype=torch.bfloat16) for o in (muon, dist_muon)]


@pytest.mark.slow
def test_bf16_keeps_main_weights_on_the_owner_alone(dist):
    """Under --bf16 at DP=2 the fp32 main weights too are kept by each parameter's owner alone (half the state
    of muon's at DP=2), and the updated bf16 weights it gathers give muon's lm_loss and grad_norm."""
    for (ref, muon_bytes), (history, state_bytes) in dist(2, _bf16_pair, 3):
        _close(history, ref, "bf16 dp2")
        assert abs(state_bytes - muon_bytes / 2) <= 0.1 * muon_bytes / 2, (state_bytes, muon_bytes)


@pytest.mark.slow
def test_checkpoint_continues_under_muon_and_another_dp_size(dist, tmp_path):
    """Saved under dist_muon at DP=2 at iteration 3 of 6 (whose every iteration is the one-process muon
    run's): loaded under muon on one process and under dist_muon at DP=4, iterations 4-6 are the unbroken
    run's (so every rank's Muon momentum and Adam moments were saved whole); and the other way round, the
    one-process muon run's checkpoint continues under dist_muon at DP=2."""
    ckpt, back = str(tmp_path / "dist"), str(tmp_path / "muon")
    ref, _ = _run("llama", ParallelConfig(), GBS, MUON, save=back)
    straight = dist(2, _run, "llama", ParallelConfig(), GBS // 2, save=ckpt)[0][0]
    _close(straight, ref, "dp2")
    resumed, _ = _run("llama", ParallelConfig(), GBS, MUON, load=ckpt)
    _close(resumed, straight[SAVE_AT:], "muon at DP=1")
    for history, _ in dist(4, _run, "llama", ParallelConfig(), GBS // 4, load=ckpt):
        _close(history, straight[SAVE_AT:], "dist_muon at DP=4")
    for history, _ in dist(2, _run, "llama", ParallelConfig(), GBS // 2, load=back):
        _close(history, ref[SAVE_AT:], "dist_muon at DP=2 from muon")


def test_split_balances_state_bytes():
    """By hand: largest first to the rank with the fewest bytes (ties: the lowest rank). 9 -> 0, 7 -> 1,
    5 -> 1 (7 < 9), 3 -> 0 (9 < 12), 2 -> 0 (12 = 12)."""
    assert layer_wise_split([5, 9, 2, 7, 3], 2) == [1, 0, 0, 1, 0]
    assert layer_wise_split([4, 4, 4], 4) == [0, 1, 2]  # (a rank may own nothing)


def test_dry_run_prices_the_state_split_over_data_parallelism():
    """--dry-run's weights+gradients+optimizer bytes: by hand, 1000 dense parameters over DP x CP = 4 and 400
    expert ones over EDP = 2 keep 8 bytes of state each (Adam's bound) on a quarter and a half of them, plus
    bf16's 4-byte main copies; gradients stay whole (all-reduced)."""
    assert parameter_state_bytes(1000, 400, 4, 2, "layer-wise", False) == (4 * 1400, 4 * 1400, 8 * 450)
    assert parameter_state_bytes(1000, 400, 4, 2, "layer-wise", True) == (2 * 1400, 4 * 1400, 12 * 450)


BASE = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-iters 4 --mock-data".split()


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--use-distributed-optimizer", "--optimizer dist_muon with --use-distributed-optimizer is not supported"),
        ("--use-torch-fsdp2", "--optimizer dist_muon with --use-torch-fsdp2 is not supported"),
        ("--fp16", "--optimizer dist_muon with --fp16 is not supported"),
        (
            "--overlap-grad-reduce --overlap-param-gather",
            "--optimizer dist_muon with --overlap-param-gather is not supported",
        ),
    ],
)
def test_refusals_are_one_line(flags, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)) as e:
        parse_args([*BASE, "--optimizer", "dist_muon", *flags.split()])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("pp,untied", [(1, True), (2, True), (2, False)], ids=["pp1", "pp2", "pp2-tied"])
def test_the_planner_prices_muons_state_stage_by_stage(pp, untied):
    """tools/plan_parallelism.py's optimizer bytes of a muon job on each pipeline stage are exactly what the
    stage's own parameters take (muon_state_bytes over them, which tests/test_cli_dry_run.py holds to a run's
    tensors): Muon's 4 bytes on the matrices, Adam's 8 on the norms and the vocabulary the first and last stages
    hold (the norms were priced at Muon's 4, within 1%). It priced everything at Adam's 8 (1.5x and more)."""
    from megatron_lite.optimizer.optimizer import group_name, muon_state_bytes
    from megatron_lite.parameters import named_param_meta
    from megatron_lite.planner.layout import Layout
    from megatron_lite.planner.memory import MuonStateBytes, rank_memory

    from models import llama_config

    model = llama_config(num_layers=4, vocab_size=512, untie_embeddings_and_output_weights=untied)
    for rank in range(pp):
        ctx = ParallelContext.virtual(ParallelConfig(pipeline_model_parallel_size=pp), pp, rank)
        trained = [(n, p, m) for n, p, m in named_param_meta(build_model(model, ctx, device="meta")) if p.requires_grad]
        numel = sum(p.numel() for _, p, _ in trained)
        exact = muon_state_bytes((group_name(n, m), p.ndim, p.numel()) for n, p, m in trained) * numel
        est = rank_memory(model, Layout(pp=pp), 16, 8, False, rank, state_bytes=MuonStateBytes(model)).optimizer
        assert est == pytest.approx(exact, rel=1e-9), (rank, est, exact)  # (norms at Adam's 8 too, as run)
