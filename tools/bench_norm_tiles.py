#!/usr/bin/env python
"""The norms' backward tilings, one at a time: forward+backward time as CUDA graph replays beside a copy of as
many bytes (the bandwidth a memory-bound kernel of that size can reach), whether two runs of the same inputs give
the same bits, and the error against the fp32 reference. For choosing the defaults in kernels/norms.py: on an
H200 the norms' forward ran at 0.89-0.97 of a same-size copy but forward+backward at 0.52-0.72.

    python tools/bench_norm_tiles.py --json n.json                         # one GPU, bf16, 4096 x 4096
    python tools/bench_norm_tiles.py --settings 2x1x1x8,2x1x3x8 --norms rms_norm
    python tools/bench_norm_tiles.py --device cpu --reps 1                 # tiny, interpreter: the code paths only

A setting is PROGRAMS_PER_SMxROWS_PER_STEPxSTAGESxWARPS (warps 0: the forward's rule for a row of that size),
run as asked but for the launcher's shared-memory bound; the default also with its bound on a step's columns;
each row says what was launched (programs, rows a step, stages). The default grid is the current default, then
every combination of 1, 2, 4 programs per SM, 1, 2 rows a step, 1, 2, 3 stages and 4, 8, 16 warps. On a CPU (the
interpreter) programs per SM, stages and warps change nothing, and rows a step only where more than the
interpreter's own rows a program (one row of 16384 columns or more).
The same-size copy is timed once per norm, launched and as a graph, the faster kept (as tools/bench_kernels.py).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from _kernel_timing import copy_ms, error_text, fwd_bwd, kernels_for, rel_err, time_ms
from _world import check_device, check_outputs, usage_error  # tools/_world.py, beside this script

from megatron_lite.flag_parser import OneLineErrorParser

# norm -> (bytes moved forward, backward) in tensors of the input's size, as tools/bench_kernels.py counts them
NORMS = {"rms_norm": (2, 3), "rms_norm_residual": (4, 4), "layer_norm": (2, 3)}
GRID = list(itertools.product((1, 2, 4), (1, 2), (1, 2, 3), (4, 8, 16)))


def _parse(text: str) -> list[tuple[int, ...]]:
    out = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 4 or not all(p.isdigit() for p in parts):
            usage_error(f"--settings {item!r}: each is PROGRAMSxROWSxSTAGESxWARPS, e.g. 2x1x3x8")
        out.append(tuple(int(p) for p in parts))
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--norms", default=",".join(NORMS), help=f"comma-separated, of {', '.join(NORMS)}")
    ap.add_argument("--settings", default=None, help="comma-separated PxRxSxW; default: the grid above")
    ap.add_argument("--tokens", type=int, default=None, help="rows (default 4096 on a GPU, 37 on a CPU)")
    ap.add_argument("--hidden", type=int, default=None, help="columns (default 4096 on a GPU, 48 on a CPU)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on a GPU, fp32 on a CPU")
    ap.add_argument("--reps", type=int, default=5, help="timing effort (at least x10 ms on a GPU, calls on a CPU)")
    ap.add_argument(
        "--set", default="", help="NAME=VALUE,... module settings of kernels/norms.py for the whole run (integers), "
        "e.g. BWD_WIDE_CHUNK=2048 or BWD_WIDE_FROM=1048576 (every row one pass)",
    )  # fmt: skip
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    check_outputs(args)
    check_device(args.device)
    unknown = set(args.norms.split(",")) - set(NORMS)
    if unknown:
        usage_error(f"--norms {','.join(sorted(unknown))}: not one of {', '.join(NORMS)}")
    settings = _parse(args.settings) if args.settings else GRID  # (before the kernels are imported)
    device = torch.device(args.device)
    K, norms = kernels_for(device, "norms", "_norm_bwd", "there is no backward kernel to tile")
    import triton

    gpu = device.type == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if gpu else "fp32")]
    rows_n, cols = args.tokens or (4096 if gpu else 37), args.hidden or (4096 if gpu else 48)
    for item in filter(None, args.set.split(",")):
        name, _, value = item.partition("=")
        if not (name.startswith(("BWD_", "SUM_")) and hasattr(norms, name) and value.strip().isdigit()):
            usage_error(f"--set {item!r}: each is NAME=INTEGER, NAME a BWD_ or SUM_ setting of norms.py")
        setattr(norms, name, int(value))
    knobs = ("BWD_PROGRAMS_PER_SM", "BWD_ROWS_PER_STEP", "BWD_STAGES", "BWD_WARPS", "BWD_STEP_ELEMENTS")
    saved = {k: getattr(norms, k) for k in knobs}
    default = tuple(saved.values())[:4]
    settings = settings if default in settings else [default, *settings]  # (the default first, as the baseline)
    gen = torch.Generator().manual_seed(0)
    x, res, dy = (torch.randn(rows_n, cols, generator=gen).to(device, dtype) for _ in range(3))
    w, b = (1 + 0.1 * torch.randn(cols, generator=gen)).to(device, dtype), torch.randn(cols, generator=gen).to(device)
    b = b.to(dtype)
    calls = {
        "rms_norm": (
            lambda a, ww, bb, r: K.rms_norm(a, ww, 1e-5),
            lambda a, ww, bb, r: K.rms_norm_reference(a, ww, 1e-5),
        ),
        "rms_norm_residual": (
            lambda a, ww, bb, r: K.rms_norm(a, ww, 1e-5, residual=r),
            lambda a, ww, bb, r: K.rms_norm_reference(a, ww, 1e-5, residual=r),
        ),
        "layer_norm": (
            lambda a, ww, bb, r: K.layer_norm(a, ww, bb, 1e-5),
            lambda a, ww, bb, r: K.layer_norm_reference(a, ww, bb, 1e-5),
        ),
    }

    def grads(fn, cast):
        leaves = [t.detach().to(cast).requires_grad_(True) for t in (x, w, b, res)]
        out = fn(*leaves)
        outs = list(out) if isinstance(out, tuple) else [out]
        torch.autograd.backward(outs, [dy.to(cast)] * len(outs))
        return [o.detach() for o in outs] + [t.grad for t in leaves if t.grad is not None]

    rows = []
    for name in args.norms.split(","):
        ours, ref_fn = calls[name]
        ref = grads(ref_fn, torch.float32)
        moved = sum(NORMS[name]) * x.numel() * x.element_size()
        copy_time = copy_ms(moved, device, dtype, args.reps)
        fwd_ms = time_ms(lambda fn=ours: fn(x, w, b, res), device, args.reps, graph=gpu)
        for s in settings:
            row = {"norm": name, "setting": "x".join(map(str, s)), "default": s == default, "device": str(device)}
            wide_from = norms.BWD_WIDE_FROM_RMS if name.startswith("rms") else norms.BWD_WIDE_FROM
            row.update(set=args.set, wide=triton.next_power_of_2(cols) >= wide_from)
            try:
                norms.BWD_PROGRAMS_PER_SM, norms.BWD_ROWS_PER_STEP, norms.BWD_STAGES, norms.BWD_WARPS = s
                if s != default:  # a forced setting: the rows a step as asked (only shared memory may lower them)
                    norms.BWD_STEP_ELEMENTS = 1 << 30
                # what the launcher runs: (programs, rows a step, stages) after its bounds by the row's size
                block = triton.next_power_of_2(cols)
                block = min(block, norms.BWD_WIDE_CHUNK) if row["wide"] else block  # (the wide kernel's chunk)
                row_bytes = (NORMS[name][1] - 1) * block * x.element_size()
                row["launched"] = list(norms._tiling(rows_n, block, device, row_bytes))
                first, again = grads(ours, dtype), grads(ours, dtype)
                row["same_bits"] = all(torch.equal(a, c) for a, c in zip(first, again))
                row["max_rel_err"] = max(rel_err(a, e) for a, e in zip(first, ref))
                run = fwd_bwd(ours, [x, w, b, res], dy)
                row["ms"] = time_ms(run, device, args.reps, graph=gpu)
                row["bwd_ms"] = row["ms"] - fwd_ms
                row["GB/s"] = moved / row["ms"] / 1e6
                if copy_time:
                    row["fraction_of_same_size_copy"] = copy_time / row["ms"]
            except Exception as e:  # noqa: BLE001 - a setting that does not build or launch is a result
                row["error"] = error_text(e)
            finally:
                for k, v in saved.items():
                    setattr(norms, k, v)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:  # after every setting: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
        copy_text = "-" if copy_time is None else f"{copy_time * 1e3:.1f} us"
        print(
            f"\n{name} backward settings on {device} ({str(dtype).split('.')[-1]}, {rows_n} x {cols}"
            f"{', ' + args.set if args.set else ''}); forward "
            f"{fwd_ms * 1e3:.1f} us; same-size copy {copy_text}:"
        )
        print("| setting PxRxSxW | same bits | max rel. err. | fwd+bwd us | bwd us | of same-size copy |")
        print("|---|---|---|---|---|---|")
        for row in sorted((q for q in rows if q["norm"] == name), key=lambda q: q.get("ms", float("inf"))):
            mark = " (default)" if row["default"] else ""
            if "error" in row:
                print(f"| {row['setting']}{mark} | - | - | {row['error']} | - | - |")
                continue
            frac = f"{row['fraction_of_same_size_copy']:.3f}" if "fraction_of_same_size_copy" in row else "-"
            print(
                f"| {row['setting']}{mark} | {row['same_bits']} | {row['max_rel_err']:.1e} | {row['ms'] * 1e3:.1f} | "
                f"{row['bwd_ms'] * 1e3:.1f} | {frac} |"
            )
    return rows


if __name__ == "__main__":
    main()
