"""Runs a pipeline schedule (schedules.py) on this rank's model chunks.

Activations and their gradients travel between neighbouring stages with point-to-point sends and
receives on the pipeline group. Their shape is known from the configuration ([seq / TP under sequence
parallelism, micro-batch, hidden]), so no shape is ever exchanged. Consecutive communication actions of
the schedule (up to a compute or a FLUSH: batches that complete under NCCL's rule, schedules.py) go out
as one batch_isend_irecv as early as the schedule lists them; a receive is waited for
before the next compute step, or, with --overlap-p2p-comm (default with virtual stages, as in Megatron),
only when the compute that reads it comes. A send's tensor is held until its transfer is known complete:
its work reports it (NCCL), or a reply the peer sent after consuming it has arrived (schedules.send_releases;
gloo reports a send complete only when waited); the rest are waited for at the end of the step. So what a
rank holds is bounded by the schedule, not by the number of micro-batches. As in Megatron
(deallocate_output_tensor), a sent output keeps only its autograd graph for the backward, not its values: the
backward is run from the received gradient alone. A stage keeps a micro-batch's input and graph only until its
backward has run.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist

from megatron_lite.pipeline_parallel.schedules import (
    BACKWARD,
    FORWARD,
    RECV_BACKWARD,
    RECV_FORWARD,
    SEND_BACKWARD,
    SEND_FORWARD,
    build_schedule,
    send_releases,
)
from megatron_lite.tensor_parallel.cross_entropy import counted_labels


def documents(mb: dict) -> dict:
    """The model's keywords for what the micro-batch carries beyond tokens, positions and labels: document_ids
    (--reset-attention-mask) and the multi-token-prediction inputs (--mtp-num-layers). Models that never see
    them, such as benchmark stand-ins, need not take them."""
    out = {"document_ids": mb["document_ids"]} if "document_ids" in mb else {}
    if "mtp_tokens" in mb:
        out["mtp"] = {k: v for k, v in mb.items() if k.startswith("mtp_")}
    return out


@functools.lru_cache(maxsize=8)
def _actions(pp: int, vp: int, num_microbatches: int, rank: int, forward_only: bool, group: int | None) -> tuple:
    """This rank's schedule, built once per shape (every rank's is built to place the communication: at PP=8 x
    VP=4 with 256 micro-batches a third of a second, each step otherwise)."""
    return tuple(build_schedule(pp, vp, num_microbatches, rank, forward_only, group))


@functools.lru_cache(maxsize=8)
def _releases(
    pp: int, vp: int, num_microbatches: int, rank: int, forward_only: bool, group: int | None
) -> dict[int, list[int]]:
    """{index of a receive: the sends it proves complete} (schedules.send_releases, inverted)."""
    out: dict[int, list[int]] = {}
    for send, recv in send_releases(pp, vp, num_microbatches, rank, forward_only, group).items():
        out.setdefault(recv, []).append(send)
    return out


def _free_values(out: torch.Tensor) -> None:
    """Drop a sent output's values, keeping its graph (the send holds the storage until it completes). Only a
    tensor an op made that owns its storage: a view's base could be alive elsewhere, and a chunk with no layers
    returns its received input, a leaf whose gradient is accumulated against its shape."""
    if out.grad_fn is not None and out._base is None:
        out.data = torch.empty((1,), dtype=out.dtype, device=out.device)


def _backward(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Backward from `out` (scalar loss, or an output whose values were freed: autograd's own entry would
    check `grad` against the freed shape, so the engine is called directly, as Megatron's custom_backward)."""
    if grad is None:
        torch.autograd.backward(out)
        return
    torch.autograd.Variable._execution_engine.run_backward((out,), (grad,), False, False, (), True, True)


def _held_bytes(outputs: dict, pending: dict) -> int:
    """Bytes of the storages this rank holds for the pipeline: outputs awaiting their backward and tensors of
    sends in flight (a sent output and its send share one storage: counted once)."""
    storages = {}
    for t in [*outputs.values(), *(t for _, t in pending.values())]:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def run_pipeline(
    chunks,
    ctx,
    micro_batches: list[dict[str, torch.Tensor]],
    activation_shape: tuple[int, ...],
    dtype: torch.dtype,
    loss_scale: float = 1.0,
    forward_only: bool = False,
    stats: dict | None = None,
    final_grads: Callable[[], AbstractContextManager] | None = None,
) -> torch.Tensor:
    """Forward (and backward) every micro-batch through this rank's chunks. Returns the summed token loss
    on the rank holding the last stage, zero elsewhere; `loss_scale` multiplies the loss before backward.
    `stats`, when given, receives the most micro-batch outputs this rank held at once (max_live_outputs)
    and the most bytes of outputs and sends in flight (max_held_bytes), and the most received inputs it
    kept for their backward (max_live_inputs). `final_grads`, when
    given, is entered around each chunk's last backward: the data-parallel wrapper's signal that the
    chunk's gradients are final, so their reduction can start under the remaining backward."""
    pp, vp = ctx.pp.size, len(chunks)
    mb_group = ctx.parallel.microbatch_group_size if vp > 1 else None  # (the schedule's, not a process group)
    actions = _actions(pp, vp, len(micro_batches), ctx.pp.rank, forward_only, mb_group)
    device = ctx.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    received: dict[tuple, torch.Tensor] = {}  # (kind, microbatch, chunk) -> tensor from a neighbour
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    input_grads: dict[tuple[int, int], torch.Tensor] = {}
    pending: dict[int, tuple] = {}  # action index of a send in flight -> (work, tensor)
    releases = _releases(pp, vp, len(micro_batches), ctx.pp.rank, forward_only, mb_group)
    group = ctx.pp.pg if pp > 1 else None
    last_chunk = vp - 1 if ctx.pp.rank == pp - 1 else None
    last_backward = {a.chunk: i for i, a in enumerate(actions) if a.kind == BACKWARD}

    batch: list[tuple[dist.P2POp, int]] = []  # consecutive communication actions (and their index), one batch
    recv_works: dict[int, tuple] = {}  # id(receive buffer) -> (its work, its action index), until waited on
    peak = held = peak_inputs = 0
    # --overlap-p2p-comm (default with virtual stages): a receive is waited on only when the compute that
    # reads it comes, so transfers run under the computes in between; otherwise before the next compute.
    lazy = ctx.parallel.overlap_p2p_comm if ctx.parallel.overlap_p2p_comm is not None else vp > 1

    def flush() -> None:
        if batch:
            works = dist.batch_isend_irecv([op for op, _ in batch])
            if len(works) != len(batch):  # NCCL coalesces a batch into one work: it stands for every op
                works = [works[0]] * len(batch)
            for (op, index), work in zip(batch, works):
                if op.op is dist.irecv:
                    recv_works[id(op.tensor)] = (work, index)
                else:
                    pending[index] = (work, op.tensor)
            batch.clear()
        if not lazy:
            wait_for(*recv_works)
        for index in [i for i, (work, _) in pending.items() if work.is_completed()]:
            del pending[index]

    def wait_for(*buffer_ids: int) -> None:
        works = [recv_works.pop(i) for i in buffer_ids if i in recv_works]
        if works:
            with ctx.pp.blocked():
                for work, _ in works:
                    work.wait()
                # the sends these replies prove complete: their wait returns at once, and their tensors go
                for send in (s for _, index in works for s in releases.get(index, ()) if s in pending):
                    pending.pop(send)[0].wait()

    for i, a in enumerate(actions):
        key = (a.microbatch, a.chunk)
        if a.kind in (RECV_FORWARD, RECV_BACKWARD):
            buf = torch.empty(activation_shape, dtype=dtype, device=device)
            batch.append((dist.P2POp(dist.irecv, buf, ctx.pp.ranks[a.peer], group), i))
            received[(a.kind, *key)] = buf
            continue
        if a.kind in (SEND_FORWARD, SEND_BACKWARD):
            if a.kind == SEND_FORWARD:  # keep the output's graph for the backward, unless there is none
                out = outputs.pop(key) if forward_only else outputs[key]
                t = out.detach().contiguous()
                _free_values(out)
            else:
                t = input_grads.pop(key).contiguous()
            batch.append((dist.P2POp(dist.isend, t, ctx.pp.ranks[a.peer], group), i))
            continue
        flush()  # the next compute may need what was just received (a FLUSH action does only this)
        if a.kind == FORWARD:
            mb = micro_batches[a.microbatch]
            chunk = chunks[a.chunk]
            x = received.pop((RECV_FORWARD, *key), None)
            if x is not None:
                wait_for(id(x))
                x.requires_grad_(not forward_only)
                if not forward_only:  # (kept for the backward; evaluation has none: Megatron pops it too)
                    inputs[key] = x
            with torch.no_grad() if forward_only else torch.enable_grad():
                if a.chunk == last_chunk:
                    token_loss = chunk(
                        mb["tokens"],
                        mb.get("position_ids"),
                        labels=counted_labels(mb["labels"], mb["loss_mask"]),
                        grads_in_forward=True,  # (summed with one scale below)
                        hidden_states=x,
                        **documents(mb),
                    )
                    loss_sum = (token_loss.float() * mb["loss_mask"]).sum()
                    total += loss_sum.detach().double()
                    out = loss_sum * loss_scale
                else:
                    out = chunk(mb["tokens"], mb.get("position_ids"), hidden_states=x, **documents(mb))
            if not (forward_only and a.chunk == last_chunk):
                outputs[key] = out
            peak = max(peak, len(outputs))
            peak_inputs = max(peak_inputs, len(inputs))
            if stats is not None:
                held = max(held, _held_bytes(outputs, pending))
        elif a.kind == BACKWARD:
            out = outputs.pop(key)
            grad = received.pop((RECV_BACKWARD, *key), None)
            if grad is not None:
                wait_for(id(grad))
            final = final_grads is not None and last_backward[a.chunk] == i
            with final_grads() if final else contextlib.nullcontext():
                if out.requires_grad:  # (not on a first stage that trains nothing: LoRA's frozen embedding)
                    _backward(out, grad)
            x = inputs.pop(key, None)
            if x is not None:
                input_grads[key] = x.grad
    flush()
    wait_for(*recv_works)
    if stats is not None:
        stats["max_live_outputs"] = peak
        stats["max_live_inputs"] = peak_inputs
        stats["max_held_bytes"] = held
    with ctx.pp.blocked():
        for handle, _ in pending.values():
            handle.wait()
    return total
