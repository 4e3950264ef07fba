"""A world of processes for the benchmark scripts: `spawn(worker, world, args, *extra)` runs
`worker(rank, world, args, *extra)` on `world` ranks (gloo on CPU; NCCL, one GPU per rank, with
args.device == "cuda"; args.threads split between them) and returns what rank 0 returned (JSON-able).
Every rank passes a barrier, then exits at once: gloo aborts at exit ("terminate called without an active
exception") when a rank tears its groups down while a peer still talks."""

from __future__ import annotations

import json
import os
import sys
import tempfile

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
