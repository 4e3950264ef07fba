"""Reading a checkpoint under any layout: boxes of full tensors, assembled from whichever stored pieces cover
them, each file checked against the checksum its writer recorded before its first tensor is used."""

from __future__ import annotations

import glob
import os

import torch
from safetensors import safe_open

from megatron_lite.checkpoint.boxes import Box, box_slices, flat_parts, intersect, to_full
from megatron_lite.checkpoint.format import FORMAT_V1, file_digest, verify_file
from megatron_lite.checkpoint.lookup import _read_json
from megatron_lite.config import ConfigError
from megatron_lite.parameters import ParamMeta


def _as_box(piece: dict, rec: dict) -> Box:
    """A stored piece's box in the full tensor: format 3 records it; formats 1 and 2 stored a range along the
    record's one dimension."""
    if "starts" in piece:
        return tuple(piece["starts"]), tuple(piece["lengths"])
    d = rec["dim"]
    shape = rec["shape"]
    starts = tuple(piece["start"] if i == d else 0 for i in range(len(shape)))
    return starts, tuple(piece["length"] if i == d else n for i, n in enumerate(shape))


class Reader:
    """Reads boxes of full tensors from the pieces every rank of the saving job wrote. `bytes_read` counts the
    tensor bytes taken from the files (what a rank's load costs it in host memory), `bytes_hashed` the bytes read
    to check sha256 sums.

    `share` (rank, ranks): the readers of one load split the checksums: each hashes its share of the files (the
    sorted list's every ranks-th from its rank: `verify_share` hashes those it has not opened) and checks only the
    size of the others it opens, so each file is read once to check it, not once per rank (every rank opens every
    rank's file for the replicated weights). A corrupt file stops every rank (load_checkpoint's agreement) before
    training takes a value from it."""

    def __init__(self, path: str, meta: dict, share: tuple[int, int] = (0, 1)) -> None:
        self.path = path
        self.index: dict[str, dict] = {}
        self.files: dict[str, dict] = {}  # file name -> the size and sha256 its writer recorded
        self.bytes_read = self.bytes_hashed = 0
        for fname, digest in sorted(meta.get("files", {}).items()):
            full = os.path.join(path, fname)
            if not os.path.isfile(full) or file_digest(full)["sha256"] != digest:
                raise ConfigError(f"checkpoint file {full} is missing or fails its sha256 check (truncated/corrupted)")
            rec = _read_json(full)
            self.files.update(rec["files"])
            for name, t in rec["tensors"].items():
                self._add(name, t)
        self.checksummed = meta["format"] != FORMAT_V1
        self.local = bool(meta.get("local"))  # (one rank's files of a local non-persistent checkpoint)
        if not self.checksummed:  # format 1 (before checksums): index files hold the tensor records only
            for f in sorted(glob.glob(os.path.join(path, "index_r*.json"))):
                for name, t in _read_json(f).items():
                    self._add(name, t)
                    for pc in t["pieces"]:
                        self.files.setdefault(pc["file"], {})
            rngs = glob.glob(os.path.join(path, "rng_r*.safetensors"))
            self.files.update({os.path.basename(f): {} for f in rngs})
        self._files: dict[str, object] = {}
        self._checked: set[str] = set()
        self._mine = {f for i, f in enumerate(sorted(self.files)) if i % share[1] == share[0]}

    def _add(self, name: str, rec: dict) -> None:
        """Merge one index file's record of a tensor: its pieces as boxes, each box once."""
        mine = self.index.setdefault(name, {"shape": rec["shape"], "dtype": rec["dtype"], "pieces": [], "seen": set()})
        for pc in rec["pieces"]:
            box = _as_box(pc, rec)
            if box not in mine["seen"]:
                mine["pieces"].append({"file": pc["file"], "key": pc["key"], "box": box})
                mine["seen"].add(box)

    def verify(self, fname: str) -> str:
        """The file's path, once its size (and, if it is this reader's to check, its sha256) is as recorded."""
        full = os.path.join(self.path, fname)
        if not self.checksummed or fname in self._checked:
            return full
        if fname not in self.files:
            raise ConfigError(f"checkpoint {self.path}: no index lists {fname}")
        checksum = fname in self._mine
        verify_file(full, self.files[fname], checksum)
        self.bytes_hashed += self.files[fname]["bytes"] if checksum else 0
        self._checked.add(fname)
        return full

    def verify_share(self) -> None:
        """Hash the files of this reader's share it has not opened (another rank read them unchecked)."""
        for fname in sorted(self._mine):
            self.verify(fname)

    def _open(self, fname: str):
        if fname not in self._files:
            full = self.verify(fname)
            try:
                self._files[fname] = safe_open(full, framework="pt")
            except Exception as e:  # a corrupt file whose checksum was forged along with it
                raise ConfigError(f"checkpoint file {full} cannot be read ({type(e).__name__}: {e})") from None
        return self._files[fname]

    def _record(self, name: str) -> dict:
        rec = self.index.get(name)
        if rec is None:
            raise ConfigError(f"checkpoint {self.path} has no tensor {name}")
        return rec

    def read_box(self, name: str, starts: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
        """The box (starts, lengths) of the full tensor `name`, from every stored piece that overlaps it."""
        rec = self._record(name)
        out = torch.empty(lengths, dtype=getattr(torch, rec["dtype"]))
        covered, parts = 0, []
        for pc in rec["pieces"]:
            part = intersect(pc["box"], (starts, lengths))
            if part is None:
                continue
            # (overlapping pieces could make up for a missing one in the count below; no writer makes them)
            if any(intersect(part, other) for other in parts):
                raise ConfigError(f"checkpoint {self.path}: {name} has overlapping pieces ({pc['key']}): a bad index")
            parts.append(part)
            src = tuple(s - p for s, p in zip(part[0], pc["box"][0]))
            dst = tuple(s - r for s, r in zip(part[0], starts))
            data = self._open(pc["file"]).get_slice(pc["key"])[box_slices(src, part[1])]
            out[box_slices(dst, part[1])] = data
            covered += data.numel()
            self.bytes_read += data.numel() * data.element_size()
        if covered != out.numel():
            box = ", ".join(f"[{s}, {s + n})" for s, n in zip(starts, lengths))
            why = (  # (a tool given one rank's local files named pieces missing, not what they are)
                ": it is one rank's part of a local non-persistent checkpoint, which only its own job's layout loads; "
                "give a persistent (--save) checkpoint"
                if self.local
                else " (pieces missing)"
            )
            raise ConfigError(f"checkpoint {self.path}: {name} lacks part of the box {box}{why}")
        return out

    def read_full(self, name: str) -> torch.Tensor:
        shape = self._record(name)["shape"]
        return self.read_box(name, (0,) * len(shape), tuple(shape))

    def fill(self, name: str, target: torch.Tensor, meta: ParamMeta) -> None:
        """This rank's tensor (`meta` tells how it relates to the full one) from the full tensor `name`."""
        with torch.no_grad():
            target.zero_()  # vocabulary padding is not stored: it stays zero
            whole = ((0,) * target.ndim, tuple(target.shape))
            for (rel, lengths), full in to_full(tuple(target.shape), meta, whole):
                target[box_slices(rel, lengths)] = self.read_box(name, full, lengths)

    def read_flat(
        self, name: str, shape: tuple[int, ...], meta: ParamMeta, lo: int, hi: int, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The flat range [lo, hi) of this rank's tensor (of `shape`), in `dtype`: only the boxes it covers are
        read (the distributed optimizer's part of a parameter, --ckpt-fully-parallel-load's part of a replica's)."""
        out = torch.zeros(hi - lo, dtype=dtype)
        for part, full in flat_parts(out, shape, meta, lo):
            part.copy_(self.read_box(name, full, tuple(part.shape)))
        return out
