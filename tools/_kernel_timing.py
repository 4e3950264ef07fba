"""How the kernel benchmarks (tools/bench_kernels.py and the tile tools) time a kernel on a GPU (and, tiny, on a
CPU): launched one by one or as CUDA graph replays, a copy of as many bytes to set it against, its peak memory, a
profiler's view of back-to-back calls, implementations timed in turn; and its error against a reference. Also the
tile tools' common start (the kernels for a device) and their error rows."""

from __future__ import annotations

import importlib
import json
import math
import os
import statistics
import time

import torch


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graphed(fn, device):
    """`fn` captured in a CUDA graph, after warm-up runs on a side stream (autotuning and compiling happen there).
    Replays time the GPU's work alone: a memory-bound kernel at these sizes runs in tens of microseconds, about
    what Python takes to launch it, so timed launch by launch it measures the launcher."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_ms(fn, device, reps: int, graph: bool = False) -> float:
    if device.type == "cuda":
        import triton.testing

        if graph:
            fn = graphed(fn, device)
        # do_bench's warmup and rep are milliseconds: a 20 ms case at rep 30 was timed once. Each case runs at
        # least 25 times (from a first estimate), never less than `reps` x 10 ms.
        fn()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        sync(device)
        estimate = (time.perf_counter() - t0) / 3 * 1e3
        rep = max(20.0, reps * 10.0, 25 * estimate)
        return float(triton.testing.do_bench(fn, warmup=max(5.0, 3 * estimate), rep=rep, return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_ms(moved_bytes: int, device, dtype, reps: int = 10) -> float | None:
    """Milliseconds of a device-to-device copy that moves `moved_bytes` (read + write) of random data, never zeros;
    None off a GPU. The faster of two timings: launch by launch, and as a CUDA graph replay like the memory-bound
    kernels. On an H200 the graph's copy (a memcpy node) ran at 2.76 TB/s against 4.2 TB/s launched, so a
    graph-only copy would flatter every kernel set against it."""
    if device.type != "cuda":
        return None
    n = max(1, moved_bytes // 2 // torch.tensor([], dtype=dtype).element_size())
    src = torch.randn(n, device=device).to(dtype)
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)  # noqa: E731
    return min(time_ms(copy, device, reps), time_ms(copy, device, reps, graph=True))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (the tests' per-tensor measure); inf where either holds a NaN or an inf (NaN
    compares false: an output with a NaN passed every "> tolerance" check, and max() kept the error before it)."""
    a, b = a.detach().double(), b.detach().double()
    err = float((a - b).norm() / b.norm().clamp_min(1e-30))
    return err if math.isfinite(err) else math.inf


# Where an implementation marks the moment its gradients start to be made (mark_before_grads, from an autograd
# hook): the peak up to then, above the base of the call peak_bytes measures.
BEFORE_GRADS: dict[str, int] = {}


def mark_before_grads(grad):
    """A tensor hook: notes the peak memory so far, before any gradient the op returns exists."""
    if grad.is_cuda:
        BEFORE_GRADS["peak"] = torch.cuda.max_memory_allocated(grad.device) - BEFORE_GRADS.get("base", 0)
    return grad


def peak_bytes(fn, device) -> int | None:
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    BEFORE_GRADS.clear()
    BEFORE_GRADS["base"] = base
    fn()
    sync(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


def fwd_bwd(fn, inputs, grad_out):
    """Forward and backward with a fixed incoming gradient (random; ones for a scalar loss), so the time is the
    op's own: no cast or reduction of the output is added to it."""

    # (a norm's second output gets a gradient of its own: given the same tensor, the kernel's two reads of it
    # were one buffer's, and its GB/s counted the second as memory traffic)
    second = grad_out.flip(-1) if grad_out.dim() else grad_out

    def run():
        ins = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
        out = fn(*ins)
        if isinstance(out, tuple) and all(o.shape == grad_out.shape for o in out):  # a norm's (y, x + residual)
            torch.autograd.backward(list(out), [grad_out, *[second] * (len(out) - 1)])
        else:
            torch.autograd.backward(out[0] if isinstance(out, tuple) else out, grad_out)

    return run


def profile_calls(case: dict, impl: str, run, device, calls: int = 5) -> None:
    """Print the GPU kernels of `calls` back-to-back calls of `run` (forward+backward), the most time first; on a
    GPU also the time the GPU was busy against the span of those calls (the rest: the GPU idle between kernels)
    and the long kernels' times in order (a clock that drops under sustained load shows as times that grow)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    run()
    sync(device)
    with profile(activities=acts) as prof:
        for _ in range(calls):
            run()
        sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=14)
    print(f"## profile: {case['name']} / {impl}, forward+backward, {calls} calls\n{table}", flush=True)
    if device.type != "cuda":
        return
    try:  # kineto's device events: (start, end) in ns
        from torch.autograd import DeviceType

        kernels = sorted(
            (e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
            for e in prof.profiler.kineto_results.events()
            if e.device_type() == DeviceType.CUDA
        )
        busy, reach, gaps = 0, kernels[0][0], []
        for (start, end, name), prev in zip(kernels, [None, *kernels[:-1]]):
            busy += max(0, end - max(start, reach))
            if prev is not None and start > reach:
                gaps.append((start - reach, prev[2][:40], name[:40]))
            reach = max(reach, end)
        span = reach - kernels[0][0]
        print(
            f"## GPU timeline: {case['name']} / {impl}: per call span {span / calls / 1e6:.3f} ms, busy "
            f"{busy / calls / 1e6:.3f} ms ({100 * busy / span:.1f}%), {len(kernels) / calls:.0f} kernels; largest "
            f"gaps (us): {[(round(g / 1e3, 1), a, b) for g, a, b in sorted(gaps, reverse=True)[:6]]}; kernels over "
            f"1 ms, in order (ms): {[round((e - s) / 1e6, 3) for s, e, _ in kernels if e - s > 1e6]}",
            flush=True,
        )
    except Exception as e:  # noqa: BLE001 - the table above stands without it
        print(f"## GPU timeline: unavailable ({type(e).__name__}: {e})", flush=True)


def time_in_turn(case: dict, impls: dict, device, peak, rounds: int = 5) -> list[dict]:
    """Forward+backward of each implementation as CUDA graph replays, timed in turn, round after round. Under
    these GEMMs an H200 runs at its 700 W power cap, its clock falling from 1980 to about 1500 MHz and drifting
    with what ran just before (a compile's idle seconds, say); in turn, every implementation meets the same."""
    graphs = {name: graphed(fwd_bwd(fn, case["inputs"], case["grad_out"]), device) for name, fn in impls.items()}
    times: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(rounds):
        for name, replay in graphs.items():
            times[name].append(time_ms(replay, device, 3))
    rows = []
    for name, ms in times.items():
        row = {"kernel": case["name"], "impl": name, "pass": "fwd+bwd interleaved", "ms": statistics.median(ms)}
        row.update(ms_rounds=ms, peak_memory_bytes=None, rel_err=None, timing="cuda graph, in turn", ms_launches=None)
        row["TFLOP/s"] = (case["flops_fwd"] + case["flops_bwd"]) / row["ms"] / 1e9
        row["fraction_of_peak"] = row["TFLOP/s"] * 1e12 / peak if peak else None
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def kernels_for(device, module: str, needs: str, what: str):
    """megatron_lite.kernels and its `module`, imported for `device`: on a CPU through the Triton interpreter (set
    before triton is imported). Exits with "Triton is not installed: `what`" where the module lacks `needs`."""
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from megatron_lite import kernels

    mod = importlib.import_module(f"megatron_lite.kernels.{module}")
    if not hasattr(mod, needs):
        raise SystemExit(f"error: Triton is not installed: {what}")
    return kernels, mod


def error_text(e: Exception) -> str:
    """A setting's error row: the exception's type and the first line of its message (Triton's compile errors run
    to pages)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
