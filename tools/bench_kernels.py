#!/usr/bin/env python
"""Kernel benchmarks: megatron_lite's Triton kernels beside PyTorch eager, torch.compile and (when installed)
Liger-Kernel, on the same inputs, in one run: forward and forward+backward time, peak memory, and achieved
GB/s (memory-bound ops, against the copy bandwidth measured in the same run) or TFLOP/s (attention: forward
4*b*h*s^2*d, halved when causal; backward 2.5x the forward; against the device's datasheet peak).

    python tools/bench_kernels.py --size tiny                                   # any machine (CPU: interpreter)
    python tools/bench_kernels.py --size llama8b --out-dir docs/bench           # one GPU, bf16, Llama-3-8B shapes

Memory-bound kernels are set against two copies timed in the same run: a 2 GiB device-to-device copy (the
bandwidth ceiling) and a copy of as many bytes as the kernel moves (the same size, launch and tail effects).
The norms' backward settings are chosen with tools/bench_norm_tiles.py. Attention's reference is PyTorch's SDPA
with the flash backend forced; the backward time is fwd+bwd minus fwd.
`flash_attention_mla` has multi-latent attention's head sizes (query/key 1.5 x head_dim, values head_dim: 192
and 128 as in DeepSeek-V3); its TFLOP/s count q.k^T at 192 and p.v at 128, for the padded runs too.
`flash_attention_documents` packs eight documents into each sequence (--reset-attention-mask) against SDPA with
the boolean document mask; its TFLOP/s count only the documents' own causal squares, the work that is needed.
The fused cross-entropy's memory is also given without the gradients it must return (the weight gradient
alone is vocab x hidden). Every case first checks our output against the reference (relative error).
Writes <out-dir>/kernels.json and <out-dir>/kernels.md (bench_out/ by default) after every case, and the targets
of issue 6 last.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch
import torch.nn.functional as F
from _kernel_report import TARGETS, verdicts, write_report
from _kernel_timing import (
    BEFORE_GRADS,
    copy_ms,
    fwd_bwd,
    mark_before_grads,
    peak_bytes,
    profile_calls,
    rel_err,
    time_in_turn,
    time_ms,
)
from _world import check_device, check_outputs, check_sizes, usage_error  # tools/_world.py, beside this script

from megatron_lite.flag_parser import OneLineErrorParser

SIZES = {
    "tiny": dict(tokens=64, hidden=64, ffn=96, vocab=512, batch=1, seq=32, heads=4, kv_heads=2, head_dim=16),
    "llama8b": dict(
        tokens=4096, hidden=4096, ffn=14336, vocab=128256, batch=1, seq=4096, heads=32, kv_heads=8, head_dim=128
    ),
}


CHUNKS: list[int] = []  # the fused cross-entropy's chunk variants (--chunks; empty: tokens/16, tokens/4, tokens)


def _flce_chunked(hh, ww, labels, chunk):
    from megatron_lite import kernels as K

    return K.fused_linear_cross_entropy(hh, ww, labels, chunk_size=chunk)


def _flce_per_token(hh, ww, labels, grads_in_forward):
    """Per-token losses reduced outside. grads_in_forward (as the model calls it): the gradients are made in the
    forward; without it the backward recomputes each chunk's logits."""
    from megatron_lite import kernels as K

    return K.fused_linear_cross_entropy(hh, ww, labels, reduction="none", grads_in_forward=grads_in_forward).mean()


def cases(s: dict, dtype, device):
    from megatron_lite import kernels as K

    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    t, h, f, v = s["tokens"], s["hidden"], s["ffn"], s["vocab"]
    b, sq, nh, nkv, d = s["batch"], s["seq"], s["heads"], s["kv_heads"], s["head_dim"]
    x, w, bias = rand(t, h), rand(h) + 1, rand(h)
    gate, up = rand(t, f), rand(t, f)
    q, k, vv = rand(b, sq, nh, d), rand(b, sq, nkv, d), rand(b, sq, nkv, d)
    ang = torch.randn(sq, d // 2, generator=g).to(device).repeat(1, 2)
    cos, sin = ang.cos(), ang.sin()
    hid, wout = rand(t, h), rand(v, h, scale=0.02)
    labels = torch.randint(0, v, (t,), generator=g).to(device)
    el = x.element_size()

    def eager_rms(a, ww):
        return K.rms_norm_reference(a, ww, 1e-5)

    def unfused_ce(hh, ww):
        return F.cross_entropy((hh @ ww.t()).float(), labels)

    def unfused_ce_marked(hh, ww):
        # The unfused loss peaks in its log-softmax backward (three fp32 logit buffers), before its matmul's
        # backward makes the gradients it returns: counted as its peak - the gradients, as ours is (made in the
        # forward, they live at its peak), its own memory was understated by them, a fifth of it (a review of
        # the accounting). The logits' gradient comes first: the peak up to then is noted there.
        logits = hh @ ww.t()
        if logits.requires_grad:
            logits.register_hook(mark_before_grads)
        return F.cross_entropy(logits.float(), labels)

    expand_kv: list[bool] = []

    def sdpa(a, c, e):
        # PyTorch's flash backend on a GPU (the target's reference); plain SDPA elsewhere.
        args = (a.transpose(1, 2), c.transpose(1, 2), e.transpose(1, 2))
        if device.type != "cuda":
            return F.scaled_dot_product_attention(*args, is_causal=True, enable_gqa=nh != nkv).transpose(1, 2)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            if not expand_kv:
                try:
                    return F.scaled_dot_product_attention(*args, is_causal=True, enable_gqa=nh != nkv).transpose(1, 2)
                except RuntimeError as e:  # a flash backend without grouped-query support: repeat K and V heads
                    print(f"SDPA flash backend refused enable_gqa ({str(e)[:120]}); repeating K and V heads instead")
                    expand_kv.append(True)
            rep = nh // nkv
            ex = (args[0], args[1].repeat_interleave(rep, dim=1), args[2].repeat_interleave(rep, dim=1))
            return F.scaled_dot_product_attention(*ex, is_causal=True).transpose(1, 2)

    flops_attn = 4 * b * nh * sq * sq * d / 2  # causal
    # --reset-attention-mask: eight documents per sequence; the useful work is each document's own causal square
    n_docs = 8 if sq >= 64 else 2
    docs = (torch.arange(sq) * n_docs // sq).to(device).expand(b, sq)
    flops_docs = sum(4 * b * nh * int(n) ** 2 * d / 2 for n in torch.bincount(docs[0].cpu()))
    doc_mask = (docs[:, :, None] == docs[:, None, :]).tril().unsqueeze(1)

    def sdpa_documents(a, c, e):
        # SDPA with the boolean mask (its memory-efficient backend on a GPU; flash takes no mask)
        rep = nh // nkv
        kv = (t.repeat_interleave(rep, 2).transpose(1, 2) for t in (c, e))
        return F.scaled_dot_product_attention(a.transpose(1, 2), *kv, attn_mask=doc_mask).transpose(1, 2)

    # Multi-latent attention's heads (DeepSeek-V3: query/key 192, values 128; every head its own keys): ours takes
    # the values as they are; SDPA's fused backends need one head size, so it (and our padded variant, what MLA
    # ran before the kernel took values of their own size) pads them to 192 and cuts the output.
    qd, dv = d + d // 2, d
    qm, km, vm = rand(b, sq, nh, qd), rand(b, sq, nh, qd), rand(b, sq, nh, dv)
    flops_mla = 2 * b * nh * sq * sq * (qd + dv) / 2  # q.k^T over qd and p.v over dv, causal

    def padded(attend):
        return lambda a, c, e: attend(a, c, F.pad(e, (0, qd - dv)))[..., :dv]

    def sdpa_mla(a, c, e):
        args = (a.transpose(1, 2), c.transpose(1, 2), e.transpose(1, 2))
        if device.type != "cuda":
            return F.scaled_dot_product_attention(*args, is_causal=True).transpose(1, 2)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(*args, is_causal=True).transpose(1, 2)

    # fused CE variants: chunk size trades memory for time
    chunk_rows = sorted(set(CHUNKS) or {max(1, t // 16), max(1, t // 4), t})
    out = [
        dict(
            name="rms_norm",
            inputs=[x, w],
            ours=lambda a, ww: K.rms_norm(a, ww, 1e-5),
            eager=eager_rms,
            bytes_fwd=2 * x.numel() * el,
            bytes_bwd=3 * x.numel() * el,
            liger="rms_norm",
            # (the eager row is the reference's composite of ops; PyTorch's own op, fused on CUDA, beside it)
            variants={"torch F.rms_norm": lambda a, ww: F.rms_norm(a, (a.shape[-1],), ww, 1e-5)}
            if hasattr(F, "rms_norm")
            else {},
        ),
        dict(  # the model's pre-MLP call: x + residual and its norm; the backward takes both outputs' gradients
            name="rms_norm_residual",
            inputs=[x, w, hid],
            ours=lambda a, ww, r: K.rms_norm(a, ww, 1e-5, residual=r),
            eager=lambda a, ww, r: K.rms_norm_reference(a, ww, 1e-5, residual=r),
            bytes_fwd=4 * x.numel() * el,
            bytes_bwd=4 * x.numel() * el,
            liger=None,
        ),
        dict(
            name="layer_norm",
            inputs=[x, w, bias],
            ours=lambda a, ww, bb: K.layer_norm(a, ww, bb, 1e-5),
            eager=lambda a, ww, bb: F.layer_norm(a, (h,), ww, bb, 1e-5),
            bytes_fwd=2 * x.numel() * el,
            bytes_bwd=3 * x.numel() * el,
            compile=False,
            liger=None,
        ),
        dict(
            name="swiglu",
            inputs=[gate, up],
            ours=K.swiglu,
            eager=lambda a, c: F.silu(a) * c,
            bytes_fwd=3 * gate.numel() * el,
            bytes_bwd=5 * gate.numel() * el,
            liger="swiglu",
        ),
        dict(  # the MLP's call: fc1's output [gate; up] read in place, its gradient written as one tensor
            name="swiglu_stacked",
            inputs=[torch.cat([gate, up], dim=-1)],
            ours=K.swiglu_stacked,
            eager=K.swiglu_stacked_reference,
            bytes_fwd=3 * gate.numel() * el,
            bytes_bwd=5 * gate.numel() * el,
            liger=None,
        ),
        dict(  # gpt-oss's activation (offset 1, clamp 7), stacked as SwiGLU's; scaled so that the clamps bite
            name="quick_geglu",
            inputs=[torch.cat([gate, up], dim=-1) * 4],
            ours=lambda a: K.quick_geglu(a, 1.0, 7.0),
            eager=lambda a: K.quick_geglu_reference(a, 1.0, 7.0),
            bytes_fwd=3 * gate.numel() * el,
            bytes_bwd=5 * gate.numel() * el,
            liger=None,
        ),
        dict(
            name="rope",
            inputs=[q],
            ours=lambda a: K.apply_rope(a, cos, sin),
            eager=lambda a: K.apply_rope_reference(a, cos, sin),
            # x read and y written, and cos and sin read (fp32, once per position) in each pass
            bytes_fwd=2 * q.numel() * el + 2 * cos.numel() * cos.element_size(),
            bytes_bwd=2 * q.numel() * el + 2 * cos.numel() * cos.element_size(),
            compile=False,
            liger=None,
        ),
        dict(
            name="flash_attention",
            inputs=[q, k, vv],
            ours=lambda a, c, e: K.flash_attention(a, c, e, causal=True),
            eager=sdpa,
            eager_name="sdpa_flash" if device.type == "cuda" else "sdpa",
            compile=False,
            flops_fwd=flops_attn,
            flops_bwd=2.5 * flops_attn,
            liger=None,
        ),
        dict(
            name="flash_attention_documents",
            inputs=[q, k, vv],
            ours=lambda a, c, e: K.flash_attention(a, c, e, causal=True, document_ids=docs),
            eager=sdpa_documents,
            eager_name="sdpa_masked",
            compile=False,
            flops_fwd=flops_docs,
            flops_bwd=2.5 * flops_docs,
            liger=None,
        ),
        dict(
            name="flash_attention_mla",
            inputs=[qm, km, vm],
            ours=lambda a, c, e: K.flash_attention(a, c, e, causal=True),
            eager=padded(sdpa_mla),
            eager_name="sdpa_flash_padded" if device.type == "cuda" else "sdpa_padded",
            last=True,
            variants={"megatron_lite padded": padded(lambda a, c, e: K.flash_attention(a, c, e, causal=True))},
            compile=False,
            flops_fwd=flops_mla,
            flops_bwd=2.5 * flops_mla,
            liger=None,
        ),
        dict(
            name="fused_linear_cross_entropy",
            inputs=[hid, wout],
            ours=lambda hh, ww: K.fused_linear_cross_entropy(hh, ww, labels),
            eager=unfused_ce_marked,
            compile_fn=unfused_ce,  # (the same loss without the hook, for torch.compile)
            variants={
                "megatron_lite per-token": functools.partial(_flce_per_token, labels=labels, grads_in_forward=True),
                "megatron_lite per-token, recomputed": functools.partial(
                    _flce_per_token, labels=labels, grads_in_forward=False
                ),
                **{
                    f"megatron_lite chunk={c}": functools.partial(_flce_chunked, labels=labels, chunk=c)
                    for c in chunk_rows
                },
            },
            flops_fwd=2 * t * h * v,
            flops_bwd=4 * t * h * v,
            # also as graph replays (the GPU's work alone, as inside a training step whose queue is full) beside
            # the launched timing, where do_bench starts each call on an idle GPU. Both are printed.
            graph=True,
            liger="fused_linear_cross_entropy",
            labels=labels,
        ),
    ]
    first = ("flash_attention", "fused_linear_cross_entropy")  # the targets that need most time go first
    return sorted(out, key=lambda c: (c["name"] not in first, first.index(c["name"]) if c["name"] in first else 0))


def _liger(kind, labels=None):
    try:
        import liger_kernel.transformers.functional as LF  # optional
    except ImportError:
        return None
    if kind == "rms_norm":
        return lambda a, ww: LF.liger_rms_norm(a, ww, 1e-5)
    if kind == "swiglu":
        return LF.liger_swiglu
    if kind == "fused_linear_cross_entropy" and hasattr(LF, "liger_fused_linear_cross_entropy"):
        return lambda hh, ww: LF.liger_fused_linear_cross_entropy(hh, ww, labels)
    return None


def _liger_version() -> str:
    try:
        from importlib.metadata import version

        import liger_kernel  # noqa: F401
    except ImportError:
        return "Liger-Kernel not installed (pip install liger-kernel to time it beside ours)"
    return f"liger-kernel {version('liger-kernel')}"


def copy_bandwidth(device, dtype, moved_bytes: int = 2 << 30) -> float | None:
    """GB/s of a device-to-device copy that moves `moved_bytes` (read + write; 2 GiB by default, the ceiling
    for memory-bound kernels); see copy_ms."""
    ms = copy_ms(moved_bytes, device, dtype)
    return None if ms is None else moved_bytes / ms / 1e6


def _measure(case: dict, impl: str, fn, device, dtype, reps: int, bw, peak, profile: bool = False) -> list[dict]:
    """Forward and forward+backward rows of one implementation of one case."""
    ins = case["inputs"]
    if impl == "liger":  # (its backwards write into their inputs and incoming gradient: copies of its own)
        ins = [t.clone() for t in ins]
        case = {**case, "inputs": ins, **({"grad_out": case["grad_out"].clone()} if "grad_out" in case else {})}
    with torch.no_grad():
        if "reference_out" not in case:  # once per case, for every implementation and both phases
            reference = case["eager"](*ins)
            case["reference_out"] = reference[0] if isinstance(reference, tuple) else reference
        out = fn(*ins)
        out = out[0] if isinstance(out, tuple) else out
        err = rel_err(out, case["reference_out"])
        if "grad_out" not in case:  # the same incoming gradient for every implementation
            gen = torch.Generator(device="cpu").manual_seed(1)
            grad = torch.randn(out.shape, generator=gen) if out.dim() else torch.ones(())
            case["grad_out"] = grad.to(device=out.device, dtype=out.dtype)
        del out
    grad_bytes = sum(t.numel() * t.element_size() for t in ins if t.is_floating_point())
    memory_bound = "bytes_fwd" in case
    rows = []
    for kind in ("fwd", "fwd+bwd"):
        run = (lambda fn=fn, ins=ins: fn(*ins)) if kind == "fwd" else fwd_bwd(fn, ins, case["grad_out"])
        with torch.no_grad() if kind == "fwd" else torch.enable_grad():
            launch_ms = time_ms(run, device, reps)
            ms, timing = launch_ms, "launches"
            if (memory_bound or case.get("graph")) and device.type == "cuda":  # GPU time alone (graphed); both kept
                try:
                    ms, timing = time_ms(run, device, reps, graph=True), "cuda graph"
                except Exception as e:  # noqa: BLE001 - an implementation that cannot be captured keeps launch timing
                    timing = f"launches (capture failed: {type(e).__name__})"
            mem = peak_bytes(run, device)
        row = {"kernel": case["name"], "impl": impl, "pass": kind, "ms": ms, "peak_memory_bytes": mem, "rel_err": err}
        row.update(timing=timing, ms_launches=launch_ms)
        if kind == "fwd+bwd" and mem is not None:  # beyond the gradients the op must return
            row["working_bytes"] = mem - grad_bytes
            if "peak" in BEFORE_GRADS:  # (the unfused loss's: no gradient exists before that peak)
                row["working_bytes"] = max(BEFORE_GRADS["peak"], mem - grad_bytes)
            row["grad_bytes"] = grad_bytes
        if "bytes_fwd" in case:
            moved = case["bytes_fwd"] + (case["bytes_bwd"] if kind == "fwd+bwd" else 0)
            row["GB/s"] = moved / ms / 1e6
            row["fraction_of_copy_bw"] = row["GB/s"] / bw if bw else None
            same = case.setdefault("same_size_copy", {})  # once per case and pass: every implementation moves as much
            if kind not in same:
                same[kind] = copy_bandwidth(device, dtype, moved)
            row["fraction_of_same_size_copy"] = row["GB/s"] / same[kind] if same[kind] else None
        else:
            work = case["flops_fwd"] + (case["flops_bwd"] if kind == "fwd+bwd" else 0)
            row["TFLOP/s"] = work / ms / 1e9
            row["fraction_of_peak"] = row["TFLOP/s"] * 1e12 / peak if peak else None
        rows.append(row)
        print(json.dumps(row), flush=True)
        if profile and kind == "fwd+bwd":
            profile_calls(case, impl, run, device)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SIZES), default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile (default on CUDA)")
    ap.add_argument(
        "--compile-kernels",
        default=None,
        help="comma-separated kernels to time under torch.compile (default: those whose eager form is several "
        "ops: rms_norm, rms_norm_residual, swiglu, swiglu_stacked, quick_geglu, fused_linear_cross_entropy); 'all' "
        "for every one",
    )
    ap.add_argument("--kernels", default=None, help="comma-separated subset of kernels to run (default: all)")
    ap.add_argument(
        "--no-variants", action="store_true", help="ours and the references only, not the chunk and per-token variants"
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunks", default=None, help="comma-separated chunk sizes (rows) of the fused CE variants")
    ap.add_argument(
        "--profile",
        default=None,
        help="comma-separated kernels whose forward+backward is also run once under torch.profiler, per "
        "implementation: the time of each GPU kernel inside it, printed (where the time goes, not only how much)",
    )
    ap.add_argument(
        "--out-dir", default="bench_out", help="where kernels.json and kernels.md go (git ignores bench_out/)"
    )
    args = ap.parse_args(argv)
    check_outputs(args)
    check_device(args.device)
    check_sizes(reps=args.reps)  # (--reps 0 wrote every row as a StatisticsError, and exited 0)
    if args.chunks:
        try:
            check_sizes(chunks=[int(c) for c in args.chunks.split(",")])
        except ValueError:
            usage_error(f"--chunks {args.chunks}: comma-separated whole numbers of rows, e.g. --chunks 1024,4096")
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    use_compile = args.compile or device.type == "cuda"
    # None: the cases' own choice; "all": every case
    compile_only = (
        args.compile_kernels if args.compile_kernels in (None, "all") else set(args.compile_kernels.split(","))
    )
    from megatron_lite.training.flops import peak_flops

    peak = peak_flops(device, dtype != torch.float32)
    bw = copy_bandwidth(device, dtype)
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "dtype": str(dtype).removeprefix("torch."),
        "size": args.size,
        "shapes": SIZES[args.size],
        "copy_bandwidth_GBps": bw,
        "peak_flops": peak,
        "torch": f"torch {torch.__version__}",
        "liger": _liger_version(),
    }
    try:
        import triton

        meta["torch"] += f", triton {triton.__version__}"
    except ImportError:
        pass
    CHUNKS[:] = [int(c) for c in args.chunks.split(",")] if args.chunks else []
    rows: list[dict] = []
    wanted = None if args.kernels is None else set(args.kernels.split(","))
    every = cases(SIZES[args.size], dtype, device)
    names = [c["name"] for c in every]
    named = (("--kernels", args.kernels, ()), ("--compile-kernels", args.compile_kernels, ("all",)))
    for flag, given, also in (*named, ("--profile", args.profile, ())):
        unknown = sorted(set((given or "").split(",")) - {*names, *also, ""})
        if unknown:  # (a misspelt name ran nothing, or dropped that kernel, without a word)
            usage_error(f"{flag}: no kernel named {', '.join(unknown)}; the kernels: {', '.join(names)}")
    selected = [c for c in every if wanted is None or c["name"] in wanted]
    # Two phases: first every kernel beside its eager reference, then torch.compile (cold compiles take the most
    # time; the fused cross-entropy's, which a target needs, goes first), so a run cut short loses the least.
    # Cases with no target (last=True) go after both phases.
    for phase in ("direct", "compiled", "last"):
        for case in selected:
            if compile_only is None:
                compiled = case.get("compile", True)
            else:
                compiled = compile_only == "all" or case["name"] in compile_only
            if phase != "compiled" and (phase == "last") == bool(case.get("last")):
                impls = {"megatron_lite": case["ours"], case.get("eager_name", "eager"): case["eager"]}
                impls.update({} if args.no_variants else case.get("variants", {}))
                if case.get("liger") and _liger(case["liger"], case.get("labels")):
                    impls["liger"] = _liger(case["liger"], case.get("labels"))
            elif phase == "compiled" and use_compile and compiled and not case.get("last"):
                impls = {"torch.compile": torch.compile(case.get("compile_fn", case["eager"]))}
                case["compiled"] = impls["torch.compile"]
            else:
                continue
            for impl, fn in impls.items():
                try:
                    prof = case["name"] in set((args.profile or "").split(","))
                    rows += _measure(case, impl, fn, device, dtype, args.reps, bw, peak, prof)
                except Exception as e:  # one implementation failing (out of memory, a compile error) loses one row
                    rows.append({"kernel": case["name"], "impl": impl, "error": f"{type(e).__name__}: {e}"[:300]})
                    print(json.dumps(rows[-1]), flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            if phase == "compiled" and case.get("graph") and "compiled" in case and device.type == "cuda":
                try:  # ours beside torch.compile in the same power state (see time_in_turn)
                    pair = {"megatron_lite": case["ours"], "torch.compile": case.pop("compiled")}
                    chunked = {} if args.no_variants else case.get("variants", {})
                    pair.update({k: v for k, v in chunked.items() if k.startswith("megatron_lite chunk=")})
                    rows += time_in_turn(case, pair, device, peak)
                except Exception as e:  # noqa: BLE001 - the rows timed apart stand without it
                    rows.append({"kernel": case["name"], "impl": "interleaved", "error": f"{type(e).__name__}: {e}"})
            if case["name"] == "flash_attention" and device.type == "cuda" and phase == "direct":
                import importlib

                fa = importlib.import_module("megatron_lite.kernels.flash_attention")
                meta["flash_attention_tiles"] = {  # the tiles each kernel's autotuner chose
                    k: str(getattr(getattr(fa, k), "best_config", None))
                    for k in ("_fwd_tuned", "_bwd_dkdv_tuned", "_bwd_dq_tuned")
                }
                print(json.dumps(meta["flash_attention_tiles"]), flush=True)
            write_report(args.out_dir, meta, rows)  # after every case: a run cut short still leaves its table
            if device.type == "cuda":
                torch.cuda.empty_cache()
    write_report(args.out_dir, meta, rows)
    print(TARGETS)
    for line in verdicts(rows):
        print(line, flush=True)
    return rows


if __name__ == "__main__":
    main()
