"""flash_attention's input checks: shapes, dtypes, masks and the kernels' 32-bit offsets, each a one-line
ValueError (a shape the kernels would index past reads other memory: plausible wrong numbers, or NaN)."""

from __future__ import annotations

from megatron_lite.kernels._common import no_interpreted_bf16_dot


def _window(window_size: int | None, causal: bool, seq_k: int) -> int:
    """The kernels' WINDOW argument: the window clamped to seq_k (a window of seq_k or more hides no key), seq_k
    when there is none. Raises on a window without causal masking or below 1."""
    if window_size is None:
        return seq_k
    if not causal:
        raise ValueError(f"window_size={window_size} needs causal=True (a sliding window looks back from the query)")
    if window_size < 1:
        raise ValueError(f"window_size must be >= 1 or None, got {window_size}")
    return min(int(window_size), seq_k)


def check(q, k, v, causal, window_size=None, document_ids=None, document_spans=None) -> None:
    """q, k, v and the masks fit together (the public entries' one-line refusals)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or not q.dtype.is_floating_point:
        raise ValueError(
            f"flash_attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} ({q.dtype}) must be "
            "floating point [batch, seq, heads, head_dim]"
        )
    b, sq, h, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or v.shape[:3] != k.shape[:3] or h % k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} / v {tuple(v.shape)} do not fit together")
    if not q.dtype == k.dtype == v.dtype:  # (the kernels' dots take one dtype: an interpreter error, else)
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if causal and sq > k.shape[1]:
        raise ValueError(f"causal attention with bottom-right alignment needs seq_q {sq} <= seq_k {k.shape[1]}")
    if document_spans is not None and (
        tuple(document_spans[0].shape) != (b, sq) or tuple(document_spans[1].shape) != (b, k.shape[1])
    ):
        raise ValueError(
            f"document_spans {tuple(document_spans[0].shape)}, {tuple(document_spans[1].shape)} must be "
            f"[batch, seq_q] = {(b, sq)} and [batch, seq_k] = {(b, k.shape[1])}"
        )
    if document_ids is not None and (not causal or tuple(document_ids.shape) != (b, k.shape[1])):
        raise ValueError(
            f"document_ids {tuple(document_ids.shape)} need causal attention and the shape [batch, seq_k] = "
            f"{(b, k.shape[1])}"
        )
    _window(window_size, causal, k.shape[1])


def check_offsets(q, k, v) -> None:
    """The kernels address a batch entry and head in int64 but the positions inside one sequence in int32."""
    no_interpreted_bf16_dot("flash_attention", q, k, v)
    sq, h = q.shape[1], q.shape[2]
    one = [("q", q.shape[1:].numel()), ("k", k.shape[1:].numel()), ("v", v.shape[1:].numel())]  # (batch 0 too)
    for name, n in [*one, ("the output", sq * h * v.shape[3])]:
        if n >= 2**31:
            raise ValueError(
                f"flash_attention: one sequence of {name} holds {n} values (q {tuple(q.shape)}, k {tuple(k.shape)}, "
                f"v {tuple(v.shape)}), past the kernels' 32-bit offsets inside a sequence (2^31): split it across "
                "ranks with --context-parallel-size, or its heads with more --tensor-model-parallel-size"
            )


def check_backward(q, k, v, o, lse, do, dlse=None) -> None:
    """flash_attention_backward's own inputs against q, k and v: o and do [batch, seq_q, heads, v_head_dim], lse
    (and dlse) [batch, heads, seq_q] (an exploratory run: an lse of other heads, a transposed one or a shorter o
    were read past their ends, giving wrong gradients or NaN)."""
    b, sq, h, _ = q.shape
    want = {"o": (o, (b, sq, h, v.shape[-1])), "do": (do, (b, sq, h, v.shape[-1])), "lse": (lse, (b, h, sq))}
    if dlse is not None:
        want["dlse"] = (dlse, (b, h, sq))
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            dims = "[batch, heads, seq_q]" if "lse" in name else "[batch, seq_q, heads, v_head_dim]"
            raise ValueError(
                f"flash_attention_backward: {name} {tuple(t.shape)} must be {dims} = {list(shape)} for q "
                f"{tuple(q.shape)} and v {tuple(v.shape)}"
            )
