"""Process groups for every parallelism, built once and passed to the layers that need them.

The rank grid is pure data (`RankGrid`): which ranks share a tensor-, context-, data- or pipeline-parallel
group follows from the sizes alone, so it can be printed and tested without processes. `ParallelContext`
turns the grid into process groups for one rank; layers receive the `Group` they communicate over
explicitly, never by reading global state (Megatron's global `parallel_state` is a known source of
wrong-group gradient bugs).

Rank order is Megatron's: rank = tp + TP*(cp + CP*(dp + DP*pp)). Expert layers use their own grid,
rank = etp + ETP*(ep + EP*(edp + EDP*pp)), so the expert tensor-parallel size may differ from TP; the
pipeline groups of both grids coincide because PP is the slowest dimension of each.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported now, before any process group exists: its functions take `group=group.WORLD` as a default, evaluated
# when the module is first imported. torch.optim's constructor imports it (through torch._dynamo) after the job
# has joined its world, and those defaults then held the default group's gloo backend past
# destroy_process_group: its worker threads lived into the interpreter's shutdown, where a gloo group left alive
# can abort the process ("terminate called without an active exception") after the job has finished.
import torch.distributed.nn.functional  # noqa: F401

from megatron_lite.comm_timer import CommTimer
from megatron_lite.config import ConfigError, ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.layout_validation import stage_layer_counts, validate_layout
from megatron_lite.tensor_parallel.random import RNGStatesTracker

DECODER_DIMS = ("tp", "cp", "dp", "pp")
EXPERT_DIMS = ("etp", "ep", "edp", "pp")


@dataclass(frozen=True)
class RankGrid:
    """Ranks laid out on named dimensions, the first varying fastest."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def world_size(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def coords(self, rank: int) -> dict[str, int]:
        out = {}
        for name, size in zip(self.names, self.sizes):
            out[name] = rank % size
            rank //= size
        return out

    def rank_of(self, coords: dict[str, int]) -> int:
        rank, stride = 0, 1
        for name, size in zip(self.names, self.sizes):
            rank += coords[name] * stride
            stride *= size
        return rank

    def groups(self, dims: tuple[str, ...]) -> list[tuple[int, ...]]:
        """All groups of ranks that differ only along `dims` (each group sorted by rank)."""
        fixed = [n for n in self.names if n not in dims]
        size = dict(zip(self.names, self.sizes))
        out = []
        for fixed_vals in itertools.product(*(range(size[n]) for n in fixed)):
            base = dict(zip(fixed, fixed_vals))
            members = []
            for vals in itertools.product(*(range(size[d]) for d in dims)):
                members.append(self.rank_of({**base, **dict(zip(dims, vals))}))
            out.append(tuple(sorted(members)))
        return sorted(out)

    def group_of(self, rank: int, dims: tuple[str, ...]) -> tuple[int, ...]:
        return next(g for g in self.groups(dims) if rank in g)


def decoder_grid(parallel: ParallelConfig, world_size: int) -> RankGrid:
    return RankGrid(DECODER_DIMS, (parallel.tp, parallel.cp, parallel.data_parallel_size(world_size), parallel.pp))


def expert_grid(parallel: ParallelConfig, world_size: int) -> RankGrid:
    edp = parallel.expert_data_parallel_size(world_size)
    return RankGrid(EXPERT_DIMS, (parallel.etp, parallel.ep, edp, parallel.pp))


@dataclass
class Group:
    """One rank's view of a process group: its members, its own index, and the handle.

    `handle` is None when the group has one member (no communication ever happens) or when the context
    was built for inspection only (dry runs, meta-device models)."""

    ranks: tuple[int, ...]
    rank: int  # index of this process within `ranks`
    handle: dist.ProcessGroup | None = None
    timer: CommTimer | None = None  # shared by the context's groups: exposed communication time

    def blocked(self):
        """Time what runs inside as communication the compute path waits for."""
        return self.timer.blocked() if self.timer is not None else contextlib.nullcontext()

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def pg(self) -> dist.ProcessGroup:
        if self.handle is None:
            raise RuntimeError(
                f"group {self.ranks} has no process group: this ParallelContext was built for inspection "
                "(ParallelContext.virtual); build it with ParallelContext.build to communicate"
            )
        return self.handle


# Each group kind: which grid and which dimensions vary inside it.
_GROUP_DIMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tp": ("decoder", ("tp",)),
    "cp": ("decoder", ("cp",)),
    "dp": ("decoder", ("dp",)),
    "dp_cp": ("decoder", ("cp", "dp")),  # dense gradients are reduced over DP x CP
    "pp": ("decoder", ("pp",)),
    "mp": ("decoder", ("tp", "pp")),  # model-parallel group (grad norm across shards)
    "tp_cp_dp": ("decoder", ("tp", "cp", "dp")),  # every replica of a stage (MoE expert-bias token counts)
    "emp": ("expert", ("etp", "ep", "pp")),  # expert-model-parallel group (grad norm across expert shards)
    "etp": ("expert", ("etp",)),
    "ep": ("expert", ("ep",)),
    "edp": ("expert", ("edp",)),
}


def all_groups(parallel: ParallelConfig, world_size: int) -> dict[str, list[tuple[int, ...]]]:
    """Every group of every kind, as sorted rank tuples: the whole layout as data."""
    return {kind: list(members) for kind, members in _all_groups(parallel, world_size).items()}


@functools.lru_cache(maxsize=8)
def _all_groups(parallel: ParallelConfig, world_size: int) -> dict[str, list[tuple[int, ...]]]:
    """(Cached: a dry run builds a context for every rank of the job, and each asked for the same layout; at
    DeepSeek-V3's 1024 ranks that took 70 s. all_groups hands out copies, so no caller can change it.)"""
    grids = {"decoder": decoder_grid(parallel, world_size), "expert": expert_grid(parallel, world_size)}
    out = {kind: grids[grid].groups(dims) for kind, (grid, dims) in _GROUP_DIMS.items()}
    # Tied embeddings: the first and last stage of each pipeline share the word embeddings.
    out["embedding"] = sorted({tuple(sorted({g[0], g[-1]})) for g in out["pp"]})
    # Hierarchical context parallelism (a2a+p2p, sizes A x P): A adjacent CP ranks exchange heads all-to-all; the
    # ranks at the same place in their groups form the ring (CP groups list their ranks in CP order)
    sizes = parallel.hierarchical_context_parallel_sizes
    if sizes:
        inner = sizes[0]
        out["cp_inner"] = sorted(g[i : i + inner] for g in out["cp"] for i in range(0, len(g), inner))
        out["cp_outer"] = sorted(g[j::inner] for g in out["cp"] for j in range(inner))
    return out


def chunk_layers(
    num_layers: int, pp_size: int, vp_size: int, pp_rank: int, chunk: int, parallel: ParallelConfig | None = None
) -> range:
    """Global layer numbers of model chunk `chunk` (a virtual stage) on pipeline rank `pp_rank`.

    Megatron's interleaved assignment: virtual stage s = chunk * pp_size + pp_rank, consecutive stages on
    consecutive ranks; layers are split evenly, or unevenly at the ends (see layout_validation.stage_layer_counts)."""
    if parallel is None:
        parallel = ParallelConfig(pipeline_model_parallel_size=pp_size, virtual_pipeline_model_parallel_size=vp_size)
    counts = stage_layer_counts(num_layers, parallel)
    stage = chunk * pp_size + pp_rank
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


@dataclass
class ParallelContext:
    """Everything a layer needs to know about the layout, for one rank."""

    parallel: ParallelConfig
    world_size: int
    rank: int
    groups: dict[str, Group]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    rng: RNGStatesTracker = field(default_factory=RNGStatesTracker)

    # Short names used throughout the layers.
    @property
    def tp(self) -> Group:
        return self.groups["tp"]

    @property
    def cp(self) -> Group:
        return self.groups["cp"]

    @property
    def cp_inner(self) -> Group:
        """Hierarchical CP (a2a+p2p): this rank's all-to-all group of adjacent CP ranks."""
        return self.groups["cp_inner"]

    @property
    def cp_outer(self) -> Group:
        """Hierarchical CP (a2a+p2p): the ring over the all-to-all groups (the ranks at the same place in theirs)."""
        return self.groups["cp_outer"]

    @property
    def dp(self) -> Group:
        return self.groups["dp"]

    @property
    def dp_cp(self) -> Group:
        return self.groups["dp_cp"]

    @property
    def pp(self) -> Group:
        return self.groups["pp"]

    @property
    def mp(self) -> Group:
        return self.groups["mp"]

    @property
    def ep(self) -> Group:
        return self.groups["ep"]

    @property
    def etp(self) -> Group:
        return self.groups["etp"]

    @property
    def edp(self) -> Group:
        return self.groups["edp"]

    @property
    def tp_cp_dp(self) -> Group:
        return self.groups["tp_cp_dp"]

    @property
    def emp(self) -> Group:
        return self.groups["emp"]

    @property
    def embedding(self) -> Group:
        """First and last pipeline stage of this rank's pipeline (tied-embedding gradients)."""
        return self.groups["embedding"]

    @property
    def vp_size(self) -> int:
        """Model chunks (virtual pipeline stages) per pipeline rank."""
        return self.parallel.vp

    @property
    def sequence_parallel(self) -> bool:
        return self.parallel.sequence_parallel and self.parallel.tp > 1

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    def seed(self, seed: int) -> None:
        """Megatron's seeding: the default generator is the same on every TP rank (dropout on activations
        replicated across TP draws the same mask), the tracked model-parallel generator differs per TP
        rank (dropout inside TP regions and in sequence-sharded regions)."""
        default_seed = seed + 100 * self.pp.rank
        torch.manual_seed(default_seed)
        self.rng.reset()
        self.rng.add("model-parallel", default_seed + 2718 + self.tp.rank, self.device)
        # (Megatron's offset: with +2718 it replayed the model-parallel stream wherever ep = 0 and etp = tp)
        self.rng.add("expert-parallel", default_seed + 1024 + 100 * self.ep.rank + self.etp.rank, self.device)
        # (an expert's LoRA dropout on inputs alike across expert-TP: lora/adapters.py; not one of Megatron's)
        self.rng.add("expert-replicated", default_seed + 7919, self.device)

    # Construction ------------------------------------------------------------------------------
    @classmethod
    def _make(cls, parallel, world_size, rank, handles, device) -> ParallelContext:
        groups = {}
        device = device if device is not None else _default_device()
        timer = CommTimer(cuda=device.type == "cuda")
        for kind, members in all_groups(parallel, world_size).items():
            # Middle pipeline stages belong to no embedding group: a group of their own, no communication.
            ranks = next((g for g in members if rank in g), (rank,))
            groups[kind] = Group(ranks=ranks, rank=ranks.index(rank), handle=handles.get(ranks), timer=timer)
        return cls(parallel=parallel, world_size=world_size, rank=rank, groups=groups, device=device)

    @property
    def comm_timer(self) -> CommTimer | None:
        return self.tp.timer

    @classmethod
    def virtual(
        cls, parallel: ParallelConfig, world_size: int = 1, rank: int = 0, device: torch.device | None = None
    ) -> ParallelContext:
        """A context with sizes and ranks but no process groups: for single-process runs, dry runs and
        building a model on the meta device as a given rank would."""
        return cls._make(parallel, world_size, rank, {}, device)

    @classmethod
    def build(
        cls, parallel: ParallelConfig, device: torch.device | None = None, timeout: timedelta | None = None
    ) -> ParallelContext:
        """Create every process group of the layout. The default group must already be initialised.

        All ranks call `new_group` for every group in the same order (a requirement of
        torch.distributed); groups with one member, and repeats of a rank set, are not created. `timeout`: each
        group's (--distributed-timeout-minutes, as Megatron passes it to every group; without it a subgroup took
        torch's default, 30 minutes on gloo, whatever the flag said, an exploratory run found)."""
        world_size, rank = dist.get_world_size(), dist.get_rank()
        handles: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for members in all_groups(parallel, world_size).values():
            for ranks in members:
                if len(ranks) > 1 and ranks not in handles:
                    whole = len(ranks) == world_size
                    handles[ranks] = dist.group.WORLD if whole else dist.new_group(list(ranks), timeout=timeout)
        return cls._make(parallel, world_size, rank, handles, device)

    def describe(self) -> str:
        return " ".join(f"{k}={g.rank}/{g.size}" for k, g in self.groups.items())


def _default_device() -> torch.device:
    """CUDA when there is a GPU and the job is not a gloo (CPU) job; CPU otherwise."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if dist.is_initialized() and dist.get_backend() != "nccl":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def check_restarts_across_nodes() -> None:
    """torchrun --max-restarts across nodes on its shared store cannot restart us: the store keeps a failed
    attempt's keys (so each attempt's go under its restart count), and each node counts only its own workers'
    failures, so after one the nodes' counts differ and they never meet (an exploratory run: "Connection refused",
    or a silent hang). A store of its own per attempt (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, c10d rendezvous)
    needs no count. Refused before any collective, on every rank."""
    env = os.environ
    nodes, restarts = int(env.get("GROUP_WORLD_SIZE", "1")), int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and nodes > 1 and restarts > 0:
        raise ConfigError(
            f"torchrun --max-restarts {restarts} across {nodes} nodes on its shared rendezvous store: a restart "
            "would never meet (each node counts only its own failures, and the store keeps a failed attempt's "
            "keys); launch with --rdzv-backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every node's "
            "environment (a fresh store per attempt; pretrain/*multinode.sh set it), or --max-restarts 0"
        )


def attempt_id() -> str:
    """The restart attempt whose keys go apart in a store: torchrun's shared store outlives attempts (their keys
    go under the restart count, which multi-node restarts cannot use and are refused on); a store of its own per
    attempt, as TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 makes, holds one attempt's alone (nodes' counts differ there
    after a restart)."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if shared else "0"


def _attempt_store(timeout_s: float, connect_s: float | None = None):
    """Under torchrun, the launcher's store with keys of this restart attempt only. The store outlives a
    failed attempt, and the process-group keys are the same in every attempt: a restarted worker could
    read a dead peer's address before the peer rewrote it ("failed to connect ... Connection refused").
    None (the default env:// path) outside torchrun. `connect_s`: how long connecting may take, where less."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s if connect_s is None else connect_s),
        wait_for_workers=False,
    )
    client.set_timeout(timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"megatron_lite/attempt_{attempt_id()}", client)


def initialize(
    model: ModelConfig,
    parallel: ParallelConfig,
    training: TrainingConfig | None = None,
    *,
    backend: str | None = None,
    timeout_s: float = 600.0,
    start_timeout_s: float | None = None,
) -> ParallelContext:
    """The start-up path of every job: validate the whole layout first (so a bad configuration stops with
    one line on every rank and no collective is ever started), then join the default group (NCCL on
    CUDA, gloo on CPU) and build every group. Under torchrun the world comes from the environment."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    validate_layout(model, parallel, world_size, training)
    if world_size == 1 and not dist.is_initialized():
        return ParallelContext.virtual(parallel, 1, 0)
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        else:
            # Workers restarted by torchrun (--max-restarts) fail to form gloo's full mesh eagerly
            # ("connectFullMesh failed"); connecting pairs on first use works.
            os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
        check_restarts_across_nodes()
        from megatron_lite.start_up_error import job_store, wait_for_every_rank

        # (a start-up error on another node stops this one; `start_timeout_s`: the flag's own, where the backend's
        # is pushed back for the flight recorder: rank 0's store, where it serves one, was waited for that long)
        start_s = timeout_s if start_timeout_s is None else start_timeout_s
        store = job_store(timeout_s, host=rank == 0, connect_s=start_s)
        wait_for_every_rank(store, world_size, start_s)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s), store=store
        )
    return ParallelContext.build(parallel, timeout=timedelta(seconds=timeout_s))


# The device meshes FSDP2 was given over our groups (distributed/fsdp.py): see destroy_process_groups.
_MESHES: weakref.WeakSet = weakref.WeakSet()


def track_mesh(mesh):
    """Remember a device mesh made over this job's groups, so destroy_process_groups releases its groups."""
    _MESHES.add(mesh)
    return mesh


def destroy_process_groups() -> None:
    """Leave the job's world: destroy every process group (ours, DeviceMesh's and FSDP2's are all registered with
    c10d) and drop the references our device meshes hold to them. A mesh outlives the job in torch's DTensor
    caches (sharding propagation, mesh topology), and through it its groups' gloo backends, whose worker threads
    then lived into the interpreter's shutdown, where a gloo group left alive can abort the process after the job
    has finished ("terminate called without an active exception")."""
    if dist.is_initialized():
        dist.destroy_process_group()
    for mesh in list(_MESHES):
        registry = getattr(mesh, "_pg_registry", None)  # (torch >= 2.9 keeps a mesh's groups there)
        if isinstance(registry, dict):
            registry.clear()
    _MESHES.clear()
