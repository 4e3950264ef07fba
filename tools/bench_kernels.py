#!/usr/bin/env python
"""Kernel benchmarks: megatron_lite's Triton kernels beside PyTorch eager, torch.compile and (when installed)
Liger-Kernel, on the same inputs, in one run: forward and forward+backward time, peak memory, and achieved
GB/s (memory-bound ops, against the copy bandwidth measured in the same run) or TFLOP/s (attention: forward
4*b*h*s^2*d, halved when causal; backward 2.5x the forward; against the device's datasheet peak).

    python tools/bench_kernels.py --size tiny                                   # any machine (CPU: interpreter)
    python tools/bench_kernels.py --size llama8b --out-dir docs/bench           # one GPU, bf16, Llama-3-8B shapes

Writes <out-dir>/kernels.json and <out-dir>/kernels.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

SIZES = {
    "tiny": dict(tokens=64, hidden=64, ffn=96, vocab=512, batch=1, seq=32, heads=4, kv_heads=2, head_dim=16),
    "llama8b": dict(
        tokens=4096, hidden=4096, ffn=14336, vocab=128256, batch=1, seq=4096, heads=32, kv_heads=8, head_dim=128
    ),
}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn, device, reps: int) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=5, rep=max(20, reps * 10)))
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _peak_bytes(fn, device) -> int | None:
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


def _fwd_bwd(fn, inputs, grad_like=True):
    def run():
        ins = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
        out = fn(*ins)
        out = out[0] if isinstance(out, tuple) else out
        (out.float().sum() if grad_like else out).backward()

    return run


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

    flops_attn = 4 * b * nh * sq * sq * d / 2  # causal
    out = [
        dict(
            name="rms_norm",
            inputs=[x, w],
            ours=lambda a, ww: K.rms_norm(a, ww, 1e-5),
            eager=eager_rms,
            bytes_fwd=2 * x.numel() * el,
            bytes_bwd=3 * x.numel() * el,
            liger="rms_norm",
        ),
        dict(
            name="layer_norm",
            inputs=[x, w, bias],
            ours=lambda a, ww, bb: K.layer_norm(a, ww, bb, 1e-5),
            eager=lambda a, ww, bb: F.layer_norm(a, (h,), ww, bb, 1e-5),
            bytes_fwd=2 * x.numel() * el,
            bytes_bwd=3 * x.numel() * el,
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
        dict(
            name="rope",
            inputs=[q],
            ours=lambda a: K.apply_rope(a, cos, sin),
            eager=lambda a: K.apply_rope_reference(a, cos, sin),
            bytes_fwd=2 * q.numel() * el,
            bytes_bwd=2 * q.numel() * el,
            liger=None,
        ),
        dict(
            name="flash_attention",
            inputs=[q, k, vv],
            ours=lambda a, c, e: K.flash_attention(a, c, e, causal=True),
            eager=lambda a, c, e: F.scaled_dot_product_attention(
                a.transpose(1, 2), c.transpose(1, 2), e.transpose(1, 2), is_causal=True, enable_gqa=nh != nkv
            ).transpose(1, 2),
            flops_fwd=flops_attn,
            flops_bwd=2.5 * flops_attn,
            liger=None,
        ),
        dict(
            name="fused_linear_cross_entropy",
            inputs=[hid, wout],
            ours=lambda hh, ww: K.fused_linear_cross_entropy(hh, ww, labels),
            eager=unfused_ce,
            flops_fwd=2 * t * h * v,
            flops_bwd=4 * t * h * v,
            liger="fused_linear_cross_entropy",
        ),
    ]
    return out


def _liger(kind):
    try:
        import liger_kernel.transformers.functional as LF  # optional
    except ImportError:
        return None
    if kind == "rms_norm":
        return lambda a, ww: LF.liger_rms_norm(a, ww, 1e-5)
    if kind == "swiglu":
        return LF.liger_swiglu
    return None


def copy_bandwidth(device, dtype) -> float | None:
    """GB/s of a device-to-device copy of 2 GiB (read + write), the ceiling for memory-bound kernels."""
    if device.type != "cuda":
        return None
    n = (1 << 30) // torch.tensor([], dtype=dtype).element_size()
    src = torch.empty(n, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), device, 10)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SIZES), default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile (default on CUDA)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out-dir", default=".")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    use_compile = args.compile or device.type == "cuda"
    from megatron_lite.training.flops import peak_flops

    peak = peak_flops(device, dtype != torch.float32)
    bw = copy_bandwidth(device, dtype)
    rows = []
    for case in cases(SIZES[args.size], dtype, device):
        impls = {"megatron_lite": case["ours"], "eager": case["eager"]}
        if use_compile:
            impls["torch.compile"] = torch.compile(case["eager"])
        if case.get("liger") and _liger(case["liger"]):
            impls["liger"] = _liger(case["liger"])
        for impl, fn in impls.items():
            for kind in ("fwd", "fwd+bwd"):
                ins = case["inputs"]
                run = (lambda fn=fn, ins=ins: fn(*ins)) if kind == "fwd" else _fwd_bwd(fn, ins)
                with torch.no_grad() if kind == "fwd" else torch.enable_grad():
                    ms = _time_ms(run, device, args.reps)
                    mem = _peak_bytes(run, device)
                row = {"kernel": case["name"], "impl": impl, "pass": kind, "ms": ms, "peak_memory_bytes": mem}
                if "bytes_fwd" in case:
                    moved = case["bytes_fwd"] + (case["bytes_bwd"] if kind == "fwd+bwd" else 0)
                    row["GB/s"] = moved / ms / 1e6
                    row["fraction_of_copy_bw"] = row["GB/s"] / bw if bw else None
                else:
                    work = case["flops_fwd"] + (case["flops_bwd"] if kind == "fwd+bwd" else 0)
                    row["TFLOP/s"] = work / ms / 1e9
                    row["fraction_of_peak"] = row["TFLOP/s"] * 1e12 / peak if peak else None
                rows.append(row)
                print(json.dumps(row), flush=True)
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "dtype": str(dtype).removeprefix("torch."),
        "size": args.size,
        "copy_bandwidth_GBps": bw,
        "peak_flops": peak,
        "torch": torch.__version__,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "kernels.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    with open(os.path.join(args.out_dir, "kernels.md"), "w") as fh:
        fh.write(f"# Kernel benchmark — {meta['device']}, {meta['dtype']}, size {args.size}\n\n")
        fh.write(f"copy bandwidth: {bw and round(bw)} GB/s; peak: {peak and peak / 1e12} TFLOP/s\n\n")
        fh.write(
            "| kernel | impl | pass | ms | peak MiB | GB/s or TFLOP/s | of ceiling |\n|---|---|---|---|---|---|---|\n"
        )
        for r in rows:
            rate = r.get("GB/s", r.get("TFLOP/s"))
            frac = r.get("fraction_of_copy_bw", r.get("fraction_of_peak"))
            mem = f"{r['peak_memory_bytes'] / 2**20:.1f}" if r["peak_memory_bytes"] is not None else "-"
            fh.write(
                f"| {r['kernel']} | {r['impl']} | {r['pass']} | {r['ms']:.3f} | {mem} | {rate:.1f} | "
                f"{'-' if frac is None else f'{frac:.2f}'} |\n"
            )
    return rows


if __name__ == "__main__":
    main()
