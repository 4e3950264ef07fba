"""A world of processes for the benchmark scripts: `spawn(worker, world, args, *extra)` runs
`worker(rank, world, args, *extra)` on `world` ranks (gloo on CPU; NCCL, one GPU per rank, with
args.device == "cuda"; args.threads split between them) and returns what rank 0 returned (JSON-able).
Every rank passes a barrier, then exits at once: gloo aborts at exit ("terminate called without an active
exception") when a rank tears its groups down while a peer still talks.

Also the benchmark scripts' checks of their flags (`usage_error`, `check_sizes`, `check_device`), run in main()
before any work: a bad value said in one line, as OneLineErrorParser says a bad flag, not a traceback from inside
a worker (or every worker at once)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, tmp: str, worker, args, extra: tuple) -> None:
    torch.set_num_threads(max(1, args.threads // world))
    backend = "nccl" if args.device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    out = worker(rank, world, args, *extra)
    if rank == 0:
        with open(os.path.join(tmp, "out.json"), "w") as f:
            json.dump(out, f)
    dist.barrier()
    # Leave without tearing the groups down: with many subgroups, gloo's teardown races a peer's and aborts
    # now and then ("terminate called without an active exception"); every rank is past its last collective.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker, world: int, args, *extra):
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world, tmp, worker, args, extra), nprocs=world, start_method="spawn")
        with open(os.path.join(tmp, "out.json")) as f:
            return json.load(f)


def usage_error(message: str) -> NoReturn:
    """`error: message` on stderr, one line, and exit status 2 (argparse's for a bad flag)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def check_sizes(minimum: int = 1, **flags: int | list[int]) -> None:
    """Each flag's value (or every value of a list) at least `minimum`; flags by name, dashes as underscores."""
    for name, value in flags.items():
        for v in value if isinstance(value, list) else [value]:
            if v < minimum:
                usage_error(f"--{name.replace('_', '-')} {v}: must be {minimum} or more")


def check_heads(hidden: int, heads: int, groups: int | None = None) -> None:
    """A Llama-shaped model's heads: they divide the hidden size, and query groups divide them (transformers'
    config, or ours, refused these with a traceback, after the benchmark's imports)."""
    if hidden % heads:
        usage_error(f"--hidden-size {hidden}: not divisible by --num-attention-heads {heads}")
    if groups is not None and heads % groups:
        usage_error(f"--num-query-groups {groups}: does not divide --num-attention-heads {heads}")


def check_device(device: str, world: int = 1, world_flag: str = "") -> None:
    """--device as the benchmarks can use it: cpu, or cuda on a machine with CUDA and one GPU for each of `world`
    ranks (`world_flag`: the flag that sets them, e.g. "--ep"). Otherwise torch fails at its first CUDA call, deep
    in the run, or in every spawned worker at once."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        usage_error(f"--device {device}: not a device; use --device cpu or --device cuda")
    if dev.type not in ("cpu", "cuda"):
        usage_error(f"--device {device}: the benchmarks run on cpu or cuda; use --device cpu or --device cuda")
    if dev.type == "cpu":
        return
    if not torch.cuda.is_available():
        usage_error(f"--device {device}: no CUDA device here (torch.cuda.is_available() is False); use --device cpu")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        usage_error(f"--device {device}: this machine has {count} CUDA devices (cuda:0 to cuda:{count - 1}); use one")
    if world > count:
        usage_error(
            f"{world_flag} {world} with --device {device}: one GPU per rank, and torch.cuda.device_count() is "
            f"{count}; use {world_flag} {count} or less, or --device cpu"
        )


def check_outputs(args) -> None:
    """The files a benchmark writes (--json, --out-dir) can be written: checked before its work, which is lost
    when the write fails after it (from a review: an IsADirectoryError once the runs were done), and the folder
    they go into made (the check passes a missing parent; the tools open their files without making it)."""
    from megatron_lite.config import ConfigError
    from megatron_lite.training.configs import check_output_path

    for flag, path, is_dir in (("--json", getattr(args, "json", None), False),
                               ("--out-dir", getattr(args, "out_dir", None), True)):  # fmt: skip
        if path:
            try:
                check_output_path(flag, path, is_dir)
            except ConfigError as e:
                usage_error(str(e))
            os.makedirs(path if is_dir else os.path.dirname(os.path.abspath(path)), exist_ok=True)
