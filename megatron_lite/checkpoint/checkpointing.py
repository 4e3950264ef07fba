"""Save and load everything a run needs to resume exactly: model weights, fp32 main weights, Adam moments
and step, LR schedule, loss scale, iteration, consumed samples, RNG states and the configs.

Saving: every rank writes the pieces it owns into <save>/iter_N.tmp; after a barrier rank 0 writes
metadata.json, renames the directory to iter_N and only then rewrites the `latest` tracker. A job killed
mid-save leaves the previous checkpoint and the tracker pointing at it.

Loading reads, for each tensor this rank needs, the ranges of the full tensor from whichever pieces cover
them, so the reader's layout need not be the writer's.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_lite.checkpoint.format import (
    FORMAT,
    TRACKER,
    Piece,
    atomic_write,
    atomic_write_json,
    atomic_write_text,
    cpu_contiguous,
    full_shape,
    iteration_dir,
    local_pieces,
    read_tracker,
    replace_dir,
)
from megatron_lite.config import ConfigError
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.parameters import named_param_meta, owns_copy


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0


def _barrier(ctx: ParallelContext) -> None:
    if ctx.world_size > 1:
        dist.barrier()


def _state_tensors(model, optimizer) -> dict[str, list]:
    """kind -> [(global name, local tensor, meta)] for every tensor that is saved."""
    out: dict[str, list] = {"model": [], "main": [], "exp_avg": [], "exp_avg_sq": []}
    main_of = optimizer.main_of if optimizer else {}
    for name, p, meta in named_param_meta(model):
        gname = model.global_name(name)
        out["model"].append((gname, p, meta))
        if optimizer is None or id(p) not in main_of:  # frozen (e.g. the MoE expert bias): weights only
            continue
        main = main_of[id(p)]
        if main is not p:
            out["main"].append((gname, main, meta))
        state = optimizer.inner.state.get(main, {})
        for kind in ("exp_avg", "exp_avg_sq"):
            if kind in state:
                out[kind].append((gname, state[kind], meta))
    return out


def _adam_step(optimizer) -> int:
    for state in optimizer.inner.state.values():
        if "step" in state:
            return int(float(state["step"]))
    return 0


def save_checkpoint(
    root: str, state: TrainState, model, optimizer, scheduler, ctx: ParallelContext, job_dict: dict
) -> str:
    final = iteration_dir(root, state.iteration)
    tmp = final + ".tmp"
    if ctx.rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier(ctx)
    tensors, index = {}, {}
    fname = f"tensors_r{ctx.rank:05d}.safetensors"
    for kind, entries in _state_tensors(model, optimizer).items():
        for gname, t, meta in entries:
            if not owns_copy(meta, ctx):
                continue
            rec = {
                "shape": full_shape(tuple(t.shape), meta),
                "dtype": str(t.dtype).removeprefix("torch."),
                "dim": 0,
                "pieces": [],
            }
            for pc in local_pieces(tuple(t.shape), meta):
                key = f"{kind}/{gname}@{pc.full_start}"
                tensors[key] = cpu_contiguous(t.narrow(pc.dim, pc.local_start, pc.length))
                rec["dim"] = pc.dim
                rec["pieces"].append({"file": fname, "key": key, "start": pc.full_start, "length": pc.length})
            index[f"{kind}/{gname}"] = rec
    if tensors:
        atomic_write(os.path.join(tmp, fname), lambda path: save_file(tensors, path))
    atomic_write_json(os.path.join(tmp, f"index_r{ctx.rank:05d}.json"), index)
    rng = {"cpu": torch.get_rng_state(), **{f"tracker/{k}": v for k, v in ctx.rng.get_states().items()}}
    if torch.cuda.is_available() and ctx.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(ctx.device)
    atomic_write(
        os.path.join(tmp, f"rng_r{ctx.rank:05d}.safetensors"),
        lambda path: save_file({k: v.contiguous() for k, v in rng.items()}, path),
    )
    _barrier(ctx)
    if ctx.rank == 0:
        meta = {
            "format": FORMAT,
            "iteration": state.iteration,
            "consumed_samples": state.consumed_samples,
            "config": job_dict,
            "layout": {"world_size": ctx.world_size, **{k: g.size for k, g in ctx.groups.items()}},
            "scheduler": scheduler.state_dict() if scheduler else None,
            "grad_scaler": optimizer.scaler.state_dict() if optimizer and optimizer.scaler else None,
            "adam_step": _adam_step(optimizer) if optimizer else 0,
        }
        atomic_write_json(os.path.join(tmp, "metadata.json"), meta)
        replace_dir(tmp, final)
        atomic_write_text(os.path.join(root, TRACKER), str(state.iteration))
    _barrier(ctx)
    return final


# Loading ----------------------------------------------------------------------------------------
def find_checkpoint(root: str | None) -> str | None:
    """The newest complete checkpoint directory under `root`; None when `root` is missing or empty.
    A directory that holds something else is a one-line error."""
    if not root or not os.path.isdir(root) or not os.listdir(root):
        return None
    try:
        iteration = read_tracker(root)
    except ValueError as e:
        raise ConfigError(f"--load {root}: {e}") from None
    if iteration is None:
        raise ConfigError(
            f"--load {root} is not a megatron_lite checkpoint directory (no {TRACKER}); point --load at the "
            "--save directory of a run, or at an empty directory to start from scratch"
        )
    path = iteration_dir(root, iteration)
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise ConfigError(f"--load {root}: {TRACKER} names iteration {iteration} but {path}/metadata.json is missing")
    return path


def read_metadata(path: str) -> dict:
    meta = json.load(open(os.path.join(path, "metadata.json")))
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path}/metadata.json has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


class _Reader:
    """Reads ranges of full tensors from the pieces every rank of the saving job wrote."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.index: dict[str, dict] = {}
        for f in sorted(glob.glob(os.path.join(path, "index_r*.json"))):
            for name, rec in json.load(open(f)).items():
                if name in self.index:
                    self.index[name]["pieces"] += rec["pieces"]
                else:
                    self.index[name] = rec
        self._files: dict[str, object] = {}

    def _open(self, fname: str):
        if fname not in self._files:
            full = os.path.join(self.path, fname)
            try:
                self._files[fname] = safe_open(full, framework="pt")
            except Exception as e:  # a truncated or corrupt file
                raise ConfigError(f"checkpoint file {full} cannot be read ({type(e).__name__}: {e})") from None
        return self._files[fname]

    def read(self, name: str, start: int, length: int, dim: int) -> torch.Tensor:
        rec = self.index.get(name)
        if rec is None:
            raise ConfigError(f"checkpoint {self.path} has no tensor {name}")
        parts, pos = [], start
        for pc in sorted(rec["pieces"], key=lambda p: p["start"]):
            lo, hi = pc["start"], pc["start"] + pc["length"]
            if hi <= pos or lo >= start + length:
                continue
            if lo > pos:
                break
            take = min(hi, start + length) - pos
            sl = self._open(pc["file"]).get_slice(pc["key"])
            index = [slice(None)] * len(rec["shape"])
            index[dim] = slice(pos - lo, pos - lo + take)
            parts.append(sl[tuple(index)])
            pos += take
        if pos != start + length:
            raise ConfigError(f"checkpoint {self.path}: {name} lacks rows [{pos}, {start + length}) along dim {dim}")
        return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]

    def fill(self, name: str, target: torch.Tensor, pieces: list[Piece]) -> None:
        with torch.no_grad():
            target.zero_()  # vocabulary padding is not stored: it stays zero
            for pc in pieces:
                data = self.read(name, pc.full_start, pc.length, pc.dim)
                target.narrow(pc.dim, pc.local_start, pc.length).copy_(data)


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
) -> TrainState:
    meta = read_metadata(path)
    reader = _Reader(path)
    entries = _state_tensors(model, optimizer if load_optim else None)
    for gname, t, pmeta in entries["model"]:
        reader.fill(f"model/{gname}", t, local_pieces(tuple(t.shape), pmeta))
    if optimizer is not None and load_optim and not finetune:
        main_of = optimizer.main_of
        for name, p, pmeta in named_param_meta(model):
            main = main_of.get(id(p), p)  # frozen parameters are not in the optimizer
            if main is not p:
                key = f"main/{model.global_name(name)}"
                if key in reader.index:
                    reader.fill(key, main, local_pieces(tuple(main.shape), pmeta))
                else:
                    with torch.no_grad():
                        main.copy_(p)
        _load_adam(reader, model, optimizer, meta["adam_step"])
        if scheduler is not None and meta.get("scheduler"):
            scheduler.load_state_dict(meta["scheduler"])
        if optimizer.scaler is not None and meta.get("grad_scaler"):
            optimizer.scaler.load_state_dict(meta["grad_scaler"])
    elif optimizer is not None:
        with torch.no_grad():
            for p, main in zip(optimizer.params, optimizer.main_params):
                if main is not p:
                    main.copy_(p)
    same_layout = meta["layout"].get("world_size") == ctx.world_size and all(
        meta["layout"].get(k) == g.size for k, g in ctx.groups.items()
    )
    rng_file = os.path.join(path, f"rng_r{ctx.rank:05d}.safetensors")
    if load_rng and not finetune and same_layout and os.path.exists(rng_file):
        with safe_open(rng_file, framework="pt") as f:
            torch.set_rng_state(f.get_tensor("cpu"))
            ctx.rng.set_states(
                {k.removeprefix("tracker/"): f.get_tensor(k) for k in f.keys() if k.startswith("tracker/")}
            )
            if "cuda" in f.keys() and ctx.device.type == "cuda":
                torch.cuda.set_rng_state(f.get_tensor("cuda"), ctx.device)
    if finetune:
        return TrainState(0, 0)
    return TrainState(int(meta["iteration"]), int(meta["consumed_samples"]))


def _load_adam(reader: _Reader, model, optimizer, step: int) -> None:
    inner = optimizer.inner
    sd = inner.state_dict()
    index_of = {}
    for group_sd, group in zip(sd["param_groups"], inner.param_groups):
        for idx, p in zip(group_sd["params"], group["params"]):
            index_of[id(p)] = idx
    state = {}
    main_of = optimizer.main_of
    for name, p, pmeta in named_param_meta(model):
        gname = model.global_name(name)
        if id(p) not in main_of or f"exp_avg/{gname}" not in reader.index:
            continue
        main = main_of[id(p)]
        entry = {"step": torch.tensor(float(step))}
        for kind in ("exp_avg", "exp_avg_sq"):
            t = torch.zeros_like(main)
            reader.fill(f"{kind}/{gname}", t, local_pieces(tuple(main.shape), pmeta))
            entry[kind] = t
        state[index_of[id(main)]] = entry
    sd["state"] = state
    inner.load_state_dict(sd)
