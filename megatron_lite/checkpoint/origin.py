"""Where a checkpoint's weights came from: the Hugging Face model it was converted from, recorded in every
checkpoint's config as `origin` and copied forward from the checkpoint a run loads, so it survives resumes into
the same --save directory, --ckpt-keep-last pruning, non-persistent and async saves, --finetune, upcycling and
LoRA. The exports and tools/generate.py read it: config.json's fields, generation_config.json and the tokenizer
from the converted checkpoint's hf/ directory, and a PEFT adapter's base_model_name_or_path.

The record: `hf_dir`, the converted checkpoint's hf/ directory (the original config.json, generation config and
tokenizer files); `converted_from`, the Hugging Face directory converted; `converted`, the converted checkpoint
(its iteration directory); `converted_weights`, whether the weights (a LoRA checkpoint's: its frozen base) are
still the converted ones, unchanged, which a PEFT adapter needs of the base it names. None: no Hugging Face
origin known; checkpoints saved before the record (or with None) are read as before, walking the chain of --load
back to the converted checkpoint."""

from __future__ import annotations

import os

from megatron_lite.checkpoint.format import _ITER_DIR, complete_iterations
from megatron_lite.checkpoint.hf_files import read_json_object
from megatron_lite.checkpoint.lookup import find_checkpoint, read_metadata
from megatron_lite.config import ConfigError

HF_DIR = "hf"  # under a converted checkpoint's root: the original config.json and tokenizer files
ORIGIN = "origin"  # the record's key in a checkpoint's config


def has_hf_config(side: str | None) -> bool:
    """`side` is a directory holding a Hugging Face config.json."""
    return bool(side) and os.path.isfile(os.path.join(side, "config.json"))


def hf_side(load_dir: str, saved: dict, depth: int = 4) -> str | None:
    """The hf/ directory a checkpoint's weights were converted with (holding the original config.json): beside
    the iteration directories (`load_dir` may be the root or one iteration, moved with it), else the recorded
    one; for a checkpoint without the record, that of the checkpoint its run started from (--load); None."""
    parent = os.path.dirname(os.path.normpath(load_dir))  # (its root, when `load_dir` is one iteration)
    for root in (load_dir, parent) if _ITER_DIR.match(os.path.basename(os.path.normpath(load_dir))) else (load_dir,):
        if has_hf_config(side := os.path.join(root, HF_DIR)):
            return side
    if ORIGIN in saved and not _walk_from(saved):  # (recorded, None too: nothing older to walk)
        return _recorded_side(saved[ORIGIN], load_dir)
    parent = _walk_from(saved) or (saved.get("checkpoint") or {}).get("load")
    try:  # (best effort: an older --load since emptied or reused is no origin, and no reason to stop a run)
        path = find_checkpoint(parent) if parent and depth > 0 and os.path.isdir(parent) else None
        if path is None or os.path.normpath(parent) == os.path.normpath(load_dir):
            return None  # (a run resumed into its own --save records itself: the walk stopped there)
        return hf_side(parent, read_metadata(path)["config"], depth - 1)
    except (ConfigError, OSError, ValueError, KeyError):
        return None


def _walk_from(saved: dict) -> str | None:
    """A record that says "not known yet": a run resumed from a checkpoint saved before the record, whose walk
    found nothing then (its --load out of reach), records where the walk starts, to try again later."""
    return (saved.get(ORIGIN) or {}).get("walk_from")


def _roots(load_dir: str) -> list[str]:
    """The --save root `load_dir` (the root, or one iteration's directory under it) lies in: a global
    non-persistent checkpoint's iterations lie one level deeper (<save>/non_persistent/iter_N)."""
    load_dir = os.path.normpath(load_dir)
    root = os.path.dirname(load_dir) if _ITER_DIR.match(os.path.basename(load_dir)) else load_dir
    return [root, os.path.dirname(root)] if os.path.basename(root) == "non_persistent" else [root]


def _recorded_side(record: dict | None, load_dir: str) -> str | None:
    """A record's hf/ directory: where it was, else where it lies relative to this checkpoint's --save root as it
    did to the saving run's (an experiment tree moved whole keeps both)."""
    side, rel = (record or {}).get("hf_dir"), (record or {}).get("hf_dir_rel")
    for root in _roots(load_dir) if not has_hf_config(side) and rel else []:
        if has_hf_config(moved := os.path.normpath(os.path.join(root, rel))):
            return moved
    return side if has_hf_config(side) else None


def _legacy_source(side: str) -> str | None:
    """The Hugging Face directory the checkpoint holding `side` was converted from (its iteration 0, also under
    newer ones), while it still holds the model."""
    root = os.path.dirname(side)
    try:
        for it in complete_iterations(root):
            source = (read_metadata(find_checkpoint(root, it)).get("converted_from") or {}).get("path")
            if has_hf_config(source):
                return source
    except (ConfigError, OSError, ValueError, KeyError):
        pass
    return None


def _is_converted(path: str | None) -> bool:
    try:
        found = find_checkpoint(path) if path and os.path.isdir(path) else None
        return found is not None and bool(read_metadata(found).get("converted_from"))
    except (ConfigError, OSError, ValueError, KeyError):
        return False


def checkpoint_origin(path: str, meta: dict) -> dict | None:
    """The origin of the weights in the checkpoint `path` (one iteration's directory, `meta` its metadata):
    recorded; a converted checkpoint's own; or, for a checkpoint saved before the record, found as before (its
    weights counted as converted only for LoRA adapters on a base recorded as the converted iteration, or on
    one beside it). None: not converted from a Hugging Face model here."""
    saved, path = meta["config"], os.path.abspath(path)
    if source := meta.get("converted_from"):
        side = os.path.join(os.path.dirname(path), HF_DIR)
        return {"hf_dir": side, "converted_from": source.get("path"), "converted": path, "converted_weights": True}
    if ORIGIN in saved and not _walk_from(saved):  # (recorded; None: none known when it was saved)
        record = saved[ORIGIN]
        side = _recorded_side(record, path) if record else None
        return {**record, "hf_dir": side} if side else record
    side = hf_side(path, saved)
    if side is None:
        return None
    source = _legacy_source(side)
    lora = saved.get("lora") or {}
    converted = _is_converted(lora["base"]) if lora.get("base") else bool(lora) and source is not None
    return {"hf_dir": side, "converted_from": source, "converted": None, "converted_weights": converted}


def lost_hf_dir(path: str, meta: dict) -> str | None:
    """The hf/ directory the checkpoint `path` records (a converted one: holds beside it) when it is out of reach
    now, moved or deleted; None where it is found or none is known. Found: where hf_side finds one, as the exports
    and tools/generate.py read them (an hf/ copied beside the checkpoint serves)."""
    if hf_side(path, meta["config"]) is not None:
        return None
    side = (checkpoint_origin(path, meta) or {}).get("hf_dir")
    return side if side and not has_hf_config(side) else None


def run_origin(ckpt_path: str | None, lora: bool, upcycling: bool, save: str | None = None) -> dict | None:
    """The origin a run records in its checkpoints: the loaded checkpoint's, its weights still the converted
    ones only where the run trains LoRA adapters on them frozen (a full fine-tune or an upcycling changes them);
    the hf/ directory also relative to `save`, the run's checkpoint root."""
    if ckpt_path is None:
        return None
    meta = read_metadata(ckpt_path)
    origin = checkpoint_origin(ckpt_path, meta)
    if origin is None:  # (final where the loaded checkpoint said so; else the walk is tried again later)
        saved = meta["config"]
        final = meta.get("converted_from") or (ORIGIN in saved and not _walk_from(saved))
        return None if final else {"walk_from": _walk_from(saved) or os.path.abspath(ckpt_path)}
    side = origin.get("hf_dir")
    rel = origin.get("hf_dir_rel")  # (kept where hf/ is out of reach now: not recomputed from a stale path)
    if has_hf_config(side) and save:
        rel = os.path.relpath(os.path.abspath(side), os.path.abspath(save))
    keep = bool(origin.get("converted_weights")) and lora and not upcycling
    return {**origin, "converted_weights": keep, "hf_dir_rel": rel}


def read_hf_config(side: str | None) -> dict:
    return read_json_object(os.path.join(side, "config.json")) if has_hf_config(side) else {}
