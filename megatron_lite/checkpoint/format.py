"""The on-disk format: layout-free tensor pieces in safetensors, everything else in JSON. No pickle, so
loading a checkpoint never runs code.

Every tensor is stored as pieces of its full, unpadded form: a piece is a box of the full tensor (a start and
a length along each dimension; format 2 stored ranges along one dimension), with the full tensor's global shape
in the index. Each rank writes the pieces it owns (a distributed optimizer's parts of a parameter, which cut
rows anywhere, are a few boxes each: boxes.py), so the files depend on the layout but their meaning does not:
any other layout reads the boxes it needs from whichever pieces cover them. Fused tensors are stored in their
layout-free order (QKV grouped per query group; SwiGLU's fc1 as [gate; up], each rank writing a gate piece and
an up piece rather than its interleaved [gate_r; up_r]); vocabulary padding is never stored.

    <dir>/latest_checkpointed_iteration.txt   the newest complete iteration (written last)
    <dir>/iter_0000010/metadata.json          iteration, samples, configs, layout, scheduler, scaler, and
                                              the sha256 of every index file
    <dir>/iter_0000010/index_r00003.json      the pieces rank 3 wrote (name -> shape, dtype, pieces) and the
                                              size and sha256 of its tensor and RNG files
    <dir>/iter_0000010/tensors_r00003.safetensors
    <dir>/iter_0000010/rng_r00003.safetensors

The checksums chain from metadata.json to every file, so a truncated or corrupted file is found before a
single tensor is used, and the error names it.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
from dataclasses import dataclass

import torch

from megatron_lite.checkpoint.atomic import atomic_write_json, atomic_write_text, replace_dir
from megatron_lite.parameters import ParamMeta

FORMAT = "megatron_lite/3"
FORMAT_V2 = "megatron_lite/2"  # still read: pieces are ranges along one dimension (the record's "dim")
FORMAT_V1 = "megatron_lite/1"  # still read: no checksums, index files hold the tensor records only
READABLE = (FORMAT, FORMAT_V2, FORMAT_V1)
TRACKER = "latest_checkpointed_iteration.txt"
NON_PERSISTENT_SUBDIR = "non_persistent"  # Megatron's _NON_PERSISTENT_CKPT_SUBDIR, under --save


@dataclass(frozen=True)
class Piece:
    dim: int
    full_start: int  # offset along `dim` in the full tensor
    length: int
    local_start: int  # offset along `dim` in this rank's tensor


_ITER_DIR = re.compile(r"^iter_(\d{7,})(?:\.old)?$")  # .old: the whole copy a re-save killed mid-swap left


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def complete_iterations(root: str) -> list[int]:
    """Iterations with a finished checkpoint directory under `root` (not `.tmp` leftovers; an `.old` copy counts),
    oldest first."""
    out = set()
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = _ITER_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, "metadata.json")):
            out.add(int(m.group(1)))
    return sorted(out)


def file_digest(path: str) -> dict:
    """Size and sha256 of a file, read in 16 MiB blocks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
            size += len(block)
    return {"bytes": size, "sha256": h.hexdigest()}


# (how to: pretrain_gpt.py takes --ckpt-step, the tools take the iteration's directory, which had been told to use
# a flag they do not have)
_OLDER = " (its iter_NNNNNNN directory as the path, or --ckpt-step N in pretrain_gpt.py)"


def verify_file(path: str, expected: dict, checksum: bool = True) -> None:
    """A one-line error naming the file when its size or (`checksum`) its sha256 is not what the writer recorded."""
    from megatron_lite.config import ConfigError

    if not os.path.isfile(path):
        raise ConfigError(f"checkpoint file {path} is missing")
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        raise ConfigError(
            f"checkpoint file {path} is {size} bytes, the writer recorded {expected['bytes']}: the file is "
            f"truncated or was overwritten; load an older checkpoint{_OLDER}"
        )
    if checksum and file_digest(path)["sha256"] != expected["sha256"]:
        raise ConfigError(
            f"checkpoint file {path} fails its sha256 check: the file is corrupted; load an older checkpoint{_OLDER}"
        )


def local_pieces(shape: tuple[int, ...], meta: ParamMeta) -> list[Piece]:
    """The ranges of the full tensor that this rank's tensor holds (padding excluded)."""
    spec = meta.shard
    if spec is None:
        return [Piece(0, 0, shape[0], 0)]
    out, block_offset, local = [], 0, 0
    for size, padded in zip(spec.sizes, spec.padded_sizes):
        step = padded // spec.tp_size
        lo = meta.shard_rank * step
        real = max(0, min(lo + step, size) - lo)
        if real:
            out.append(Piece(spec.dim, block_offset + lo, real, local))
        local += step
        block_offset += size
    return out


def full_shape(shape: tuple[int, ...], meta: ParamMeta) -> list[int]:
    return list(shape) if meta.shard is None else list(meta.shard.full_shape(shape))


def read_tracker(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise ValueError(f"{path} holds {text!r}, not an iteration number")
    return int(text)


def cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().clone()


def publish(root: str, tmp: str, meta: dict, keep_last: int | None = None, retain_interval: int | None = None) -> str:
    """Rank 0, once every rank's files are in `tmp`: metadata.json (with the index files' checksums), the
    rename to iter_N, and only then the `latest` tracker; then the oldest checkpoints beyond `keep_last`, or,
    with `retain_interval` (Megatron's --save-retain-interval), the checkpoint the tracker named before unless
    its iteration is a multiple of the interval."""
    meta = dict(meta)
    previous = _tracked(root) if retain_interval else None
    indexes = sorted(glob.glob(os.path.join(tmp, "index_r*.json")))
    expected = meta["layout"].get("world_size", 1)
    if len(indexes) != expected:
        raise RuntimeError(f"{tmp} holds {len(indexes)} index files for {expected} ranks; not publishing it")
    meta["files"] = {os.path.basename(f): file_digest(f)["sha256"] for f in indexes}
    atomic_write_json(os.path.join(tmp, "metadata.json"), meta)
    final = iteration_dir(root, meta["iteration"])
    replace_dir(tmp, final)
    atomic_write_text(os.path.join(root, TRACKER), str(meta["iteration"]))
    if previous and previous != meta["iteration"] and previous % retain_interval:
        _delete(iteration_dir(root, previous))
    if keep_last:
        # Only checkpoints up to this one count: newer ones belong to a run the tracker was moved back from.
        upto = [i for i in complete_iterations(root) if i <= meta["iteration"]]
        for old in upto[:-keep_last]:
            _delete(iteration_dir(root, old))
    _sweep_leftovers(root, meta["iteration"])
    return final


def _tracked(root: str) -> int | None:
    try:
        return read_tracker(root)
    except (OSError, ValueError):  # (a tracker that names no iteration: nothing to delete)
        return None


def _delete(directory: str) -> None:
    """A checkpoint directory and its .old copy, renamed first: a deletion cut short leaves a leftover, swept
    by the next publish."""
    for path in (directory, directory + ".old"):
        if os.path.isdir(path):
            shutil.rmtree(path + ".del", ignore_errors=True)  # (an earlier one's, were N saved again)
            os.replace(path, path + ".del")
            shutil.rmtree(path + ".del", ignore_errors=True)


_LEFTOVER = re.compile(r"^iter_(\d{7,})(\.old|\.tmp|\.old\.del|\.del)$")


def unfinished_saves(root: str | None, after: int) -> list[str]:
    """The iter_N.tmp directories under `root` of iterations after `after`: saves stopped before they were
    published (a kill, a crash, a full disk), so never loaded; publishing N or a later iteration removes them."""
    names = sorted(os.listdir(root)) if root and os.path.isdir(root) else []
    return [n for n in names if (m := _LEFTOVER.match(n)) and m[2] == ".tmp" and int(m[1]) > after]


def iteration_of(path: str) -> int | None:
    """The iteration of a persistent checkpoint directory (iter_N or its .old copy), None for another path."""
    m = _ITER_DIR.match(os.path.basename(os.path.normpath(path)))
    return int(m[1]) if m else None


def _sweep_leftovers(root: str, upto: int) -> None:
    """What saves and deletions killed part-way left at or below the checkpoint just published (from a review:
    nothing removed them): unpublished .tmp directories of earlier iterations, the .old copy of a re-saved one,
    a deletion's remains. The tracker names a newer complete checkpoint, so none is ever loaded again."""
    for name in os.listdir(root):
        m = _LEFTOVER.match(name)
        if m and (int(m[1]) < upto or (int(m[1]) == upto and m[2] != ".tmp")):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
