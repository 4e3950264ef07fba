"""--use-distributed-optimizer (Megatron's name; ZeRO-1): fp32 main weights and Adam moments sharded over the
data-parallel group (experts: the expert-data-parallel group).

The DDP gradient buffers are sharded (distributed/ddp.py): each bucket is reduce-scattered, and data-parallel
rank d owns the d-th equal part of every bucket. This optimizer keeps main weights and moments only for the
owned parts: for each parameter, the flat range of it that falls in this rank's parts. A step updates those,
then the new weights are all-gathered bucket by bucket into every rank's model parameters.

The grad norm is exact: each rank sums the squares of its owned ranges of the parameters it counts (the same
counting rules as without sharding), summed over the data-parallel group, then over the model-parallel one.
Checkpoints: each rank writes the boxes of the full tensors its parts cover and reads only those
(checkpoint/boxes.py), with no gather; the stored pieces are the full tensors', so a checkpoint saved with the
distributed optimizer loads without it, under another DP size, and the other way round.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.distributed.ddp import DistributedDataParallel, GradBuffer
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.optimizer.optimizer import (
    OptimizerBase,
    StepResult,
    _inner_optimizer,
    count_real_zeros,
    fp32,
    group_name,
    load_inner_state,
    make_scaler,
    optimizer_groups,
    padding_in,
    set_lr,
    squared_norm,
    state_entry,
    state_kinds,
)
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.parameters import hold_copy, named_param_meta
from megatron_lite.tensor_parallel.mappings import all_gather_tensor


def _gather_dtype(bucket) -> torch.dtype:
    """The dtype a bucket's updated weights are all-gathered in: its weights' (a buffer holds one dtype)."""
    return bucket.params[0].dtype


class _Shard:
    """The part [lo, hi) (flat, within the parameter) of a parameter this rank owns."""

    def __init__(
        self, p: nn.Parameter, buffer: GradBuffer, lo: int, hi: int, counted: bool, expert: bool, fp32_bucket: bool
    ):
        self.p, self.buffer, self.lo, self.hi = p, buffer, lo, hi
        self.counted, self.expert = counted, expert
        # An fp32 weight's main part is a view of the weight itself, as in Megatron (a copy had kept 4 more bytes a
        # parameter over DP: at DP 1 an fp32 run's optimizer held 1.5x plain Adam's); the step updates the owned
        # part in place and the all-gather brings the others. Only in a bucket gathered in fp32 (DDP keeps one
        # buffer per weight dtype, so every fp32 weight is; were one gathered rounded to bf16, as its own main
        # weight it would lose every update below bf16's resolution, which a review once found).
        self.aliased = fp32_bucket and p.dtype == torch.float32 and p.is_contiguous()
        self.main = p.detach().view(-1)[lo:hi] if self.aliased else p.detach().reshape(-1)[lo:hi].float().clone()
        self.grad = buffer.shard_view(p, lo, hi)  # the reduced gradient of this part


class DistributedOptimizer(OptimizerBase):
    def __init__(
        self,
        model: nn.Module,
        ddp: DistributedDataParallel,
        config: OptimizerConfig,
        ctx: ParallelContext,
        overlap_param_gather: bool = False,
    ) -> None:
        if not ddp.use_distributed_optimizer:
            raise ValueError("DistributedOptimizer needs DistributedDataParallel(use_distributed_optimizer=True)")
        self.config, self.ctx, self.ddp = config, ctx, ddp
        meta_of = {id(p): m for _, p, m in named_param_meta(model)}
        name_of = {id(p): group_name(name, m) for name, p, m in named_param_meta(model)}
        self.shards: list[_Shard] = []
        for buffer in ddp.buffers:
            ranges = buffer.shard_ranges()
            for bucket in buffer.buckets:
                fp32_bucket = _gather_dtype(bucket) == torch.float32
                for p in bucket.params:
                    pid, offset = id(p), buffer.offset[id(p)]
                    meta = meta_of[pid]
                    counted = hold_copy(meta, ctx)  # (experts: on expert-TP rank 0)
                    for lo, hi in ranges:
                        a, b = max(lo, offset), min(hi, offset + p.numel())
                        if b > a:
                            shard = _Shard(p, buffer, a - offset, b - offset, counted, meta.expert, fp32_bucket)
                            shard.meta = meta
                            self.shards.append(shard)
        self._moe = any(getattr(getattr(m, "config", None), "num_experts", None) for m in model.modules())
        groups = optimizer_groups([(s.main, name_of[id(s.p)], s.p.ndim) for s in self.shards], config)
        self.inner = _inner_optimizer(groups, config, ctx.device)
        self.scaler = make_scaler(config)
        # --overlap-param-gather: the updated weights' all-gathers run under the next forward; each module
        # waits for its parameters' buckets just before it runs.
        self.overlap_param_gather = overlap_param_gather
        self._in_flight: dict[int, tuple] = {}  # id(bucket) -> (buffer, bucket, gathered, work)
        self._bucket_of_param = {id(p): (buf, b) for buf in ddp.buffers for b in buf.buckets for p in b.params}
        self._pending_scale: dict[int, torch.Tensor] = {}  # id(p) -> row factors for when its gather lands
        if overlap_param_gather:
            self._register_waits(model)

    def _register_waits(self, model: nn.Module) -> None:
        """Forward pre-hooks that wait for a module's buckets just before it runs. Some weights are read by
        an enclosing module without their own module being called: experts (read by the MoE layer's
        dispatch and grouped GEMM) and the output layer under the fused loss (read by the model). Those are
        waited for by the enclosing module's hook."""
        from megatron_lite.moe.layer import MoELayer

        held = self._bucket_of_param
        covered: set[int] = set()

        def hook(module: nn.Module, params: list) -> None:
            module.register_forward_pre_hook(lambda mod, args, params=params: self._wait_for(params))

        for m in model.modules():
            if isinstance(m, MoELayer):
                params = [p for p in m.parameters() if id(p) in held]
                covered |= {id(p) for p in params}
                hook(m, params)
            output = getattr(m, "output_layer", None)
            if isinstance(output, nn.Module):
                # the weight the output layer multiplies by: with tied embeddings on the last stage of a pipeline
                # with MTP, the embedding copy, otherwise first waited for after the loss had read it stale
                tied = [m.output_weight()] if hasattr(m, "output_weight") else []
                params = [p for p in [*output.parameters(), *tied] if id(p) in held]
                covered |= {id(p) for p in params}
                hook(m, params)
        for m in model.modules():
            own = [p for p in m._parameters.values() if p is not None and id(p) in held and id(p) not in covered]
            if own:
                hook(m, own)

    @torch.no_grad()
    def scale_rows(self, p: nn.Parameter, row_scale: torch.Tensor) -> None:
        """The model's rows, and the rows this rank's parts of `p` cover (flat index // row width)."""
        width = p.numel() // max(1, p.shape[0])
        in_flight = id(self._bucket_of_param.get(id(p), (None, None))[1]) in self._in_flight
        for s in self.shards:
            if s.p is p and (in_flight or not s.aliased):  # (an aliased part is scaled with the model's rows below)
                rows = torch.arange(s.lo, s.hi, device=s.main.device) // width
                s.main.mul_(row_scale.to(s.main)[rows])
        factor = row_scale.float().view(-1, *[1] * (p.dim() - 1))
        if in_flight:
            # --overlap-param-gather: the step's (unscaled) weights are still being gathered into the model; the
            # scale is applied when they land (_wait_for), so only this bucket waits, and then under the forward
            # (waiting here for every bucket had exposed the whole all-gather at every clipped step)
            held = self._pending_scale.get(id(p))
            self._pending_scale[id(p)] = factor if held is None else held * factor
            return
        # (a low-precision model weight is scaled in fp32 and rounded once; the next step's gather replaces it by
        # the cast main weights)
        p.copy_(p.float() * factor)

    def _counted_sum(self, tensor_of, fn) -> float:
        """fn over each shard's tensor, summed over the groups it is sharded and split over."""
        total = 0.0
        for want_expert, groups in ((False, (self.ctx.dp_cp, self.ctx.mp)), (True, (self.ctx.edp, self.ctx.emp))):
            if want_expert and not self._moe:
                continue
            mine = [tensor_of(s) for s in self.shards if s.counted and s.expert == want_expert]
            total += fn(mine, self.ctx.device, *groups)
        return total

    def grad_norm(self, grads: list[torch.Tensor]) -> float:
        """Of `grads`, one per shard in order (step's unscaled fp32 copies of the shards' gradients)."""
        of = {id(s): g for s, g in zip(self.shards, grads)}
        return self._counted_sum(lambda s: of[id(s)], squared_norm) ** 0.5

    def params_norm(self) -> float:
        return self._counted_sum(lambda s: s.main, squared_norm) ** 0.5

    def grad_zeros(self) -> int:
        return int(self._counted_sum(lambda s: (s.grad, padding_in(s.meta, tuple(s.p.shape), s.lo, s.hi)),
                                     count_real_zeros))  # fmt: skip

    @torch.no_grad()
    def step(self, lr: float, decoupled_lr: float | None = None, weight_decay: float | None = None) -> StepResult:
        # bf16 main gradients (--grad-reduce-in-bf16) are copied to fp32 before they are unscaled, as Megatron
        # copies then unscales: unscaling in bf16 rounded each once more (0.4% at a --loss-scale of 1000)
        grads = fp32([s.grad for s in self.shards])
        norm, skipped = self._prepare_grads(grads, lambda: self.grad_norm(grads))
        if skipped is not None:
            return skipped
        for s, g in zip(self.shards, grads):
            s.main.grad = g
        set_lr(self.inner, lr, decoupled_lr, weight_decay)
        self.inner.step()
        self.steps_taken += 1
        for s in self.shards:
            s.main.grad = None
        self._gather_params()
        if self.scaler is not None:
            self.scaler.update(False)
        return StepResult(True, norm, self.loss_scale)

    def _gather_params(self) -> None:
        """Every rank's updated parts, all-gathered bucket by bucket into the model parameters; with
        --overlap-param-gather only launched here, first-used buckets first (the reverse of their order)."""
        if not self.overlap_param_gather:
            for buffer in self.ddp.buffers:
                self._gather_buffer(buffer)
            return
        for buffer in self.ddp.buffers:
            for bucket, (lo, hi) in reversed(list(zip(buffer.buckets, buffer.bucket_bounds))):
                mine = self._own_part(buffer, bucket, lo, hi)
                gathered = torch.empty(hi - lo, dtype=mine.dtype, device=buffer.device)
                work = (
                    all_gather_tensor(gathered, mine, group=buffer.group.pg, async_op=True)
                    if buffer.group.size > 1
                    else None
                )
                if work is None:
                    gathered.copy_(mine)
                self._in_flight[id(bucket)] = (buffer, bucket, lo, gathered, work)

    @torch.no_grad()
    def _wait_for(self, params) -> None:
        for p in params:
            _, bucket = self._bucket_of_param[id(p)]
            entry = self._in_flight.pop(id(bucket), None)
            if entry is None:
                continue
            buffer, bucket, lo, gathered, work = entry
            if work is not None:
                with buffer.group.blocked():
                    work.wait()
            for q in bucket.params:
                start = buffer.offset[id(q)] - lo
                q.detach().copy_(gathered[start : start + q.numel()].view(q.shape))
                if (factor := self._pending_scale.pop(id(q), None)) is not None:  # (QK-clip's, see scale_rows)
                    q.detach().copy_(q.float() * factor)

    def finish_param_sync(self) -> None:
        """Wait for every in-flight parameter all-gather (before a checkpoint, an evaluation, the end)."""
        for _, bucket, *_ in list(self._in_flight.values()):
            self._wait_for(bucket.params[:1])

    def _own_part(self, buffer: GradBuffer, bucket, lo: int, hi: int) -> torch.Tensor:
        """This rank's part of a bucket's updated weights, in the model's dtype."""
        n, d = buffer.group.size, buffer.group.rank
        part = (hi - lo) // n
        mine = torch.zeros(part, dtype=_gather_dtype(bucket), device=buffer.device)
        own_lo = lo + d * part
        for s in self.shards:
            if s.buffer is buffer and self._bucket_of_param[id(s.p)][1] is bucket:
                start = buffer.offset[id(s.p)] + s.lo - own_lo
                mine[start : start + (s.hi - s.lo)] = s.main
        return mine

    def _gather_buffer(self, buffer: GradBuffer) -> None:
        """All-gather, bucket by bucket, every rank's updated weights into the model."""
        for bucket, (lo, hi) in zip(buffer.buckets, buffer.bucket_bounds):
            mine = self._own_part(buffer, bucket, lo, hi)
            gathered = torch.empty(hi - lo, dtype=mine.dtype, device=buffer.device)
            if buffer.group.size > 1:
                with buffer.group.blocked():
                    all_gather_tensor(gathered, mine, group=buffer.group.pg)
            else:
                gathered.copy_(mine)
            for p in bucket.params:
                po = buffer.offset[id(p)] - lo
                p.detach().copy_(gathered[po : po + p.numel()].view(p.shape))

    # Checkpoint interface: each rank its own parts, no gather ----------------------------------------------
    sharded = True

    def state_ranges(self) -> list[tuple[nn.Parameter, int, int]]:
        return [(s.p, s.lo, s.hi) for s in self.shards]

    def state_values(self) -> list[tuple[nn.Parameter, int, dict[str, torch.Tensor]]]:
        kinds = state_kinds(self.config)
        out = []
        for s in self.shards:
            # (fp32 weights: the model's, all-gathered from the main weights after each step, are the same values)
            d = {"main": s.main} if s.p.dtype != torch.float32 else {}
            d.update({k: v for k, v in self.inner.state.get(s.main, {}).items() if k in kinds})
            out.append((s.p, s.lo, d))
        return out

    @torch.no_grad()
    def load_state_values(self, values: dict[tuple[int, int], dict[str, torch.Tensor]], step: int) -> None:
        states = {}
        for s in self.shards:
            d = values.get((id(s.p), s.lo), {})
            if not s.aliased:  # (an fp32 weight is its own main weight, as for the plain optimizer)
                s.main.copy_(d["main"] if "main" in d else s.p.reshape(-1)[s.lo : s.hi])
            if (entry := state_entry(d, self.config, step)) is not None:
                states[s.main] = entry
        if states:
            load_inner_state(self.inner, states)
        self._loaded(states, step)

    @torch.no_grad()
    def sync_main_from_model(self) -> None:
        for s in self.shards:
            if not s.aliased:
                s.main.copy_(s.p.reshape(-1)[s.lo : s.hi])

    # Memory accounting --------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: fp32 main weights (of low-precision weights) and Adam moments
        of its parts."""
        total = sum(s.main.numel() * s.main.element_size() for s in self.shards if not s.aliased)
        kinds = state_kinds(self.config)
        for st in self.inner.state.values():
            total += sum(v.numel() * v.element_size() for k, v in st.items() if k in kinds)
        return total
