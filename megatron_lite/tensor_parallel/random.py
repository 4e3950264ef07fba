"""Dropout randomness under tensor parallelism, and recomputation that replays it.

Activations replicated across TP ranks must see the same dropout mask on every rank (the default
generator, seeded identically on all TP ranks); activations that differ per rank (a head shard inside
attention, a sequence shard under sequence parallelism) draw from a tracked generator seeded per TP rank.
`checkpoint` recomputes a region in the backward with both the default and the tracked generators
restored, so recomputation reproduces the same masks. `Regenerated` drops chosen tensors an operation saves
and makes them again when its backward needs them (the operation itself is not run again).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

from megatron_lite.config import RECOMPUTE_MODULES, ConfigError, ModelConfig


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states swapped into the device's default generator for the span of a `fork`."""

    def __init__(self) -> None:
        self._states: dict[str, torch.Tensor] = {}
        self._devices: dict[str, torch.device] = {}
        self._seeds: dict[str, int] = {}

    def reset(self) -> None:
        self._states.clear()
        self._devices.clear()
        self._seeds.clear()

    def add(self, name: str, seed: int, device: torch.device | str = "cpu") -> None:
        device = torch.device(device)
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists")
        if seed in self._seeds.values():  # (as Megatron's tracker: two names would draw the same masks)
            used = next(k for k, s in self._seeds.items() if s == seed)
            raise ValueError(f"RNG seed {seed} of {name!r} is already used by {used!r}")
        self._seeds[name] = seed
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        self._states[name] = gen.get_state()
        self._devices[name] = device

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        for k, v in states.items():
            self._states[k] = v.clone()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel") -> Iterator[None]:
        if name not in self._states:
            raise RuntimeError(
                f"RNG state {name!r} is not seeded: call ParallelContext.seed(seed) before running the model"
            )
        device = self._devices[name]
        outer = _get_state(device)
        _set_state(device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(device)
            _set_state(device, outer)


_RECOMPUTING = [0]


def is_recomputing() -> bool:
    """True while a checkpointed region is being recomputed in the backward (so layers that record
    statistics in their forward do not count twice)."""
    return _RECOMPUTING[0] > 0


def checkpoint(fn: Callable[..., Any], tracker: RNGStatesTracker, *args: Any) -> Any:
    """Activation recomputation: run `fn(*args)` without keeping its intermediates; the backward
    recomputes them with the default generator and every tracked generator as they were here."""
    saved = tracker.get_states()
    first_call = [True]

    def run(*inner: Any) -> Any:
        if first_call[0]:
            first_call[0] = False
            return fn(*inner)
        current = tracker.get_states()
        tracker.set_states(saved)
        _RECOMPUTING[0] += 1
        try:
            return fn(*inner)
        finally:
            _RECOMPUTING[0] -= 1
            tracker.set_states(current)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)


class Regenerated:
    """Tensors an operation saves for its backward, dropped after the forward and made again by `make` (no
    gradient: the graph that made them in the forward still carries theirs) when the backward first unpacks
    one, with the default generator and the tracked ones as `make` first found them (a LoRA adapter's dropout
    inside it draws the same mask). Recognised by storage, so the views the operation saves (transposes,
    reshapes) are regenerated too; whatever else it saves passes to the enclosing saved-tensor hooks (an
    activation meter), if any. What `make` reads stays alive until then: it should read tensors that are
    saved anyway (a linear layer's input), or the saving is lost.

        regen = Regenerated(tracker)
        q, k, v = regen.first(make)     # make() as the forward runs it, with its graph
        with regen.hooks():
            out = attention(q, k, v)    # saves q, k, v: dropped, made again in the backward
    """

    def __init__(self, tracker: RNGStatesTracker | None = None) -> None:
        self.tracker, self.make, self.values = tracker, None, None
        self.cpu_state = None  # (the generators' states `make` replays, taken by `first` or `adopt`)
        self.index: dict[int, int] = {}
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        self.outer = top(False) if top is not None else None

    def first(self, make: Callable[[], Any]) -> Any:
        self._states()
        return self.adopt(make(), make)

    def adopt(self, out: Any, make: Callable[[], Any]) -> Any:
        """`out`, already made (by the forward's own ops, with their graph), to be made again by `make`: one
        that gives the same values from tensors saved anyway (a fused add+norm's output from the sum it returns).
        The generators are replayed as they are now (after `first`: as they were before it)."""
        if self.cpu_state is None:
            self._states()
        self.make = make
        for i, t in enumerate(out if isinstance(out, tuple) else (out,)):
            self.index[t.untyped_storage().data_ptr()] = i  # no reference kept
        return out

    def _states(self) -> None:
        self.tracked = self.tracker.get_states() if self.tracker is not None else None
        self.cpu_state = torch.get_rng_state()
        self.cuda_state = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        i = self.index.get(t.untyped_storage().data_ptr())
        if i is None:  # (detached: an output packed with its grad_fn would hold its own node, a cycle through
            # C++ that outlives the step where the node never runs in the backward, e.g. unused router scores)
            return None, self.outer[0](t) if self.outer else t.detach()
        return i, t.size(), t.stride(), t.storage_offset()

    def _unpack(self, packed) -> torch.Tensor:
        if packed[0] is None:
            return self.outer[1](packed[1]) if self.outer else packed[1]
        if self.values is None:
            out = self._remake()
            self.values = out if isinstance(out, tuple) else (out,)
        i, size, stride, offset = packed
        return self.values[i].as_strided(size, stride, offset)

    def _remake(self) -> Any:
        cuda = self.cuda_state is not None
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else [], enabled=True):
            torch.set_rng_state(self.cpu_state)
            if cuda:
                torch.cuda.set_rng_state(self.cuda_state)
            current = self.tracker.get_states() if self.tracker is not None else None
            if current is not None:
                self.tracker.set_states(self.tracked)
            try:
                with torch.no_grad():
                    return self.make()
            finally:
                if current is not None:
                    self.tracker.set_states(current)


def validate_recompute_config(c: ModelConfig) -> None:
    """ModelConfig's checks of the --recompute-* flags (part of its validate())."""
    g, m, n = c.recompute_granularity, c.recompute_method, c.recompute_num_layers
    if g not in (None, "full", "selective"):
        raise ConfigError(f"--recompute-granularity {g} is not supported; use full or selective")
    if g == "full":
        if m not in ("uniform", "block"):
            raise ConfigError(
                f"--recompute-granularity full needs --recompute-method uniform|block (got {m}); "
                "e.g. --recompute-method uniform --recompute-num-layers 1"
            )
        if n is None or n < 1:
            raise ConfigError(
                f"--recompute-granularity full needs --recompute-num-layers >= 1 (got {n}); "
                "e.g. --recompute-num-layers 1"
            )
    elif m is not None or n is not None:
        given = " and ".join(
            f"{f} {v}" for f, v in (("--recompute-method", m), ("--recompute-num-layers", n)) if v is not None
        )  # fmt: skip  (a flag not given was named as None)
        raise ConfigError(
            f"{given} {'apply' if m is not None and n is not None else 'applies'} only with "
            "--recompute-granularity full; add it or drop them"
        )
    bad = [x for x in c.recompute_modules if x not in RECOMPUTE_MODULES]
    if bad:
        raise ConfigError(f"--recompute-modules {' '.join(bad)} not supported; choose from {RECOMPUTE_MODULES}")
