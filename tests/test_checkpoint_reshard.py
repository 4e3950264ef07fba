"""Layout-free checkpoints: a run saved under one layout continues under another with the same per-iteration
lm_loss and grad_norm (within 1e-5 relative) as the run that continued under the original layout, so the
fp32 main weights, Adam moments, LR schedule and data position all came back exactly.

Dense: saved at TP=2 (sequence parallel) x PP=2 (two virtual stages per rank) x DP=2, loaded at
TP=1 x PP=4 x DP=2, TP=4 x PP=1 x DP=2 and on one process. MoE: saved at EP=2 (DP=4), loaded at EP=4 and
EP=1."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_lite.checkpoint.checkpointing import TrainState, find_checkpoint, load_checkpoint, save_checkpoint
from megatron_lite.config import ParallelConfig
from megatron_lite.data.mock import MockGPTDataset, collate
from megatron_lite.data.samplers import micro_batch_indices
from megatron_lite.distributed.ddp import DistributedDataParallel
from megatron_lite.models.gpt_model import build_model
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.optimizer.lr_scheduler import LRScheduler
from megatron_lite.optimizer.optimizer import MixedPrecisionOptimizer
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.training.wrap import wrap_for_training

from dist_pool import get_context
from models import llama_config

TOL = 1e-5
SEQ, GBS, TOTAL, SAVE_AT = 16, 8, 6, 3
OPTIM = OptimizerConfig(
    lr=3e-3, min_lr=3e-4, lr_decay_style="cosine", lr_warmup_iters=2, weight_decay=0.1, clip_grad=1.0
)
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
P = ParallelConfig


def run(
    config_kw: dict,
    parallel: ParallelConfig,
    mbs: int,
    save: str | None = None,
    load: str | None = None,
    distributed_optimizer: bool = False,
    fsdp2: bool = False,
    optimizer: str = "adam",
    load_kw: dict | None = None,
):
    """Train to iteration TOTAL (from the checkpoint in `load` if given, load_checkpoint's `load_kw`), saving at
    SAVE_AT into `save`; returns (iteration, lm_loss, grad_norm) for every iteration run."""
    from megatron_lite.training.step import train_step

    ctx = (
        get_context(parallel)
        if dist.is_initialized()
        else ParallelContext.virtual(parallel, device=torch.device("cpu"))
    )
    config = llama_config(num_layers=4, **config_kw)
    ctx.seed(1234)
    model = build_model(config, ctx, seed=1234 if load is None else 999)  # loading must overwrite every weight
    optim = dataclasses.replace(
        OPTIM, use_distributed_optimizer=distributed_optimizer, use_torch_fsdp2=fsdp2, optimizer=optimizer
    )
    ddp, opt = wrap_for_training(model, ctx, optim)
    sched = LRScheduler(OPTIM, TOTAL)
    state = TrainState()
    if load is not None:
        state = load_checkpoint(find_checkpoint(load), model, opt, sched, ctx, **(load_kw or {}))
        assert state.iteration == SAVE_AT and state.consumed_samples == SAVE_AT * GBS
    data = MockGPTDataset(config.vocab_size, SEQ, seed=7)
    history = []
    while state.iteration < TOTAL:
        idx = micro_batch_indices(state.consumed_samples, GBS, mbs, ctx.dp.rank, ctx.dp.size)
        m = train_step(ddp, opt, sched, [collate([data[i] for i in ix]) for ix in idx], ctx)
        state.iteration += 1
        state.consumed_samples += GBS
        history.append((state.iteration, m.lm_loss, m.grad_norm))
        if save is not None and state.iteration == SAVE_AT:
            job = {"model": dataclasses.asdict(config), "optimizer": {"optimizer": optimizer}}
            save_checkpoint(save, state, model, opt, sched, ctx, job)
    return history


def _compare(got, ref, what):
    assert [h[0] for h in got] == [r[0] for r in ref], what
    for (it, loss, norm), (_, rloss, rnorm) in zip(got, ref):
        assert abs(loss - rloss) <= TOL * abs(rloss), f"{what} iteration {it}: lm_loss {loss} vs {rloss}"
        assert abs(norm - rnorm) <= TOL * abs(rnorm), f"{what} iteration {it}: grad_norm {norm} vs {rnorm}"


def _check_everyone_agrees(results):
    for h in results[1:]:
        assert [x[0] for x in h] == [x[0] for x in results[0]]


SAVED_DENSE = P(
    tensor_model_parallel_size=2,
    pipeline_model_parallel_size=2,
    virtual_pipeline_model_parallel_size=2,
    sequence_parallel=True,
)
DENSE_TARGETS = {
    "tp1-pp4-dp2": (8, P(pipeline_model_parallel_size=4), 1),
    "tp4-pp1-dp2": (8, P(tensor_model_parallel_size=4), 2),
}


@pytest.mark.slow
def test_dense_checkpoint_loads_under_any_layout(dist, tmp_path):
    ckpt = str(tmp_path / "dense")
    original = dist(8, run, {}, SAVED_DENSE, 1, ckpt)
    _check_everyone_agrees(original)
    continued = [h for h in original[0] if h[0] > SAVE_AT]
    for name, (world, parallel, mbs) in DENSE_TARGETS.items():
        for history in dist(world, run, {}, parallel, mbs, None, ckpt):
            _compare(history, continued, name)
    _compare(run({}, P(), GBS, None, ckpt), continued, "tp1-pp1-dp1 (one process)")


def test_a_same_layout_resume_at_pp4_replays_the_dropout_streams(dist, tmp_path):
    """Each rank's random states come back under the layout they were saved with, on the middle pipeline stages
    too: they took the checkpoint for another layout (rank 0 records its embedding group, 2 ranks, a middle
    stage has none) and restarted dropout from the seed, the loss 1e-3 off the uninterrupted run."""
    ckpt, drop, parallel = (
        str(tmp_path / "pp4"),
        dict(hidden_dropout=0.2, attention_dropout=0.2),
        P(pipeline_model_parallel_size=4),
    )
    original = dist(4, run, drop, parallel, 2, ckpt)
    continued = [h for h in original[-1] if h[0] > SAVE_AT]
    _compare(dist(4, run, drop, parallel, 2, None, ckpt)[-1], continued, "pp4 resumed")


SAVED_MOE = P(expert_model_parallel_size=2)


def test_moe_checkpoint_loads_under_any_expert_layout(dist, tmp_path):
    ckpt = str(tmp_path / "moe")
    original = dist(4, run, MOE, SAVED_MOE, 2, ckpt)
    continued = [h for h in original[0] if h[0] > SAVE_AT]
    for ep in (4, 1):
        for history in dist(4, run, MOE, P(expert_model_parallel_size=ep), 2, None, ckpt):
            _compare(history, continued, f"ep{ep}")
    _compare(run(MOE, P(), 2, None, ckpt), continued, "one process")


def test_moe_checkpoint_saved_with_expert_tp_below_tp_loads_under_other_layouts(dist, tmp_path):
    """Whole experts at TP=2 (ETP=1, EP=2, DP=2, the distributed optimizer's shards), saved, and loaded with the
    experts split over TP (ETP=TP=2) and on one process: the run continues as the original."""
    ckpt = str(tmp_path / "etp1")
    saved = P(expert_model_parallel_size=2, tensor_model_parallel_size=2, expert_tensor_parallel_size=1,
              sequence_parallel=True)  # fmt: skip
    original = dist(4, run, MOE, saved, 2, ckpt, None, True)
    continued = [h for h in original[0] if h[0] > SAVE_AT]
    etp2 = P(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)
    for history in dist(4, run, MOE, etp2, 2, None, ckpt):
        _compare(history, continued, "etp2")
    _compare(run(MOE, P(), 2, None, ckpt), continued, "one process")


def test_biased_moe_checkpoint_saved_under_expert_tensor_parallelism_loads_on_one_process(dist, tmp_path):
    """gpt-oss's MLP (biased router and experts, quick-GEGLU): saved at EP=2 x TP=2 + SP, where fc2's bias is added
    by one expert-TP rank of each pair but held by both, loaded on one process: the run continues as the original."""
    ckpt, gpt_oss = str(tmp_path / "gpt-oss"), dict(MOE, activation="quick_geglu", glu_linear_offset=1.0,
                                                    activation_func_clamp_value=7.0, add_bias_linear=True)  # fmt: skip
    saved = P(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)
    original = dist(4, run, gpt_oss, saved, 2, ckpt)
    continued = [h for h in original[0] if h[0] > SAVE_AT]
    _compare(run(gpt_oss, P(), 2, None, ckpt), continued, "one process")


def test_tied_padded_checkpoint_loads_across_pipeline_and_tensor_layouts(dist, tmp_path):
    """Tied embeddings (the last stage's copy of the word embeddings) and a vocabulary padded to 128 rows per TP
    rank: saved at PP=2, loaded at TP=2 (another padding) and on one process, the runs continue as the original."""
    ckpt, tied = (
        str(tmp_path / "tied"),
        dict(untie_embeddings_and_output_weights=False, make_vocab_size_divisible_by=128),
    )
    original = dist(2, run, tied, P(pipeline_model_parallel_size=2), 4, ckpt)
    continued = [h for h in original[-1] if h[0] > SAVE_AT]  # (the last stage's record of the loss)
    for history in dist(2, run, tied, P(tensor_model_parallel_size=2), 4, None, ckpt):
        _compare(history, continued, "tp2")
    _compare(run(tied, P(), 4, None, ckpt), continued, "one process")


def async_vs_sync(root: str) -> list[str]:
    """At TP=2 x DP=2: an async save (published by `poll` on every rank, after further training steps)
    holds exactly what a synchronous save of the same state holds."""
    import os

    from safetensors import safe_open

    from megatron_lite.checkpoint.checkpointing import AsyncSaver
    from megatron_lite.training.step import train_step

    parallel = P(tensor_model_parallel_size=2)
    ctx = get_context(parallel)
    config = llama_config(num_layers=2)
    ctx.seed(1234)
    model = build_model(config, ctx, seed=1234)
    ddp = DistributedDataParallel(model, ctx)
    opt = MixedPrecisionOptimizer(model, ddp.main_grad, OPTIM, ctx)
    sched = LRScheduler(OPTIM, TOTAL)
    data = MockGPTDataset(config.vocab_size, SEQ, seed=7)

    def step(i):
        idx = micro_batch_indices(i * GBS, GBS, 2, ctx.dp.rank, ctx.dp.size)
        train_step(ddp, opt, sched, [collate([data[j] for j in ix]) for ix in idx], ctx)

    step(0)
    state = TrainState(1, GBS)
    save_checkpoint(os.path.join(root, "sync"), state, model, opt, sched, ctx, {})
    saver = AsyncSaver(os.path.join(root, "async"), ctx)
    saver.save(state, model, opt, sched, {})
    published = []
    for i in (1, 2):  # training goes on (and changes the weights) while the writer works
        step(i)
        published.append(saver.poll())
    published.append(saver.finish())
    assert [p for p in published if p] == [os.path.join(root, "async", "iter_0000001")]
    mismatched = []
    if ctx.rank == 0:
        for f in sorted(os.listdir(os.path.join(root, "sync", "iter_0000001"))):
            if not f.startswith("tensors_"):
                continue
            with safe_open(os.path.join(root, "sync", "iter_0000001", f), "pt") as a:
                with safe_open(os.path.join(root, "async", "iter_0000001", f), "pt") as b:
                    assert set(a.keys()) == set(b.keys())
                    mismatched += [k for k in a.keys() if not a.get_tensor(k).equal(b.get_tensor(k))]
    return mismatched


def test_async_save_at_tp2_dp2(dist, tmp_path):
    for mismatched in dist(4, async_vs_sync, str(tmp_path)):
        assert mismatched == []


@pytest.mark.slow
def test_distributed_optimizer_checkpoint_loads_without_it(dist, tmp_path):
    """Saved with the distributed optimizer at TP=2 x DP=4, loaded at TP=1 x DP=2 without it (and at DP=4
    with it again from a plain checkpoint): the runs continue exactly as the original job."""
    ckpt = str(tmp_path / "zero1")
    original = dist(8, run, {}, P(tensor_model_parallel_size=2), 1, ckpt, None, True)
    continued = [h for h in original[0] if h[0] > SAVE_AT]
    for history in dist(2, run, {}, P(), 4, None, ckpt, False):
        _compare(history, continued, "tp1-dp2 without the distributed optimizer")
    plain = str(tmp_path / "plain")
    original = dist(2, run, {}, P(), 4, plain, None, False)
    continued = [h for h in original[0] if h[0] > SAVE_AT]
    for history in dist(4, run, {}, P(), 2, None, plain, True):
        _compare(history, continued, "dp4 with the distributed optimizer")


def test_sgd_momentum_comes_back_under_another_layout(dist, tmp_path):
    """--optimizer sgd: its momentum buffers are saved from the distributed optimizer's shards (TP=2 x DP=2) and
    the run continues exactly at DP=2 without it; loading them into an Adam run is refused in one line."""
    from megatron_lite.config import ConfigError

    ckpt = str(tmp_path / "sgd")
    original = dist(4, run, {}, P(tensor_model_parallel_size=2), 2, ckpt, None, True, False, "sgd")
    continued = [h for h in original[0] if h[0] > SAVE_AT]
    for history in dist(2, run, {}, P(), 4, None, ckpt, False, False, "sgd"):
        _compare(history, continued, "sgd at dp2 without the distributed optimizer")
    with pytest.raises(ConfigError, match=r"holds SGD momentum \(--optimizer sgd\); this run keeps Adam moments"):
        run({}, P(), 8, None, ckpt)


def test_optimizer_state_of_another_kind_is_refused():
    """SGD without momentum keeps no state: loading it into a run with momentum (or Adam) would silently start
    from nothing, and the other way round drop what was saved; both are one-line errors. A --no-save-optim
    checkpoint says that it holds nothing, whatever optimizer wrote it."""
    from megatron_lite.checkpoint.compatibility import check_optimizer_state
    from megatron_lite.config import ConfigError

    def meta(optimizer, momentum, saved=True, iteration=3):
        config = {"optimizer": {"optimizer": optimizer, "sgd_momentum": momentum}}
        return {"config": config, "optimizer_saved": saved, "iteration": iteration}

    sgd = dataclasses.replace(OPTIM, optimizer="sgd", sgd_momentum=0.9)
    no_momentum = dataclasses.replace(sgd, sgd_momentum=0.0)
    check_optimizer_state("c", meta("sgd", 0.5), sgd)  # momentum values may differ; the state is the same kind
    for saved, run_config, says in (
        (meta("sgd", 0.0), sgd, "holds no state"),
        (meta("sgd", 0.9), no_momentum, "keeps no state"),
        (meta("adam", 0.9), sgd, "holds Adam moments"),
        (meta("adam", 0.9, saved=False), sgd, "saved with --no-save-optim"),
    ):
        with pytest.raises(ConfigError, match=says):
            check_optimizer_state("c", saved, run_config)


@pytest.mark.slow
def test_fsdp2_checkpoint_loads_without_it_and_back(dist, tmp_path):
    """Saved under FSDP2 at DP=4, loaded at DP=2 without it; saved without it at DP=2, loaded under FSDP2 at
    DP=4 (with TP=2): each run continues as the original job."""
    ckpt = str(tmp_path / "fsdp2")
    original = dist(4, run, {}, P(), 2, ckpt, None, False, True)
    continued = [h for h in original[0] if h[0] > SAVE_AT]
    for history in dist(2, run, {}, P(), 4, None, ckpt, False, False):
        _compare(history, continued, "dp2 without FSDP2")
    plain = str(tmp_path / "plain")
    original = dist(2, run, {}, P(), 4, plain, None, False, False)
    continued = [h for h in original[0] if h[0] > SAVE_AT]
    for history in dist(4, run, {}, P(tensor_model_parallel_size=2), 2, None, plain, False, True):
        _compare(history, continued, "tp2 x dp2 under FSDP2")


@pytest.mark.slow
def test_fsdp2_checkpoint_under_pipeline_and_context_parallelism(dist, tmp_path):
    """Saved under FSDP2 at PP=2 x DP=2 (each stage gathers its own shards), loaded under FSDP2 at CP=2 x DP=2:
    the run continues as the original job."""
    ckpt = str(tmp_path / "fsdp2-pp")
    original = dist(4, run, {}, P(pipeline_model_parallel_size=2), 1, ckpt, None, False, True)
    _check_everyone_agrees(original)
    continued = [h for h in original[-1] if h[0] > SAVE_AT]
    for history in dist(4, run, {}, P(context_parallel_size=2), 2, None, ckpt, False, True):
        _compare(history, continued, "cp2 x dp2 under FSDP2")


@pytest.mark.slow
def test_fsdp2_moe_checkpoint_loads_without_it(dist, tmp_path):
    """Experts sharded by FSDP2 over the expert-data-parallel group (EP=2 x DP=4), saved, and loaded at DP=2
    without FSDP2 or expert parallelism: the run continues as the original job."""
    ckpt = str(tmp_path / "fsdp2-moe")
    original = dist(4, run, MOE, P(expert_model_parallel_size=2), 2, ckpt, None, False, True)
    _check_everyone_agrees(original)
    continued = [h for h in original[0] if h[0] > SAVE_AT]
    for history in dist(2, run, MOE, P(), 2, None, ckpt, False, False):  # same micro-batches (the aux loss's)
        _compare(history, continued, "dp2 without FSDP2 or EP")


def test_load_alone_does_not_take_over_the_checkpoints_sharding(tmp_path, capsys, monkeypatch):
    """A checkpoint saved with --use-distributed-optimizer --zero-stage 2 loads with or without it, or under FSDP2,
    from the command line: its sharding flags (store_true, with no way to turn them off) were taken over as
    defaults, and another sharding refused as a conflict."""
    from test_pretrain_cli import _run

    from megatron_lite.arguments import parse_args

    ckpt = str(tmp_path / "ckpt")
    data = ["--mock-data", "--vocab-size", "100"]
    rc, _, err = _run([*data, "--save", ckpt, "--use-distributed-optimizer", "--zero-stage", "2"], capsys, monkeypatch)
    assert rc == 0, err
    _, job = parse_args(["--load", ckpt, *data])
    assert not job.optimizer.use_distributed_optimizer and job.optimizer.zero_stage == 1
    _, job = parse_args(["--load", ckpt, *data, "--use-torch-fsdp2"])
    assert job.optimizer.use_torch_fsdp2 and not job.optimizer.use_distributed_optimizer
    rc, out, err = _run([*data, "--load", ckpt, "--train-iters", "4"], capsys, monkeypatch)
    assert rc == 0 and "iteration        4/" in out, err


def save_failing_on_rank0(root: str, stage: str):
    """A save whose `stage` (writing a rank's files, or publishing) raises on rank 0 only: what each rank raised
    and how long it took."""
    import time

    from megatron_lite.checkpoint import checkpointing

    ctx = get_context(P())
    model = build_model(llama_config(num_layers=1), ctx, seed=1)
    if ctx.rank == 0:
        real = getattr(checkpointing, stage)

        def broken(*a, **kw):
            raise OSError(28, "No space left on device")

        setattr(checkpointing, stage, broken)
    start = time.time()
    try:
        save_checkpoint(root, TrainState(1, 1), model, None, None, ctx, {})
        raised = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        raised = f"{type(e).__name__}: {e}"
    finally:
        if ctx.rank == 0:
            setattr(checkpointing, stage, real)
    return raised, time.time() - start, find_checkpoint(root) if ctx.rank == 0 else None


@pytest.mark.parametrize("stage", ["_write_rank_files", "publish"])
def test_a_save_failing_on_one_rank_stops_every_rank_at_once(dist, tmp_path, stage):
    """A full disk on rank 0 while the others wait: every rank raises in well under the collective timeout (they
    waited in a barrier until it: 10 minutes by default), rank 0 its own error, and nothing is published."""
    (r0, t0, found), (r1, t1, _) = dist(2, save_failing_on_rank0, str(tmp_path / "ck"), stage)
    assert r0 == "OSError: [Errno 28] No space left on device" and found is None, r0
    assert r1 is not None and "failed on another rank" in r1, r1
    assert max(t0, t1) < 20, (t0, t1)


def load_with_one_rank_file_corrupted(root: str):
    """TP=2 loads a checkpoint whose rank-1 tensor file (read by rank 1 alone) has a flipped byte: (error, seconds)."""
    ctx = get_context(P(tensor_model_parallel_size=2))
    model = build_model(llama_config(num_layers=2), ctx)
    _, opt = wrap_for_training(model, ctx, OPTIM)
    start = time.time()
    try:
        load_checkpoint(find_checkpoint(root), model, opt, LRScheduler(OPTIM, TOTAL), ctx)
        raised = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        raised = f"{type(e).__name__}: {e}"
    return raised, time.time() - start


def test_a_load_failing_on_one_rank_stops_every_rank_at_once(dist, tmp_path):
    """From a review: each rank checks the files it reads, so a corrupted file only rank 1 reads failed there
    while rank 0 went on into the optimizer's collectives and waited until the timeout (10 minutes by default)."""
    root = str(tmp_path / "ck")
    dist(2, save_at_tp2, root)
    shard = os.path.join(find_checkpoint(root), "tensors_r00001.safetensors")
    data = bytearray(open(shard, "rb").read())
    data[-100] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    (r0, t0), (r1, t1) = dist(2, load_with_one_rank_file_corrupted, root)
    assert r1 is not None and r1.startswith("ConfigError") and "sha256" in r1 and shard in r1, r1
    assert r0 == f"ConfigError: loading {find_checkpoint(root)} failed on another rank (its error says why)", r0
    assert max(t0, t1) < 20, (t0, t1)


def save_at_tp2(root: str) -> None:
    ctx = get_context(P(tensor_model_parallel_size=2))
    model = build_model(llama_config(num_layers=2), ctx)
    _, opt = wrap_for_training(model, ctx, OPTIM)
    save_checkpoint(root, TrainState(1, 8), model, opt, LRScheduler(OPTIM, TOTAL), ctx, {})


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_an_fp32_run_takes_a_bf16_checkpoints_main_weights(tmp_path, distributed_optimizer):
    """From a review: a --bf16 checkpoint's model weights are the bf16 rounding of its fp32 main weights; an fp32
    run loading it took the rounding (and with the distributed optimizer ran its first step on it while its main
    weights were exact). Its weights are now the saved main weights, exactly."""
    from megatron_lite.checkpoint.hf_convert import read_model_tensors

    ctx = ParallelContext.virtual(P(), device=torch.device("cpu"))
    config = llama_config(num_layers=2)
    root = str(tmp_path / "ck")
    model = build_model(config, ctx, dtype=torch.bfloat16)
    ddp, opt = wrap_for_training(model, ctx, dataclasses.replace(OPTIM, bf16=True))
    data = MockGPTDataset(config.vocab_size, SEQ, seed=7)
    from megatron_lite.training.step import train_step

    sched = LRScheduler(OPTIM, TOTAL)
    for it in range(2):  # (main weights that moved off the bf16 grid)
        train_step(ddp, opt, sched, [collate([data[i] for i in range(it * 2, it * 2 + 2)])], ctx)
    save_checkpoint(root, TrainState(2, 4), model, opt, None, ctx, {})
    main = read_model_tensors(root, main=True)[1]
    optim = dataclasses.replace(OPTIM, use_distributed_optimizer=distributed_optimizer)
    fp32 = build_model(config, ctx, seed=999)
    _, opt32 = wrap_for_training(fp32, ctx, optim)
    load_checkpoint(find_checkpoint(root), fp32, opt32, None, ctx)
    rounded = 0
    for name, p in fp32.named_parameters():
        saved = main[fp32.global_name(name)]
        assert torch.equal(p.detach(), saved), name
        rounded += not torch.equal(saved, saved.bfloat16().float())
    assert rounded, "the main weights are all on the bf16 grid: the test would not see the rounding"
    # also without the optimizer's state (--finetune, --no-load-optim) or any optimizer (generation)
    for how in (dict(finetune=True), dict(load_optim=False), dict(optimizer=None)):
        fresh = build_model(config, ctx, seed=999)
        opt_ = None if "optimizer" in how else wrap_for_training(fresh, ctx, optim)[1]
        load_checkpoint(
            find_checkpoint(root), fresh, opt_, None, ctx, **{k: v for k, v in how.items() if k != "optimizer"}
        )
        for name, p in fresh.named_parameters():
            assert torch.equal(p.detach(), main[fresh.global_name(name)]), (how, name)


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_data_parallel_replicas_share_the_writing_of_a_checkpoint(dist, tmp_path, distributed_optimizer):
    """From a checkpoint review: data-parallel rank 0 wrote every tensor and the other replicas only their index,
    so a save's time and host memory did not fall with DP (Megatron's fully parallel save spreads them). Each
    replica now writes about an equal share, and the checkpoint continues on one process as the job would."""
    from safetensors import safe_open

    ckpt = str(tmp_path / "ck")
    original = dist(2, run, {}, P(), 4, ckpt, None, distributed_optimizer)
    written = []
    for r in range(2):
        with safe_open(os.path.join(find_checkpoint(ckpt), f"tensors_r{r:05d}.safetensors"), framework="pt") as f:
            written.append(sum(f.get_tensor(k).numel() for k in f.keys()))
    assert min(written) > 0.4 * sum(written), written
    _compare(run({}, P(), GBS, None, ckpt), [h for h in original[0] if h[0] > SAVE_AT], "one process")
