#!/usr/bin/env python
"""Flash attention's candidate tiles, one kernel forced to one tile at a time: its time beside SDPA's flash
backend, whether repeated runs of the same inputs give the same bits, and its error against the fp32 reference.
For choosing the autotuner's lists in kernels/flash_attention.py: on an H200 (Triton 3.6) three dK/dV tiles gave
different bits from run to run (a race in the generated code), so a tile enters a list only if it stays
deterministic over many runs, at the timed shape and at an odd one (lengths no tile divides, grouped-query heads,
seq_q < seq_k, with and without a sliding window), and if it is faster.

    python tools/bench_attention_tiles.py --kernel dkdv --tiles 32x64x4x3,64x64x8x3 --repeats 10 --json t.json
    python tools/bench_attention_tiles.py --device cpu --repeats 2      # tiny, interpreter: tile logic only

Tiles are BLOCK_MxBLOCK_Nxwarpsxstages (warps and stages only on a GPU). The other two kernels keep their usual
choice (the autotuner's on a GPU). The time is the pass the forced kernel runs in: the forward for `fwd`, the
backward (forward+backward minus forward, as tools/bench_kernels.py counts it) for `dkdv` and `dq`; ratios are
SDPA's time over ours (above 1: ours is faster). A tile that does not build (shared memory) is reported as such.
"""

from __future__ import annotations

import argparse
import json

import torch
from _kernel_timing import error_text, kernels_for, rel_err, time_ms
from _world import check_device, check_outputs, usage_error  # tools/_world.py, beside this script

from megatron_lite.flag_parser import OneLineErrorParser

KINDS = {"fwd": ("_fwd", "_FWD_TILES"), "dkdv": ("_bwd_dkdv", "_DKDV_TILES"), "dq": ("_bwd_dq", "_DQ_TILES")}
# (batch, seq_q, seq_k, heads, kv_heads, head_dim, window): the timed shape first (Llama-3-8B), then odd ones
SHAPES = {
    "cuda": [(1, 4096, 4096, 32, 8, 128, None), (2, 1000, 1100, 16, 4, 128, None), (2, 1000, 1100, 16, 4, 128, 300)],
    "cpu": [(1, 64, 64, 4, 2, 16, None), (1, 60, 70, 4, 2, 16, None), (1, 60, 70, 4, 2, 16, 24)],
}


def _parse_tiles(text: str) -> list[tuple[int, ...]]:
    tiles = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 4 or not all(p.isdigit() for p in parts):
            usage_error(f"--tiles {item!r}: each tile is BLOCK_MxBLOCK_Nxwarpsxstages, e.g. 64x64x4x3")
        tiles.append(tuple(int(p) for p in parts))
    return tiles


def _inputs(shape, device, dtype):
    b, sq, sk, h, hkv, d, _ = shape
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(b, s, n, d, generator=gen).to(device, dtype) for s, n in ((sq, h), (sk, hkv), (sk, hkv), (sq, h))
    ]


def _run(fn, q, k, v, up, window, dtype, backward=True):
    """Output and gradients of one call on fresh leaves (cast to `dtype`)."""
    leaves = [t.detach().to(dtype).requires_grad_(backward) for t in (q, k, v)]  # fresh leaves, no copy if same dtype
    o = fn(*leaves, causal=True, window_size=window)
    if not backward:
        return [o.detach()]
    o.backward(up.to(dtype))
    return [o.detach()] + [t.grad for t in leaves]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kernel", choices=list(KINDS), default="dkdv", help="the kernel whose tile is forced")
    ap.add_argument("--tiles", default=None, help="comma-separated MxNxWARPSxSTAGES; default: the autotuner's list")
    ap.add_argument("--repeats", type=int, default=10, help="runs of the same inputs per shape that must agree")
    ap.add_argument("--reps", type=int, default=10, help="timing effort (at least x10 ms on a GPU, calls on a CPU)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    check_outputs(args)
    check_device(args.device)
    tiles = _parse_tiles(args.tiles) if args.tiles else None  # (before the kernels are imported)
    device = torch.device(args.device)
    K, fa = kernels_for(device, "flash_attention", KINDS[args.kernel][1], "there are no tiles to try")
    tiles = tiles or list(getattr(fa, KINDS[args.kernel][1]))
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    shapes = SHAPES["cuda" if gpu else "cpu"]
    cases = []
    for shape in shapes:  # inputs and the fp32 reference once per shape, for every tile
        q, k, v, up = _inputs(shape, device, dtype)
        ref = _run(K.flash_attention_reference, q, k, v, up, shape[6], torch.float32)
        cases.append((shape, (q, k, v, up), ref))
    q, k, v, up = cases[0][1]

    def timed(fn) -> tuple[float, float]:
        """(the kernel's ms, the timed call's: forward, or forward+backward). A backward is the difference of
        two timings, which on a loaded CPU can come out below zero: the whole call's time says the run was timed."""
        run_fwd = lambda: _run(fn, q, k, v, up, None, dtype, backward=False)  # noqa: E731
        fwd = time_ms(run_fwd, device, args.reps)
        if args.kernel == "fwd":
            return fwd, fwd
        both = time_ms(lambda: _run(fn, q, k, v, up, None, dtype), device, args.reps)
        return both - fwd, both

    sdpa_ms = None
    if gpu:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa(a, b_, c, causal, window_size):
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return fa.sdpa_reference(a, b_, c, causal=causal)

        sdpa_ms = timed(sdpa)[0]
    rows = []
    for tile in tiles:
        # The other two kernels: their usual choice (autotuned on a GPU) at the timed shape, a fixed small tile at
        # the odd ones (checks only: no autotuning there)
        fixed = {"BLOCK_M": 32, "BLOCK_N": 32}
        row = {"kernel": args.kernel, "tile": "x".join(map(str, tile)), "device": str(device)}
        try:
            differs, errs = [], {}
            for shape, (sq_, sk_, sv_, sup), ref in cases:
                with fa.forced_tile(args.kernel, tile, others=None if shape == shapes[0] else fixed):
                    first = _run(K.flash_attention, sq_, sk_, sv_, sup, shape[6], dtype)
                    for i in range(1, args.repeats):
                        again = _run(K.flash_attention, sq_, sk_, sv_, sup, shape[6], dtype)
                        pairs = zip(("o", "dq", "dk", "dv"), first, again)
                        bad = [nm for nm, a, b_ in pairs if not torch.equal(a, b_)]
                        if bad:
                            differs.append(f"{shape}: run {i} differs in {','.join(bad)}")
                            break
                for nm, a, r in zip(("o", "dq", "dk", "dv"), first, ref):
                    errs[nm] = max(errs.get(nm, 0.0), rel_err(a, r))
            row.update(deterministic=not differs, differs=differs, max_rel_err=errs)
            with fa.forced_tile(args.kernel, tile):
                row["ms"], row["call_ms"] = timed(K.flash_attention)
            if sdpa_ms is not None:
                row.update(sdpa_ms=sdpa_ms, speed_vs_sdpa=sdpa_ms / row["ms"])
        except Exception as e:  # noqa: BLE001 - a tile that does not build is a result, not the end of the run
            row["error"] = error_text(e)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{args.kernel} tiles on {device} ({'bf16' if gpu else 'fp32'}), shape {shapes[0]}:")
    print("| tile | deterministic | max rel. err. | ms | speed vs SDPA flash |\n|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: r.get("ms", float("inf"))):
        if "error" in r:
            print(f"| {r['tile']} | - | - | {r['error']} | - |")
            continue
        ratio = f"{r['speed_vs_sdpa']:.3f}x" if "speed_vs_sdpa" in r else "-"
        print(
            f"| {r['tile']} | {r['deterministic']} | {max(r['max_rel_err'].values()):.1e} | {r['ms']:.3f} | {ratio} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
