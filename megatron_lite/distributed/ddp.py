"""Data parallelism with a contiguous gradient buffer and bucketed all-reduce.

Gradients accumulate into one flat buffer (per process group and parameter dtype; fp32, or bf16 with
--grad-reduce-in-bf16 as in Megatron, which halves its memory and the reduction's bytes), laid out in reverse
registration order, which is roughly the order the backward produces them. The buffer is cut into buckets; with
`overlap_grad_reduce`, a bucket's all-reduce is launched as soon as every gradient in it is final, while
the backward continues. Buckets are launched strictly in order on every rank, so all ranks issue the
same collectives in the same sequence. Inside `no_sync()` (all but the last micro-batch of gradient
accumulation) gradients only accumulate. Under pipelining the whole schedule runs inside `no_sync()` and
the executor opens `final_grads()` around each model chunk's last backward, so a chunk's buckets are
reduced while the other chunks' backward continues (Megatron's grad_sync_func).

Embeddings tied across pipeline stages: the first stage's word embeddings and the last stage's copy must
be summed over the embedding group before the data-parallel reduction (a reduce-scatter would leave each
rank the sum of different parts of the two). Their gradients therefore sit in buckets of their own at the
end of the buffer, held back from early launches and, under ZeRO-2, kept whole across micro-batches; the
step reduces them after the embedding all-reduce (step.finalize_grads).

The loss is normalised by the number of tokens in the whole global batch before the backward, so
gradients are summed (not averaged) across data-parallel ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.distributed.fp32_accumulation import reduce_scatter_with_fp32_accumulation
from megatron_lite.parallel_context import Group, ParallelContext
from megatron_lite.parameters import named_param_meta
from megatron_lite.tensor_parallel.grads import allreduce_coalesced, sum_groups
from megatron_lite.tensor_parallel.mappings import reduce_scatter_tensor


def tied_embedding_copies(module: nn.Module, ctx: ParallelContext) -> list[nn.Parameter]:
    """This rank's copy of word embeddings shared by the first and last pipeline stage, if any: tied to the
    output layer, or read by multi-token prediction on the last stage."""
    configs = [m.config for m in module.modules() if hasattr(getattr(m, "config", None), "tied_embeddings")]
    shared = any(c.tied_embeddings or getattr(c, "mtp_num_layers", 0) for c in configs)
    if ctx.embedding.size == 1 or not hasattr(module, "global_name") or not shared:
        return []
    return [
        p
        for name, p in module.named_parameters()
        if p.requires_grad and module.global_name(name) == "embedding.word_embeddings.weight"
    ]


@dataclass
class _Bucket:
    index: int
    params: list[nn.Parameter]
    data: torch.Tensor | None  # None while a ZeRO-2 bucket holds no gradient
    lo: int = 0  # its range in the buffer's flat index space
    hi: int = 0
    pending: set[int] = field(default_factory=set)
    handle: dist.Work | None = None
    launched: bool = False
    shard_grad: torch.Tensor | None = None  # sharded: the reduced gradient of this rank's part
    scratch: torch.Tensor | None = None  # ZeRO-2: a reduce-scatter in flight writes here
    held: bool = False  # tied across pipeline stages: reduced only at the end of the step


class GradBuffer:
    """A flat buffer (of `dtype`) holding the main gradient of each parameter, cut into buckets.

    `sharded` (the distributed optimizer): each bucket is padded to a multiple of the group size and
    reduce-scattered instead of all-reduced; group rank d then holds the summed gradient of the d-th equal
    part of every bucket (`shard_grad`, laid out as `shard_ranges`), the only part its optimizer steps.
    `zero_stage` 2 also drops each bucket's full gradient once it is reduce-scattered, after every
    micro-batch: a bucket's full storage exists only while its gradients are being produced, and the
    persistent gradient memory per rank is the parts, about 1/DP."""

    def __init__(
        self,
        params: list[nn.Parameter],
        group: Group,
        bucket_numel: int | None,
        sharded: bool = False,
        zero_stage: int = 1,
        held: set[int] | None = None,
        dtype: torch.dtype = torch.float32,
        fp32_accumulation: bool = False,
        name: str = "bucket",
    ) -> None:
        """`held`: ids of parameters whose buckets wait for the end of the step (tied embeddings; they
        must come last in `params`). `fp32_accumulation` (sharded; --ddp-reduce-scatter-with-fp32-accumulation):
        the reduce-scatters send the buffer's dtype and sum in fp32 (distributed/fp32_accumulation.py). `name`:
        what --check-for-large-grads calls its buckets."""
        held = held or set()
        self.group = group
        self.sharded = sharded
        self.fp32_accumulation = fp32_accumulation
        self.transient = sharded and zero_stage >= 2
        self.device = params[0].device
        self.dtype = dtype
        self.offset: dict[int, int] = {}  # id(param) -> its start in the flat buffer
        self.shape: dict[int, torch.Size] = {}
        layout: list[tuple[list[nn.Parameter], int, int]] = []
        start = offset = 0
        current: list[nn.Parameter] = []
        for p in params:
            if id(p) in held and current and not any(id(x) in held for x in current):
                offset = self._pad(offset, start)  # held parameters start a bucket of their own
                layout.append((current, start, offset))
                start, current = offset, []
            self.offset[id(p)], self.shape[id(p)] = offset, p.shape
            offset += p.numel()
            current.append(p)
            if bucket_numel is not None and offset - start >= bucket_numel:
                offset = self._pad(offset, start)
                layout.append((current, start, offset))
                start, current = offset, []
        if current:
            offset = self._pad(offset, start)
            layout.append((current, start, offset))
        self.numel = offset
        self.data = None if self.transient else torch.zeros(offset, dtype=dtype, device=self.device)
        self.buckets: list[_Bucket] = []
        self.bucket_bounds: list[tuple[int, int]] = []
        for ps, lo, hi in layout:
            data = None if self.data is None else self.data[lo:hi]
            b = _Bucket(len(self.buckets), list(ps), data, lo, hi, held=any(id(p) in held for p in ps))
            if self.buckets and self.buckets[-1].held and not b.held:
                raise ValueError("held parameters must come last in the gradient buffer")
            if sharded and self.transient:
                b.shard_grad = torch.zeros((hi - lo) // group.size, dtype=dtype, device=self.device)
            elif sharded:  # ZeRO-1: the reduced part lives in place, in this rank's slot of the bucket
                b.shard_grad = data.view(group.size, -1)[group.rank]
            self.buckets.append(b)
            self.bucket_bounds.append((lo, hi))
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.free = sum(1 for b in self.buckets if not b.held)  # buckets reduced as soon as they are complete
        self.peak_transient = 0  # ZeRO-2: most bytes of full bucket storage alive at once
        # ZeRO-2 with --overlap-grad-reduce: reduce-scatters in flight, oldest first (bucket, full storage, the
        # part's result, handle); at most FLYING at once bounds the full storage they keep alive
        self._flying: list[tuple[_Bucket, torch.Tensor, torch.Tensor, dist.Work]] = []
        self._next = 0
        # --check-for-nan-in-loss-and-grad: per bucket, the first non-finite element of this rank's own
        # gradient before the reduction mixes it with the others' (a device tensor, -1 when none; read only
        # when the step's norm turns out non-finite, so no synchronisation in the normal case).
        self.check_finite = False
        self.first_bad: dict[int, torch.Tensor] = {}
        # --check-for-large-grads: each reduction's local bucket norm, before it (Megatron's check_grads), appended
        # in launch order to a list the wrapper shares between its buffers (device tensors, read after the step)
        self.local_norms: list[tuple[str, torch.Tensor]] | None = None
        self.name = name

    def _pad(self, end: int, start: int) -> int:
        """A sharded bucket's length is a multiple of the group size, so it splits into equal parts."""
        if not self.sharded:
            return end
        n = self.group.size
        return start + -(-(end - start) // n) * n

    def holds(self, p: nn.Parameter) -> bool:
        return id(p) in self.offset

    def grad_view(self, p: nn.Parameter) -> torch.Tensor:
        """The parameter's full main gradient (a view into its bucket; ZeRO-2 allocates the bucket now)."""
        b = self.bucket_of[id(p)]
        if b.data is None:
            b.data = torch.zeros(b.hi - b.lo, dtype=self.dtype, device=self.device)
            live = sum(x.data.numel() for x in self.buckets if x.data is not None)
            live += sum(full.numel() for _, full, _, _ in self._flying)
            self.peak_transient = max(self.peak_transient, live * b.data.element_size())
        start = self.offset[id(p)] - b.lo
        return b.data[start : start + p.numel()].view(p.shape)

    def grad_bytes(self) -> int:
        """Persistent gradient storage on this rank: the full buffer, or with ZeRO-2 the reduced parts (and
        the held buckets whole, which live for the whole step)."""
        if self.transient:
            size = torch.empty((), dtype=self.dtype).element_size()
            return sum((b.shard_grad.numel() + (b.hi - b.lo) * b.held) * size for b in self.buckets)
        return self.data.numel() * self.data.element_size()

    def shard_ranges(self) -> list[tuple[int, int]]:
        """The flat ranges this rank owns: its part of every bucket (sharded buffers)."""
        n, d = self.group.size, self.group.rank
        return [(lo + d * (hi - lo) // n, lo + (d + 1) * (hi - lo) // n) for lo, hi in self.bucket_bounds]

    def shard_view(self, p: nn.Parameter, lo: int, hi: int) -> torch.Tensor:
        """The reduced gradient of the parameter's flat range [lo, hi), which this rank owns."""
        b = self.bucket_of[id(p)]
        own_lo = b.lo + self.group.rank * (b.hi - b.lo) // self.group.size
        start = self.offset[id(p)] + lo - own_lo
        return b.shard_grad[start : start + hi - lo]

    def reset(self) -> None:
        for b in self.buckets:
            b.pending = {id(p) for p in b.params}
            b.handle, b.launched = None, False
        self._next = 0

    def zero(self) -> None:
        self._land()  # (a backward cut short left a reduce-scatter in flight: it must not land in the next step)
        self.first_bad = {}
        if self.data is not None:
            self.data.zero_()  # (ZeRO-1 parts are views into it)
        for b in self.buckets:
            if self.transient:
                b.data = None
                b.shard_grad.zero_()
        self.reset()

    def mark_ready(self, p: nn.Parameter, overlap: bool, events: list | None) -> None:
        bucket = self.bucket_of[id(p)]
        bucket.pending.discard(id(p))
        if self.transient:  # strictly in bucket order on every rank, like the launches below
            while self._next < self.free and not self.buckets[self._next].pending:
                self._reduce_transient(self.buckets[self._next], async_op=overlap)
                self._next += 1
            if self._next == self.free and not any(b.pending for b in self.buckets[self.free :]):
                self.reset()  # this micro-batch is done: the next one starts over (held buckets stay whole)
        elif overlap:
            self._launch_ready(events, async_op=True)

    def note_held_local(self) -> None:
        """Before anything mixes the held (tied) gradients with another rank's: note this rank's own. Their
        reductions do not note them again."""
        for b in self.buckets:
            if b.held:
                self._note_local(b)

    def _note_local(self, b: _Bucket) -> None:
        if b.data is None:
            return
        if self.local_norms is not None:
            self.local_norms.append((f"{self.name} #{b.index}", b.data.norm(p=2)))
        if not self.check_finite:
            return
        bad = ~torch.isfinite(b.data)
        first = torch.where(bad.any(), bad.to(torch.uint8).argmax(), torch.tensor(-1, device=b.data.device))
        prev = self.first_bad.get(b.index)
        self.first_bad[b.index] = first if prev is None else torch.where(prev >= 0, prev, first)

    def first_nonfinite(self) -> nn.Parameter | None:
        """The first parameter, in the order their gradients were produced, whose local gradient on this
        rank was non-finite before the reduction (None when every one was finite)."""
        for b in self.buckets:
            idx = int(self.first_bad[b.index]) if b.index in self.first_bad else -1
            if idx >= 0:
                flat = b.lo + idx
                return next((p for p in b.params if self.offset[id(p)] <= flat < self.offset[id(p)] + p.numel()), None)
        return None

    FLYING = 1  # (one reduce-scatter under the next bucket's backward: two buckets whole at most)

    def _reduce_transient(self, b: _Bucket, async_op: bool = False) -> None:
        """ZeRO-2: reduce-scatter a complete bucket into its part, add it up, and drop the full storage.
        `async_op` (--overlap-grad-reduce): launched under the backward and landed later, in launch order (each
        part's sums in the order a blocking reduction adds them); the next micro-batch's gradients of the
        bucket go to new storage meanwhile."""
        if not b.held:
            self._note_local(b)
        if self.group.size > 1:
            out = torch.empty_like(b.shard_grad)
            if async_op:
                handle = self._reduce_scatter(out, b.data, async_op=True)
                self._flying.append((b, b.data, out, handle))
                if len(self._flying) > self.FLYING:
                    self._land(1)
            else:
                self._land()  # (an earlier part's sum first)
                with self.group.blocked():
                    self._reduce_scatter(out, b.data)
                b.shard_grad += out
        else:
            b.shard_grad += b.data
        b.data = None

    def _reduce_scatter(self, out: torch.Tensor, data: torch.Tensor, async_op: bool = False):
        rs = reduce_scatter_with_fp32_accumulation if self.fp32_accumulation else reduce_scatter_tensor
        return rs(out, data, group=self.group.pg, async_op=async_op)

    def _land(self, n: int | None = None) -> None:
        """Wait for the oldest `n` (all) reduce-scatters in flight and add their parts up."""
        while self._flying and (n is None or n > 0):
            b, _, out, handle = self._flying.pop(0)
            with self.group.blocked():
                handle.wait()
            b.shard_grad += out
            n = None if n is None else n - 1

    def _launch_ready(self, events: list | None, async_op: bool, force: bool = False) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if (b.pending or b.held) and not force:
                return
            if not b.held:
                self._note_local(b)
            if self.group.size > 1:
                with self.group.blocked() if not async_op else contextlib.nullcontext():
                    if self.sharded:  # the summed part lands in scratch, then in this rank's slot (finish)
                        b.scratch = torch.empty_like(b.shard_grad)
                        b.handle = self._reduce_scatter(b.scratch, b.data, async_op=async_op)
                        if async_op and self.fp32_accumulation:
                            self._land_previous()
                    else:
                        b.handle = dist.all_reduce(b.data, group=self.group.pg, async_op=async_op)
            b.launched = True
            if events is not None:
                events.append(("launch", b.index))
            self._next += 1

    def _land_previous(self) -> None:
        """--ddp-reduce-scatter-with-fp32-accumulation under ZeRO-1's overlap: an all-to-all keeps a bucket-sized
        receive buffer until its wait, and ZeRO-1 waits at finish(): every bucket's at once, the gradient buffer
        again at the end of the backward. The bucket launched before this one completes now (two at most)."""
        prev = self.buckets[self._next - 1] if self._next > 0 else None
        if prev is not None and prev.handle is not None:
            with self.group.blocked():
                prev.handle.wait()
            prev.handle = None

    def finish(self, events: list | None) -> None:
        if self.transient:  # what is still whole, in order: held buckets, and behind a bucket left incomplete
            self._land()  # by an unused parameter, later micro-batches' gradients of earlier buckets
            for b in self.buckets:
                if b.data is not None:
                    self._reduce_transient(b)
            self.reset()
            return
        self._launch_ready(events, async_op=True, force=True)
        with self.group.blocked() if self.group.size > 1 else contextlib.nullcontext():
            for b in self.buckets:
                if b.handle is not None:
                    b.handle.wait()
        for b in self.buckets:
            if b.scratch is not None:
                b.shard_grad.copy_(b.scratch)
                b.scratch = None
        self.reset()


class DistributedDataParallel(nn.Module):
    def __init__(
        self,
        module: nn.Module,
        ctx: ParallelContext,
        *,
        overlap_grad_reduce: bool = False,
        bucket_size: int | None = None,
        record_events: bool = False,
        use_distributed_optimizer: bool = False,
        zero_stage: int = 1,
        grad_dtype: torch.dtype = torch.float32,
        reduce_scatter_with_fp32_accumulation: bool = False,
    ) -> None:
        """`grad_dtype`: what main gradients accumulate and are reduced in (bf16: --grad-reduce-in-bf16).
        `reduce_scatter_with_fp32_accumulation`: the distributed optimizer's reduce-scatters sum in fp32 (Megatron's
        --ddp-reduce-scatter-with-fp32-accumulation; all-reduces, without the distributed optimizer, are as they
        were, as in Megatron)."""
        super().__init__()
        self.module = module
        self.overlap_grad_reduce = overlap_grad_reduce
        expert = {id(p): meta.expert for _, p, meta in named_param_meta(module)}
        params = [p for p in module.parameters() if p.requires_grad]
        # Buckets with --overlap-grad-reduce (Megatron: one per buffer without), and always under ZeRO-2, whose
        # memory saving is that only the bucket being produced exists whole
        bucketed = overlap_grad_reduce or (use_distributed_optimizer and zero_stage >= 2)
        if bucketed and bucket_size is None:
            bucket_size = max(40_000_000, 1_000_000 * ctx.dp_cp.size)  # Megatron's default
        size = bucket_size if bucketed else None
        # Dense gradients are summed over data x context parallelism; an expert's over the ranks holding
        # the same expert (expert-data-parallel).
        # One buffer per parameter dtype within each, as Megatron keeps: the distributed optimizer all-gathers a
        # bucket's updated weights in its weights' dtype, so an fp32 weight of a --bf16 model (the learnable softmax
        # offsets) must not share a bucket with bf16 ones (it was gathered rounded to bf16, and the forward read that)
        groups = [
            ([p for p in ps if p.dtype == dtype], group, name if i == 0 else f"{name} ({str(dtype)[6:]})")
            for ps, group, name in (
                ([p for p in params if not expert[id(p)]], ctx.dp_cp, "bucket"),
                ([p for p in params if expert[id(p)]], ctx.edp, "expert bucket"),
            )
            for i, dtype in enumerate(dict.fromkeys(p.dtype for p in ps))
        ]
        self.use_distributed_optimizer = use_distributed_optimizer
        if zero_stage >= 2 and not use_distributed_optimizer:
            raise ValueError("ZeRO stage 2 shards gradients for the distributed optimizer: use_distributed_optimizer")
        self.zero_stage = zero_stage
        held = {id(p) for p in tied_embedding_copies(module, ctx)}
        self.buffers = [
            GradBuffer(
                [p for p in reversed(ps) if id(p) not in held] + [p for p in ps if id(p) in held],
                group,
                size,
                sharded=use_distributed_optimizer,
                zero_stage=zero_stage,
                held=held,
                dtype=grad_dtype,
                fp32_accumulation=reduce_scatter_with_fp32_accumulation,
                name=name,
            )
            for ps, group, name in groups
        ]
        self.buffer_of = {pid: b for b in self.buffers for pid in b.offset}
        self._local_norms: list | None = None
        for b in self.buffers:
            b.reset()
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._sync = True
        self.events: list | None = [] if record_events else None
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def buffer(self) -> GradBuffer:
        """The dense gradient buffer (of the first weight's dtype)."""
        return self.buffers[0]

    def main_grad(self, p: nn.Parameter) -> torch.Tensor:
        return self.buffer_of[id(p)].grad_view(p)

    def _on_grad(self, p: nn.Parameter) -> None:
        buffer = self.buffer_of[id(p)]
        buffer.grad_view(p).add_(p.grad)
        p.grad = None
        if self._sync or buffer.transient:  # ZeRO-2 reduces every micro-batch's gradients
            if self.events is not None:
                self.events.append(("ready", self._names[id(p)]))
            buffer.mark_ready(p, self.overlap_grad_reduce, self.events)

    @contextlib.contextmanager
    def final_grads(self) -> Iterator[None]:
        """Inside `no_sync()`: the gradients produced here are final for this step (a pipeline chunk's last
        backward), so their buckets are reduced as they complete."""
        outer, self._sync = self._sync, True
        try:
            yield
        finally:
            self._sync = outer

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (all but the last micro-batch)."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def grad_bytes(self) -> int:
        return sum(b.grad_bytes() for b in self.buffers)

    def check_finite(self, enabled: bool = True) -> None:
        """Note where this rank's own gradients first turn non-finite, before each reduction."""
        for b in self.buffers:
            b.check_finite = enabled

    def check_large(self, enabled: bool = True) -> None:
        """Note each reduction's local bucket norm before it (--check-for-large-grads), for take_local_norms."""
        self._local_norms = [] if enabled else None
        for b in self.buffers:
            b.local_norms = self._local_norms

    def take_local_norms(self) -> list[tuple[str, float]]:
        """(bucket, norm of this rank's own gradient in it) for each reduction since the last call, in launch order
        (one host synchronisation)."""
        norms = self._local_norms
        if not norms:
            return []
        values = torch.stack([t.float() for _, t in norms]).tolist()
        out = [(name, v) for (name, _), v in zip(norms, values)]
        norms.clear()
        return out

    def first_nonfinite_param(self) -> str | None:
        """The name of the first parameter whose local gradient was non-finite on this rank, if any."""
        for b in self.buffers:
            if (p := b.first_nonfinite()) is not None:
                name = self._names[id(p)]
                # the checkpoint's name (global layer and expert numbers), not the chunk-local one
                return self.module.global_name(name) if hasattr(self.module, "global_name") else name
        return None

    def sequence_parallel_shard_sum(self, tp: Group, etp: Group | None) -> None:
        """Sharded buffers: the TP sum of sequence-parallel parameters' gradients (experts' over `etp`: see
        tensor_parallel/grads.py), on this rank's reduced parts (the ranks of either group share one buffer layout
        and data-parallel rank, so they own the same parts)."""
        for group, which in sum_groups(tp, etp):
            sp = {id(p) for _, p, meta in named_param_meta(self.module) if meta.sequence_parallel and which(meta)}
            views = []
            for buffer in self.buffers:
                for (lo, hi), b in zip(buffer.shard_ranges(), buffer.buckets):
                    for p in b.params:
                        if id(p) not in sp:
                            continue
                        po = buffer.offset[id(p)]
                        a, z = max(lo, po), min(hi, po + p.numel())
                        if z > a:
                            views.append(buffer.shard_view(p, a - po, z - po))
            allreduce_coalesced(views, group)

    def note_tied_local(self) -> None:
        """For the NaN report: record this rank's own tied-embedding gradient before any reduction of it."""
        for b in self.buffers:
            b.note_held_local()

    def finish_grad_sync(self) -> None:
        """Launch whatever buckets are left and wait for every reduction."""
        for b in self.buffers:
            b.finish(self.events)

    def zero_grad_buffer(self) -> None:
        for b in self.buffers:
            b.zero()
        if self.events is not None:
            self.events.clear()
        if self._local_norms:  # (a step whose norms nobody took: not the next step's)
            self._local_norms.clear()
