"""Every layout of a model on a cluster: the ones our validation refuses (with its reason), the ones that do
not fit in memory, and the rest ranked by the cost model's step time."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from megatron_lite.config import ConfigError, ModelConfig, divisors
from megatron_lite.layout_validation import validate_layout
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.planner.cost import StepTime, step_time, throughput
from megatron_lite.planner.hardware import GIB, Cluster
from megatron_lite.planner.layout import RECOMPUTES, SHARDINGS, Layout, searched_gather_overlap, searched_grad_overlap
from megatron_lite.planner.memory import Memory, peak_rank_memory
from megatron_lite.planner.muon_cost import MuonSettings

PRICED_CP = ("p2p", "a2a", "allgather")  # (not the hierarchical a2a+p2p)
PRECISIONS = ("bf16", "fp16", "fp32")  # --bf16, --fp16, neither
RESERVED_BYTES = 3 * GIB  # CUDA context, NCCL buffers
USABLE_FRACTION = 0.92  # the allocator's fragmentation and transient buffers


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    reason: str | None = None  # why it cannot run (validation or memory); None when it fits
    memory: Memory | None = None
    time: StepTime | None = None
    tokens_per_second: float = 0.0  # per GPU
    tflops: float = 0.0  # model TFLOP/s per GPU
    mfu: float = 0.0


def optimizer_config(
    layout: Layout, bf16: bool, grads_bf16: bool = False, optimizer: str = "adam", fp16: bool = False
) -> OptimizerConfig:
    """`optimizer`: adam, sgd, or adam-bf16 (Adam's moments in bf16, --use-precision-aware-optimizer); `fp16`:
    --fp16 instead of --bf16 (16-bit weights either way)."""
    optimizer, _, moments = optimizer.partition("-")
    return OptimizerConfig(
        optimizer=optimizer,
        use_precision_aware_optimizer=bool(moments),
        exp_avg_dtype=moments or "fp32",
        exp_avg_sq_dtype=moments or "fp32",
        bf16=bf16 and not fp16,
        fp16=fp16,
        grad_reduce_in_bf16=grads_bf16,
        use_distributed_optimizer=layout.sharding in ("dist-opt", "zero2"),
        zero_stage=2 if layout.sharding == "zero2" else 1,
        use_torch_fsdp2=layout.sharding == "fsdp2",
        overlap_param_gather=layout.overlaps_param_gather,
    )


def sharding_of(optim: OptimizerConfig) -> str:
    """The inverse of `optimizer_config`: which of SHARDINGS a job's optimizer flags select, or "layer-wise" for
    --optimizer dist_muon (its state split by whole tensors over data parallelism, gradients whole)."""
    if optim.optimizer == "dist_muon":
        return "layer-wise"
    if optim.use_torch_fsdp2:
        return "fsdp2"
    if optim.use_distributed_optimizer:
        return "zero2" if optim.zero_stage >= 2 else "dist-opt"
    return "none"


def check(
    model: ModelConfig, layout: Layout, seq_length: int, global_batch_size: int, precision: str = "bf16"
) -> str | None:
    """Our own start-up validation of this layout at `precision` (bf16, fp16 or fp32): its one-line error, or
    None."""
    if layout.cp > 1 and layout.cp_comm_type not in PRICED_CP:
        return f"the planner prices --cp-comm-type {', '.join(PRICED_CP)}, not {layout.cp_comm_type}"
    try:
        cfg = layout.model_config(model)  # validated as it is made
    except (ConfigError, ValueError) as e:
        return str(e)
    # (the checks are pure functions of frozen configs, most of which a search meets many times: DDP, ZeRO-1 and
    # ZeRO-2 share the layout check; it was a third of a 1024-GPU DeepSeek-V3 plan's time)
    parallel = _parallel(
        layout.tp, layout.pp, layout.vp, layout.cp, layout.ep, layout.sequence_parallel, layout.cp_comm_type,
        layout.microbatch_group_size, layout.stages, layout.etp,
    )  # fmt: skip
    training = _training(layout.micro_batch_size, global_batch_size, seq_length, layout.overlaps_grad_reduce)
    try:
        # (validated as it is made: FSDP2 refuses --fp16)
        _optimizer(layout.sharding, precision, layout.overlaps_param_gather)
    except ConfigError as e:
        return str(e)
    return _layout_error(cfg, parallel, layout.world, training)


@functools.lru_cache(maxsize=1 << 16)
def _parallel(tp, pp, vp, cp, ep, sequence_parallel, cp_comm_type, microbatch_group_size, stages, etp):
    return Layout(tp, pp, vp, 1, cp, ep, sequence_parallel=sequence_parallel, cp_comm_type=cp_comm_type,
                  microbatch_group_size=microbatch_group_size, stages=stages, etp=etp).parallel_config()  # fmt: skip


@functools.lru_cache(maxsize=1 << 10)
def _training(micro_batch_size: int, global_batch_size: int, seq_length: int, overlap: bool):
    training = Layout(micro_batch_size=micro_batch_size).training_config(global_batch_size, seq_length)
    return dataclasses.replace(training, overlap_grad_reduce=overlap)


@functools.lru_cache(maxsize=64)
def _optimizer(sharding: str, precision: str, overlap_param_gather: bool) -> OptimizerConfig:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
    layout = Layout(sharding=sharding, overlap_param_gather=overlap_param_gather)
    return optimizer_config(layout, precision != "fp32", fp16=precision == "fp16")


@functools.lru_cache(maxsize=1 << 16)
def _layout_error(cfg: ModelConfig, parallel, world: int, training) -> str | None:
    try:
        validate_layout(cfg, parallel, world, training)
    except (ConfigError, ValueError) as e:
        return str(e)
    return None


def uneven_stages(num_layers: int, stages: int) -> tuple[int, ...] | None:
    """Layers of `stages` virtual stages when they do not divide `num_layers`: as many as the largest share on each,
    one fewer on the end stages first (the first holds the embedding, the last the loss), then on their
    neighbours. None when the split is even, or would leave a middle stage empty."""
    if num_layers % stages == 0:
        return None
    base = -(-num_layers // stages)
    counts = [base] * stages
    order = [i for pair in zip(range(stages), reversed(range(stages))) for i in pair]
    for i in order[: base * stages - num_layers]:
        counts[i] -= 1
    return tuple(counts) if min(counts[1:-1] or [1]) > 0 else None


def layouts(
    model: ModelConfig,
    world: int,
    gpus_per_node: int,
    global_batch_size: int,
    uneven: bool = False,
    shardings: tuple[str, ...] = SHARDINGS,
) -> list[Layout]:
    """Every combination worth trying: TP inside a node (dividing its GPUs), CP and EP in powers of two, PP dividing the
    rest, 2 or 4 virtual stages with PP, each sharding and recomputation, micro-batches of 1 to 8 dividing each data-
    parallel rank's share of the batch (a DP size that does not divide it once per TP x CP x PP, refused); CP as the
    ring and as all-to-all (all-gather too for a sliding window, which the ring refuses). `uneven`: pipeline sizes whose
    stages the layers do not divide are tried with lighter end stages (`uneven_stages`). `shardings`: those tried
    (--optimizer dist_muon's "layer-wise" in place of DDP's "none")."""
    out = []
    pow2 = [1, 2, 4, 8, 16, 32]
    experts = divisors(model.num_experts) if model.num_experts else [1]
    # expert TP = TP (None), and under TP also 1: whole experts, spread over TP x DP ranks by EP (Megatron's usual
    # --expert-tensor-parallel-size 1 for fine-grained experts)
    cp_types = PRICED_CP if model.sliding_window is not None else PRICED_CP[:2]
    # (TP dividing the GPUs of a node: 4 on nodes of 6 put a group across two nodes, which an exploratory run found
    # priced as NVLink)
    for tp, cp in itertools.product([d for d in pow2 if gpus_per_node % d == 0], pow2):
        if world % (tp * cp):
            continue
        for pp in divisors(world // (tp * cp)):
            dp = world // (tp * cp * pp)
            if global_batch_size % dp:  # (tried once, so the plan says why this DP size is out)
                out.append(Layout(tp, pp, 1, dp, cp))
                continue
            etps = [None, 1] if model.num_experts and tp > 1 else [None]
            for vp, ep, etp, sharding, recompute, mbs in itertools.product(
                [1, 2, 4] if pp > 1 else [1], experts, etps, shardings, RECOMPUTES, [1, 2, 4, 8]
            ):
                if (dp * cp * tp) % ep or global_batch_size % (mbs * dp) or (etp and ep == 1):
                    continue  # (a micro-batch size that does not divide a rank's share is just not a choice)
                stages = uneven_stages(model.num_layers, pp * vp) if uneven and pp > 1 else None
                for comm in cp_types if cp > 1 else ("p2p",):
                    out.append(
                        Layout(
                            tp, pp, vp, dp, cp, ep, sharding, recompute, mbs, stages=stages, cp_comm_type=comm, etp=etp
                        )
                    )
    return out


def evaluate(
    model: ModelConfig,
    layout: Layout,
    seq_length: int,
    global_batch_size: int,
    cl: Cluster,
    precision: str = "bf16",
    tp_comm_overlap: bool = False,
    grads_bf16: bool = False,
    state_bytes: int = 8,
    muon: MuonSettings | None = None,
) -> Candidate:
    """`precision`: bf16, fp16 or fp32 (--bf16, --fp16, neither); `grads_bf16`: --grad-reduce-in-bf16;
    `state_bytes`: the optimizer's state per parameter (Adam 8, SGD 4); `muon`: --optimizer muon's or dist_muon's
    flags (their Newton-Schulz is priced)."""
    reason = check(model, layout, seq_length, global_batch_size, precision)
    if reason:
        return Candidate(layout, reason)
    bf16 = precision != "fp32"  # (the sizes: 16-bit weights and activations, either kind)
    cfg = layout.model_config(model)
    mem, reason = _memory(model, layout, seq_length, global_batch_size, cl, bf16, grads_bf16, state_bytes)
    if reason:
        return Candidate(layout, reason, mem)
    t = step_time(
        cfg,
        layout,
        seq_length,
        global_batch_size,
        cl,
        bf16,
        tp_comm_overlap and layout.sp,
        grads_bf16=grads_bf16,
        state_bytes=state_bytes,
        muon=muon,
    )
    tps, tflops, mfu = throughput(cfg, layout, seq_length, global_batch_size, t, cl, bf16)
    return Candidate(layout, None, mem, t, tps, tflops, mfu)


def _memory(
    model: ModelConfig, layout: Layout, seq_length: int, global_batch_size: int, cl: Cluster, bf16: bool,
    grads_bf16: bool, state_bytes: int,
) -> tuple[Memory, str | None]:  # fmt: skip
    """The busiest rank's memory, and why it does not fit (None when it does)."""
    cfg = layout.model_config(model)
    _, mem = peak_rank_memory(cfg, layout, seq_length, global_batch_size, bf16, grads_bf16, state_bytes)
    usable = cl.gpu.memory_bytes * USABLE_FRACTION - RESERVED_BYTES
    if mem.total <= usable:
        return mem, None
    # (as many decimals as tell the two apart: never "needs 70.6 GiB, more than the 70.6 GiB usable")
    digits = next((d for d in (1, 2, 3) if f"{mem.total / GIB:.{d}f}" != f"{usable / GIB:.{d}f}"), 4)
    return mem, f"needs {mem.total / GIB:.{digits}f} GiB per GPU, more than the {usable / GIB:.{digits}f} GiB usable"


def fewest_block_layers(
    model: ModelConfig, layout: Layout, seq_length: int, global_batch_size: int, cl: Cluster,
    precision: str = "bf16", grads_bf16: bool = False, state_bytes: int = 8, none_fits: bool | None = None,
) -> int | None:  # fmt: skip
    """For a layout that fits with full recomputation: the fewest layers of each model chunk that
    --recompute-method block can recompute and still fit (the rest keep their activations, and do not run
    twice). None where that is every layer (uniform 1 is as fast), or none (it fits without recomputation;
    `none_fits`: whether it does, where the caller knows)."""
    chunk = max(layout.stages) if layout.stages else model.num_layers // (layout.pp * layout.vp)
    bf16 = precision != "fp32"

    def fits(n: int) -> bool:  # (a chunk's memory falls as n grows: each layer recomputed keeps only its input)
        candidate = dataclasses.replace(layout, recompute="none") if n == 0 else _block(layout, n)
        return _memory(model, candidate, seq_length, global_batch_size, cl, bf16, grads_bf16, state_bytes)[1] is None

    if chunk < 2 or (none_fits if none_fits is not None else fits(0)):
        return None
    lo, hi = 0, chunk  # lo does not fit; hi (every layer: uniform 1's memory) does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi if hi < chunk else None


def _block(layout: Layout, n: int) -> Layout:
    return dataclasses.replace(layout, recompute="full", recompute_method="block", recompute_num_layers=n)


def plan(
    model: ModelConfig,
    cl: Cluster,
    seq_length: int,
    global_batch_size: int,
    precision: str = "bf16",
    tp_comm_overlap: bool = False,
    grads_bf16: bool = False,
    state_bytes: int = 8,
    uneven: bool = False,
    shardings: tuple[str, ...] = SHARDINGS,
    muon: MuonSettings | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[Candidate], list[Candidate]]:
    """(layouts that fit, fastest first; layouts refused or too big). `uneven`, `shardings`: see `layouts`;
    `muon`: see `evaluate`; `progress`: called as the search goes with (layouts costed, how many fit)."""
    fits, rejected = [], []
    unrecomputed: dict[Layout, bool] = {}  # whether each layout fits without recomputation (searched first)
    for i, layout in enumerate(layouts(model, cl.world, cl.gpus_per_node, global_batch_size, uneven, shardings)):
        if progress is not None and i % 256 == 0:
            progress(i, len(fits))
        c = evaluate(
            model, layout, seq_length, global_batch_size, cl, precision, tp_comm_overlap, grads_bf16, state_bytes, muon
        )
        (rejected if c.reason else fits).append(c)
        if layout.recompute == "none":
            unrecomputed[layout] = c.reason is None
        if c.reason is None and layout.recompute == "full":
            # recomputing fewer layers where memory allows: fewer forwards run twice (Megatron's block method)
            none_fits = unrecomputed.get(dataclasses.replace(layout, recompute="none"))
            n = fewest_block_layers(
                model, layout, seq_length, global_batch_size, cl, precision, grads_bf16, state_bytes, none_fits
            )
            if n is not None:
                partial = evaluate(
                    model, _block(layout, n), seq_length, global_batch_size, cl, precision, tp_comm_overlap,
                    grads_bf16, state_bytes, muon,
                )  # fmt: skip
                (rejected if partial.reason else fits).append(partial)
    fits.sort(key=lambda c: (c.time.total, c.memory.total))
    return fits, rejected


def job_layout(job, world: int) -> Layout:
    """The layout a parsed job runs with."""
    from megatron_lite.layout_validation import stage_layer_counts

    p, m = job.parallel, job.model
    sharding = sharding_of(job.optimizer)
    uneven = p.pipeline_layout is not None or p.decoder_first_pipeline_num_layers is not None
    uneven = uneven or p.decoder_last_pipeline_num_layers is not None
    uneven = uneven or p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split
    return Layout(
        stages=tuple(stage_layer_counts(m.num_layers, p)) if uneven else None,
        tp=p.tp,
        pp=p.pp,
        vp=p.vp,
        dp=p.data_parallel_size(world),
        cp=p.cp,
        ep=p.ep,
        # (None: the experts split as the dense layers; a dense model's flag, which Megatron ignores, too)
        etp=p.etp if p.etp != p.tp and m.num_experts else None,
        sharding=sharding,
        recompute=m.recompute_granularity or "none",
        recompute_method=(m.recompute_method or "uniform") if m.recompute_granularity == "full" else "uniform",
        recompute_num_layers=(m.recompute_num_layers or 1) if m.recompute_granularity == "full" else 1,
        micro_batch_size=job.training.micro_batch_size,
        sequence_parallel=p.sequence_parallel or p.tp == 1,  # (no SP at TP 1: the search's form of it)
        cp_comm_type=p.cp_comm_type if p.cp > 1 else "p2p",
        microbatch_group_size=p.microbatch_group_size if p.vp > 1 else None,
        # (None where the job does what the search plans)
        overlap_grad_reduce=_unless(job.training.overlap_grad_reduce, searched_grad_overlap(sharding)),
        overlap_param_gather=_unless(job.optimizer.overlap_param_gather, searched_gather_overlap(sharding)),
    )


def _unless(value: bool, default: bool) -> bool | None:
    return None if value == default else value
