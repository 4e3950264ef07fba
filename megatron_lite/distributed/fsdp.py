"""--use-torch-fsdp2: ZeRO-3 through PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`), composed with our
tensor parallelism (2-D: TP inside each layer, parameters sharded over the data-parallel group).

Each transformer layer, then each model chunk, is wrapped with `fully_shard` on a device mesh made from the
data-parallel group: parameters live sharded along dim 0 (DTensors); FSDP2 all-gathers a layer's parameters
before it runs and reduce-scatters its gradients after its backward. The mixed-precision policy computes in
bf16 when --bf16 is given and reduces in fp32 (bf16 with --grad-reduce-in-bf16); the sharded parameters
themselves stay fp32 and are the optimizer's main weights. Our loss is already normalised over the global batch, so
gradients are summed, not averaged, over data-parallel ranks (FSDP2's mean times the DP size).

Under pipelining each model chunk is its own FSDP2 root and every micro-batch's backward reduce-scatters its
layers' gradients, so the executor's interleaving of chunks needs nothing more; tied embeddings are summed
shard by shard over the embedding group (first and last stage shard them alike over equal DP groups). With
context parallelism the mesh is DP x CP, the group over which gradients are summed anyway. Under expert
parallelism each layer's experts are a `fully_shard` unit of their own on the expert-data-parallel mesh (the
ranks holding the same experts), inside their layer's unit on the data-parallel mesh.

`FSDP2Model` offers what the training step needs from the data-parallel wrapper; `FSDP2Optimizer` is AdamW on
the sharded parameters with our exact grad norm (local shards summed over DP, then over TP).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.config import ConfigError
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.optimizer.optimizer import (
    OptimizerBase,
    StepResult,
    _inner_optimizer,
    count_real_zeros,
    group_name,
    load_inner_state,
    optimizer_groups,
    padding_in,
    set_lr,
    squared_norm,
    state_entry,
    state_kinds,
)
from megatron_lite.parallel_context import Group, ParallelContext, track_mesh
from megatron_lite.parameters import hold_copy, named_param_meta


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def flat_range(p: torch.Tensor) -> tuple[int, int]:
    """The flat range [lo, hi) of an FSDP2 parameter's full tensor that this rank's shard holds: fully_shard
    splits dim 0 over a one-dimensional mesh as torch.chunk does (the last ranks may hold fewer rows, or none)."""
    from torch.distributed.tensor import Shard

    placements = tuple(p.placements)
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise NotImplementedError(f"an FSDP2 parameter placed {placements}: expected Shard(0) on one mesh dimension")
    n, r, rows = p.device_mesh.size(), p.device_mesh.get_local_rank(), p.shape[0]
    chunk = -(-rows // n)
    start = min(r * chunk, rows)
    local = _local(p).shape[0]
    if local != min(rows, start + chunk) - start:
        raise RuntimeError(f"an FSDP2 shard of {local} rows where torch.chunk gives rows [{start}, {start + chunk})")
    inner = p.numel() // rows if rows else 0
    return start * inner, (start + local) * inner


def from_flat(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard (its flat values, see flat_range) as a DTensor placed as `like`: no collective."""
    from torch.distributed.tensor import DTensor

    local = flat.to(like.device).view(_local(like).shape)
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())  # fmt: skip


def local_shard(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` (the same on every rank) as a DTensor placed as `like`, each rank taking its own shard of it with no
    collective: a checkpoint's reads stay apart from collectives (torch >= 2.6; before it, from rank 0's copy)."""
    from torch.distributed.tensor import distribute_tensor

    if "src_data_rank" in inspect.signature(distribute_tensor).parameters:
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return distribute_tensor(full, like.device_mesh, like.placements)


def _not_a_view(module: nn.Module, args, output):
    """A forward hook: the output, copied where it is a view of another tensor (None: unchanged)."""
    if isinstance(output, torch.Tensor) and output._base is not None:
        return output.clone()
    return None


class FSDP2Model(nn.Module):
    def __init__(
        self,
        module: nn.Module,
        ctx: ParallelContext,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype = torch.float32,
        reshard_after_forward: bool = True,
    ) -> None:
        """`reduce_dtype`: the reduce-scatters' (bf16 with --grad-reduce-in-bf16); the sharded gradients
        accumulate in the fp32 of the sharded weights either way. `reshard_after_forward` False: Megatron's
        --torch-fsdp2-no-reshard-after-forward (the backward finds each layer still gathered)."""
        super().__init__()
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from megatron_lite.models.transformer import HybridLayer, TransformerLayer
        from megatron_lite.moe.experts import LocalExperts

        self.ctx = ctx
        device_type = ctx.device.type
        if not dist.is_initialized():  # one process without torchrun: FSDP2 still needs a (trivial) group
            backend = "nccl" if device_type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        singles: list = []

        def mesh_of(group: Group) -> DeviceMesh:
            if group.size > 1:
                return track_mesh(DeviceMesh.from_group(group.pg, device_type))
            if dist.get_world_size() == 1:
                return track_mesh(DeviceMesh(device_type, [0]))
            # a group of one inside a larger job: every rank creates every singleton group, in the same order,
            # as new_group requires (once), and keeps its own
            if not singles:
                singles.extend(dist.new_group([r]) for r in range(dist.get_world_size()))
            return track_mesh(DeviceMesh.from_group(singles[dist.get_rank()], device_type))

        self.mesh = mesh_of(ctx.dp_cp)
        # experts are sharded over the ranks that hold the same experts (expert-data-parallel), the rest over DP
        # (decided from the config, the same on every rank: a stage without MoE layers still joins new_group)
        self.moe = any(getattr(getattr(m, "config", None), "num_experts", None) for m in module.modules())
        expert_mesh = mesh_of(ctx.edp) if self.moe else None
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        # The routers' expert biases stay whole fp32 tensors on every rank (Megatron keeps them fp32 whatever
        # the model's dtype): a bf16 copy rounds 0.5 + 1e-3 to 0.5, so the routing never saw most updates.
        kw: dict = dict(reshard_after_forward=reshard_after_forward)
        if biases := {m.expert_bias for m in module.modules() if getattr(m, "expert_bias", None) is not None}:
            if "ignored_params" not in inspect.signature(fully_shard).parameters:
                raise ConfigError(
                    "--use-torch-fsdp2 with --moe-router-enable-expert-bias needs PyTorch >= 2.7 (fully_shard's "
                    "ignored_params keeps the bias in fp32); upgrade torch or use --use-distributed-optimizer"
                )
            kw["ignored_params"] = biases
        chunks = list(module) if isinstance(module, nn.ModuleList) else [module]
        for chunk in chunks:
            for m in chunk.modules():
                if isinstance(m, LocalExperts):
                    fully_shard(m, mesh=expert_mesh, mp_policy=policy, **kw)
            for m in chunk.modules():
                if isinstance(m, (TransformerLayer, HybridLayer)):
                    fully_shard(m, mesh=self.mesh, mp_policy=policy, **kw)
            # (registered before fully_shard's own, so it runs first: torch warned on every rank of every run that
            # the chunk's output, the per-token loss transposed, was a view an in-place op would break; none is
            # made to it, and a copy of [batch, seq] costs nothing)
            chunk.register_forward_hook(_not_a_view)
            fully_shard(chunk, mesh=self.mesh, mp_policy=policy, **kw)
        # (after fully_shard, which swaps every parameter for a sharded one)
        self.expert = {id(p) for _, p, meta in named_param_meta(module) if meta.expert}
        self.module = module
        self.compute_dtype = param_dtype  # None: the parameters' own (fp32)
        self.use_distributed_optimizer = False
        self.buffers_ = []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield  # FSDP2 reduce-scatters after every micro-batch's backward; the sharded gradients accumulate

    @contextlib.contextmanager
    def final_grads(self) -> Iterator[None]:
        yield  # (a pipeline chunk's last backward: nothing left to start, every backward was reduced)

    def finish_grad_sync(self) -> None:
        """FSDP2 has reduce-scattered when the backward returns, as a mean over DP; our loss is normalised
        over the global batch, so the gradient wanted is the sum. (Setting FSDP2's divide factor to 1
        would need ReduceOp.PREMUL_SUM, which gloo lacks.)"""
        for expert, n in ((False, self.ctx.dp_cp.size), (True, self.ctx.edp.size)):
            grads = [
                _local(p.grad)
                for p in self.module.parameters()
                if p.grad is not None and (id(p) in self.expert) == expert
            ]
            if n > 1 and grads:
                torch._foreach_mul_(grads, float(n))

    def reshard(self) -> None:
        """Back to the sharded parameters after a forward with no backward (an evaluation): FSDP2 keeps each
        chunk's root unit (embeddings, final norm, output layer) gathered after its forward, and registered
        there the gathered copies hid the sharded parameters from zero_grad_buffer and the checkpoint."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def zero_grad_buffer(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def main_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """This rank's shard of the summed gradient (the same shard on every TP rank)."""
        return None if p.grad is None else _local(p.grad)

    def sequence_parallel_shard_sum(self, tp: Group, etp: Group | None) -> None:
        from megatron_lite.tensor_parallel.grads import allreduce_sequence_parallel_grads

        allreduce_sequence_parallel_grads(self.module, tp, self.main_grad, etp=etp)

    def grad_bytes(self) -> int:
        return sum(_local(p.grad).numel() * 4 for p in self.module.parameters() if p.grad is not None)

    def check_finite(self, enabled: bool = True) -> None:
        """FSDP2 reduces inside its own hooks: only the reduced shards can be inspected."""

    def note_tied_local(self) -> None:
        """(Nothing to note: FSDP2 reduces inside its own hooks, see check_finite.)"""

    def first_nonfinite_param(self) -> str | None:
        """The first parameter whose shard of the reduced gradient is non-finite on this rank (FSDP2 mixes
        the ranks' gradients before we see them, so this names the parameter, not the rank it came from)."""
        for name, p in self.module.named_parameters():
            if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all()):
                return self.module.global_name(name) if hasattr(self.module, "global_name") else name
        return None


class FSDP2Optimizer(OptimizerBase):
    def __init__(self, model: FSDP2Model, config: OptimizerConfig, ctx: ParallelContext) -> None:
        self.config, self.ctx, self.model = config, ctx, model
        self.params, counted, expert, entries, self._metas = [], [], [], [], []
        for name, p, meta in named_param_meta(model.module):
            if not p.requires_grad:
                continue
            self.params.append(p)
            self._metas.append(meta)
            counted.append(hold_copy(meta, ctx))  # (experts: on expert-TP rank 0)
            expert.append(meta.expert)
            entries.append((p, group_name(name, meta), p.ndim))
        self._counted, self._expert = counted, expert
        self.inner = _inner_optimizer(optimizer_groups(entries, config), config, ctx.device)
        self.scaler = None

    def grad_norm(self) -> float:
        """Local shards summed over the group they are sharded over, then over the model-parallel group:
        dense over DP x CP and TP x PP, experts over expert-DP and expert-TP x EP x PP."""
        return self._counted_sum(lambda p: p.grad, squared_norm) ** 0.5

    def _counted_sum(self, tensor_of, fn, pad: dict | None = None) -> float:
        """fn over this rank's local shards (with `pad`: (shard, its padding elements) pairs)."""
        total = 0.0
        for want_expert, groups in ((False, (self.ctx.dp_cp, self.ctx.mp)), (True, (self.ctx.edp, self.ctx.emp))):
            if want_expert and not self.model.moe:
                continue
            mine = [
                _local(tensor_of(p)) if pad is None else (_local(tensor_of(p)), pad[id(p)])
                for p, c, e in zip(self.params, self._counted, self._expert)
                if c and e == want_expert and tensor_of(p) is not None
            ]
            total += fn(mine, self.ctx.device, *groups)
        return total

    def params_norm(self) -> float:
        return self._counted_sum(lambda p: p, squared_norm) ** 0.5

    def grad_zeros(self) -> int:
        pad = {id(p): padding_in(m, tuple(p.shape), *flat_range(p)) for p, m in zip(self.params, self._metas)}
        return int(self._counted_sum(lambda p: p.grad, count_real_zeros, pad))

    @torch.no_grad()
    def step(self, lr: float, decoupled_lr: float | None = None, weight_decay: float | None = None) -> StepResult:
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        norm, skipped = self._prepare_grads(grads, self.grad_norm)  # (no loss scaling: refused at start-up)
        if skipped is not None:
            return skipped
        set_lr(self.inner, lr, decoupled_lr, weight_decay)
        self.inner.step()
        self.steps_taken += 1
        return StepResult(True, norm, 1.0)

    @torch.no_grad()
    def scale_rows(self, p: nn.Parameter, row_scale: torch.Tensor) -> None:
        """This rank's dim-0 rows of the sharded parameter (which is the main weight)."""
        local = _local(p)
        start = flat_range(p)[0] // max(1, p.numel() // max(1, p.shape[0]))
        local.mul_(row_scale[start : start + local.shape[0]].float().view(-1, *[1] * (p.dim() - 1)))

    # Checkpoint interface: each rank its own rows (the sharded weights are the main weights) -----------------
    sharded = True

    def state_ranges(self) -> list[tuple[nn.Parameter, int, int]]:
        return [(p, *flat_range(p)) for p in self.params]

    def state_values(self) -> list[tuple[nn.Parameter, int, dict[str, torch.Tensor]]]:
        kinds = state_kinds(self.config)
        out = []
        for p in self.params:
            st = self.inner.state.get(p, {})
            out.append((p, flat_range(p)[0], {k: _local(st[k]).reshape(-1) for k in kinds if k in st}))
        return out

    @torch.no_grad()
    def load_state_values(self, values: dict[tuple[int, int], dict[str, torch.Tensor]], step: int) -> None:
        states = {}
        for p in self.params:
            d = values.get((id(p), flat_range(p)[0]), {})
            if "main" in d:  # (a mixed-precision run's fp32 main weights: more exact than its low-precision ones)
                _local(p).view(-1).copy_(d["main"])
            entry = state_entry(d, self.config, step, lambda t, p=p: from_flat(t, p))
            if entry is not None:
                states[p] = entry
        if states:
            load_inner_state(self.inner, states)
        self._loaded(states, step)

    def sync_main_from_model(self) -> None:
        pass  # the sharded parameters are the main weights

    def state_bytes(self) -> int:
        kinds = state_kinds(self.config)
        states = self.inner.state.values()
        return sum(_local(v).numel() * v.element_size() for st in states for k, v in st.items() if k in kinds)
