"""Published training throughput the cost model is held against, with one global set of constants
(planner/cost.py): nothing here is tuned per row. Each row says where it comes from and what of its setup
had to be assumed.

torchtitan (docs/performance.md and benchmarks/llama3_h100_202412_torchtitan.md, H100 96GB HBM2e at
500 W, 8 per node, 400 Gb/s per GPU between nodes; Llama 3.1 8B / 3 70B, bf16, sequence 8192 from the
Llama-3 8B train config of the time): Table 1 and 3 rows without torch.compile are eager PyTorch (our
--kernel-impl torch prices that: unfused norms, RoPE and activations); those with torch.compile (not
Float8), and the async-TP benchmark's bf16 "vanilla TP" rows, which also ran compiled, are priced with
compile's fusion, like our fused kernels. torchtitan's selective checkpointing is its per-op policy (every
other matmul and all elementwise ops recomputed).

Megatron-Core weak scaling (README, H100 SXM, sequence 4096, vocabulary 131072, GPT with 4h GELU MLP and
full multi-head attention, data-parallel 48, --overlap-grad-reduce --overlap-param-gather
--tp-comm-overlap, distributed optimizer): the table is an image; the dimensions and batch sizes of the
1.7B, 16B and 70B rows come from a user's transcription of it (Megatron-LM issue #1571), the 177B row is
GPT-3 175B's dimensions with the strong-scaling batch of 1152. Micro-batch 1 is assumed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_lite.config import LLAMA_ARCHITECTURE, ModelConfig
from megatron_lite.planner.cost import IMPLEMENTATIONS, step_time, throughput
from megatron_lite.planner.hardware import cluster
from megatron_lite.planner.layout import Layout


@dataclass(frozen=True)
class Published:
    source: str
    label: str
    model: ModelConfig
    layout: Layout
    seq_length: int
    global_batch_size: int
    gpu: str
    nodes: int
    metric: str  # "tokens/s/GPU" or "TFLOP/s/GPU"
    value: float
    implementation: str  # a key of planner.cost.IMPLEMENTATIONS
    tp_comm_overlap: bool = False


def llama3(layers: int, hidden: int, heads: int, ffn: int, impl: str) -> ModelConfig:
    return ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=8,
        ffn_hidden_size=ffn,
        vocab_size=128256,
        max_position_embeddings=8192,
        untie_embeddings_and_output_weights=True,
        kernel_impl=impl,
        **LLAMA_ARCHITECTURE,
    )


def megatron_gpt(layers: int, hidden: int, heads: int) -> ModelConfig:
    return ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        vocab_size=131072,
        max_position_embeddings=4096,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
        hidden_dropout=0.1,
        attention_dropout=0.0,
        kernel_impl="triton",  # Transformer Engine's fused kernels
    )


L8_EAGER = llama3(32, 4096, 32, 14336, "torch")
L8_FUSED = llama3(32, 4096, 32, 14336, "triton")
L70_FUSED = llama3(80, 8192, 64, 28672, "triton")
TT, MC = "torchtitan", "Megatron-Core"


def _tt(label: str, model: ModelConfig, layout: Layout, gbs: int, nodes: int, tps: float, impl: str) -> Published:
    return Published(TT, label, model, layout, 8192, gbs, "H100-96GB", nodes, "tokens/s/GPU", tps, impl)


def _mc(label: str, model: ModelConfig, layout: Layout, gbs: int, nodes: int, tflops: float) -> Published:
    return Published(
        MC, label, model, layout, 4096, gbs, "H100", nodes, "TFLOP/s/GPU", tflops, "transformer-engine", True
    )


def _fsdp(dp: int, recompute: str, mbs: int, tp: int = 1) -> Layout:
    return Layout(tp=tp, dp=dp, sharding="fsdp2", recompute=recompute, micro_batch_size=mbs)


def _zero1(dp: int, tp: int = 1, pp: int = 1) -> Layout:
    return Layout(tp=tp, pp=pp, dp=dp, sharding="dist-opt")


ROWS = [
    _tt("Llama 3.1 8B, 8 GPUs, FSDP, eager (Table 1)", L8_EAGER, _fsdp(8, "op", 2), 16, 1, 5762, "torch"),
    _tt("Llama 3.1 8B, 128 GPUs, FSDP, eager (Table 3)", L8_EAGER, _fsdp(128, "op", 2), 256, 16, 5605, "torch"),
    _tt("Llama 3.1 8B, 8 GPUs, FSDP, compiled (Table 1)", L8_FUSED, _fsdp(8, "op", 2), 16, 1, 6667,
        "torch-compile"),
    _tt("Llama 3.1 8B, 128 GPUs, FSDP, compiled (Table 3)", L8_FUSED, _fsdp(128, "op", 2), 256, 16, 6514,
        "torch-compile"),
    _tt("Llama 3.1 8B, 64 GPUs, FSDP 8 x TP 8, compiled (async-TP bench, vanilla TP)", L8_FUSED,
        _fsdp(8, "op", 12, tp=8), 96, 8, 4378, "torch-compile"),
    _tt("Llama 3 70B, 256 GPUs, FSDP 32 x TP 8, compiled, full AC (async-TP bench, vanilla TP)", L70_FUSED,
        _fsdp(32, "full", 16, tp=8), 512, 32, 597, "torch-compile"),
    _mc("GPT 1.7B (24 x 2048), TP1 PP1, 48 GPUs", megatron_gpt(24, 2048, 16), _zero1(48), 3840, 6, 408.8),
    _mc("GPT 16B (32 x 6144), TP4 PP1, 192 GPUs", megatron_gpt(32, 6144, 48), _zero1(48, 4), 960, 24, 489.1),
    _mc("GPT 70B (84 x 8192), TP8 PP2, 768 GPUs", megatron_gpt(84, 8192, 64), _zero1(48, 8, 2), 384, 96, 419.7),
    _mc("GPT 177B (96 x 12288), TP8 PP6, 2304 GPUs", megatron_gpt(96, 12288, 96), _zero1(48, 8, 6), 1152, 288, 432.8),
]  # fmt: skip


def predict(row: Published) -> float:
    cl = cluster(row.gpu, 8, row.nodes, None, None)
    impl = IMPLEMENTATIONS[row.implementation]
    t = step_time(
        row.model, row.layout, row.seq_length, row.global_batch_size, cl, True, row.tp_comm_overlap, impl=impl
    )
    tps, tflops, _ = throughput(row.model, row.layout, row.seq_length, row.global_batch_size, t, cl)
    return tps if row.metric == "tokens/s/GPU" else tflops


def _order(values: list[float]) -> list[int]:
    return sorted(range(len(values)), key=lambda i: -values[i])


def recommend(row: Published):
    """The planner's best layout for the row's model, cluster, sequence and batch, run by megatron_lite with
    its Triton kernels (a Candidate), or None when nothing fits."""
    from megatron_lite.planner.search import plan

    cl = cluster(row.gpu, 8, row.nodes, None, None)
    model = dataclasses.replace(row.model, kernel_impl="triton")
    fits, _ = plan(model, cl, row.seq_length, row.global_batch_size, "bf16", row.tp_comm_overlap)
    return fits[0] if fits else None


def compare(log=print, recommendations: bool = True) -> dict:
    """Each row's prediction beside its published value; per source, whether the rows keep their order."""
    out = {"rows": [], "order_kept": {}}
    log(f"{'source':<14} {'run':<88} {'metric':<13} {'published':>9} {'predicted':>9} {'ratio':>6}")
    for source in (TT, MC):
        rows = [r for r in ROWS if r.source == source]
        preds = [predict(r) for r in rows]
        for r, pred in zip(rows, preds):
            log(f"{source:<14} {r.label:<88} {r.metric:<13} {r.value:9.1f} {pred:9.1f} {pred / r.value:6.2f}")
            out["rows"].append({"source": source, "label": r.label, "published": r.value, "predicted": pred})
        kept = _order(preds) == _order([r.value for r in rows])
        out["order_kept"][source] = kept
        log(f"{source}: the published order of the rows is {'kept' if kept else 'NOT kept'}")
    if recommendations:
        log("\nThe planner's top layout for each published model, cluster and batch (megatron_lite, Triton kernels):")
        out["recommendations"] = []
        seen = set()
        for r in ROWS:
            # eager and compiled rows of one model, cluster and batch share a recommendation
            key = (
                dataclasses.replace(r.model, kernel_impl="triton"),
                r.gpu,
                r.nodes,
                r.seq_length,
                r.global_batch_size,
            )
            if key in seen:
                continue
            seen.add(key)
            best = recommend(r)
            unit = r.metric.split("/")[0]
            value = (best.tokens_per_second if unit == "tokens" else best.tflops) if best else 0.0
            log(f"  {r.label}\n    published: {r.layout.describe()}  {r.value:.1f} {r.metric}")
            log(
                f"    planner:   {best.layout.describe() if best else 'nothing fits'}  {value:.1f} {r.metric} predicted"
            )
            out["recommendations"].append(
                {
                    "label": r.label,
                    "published": r.layout.describe(),
                    "planner": best.layout.describe(),
                    "predicted": value,
                }
            )
    return out
