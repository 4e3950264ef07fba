"""--optimizer muon's and dist_muon's Newton-Schulz, priced as optimizer/muon.py runs it: the GEMMs of every
matrix a rank orthogonalizes, the passes around them and, under --muon-tp-mode duplicated or distributed, their
tensor-parallel collectives (cost.step_time adds it to the optimizer step's memory traffic).

A Newton-Schulz run on X [m, n] (m the side A = X X^T spans) does, per --muon-num-ns-steps iteration,
A = X X^T (2 m^2 n FLOPs), B = b A + c A A (2 m^3) and X = a X + B X (2 m^2 n). Which runs a rank does:
  blockwise    each TP shard alone, the shorter side whitened (m = the shorter)
  duplicated   the matrix all-gathered (fp32) over TP, then the whole matrix on every TP rank
  distributed  this rank's shard, its columns the TP-split side (transposed first when rows are split), so A
               spans the unsplit side (longer or not); the Frobenius norm (a scalar) and each A all-reduced
               over TP
With --muon-split-qkv (the default) the fused QKV weight runs once per part (queries, gates, keys, values: each
part's rows of every local query group). Experts run over the expert TP group (the planner's: TP). Under
dist_muon each data-parallel rank runs only the whole tensors it owns (layer_wise_optimizer's split, as
planner/memory.py prices it) and the busiest rank's runs decide the time.

Precision (--muon-fp32-matmul-prec): medium (Megatron's default) casts X to bf16 for the iterations, as
emerging_optimizers does, so the GEMMs run at the bf16 tensor-core peak on 2-byte operands; high leaves X in
fp32 under torch's "high" matmul precision: TF32 tensor cores, half the bf16 peak on the A100, H100, H200 and
B200 datasheets; low keeps the process's precision, which pretrain leaves at torch's "highest": plain fp32 on
the CUDA cores (Accelerator.fp32_flops), 4-byte operands. A measured CPU runs every one at its measured rate."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from dataclasses import dataclass

from megatron_lite.config import ModelConfig
from megatron_lite.planner.hardware import Accelerator, Cluster
from megatron_lite.planner.layout import Layout
from megatron_lite.planner.memory import layer_wise_split_of
from megatron_lite.planner.params import Matrix, StageParams, _stage_groups, trained_tensors

# Bytes each element of a run's input moves outside the GEMMs: the Frobenius normalization (read for the norm,
# read and written by the division), the scale factor's multiply (read, write), and under medium the casts to
# bf16 and back (4 + 2 bytes each). (The momentum, weight decay and the update's add are the state traffic every
# optimizer step is priced with.)
NORMALIZE_BYTES, SCALE_BYTES, CAST_BYTES = 12, 8, 12
OPS_PER_RUN, OPS_PER_ITERATION = 6, 3  # operators launched: normalize, casts, scale; three GEMMs an iteration


@dataclass(frozen=True)
class MuonSettings:
    """The --muon-* flags that decide the Newton-Schulz work (Megatron's defaults)."""

    num_ns_steps: int = 5
    tp_mode: str = "blockwise"
    split_qkv: bool = True
    fp32_matmul_prec: str = "medium"

    @classmethod
    def of(cls, config) -> MuonSettings:
        """From an OptimizerConfig."""
        return cls(config.muon_num_ns_steps, config.muon_tp_mode, config.muon_split_qkv, config.muon_fp32_matmul_prec)


@dataclass(frozen=True)
class NewtonSchulz:
    """One Newton-Schulz run on one rank: X [m, n]; `tp` > 1: the norm and each A all-reduced over that many ranks
    (distributed); `gathered`: the elements all-gathered over `group` ranks (TP, or an expert's expert TP) before
    it (duplicated)."""

    m: int
    n: int
    tp: int = 1
    gathered: int = 0
    group: int = 1

    def flops(self, steps: int) -> int:
        m, n = self.m, self.n
        return steps * (4 * m * m * n + 2 * m**3)

    def collectives(self, steps: int, a: int) -> list[tuple[str, int]]:
        """(kind, bytes) of each TP collective, in order: the fp32 shards' all-gather (its output); the squared
        norm's all-reduce (fp32), then each iteration's A's, in X's precision (`a` bytes)."""
        gather = [("all_gather", 4 * self.gathered)] if self.gathered else []
        return gather + ([("all_reduce", 4)] + [("all_reduce", a * self.m**2)] * steps if self.tp > 1 else [])


def newton_schulz_runs(matrix: Matrix, tp: int, settings: MuonSettings) -> list[NewtonSchulz]:
    """The runs one rank does to orthogonalize `matrix` (its shard) under a TP group of `tp` ranks."""
    parts = [matrix.rows]
    if matrix.qkv is not None and settings.split_qkv:
        groups = matrix.rows // sum(matrix.qkv)
        parts = [groups * rows for rows in matrix.qkv]
    out = []
    for rows in parts:
        cols = matrix.cols
        if matrix.dim is None or tp == 1 or settings.tp_mode == "blockwise":
            out.append(NewtonSchulz(min(rows, cols), max(rows, cols)))
        elif settings.tp_mode == "duplicated":
            full = (rows * tp, cols) if matrix.dim == 0 else (rows, cols * tp)
            out.append(NewtonSchulz(min(full), max(full), gathered=rows * cols * tp, group=tp))
        else:  # distributed: X's columns are the split side
            m, n = (cols, rows) if matrix.dim == 0 else (rows, cols)
            out.append(NewtonSchulz(m, n, tp=tp))
    return out


@functools.lru_cache(maxsize=65536)
def _runs(matrix: Matrix, tp: int, settings: MuonSettings) -> tuple[NewtonSchulz, ...]:
    return tuple(newton_schulz_runs(matrix, tp, settings))


@functools.lru_cache(maxsize=4096)
def _rank_runs(model: ModelConfig, layout: Layout, pp_rank: int, bf16: bool, settings: MuonSettings):
    out = []
    if layout.sharding != "layer-wise":  # every rank steps every tensor it holds: each kind of layer once
        groups = _stage_groups(model, layout, pp_rank)[0]
        for expert in (False, True):
            counts = collections.Counter()
            for tensors, times in groups:
                for _, matrix, _ in (t for t in tensors if t[2] == expert and t[1] is not None):
                    for run in _runs(matrix, layout.expert_tp if expert else layout.tp, settings):
                        counts[run] += times
            if any(t[2] == expert for tensors, _ in groups for t in tensors):
                out.append((tuple(counts.items()),))
        return tuple(out)
    # dist_muon: the whole tensors each rank owns (memory.py's split, the runtime's)
    tensors = trained_tensors(model, layout, pp_rank)
    owners = layer_wise_split_of(model, layout, pp_rank, bf16).owners
    dp_cp = layout.dp * layout.cp
    present = [(e, r) for e, r in ((False, dp_cp), (True, layout.edp)) if any(t[2] == e for t in tensors)]
    for (expert, ranks), owner in zip(present, owners):
        matrices = [collections.Counter() for _ in range(ranks)]
        for (_, matrix, _), r in zip((t for t in tensors if t[2] == expert), owner):
            if matrix is not None:
                matrices[r][matrix] += 1
        ranks_runs = []
        for mine in matrices:
            counts = collections.Counter()
            for matrix, times in mine.items():
                for run in _runs(matrix, layout.expert_tp if expert else layout.tp, settings):
                    counts[run] += times
            ranks_runs.append(tuple(counts.items()))
        out.append(tuple(ranks_runs))
    return tuple(out)


def rank_runs(model: ModelConfig, layout: Layout, pp_rank: int, bf16: bool, settings: MuonSettings) -> tuple:
    """Per data-parallel group (dense, then experts, where the stage holds any), each rank's Newton-Schulz runs on
    pipeline stage `pp_rank` as ((run, count), ...): one rank a group unless dist_muon splits the tensors (`bf16`:
    its split weighs an fp32 main copy). Cached by what decides them: the parallel sizes (the data-parallel ones
    only for dist_muon's split), not the batch."""
    if layout.sharding == "layer-wise":
        sizes = (layout.tp, layout.pp, layout.vp, layout.dp, layout.cp, layout.ep, "layer-wise")
        key = Layout(*sizes, stages=layout.stages, etp=layout.etp)
    else:
        key, bf16 = layout.params_key(), False
    return _rank_runs(model, key, pp_rank, bf16, settings)


def busiest_flops(model: ModelConfig, layout: Layout, pp_rank: int, bf16: bool, settings: MuonSettings) -> int:
    """The Newton-Schulz GEMM FLOPs of the busiest rank of each group, summed (the step's optimizer FLOPs)."""
    steps = settings.num_ns_steps
    return sum(
        max(sum(run.flops(steps) * k for run, k in rank) for rank in group)
        for group in rank_runs(model, layout, pp_rank, bf16, settings)
    )


def ns_flops_per_second(gpu: Accelerator, prec: str) -> float:
    """The peak the Newton-Schulz GEMMs run against at --muon-fp32-matmul-prec `prec` (see the module's notes)."""
    if gpu.measured:
        return gpu.peak_flops
    if prec == "medium":
        return gpu.peak_flops
    if prec == "high":
        return gpu.peak_flops / 2
    return gpu.fp32_flops or gpu.peak_flops / 15


def muon_seconds(
    model: ModelConfig,
    layout: Layout,
    pp_rank: int,
    bf16: bool,
    settings: MuonSettings,
    cl: Cluster,
    eff,
    collective: Callable[..., float],
) -> float:
    """The busiest rank's Newton-Schulz time on pipeline stage `pp_rank` (each group's busiest rank, summed):
    its GEMMs at EFF.gemm of the precision's peak plus their operands at EFF.memory of the memory bandwidth
    (cost._gemm's form), the passes around them, the operators' launches, and under duplicated or distributed
    their TP collectives (`collective`: cost._collective), all exposed: each waits for the one before."""
    return _seconds_of(settings, cl, eff, collective)(rank_runs(model, layout, pp_rank, bf16, settings))


def _seconds_of(settings: MuonSettings, cl: Cluster, eff, collective: Callable[..., float]):
    """muon_seconds of a stage's rank_runs (one function for every stage of a layout: a run's time made once). A
    run's collectives go over its own group: TP's, or an expert's expert TP."""
    g, steps = cl.gpu, settings.num_ns_steps
    medium = settings.fp32_matmul_prec == "medium"
    a = 2 if medium else 4  # bytes of an operand of the iterations' GEMMs
    peak = ns_flops_per_second(g, settings.fp32_matmul_prec) * eff.gemm
    bandwidth = g.memory_bandwidth * eff.memory

    def gemm(m: int, k: int, n: int) -> float:
        return 2 * m * k * n / peak + a * (m * k + k * n + m * n) / bandwidth

    @functools.cache
    def seconds(run: NewtonSchulz) -> float:
        m, n = run.m, run.n
        t = steps * (gemm(m, n, m) + gemm(m, m, m) + gemm(m, m, n))
        t += m * n * (NORMALIZE_BYTES + SCALE_BYTES + (CAST_BYTES if medium else 0)) / bandwidth
        t += (OPS_PER_RUN + OPS_PER_ITERATION * steps) * g.launch_seconds
        size = max(run.tp, run.group)
        return t + sum(collective(kind, b, size, size, cl, eff) for kind, b in run.collectives(steps, a))

    def of(groups: tuple) -> float:
        return sum(max(sum(seconds(run) * k for run, k in rank) for rank in group) for group in groups)

    return of


def optimizer_seconds(
    model: ModelConfig,
    layout: Layout,
    stages: list[StageParams],
    bf16: bool,
    state_bytes: int,
    settings: MuonSettings | None,
    cl: Cluster,
    eff,
    collective: Callable[..., float],
) -> float:
    """The optimizer step's time (cost.step_time's): the slowest pipeline stage's, since every stage steps its own
    parameters and the step ends with the last (not the stage with the most compute: the first and last hold the
    vocabulary, a stage of uneven --decoder-*-pipeline-num-layers or of MoE layers more matrices). A stage's: its
    busiest rank's state traffic (read the gradient, read and write the state, write main weights and weights:
    12 + 2 x `state_bytes` a local parameter, 28 with Adam) at EFF.memory of the memory bandwidth, plus under
    muon (`settings`) the busiest rank's Newton-Schulz (muon_seconds); and 10 launches. Stages alike in what they
    step are priced once (a search prices thousands of layouts)."""
    g = cl.gpu
    dp_cp = layout.dp * layout.cp
    edp = layout.edp
    ns = _seconds_of(settings, cl, eff, collective) if settings is not None else None
    priced: dict[tuple, float] = {}
    for r, st in enumerate(stages):
        if layout.sharding == "layer-wise":  # (the busiest rank's whole tensors)
            local = layer_wise_split_of(model, layout, r, bf16).owned
        else:
            local = st.dense / dp_cp + st.expert / edp if layout.sharding != "none" else st.total
        runs = rank_runs(model, layout, r, bf16, settings) if ns is not None else ()
        if (local, runs) not in priced:
            t = (12 + 2 * state_bytes) * local / (g.memory_bandwidth * eff.memory)
            priced[local, runs] = t + (ns(runs) if ns is not None else 0.0)
    return max(priced.values()) + 10 * g.launch_seconds
