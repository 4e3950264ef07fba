#!/usr/bin/env python
"""The fused cross-entropy's two row kernels (a chunk's statistics, and its logits turned into their gradient in
place), one launch setting at a time on one chunk: time as CUDA graph replays beside a copy of as many bytes,
and the error against PyTorch. Then the op itself, forward+backward, with the fastest settings and with the
current ones, timed in turn with torch.compile of the unfused loss, and each one's memory beyond the gradients
against the unfused loss's. For choosing kernels/cross_entropy.py's STATS_SETTING and GRAD_SETTING: on an H200 the
statistics of a 1024-row chunk took 134 us at the old settings and 82 us at the chosen ones (a read of its logits
takes about 60), and the op 0.98x torch.compile's time, timed in turn.

    python tools/bench_ce_rows.py --json ce.json                 # one GPU: a 1024 x 128256 bf16 chunk
    python tools/bench_ce_rows.py --stats 2048x1x4,4096x1x8 --grad 4096x1x16 --in-turn 1
    python tools/bench_ce_rows.py --device cpu --reps 1          # tiny, interpreter: the code paths only

A setting is BLOCKxSTAGESxWARPS (kernels/cross_entropy.py's RowSetting). The default grid, for both kernels:
1024, 2048, 4096, 8192 columns a step x 1, 2, 3 stages x 4, 8, 16 warps. --in-turn N: the op with the N fastest
statistics and gradient settings (paired in order), at the default chunk and at tokens/5 rows (five chunks: the
memory target's count at 4096 tokens), timed in turn (on a CPU once each, beside the eager loss). On a CPU (the
interpreter) only the columns a step change anything.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json

import torch
from _kernel_timing import copy_ms, error_text, fwd_bwd, kernels_for, peak_bytes, rel_err, time_in_turn, time_ms
from _world import check_device, check_outputs, usage_error  # tools/_world.py, beside this script

from megatron_lite.flag_parser import OneLineErrorParser

GRID = list(itertools.product((1024, 2048, 4096, 8192), (1, 2, 3), (4, 8, 16)))
KNOBS = {"stats": "STATS_SETTING", "grad": "GRAD_SETTING"}


def _parse(text: str, kind: str) -> list[tuple[int, ...]]:
    out = []
    for item in text.split(","):
        fields = item.strip().lower().split("x")
        if len(fields) != 3 or not all(f.isdigit() for f in fields):
            usage_error(f"--{kind} {item!r}: each is BLOCKxSTAGESxWARPS, e.g. 4096x1x16")
        out.append(tuple(int(f) for f in fields))
    return out


@contextlib.contextmanager
def _applied(ce, **settings: str):
    """kernels/cross_entropy's settings, by kind (stats, grad: "BxSxW"), for the block; restored after."""
    saved = {k: getattr(ce, KNOBS[k]) for k in KNOBS}
    try:
        for kind, text in settings.items():
            setattr(ce, KNOBS[kind], ce.RowSetting(*(int(v) for v in text.split("x"))))
        yield
    finally:
        for k, v in saved.items():
            setattr(ce, KNOBS[k], v)


def _stats_reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    m = x.amax(1)
    return torch.stack([m, torch.exp(x - m[:, None]).sum(1), x.gather(1, labels[:, None])[:, 0]], 1)  # (no smoothing)


def _grad_reference(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    g = torch.softmax(logits.float(), 1)
    g[torch.arange(len(labels), device=labels.device), labels] -= 1.0
    return g * scale[:, None]


def _table(title: str, rows: list[dict], default: str) -> None:
    print(f"\n{title}\n| setting | default | max rel. err. | us | of same-size copy |\n|---|---|---|---|---|")
    for row in sorted(rows, key=lambda q: q.get("ms", float("inf"))):
        if "error" in row:
            print(f"| {row['setting']} | {row['setting'] == default} | - | {row['error']} | - |")
            continue
        frac = f"{row['fraction_of_same_size_copy']:.3f}" if "fraction_of_same_size_copy" in row else "-"
        print(
            f"| {row['setting']} | {row['setting'] == default} | {row['rel_err']:.1e} | {row['ms'] * 1e3:.1f} "
            f"| {frac} |"
        )


def main(argv: list[str] | None = None) -> dict:
    ap = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=None, help="the chunk's rows (default 1024 on a GPU, 37 on a CPU)")
    ap.add_argument("--vocab", type=int, default=None, help="columns (default 128256 on a GPU, 50 on a CPU)")
    for kind in KNOBS:
        ap.add_argument(f"--{kind}", default=None, help="comma-separated BLOCKxSTAGESxWARPS; default: the grid")
    ap.add_argument("--in-turn", type=int, default=2, help="the op with the N fastest settings of each (0: none)")
    ap.add_argument("--tokens", type=int, default=None, help="the op's tokens (default 4096 on a GPU, 40 on a CPU)")
    ap.add_argument(
        "--hidden", type=int, default=None, help="the op's hidden size (default 4096 on a GPU, 24 on a CPU)"
    )
    ap.add_argument("--reps", type=int, default=5, help="timing effort (at least x10 ms on a GPU, calls on a CPU)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    check_outputs(args)
    check_device(args.device)
    settings = {k: GRID if getattr(args, k) is None else _parse(getattr(args, k), k) for k in KNOBS}
    device = torch.device(args.device)
    K, ce = kernels_for(device, "cross_entropy", "_ce_stats", "there are no row kernels to time")
    gpu = device.type == "cuda"
    defaults = {k: "x".join(map(str, getattr(ce, KNOBS[k]))) for k in KNOBS}
    rows_n, vocab = args.rows or (1024 if gpu else 37), args.vocab or (128256 if gpu else 50)
    dtype = torch.bfloat16 if gpu else torch.float32
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(rows_n, vocab, generator=gen)).to(device, dtype)
    labels = torch.randint(0, vocab, (rows_n,), generator=gen).to(device)
    scale = torch.full((rows_n,), 1.0 / rows_n, device=device)
    stats = torch.empty(rows_n, 4, device=device)
    ref_stats = _stats_reference(logits, labels)
    ref_grad = _grad_reference(logits, labels, scale)
    chunk_bytes = logits.numel() * logits.element_size()
    moved = {"stats": chunk_bytes, "grad": 2 * chunk_bytes}
    copies = {k: copy_ms(b, device, dtype, args.reps) for k, b in moved.items()}
    work = logits.clone()
    runs = {  # the gradient works in place: replays turn a gradient into another (in the same time)
        "stats": lambda: ce._row_stats(logits, labels, stats, None, 0, vocab, 0.0),
        "grad": lambda: ce._logits_grad(work, labels, stats, scale, 0, vocab, 0.0, 0.0),
    }

    result: dict = {"device": str(device), "rows": rows_n, "vocab": vocab, "dtype": str(dtype), "defaults": defaults}
    for kind in KNOBS:
        result[kind] = []
        for s in settings[kind]:
            row = {"setting": "x".join(map(str, s))}
            try:
                with _applied(ce, **{kind: row["setting"]}):
                    runs["stats"]()  # (also the gradient's statistics: at the current setting unless timed)
                    if kind == "grad":
                        work.copy_(logits)
                        runs["grad"]()
                        row["rel_err"] = rel_err(work, ref_grad)
                    else:
                        row["rel_err"] = max(rel_err(stats[:, i], ref_stats[:, i]) for i in range(3))
                    row["ms"] = time_ms(runs[kind], device, args.reps, graph=gpu)
                row["GB/s"] = moved[kind] / row["ms"] / 1e6
                if copies[kind]:
                    row["fraction_of_same_size_copy"] = copies[kind] / row["ms"]
            except Exception as e:  # noqa: BLE001 - a setting that does not build or launch is a result
                row["error"] = error_text(e)
            result[kind].append(row)
            print(json.dumps({"kernel": kind, **row}), flush=True)
            if args.json:  # after every setting: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1)
        if result[kind]:
            title = f"{kind} kernel on {device} ({rows_n} x {vocab}, {str(dtype).split('.')[-1]})"
            _table(title, result[kind], defaults[kind])
    if args.in_turn > 0:
        result["op"] = _op_in_turn(args, ce, K, device, result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    return result


def _op_in_turn(args, ce, K, device, result: dict) -> list[dict]:
    """The op with the N fastest settings (statistics and gradient paired in order), and with the current ones, at
    the default chunk and at tokens/5 rows, beside torch.compile of the unfused loss (eager on a CPU), timed in
    turn; and each one's peak memory beyond the gradients against the unfused eager loss's."""
    gpu = device.type == "cuda"
    best = {
        k: [r["setting"] for r in sorted((r for r in result[k] if "ms" in r), key=lambda r: r["ms"])] for k in KNOBS
    }
    variants = {"current": {}}
    for st, gr in list(zip(best["stats"], best["grad"]))[: args.in_turn]:
        variants[f"{st} / {gr}"] = {"stats": st, "grad": gr}
    tokens, hidden = args.tokens or (4096 if gpu else 40), args.hidden or (4096 if gpu else 24)
    dtype = torch.bfloat16 if gpu else torch.float32
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    w = (torch.randn(result["vocab"], hidden, generator=gen) / hidden**0.5).to(device, dtype)
    labels = torch.randint(0, result["vocab"], (tokens,), generator=gen).to(device)

    def unfused(hh, ww):
        return torch.nn.functional.cross_entropy((hh @ ww.t()).float(), labels)

    def ours(variant: dict, chunk: int | None):
        def fn(hh, ww):  # the settings hold while the forward launches (and a graph captures) the row kernels
            with _applied(ce, **variant):
                return K.fused_linear_cross_entropy(hh, ww, labels, chunk_size=chunk)

        return fn

    five = -(-tokens // 5)
    impls = {}
    for name, variant in variants.items():
        impls[name] = ours(variant, None)
        impls[f"{name}, 5 chunks of {five}"] = ours(variant, five)
    impls["unfused, " + ("torch.compile" if gpu else "eager")] = torch.compile(unfused) if gpu else unfused
    grad_out = torch.ones((), device=device)
    case = {"name": "fused_linear_cross_entropy", "inputs": [h, w], "grad_out": grad_out}
    case["flops_fwd"] = 2 * tokens * hidden * result["vocab"]
    case["flops_bwd"] = 2 * case["flops_fwd"]
    if gpu:
        rows = time_in_turn(case, impls, device, None)
    else:
        rows = [{"impl": n, "ms": time_ms(fwd_bwd(f, [h, w], grad_out), device, args.reps)} for n, f in impls.items()]
    if gpu:  # memory beyond the two gradients the op returns
        grads = 2 * (h.numel() + w.numel())
        unfused_extra = peak_bytes(fwd_bwd(unfused, [h, w], grad_out), device) - grads
        for row in rows:
            extra = peak_bytes(fwd_bwd(impls[row["impl"]], [h, w], grad_out), device) - grads
            row["extra_memory_MiB"] = extra / 2**20
            row["of_unfused_eager_memory"] = extra / unfused_extra
    base = rows[-1]["ms"]
    print(
        f"\nthe op, forward+backward, {tokens} x {hidden} -> {result['vocab']}, timed in turn "
        f"(current: {result['defaults']}):"
    )
    print(
        "| impl | ms | speed vs the unfused | memory beyond the gradients, of the unfused eager's |\n|---|---|---|---|"
    )
    for row in rows:
        row["speed_vs_unfused"] = base / row["ms"]
        mem = f"{row['of_unfused_eager_memory']:.2%}" if "of_unfused_eager_memory" in row else "-"
        print(f"| {row['impl']} | {row['ms']:.3f} | {row['speed_vs_unfused']:.3f}x | {mem} |")
    return rows


if __name__ == "__main__":
    main()
