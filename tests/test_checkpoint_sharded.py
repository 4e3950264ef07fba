"""Sharded optimizers (the distributed optimizer, FSDP2, dist_muon) write and read only what each rank owns.

Before, a save all-gathered (or broadcast) the full optimizer state onto every rank's host and a load read the
full state on every rank, then kept its part: host memory for a 70B model's state on every rank. Now each rank
writes the boxes of the full tensors its parts cover (checkpoint/boxes.py) and reads only those. Measured here:
each rank's host-memory peak during a save (the kernel's high-water mark, /proc/self/status VmHWM, reset just
before) and the tensor bytes each rank reads at a load, at DP=4 against one process. The loaded runs continuing
exactly is shown by tests/test_checkpoint_reshard.py (saved under each, loaded under other layouts).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import shutil

import pytest
import torch

from megatron_lite.checkpoint.boxes import box_slices, flat_boxes, flat_start
from megatron_lite.checkpoint.checkpointing import _Snapshot, _write_rank_files
from megatron_lite.checkpoint.format import FORMAT, file_digest
from megatron_lite.checkpoint.reader import Reader
from megatron_lite.config import ConfigError, ParallelConfig

from dist_pool import get_context

SHAPES = [(7,), (3, 5), (4, 3, 5), (1, 6), (6, 1), (2, 3, 4, 5)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_flat_boxes_cover_exactly_the_flat_range(shape):
    """Every flat range [lo, hi) of a tensor is the boxes flat_boxes gives, in flat order (oracle: indexing an
    arange), each box starting at the flat index flat_start says."""
    n = math.prod(shape)
    t = torch.arange(n).view(shape)
    for lo in range(n + 1):
        for hi in range(lo, n + 1):
            parts = []
            for starts, lengths in flat_boxes(shape, lo, hi):
                part = t[box_slices(starts, lengths)].reshape(-1)
                assert part[0].item() == flat_start(shape, starts)
                parts.append(part)
            got = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
            assert torch.equal(got, torch.arange(lo, hi)), (shape, lo, hi)
            # a partial first row, whole rows, a partial last row: 2 per extra dimension plus one, at most
            assert len(parts) <= 2 * (len(shape) - 1) + 1


def _write_ranges(path: str, full: torch.Tensor, cuts: list[int], drop: int | None = None) -> dict:
    """`full` written as the flat ranges between `cuts`, one rank's files each (the checkpoint writer's own
    files and index), as a distributed optimizer's ranks write a parameter's parts; returns the metadata."""
    shape = tuple(full.shape)
    flat = full.reshape(-1)
    for rank, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        tensors, pieces = {}, []
        for starts, lengths in flat_boxes(shape, lo, hi):
            if rank == drop:
                continue
            key = f"main/w@{','.join(map(str, starts))}"
            at = flat_start(shape, starts)
            tensors[key] = flat[at : at + math.prod(lengths)].view(lengths).clone()
            pieces.append({"file": f"tensors_r{rank:05d}.safetensors", "key": key, "starts": list(starts),
                           "lengths": list(lengths)})  # fmt: skip
        index = {"main/w": {"shape": list(shape), "dtype": "float32", "pieces": pieces}}
        _write_rank_files(path, _Snapshot(rank, tensors, index, {}))
    indexes = [f for f in sorted(os.listdir(path)) if f.startswith("index_r")]
    return {"format": FORMAT, "files": {f: file_digest(os.path.join(path, f))["sha256"] for f in indexes}}


def test_any_box_reads_back_from_ranges_written_by_several_ranks(tmp_path):
    """A tensor written in flat ranges by three ranks reads back whole and box by box (oracle: indexing the
    tensor), each read taking only the bytes of its box; a missing range is a one-line error naming the box."""
    rng = random.Random(0)
    full = torch.randn(5, 7, 3)
    n = full.numel()
    meta = _write_ranges(str(tmp_path), full, [0, 23, 61, n])
    reader = Reader(str(tmp_path), meta)
    assert torch.equal(reader.read_full("main/w"), full)
    for _ in range(40):
        starts = tuple(rng.randrange(s) for s in full.shape)
        lengths = tuple(rng.randint(1, s - a) for s, a in zip(full.shape, starts))
        before = reader.bytes_read
        assert torch.equal(reader.read_box("main/w", starts, lengths), full[box_slices(starts, lengths)])
        assert reader.bytes_read - before == 4 * math.prod(lengths)
    lost = tmp_path / "lost"
    lost.mkdir()
    meta = _write_ranges(str(lost), full, [0, 23, 61, n], drop=1)
    with pytest.raises(ConfigError, match=r"main/w lacks part of the box \[0, 5\), \[0, 7\), \[0, 3\)"):
        Reader(str(lost), meta).read_full("main/w")


def _vm_hwm() -> int:
    """This process's resident-memory high-water mark in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def save_and_load(root: str, sharding: str) -> tuple[int, ...]:
    """After one step under `sharding` (adam: plain data parallelism; zero1: the distributed optimizer; fsdp2;
    muon; dist_muon), a save and a load into a new model and optimizer. Returns (the save's host-memory peak
    above the memory held before it, the tensor bytes the load read, the checkpoint's optimizer-state bytes, its
    model-weight bytes, the bytes the load read to check checksums, the checkpoint's file bytes)."""
    import torch.distributed as dist
    from test_train_equivalence import OPTIM

    from megatron_lite.checkpoint.checkpointing import TrainState, load_checkpoint, save_checkpoint
    from megatron_lite.data.mock import MockGPTDataset, collate
    from megatron_lite.data.samplers import micro_batch_indices
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.optimizer.lr_scheduler import LRScheduler
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.training.step import train_step
    from megatron_lite.training.wrap import wrap_for_training

    from models import llama_config

    P = ParallelConfig
    ctx = get_context(P()) if dist.is_initialized() else ParallelContext.virtual(P(), device=torch.device("cpu"))
    # big enough that the optimizer's state (12 bytes a parameter) outweighs the allocator's noise: 5.6M parameters
    config = llama_config(num_layers=4, hidden_size=256, ffn_hidden_size=768, num_attention_heads=8, vocab_size=2048)
    kw = {"adam": {}, "zero1": dict(use_distributed_optimizer=True), "fsdp2": dict(use_torch_fsdp2=True),
          "muon": dict(optimizer="muon"), "dist_muon": dict(optimizer="dist_muon")}[sharding]  # fmt: skip
    optim = dataclasses.replace(OPTIM, **kw)

    def build(seed: int):
        model = build_model(config, ctx, seed=seed)
        ddp, opt = wrap_for_training(model, ctx, optim)
        return model, ddp, opt

    model, ddp, opt = build(1)
    data = MockGPTDataset(config.vocab_size, 16, seed=1)
    idx = micro_batch_indices(0, 4, 1, ctx.dp.rank, ctx.dp.size)
    sched = LRScheduler(OPTIM, 10)
    train_step(ddp, opt, sched, [collate([data[i] for i in ix]) for ix in idx], ctx)
    job = {"model": dataclasses.asdict(config), "optimizer": dataclasses.asdict(optim)}
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # (freed memory back to the system: reused, it would not show)
    held = _vm_hwm()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # (the high-water mark starts again from what is resident now)
    held = min(held, _vm_hwm())
    path = save_checkpoint(root, TrainState(1, 4), model, opt, sched, ctx, job)
    peak = _vm_hwm() - held
    model2, _, opt2 = build(2)
    stats = {}
    load_checkpoint(path, model2, opt2, LRScheduler(OPTIM, 10), ctx, stats=stats)
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):  # (the load is the save's)
        a, b = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (p, q))
        assert torch.equal(a, b), name
    import json

    sizes = {"state": 0, "model": 0}
    for f in os.listdir(path):
        if f.startswith("index_r"):
            for name, rec in json.load(open(os.path.join(path, f)))["tensors"].items():
                n = sum(math.prod(pc["lengths"]) * 4 for pc in rec["pieces"])
                sizes["model" if name.startswith("model/") else "state"] += n
    files = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    return peak, stats["bytes_read"], sizes["state"], sizes["model"], stats["bytes_hashed"], files


def test_sharded_optimizers_save_and_load_only_their_own_share(dist, tmp_path):
    """At DP=4, a save under the distributed optimizer or FSDP2 raises a rank's host memory no more than one
    under plain data parallelism with Adam does (which writes the same share of the checkpoint, its replicas
    sharing the writing, and gathers nothing; before, every rank first gathered the full optimizer state: 2.5x
    and more), dist_muon's no more than plain muon's; and at a load each rank reads the model weights it holds
    plus its quarter of the optimizer state (FSDP2: a quarter of both), within 5% (dist_muon, which owns whole
    parameters: 15%), where a replicated optimizer's rank reads all of it; and the ranks check the files' sha256
    sums between them, each file read once for it (every rank hashed the whole checkpoint)."""
    runs = {mode: dist(4, save_and_load, str(tmp_path / mode), mode) for mode in SHARDINGS}
    for mode, baseline in SHARDINGS.items():
        hashed = [r[4] for r in runs[mode]]
        assert sum(hashed) == runs[mode][0][5], (mode, hashed)  # every file checked once, by one rank
        for rank, (peak, read, state, weights, _, _) in enumerate(runs[mode]):
            if baseline is None:  # replicated: every rank reads everything
                assert read == state + weights, (mode, read, state, weights)
                continue
            plain = max(r[0] for r in runs[baseline])
            assert peak <= 1.2 * plain + 2**21, f"{mode}: rank {rank}'s save peaked {peak / 2**20:.1f} MiB above " \
                f"its start, under {baseline} at most {plain / 2**20:.1f} MiB"  # fmt: skip
            want = (state + weights) / 4 if mode == "fsdp2" else weights + state / 4
            tol = 0.15 if mode == "dist_muon" else 0.05
            assert abs(read - want) <= tol * want, (mode, read, want, state, weights)


SHARDINGS = {"adam": None, "zero1": "adam", "fsdp2": "adam", "muon": None, "dist_muon": "muon"}  # (-> baseline)


def test_a_format_2_checkpoint_saved_under_tensor_parallelism_still_loads(dist, tmp_path):
    """Format 2's pieces were ranges along one dimension (dim 1 for a row-parallel weight's TP shards): a TP=2 x
    DP=2 checkpoint rewritten as format 2 reads the same tensors as the original, and a one-process run loaded
    from it continues as the original job."""
    from test_checkpoint_reliability import _as_format_2
    from test_checkpoint_reshard import SAVE_AT, _compare, run

    ckpt = tmp_path / "tp2"
    original = dist(4, run, {}, ParallelConfig(tensor_model_parallel_size=2), 2, str(ckpt))
    it = ckpt / f"iter_{SAVE_AT:07d}"
    v2 = tmp_path / "v2" / it.name
    shutil.copytree(it, v2)
    (v2.parent / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    _as_format_2(str(v2))
    import json

    new, old = (Reader(str(p), json.load(open(p / "metadata.json"))) for p in (it, v2))
    assert json.load(open(v2 / "metadata.json"))["format"] == "megatron_lite/2"
    assert any(t.get("dim") == 1 for t in json.load(open(v2 / "index_r00000.json"))["tensors"].values())
    for name in new.index:
        assert torch.equal(old.read_full(name), new.read_full(name)), name
    continued = [h for h in original[0] if h[0] > SAVE_AT]
    _compare(run({}, ParallelConfig(), 8, None, str(v2.parent)), continued, "format 2 at one process")


def test_overlapping_pieces_are_a_bad_index_not_a_gap(tmp_path):
    """Two pieces that overlap by as much as a third one misses add up to the box's size: the read would return
    the missing part uninitialised. Such an index (no writer makes one) is a one-line error."""
    full = torch.randn(6, 4)
    meta = _write_ranges(str(tmp_path), full, [0, 8, 16, 24])
    index = tmp_path / "index_r00002.json"
    import json

    rec = json.load(open(index))
    piece = rec["tensors"]["main/w"]["pieces"][0]
    piece["starts"], piece["lengths"] = [1, 0], [2, 4]  # (rank 2 claims rows 1-2, which ranks 0 and 1 hold, not 4-5)
    json.dump(rec, open(index, "w"))
    meta["files"]["index_r00002.json"] = file_digest(str(index))["sha256"]
    with pytest.raises(ConfigError, match="main/w has overlapping pieces"):
        Reader(str(tmp_path), meta).read_full("main/w")
