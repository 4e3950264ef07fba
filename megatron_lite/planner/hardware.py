"""Accelerators and clusters the planner knows: datasheet peaks, memory, and the links between GPUs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # dense bf16 tensor FLOP/s (fp32 on a CPU)
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    launch_seconds: float  # host cost of one operator (kernel launch, or a PyTorch op on a CPU)


GIB = 2**30

# Datasheet figures (bf16 dense, HBM). torchtitan's H100s are the 96 GB HBM2e part at a 500 W limit
# (2.4 TB/s); its peak lies between SXM (989 T) and NVL (835 T), torchtitan says: we take the midpoint for
# timing, and MFU is reported against the SXM number, as they do.
ACCELERATORS = {
    "H100": Accelerator("H100 SXM 80GB", 989.4e12, 3.35e12, 80 * GIB, 4e-6),
    "H100-96GB": Accelerator("H100 96GB HBM2e 500W", 912e12, 2.4e12, 96 * GIB, 4e-6),
    "H200": Accelerator("H200 141GB", 989.4e12, 4.8e12, 141 * GIB, 4e-6),
    "A100": Accelerator("A100 SXM 80GB", 312e12, 2.04e12, 80 * GIB, 4e-6),
    "B200": Accelerator("B200 180GB", 2250e12, 8.0e12, 180 * GIB, 4e-6),
}


@dataclass(frozen=True)
class Cluster:
    gpu: Accelerator
    gpus_per_node: int
    nodes: int
    nvlink_bandwidth: float  # bytes/s per GPU, one direction, inside a node
    network_bandwidth: float  # bytes/s per GPU between nodes
    link_latency: float = 10e-6  # seconds per collective step

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def bandwidth(self, group_span: int) -> float:
        """Bandwidth of a ring over ranks `group_span` consecutive ranks apart at most: NVLink while the
        group stays inside a node, else the network (each GPU's own NIC sets a ring's pace)."""
        return self.nvlink_bandwidth if group_span <= self.gpus_per_node else self.network_bandwidth


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
    return Accelerator("CPU (measured)", flops, bandwidth, mem, op)


def measure_link(group=None) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of the process group's all-reduce, as the ring model counts them."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size(group)
    small, large = torch.zeros(1), torch.zeros(2**20)  # 4 MiB

    def reduce(t):
        return lambda: [dist.all_reduce(t, group=group) for _ in range(5)]

    t_small = _best_of(reduce(small)) / 5
    t_large = _best_of(reduce(large)) / 5
    steps = 2 * (n - 1)
    latency = t_small / steps
    bandwidth = 2 * (n - 1) / n * large.numel() * 4 / max(t_large - t_small, 1e-9)
    return bandwidth, latency


def cpu_cluster(processes: int, link_bandwidth: float, link_latency: float) -> Cluster:
    """One machine running `processes` single-threaded ranks over gloo."""
    return Cluster(measure_cpu(), processes, 1, link_bandwidth, link_bandwidth, link_latency)
