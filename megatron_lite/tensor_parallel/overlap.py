"""--tp-comm-overlap: the sequence-parallel GEMMs decomposed into TP ring steps, each step's GEMM running
while the next chunk travels (batched isend/irecv; on CUDA, NCCL moves it on its own stream).

All-gather + GEMM (column-parallel, X sharded along the sequence): at step i this rank multiplies the
sequence chunk it holds (rank r - i's) into that chunk's rows of the output, while passing the chunk on.

GEMM + reduce-scatter (row-parallel): at step i this rank computes its partial product for the chunk that
ends on rank r - 1 - i after the remaining steps, adds the partial sum that arrived for it, and passes it
on; after TP steps each rank holds the full sum of its own chunk.

The backward of each is the other: the column layer's input gradient is a GEMM + reduce-scatter, while the
input chunks go round the same ring again for the weight gradient; the row layer's input gradient is an
all-gather (of the output gradient) + GEMM. Each weight gradient is then one GEMM over the gathered
chunks (accumulating it chunk by chunk would re-read the whole gradient TP times).
Every per-chunk GEMM writes straight into its slice of the output. Results equal all-gather-then-matmul and
matmul-then-reduce-scatter (tests/test_tp_overlap.py).
"""

from __future__ import annotations

import torch

from megatron_lite import kernels as K
from megatron_lite.parallel_context import Group
from megatron_lite.ring import ring_exchange, wait


def _mm_into(out: torch.Tensor, a: torch.Tensor, w: torch.Tensor, triton: bool = False) -> None:
    """out[...] = a @ w^T for a [rows, batch, k], w [n, k], out [rows, batch, n] (a contiguous view): our
    Triton GEMM writing into the slice with `triton` (CUDA), else torch.matmul(out=...)."""
    a2, o2 = a.reshape(-1, a.shape[-1]), out.view(-1, out.shape[-1])
    if triton:
        K.matmul_into(o2, a2, w)
    else:
        torch.matmul(a2, w.t(), out=o2)


def all_gather_matmul(x: torch.Tensor, w: torch.Tensor, group: Group, triton: bool = False) -> torch.Tensor:
    """[AG(x)] @ w^T with x [c, batch, k] this rank's sequence chunk -> [TP * c, batch, n]."""
    tp, r, c = group.size, group.rank, x.shape[0]
    out = torch.empty((tp * c, *x.shape[1:-1], w.shape[0]), dtype=x.dtype, device=x.device)
    cur = x.contiguous()
    for i in range(tp):
        works = []
        if i < tp - 1:
            (nxt,), works = ring_exchange([cur], group)
        j = (r - i) % tp
        _mm_into(out[j * c : (j + 1) * c], cur, w, triton)
        wait(works, group)
        if i < tp - 1:
            cur = nxt
    return out


def matmul_reduce_scatter(x: torch.Tensor, w: torch.Tensor, group: Group, triton: bool = False) -> torch.Tensor:
    """RS(x @ w^T) along the sequence with x [TP * c, batch, k] -> [c, batch, n], this rank's chunk."""
    tp, r = group.size, group.rank
    if x.shape[0] % tp:  # (as the plain reduce-scatter says: the ring would drop the remainder's rows)
        raise ValueError(f"dim 0 of size {x.shape[0]} does not split over {tp} ranks")
    c = x.shape[0] // tp

    def partial(i: int) -> torch.Tensor:
        j = (r - 1 - i) % tp
        out = torch.empty((c, *x.shape[1:-1], w.shape[0]), dtype=x.dtype, device=x.device)
        _mm_into(out, x[j * c : (j + 1) * c], w, triton)
        return out

    part = partial(0)
    for i in range(1, tp):
        (acc,), works = ring_exchange([part], group)
        part = partial(i)  # the next chunk's GEMM runs while the running sum travels
        wait(works, group)
        part += acc
    return part


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, group: Group, triton: bool):
        ctx.save_for_backward(x, w)
        ctx.group, ctx.triton = group, triton
        return all_gather_matmul(x, w, group, triton)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        group = ctx.group
        tp, r, c = group.size, group.rank, x.shape[0]
        dy = dy.contiguous()
        # The input chunks go round the ring again (into one buffer, for a single weight-gradient GEMM)
        # while the input gradient is computed chunk by chunk and reduce-scattered round the same ring.
        x_full = torch.empty((tp * c, *x.shape[1:]), dtype=x.dtype, device=x.device)
        x_cur = x.contiguous()

        def partial(i: int) -> torch.Tensor:  # the input gradient's partial sum for chunk (r - 1 - i)
            j = (r - 1 - i) % tp
            out = torch.empty((c, *dy.shape[1:-1], w.shape[1]), dtype=dy.dtype, device=dy.device)
            _mm_into(out, dy[j * c : (j + 1) * c], w.t(), ctx.triton)
            return out

        part = partial(0)
        for i in range(tp):
            k = (r - i) % tp
            x_full[k * c : (k + 1) * c] = x_cur
            if i == tp - 1:
                break
            # Both transfers (the input chunk onward, the running sum onward) run under the next GEMM.
            (x_next, acc), works = ring_exchange([x_cur, part], group)
            part = partial(i + 1)
            wait(works, group)
            part += acc
            x_cur = x_next
        dx = part
        dw = dy.reshape(-1, dy.shape[-1]).t() @ x_full.reshape(-1, x_full.shape[-1])
        return dx, dw, None, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, group: Group, triton: bool):
        ctx.save_for_backward(x, w)
        ctx.group, ctx.triton = group, triton
        return matmul_reduce_scatter(x, w, group, triton)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        group = ctx.group
        tp, r, c = group.size, group.rank, dy.shape[0]
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dy_full = torch.empty((tp * c, *dy.shape[1:]), dtype=dy.dtype, device=dy.device)
        cur = dy.contiguous()
        for i in range(tp):  # all-gather of the output gradient + GEMM, chunk by chunk
            works = []
            if i < tp - 1:
                (nxt,), works = ring_exchange([cur], group)
            j = (r - i) % tp
            dy_full[j * c : (j + 1) * c] = cur
            _mm_into(dx[j * c : (j + 1) * c], cur, w.t(), ctx.triton)
            wait(works, group)
            if i < tp - 1:
                cur = nxt
        dw = dy_full.reshape(-1, dy_full.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return dx, dw, None, None


def column_parallel_overlapped(x: torch.Tensor, w: torch.Tensor, group: Group, triton: bool = False) -> torch.Tensor:
    """Differentiable [AG(x)] @ w^T, overlapped; per-chunk GEMMs by our Triton kernel with `triton`."""
    return _AllGatherMatmul.apply(x, w, group, triton)


def row_parallel_overlapped(x: torch.Tensor, w: torch.Tensor, group: Group, triton: bool = False) -> torch.Tensor:
    """Differentiable RS(x @ w^T), overlapped; per-chunk GEMMs by our Triton kernel with `triton`."""
    return _MatmulReduceScatter.apply(x, w, group, triton)
