"""What the system needs to know about each parameter, kept on the module that owns it.

Megatron tags parameters with attributes (`tensor_model_parallel`, `sequence_parallel`, ...). Those tags
vanish whenever a parameter object is replaced: `Module.to_empty()` after meta-device construction does
it, and so does FSDP2's `fully_shard`. Here the owning module holds a `ParamMeta` per parameter name, so
the information survives any replacement of the tensor itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from megatron_lite.tensor_parallel.sharding import ShardSpec

_ATTR = "_megatron_param_meta"


@dataclass(frozen=True)
class ParamMeta:
    init: tuple = ("normal", 0.02)  # ("normal", std) | ("zeros",) | ("ones",), applied to the full tensor
    shard: ShardSpec | None = None  # how this rank's tensor relates to the full one (tensor parallelism)
    shard_rank: int = 0  # this rank's index among the shards
    # Replicated across TP but fed only this rank's part of the activations (its sequence shard under
    # sequence parallelism; its heads for the --qk-layernorm weights; the MoE router under TP): the gradient
    # is partial and must be summed over TP (an expert's over expert-TP: see tensor_parallel/grads.py).
    sequence_parallel: bool = False
    # The last pipeline stage's copy of tied word embeddings: kept equal to the first stage's by an all-reduce
    # of their gradients, counted once in the grad norm and stored once in checkpoints (under the original).
    embedding_copy: bool = False
    # An expert's weight: it lives on one expert-parallel rank, its gradient is reduced over the
    # expert-data-parallel group, and the grad norm sums it over the expert-model-parallel group.
    expert: bool = False

    @property
    def tensor_parallel(self) -> bool:
        return self.shard is not None and self.shard.tp_size > 1


def owns_copy(meta: ParamMeta, ctx) -> bool:
    """Whether this rank holds the one copy of its piece that is counted and stored: data-parallel rank 0
    (expert-data-parallel rank 0 for experts) of the ranks that `hold_copy`."""
    return hold_copy(meta, ctx) and replica_group(meta, ctx).rank == 0


def hold_copy(meta: ParamMeta, ctx) -> bool:
    """Whether this rank's piece is one of the data-parallel replicas of a stored piece: for tensors replicated
    across (expert-)TP its rank 0; never the last stage's copy of tied embeddings."""
    if meta.embedding_copy:
        return False
    return meta.tensor_parallel or (ctx.etp.rank if meta.expert else ctx.tp.rank) == 0


def replica_group(meta: ParamMeta, ctx):
    """The ranks holding the same piece: the data-parallel group (with CP), the expert-data-parallel one for
    experts."""
    return ctx.edp if meta.expert else ctx.dp_cp


def set_param_meta(module: nn.Module, name: str, meta: ParamMeta) -> None:
    if name not in module._parameters:
        raise KeyError(f"{type(module).__name__} has no parameter {name!r}")
    registry = module.__dict__.setdefault(_ATTR, {})
    registry[name] = meta


def param_meta(module: nn.Module, name: str) -> ParamMeta:
    """The metadata of `module`'s own parameter `name` (a replicated default when none was set)."""
    return module.__dict__.get(_ATTR, {}).get(name, ParamMeta())


def named_param_meta(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, ParamMeta]]:
    """(qualified name, parameter, metadata) for every parameter, shared ones once, in the order of
    `named_parameters()`."""
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        registry = module.__dict__.get(_ATTR, {})
        for name, p in module._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            qualified = f"{prefix}.{name}" if prefix else name
            if name not in registry:
                raise KeyError(
                    f"parameter {qualified} ({type(module).__name__}) has no ParamMeta; register it with "
                    "megatron_lite.parameters.set_param_meta so init, sharding and reductions know it"
                )
            yield qualified, p, registry[name]
