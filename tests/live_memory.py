"""Bytes a block of code leaves alive, counted from every tensor the dispatcher makes inside it: what autograd saves,
what a closure or a hook keeps, and the outputs. The activation meter (megatron_lite.training.memory) counts only
what autograd saves, so a tensor kept alive another way escapes it; tests of memory savings use this as well."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """with LiveBytes() as live: ...; live.alive() -> bytes of the storages made inside that are still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[StorageWeakRef, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                self.made.append((StorageWeakRef(s), s.data_ptr(), s.nbytes()))
        return out

    def alive(self) -> int:
        # by address among the living: views and in-place results share their base's storage
        return sum({ptr: n for ref, ptr, n in self.made if not ref.expired()}.values())
