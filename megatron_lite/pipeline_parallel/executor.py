"""Runs a pipeline schedule (schedules.py) on this rank's model chunks.

Activations and their gradients travel between neighbouring stages with point-to-point sends and
receives on the pipeline group. Their shape is known from the configuration ([seq / TP under sequence
parallelism, micro-batch, hidden]), so no shape is ever exchanged. Sends are asynchronous (their handles
are kept, with the tensors, until the step ends); receives block, in the order the schedule lists them.
A stage keeps a micro-batch's input and output only until its backward has run.
"""

from __future__ import annotations

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


def run_pipeline(
    chunks,
    ctx,
    micro_batches: list[dict[str, torch.Tensor]],
    activation_shape: tuple[int, ...],
    dtype: torch.dtype,
    loss_scale: float = 1.0,
    forward_only: bool = False,
) -> torch.Tensor:
    """Forward (and backward) every micro-batch through this rank's chunks. Returns the summed token loss
    on the rank holding the last stage, zero elsewhere; `loss_scale` multiplies the loss before backward."""
    pp, vp = ctx.pp.size, len(chunks)
    actions = build_schedule(pp, vp, len(micro_batches), ctx.pp.rank, forward_only)
    device = ctx.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    received: dict[tuple, torch.Tensor] = {}  # (kind, microbatch, chunk) -> tensor from a neighbour
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    input_grads: dict[tuple[int, int], torch.Tensor] = {}
    pending = []  # (handle, tensor) of sends in flight
    group = ctx.pp.pg if pp > 1 else None
    last_chunk = vp - 1 if ctx.pp.rank == pp - 1 else None

    for a in actions:
        key = (a.microbatch, a.chunk)
        if a.kind in (RECV_FORWARD, RECV_BACKWARD):
            buf = torch.empty(activation_shape, dtype=dtype, device=device)
            dist.recv(buf, src=ctx.pp.ranks[a.peer], group=group)
            received[(a.kind, *key)] = buf
        elif a.kind in (SEND_FORWARD, SEND_BACKWARD):
            if a.kind == SEND_FORWARD:  # keep the output for the backward, unless there is none
                t = (outputs.pop(key) if forward_only else outputs[key]).detach().contiguous()
            else:
                t = input_grads.pop(key).contiguous()
            pending.append((dist.isend(t, dst=ctx.pp.ranks[a.peer], group=group), t))
        elif a.kind == FORWARD:
            mb = micro_batches[a.microbatch]
            chunk = chunks[a.chunk]
            x = received.pop((RECV_FORWARD, *key), None)
            if x is not None:
                x.requires_grad_(not forward_only)
                inputs[key] = x
            with torch.no_grad() if forward_only else torch.enable_grad():
                if a.chunk == last_chunk:
                    token_loss = chunk(mb["tokens"], mb.get("position_ids"), labels=mb["labels"], hidden_states=x)
                    loss_sum = (token_loss.float() * mb["loss_mask"]).sum()
                    total += loss_sum.detach().double()
                    out = loss_sum * loss_scale
                else:
                    out = chunk(mb["tokens"], mb.get("position_ids"), hidden_states=x)
            outputs[key] = out
            if forward_only and a.chunk == last_chunk:
                outputs.pop(key)
        elif a.kind == BACKWARD:
            out = outputs.pop(key)
            grad = received.pop((RECV_BACKWARD, *key), None)
            torch.autograd.backward(out, grad_tensors=grad)
            x = inputs.pop(key, None)
            if x is not None:
                input_grads[key] = x.grad
    for handle, _ in pending:
        handle.wait()
    return total
