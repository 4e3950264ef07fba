"""Which base checkpoint LoRA adapters belong to: adapters-only checkpoints record the base they were trained on
(its path and a fingerprint of its contents, training.resume.lora_base), found again, or refused in one line, where
they load (a resume, the converter, generation)."""

from __future__ import annotations

import hashlib
import json

from megatron_lite.checkpoint.checkpointing import find_checkpoint, read_metadata
from megatron_lite.config import ConfigError


def lora_base_checkpoint(base: str, holder: str, fingerprint: str | None = None) -> str:
    """The base checkpoint adapters-only LoRA checkpoints recorded (training.resume.lora_base), found and as they
    recorded it (`fingerprint`; None in older checkpoints), or one line naming `holder`, what holds them."""
    path = find_checkpoint(base)
    if path is None:
        raise ConfigError(
            f"{holder} holds LoRA adapters trained on the base checkpoint {base!r}, which is gone; restore it or "
            "start again from a base with --load BASE --finetune"
        )
    if fingerprint is not None and checkpoint_fingerprint(path) != fingerprint:
        # (a base run started again into the same directory rewrites its iterations: other weights, same path)
        raise ConfigError(
            f"{holder} holds LoRA adapters trained on the base checkpoint {path}, which has been rewritten since "
            "(its files' checksums differ): the adapters do not fit these weights; restore that base or start "
            "again from this one with --load BASE --finetune"
        )
    return path


def checkpoint_fingerprint(path: str) -> str | None:
    """A digest of the checksums a checkpoint's metadata records for its index files, which record its tensor
    files' (None for format 1, which records none)."""
    files = read_metadata(path).get("files")
    if not files:
        return None
    return hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()[:16]
