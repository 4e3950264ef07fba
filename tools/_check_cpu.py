"""tools/plan_parallelism.py --check-cpu: a small Llama trained for real on this machine's cores, one
single-threaded process per rank, each layout's measured step time beside the cost model's."""

from __future__ import annotations

import argparse
import dataclasses

from megatron_lite.config import LLAMA_ARCHITECTURE, ModelConfig
from megatron_lite.planner.layout import Layout
from megatron_lite.planner.muon_cost import MuonSettings

CPU_MODEL = ModelConfig(
    num_layers=4,
    hidden_size=256,
    num_attention_heads=8,
    num_query_groups=4,
    ffn_hidden_size=704,
    vocab_size=2048,
    max_position_embeddings=256,
    untie_embeddings_and_output_weights=True,
    kernel_impl="torch",
    **LLAMA_ARCHITECTURE,
)
CPU_SEQ, CPU_GBS = 256, 8
CPU_LAYOUTS = [
    Layout(micro_batch_size=2),
    Layout(micro_batch_size=2, recompute="full"),
    Layout(dp=2, micro_batch_size=2),
    Layout(dp=2, micro_batch_size=2, sharding="dist-opt"),
    Layout(tp=2, micro_batch_size=2),
    Layout(tp=2, micro_batch_size=2, sequence_parallel=False),
    Layout(pp=2, micro_batch_size=1),
    Layout(cp=2, micro_batch_size=2),
    Layout(cp=2, micro_batch_size=2, cp_comm_type="a2a"),
]
# (layout, optimizer): Adam unless named. Muon's rows run its Newton-Schulz in fp32 (--muon-fp32-matmul-prec low):
# a CPU's bf16 matmul is another rate than the fp32 one measured
CPU_RUNS = [(layout, "adam") for layout in CPU_LAYOUTS] + [
    (Layout(micro_batch_size=2), "muon"),
    (Layout(dp=2, micro_batch_size=2, sharding="layer-wise"), "dist_muon"),
    (Layout(tp=2, micro_batch_size=2), "muon-distributed"),
]
CPU_MUON = MuonSettings(fp32_matmul_prec="low")


def _muon(optimizer: str) -> MuonSettings | None:
    """The Muon flags of a CPU run's optimizer ("muon-distributed": --muon-tp-mode distributed)."""
    name, _, mode = optimizer.partition("-")
    return None if name == "adam" else dataclasses.replace(CPU_MUON, tp_mode=mode or CPU_MUON.tp_mode)


def _describe(layout: Layout, optimizer: str) -> str:
    return layout.describe() + ("" if optimizer == "adam" else f" {optimizer}")


def _cpu_worker(rank: int, world: int, args, runs: list[tuple[Layout, str]], collectives: bool) -> dict:
    """Every run of this world size in turn (each built afresh on its own groups, one warm-up step), then,
    with `collectives`, gloo's latency and bandwidth between compute."""
    from megatron_lite.planner.hardware import measure_collectives
    from megatron_lite.planner.measure import measure_layout

    out = {
        "layouts": [
            measure_layout(
                CPU_MODEL, layout, CPU_SEQ, CPU_GBS, iters=args.iters, optimizer=o.partition("-")[0], muon=_muon(o)
            )
            for layout, o in runs
        ]
    }
    if collectives:
        out["collectives"] = measure_collectives()
    return out


def check_cpu(log=print, iters: int = 5, layouts: int | None = None) -> dict:
    """Each CPU run's measured step time beside the cost model's, as ratios to the first (the first `layouts` of
    them when given)."""
    import torch
    from _world import spawn  # tools/_world.py, beside this script

    from megatron_lite.planner.cost import step_time
    from megatron_lite.planner.hardware import cpu_cluster

    chosen = CPU_RUNS[:layouts] if layouts else CPU_RUNS
    # one world per world size (starting processes costs more than a small layout's steps), the collectives
    # measured on the 2-rank one
    sizes = sorted({layout.world for layout, _ in chosen} | {2})
    results, kinds = {}, {}
    for size in sizes:
        group = [run for run in chosen if run[0].world == size]
        args = argparse.Namespace(device="cpu", threads=size, iters=iters)
        out = spawn(_cpu_worker, size, args, group, size == 2)
        kinds.update({k: tuple(v) for k, v in out.get("collectives", {}).items()})
        for run, r in zip(group, out["layouts"]):
            results[run] = r
            log(
                f"  measured {_describe(*run):<44} {r['step_seconds']:.3f} s, "
                f"{r['comm_exposed_seconds']:.3f} s blocked in communication"
            )
    measured = [results[run]["step_seconds"] for run in chosen]
    torch.set_num_threads(1)
    cl = cpu_cluster(2, kinds)
    cpu = cl.gpu
    model = CPU_MODEL
    predicted = [
        step_time(layout.model_config(model), layout, CPU_SEQ, CPU_GBS, cl, bf16=False, muon=_muon(o)).total
        for layout, o in chosen
    ]
    log(
        f"CPU (one thread): matmul {cpu.peak_flops / 1e9:.0f} GFLOP/s, copy {cpu.memory_bandwidth / 1e9:.0f} GB/s, "
        f"{cpu.launch_seconds * 1e6:.1f} us per operator; gloo between compute: "
        + ", ".join(f"{k} {lat * 1e6:.0f} us + {bw / 1e9:.2f} GB/s" for k, (lat, bw) in kinds.items())
    )
    log(f"{'layout':<44} {'measured s':>10} {'predicted s':>11} {'measured':>9} {'predicted':>9} {'error':>6}")
    rows = []
    for run, m, p in zip(chosen, measured, predicted):
        rm, rp = m / measured[0], p / predicted[0]
        rows.append(
            {"layout": _describe(*run), "measured": m, "predicted": p, "ratio_measured": rm, "ratio_predicted": rp}
        )
        log(f"{_describe(*run):<44} {m:10.3f} {p:11.3f} {rm:9.2f} {rp:9.2f} {rp / rm - 1:6.0%}")
    return {"rows": rows, "cpu": dataclasses.asdict(cpu), "collectives": kinds}
