"""Memory per rank, counted from tensors (the same on CPU and GPU, independent of any allocator's caching):
parameters, gradient buffers, optimizer state, and the peak of activations saved for the backward.

Activations are counted through autograd's saved-tensor hooks during the step: each storage a forward saves
(parameters excluded) is added once when first saved and released when the saved tensor is freed after its
backward; the peak of the running sum is the step's activation memory (with pipelining, several
micro-batches' activations are alive at once, and the peak says so)."""

from __future__ import annotations

import contextlib
import resource
import weakref

import torch
import torch.distributed as dist
from torch import nn


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class ActivationMeter:
    def __init__(self, model: nn.Module) -> None:
        self._params = set()
        for p in model.parameters():
            t = p.to_local() if hasattr(p, "to_local") else p  # FSDP2: this rank's shard
            try:
                self._params.add(t.untyped_storage().data_ptr())
            except RuntimeError:  # a resharded FSDP2 parameter has no storage of its own
                continue
        self._live: dict[int, list[int]] = {}  # storage -> [bytes, references to it]
        self.current = 0
        self.peak = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # (a parameter, or a view of one, is no activation: FSDP2's gathered weights are parameters of their own
        # storage, used by their module's forward or elsewhere: the experts' weights, a tied output layer)
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._params or storage.nbytes() == 0:
            return t
        # Kept detached: an output packed with its grad_fn holds its own node, a cycle through C++ that outlives
        # the step where the node never runs in the backward (unused router scores). The storage counts until both
        # the tensor (a pipeline stage's received input, held by its schedule) and what autograd keeps of it go.
        saved = t.detach()
        if ptr in self._live:
            self._live[ptr][1] += 2
        else:
            self._live[ptr] = [storage.nbytes(), 2]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        weakref.finalize(saved, self._free, ptr)
        weakref.finalize(t, self._free, ptr)
        return saved

    def _free(self, ptr: int) -> None:
        entry = self._live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= self._live.pop(ptr)[0]

    def measuring(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


def measure(model: nn.Module | None):
    """(context manager, meter) — a no-op context and None when `model` is None."""
    if model is None:
        return contextlib.nullcontext(), None
    meter = ActivationMeter(model)
    return meter.measuring(), meter


def _nf4_bytes(model: nn.Module) -> int:
    from megatron_lite.lora.qlora import nf4_bytes

    return nf4_bytes(model)


def breakdown(model: nn.Module, ddp, optimizer, activation_bytes: int) -> dict[str, int]:
    return {
        # FSDP2 parameters are DTensors: count this rank's shard.
        "mem_params_bytes": tensor_bytes(p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())
        + _nf4_bytes(model),  # QLoRA's quantised base weights are buffers, not parameters
        "mem_grads_bytes": ddp.grad_bytes(),
        "mem_optimizer_bytes": optimizer.state_bytes(),
        "mem_activations_bytes": activation_bytes,
    }


def peak_and_rss(device: torch.device) -> dict[str, int | None]:
    """The allocator's peak (CUDA; none on a CPU, where the process's size says nothing of its tensors) and the
    process's largest resident size (host memory: data loading, pinned copies, the CPU itself)."""
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    return {"peak_memory_bytes": peak, "max_rss_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024}


def report_memory(label: str, device: torch.device) -> str | None:
    """Megatron's report_memory line, which logs are grepped for ("max allocated"): this rank's CUDA allocator in
    MB; None on a CPU, which has no allocator statistics."""
    if device.type != "cuda":
        return None
    mb = 1024.0 * 1024.0
    stats = (
        ("allocated", torch.cuda.memory_allocated(device)),
        ("max allocated", torch.cuda.max_memory_allocated(device)),
        ("reserved", torch.cuda.memory_reserved(device)),
        ("max reserved", torch.cuda.max_memory_reserved(device)),
    )
    return f"{label} memory (MB)" + "".join(f" | {name}: {value / mb}" for name, value in stats)


def largest_over_ranks(values: dict[str, int | None], ctx) -> dict[str, int | None]:
    """Each value's largest over every rank, as the log shows it: the logging rank holds the last pipeline stage
    and one expert-parallel rank's experts, rarely the busiest (Megatron prints each rank's). Every rank calls
    it with the same keys."""
    keys = [k for k, v in values.items() if v is not None]
    if not keys or ctx.world_size == 1 or not dist.is_initialized():
        return values
    t = torch.tensor([values[k] for k in keys], dtype=torch.int64, device=ctx.device)
    with ctx.tp.blocked():  # (the context's hang bookkeeping)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {**values, **dict(zip(keys, t.tolist()))}
