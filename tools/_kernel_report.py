"""The kernel benchmark's report (tools/bench_kernels.py): issue 6's targets judged from the measured rows,
and the JSON and markdown table it writes."""

from __future__ import annotations

import json
import os

TARGETS = """Targets (issue 6, one H200, bf16): norms, SwiGLU (quick-GEGLU too) and RoPE >= 0.85 of the copy
bandwidth; flash attention forward >= 1.0x and backward >= 0.8x the speed of SDPA's flash backend; fused linear
cross-entropy <= 5% of the unfused peak memory and no slower than torch.compile of the unfused loss."""


WRONG_REL_ERR = 5e-2  # (bf16 kernels sit within 1e-2 of eager; garbage, such as bf16 tl.dot in the interpreter, not)


def verdicts(rows: list[dict]) -> list[str]:
    """One line per target: the measured numbers and whether they meet it."""

    rows = [r for r in rows if "error" not in r]
    # an implementation whose output is not the reference's is no result, however fast: said first, and its rows
    # take no part in any verdict
    wrong = [r for r in rows if r["pass"] == "fwd" and (r.get("rel_err") or 0) > WRONG_REL_ERR]
    lines = [f"WRONG: {r['kernel']} / {r['impl']} differs from the reference by {r['rel_err']:.1e} (> "
             f"{WRONG_REL_ERR:g}): its times are not results" for r in wrong]  # fmt: skip
    bad = {(r["kernel"], r["impl"]) for r in wrong}
    rows = [r for r in rows if (r["kernel"], r["impl"]) not in bad]

    def get(kernel, impl, kind):
        return next((r for r in rows if r["kernel"] == kernel and r["impl"] == impl and r["pass"] == kind), None)

    for kernel in ("rms_norm", "rms_norm_residual", "layer_norm", "swiglu", "swiglu_stacked", "quick_geglu", "rope"):
        for kind in ("fwd", "fwd+bwd"):
            r = get(kernel, "megatron_lite", kind)
            if r and r.get("fraction_of_copy_bw") is not None:
                big, same = r["fraction_of_copy_bw"], r.get("fraction_of_same_size_copy")
                ok = "meets" if big >= 0.85 else "misses"
                same = "-" if same is None else f"{same:.2f}"
                lines.append(f"{kernel} {kind}: {big:.2f} of the 2 GiB copy, {same} of a same-size copy: {ok} 0.85")
    ours_f, ref_f = get("flash_attention", "megatron_lite", "fwd"), get("flash_attention", "sdpa_flash", "fwd")
    ours_b, ref_b = get("flash_attention", "megatron_lite", "fwd+bwd"), get("flash_attention", "sdpa_flash", "fwd+bwd")
    if ours_f and ref_f:
        x = ref_f["ms"] / ours_f["ms"]
        lines.append(
            f"flash_attention fwd: {x:.2f}x SDPA flash ({ours_f['TFLOP/s']:.0f} vs {ref_f['TFLOP/s']:.0f} "
            f"TFLOP/s): {'meets' if x >= 1.0 else 'misses'} 1.0x"
        )
    if ours_f and ref_f and ours_b and ref_b and ours_b["ms"] > ours_f["ms"] and ref_b["ms"] > ref_f["ms"]:
        ob, rb = ours_b["ms"] - ours_f["ms"], ref_b["ms"] - ref_f["ms"]
        x = rb / ob
        lines.append(
            f"flash_attention bwd: {x:.2f}x SDPA flash ({ob:.2f} vs {rb:.2f} ms): "
            f"{'meets' if x >= 0.8 else 'misses'} 0.8x"
        )
    mla = {r["impl"]: r for r in rows if r["kernel"] == "flash_attention_mla" and r["pass"] == "fwd+bwd"}
    if "megatron_lite" in mla and len(mla) > 1:  # no target: values of their own size against padded ones
        others = ", ".join(f"{k} {r['ms']:.2f} ms" for k, r in mla.items() if k != "megatron_lite")
        lines.append(
            f"flash_attention_mla fwd+bwd (no target): megatron_lite {mla['megatron_lite']['ms']:.2f} ms; {others}"
        )
    ce = [r for r in rows if r["kernel"] == "fused_linear_cross_entropy" and r["pass"] == "fwd+bwd"]
    eager = next((r for r in ce if r["impl"] == "eager"), None)
    comp = next((r for r in ce if r["impl"] == "torch.compile"), None)
    for r in ce:
        if not r["impl"].startswith("megatron_lite") or not eager or not eager["peak_memory_bytes"]:
            continue
        # The gradients the op returns (the weight's is vocab x hidden) sit in both peaks and alone are a fifth or
        # more of the unfused one, so 5% can only be met by the loss's own memory, as Cut Cross-Entropy counts it:
        # the verdict judges that, and both are printed.
        mem = r["peak_memory_bytes"] / eager["peak_memory_bytes"]
        work = r["working_bytes"] / max(1, eager["working_bytes"])
        grads = r.get("grad_bytes", 0) / eager["peak_memory_bytes"]
        speed = verdict = ""
        if comp:  # the GPU's work (graph replays) and launched one by one from Python, where both were timed
            both = comp.get("timing") == r.get("timing") == "cuda graph"
            launched = comp["ms_launches"] / r["ms_launches"] if both else None
            speed = f", {comp['ms'] / r['ms']:.2f}x the speed of torch.compile" + (
                f" as graph replays (the GPU's work), {launched:.2f}x launched one by one" if both else ""
            )
            verdict = f", speed {'meets' if comp['ms'] >= r['ms'] else 'misses'}" + (
                f" (launched one by one: {'meets' if launched >= 1 else 'misses'})" if both else ""
            )
        lines.append(
            f"{r['impl']} fwd+bwd: {work:.2%} of the unfused loss's memory beyond the returned gradients "
            f"(whole peak {mem:.1%}; the gradients alone are {grads:.0%} of the unfused peak){speed}: "
            f"memory {'meets' if work <= 0.05 else 'misses'} 5%{verdict}"
        )
    turns = {r["impl"]: r for r in rows if r.get("pass") == "fwd+bwd interleaved" and "error" not in r}
    if "megatron_lite" in turns and "torch.compile" in turns:
        ours, comp = turns["megatron_lite"], turns["torch.compile"]
        lines.append(
            f"fused_linear_cross_entropy fwd+bwd timed in turn with torch.compile ({len(ours['ms_rounds'])} rounds "
            f"of graph replays, the same clocks): {ours['ms']:.2f} vs {comp['ms']:.2f} ms, "
            f"{comp['ms'] / ours['ms']:.2f}x the speed of torch.compile: "
            f"speed {'meets' if comp['ms'] >= ours['ms'] else 'misses'}"
        )
    return lines


def write_report(out_dir: str, meta: dict, rows: list[dict]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "kernels.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows, "targets": verdicts(rows)}, fh, indent=1)
    with open(os.path.join(out_dir, "kernels.md"), "w") as fh:
        fh.write(f"# Kernel benchmark: {meta['device']}, {meta['dtype']}, size {meta['size']}\n\n")
        fh.write(f"{meta['torch']}; {meta.get('liger', '')}; shapes {meta['shapes']}\n\n")
        bw, peak = meta["copy_bandwidth_GBps"], meta["peak_flops"]
        bw_text = f"{round(bw)} GB/s" if bw else "not measured (a GPU's)"
        peak_text = f"{peak / 1e12:g} TFLOP/s" if peak else "none for this device"
        fh.write(f"copy bandwidth (2 GiB): {bw_text}; datasheet peak: {peak_text}\n\n")
        if any(r.get("timing") == "cuda graph" for r in rows):
            fh.write(
                "Memory-bound kernels (norms, SwiGLU, RoPE) and the fused cross-entropy are timed as CUDA graph "
                "replays, the GPU's work alone; "
                "'ms, launch by launch' is the same work launched from Python each time, which for the "
                "memory-bound kernels at these sizes is mostly the launcher's time. The copies they are set "
                "against take the faster of both timings. "
            )
        fh.write(
            "The backward takes a fixed random incoming gradient; the relative error is the forward output's "
            "against the reference (gradients are compared by the tests).\n\n"
        )
        fh.write(
            "| kernel | impl | pass | ms | ms, launch by launch | peak MiB | GB/s or TFLOP/s | of 2 GiB copy / of peak "
            "| of same-size copy | fwd rel. err. vs reference |\n|---|---|---|---|---|---|---|---|---|---|\n"
        )
        for r in (r for r in rows if "error" not in r):
            rate = r.get("GB/s", r.get("TFLOP/s"))
            frac = r.get("fraction_of_copy_bw", r.get("fraction_of_peak"))
            same = r.get("fraction_of_same_size_copy")
            mem = f"{r['peak_memory_bytes'] / 2**20:.1f}" if r["peak_memory_bytes"] is not None else "-"
            err = r.get("rel_err")
            timing = r.get("timing", "launches")  # "-": timed launch by launch only (milliseconds-long kernels)
            launches = (
                "-"
                if timing == "launches" or r.get("ms_launches") is None  # (None: timed in turn, graph replays only)
                else f"{r['ms_launches']:.3f}" + ("" if timing == "cuda graph" else f" ({timing})")
            )
            fh.write(
                f"| {r['kernel']} | {r['impl']} | {r['pass']} | {r['ms']:.3f} | "
                f"{launches} | {mem} | {rate:.1f} | "
                f"{'-' if frac is None else f'{frac:.2f}'} | {'-' if same is None else f'{same:.2f}'} | "
                f"{'-' if err is None else f'{err:.1e}'} |\n"
            )
        errors = [r for r in rows if "error" in r]
        if errors:
            fh.write("\nFailed: " + "; ".join(f"{r['kernel']} {r['impl']}: {r['error']}" for r in errors) + "\n")
        fh.write("\n" + TARGETS + "\n\n" + "\n".join(f"- {v}" for v in verdicts(rows)) + "\n")
