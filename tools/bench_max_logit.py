"""Time QK-clip's recomputed max logit (models/qk_clip.py max_attention_logits, the SDPA path's) against SDPA's
causal forward on the same q, k, v: `python tools/bench_max_logit.py [seq ...]` (one CPU thread unless
--threads; --cuda on a GPU). Prints ms per call (best of 3) and the max's relative difference from fp64."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from _world import check_sizes, usage_error  # tools/_world.py, beside this script

from megatron_lite.flag_parser import OneLineErrorParser
from megatron_lite.models.qk_clip import max_attention_logits


def best_ms(fn, n: int = 3) -> float:
    fn()
    times = []
    for _ in range(n):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("seq", type=int, nargs="*", default=[1024, 4096], help="sequence lengths to time")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    a = ap.parse_args(argv)
    # (a sequence of 0 ended in an IndexError)
    check_sizes(seq=a.seq, threads=a.threads, batch=a.batch, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim)
    if a.heads % a.kv_heads:
        usage_error(f"--kv-heads {a.kv_heads}: does not divide --heads {a.heads}")
    torch.set_num_threads(a.threads)
    dev = "cuda" if a.cuda else "cpu"
    b, h, g, d = a.batch, a.heads, a.kv_heads, a.head_dim
    for dtype in (torch.float32, torch.bfloat16):
        for s in a.seq:
            q = torch.randn(b, s, h, d, dtype=dtype, device=dev)
            k, v = (torch.randn(b, s, g, d, dtype=dtype, device=dev) for _ in range(2))
            kk, vv = (x.repeat_interleave(h // g, 2).transpose(1, 2) for x in (k, v))
            sdpa = best_ms(
                lambda q=q, kk=kk, vv=vv: F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, is_causal=True)
            )
            ours = best_ms(lambda q=q, k=k: max_attention_logits(q, k, d**-0.5, None))
            exact = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk.transpose(1, 2).double()) * d**-0.5
            exact = exact.masked_fill(~torch.ones(s, s, dtype=torch.bool, device=dev).tril(), -torch.inf)
            want = exact.amax(dim=(0, 2, 3)).float()
            got = max_attention_logits(q, k, d**-0.5, None)
            diff = ((got - want).abs() / want.abs()).max().item()
            print(f"{str(dtype):14s} seq {s:6d}: SDPA causal forward {sdpa:8.1f} ms, max logit {ours:8.1f} ms "
                  f"({ours / sdpa:.2f}x), rel diff from fp64 {diff:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
