"""Runs a pipeline schedule (schedules.py) on this rank's model chunks.

Activations and their gradients travel between neighbouring stages with point-to-point sends and
receives on the pipeline group. Their shape is known from the configuration ([seq / TP under sequence
parallelism, micro-batch, hidden]), so no shape is ever exchanged. Consecutive communication actions of
the schedule (up to a compute or a FLUSH: batches that complete under NCCL's rule, schedules.py) go out
as one batch_isend_irecv as early as the schedule lists them; a receive is waited for
before the next compute step, or, with --overlap-p2p-comm (default with virtual stages, as in Megatron),
only when the compute that reads it comes; sends are waited for at the end of the step (their tensors are
kept alive until then). A stage
keeps a micro-batch's input and output only until its backward has run.
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
def _actions(pp: int, vp: int, num_microbatches: int, rank: int, forward_only: bool) -> tuple:
    """This rank's schedule, built once per shape (every rank's is built to place the communication: at PP=8 x
    VP=4 with 256 micro-batches a third of a second, each step otherwise)."""
    return tuple(build_schedule(pp, vp, num_microbatches, rank, forward_only))


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
    `stats`, when given, receives the most micro-batch outputs this rank held at once. `final_grads`, when
    given, is entered around each chunk's last backward: the data-parallel wrapper's signal that the
    chunk's gradients are final, so their reduction can start under the remaining backward."""
    pp, vp = ctx.pp.size, len(chunks)
    actions = _actions(pp, vp, len(micro_batches), ctx.pp.rank, forward_only)
    device = ctx.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    received: dict[tuple, torch.Tensor] = {}  # (kind, microbatch, chunk) -> tensor from a neighbour
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    input_grads: dict[tuple[int, int], torch.Tensor] = {}
    pending = []  # (handle, tensor) of sends in flight
    group = ctx.pp.pg if pp > 1 else None
    last_chunk = vp - 1 if ctx.pp.rank == pp - 1 else None
    last_backward = {a.chunk: i for i, a in enumerate(actions) if a.kind == BACKWARD}

    batch: list[dist.P2POp] = []  # consecutive communication actions, sent as one batch
    recv_works: dict[int, object] = {}  # id(receive buffer) -> its work, until waited on
    peak = 0
    # --overlap-p2p-comm (default with virtual stages): a receive is waited on only when the compute that
    # reads it comes, so transfers run under the computes in between; otherwise before the next compute.
    lazy = ctx.parallel.overlap_p2p_comm if ctx.parallel.overlap_p2p_comm is not None else vp > 1

    def flush() -> None:
        if batch:
            works = dist.batch_isend_irecv(batch)
            if len(works) != len(batch):  # NCCL coalesces a batch into one work: it stands for every op
                works = [works[0]] * len(batch)
            for op, work in zip(batch, works):
                if op.op is dist.irecv:
                    recv_works[id(op.tensor)] = work
                else:
                    pending.append((work, op.tensor))
            batch.clear()
        if not lazy:
            wait_for(*recv_works)

    def wait_for(*buffer_ids: int) -> None:
        works = [recv_works.pop(i) for i in buffer_ids if i in recv_works]
        if works:
            with ctx.pp.blocked():
                for work in works:
                    work.wait()

    for i, a in enumerate(actions):
        key = (a.microbatch, a.chunk)
        if a.kind in (RECV_FORWARD, RECV_BACKWARD):
            buf = torch.empty(activation_shape, dtype=dtype, device=device)
            batch.append(dist.P2POp(dist.irecv, buf, ctx.pp.ranks[a.peer], group))
            received[(a.kind, *key)] = buf
            continue
        if a.kind in (SEND_FORWARD, SEND_BACKWARD):
            if a.kind == SEND_FORWARD:  # keep the output for the backward, unless there is none
                t = (outputs.pop(key) if forward_only else outputs[key]).detach().contiguous()
            else:
                t = input_grads.pop(key).contiguous()
            batch.append(dist.P2POp(dist.isend, t, ctx.pp.ranks[a.peer], group))
            continue
        flush()  # the next compute may need what was just received (a FLUSH action does only this)
        if a.kind == FORWARD:
            mb = micro_batches[a.microbatch]
            chunk = chunks[a.chunk]
            x = received.pop((RECV_FORWARD, *key), None)
            if x is not None:
                wait_for(id(x))
                x.requires_grad_(not forward_only)
                inputs[key] = x
            with torch.no_grad() if forward_only else torch.enable_grad():
                if a.chunk == last_chunk:
                    token_loss = chunk(
                        mb["tokens"],
                        mb.get("position_ids"),
                        labels=counted_labels(mb["labels"], mb["loss_mask"]),
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
        elif a.kind == BACKWARD:
            out = outputs.pop(key)
            grad = received.pop((RECV_BACKWARD, *key), None)
            if grad is not None:
                wait_for(id(grad))
            final = final_grads is not None and last_backward[a.chunk] == i
            with final_grads() if final else contextlib.nullcontext():
                if out.requires_grad:  # (not on a first stage that trains nothing: LoRA's frozen embedding)
                    torch.autograd.backward(out, grad_tensors=grad)
            x = inputs.pop(key, None)
            if x is not None:
                input_grads[key] = x.grad
    flush()
    wait_for(*recv_works)
    if stats is not None:
        stats["max_live_outputs"] = peak
    with ctx.pp.blocked():
        for handle, _ in pending:
            handle.wait()
    return total
