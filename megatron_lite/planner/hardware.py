"""Accelerators and clusters the planner knows: datasheet peaks, memory, and the links between GPUs."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.training.flops import PEAKS


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # dense bf16 tensor FLOP/s (fp32 on a CPU)
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    launch_seconds: float  # host cost of one operator (kernel launch, or a PyTorch op on a CPU)
    # True when peak_flops and memory_bandwidth were measured here (rates a real kernel achieved), not taken
    # from a datasheet: the cost model's efficiency factors, fractions of a datasheet peak, then do not apply.
    measured: bool = False
    mfu_peak_flops: float | None = None  # the peak MFU is reported against, where not peak_flops
    fp8_flops: float | None = None  # dense fp8 tensor FLOP/s (None: no fp8 tensor cores)
    fp32_flops: float | None = None  # plain fp32 FLOP/s off the tensor cores (Muon's Newton-Schulz at "low")

    @property
    def mfu_peak(self) -> float:
        return self.mfu_peak_flops or self.peak_flops

    @property
    def fp32_rate(self) -> float:
        """Plain fp32 FLOP/s off the tensor cores: what an fp32 run's matmuls reach (pretrain turns on no TF32);
        the training log's fp32 MFU peak first."""
        if self.measured:
            return self.peak_flops
        return next((f for key, _, f in PEAKS if key in self.name), self.fp32_flops or self.peak_flops / 15)

    def matmul_rate(self, a: int) -> float:
        """The peak a GEMM or attention of `a`-byte values runs against: the tensor cores' in bf16/fp16, the plain
        fp32 rate in fp32 (an exploratory run: fp32 plans were priced at the bf16 peak, 6x too fast, at 39% MFU)."""
        return self.peak_flops if a < 4 else self.fp32_rate


GIB = 2**30

# Datasheet figures (bf16 dense, HBM). torchtitan's H100s are the 96 GB HBM2e part at a 500 W limit
# (2.4 TB/s); its peak lies between SXM (989 T) and NVL (835 T), torchtitan says: we take the midpoint for
# timing, and MFU is reported against the SXM number, as they do.
# (fp8: the datasheets' dense figures, twice bf16's; the A100 has no fp8 tensor cores. fp32: the non-tensor
# figure, the 96 GB part's again the SXM/NVL midpoint, the B200's HGX B200's per GPU)
ACCELERATORS = {
    "H100": Accelerator("H100 SXM 80GB", 989.4e12, 3.35e12, 80 * GIB, 4e-6, fp8_flops=1978.9e12, fp32_flops=66.9e12),
    "H100-96GB": Accelerator(
        "H100 96GB HBM2e 500W",
        912e12,
        2.4e12,
        96 * GIB,
        4e-6,
        mfu_peak_flops=989.4e12,
        fp8_flops=1824e12,
        fp32_flops=63.4e12,
    ),
    "H200": Accelerator("H200 141GB", 989.4e12, 4.8e12, 141 * GIB, 4e-6, fp8_flops=1978.9e12, fp32_flops=66.9e12),
    "A100": Accelerator("A100 SXM 80GB", 312e12, 2.04e12, 80 * GIB, 4e-6, fp32_flops=19.5e12),
    "B200": Accelerator("B200 180GB", 2250e12, 8.0e12, 180 * GIB, 4e-6, fp8_flops=4500e12, fp32_flops=75e12),
}


@dataclass(frozen=True)
class Cluster:
    gpu: Accelerator
    gpus_per_node: int
    nodes: int
    nvlink_bandwidth: float  # bytes/s per GPU, one direction, inside a node
    network_bandwidth: float  # bytes/s per GPU between nodes
    link_latency: float = 10e-6  # seconds per collective step
    # measured {kind: (latency per step, achieved bandwidth)}; when given, used instead of the link figures
    collectives: dict[str, tuple[float, float]] | None = None

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def bandwidth(self, group_span: int, ranks_per_node: int = 1) -> float:
        """Bandwidth of a ring over ranks `group_span` consecutive ranks apart at most: NVLink while the
        group stays inside a node, else the network. A ring that holds `ranks_per_node` of its ranks in each
        node crosses the network through that many NICs at once (NCCL gives each channel its own NIC), so
        its pace is their sum, unless NVLink, which carries the other (r-1)/r of each rank's sends, is slower.
        (NCCL's multi-node ring on 8 x 400 Gb/s per node reaches 400-450 GB/s bus bandwidth.)"""
        if group_span <= self.gpus_per_node:
            return self.nvlink_bandwidth
        r = max(1, ranks_per_node)
        return 1.0 / max(1.0 / (r * self.network_bandwidth), (r - 1) / r / self.nvlink_bandwidth)


def cluster(gpu: str, gpus_per_node: int, nodes: int, nvlink_gbps: float | None, network_gbps: float | None) -> Cluster:
    """A cluster of a known GPU type; NVLink 450 GB/s (H100/H200 NVLink 4, one direction) and 50 GB/s
    (400 Gb/s InfiniBand per GPU) unless given."""
    if gpu not in ACCELERATORS:
        raise ValueError(f"--gpu {gpu} is not known; choose one of {sorted(ACCELERATORS)}")
    nv = nvlink_gbps if nvlink_gbps is not None else (300.0 if gpu == "A100" else 900.0 if gpu == "B200" else 450.0)
    net = network_gbps if network_gbps is not None else 50.0
    return Cluster(ACCELERATORS[gpu], gpus_per_node, nodes, nv * 1e9, net * 1e9)


def _best_of(fn, repeats: int = 5) -> float:
    import time

    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_cpu() -> Accelerator:
    """This CPU (at the current thread count) as the cost model sees an accelerator: fp32 matmul FLOP/s,
    copy bandwidth, and the cost of one autograd operator on a tiny tensor (what dominates small models)."""
    import torch

    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    flops = 2 * n**3 * 8 / _best_of(lambda: [a @ b for _ in range(8)])
    big = torch.empty(64 * 2**20 // 4)
    dst = torch.empty_like(big)
    bandwidth = 2 * big.numel() * 4 * 4 / _best_of(lambda: [dst.copy_(big) for _ in range(4)])
    x = torch.randn(8, 8, requires_grad=True)

    def tiny():
        for _ in range(50):
            (x * 2.0 + 1.0).sum().backward()  # 3 forward and 3 backward operators

    op = _best_of(tiny) / (50 * 6)
    mem = 8 * GIB
    try:
        import os

        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    return Accelerator("CPU (measured)", flops, bandwidth, mem, op, measured=True)


def measure_collectives(group=None, reps: int = 30) -> dict[str, tuple[float, float]]:
    """{kind: (latency s, bandwidth bytes/s)} of this process group's collectives, as the ring formulas of
    the cost model count them, each timed between bursts of compute as training interleaves them (a rank
    waking from a blocking wait costs more than a collective in a tight loop). Kinds: all_reduce,
    all_gather, reduce_scatter, p2p (a send/receive pair between neighbours)."""
    import time

    import torch
    import torch.distributed as dist

    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    a, b = torch.randn(128, 512), torch.randn(512, 512)

    def compute():
        for _ in range(4):
            a @ b

    def timed(fn) -> float:
        """Mean over `reps` of (compute + collective) minus the compute alone, alternated so drift in the
        machine's speed hits both."""
        compute()
        fn()
        spent = 0.0
        for _ in range(reps):
            dist.barrier(group)
            t0 = time.perf_counter()
            compute()
            t1 = time.perf_counter()
            dist.barrier(group)
            t2 = time.perf_counter()
            compute()
            fn()
            spent += time.perf_counter() - t2 - (t1 - t0)
        return spent / reps

    out = {}
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "p2p"):
        times = {}
        for numel in (1024, 2**20):  # 4 KiB and 4 MiB
            x = torch.zeros(numel)
            if kind == "all_reduce":
                fn = lambda x=x: dist.all_reduce(x, group=group)  # noqa: E731
            elif kind == "all_gather":
                fn = lambda x=x: dist.all_gather_into_tensor(torch.empty(n * x.numel()), x, group=group)  # noqa: E731
            elif kind == "reduce_scatter":
                fn = lambda x=x: dist.reduce_scatter_tensor(torch.empty(x.numel() // n), x, group=group)  # noqa: E731
            else:
                peer = dist.get_global_rank(group, (rank + 1) % n) if group is not None else (rank + 1) % n
                src = dist.get_global_rank(group, (rank - 1) % n) if group is not None else (rank - 1) % n

                def fn(x=x, peer=peer, src=src):
                    ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, torch.empty_like(x), src)]
                    for w in dist.batch_isend_irecv(ops):
                        w.wait()

            times[numel * 4] = max(timed(fn), 1e-7)
        (s1, t1), (s2, t2) = sorted(times.items())
        # the cost model charges a ring collective (n-1)/n * bytes / bandwidth (x2 for all-reduce)
        volume = {"all_reduce": 2 * (n - 1) / n, "p2p": 1.0}.get(kind, (n - 1) / n)
        # noise can make the small transfer look as slow as the large one: then charge it all to bandwidth
        bandwidth = volume * (s2 - s1) / (t2 - t1) if t2 > 2 * t1 else volume * s2 / t2
        steps = {"all_reduce": 2 * (n - 1), "p2p": 1}.get(kind, n - 1)
        out[kind] = (max(t1 - volume * s1 / bandwidth, 0.0) / steps, bandwidth)
    return out


def cpu_cluster(processes: int, collectives: dict[str, tuple[float, float]]) -> Cluster:
    """One machine running `processes` single-threaded ranks over gloo, its collectives as measured."""
    bw = collectives["all_reduce"][1]
    return Cluster(measure_cpu(), processes, 1, bw, bw, collectives["all_reduce"][0], collectives)
