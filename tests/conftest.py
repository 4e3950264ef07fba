"""Shared fixtures: `dist(world_size, fn, *args)` runs `fn` on every rank of a persistent gloo world."""

from __future__ import annotations

import gc
import os
import pathlib
import sys

# The repository's top-level kernels/ (installed as megatron_lite.kernels) shadows Hugging Face's `kernels`
# package, which transformers 5 imports, wherever the repository root is on sys.path: `python -m pytest` puts
# the working directory there, and transformers then failed to import ("cannot import name 'CUDAProperties'
# from 'kernels'"). Taken off before anything imports transformers; the project is imported as installed.
_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if pathlib.Path(p or os.curdir).resolve() != _ROOT]

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels run through the interpreter where there is no GPU; it must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:  # fp32 kernel tests compare at fp32 tolerances: tl.dot must not round its fp32 inputs to tf32 on a GPU
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

# The embedded corpus (and dataset index caches) for tests live in the repo's pytest cache, not in the home
# directory; set before any worker pool is spawned so every rank sees the same place.
os.environ.setdefault("MEGATRON_LITE_CACHE", str(_ROOT / ".pytest_cache" / "megatron_lite"))

import megatron_lite  # noqa: E402  (after TRITON_INTERPRET is set, should importing it ever import triton)

# The tests import the project as installed: an editable install of another checkout would test that one's code
# without a word (pip install -e . points megatron_lite here).
if not pathlib.Path(megatron_lite.__file__).resolve().is_relative_to(_ROOT):
    pytest.exit(
        f"megatron_lite is imported from {pathlib.Path(megatron_lite.__file__).parent}, not from this checkout "
        f"({_ROOT}): run `pip install -e .` here first",
        returncode=4,
    )

import head_start  # noqa: E402

from dist_pool import WorkerPool  # noqa: E402

torch.set_num_threads(2)


def pytest_collection_modifyitems(session, config, items):
    """The tests that own a head start run last, in their order: the background then has the whole suite's idle
    core to finish their checks, not the minutes before their file's turn (tests/head_start.py)."""
    owners = [item for item in items if item.get_closest_marker("head_start")]
    if owners and len(owners) < len(items):
        items[:] = [item for item in items if not item.get_closest_marker("head_start")] + owners


def pytest_collection_finish(session):
    """The one-process checks of the tests collected start in the background, in the tests' order
    (tests/head_start.py)."""
    keys = [k for item in session.items for m in item.iter_markers("head_start") for k in m.args]
    head_start.start(keys)


def pytest_sessionfinish(session, exitstatus):
    head_start.stop()


@pytest.fixture(autouse=True, scope="module")
def _frozen_heap():
    """A full garbage collection walks every object Python tracks, and pretrain's main ends with one (the cycles
    that hold its process groups must go before the interpreter's shutdown). This process holds 1.4 M objects
    by the suite's end (torch, transformers, every test module): the collections of the ~540 jobs run in it
    took 205 s of a 1015 s suite here. So each module starts by collecting what the modules before it left
    and freezing what is still alive (gc.freeze: out of later collections, still freed by reference counting);
    a collection then walks only what the current module made. (What a module leaves in a cycle stays.)"""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def _pools():
    pools: dict = {}  # world size -> pool; ("jobs", world size) -> a bare pool (pretrain_jobs)
    yield pools
    for pool in pools.values():
        if not pool.broken:
            pool.close()


def _pool(pools: dict, world_size: int, init_group: bool = True) -> WorkerPool:
    """The session's pool of this kind and size, started again if a failure broke it."""
    key = world_size if init_group else ("jobs", world_size)
    pool = pools.get(key)
    if pool is None or pool.broken:
        pool = pools[key] = WorkerPool(world_size, init_group=init_group)
    return pool


@pytest.fixture
def dist(_pools):
    def run(world_size: int, fn, *args, **kwargs):
        return _pool(_pools, world_size).run(fn, *args, **kwargs)

    return run


@pytest.fixture
def pretrain_job(_pools, tmp_path):
    """`pretrain_job(world_size, argv)`: a whole pretraining job (pretrain_gpt.py's main) on the ranks of a
    persistent bare pool, started as torchrun starts its workers (tests/pretrain_jobs.py)."""
    from pretrain_jobs import run_job

    def run(world_size: int, argv: list[str], **kwargs):
        return run_job(_pool(_pools, world_size, init_group=False), argv, tmp_path, **kwargs)

    return run


@pytest.fixture(autouse=True)
def _small_interpreter_tiles(request, monkeypatch):
    """The kernel unit tests run the interpreter on 16-wide tiles and one row per program (as on a GPU), and the
    NF4 tests on the GPU's 1024-element blocks, so that their small, odd shapes cross many tile, row and block
    boundaries; model-level tests keep the defaults (kernels/_common.py: INTERPRETER_TILE, INTERPRETER_BLOCK),
    which are faster. (The row kernels' several rows per program have tests of their own.)"""
    from megatron_lite.kernels import _common

    if request.module.__name__.startswith("test_kernels_"):
        monkeypatch.setattr(_common, "INTERPRETER_TILE", 16)
        monkeypatch.setattr(_common, "INTERPRETER_BLOCK", 1)
    if request.module.__name__ == "test_nf4":
        from megatron_lite.kernels import nf4

        monkeypatch.setattr(_common, "INTERPRETER_BLOCK", nf4.BLOCK)
