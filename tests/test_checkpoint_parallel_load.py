"""--ckpt-fully-parallel-load (Megatron's): the data-parallel replicas split the reading of what they all hold and
exchange the parts. Without it every DP rank read every replicated weight (and a replicated optimizer's whole
state): at DP=4 four times the bytes. Checked at DP=4 against the load without the flag (the path the other
checkpoint tests check against uninterrupted runs): the same weights and optimizer state bit for bit, each rank
reading a quarter of the replicated bytes, the ranks together the checkpoint's bytes once; and a run resumed with
the flag continuing as the uninterrupted run (lm_loss, grad_norm)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import torch
from test_checkpoint_reshard import MOE, OPTIM, SAVE_AT, TOTAL, _compare, run, save_at_tp2
from test_megatron_flags import MOCK

from megatron_lite.arguments import parse_args
from megatron_lite.checkpoint.checkpointing import find_checkpoint, load_checkpoint
from megatron_lite.config import ParallelConfig
from megatron_lite.models.gpt_model import build_model
from megatron_lite.optimizer.lr_scheduler import LRScheduler
from megatron_lite.training.resume import start_load
from megatron_lite.training.wrap import wrap_for_training

from dist_pool import get_context
from models import llama_config

P = ParallelConfig


def _tensor_bytes(path: str) -> int:
    """Every tensor byte the checkpoint holds, from its index files (the writers' own record)."""
    total = 0
    for f in os.listdir(path):
        if f.startswith("index_r"):
            for rec in json.load(open(os.path.join(path, f)))["tensors"].values():
                size = torch.empty(0, dtype=getattr(torch, rec["dtype"])).element_size()
                total += sum(math.prod(pc["lengths"]) * size for pc in rec["pieces"])
    return total


def load_both_ways(root: str, parallel: ParallelConfig, config_kw: dict, distributed_optimizer: bool):
    """The checkpoint in `root` loaded into fresh models and optimizers without and with the flag: asserts the
    weights and optimizer state are the same bit for bit; returns the bytes each load read."""
    ctx = get_context(parallel)
    optim = dataclasses.replace(OPTIM, use_distributed_optimizer=distributed_optimizer)
    loaded = []
    for flag in (False, True):
        model = build_model(llama_config(num_layers=4, **config_kw), ctx, seed=100 + flag)
        _, opt = wrap_for_training(model, ctx, optim)
        stats: dict = {}
        sched = LRScheduler(OPTIM, TOTAL)
        load_checkpoint(find_checkpoint(root), model, opt, sched, ctx, fully_parallel_load=flag, stats=stats)
        loaded.append((model, opt, stats["bytes_read"]))
    (m0, o0, read0), (m1, o1, read1) = loaded
    for (name, p), q in zip(m0.named_parameters(), m1.parameters()):
        assert torch.equal(p, q), name
    states = [o.state_values() for o in (o0, o1)]
    assert len(states[0]) == len(states[1]) and states[0]
    for (_, lo, d), (_, lo1, e) in zip(*states):
        assert lo == lo1 and d.keys() == e.keys() and "exp_avg_sq" in d
        assert all(torch.equal(d[k], e[k]) for k in d), (lo, list(d))
    held = sum(p.numel() * p.element_size() for p in m0.parameters())
    return read0, read1, held


def resume_with_flag(parallel: ParallelConfig, ckpt: str, **kw):
    stats: dict = {}
    history = run({}, parallel, 2, None, ckpt, load_kw=dict(fully_parallel_load=True, stats=stats), **kw)
    return history, stats["bytes_read"]


def test_the_flag_is_megatrons_and_off_by_default():
    assert parse_args(MOCK)[1].checkpoint.ckpt_fully_parallel_load is False
    job = parse_args([*MOCK, "--ckpt-fully-parallel-load"])[1]
    assert job.checkpoint.ckpt_fully_parallel_load is True
    assert start_load(job, None)["fully_parallel_load"] is True  # (what pretrain and a rollback load with)


def test_saved_at_tp2_dp2_loaded_at_dp4_each_rank_reads_a_quarter(dist, tmp_path):
    """Plain data parallelism (Adam's state replicated): saved at TP=2 x DP=2, loaded at TP=1 x DP=4, where without
    the flag each rank reads the whole checkpoint; with it a quarter (within 1%), the four the whole once. The
    group is the data-parallel one with CP folded in (Megatron's): at CP=2 x DP=2 a quarter too; at PP=2 x DP=2
    each stage's two replicas split its tensors."""
    ckpt = str(tmp_path / "tp2")
    original = dist(4, run, {}, P(tensor_model_parallel_size=2), 2, ckpt)
    total = _tensor_bytes(find_checkpoint(ckpt))
    for layout in (P(), P(context_parallel_size=2)):
        for read0, read1, _ in dist(4, load_both_ways, ckpt, layout, {}, False):
            assert read0 == total, (read0, total)
            assert abs(read1 - total / 4) <= 0.01 * total / 4, (layout, read1, total)
    reads = dist(4, load_both_ways, ckpt, P(pipeline_model_parallel_size=2), {}, False)
    assert sum(r[1] for r in reads) == total
    for read0, read1, _ in reads:
        assert abs(read1 - read0 / 2) <= 0.01 * read0 / 2, (read0, read1)
    resumed = dist(4, resume_with_flag, P(), ckpt)
    assert sum(read for _, read in resumed) == total
    continued = [h for h in original[0] if h[0] > SAVE_AT]
    for history, _ in resumed:
        _compare(history, continued, "tp1-dp4 with --ckpt-fully-parallel-load")


def test_distributed_optimizer_ranks_split_the_weights_too(dist, tmp_path):
    """Under the distributed optimizer each rank already read only its part of the state; with the flag the
    replicated weights are split as well: a quarter each (within 1%), the state's parts unchanged."""
    ckpt = str(tmp_path / "zero1")
    original = dist(4, run, {}, P(), 2, ckpt, distributed_optimizer=True)
    total = _tensor_bytes(find_checkpoint(ckpt))
    reads = dist(4, load_both_ways, ckpt, P(), {}, True)
    for read0, read1, held in reads:
        own_state = read0 - held  # (without the flag: every weight, and this rank's part of the state)
        assert abs((read1 - own_state) - held / 4) <= 0.01 * held / 4, (read0, read1, held)
    assert sum(r[1] for r in reads) == total
    resumed = dist(4, resume_with_flag, P(), ckpt, distributed_optimizer=True)
    continued = [h for h in original[0] if h[0] > SAVE_AT]
    for (history, read), (_, read1, _) in zip(resumed, reads):
        assert read == read1
        _compare(history, continued, "dp4 distributed optimizer with --ckpt-fully-parallel-load")


def test_experts_split_over_the_expert_data_parallel_group(dist, tmp_path):
    """MoE at EP=2 x DP=4: the dense weights split four ways, each expert's between the two ranks that hold it
    (the expert-data-parallel group); the ranks read the checkpoint once between them, evenly (within 2%)."""
    ckpt = str(tmp_path / "moe")
    dist(4, run, MOE, P(expert_model_parallel_size=2), 2, ckpt)
    total = _tensor_bytes(find_checkpoint(ckpt))
    reads = dist(4, load_both_ways, ckpt, P(expert_model_parallel_size=2), MOE, False)
    assert sum(r[1] for r in reads) == total
    for read0, read1, _ in reads:
        assert read1 < read0 / 2 and abs(read1 - total / 4) <= 0.02 * total / 4, (read0, read1, total)


def load_with_one_file_corrupted(root: str, missing: bool):
    ctx = get_context(P())
    model = build_model(llama_config(num_layers=2), ctx)
    _, opt = wrap_for_training(model, ctx, OPTIM)
    start = time.time()
    try:
        load_checkpoint(find_checkpoint(root), model, opt, LRScheduler(OPTIM, TOTAL), ctx, fully_parallel_load=True)
        raised = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        raised = f"{type(e).__name__}: {e}"
    return raised, time.time() - start


def test_a_bad_file_stops_every_rank_before_the_exchange(dist, tmp_path):
    """Saved at TP=2, loaded at DP=2 with the flag (both ranks read parts of both tensor files): a corrupted file
    (caught by the rank whose share of checksums holds it) and a missing one stop every rank at once with one
    line, none waiting in the exchange's all-gathers."""
    root = str(tmp_path / "ck")
    dist(2, save_at_tp2, root)
    path = find_checkpoint(root)
    shard = os.path.join(path, "tensors_r00001.safetensors")
    data = bytearray(open(shard, "rb").read())
    data[-100] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    (r0, t0), (r1, t1) = dist(2, load_with_one_file_corrupted, root, False)
    assert r1 is not None and r1.startswith("ConfigError") and "sha256" in r1 and shard in r1, r1
    assert r0 == f"ConfigError: loading {path} failed on another rank (its error says why)", r0
    os.remove(shard)
    for raised, seconds in dist(2, load_with_one_file_corrupted, root, True):
        assert raised is not None and raised.startswith("ConfigError") and "\n" not in raised, raised
        assert seconds < 20
    assert max(t0, t1) < 20, (t0, t1)


def exchange_with_one_tensor_more_on_rank0():
    from megatron_lite.checkpoint.parallel_load import SplitLoad, _Share

    split = SplitLoad(get_context(P()), enabled=True)
    if torch.distributed.get_rank() == 0:  # (what a bug would do: the replicas would pair up the wrong bytes)
        split._shares[False].append(_Share(torch.zeros(4), torch.zeros(2), None))
    try:
        split.exchange()
    except RuntimeError as e:
        return str(e)


def test_replicas_disagreeing_on_what_to_exchange_stop_rather_than_hang(dist):
    for raised in dist(2, exchange_with_one_tensor_more_on_rank0):
        assert raised is not None and "hold different tensors to load" in raised, raised
