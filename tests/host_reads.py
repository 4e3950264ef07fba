"""A dispatch mode that counts the host's reads of tensor values (`.item()`, `bool()`, `float()`, `torch.equal`,
copies to the CPU): on a GPU each waits for the work queued before it, so a loop of them serialises it."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default) or (
            func is torch.ops.aten._to_copy.default and (kwargs or {}).get("device") == torch.device("cpu")
        ):
            self.reads += 1
        return func(*args, **(kwargs or {}))
