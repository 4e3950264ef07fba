"""Fused linear cross-entropy: loss = CE(hidden @ weight^T, labels) without ever holding the full logits.

Tokens go through in chunks: a chunk's logits [chunk, vocab] are computed, one Triton kernel takes each
row's max, sum of exponentials, target logit and sum of logits, and a second turns the chunk's logits, in
place, into their gradient; two GEMMs then give the chunk's hidden gradient and add to the weight
gradient. Peak extra memory is O(chunk x vocab) instead of O(tokens x vocab).

Under tensor parallelism `weight` is this rank's vocabulary shard (rows [vocab_start, vocab_start + V_local)
of the vocabulary); the row statistics are combined over `tp_group` (max, then sums), so only [tokens]-sized
tensors cross ranks, and the returned hidden gradient is this shard's part (the caller's TP reduction sums
it, as for a column-parallel output layer). Columns at or beyond `vocab_size` (padding) take no probability.

With reduction "mean" or "sum" the gradients are computed in the forward pass and scaled by the incoming
gradient. With "none" the backward recomputes the chunks with each token's incoming gradient, unless the caller
passes grads_in_forward=True, as the model does: its per-token losses are summed (tokens outside the loss mask
carry ignore_index), so every counted token receives one and the same gradient. The gradients are then made in
the forward too and the backward only scales them (three vocabulary GEMMs, not four). On a CPU it checks that
promise on the incoming gradient and, when it does not hold, warns and recomputes; on a GPU a host read there
stalled every step, so a device assert checks it instead (a broken promise stops the process).
Options: z-loss (coeff * logsumexp^2 per token) and label smoothing.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_lite.kernels._common import (
    HAVE_TRITON,
    launched,
    next_pow2,
    no_interpreted_bf16_dot,
    on_tensor_device,
    require,
    rows_per_program,
    triton_usable,
)


class RowSetting(NamedTuple):
    """A row kernel's launch on a GPU (tools/bench_ce_rows.py sweeps them)."""

    block: int  # columns a step (at most the row's, rounded up to a power of two)
    stages: int  # steps whose loads are prefetched into shared memory (1: none)
    warps: int


# From tools/bench_ce_rows.py on an H200 (a 1024 x 128256 bf16 chunk, 2026-12-04): the statistics 82 us, 0.82 of
# a same-size copy (134 us before the unmasked loop and these settings); the gradient 144 us, 0.90 (160 before).
STATS_SETTING = RowSetting(2048, 3, 4)
GRAD_SETTING = RowSetting(4096, 1, 16)


if HAVE_TRITON:
    import triton
    import triton.language as tl

    # Both row kernels take ROWS rows per program as [ROWS, BLOCK] tiles: 1 on a GPU, more under the interpreter.
    # Their loops run unmasked over the row's whole blocks of real columns, then masked over the rest (a partial
    # block; and for the gradient, which writes zeros there, the padding): on an H200 the statistics of a 1024-row
    # chunk of Llama-3's vocabulary were bound by their instructions, not memory (0.62 of a same-size copy), and a
    # column mask costs five of them an element.
    @triton.jit
    def _stats_step(x, real, m, s, total, MASKED: tl.constexpr, SUM: tl.constexpr):
        """One block of the running [max, sum exp(x - max), sum of x]: one cross-thread reduction (the max), not
        four (on the H200 a 1024-row chunk took 134 us instead of 194)."""
        new_m = tl.maximum(m, tl.max(x, axis=1))
        e = tl.exp(x - new_m[:, None])
        if MASKED:
            e = tl.where(real, e, 0.0)
        s = s * tl.exp(m - new_m)[:, None] + e
        if SUM:
            if MASKED:
                x = tl.where(real, x, 0.0)
            total += x
        return new_m, s, total

    @triton.jit
    def _ce_stats(
        LOGITS, LABELS, STATS, rows, stride_l, V_local, vocab_start, vocab_size, BLOCK: tl.constexpr,
        ROWS: tl.constexpr, STAGES: tl.constexpr, SUM: tl.constexpr,
    ):  # fmt: skip
        """Per row: [max, sum exp(x - max), target logit (0 if not here), sum of logits (SUM, else 0)] over real
        columns. STAGES > 1: the coming steps' loads are prefetched (cp.async)."""
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # rows x stride may pass 2^31
        rmask = row < rows
        last = tl.minimum(row, rows - 1)  # (rows past the end read the last one's, unmasked; nothing is stored)
        n_real = tl.minimum(V_local, vocab_size - vocab_start)  # (<= 0: a shard of padding only)
        full = tl.maximum(n_real, 0) // BLOCK * BLOCK
        # A large finite floor rather than -inf: a block (or shard) of padding only must not give inf - inf.
        m = tl.zeros([ROWS], dtype=tl.float32) - 1e30
        s = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        total = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for start in tl.range(0, full, BLOCK, num_stages=STAGES):
            cols = start + tl.arange(0, BLOCK)[None, :]
            x = tl.load(LOGITS + last[:, None] * stride_l + cols).to(tl.float32)
            m, s, total = _stats_step(x, x, m, s, total, False, SUM)
        for start in range(full, n_real, BLOCK):
            cols = start + tl.arange(0, BLOCK)[None, :]
            real = rmask[:, None] & (cols < n_real)
            x = tl.load(LOGITS + row[:, None] * stride_l + cols, mask=real, other=-1e30).to(tl.float32)
            m, s, total = _stats_step(x, real, m, s, total, True, SUM)
        # The target's logit, read once where this shard holds it (ignore_index and padding hold none: 0)
        local = tl.load(LABELS + row, mask=rmask, other=-1).to(tl.int64) - vocab_start
        here = rmask & (local >= 0) & (local < n_real)
        target = tl.load(LOGITS + row * stride_l + local, mask=here, other=0.0).to(tl.float32)
        tl.store(STATS + row * 4 + 0, m, mask=rmask)
        tl.store(STATS + row * 4 + 1, tl.sum(s, axis=1), mask=rmask)
        tl.store(STATS + row * 4 + 2, target, mask=rmask)
        tl.store(STATS + row * 4 + 3, tl.sum(total, axis=1), mask=rmask)

    @triton.jit
    def _ce_grad(
        LOGITS, LABELS, STATS, SCALE, rows, stride_l, V_local, vocab_start, vocab_size, z_coeff, smoothing,
        BLOCK: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr,
    ):  # fmt: skip
        """In place: logits -> d loss / d logits = (softmax * (1 + 2 z lse) - (1-eps) onehot - eps / V) * scale,
        lse = max + log(sum of exponentials) from the row's (combined) statistics."""
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # rows x stride may pass 2^31
        rmask = row < rows
        last = tl.minimum(row, rows - 1)
        n_real = tl.minimum(V_local, vocab_size - vocab_start)
        full = tl.maximum(n_real, 0) // BLOCK * BLOCK
        label = tl.load(LABELS + row, mask=rmask, other=-1)[:, None] - vocab_start
        lse = tl.load(STATS + row * 4, mask=rmask, other=0.0) + tl.log(
            tl.load(STATS + row * 4 + 1, mask=rmask, other=1.0)
        )
        scale = tl.load(SCALE + row, mask=rmask, other=0.0)
        # (the row's constants, scaled once: softmax's factor, the target's and every column's smoothing)
        p_scale = ((1.0 + 2.0 * z_coeff * lse) * scale)[:, None]
        hit = ((1.0 - smoothing) * scale)[:, None]
        flat = (smoothing / vocab_size * scale)[:, None]
        lse = lse[:, None]
        for start in tl.range(0, full, BLOCK, num_stages=STAGES):
            cols = start + tl.arange(0, BLOCK)[None, :]
            x = tl.load(LOGITS + last[:, None] * stride_l + cols).to(tl.float32)
            g = tl.exp(x - lse) * p_scale - tl.where(cols == label, hit, 0.0) - flat
            tl.store(LOGITS + row[:, None] * stride_l + cols, g.to(LOGITS.dtype.element_ty), mask=rmask[:, None])
        for start in range(full, V_local, BLOCK):  # the rest: a partial block, and padding (gradient 0)
            cols = start + tl.arange(0, BLOCK)[None, :]
            inside = rmask[:, None] & (cols < V_local)
            real = inside & (cols < n_real)
            x = tl.load(LOGITS + row[:, None] * stride_l + cols, mask=inside, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) * p_scale - tl.where(cols == label, hit, 0.0) - flat
            tl.store(
                LOGITS + row[:, None] * stride_l + cols, tl.where(real, g, 0.0).to(LOGITS.dtype.element_ty), mask=inside
            )

    @triton.jit
    def _scale_inplace(X, S, n, BLOCK: tl.constexpr):
        """X *= S[0] in fp32 (the backward's incoming gradient on the gradients made in the forward). A gradient of
        exactly 1 (loss.backward() on the mean loss) touches nothing: the device decides, so the host never waits
        to read it, and the common case skips a pass over the vocab x hidden weight gradient."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # a weight gradient may pass 2^31
        s = tl.load(S)
        mask = offs < tl.where(s != 1.0, n, 0)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(X + offs, (x * s).to(X.dtype.element_ty), mask=mask)

    def _sig(t: str, kernel) -> dict:
        """A row kernel's signature: the statistics' arguments, and the gradient's more."""
        grad = kernel is _ce_grad
        sig = {"LOGITS": f"*{t}", "LABELS": "*i64", "STATS": "*fp32", **({"SCALE": "*fp32"} if grad else {})}
        sig.update(dict.fromkeys(("rows", "stride_l", "V_local", "vocab_start", "vocab_size"), "i32"))
        sig.update({"z_coeff": "fp32", "smoothing": "fp32"} if grad else {})
        return {**sig, **dict.fromkeys(("BLOCK", "ROWS", "STAGES") + (() if grad else ("SUM",)), "constexpr")}

    def _case(name: str, kernel, setting: RowSetting, **consts) -> tuple:
        return name, kernel, {"BLOCK": setting.block, "STAGES": setting.stages, **consts}, {"num_warps": setting.warps}

    # (name, kernel, constexprs, options): the launches the defaults make (with and without label smoothing's
    # sum), and others the bench tool may run
    _ROW_CASES = [
        _case("ce_stats", _ce_stats, STATS_SETTING, SUM=False),
        _case("ce_stats_sum", _ce_stats, STATS_SETTING, SUM=True),
        _case("ce_stats_1024x1x8", _ce_stats, RowSetting(1024, 1, 8), SUM=False),
        _case("ce_grad", _ce_grad, GRAD_SETTING),
        _case("ce_grad_1024x3x4", _ce_grad, RowSetting(1024, 3, 4)),
    ]
    COMPILE_CASES = [
        (
            f"ce_scale_{t}",
            _scale_inplace,
            {"X": f"*{t}", "S": "*fp32", "n": "i64", "BLOCK": "constexpr"},
            {"BLOCK": 4096},
        )
        for t in ("bf16", "fp32")
    ] + [
        (f"{name}_{t}", kernel, _sig(t, kernel), {**consts, "ROWS": 1}, opts)
        for name, kernel, consts, opts in _ROW_CASES
        for t in ("bf16", "fp32")
    ]
else:  # pragma: no cover
    COMPILE_CASES = []


CHUNK_LOGITS_BYTES = 256 << 20


def _chunk_size(tokens: int, vocab: int, element_size: int = 2) -> int:
    """Rows per chunk: as many as fill CHUNK_LOGITS_BYTES of logits, whatever the token count, so the extra memory
    stays O(chunk x vocab). Not Liger's rule (as many logits as the hidden states hold elements): every chunk
    re-reads and re-writes the whole weight gradient, and at Llama-3's vocabulary that rule cuts 4096 tokens
    into 32 chunks of 128 rows."""
    rows = 1 << max(0, (CHUNK_LOGITS_BYTES // max(1, vocab * element_size)).bit_length() - 1)
    return max(1, min(tokens, rows))


def _launch(logits: torch.Tensor, setting: RowSetting) -> tuple[tuple[int], dict]:
    """A row kernel's grid and launch arguments: one row per program on a GPU (more under the interpreter, whose
    cost is per operation)."""
    block = min(setting.block, next_pow2(logits.shape[1]))
    rows = rows_per_program(block, logits.shape[0])
    grid = (triton.cdiv(logits.shape[0], rows),)
    return grid, {"BLOCK": block, "ROWS": rows, "STAGES": setting.stages, "num_warps": setting.warps}


def _row_stats(logits, labels, stats, group, vocab_start, vocab_size, smoothing: float) -> None:
    """Into stats [rows, 4]: max, sum of exponentials, target logit and sum of logits (with label smoothing; else
    0) per row, combined over the vocabulary shards of `group` (the max taken first, the sums rescaled to it)."""
    rows = logits.shape[0]
    grid, kw = _launch(logits, STATS_SETTING)
    _ce_stats[grid](
        logits, labels, stats, rows, logits.stride(0), logits.shape[1], vocab_start, vocab_size, **kw,
        SUM=smoothing != 0.0,
    )  # fmt: skip
    launched("cross_entropy_stats")
    if group is not None and dist.get_world_size(group) > 1:
        m = stats[:, 0].clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        stats[:, 1] *= torch.exp(stats[:, 0] - m)
        stats[:, 0] = m
        sums = stats[:, 1:].contiguous()
        dist.all_reduce(sums, group=group)
        stats[:, 1:] = sums


def _logits_grad(logits, labels, stats, scale, vocab_start, vocab_size, z_coeff, smoothing) -> None:
    """In place: a chunk's logits into their gradient, each row times its `scale`, from the rows' statistics."""
    grid, kw = _launch(logits, GRAD_SETTING)
    _ce_grad[grid](
        logits, labels, stats, scale, logits.shape[0], logits.stride(0), logits.shape[1], vocab_start, vocab_size,
        z_coeff, smoothing, **kw,
    )  # fmt: skip
    launched("cross_entropy_grad")


def _pass(
    hidden,
    weight,
    labels,
    ignore_index,
    group,
    vocab_start,
    vocab_size,
    z_coeff,
    smoothing,
    row_scale,
    want_dh,
    want_dw,
    chunk,
):
    """One sweep over the chunks: per-token losses, and the gradients asked for (for `row_scale`). Per chunk the
    host launches the logits' GEMM, two kernels and the two gradient GEMMs; the losses come from the gathered
    statistics after the loop (fewer launches: at Llama-3's vocabulary the H200 waited on the host)."""
    tokens = hidden.shape[0]
    want_grads = want_dh or want_dw
    stats = torch.empty(tokens, 4, dtype=torch.float32, device=hidden.device)
    ignored = labels == ignore_index
    dh = torch.empty_like(hidden) if want_dh else None
    # The weight gradient accumulates in the weight's dtype, one GEMM epilogue per chunk (as Liger does): an fp32
    # copy would double its memory, and an fp32 GEMM per chunk would run at a fraction of the bf16 rate. The first
    # chunk writes it (no zero fill, no read of zeros: each is a pass over a vocab x hidden tensor).
    dw = (torch.empty_like(weight) if tokens else torch.zeros_like(weight)) if want_dw else None
    scale = row_scale.float().masked_fill(ignored, 0.0).contiguous() if want_grads else None
    for start in range(0, tokens, chunk):
        end = min(start + chunk, tokens)
        h, lab = hidden[start:end], labels[start:end]
        logits = h @ weight.t()  # [chunk, V_local], the only vocabulary-sized buffer
        _row_stats(logits, lab, stats[start:end], group, vocab_start, vocab_size, smoothing)
        if want_grads:
            _logits_grad(logits, lab, stats[start:end], scale[start:end], vocab_start, vocab_size, z_coeff, smoothing)
            if want_dh:
                torch.mm(logits, weight, out=dh[start:end])
            if want_dw:
                if start == 0:
                    torch.mm(logits.t(), h, out=dw)
                else:
                    dw.addmm_(logits.t(), h)
        # Dropped before the next chunk's logits exist: otherwise two chunks' logits are alive at once, twice the
        # op's working memory.
        del logits
    m, s, target, total = stats.unbind(1)
    lse = m + torch.log(s)
    loss = lse - target if smoothing == 0.0 else lse - (1.0 - smoothing) * target - smoothing * total / vocab_size
    if z_coeff:
        loss = loss + z_coeff * lse * lse
    return loss.masked_fill(ignored, 0.0), dh, dw


def _scale_(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """t *= grad (a 0-dim tensor), in place. One Triton pass: PyTorch's mul_ by a 0-dim CUDA tensor reads the
    broadcast operand element by element and, on an H200, took 1.3 ms for a Llama-3 weight gradient (2 GB moved)."""
    if not triton_usable(t) or not t.is_contiguous():
        return t.mul_(grad.to(t.dtype))
    block = 4096
    _scale_inplace[(triton.cdiv(t.numel(), block),)](t, grad.float().reshape(1), t.numel(), BLOCK=block)
    return t


def _reduce(losses, labels, ignore_index, reduction):
    if reduction == "none":
        return losses
    return losses.sum() / (labels != ignore_index).sum().clamp(min=1) if reduction == "mean" else losses.sum()


def _host_check(t: torch.Tensor) -> bool:
    """Whether the per-token backward may read on the host if every counted token got one gradient: on a CPU it
    costs nothing; on a GPU (an H200 run, 2026-12-04) the read waited for the whole forward every step, so the
    backward's launches started from an idle GPU."""
    return not t.is_cuda


def _common_gradient(grad, labels, ignore_index, group) -> tuple[torch.Tensor, bool]:
    """The one gradient every counted token received (0 when none is counted), and whether they all did receive
    the same one (agreed over `group`, so no vocabulary shard recomputes alone and waits in a collective). On a
    GPU no host read: the caller's promise (grads_in_forward) is taken, and checked by a device assert, which
    stops the process at a later launch if it was broken rather than train on a wrongly scaled gradient."""
    counted = labels != ignore_index
    if grad.numel() == 0:
        return grad.new_zeros(()), True
    hi = torch.where(counted, grad, float("-inf")).amax()
    lo = torch.where(counted, grad, float("inf")).amin()
    anyone = counted.any()
    same = (hi == lo) | ~anyone
    if not _host_check(grad):
        torch._assert_async(same)
        return torch.where(anyone, hi, 0.0), True
    same = same.to(torch.int32)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(same, op=dist.ReduceOp.MIN, group=group)
    return torch.where(anyone, hi, 0.0), bool(same)


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, labels, ignore_index, reduction, group, vocab_start, vocab_size, z_coeff, smoothing, chunk,
        grads_in_forward,
    ):  # fmt: skip
        hidden, labels = hidden.contiguous(), labels.contiguous()
        n_valid = (labels != ignore_index).sum().clamp(min=1)
        # mean / sum (and "none" with grads_in_forward): the gradients are known up to the incoming scalar, so they
        # are made in this pass, and only those that will be asked for (no weight gradient for a frozen output
        # layer, as under LoRA).
        want_dh, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        eager = (reduction in ("mean", "sum") or grads_in_forward) and (want_dh or want_dw)
        # On the device, no host sync: a float(n_valid) here stalled the launch queue every step.
        ones = torch.ones(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        row_scale = ones / n_valid if reduction == "mean" else ones
        args = (ignore_index, group, vocab_start, vocab_size, z_coeff, smoothing)
        losses, dh, dw = _pass(hidden, weight, labels, *args, row_scale, eager and want_dh, eager and want_dw, chunk)
        ctx.args, ctx.chunk, ctx.reduction, ctx.eager = args, chunk, reduction, eager
        if reduction in ("mean", "sum"):
            ctx.save_for_backward(dh, dw)
        elif eager:  # the inputs too, for a backward that breaks the promise
            ctx.save_for_backward(hidden, weight, labels, dh, dw)
        else:
            ctx.save_for_backward(hidden, weight, labels)
        return _reduce(losses, labels, ignore_index, reduction)

    @staticmethod
    def backward(ctx, grad):
        none = [None] * 10
        # The gradients made in the forward are scaled in place (a second vocab x hidden weight gradient would
        # double the op's peak memory), so only one backward may use them.
        if getattr(ctx, "scaled", False):
            raise RuntimeError(f"fused_linear_cross_entropy ({ctx.reduction}) supports one backward per forward")
        if ctx.reduction in ("mean", "sum"):
            ctx.scaled = True
            dh, dw = ctx.saved_tensors
            dh = None if dh is None else _scale_(dh, grad)
            return dh, None if dw is None else _scale_(dw, grad), *none
        grad = grad.float().contiguous()
        if ctx.eager:
            hidden, weight, labels, dh, dw = ctx.saved_tensors
            # A row's hidden gradient scales by its own token's gradient, whatever the others got; the weight
            # gradient sums over tokens, so it takes one scale only if every counted token got the same.
            common, same = _common_gradient(grad, labels, *ctx.args[:2]) if dw is not None else (None, True)
            if same:
                ctx.scaled = True
                dh = None if dh is None else dh.mul_(grad.masked_fill(labels == ctx.args[0], 0.0)[:, None])
                return dh, None if dw is None else _scale_(dw, common), *none
            # (Python's default filter shows it once)
            warnings.warn(
                "fused_linear_cross_entropy(grads_in_forward=True): the counted tokens received different "
                "gradients, so the logits are recomputed (give tokens that should not count ignore_index "
                "instead of a zero weight)",
                stacklevel=2,
            )
        else:
            hidden, weight, labels = ctx.saved_tensors
        want_dh, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        _, dh, dw = _pass(hidden, weight, labels, *ctx.args, grad, want_dh, want_dw, ctx.chunk)
        return dh, dw, *none


def fused_linear_cross_entropy_reference(
    hidden,
    weight,
    labels,
    ignore_index=-100,
    reduction="mean",
    tp_group=None,
    z_loss_coeff=0.0,
    label_smoothing=0.0,
    vocab_start=0,
    vocab_size=None,
):
    """Full logits, single shard (no TP): the oracle."""
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    logits = (hidden @ weight.t()).float()[:, : vocab_size - vocab_start]
    lse = torch.logsumexp(logits, dim=-1)
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    loss = (loss + z_loss_coeff * lse * lse).masked_fill(labels == ignore_index, 0.0)
    if reduction == "none":
        return loss
    return loss.sum() / (labels != ignore_index).sum().clamp(min=1) if reduction == "mean" else loss.sum()


@on_tensor_device
def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    tp_group=None,
    z_loss_coeff: float = 0.0,
    label_smoothing: float = 0.0,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    grads_in_forward: bool = False,
) -> torch.Tensor:
    """hidden [tokens, H], weight [V_local, H] (a vocabulary shard under TP), labels [tokens] (global ids).

    vocab_start: this shard's first vocabulary id (default: TP rank x V_local); vocab_size: the real
    vocabulary (default: V_local x TP), columns beyond it are padding. grads_in_forward (reduction "none"):
    the caller will give every counted token the same gradient (it sums the losses, with any scale), so the
    gradients are made in the forward pass; the backward checks it (see the module's docstring)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction {reduction!r} is not mean|sum|none")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"fused_linear_cross_entropy: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and labels "
            f"{tuple(labels.shape)} must be [tokens, hidden], [vocab, hidden] and [tokens] (flatten batch and sequence)"
        )
    if hidden.dtype != weight.dtype:  # (it was torch's own "expected m1 and m2 to have the same dtype", deep inside)
        msg = f"fused_linear_cross_entropy: hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype"
        raise ValueError(msg)
    if chunk_size is not None and chunk_size < 1:  # (no chunk ran: -inf from an unwritten buffer, no gradient)
        raise ValueError(f"fused_linear_cross_entropy: chunk_size {chunk_size} must be >= 1 (or None: sized here)")
    if not 0.0 <= label_smoothing <= 1.0:  # (F.cross_entropy's range)
        raise ValueError(f"fused_linear_cross_entropy: label_smoothing {label_smoothing} must be in [0, 1]")
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    v_local = weight.shape[0]
    # (a label past the rows had no column: its loss the log-sum-exp alone. Checked where every rank finds the
    # same, so none is left in the all-reduces: one shard, or equal shards; trimmed ones are the caller's)
    if vocab_size is not None and vocab_size > (vocab_start or 0) + v_local * (tp if vocab_start is None else 1):
        if tp == 1 or vocab_start is None:
            raise ValueError(
                f"fused_linear_cross_entropy: vocab_size {vocab_size} is past the weight's {v_local} rows"
                + (f" x {tp} TP ranks" if tp > 1 else f" from vocab_start {vocab_start or 0}")
                + " (the columns beyond vocab_size are padding; none may be missing)"
            )
    vocab_start = rank * v_local if vocab_start is None else vocab_start
    vocab_size = v_local * tp if vocab_size is None else vocab_size
    if not triton_usable(hidden):
        if tp > 1:
            raise RuntimeError("fused_linear_cross_entropy over a TP group needs the Triton path")
        return fused_linear_cross_entropy_reference(
            hidden,
            weight,
            labels,
            ignore_index,
            reduction,
            None,
            z_loss_coeff,
            label_smoothing,
            vocab_start,
            vocab_size,
        )
    no_interpreted_bf16_dot("fused_linear_cross_entropy", hidden, weight)
    # (a label outside the vocabulary matched no column: its loss was the log-sum-exp alone, counted in the mean)
    require(
        (labels == ignore_index) | ((labels >= 0) & (labels < vocab_size)),
        lambda: (
            f"fused_linear_cross_entropy: labels must be in [0, {vocab_size}) or ignore_index {ignore_index}; got "
            f"{labels[(labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))][:4].tolist()}"
        ),
    )
    # Every rank of the TP group must run as many chunks (each one's statistics are all-reduced): sized by the
    # group's widest shard, not this rank's rows, which the caller may have trimmed of vocabulary padding.
    widest = v_local if tp == 1 else -(-vocab_size // tp)
    chunk = chunk_size or _chunk_size(hidden.shape[0], widest, hidden.element_size())
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):  # evaluation: losses only
        args = (ignore_index, tp_group, vocab_start, vocab_size, float(z_loss_coeff), float(label_smoothing))
        hidden, labels = hidden.contiguous(), labels.contiguous()
        losses, _, _ = _pass(hidden, weight, labels, *args, None, False, False, chunk)
        return _reduce(losses, labels, ignore_index, reduction)
    return _FusedLinearCE.apply(
        hidden,
        weight,
        labels,
        ignore_index,
        reduction,
        tp_group,
        vocab_start,
        vocab_size,
        float(z_loss_coeff),
        float(label_smoothing),
        chunk,
        grads_in_forward,
    )
