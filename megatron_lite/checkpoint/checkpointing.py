"""Save and load everything a run needs to resume exactly: model weights, fp32 main weights, Adam moments
and step, LR schedule, loss scale, iteration, consumed samples, RNG states and the configs.

Saving: every rank writes the pieces it owns into <save>/iter_N.tmp; after a barrier rank 0 writes
metadata.json, renames the directory to iter_N and only then rewrites the `latest` tracker. A job killed
mid-save leaves the previous checkpoint and the tracker pointing at it.

Loading reads, for each tensor this rank needs, the ranges of the full tensor from whichever pieces cover
them, so the reader's layout need not be the writer's.
"""

from __future__ import annotations

import os
import shutil
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_lite.checkpoint.atomic import atomic_write, atomic_write_json
from megatron_lite.checkpoint.boxes import flat_parts
from megatron_lite.checkpoint.compatibility import (
    check_adapters_have_a_home,
    check_model_structure,
    check_optimizer_state,
)
from megatron_lite.checkpoint.compatibility import model_config_from_dict as model_config_from_dict
from megatron_lite.checkpoint.format import FORMAT, cpu_contiguous, file_digest, full_shape, iteration_dir, publish

# (find_checkpoint, read_metadata and same_directory are imported from here too)
from megatron_lite.checkpoint.lookup import find_checkpoint, read_metadata, same_directory  # noqa: F401
from megatron_lite.checkpoint.parallel_load import SplitLoad
from megatron_lite.checkpoint.reader import Reader
from megatron_lite.config import ConfigError
from megatron_lite.optimizer.optimizer import any_rank, state_kinds
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.parameters import ParamMeta, hold_copy, named_param_meta, replica_group
from megatron_lite.tensor_parallel.fp8 import fp8_state_tensors


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    consumed_valid_samples: int = 0  # validation samples evaluated so far: the next evaluation goes on from there
    # the training loop's guards' state (resilience/supervisor.py: the loss-spike check's history), so a restart
    # checks the iterations after the checkpoint as the run that saved it would have
    guards: dict = field(default_factory=dict)
    skipped_samples: int = 0  # of consumed_samples, those --iterations-to-skip dropped (Megatron's skipped samples)


# (a tensor each replica holds whole, fp8 scaling state: a dense layer's, an expert's)
REPLICATED = {False: ParamMeta(("zeros",)), True: ParamMeta(("zeros",), expert=True)}


def _on_every_rank(ctx: ParallelContext, work, what: str, then: str = "; the checkpoint was not published"):
    """`work()` on this rank, then one tiny all-reduce in place of a barrier: when it failed on a rank (a full
    disk, a directory it may not write), that rank raises its error and every other rank a line saying so,
    where they had waited in the barrier until the timeout."""
    error = None
    try:
        result = work()
    except Exception as e:  # noqa: BLE001 - raised again below, after the others know
        error, result = e, None
    failed = any_rank(error is not None, ctx)
    if error is not None:
        raise error
    if failed:
        raise (RuntimeError if then else ConfigError)(f"{what} failed on another rank (its error says why){then}")
    return result


def _entries(model, optimizer, adapters_only: bool = False) -> list[tuple]:
    """(kind, global name, this rank's shape, meta, lo, flat values of [lo, lo + n), own) for every tensor range a
    checkpoint takes from this rank: the model's weights, the optimizer's main weights and state (whole, or the
    parts a sharded optimizer keeps), fp8 scaling state. `own`: no data-parallel replica holds the same range
    (FSDP2's shards, the distributed optimizer's parts), so this rank writes it; the rest the replicas share.
    No collective. `adapters_only`: a LoRA run that records its base checkpoint saves no frozen weight."""
    if optimizer is not None and hasattr(optimizer, "finish_param_sync"):
        optimizer.finish_param_sync()  # --overlap-param-gather: the model's weights must be current
    out, named = [], {}
    for name, p, meta in named_param_meta(model):
        if adapters_only and not p.requires_grad:
            continue
        gname = model.global_name(name)
        named[id(p)] = gname, meta
        if hasattr(p, "device_mesh"):  # FSDP2: each rank its own rows, never the gathered tensor
            from megatron_lite.distributed.fsdp import flat_range

            out.append(("model", gname, tuple(p.shape), meta, flat_range(p)[0], p.to_local().reshape(-1), True))
        else:
            out.append(("model", gname, tuple(p.shape), meta, 0, p.reshape(-1), False))
    for p, lo, values in optimizer.state_values() if optimizer is not None else ():
        gname, meta = named.get(id(p), (None, None))
        for kind, t in values.items() if gname is not None else ():
            out.append((kind, gname, tuple(p.shape), meta, lo, t.reshape(-1), optimizer.sharded))
    for gname, t, expert in fp8_state_tensors(model):  # (delayed scaling's)
        out.append(("fp8", gname, tuple(t.shape), REPLICATED[expert], 0, t.reshape(-1), False))
    return out


def _saved_parts(optimizer, scheduler, save_optim: bool):
    """(optimizer, scheduler) a checkpoint takes its state from: none with --no-save-optim, once the model holds
    its current weights (--overlap-param-gather may still be gathering them)."""
    if save_optim:
        return optimizer, scheduler
    if optimizer is not None and hasattr(optimizer, "finish_param_sync"):
        optimizer.finish_param_sync()
    return None, None


@dataclass
class _Snapshot:
    """One rank's share of a checkpoint, copied to CPU memory: what the writer (possibly a background
    thread) puts on disk while training goes on."""

    rank: int
    tensors: dict[str, torch.Tensor]
    index: dict[str, dict]
    rng: dict[str, torch.Tensor]


def _snapshot(model, optimizer, ctx: ParallelContext, job_dict: dict, save_rng: bool = True) -> _Snapshot:
    tensors, index = {}, {}
    fname = f"tensors_r{ctx.rank:05d}.safetensors"
    adapters_only = bool((job_dict.get("lora") or {}).get("base"))  # (training.resume.lora_base)
    # The data-parallel replicas of a range share the writing, each range written by the replica with the fewest
    # bytes so far (every replica holds the same entries in the same order, so all choose alike): a save's time
    # and host memory fall with DP, as Megatron's fully parallel save (data-parallel rank 0 wrote everything)
    written: dict[bool, list[int]] = {}
    for kind, gname, shape, meta, lo, flat, own in _entries(model, optimizer, adapters_only):
        if not hold_copy(meta, ctx) or not flat.numel():
            continue
        if not own:
            group = replica_group(meta, ctx)
            # (experts apart: their replicas, one expert-parallel rank's, differ from the dense pieces' replicas)
            load = written.setdefault(meta.expert, [0] * group.size)
            writer = load.index(min(load))
            load[writer] += flat.numel() * flat.element_size()
            if writer != group.rank:
                continue
        rec = index.setdefault(f"{kind}/{gname}", {
            "shape": full_shape(shape, meta), "dtype": str(flat.dtype).removeprefix("torch."), "pieces": []
        })  # fmt: skip
        for part, full in flat_parts(flat, shape, meta, lo):
            key = f"{kind}/{gname}@{','.join(map(str, full))}"
            tensors[key] = cpu_contiguous(part)
            rec["pieces"].append({"file": fname, "key": key, "starts": list(full), "lengths": list(part.shape)})
    if not save_rng:  # --no-save-rng
        return _Snapshot(ctx.rank, tensors, index, {})
    rng = {"cpu": torch.get_rng_state(), **{f"tracker/{k}": v for k, v in ctx.rng.get_states().items()}}
    if torch.cuda.is_available() and ctx.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(ctx.device)
    rng = {k: v.detach().cpu().contiguous().clone() for k, v in rng.items()}
    return _Snapshot(ctx.rank, tensors, index, rng)


def _write_rank_files(tmp: str, snap: _Snapshot) -> None:
    """This rank's tensor file, RNG file and index (with the files' sizes and checksums), each atomic."""
    files = {}
    if snap.tensors:
        fname = f"tensors_r{snap.rank:05d}.safetensors"
        atomic_write(os.path.join(tmp, fname), lambda path: save_file(snap.tensors, path))
        files[fname] = file_digest(os.path.join(tmp, fname))
    if snap.rng:
        fname = f"rng_r{snap.rank:05d}.safetensors"
        atomic_write(os.path.join(tmp, fname), lambda path: save_file(snap.rng, path))
        files[fname] = file_digest(os.path.join(tmp, fname))
    atomic_write_json(os.path.join(tmp, f"index_r{snap.rank:05d}.json"), {"tensors": snap.index, "files": files})


def _metadata(state: TrainState, optimizer, scheduler, ctx: ParallelContext, job_dict: dict) -> dict:
    return {
        "format": FORMAT,
        "iteration": state.iteration,
        "consumed_samples": state.consumed_samples,
        "consumed_valid_samples": state.consumed_valid_samples,
        "guards": state.guards,
        "skipped_samples": state.skipped_samples,
        "config": job_dict,
        "layout": {"world_size": ctx.world_size, **{k: g.size for k, g in ctx.groups.items()}},
        "scheduler": scheduler.state_dict() if scheduler else None,
        "grad_scaler": optimizer.scaler.state_dict() if optimizer and optimizer.scaler else None,
        "adam_step": optimizer.steps_taken if optimizer else 0,
        "optimizer_saved": optimizer is not None,
    }


def _prepare_tmp(root: str, iteration: int, ctx: ParallelContext, own_root: bool = False) -> str:
    """iter_N.tmp under `root`, made afresh by rank 0 (`own_root`: each rank's in its own root), every rank told."""
    tmp = iteration_dir(root, iteration) + ".tmp"

    def make() -> None:
        if own_root or ctx.rank == 0:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)

    _on_every_rank(ctx, make, f"making {tmp}")
    return tmp


def save_checkpoint(
    root: str,
    state: TrainState,
    model,
    optimizer,
    scheduler,
    ctx: ParallelContext,
    job_dict: dict,
    *,
    keep_last: int | None = None,
    retain_interval: int | None = None,
    save_optim: bool = True,
    save_rng: bool = True,
) -> str:
    """Save synchronously: every rank writes its files into iter_N.tmp, then rank 0 publishes it.
    `save_optim` False (--no-save-optim): the weights without the optimizer state and LR schedule; `save_rng`
    False (--no-save-rng): no random-number-generator states."""
    optimizer, scheduler = _saved_parts(optimizer, scheduler, save_optim)
    tmp = _prepare_tmp(root, state.iteration, ctx)
    snap = _snapshot(model, optimizer, ctx, job_dict, save_rng)  # (collectives with the distributed optimizer)
    _on_every_rank(ctx, lambda: _write_rank_files(tmp, snap), f"writing {tmp}")
    final = iteration_dir(root, state.iteration)
    meta = _metadata(state, optimizer, scheduler, ctx, job_dict)
    _on_every_rank(
        ctx, lambda: publish(root, tmp, meta, keep_last, retain_interval) if ctx.rank == 0 else None,
        f"publishing {final}",
    )  # fmt: skip
    return final


class AsyncSaver:
    """--async-save: the state is copied to CPU memory at the save (the only pause training sees) and a
    background thread on each rank writes it. Each iteration `poll` asks every rank (one tiny all-reduce,
    only while a save is in flight) whether its writer has finished; once all have, rank 0 publishes the
    checkpoint. Until then the `latest` tracker still names the previous checkpoint, so a job killed
    meanwhile resumes from that one."""

    def __init__(
        self, root: str, ctx: ParallelContext, keep_last: int | None = None, retain_interval: int | None = None
    ) -> None:
        self.root, self.ctx, self.keep_last, self.retain_interval = root, ctx, keep_last, retain_interval
        self.share_ctx = ctx  # (the layout the snapshot is taken under: non_persistent.LocalSaver's is its own)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending: tuple[str, dict] | None = None

    def save(
        self, state: TrainState, model, optimizer, scheduler, job_dict: dict, save_optim=True, save_rng=True
    ) -> str | None:
        """Start saving; returns the previous checkpoint's directory if this had to publish it first (the parts
        saved as in save_checkpoint)."""
        previous = self.finish()  # one save in flight at a time
        optimizer, scheduler = _saved_parts(optimizer, scheduler, save_optim)
        tmp = self._prepare(state.iteration)
        snap = _snapshot(model, optimizer, self.share_ctx, job_dict, save_rng)
        meta = _metadata(state, optimizer, scheduler, self.ctx, job_dict)
        self._pending = (tmp, meta)
        self._error = None

        def write() -> None:
            try:
                _write_rank_files(tmp, snap)
            except BaseException as e:  # noqa: B036 - reported by poll on every rank
                self._error = e

        self._thread = threading.Thread(target=write, name=f"async-save-{state.iteration}", daemon=True)
        self._thread.start()
        return previous

    def poll(self, wait: bool = False) -> str | None:
        """Publish the in-flight checkpoint if every rank has written its files (waiting for that when
        `wait`); returns the published directory, or None. Every rank must call it at the same points."""
        if self._pending is None:
            return None
        if wait:
            self._thread.join()
        flags = torch.tensor(
            [0.0 if self._thread.is_alive() else 1.0, 1.0 if self._error else 0.0], device=self.ctx.device
        )
        if self.ctx.world_size > 1:
            done = flags[:1].clone()
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            failed = flags[1:].clone()
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            flags = torch.cat([done, failed])
        if flags[1].item() > 0:
            tmp, meta = self._pending
            self._pending = None
            mine = f": {type(self._error).__name__}: {self._error}" if self._error else ""
            raise RuntimeError(f"the save of iteration {meta['iteration']} into {tmp} failed on a rank{mine}")
        if flags[0].item() < 1:
            return None
        tmp, meta = self._pending
        self._pending = None
        final = iteration_dir(self.root, meta["iteration"])
        _on_every_rank(self.ctx, lambda: self._publish(tmp, meta), f"publishing {final}")
        self._published(final)
        return final

    def finish(self) -> str | None:
        return self.poll(wait=True)

    # (overridden by non_persistent.LocalSaver, whose ranks each publish a directory of their own)
    def _prepare(self, iteration: int) -> str:
        return _prepare_tmp(self.root, iteration, self.ctx)

    def _publish(self, tmp: str, meta: dict) -> None:
        if self.ctx.rank == 0:
            publish(self.root, tmp, meta, self.keep_last, self.retain_interval)

    def _published(self, final: str) -> None:
        pass


# Loading ----------------------------------------------------------------------------------------
def _fresh_optimizer(optimizer, scheduler) -> None:
    """Main weights from the model, and optimizer state, LR schedule and loss scale as a new run's: a rollback
    to a start loaded without them (--no-load-optim, --finetune, or a checkpoint that holds none) forgets the
    pass it goes back from."""
    optimizer.reset_state()
    if scheduler is not None:
        scheduler.num_steps = scheduler.position = 0


def saved_under_this_layout(meta: dict, ctx: ParallelContext) -> bool:
    """Whether a checkpoint (its metadata) was saved with this world and these group sizes: each rank's random
    states are restored only then. Not the embedding group's: rank 0 wrote its own (2 with a pipeline), and a
    middle stage's is 1 (from a review: those stages restarted their dropout streams on a same-layout resume);
    the pipeline's size decides it."""
    return meta["layout"].get("world_size") == ctx.world_size and all(
        meta["layout"].get(k) == g.size for k, g in ctx.groups.items() if k != "embedding"
    )


def _read(
    path: str, model, optimizer, ctx: ParallelContext, with_optim: bool, with_rng: bool, skip_frozen: bool, split,
    main_only: bool = False,
):  # fmt: skip
    """load_checkpoint's reads, no collective among them: the model's weights (filled in place), the optimizer's
    state by parameter (`with_optim`; `main_only`: its main weights alone) and this rank's RNG states
    (`with_rng`, same layout only). `split` (a SplitLoad): with --ckpt-fully-parallel-load, replicated tensors get
    only this rank's part until its exchange."""
    meta = read_metadata(path)
    check_model_structure(path, meta, model)
    if with_optim:
        check_optimizer_state(path, meta, optimizer.config)
    # (the ranks of a load split the files' checksums; a local non-persistent checkpoint's files are its rank's own)
    reader = Reader(path, meta, share=(0, 1) if meta.get("local") else (ctx.rank, ctx.world_size))
    check_adapters_have_a_home(path, reader, model)
    for name, p, pmeta in named_param_meta(model):
        key = f"model/{model.global_name(name)}"
        if key not in reader.index and (".lora." in name or (skip_frozen and not p.requires_grad)):
            continue  # LoRA adapters on a base checkpoint keep their initialisation
        stored, mine = (reader.index.get(key) or {}).get("shape"), full_shape(tuple(p.shape), pmeta)
        if stored is not None and list(stored) != mine:  # (reading a range of a larger tensor would not fail)
            raise ConfigError(f"{path}: {key[6:]} is {list(stored)} in the checkpoint but {mine} in this model")
        if p.dtype == torch.float32 and "main/" + key[6:] in reader.index:
            key = "main/" + key[6:]  # (a --bf16 run's: fp32 weights from its main weights, not their rounding)
        if hasattr(p, "device_mesh"):  # FSDP2: this rank's rows alone
            from megatron_lite.distributed.fsdp import flat_range

            with torch.no_grad():
                p.to_local().view(-1).copy_(reader.read_flat(key, tuple(p.shape), pmeta, *flat_range(p)))
            continue
        split.fill(reader, key, p, pmeta)
    for gname, t, expert in fp8_state_tensors(model):  # (a checkpoint without them: delayed scaling starts afresh)
        if (stored := (reader.index.get(f"fp8/{gname}") or {}).get("shape")) is None:
            continue

        def keep(full: torch.Tensor, t: torch.Tensor = t) -> None:
            with torch.no_grad():  # (another --fp8-amax-history-len: its newest iterations, as many as it keeps)
                t.zero_()
                t[: min(len(t), len(full))] = full[: len(t)]

        full = torch.zeros(stored, dtype=t.dtype, device=t.device)
        split.fill(reader, f"fp8/{gname}", full, REPLICATED[expert], then=keep)
    # The optimizer's main weights and state: only the ranges this rank keeps are read (a distributed
    # optimizer's parts: about 1/DP of them), in fp32 on the host until the optimizer takes them.
    values, replicated = {}, (with_optim or main_only) and not optimizer.sharded
    named = {id(p): (model.global_name(name), pmeta) for name, p, pmeta in named_param_meta(model)}
    for p, lo, hi in optimizer.state_ranges() if with_optim or main_only else ():
        gname, pmeta = named[id(p)]
        d = {}
        if main_only and f"model/{gname}" not in reader.index:  # (LoRA's new adapters on a base checkpoint)
            values[(id(p), lo)] = {}
            continue
        for kind in ("main", *(state_kinds(optimizer.config) if with_optim else ())):
            if f"{kind}/{gname}" in reader.index:
                d[kind] = split.read_flat(reader, f"{kind}/{gname}", tuple(p.shape), pmeta, lo, hi, replicated)
        if "main" not in d and p.dtype != torch.float32:  # (an fp32 run's main weights are its weights)
            if main_only and reader.index[f"model/{gname}"]["dtype"] != "float32":
                raise ConfigError(
                    f"--load-main-params-from-ckpt: {path} holds no fp32 main weights for {gname} (saved with "
                    "--no-save-optim); drop the flag to take them from its weights"
                )
            # Saved by an fp32-weight run (or FSDP2, whose fp32 shards are the main weights): the stored
            # weights are the main weights; read them at full precision, not from the bf16 copy.
            d["main"] = split.read_flat(reader, f"model/{gname}", tuple(p.shape), pmeta, lo, hi, replicated)
        values[(id(p), lo)] = d
    rng, rng_name = None, f"rng_r{ctx.rank:05d}.safetensors"
    if with_rng and saved_under_this_layout(meta, ctx) and rng_name in reader.files:
        with safe_open(reader.verify(rng_name), framework="pt") as f:
            rng = {k: f.get_tensor(k) for k in f.keys()}
    reader.verify_share()  # (every file checked by some rank before any rank goes on: see load_checkpoint)
    return meta, values, rng, (reader.bytes_read, reader.bytes_hashed)


def load_checkpoint(
    path: str,
    model,
    optimizer,
    scheduler,
    ctx: ParallelContext,
    *,
    load_optim: bool = True,
    load_rng: bool = True,
    finetune: bool = False,
    skip_missing_frozen: bool = False,
    fully_parallel_load: bool = False,
    load_main_params: bool = False,
    stats: dict | None = None,
) -> TrainState:
    """`skip_missing_frozen`: frozen weights the checkpoint lacks keep their values (a QLoRA checkpoint holds
    the adapters; its base was loaded first). `fully_parallel_load` (--ckpt-fully-parallel-load): the
    data-parallel replicas split the reading of what they all hold, then exchange it (parallel_load.py).
    `load_main_params` (Megatron's --load-main-params-from-ckpt): where the optimizer state is not loaded, its
    fp32 main weights still are. `stats`, when given, gets `bytes_read`: the tensor bytes this rank read (under
    the distributed optimizer about 1/DP of the optimizer state's; with `fully_parallel_load` about 1/DP of the
    replicated weights' too), and `bytes_hashed`: the bytes it read to check checksums (its share of the files).
    Every read happens before any collective, and a failed one (a corrupted file, a missing piece) on any rank
    stops every rank, where the others had waited in the optimizer's collectives (or the exchange) until the
    timeout."""
    with_optim = optimizer is not None and load_optim and not finetune
    main_only = optimizer is not None and load_main_params and not with_optim
    split = SplitLoad(ctx, fully_parallel_load)
    meta, values, rng, (bytes_read, bytes_hashed) = _on_every_rank(
        ctx,
        lambda: _read(
            path, model, optimizer, ctx, with_optim, load_rng and not finetune, skip_missing_frozen, split, main_only
        ),
        f"loading {path}",
        then="",
    )
    split.exchange()  # (after the agreement: every rank's reads succeeded)
    if stats is not None:
        stats.update(bytes_read=bytes_read, bytes_hashed=bytes_hashed)
    if optimizer is not None:  # what the checkpoint does not hold, or is not loaded, starts as a new run's
        _fresh_optimizer(optimizer, scheduler)
    if with_optim:
        optimizer.load_state_values(values, meta["adam_step"])
        if scheduler is not None and meta.get("scheduler"):
            scheduler.load_state_dict(meta["scheduler"])
        if optimizer.scaler is not None and meta.get("grad_scaler"):
            optimizer.scaler.load_state_dict(meta["grad_scaler"])
    elif main_only:  # (no moments among the values: the state starts as a new run's, at step 0)
        optimizer.load_state_values(values, 0)
    if rng is not None:
        torch.set_rng_state(rng["cpu"])
        ctx.rng.set_states({k.removeprefix("tracker/"): v for k, v in rng.items() if k.startswith("tracker/")})
        if "cuda" in rng and ctx.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], ctx.device)
    if finetune:
        return TrainState(0, 0, 0)
    # (a checkpoint saved before the validation samples were counted starts them again)
    return TrainState(
        int(meta["iteration"]),
        int(meta["consumed_samples"]),
        int(meta.get("consumed_valid_samples", 0)),
        dict(meta.get("guards") or {}),
        int(meta.get("skipped_samples", 0)),
    )
