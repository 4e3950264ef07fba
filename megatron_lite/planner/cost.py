"""Step time of a layout from a cost model: one global set of efficiency constants, nothing per model.

Per micro-batch and pipeline stage, each transformer layer costs (forward + backward = 3x the forward's
GEMMs; +1 forward per recomputed part):
  GEMMs        2 m k n FLOPs at EFF.gemm of the peak, plus moving their operands at EFF.memory of the memory
               bandwidth (the second term is what makes narrow models slower per FLOP)
  attention    the causal half of q.k^T and p.v (forward 2 s q per token, backward 2.5x) at EFF.attention
  elementwise  norms, RoPE, activation, residuals and dropout: ELEMENTWISE_PASSES reads/writes of the
               hidden state per layer at EFF.memory of the memory bandwidth
  launches     the implementation's operators per layer, each costing the accelerator's launch time
  TP           sequence parallelism: 4 all-gathers + 4 reduce-scatters of the layer's activations
               (all-reduces without SP), exposed unless --tp-comm-overlap hides EFF.tp_overlap of them
  CP           ring attention passes K and V around the ring under the attention compute; all-to-all
               (a2a) trades sequence for heads of q, k, v and back for the output, exposed; all-gather
               gathers K and V and reduce-scatters their gradients, exposed
  EP           two all-to-alls forward, two backward, of each token's top-k copies
A hybrid model's Mamba layer: in_proj and out_proj as GEMMs, the scan at the fp32 rate, what it saves moved
through memory, its own launches, one part's TP collectives (_mixer_terms, planner/hybrid.py).
Then: the pipeline bubble (p - 1) / (v m) of the compute, p2p sends, the data-parallel gradient reduction
(and parameter all-gather for ZeRO/FSDP) exposed beyond the backward it overlaps, and the optimizer step
(memory-bound; --optimizer muon and dist_muon add their Newton-Schulz GEMMs: planner/muon_cost.py).
Collectives run over NVLink while their group stays inside a node, else the network, at EFF.comm of the link's
bandwidth."""

from __future__ import annotations

import collections
import dataclasses
import functools
from dataclasses import dataclass

from megatron_lite.config import ModelConfig
from megatron_lite.models.heterogeneous import LINEAR, NO_OP, NORMAL, BlockConfig
from megatron_lite.planner.hardware import Cluster
from megatron_lite.planner.hybrid import (
    MAMBA_MIXER,
    layer_block,
    mixer_activation_bytes,
    mixer_dims,
    mixer_ops,
    scan_flops,
)
from megatron_lite.planner.layout import Layout
from megatron_lite.planner.memory import full_recompute_runs, layer_wise_split_of
from megatron_lite.planner.muon_cost import MuonSettings, optimizer_seconds
from megatron_lite.planner.params import layer_params, stage_params
from megatron_lite.planner.precision import fp8_layer
from megatron_lite.planner.schedule import schedule_marks
from megatron_lite.training.flops import flops_per_token


@dataclass(frozen=True)
class Efficiency:
    gemm: float = 0.60  # of peak FLOP/s
    attention: float = 0.50
    memory: float = 0.70  # of memory bandwidth
    comm: float = 0.75  # of link bandwidth
    tp_overlap: float = 0.95  # share of TP communication hidden with --tp-comm-overlap
    dp_overlap: float = 1.0  # share of the backward the gradient reduction can hide under
    contention: float = 0.1  # communication hidden under compute still slows it by this share of its time


EFF = Efficiency()


@dataclass(frozen=True)
class Implementation:
    """What the software fuses, which sets how often activations cross memory outside the GEMMs."""

    fused_elementwise: bool  # norms, RoPE, activations as single kernels (ours, Transformer Engine, compile)
    fused_cross_entropy: bool  # logits consumed in chunks by the loss kernel (ours), else materialised
    ops_per_layer: int  # operators launched per layer, forward and backward


IMPLEMENTATIONS = {
    "triton": Implementation(True, True, 40),  # our kernels
    "torch": Implementation(False, False, 150),  # eager PyTorch (ours with --kernel-impl torch, torchtitan)
    "transformer-engine": Implementation(True, False, 50),  # Megatron-Core with TE
    "torch-compile": Implementation(True, False, 40),
}
CE_BYTES = {True: 16, False: 40}  # bytes moved per logit, forward and backward (fused chunks / eager fp32 CE)


def elementwise_values(
    model: ModelConfig, tp: int, sp: bool, impl: Implementation, attention: str = NORMAL, mlp: str = NORMAL
) -> float:
    """Values read and written per token by one layer's forward outside GEMMs and attention (the backward
    moves about twice as many). Fused kernels (ours, Transformer Engine, torch.compile) read and write each
    tensor once per op; eager PyTorch runs every step of a norm, RoPE or activation as its own kernel, with
    fp32 upcasts in the norms. `attention`, `mlp`: a heterogeneous layer's parts (a no-op has no norm and no
    residual; only normal attention has RoPE, only a normal MLP an activation)."""
    h, d = model.hidden_size, model.head_dim
    parts = (attention != NO_OP) + (mlp != NO_OP)
    q, kv = model.num_attention_heads * d, model.query_groups * d
    f = model.ffn_size if not model.num_experts else model.moe_ffn_size * model.moe_router_topk
    f = f if mlp == NORMAL else 0
    swiglu = model.gated_linear_unit
    rope = model.position_embedding_type == "rope" and attention == NORMAL
    norm_div = tp if sp else 1
    if impl.fused_elementwise:
        norms = parts * 3 * h  # read x (+ residual), write y (+ sum)
        act = 3 * f / tp if swiglu else 2 * f / tp
        rot = 2 * (q + kv) / tp if rope else 0
        residual = parts / 2 * (3 * h + (2 * h if model.hidden_dropout else 0))
        return norms / norm_div + act + rot + residual / norm_div
    norms = parts * 14 * h  # upcast, square, mean, rsqrt, scale, downcast, weight (fp32 steps count double)
    act = 5 * f / tp if swiglu else 4 * f / tp
    rot = 10 * (q + kv) / tp if rope else 0
    # [s, b, heads, d] <-> [b, heads, s, d] around attention
    layout_copies = 4 * (2 * q + 2 * kv) / tp if attention == NORMAL else 0
    residual = parts / 2 * (6 * h + (4 * h if model.hidden_dropout else 0))
    return norms / norm_div + act + rot + layout_copies + residual / norm_div


@dataclass(frozen=True)
class StepTime:
    compute: float  # all micro-batches through the busiest stage, recomputation included
    tp_comm: float
    cp_comm: float
    ep_comm: float
    bubble: float
    pp_comm: float
    dp_comm: float  # exposed part
    optimizer: float

    @property
    def total(self) -> float:
        return (
            self.compute + self.tp_comm + self.cp_comm + self.ep_comm + self.bubble + self.pp_comm + self.dp_comm
        ) + self.optimizer


def _mla_gemms(model: ModelConfig, m: float, tp: int, a: int, cl: Cluster, eff: Efficiency, fp8=None) -> float:
    """Multi-latent attention's projections: down-projections split over TP by their latent rows, up-projections
    and the output projection by heads."""
    h, heads, qd, r = model.hidden_size, model.num_attention_heads, model.mla_q_head_dim, model.q_lora_rank
    if r is None:
        t = _gemm(m, h, heads * qd / tp, a, cl, eff, fp8=fp8)
    else:
        t = _gemm(m, h, r / tp, a, cl, eff, fp8=fp8) + _gemm(m, r, heads * qd / tp, a, cl, eff, fp8=fp8)
    t += _gemm(m, h, (model.kv_lora_rank + model.qk_pos_emb_head_dim) / tp, a, cl, eff, fp8=fp8)
    t += _gemm(m, model.kv_lora_rank, heads * (model.qk_head_dim + model.v_head_dim) / tp, a, cl, eff, fp8=fp8)
    return t + _gemm(m, heads * model.v_head_dim / tp, h, a, cl, eff, fp8=fp8)


def _gemm(
    m: float, k: float, n: float, a: int, cl: Cluster, eff: Efficiency, weights: int = 1, fp8: str | None = None
) -> float:
    """An m x k by k x n GEMM; `weights` > 1: a grouped GEMM whose m rows are split over that many k x n weight
    matrices (this rank's experts), each read, so fewer experts a rank (more EP) move fewer bytes. `fp8`
    ("fp8", or "dgrad" under --no-fp8-wgrad, whose weight-gradient GEMM, a third of the 3x, is not): at the
    accelerator's fp8 peak, its operands 1 byte a value, plus quantizing the input (read, and written in fp8);
    priced as bf16 where there are no fp8 tensor cores (the planner warns)."""
    g = cl.gpu
    moved = m * k + weights * k * n + m * n
    t = 2 * m * k * n / (g.matmul_rate(a) * eff.gemm) + a * moved / (g.memory_bandwidth * eff.memory)
    if fp8 is None or not g.fp8_flops:
        return t
    moved = m * k + weights * k * n + a * m * n + (a + 1) * m * k
    t8 = 2 * m * k * n / (g.fp8_flops * eff.gemm) + moved / (g.memory_bandwidth * eff.memory)
    return t8 if fp8 == "fp8" else (2 * t8 + t) / 3


def _mixer_terms(
    model: ModelConfig, layout: Layout, m: float, a: int, cl: Cluster, eff: Efficiency, impl: Implementation
) -> tuple[float, float, float, float, float]:
    """A Mamba layer's forward as layer_terms gives a layer's: in_proj and out_proj (this rank's heads and groups),
    the FLOPs the chunked scan executes (planner/hybrid.py's scan_flops, not Megatron's 7 d N that the FLOPs
    counter and MFU keep) at the accelerator's fp32 rate (models/mamba.py scans in fp32 PyTorch, no TF32), the
    traffic of writing and reading what the mixer saves plus its norm and residual, and its PyTorch operators'
    launches (planner/hybrid.py)."""
    g, tp, h, seq = cl.gpu, layout.tp, model.hidden_size, m / layout.micro_batch_size
    d, gn, heads, _ = mixer_dims(model, tp)
    gemms = _gemm(m, h, 2 * d + 2 * gn + heads, a, cl, eff) + _gemm(m, d, h, a, cl, eff)
    scan = m * scan_flops(model, int(seq)) / tp / (g.fp32_rate * eff.attention)
    moved = elementwise_values(model, tp, layout.sp, impl, MAMBA_MIXER, NO_OP) * a
    moved += 2 * mixer_activation_bytes(model, tp, a, int(seq), layout.micro_batch_size)
    elem = m * moved / (g.memory_bandwidth * eff.memory)
    return gemms + scan, 0.0, 0.0, elem, mixer_ops(int(seq)) / impl.ops_per_layer


RINGS = ("all_reduce", "all_gather", "reduce_scatter")


@functools.lru_cache(maxsize=4096)
def _ranks_per_node(size: int, span: int, gpus_per_node: int) -> int:
    """Ranks of a group of `size` ranks `span // size` apart in its least-filled node (a group that does not
    fill whole nodes, e.g. DP 12 over nodes of 8, has a node with only 4 of them)."""
    stride = max(1, span // size)
    if stride >= gpus_per_node:
        return 1
    if span % gpus_per_node == 0 and gpus_per_node % stride == 0:
        return min(size, gpus_per_node // stride)
    return min(collections.Counter(i * stride // gpus_per_node for i in range(size)).values())


def _collective(kind: str, bytes_: float, size: int, span: int, cl: Cluster, eff: Efficiency) -> float:
    """A collective over `size` ranks at most `span` ranks apart, as a ring: all-gather and reduce-scatter
    move (n-1)/n of the tensor, an all-reduce twice that, p2p (and all-to-all) the tensor once. Measured
    collectives (a CPU's gloo) use their own latency and bandwidth; else the link's at EFF.comm."""
    if size <= 1 or bytes_ <= 0:
        return 0.0
    volume = {"all_reduce": 2 * (size - 1) / size, "p2p": 1.0}.get(kind, (size - 1) / size)
    steps = {"all_reduce": 2 * (size - 1), "p2p": 1}.get(kind, size - 1)
    measured = cl.collectives or {}
    if kind in measured or (kind == "all_to_all" and "all_gather" in measured):
        latency, bandwidth = measured[kind if kind in measured else "all_gather"]
    else:
        # a ring collective crosses nodes through as many NICs as the group's least-filled node holds ranks
        # (all-to-all and p2p send each rank's own data through its own NIC, so they get one)
        per_node = _ranks_per_node(size, span, cl.gpus_per_node) if kind in RINGS else 1
        latency, bandwidth = cl.link_latency, cl.bandwidth(span, per_node) * eff.comm
    return volume * bytes_ / bandwidth + steps * latency


def _chunk_seconds(layout: Layout, per_mb: float, eff: Efficiency) -> tuple[float, float]:
    """A chunk's forward and backward of one micro-batch (1 : 2 of its time); overlap stretches what the link
    can use."""
    return per_mb / 3 / layout.vp * eff.dp_overlap, 2 * per_mb / 3 / layout.vp * eff.dp_overlap


def _exposed_reduction(layout: Layout, micro: int, per_mb: float, seconds: float, eff: Efficiency) -> float:
    """The step's gradient reduction past the end of the backward: each chunk's buckets (1/VP of it) go out
    from the start of that chunk's last backward (DDP.final_grads), one chunk after another on the link."""
    f, b = _chunk_seconds(layout, per_mb, eff)
    last_backward, _, (nf, nb) = schedule_marks(layout.pp, layout.vp, micro, layout.microbatch_group_size)
    free = 0.0
    for ready in sorted(i * f + j * b for i, j in last_backward):
        free = max(free, ready) + seconds / layout.vp
    return max(0.0, free - (nf * f + nb * b))


def _exposed_gather(layout: Layout, micro: int, per_mb: float, seconds: float, eff: Efficiency) -> float:
    """--overlap-param-gather: the updated weights' all-gathers go out at the step's start, chunk by chunk;
    each chunk waits for its own before its first forward ends."""
    if seconds <= 0:
        return 0.0
    f, b = _chunk_seconds(layout, per_mb, eff)
    _, first_forward, _ = schedule_marks(layout.pp, layout.vp, micro, layout.microbatch_group_size)
    done, stall = 0.0, 0.0
    for need in sorted(i * f + j * b for i, j in first_forward):
        done += seconds / layout.vp
        stall = max(stall, done - need)
    return stall


def step_time(
    model: ModelConfig,
    layout: Layout,
    seq_length: int,
    global_batch_size: int,
    cl: Cluster,
    bf16: bool = True,
    tp_comm_overlap: bool = False,
    eff: Efficiency = EFF,
    impl: Implementation | None = None,
    grads_bf16: bool = False,
    state_bytes: int = 8,
    muon: MuonSettings | None = None,
) -> StepTime:
    """`impl`: what runs the model (default: what its --kernel-impl selects in megatron_lite); `grads_bf16`:
    --grad-reduce-in-bf16 (gradients reduced in bf16, half the bytes); `state_bytes`: the optimizer's state per
    parameter (Adam 8, SGD with momentum 4); `muon`: --optimizer muon's or dist_muon's flags (its Newton-Schulz
    priced on top of the state's traffic)."""
    impl = impl or IMPLEMENTATIONS[model.kernel_impl]
    if cl.gpu.measured:  # a measured rate already is what a GEMM or a copy achieves: no datasheet discount on it
        eff = dataclasses.replace(eff, gemm=1.0, attention=1.0, memory=1.0)
    a = 2 if bf16 else 4
    h, d = model.hidden_size, model.head_dim
    q = model.num_attention_heads * d
    tp, cp, pp, vp, ep = layout.tp, layout.cp, layout.pp, layout.vp, layout.ep
    m = layout.micro_batch_size * seq_length / cp  # tokens of a micro-batch on this rank
    swiglu = model.gated_linear_unit
    g = cl.gpu

    def block_of(layer: int):  # (a heterogeneous or hybrid layer's parts, None in a homogeneous model and the MTP
        return layer_block(model, layer)  # depths; a Mamba mixer's collectives are a normal part's)

    def layer_terms(moe: bool, fp8: str | None, layer: int) -> tuple[float, float, float, float, float]:
        """One layer's forward (attention GEMMs, MLP, attention core, element-wise) and its share of a layer's
        operator launches; a layer's kind decides it. `fp8`: its linears' GEMMs in fp8 (_gemm's; the router's
        stays in the compute dtype). A heterogeneous layer at its own query groups and FFN size, a linear
        replacement one [hidden, hidden / TP] GEMM, a no-op part nothing."""
        block = block_of(layer)
        own = model.layer_config(layer) if block is not None else model
        if block is not None and block.attention == MAMBA_MIXER:
            return _mixer_terms(model, layout, m, a, cl, eff, impl)
        kv = own.query_groups * d
        rows = q * (2 if model.attention_output_gate else 1) + 2 * kv  # (the gate's rows, if any)
        attn = _gemm(m, h, rows / tp, a, cl, eff, fp8=fp8) + _gemm(m, q / tp, h, a, cl, eff, fp8=fp8)
        core_q = q  # the query dims each key is scored over (and the value dims)
        if model.multi_latent_attention:
            attn = _mla_gemms(model, m, tp, a, cl, eff, fp8)
            # q.k^T over the query/key head and p.v over the (unpadded) value head: their mean counts both
            core_q = model.num_attention_heads * (model.mla_q_head_dim + model.v_head_dim) / 2
        if moe:
            f, k = model.moe_ffn_size, model.moe_router_topk
            # each rank's experts get, balanced, m k of the tokens routed over the EP group; with expert TP below
            # TP each expert-TP group dispatches its 1 / (TP / ETP) of them, to experts split ETP ways
            local, etp = model.num_experts // ep, layout.expert_tp
            mlp = _gemm(m, h, model.num_experts, a, cl, eff)
            mlp += _gemm(m * k * etp / tp, h, f * (2 if swiglu else 1) / etp, a, cl, eff, local, fp8)
            mlp += _gemm(m * k * etp / tp, f / etp, h, a, cl, eff, local, fp8)
            shared = model.moe_shared_expert_intermediate_size
            if shared:  # every token through the shared expert too
                mlp += _gemm(m, h, shared * (2 if swiglu else 1) / tp, a, cl, eff, fp8=fp8)
                mlp += _gemm(m, shared / tp, h, a, cl, eff, fp8=fp8)
        else:
            f = own.ffn_size
            mlp = _gemm(m, h, f * (2 if swiglu else 1) / tp, a, cl, eff, fp8=fp8)
            mlp += _gemm(m, f / tp, h, a, cl, eff, fp8=fp8)
        # causal attention over the whole sequence (this rank's queries see all earlier keys)
        core = 2 * m * seq_length * core_q / tp / (g.matmul_rate(a) * eff.attention)
        if model.sliding_window:  # (the windowed share of the layers: --window-attn-skip-freq spares some)
            windowed = sum(model.layer_window(i) is not None for i in range(model.num_layers)) / model.num_layers
            core *= 1.0 - windowed * (1.0 - min(1.0, 2 * model.sliding_window / seq_length))
        if model.attention_chunk_size:  # (Llama 4's chunks on its RoPE layers: a query scores half its chunk's keys)
            chunked = sum(not model.skips_rope(i) for i in range(model.num_layers)) / model.num_layers
            core *= 1.0 - chunked * (1.0 - min(1.0, model.attention_chunk_size / seq_length))
        if block is None:
            elem = elementwise_values(model, tp, layout.sp, impl) * m * a / (g.memory_bandwidth * eff.memory)
            return attn, mlp, core, elem, 1.0
        linear = _gemm(m, h, h / tp, a, cl, eff)
        attn = {NORMAL: attn, LINEAR: linear, NO_OP: 0.0}[block.attention]
        mlp = {NORMAL: mlp, LINEAR: linear, NO_OP: 0.0}[block.mlp]
        core = core if block.attention == NORMAL else 0.0
        elem = elementwise_values(own, tp, layout.sp, impl, block.attention, block.mlp) * m * a
        return (
            attn,
            mlp,
            core,
            elem / (g.memory_bandwidth * eff.memory),
            ((block.attention != NO_OP) + (block.mlp != NO_OP)) / 2,
        )

    # The busiest stage: the one with most layers, plus the output layer on the last
    stages = [stage_params(model, layout, r) for r in range(pp)]
    per_stage = []
    kinds: dict[tuple, tuple[float, ...]] = {}  # (layer_terms of each kind, made once)
    fp8_kind = None if model.fp8 is None else ("fp8" if model.fp8_wgrad else "dgrad")
    for r, st in enumerate(stages):
        fwd = 0.0  # one micro-batch's forward
        recompute_fwd = 0.0
        attn_total = 0.0
        rerun, checkpoints = full_recompute_runs(model, layout, r)  # (full: all of them, or a block's)
        recomputed = set(rerun)
        for layer in st.layers:
            moe, fp8 = model.is_moe_layer(layer), fp8_kind if fp8_layer(model, layer) else None
            kind = (moe, fp8, block_of(layer))
            if kind not in kinds:
                kinds[kind] = layer_terms(moe, fp8, layer)
            attn, mlp, core, elem, launches = kinds[kind]
            fwd += attn + mlp + core + elem + launches * impl.ops_per_layer / 3 * g.launch_seconds
            attn_total += core
            if layer in recomputed:
                recompute_fwd += attn + mlp + core + elem
            elif layout.recompute == "selective":  # what --recompute-modules names runs again (the norms, the
                # experts' activation and MLA's up-projections are cheap beside these)
                mods = model.recompute_modules
                recompute_fwd += (core if "core_attn" in mods else 0) + (
                    mlp if ("moe" if moe else "mlp") in mods else 0
                )
            elif layout.recompute == "op":  # torchtitan's per-op policy: every other matmul, all elementwise
                recompute_fwd += (attn + mlp) / 2 + elem
        if r == pp - 1:
            vocab = model.padded_vocab_size(tp) / tp
            ce = m * vocab * CE_BYTES[impl.fused_cross_entropy] / 3  # counted with the forward, x3 below
            fwd += (1 + model.mtp_num_layers) * (
                _gemm(m, h, vocab, a, cl, eff) + ce / (g.memory_bandwidth * eff.memory)
            )
            fwd += model.mtp_num_layers * _gemm(m, 2 * h, h / tp, a, cl, eff, fp8=fp8_kind)  # each depth's eh_proj
        # backward: dgrad + wgrad GEMMs (2x) and flash backward (2.5x the causal forward)
        per_mb = 3 * fwd + 0.5 * attn_total + recompute_fwd
        per_stage.append((per_mb, st, rerun, checkpoints))
    r_busiest = max(range(pp), key=lambda r: per_stage[r][0])
    per_mb, st, rerun, checkpoints = per_stage[r_busiest]
    micro = max(layout.micro_batches(global_batch_size), 1)
    compute = micro * per_mb
    bubble = (pp - 1) / (vp * micro) * compute if pp > 1 else 0.0

    def attends(layer: int) -> bool:  # (a heterogeneous layer's linear replacement or no-op has no attention)
        return block_of(layer) is None or block_of(layer).attention == NORMAL

    def layer_model(layer: int) -> ModelConfig:
        return model.layer_config(layer) if block_of(layer) is not None else model

    act = m * h * a  # one micro-batch's hidden states on this rank (full sequence part)
    tp_comm = 0.0
    if tp > 1:
        gather, scatter = (_collective(k, act, tp, tp, cl, eff) for k in ("all_gather", "reduce_scatter"))
        reduce = _collective("all_reduce", act, tp, tp, cl, eff)
        # embedding reduce-scatter, output layer all-gather, and their backward twins (all-reduces without SP)
        edges = 2 * (gather + scatter) if layout.sp else 2 * reduce
        edges += 3 * _collective("all_reduce", m * 4, tp, tp, cl, eff)  # vocab-parallel loss: max, sum, target

        def part_comm(kind: str) -> tuple[float, float]:
            """(forward and backward, forward) collectives of a layer's attention or MLP. Under SP: a gather in
            and a reduce-scatter out, and their backward twins; a linear replacement gathers its input and its
            output (the scatter back to the sequence shard is a slice, whose backward gathers). Without SP:
            an all-reduce forward and backward; the linear its output's gather and its input's gradient's
            all-reduce. A no-op: none."""
            if kind == NO_OP:
                return 0.0, 0.0
            if kind == LINEAR:
                return (3 * gather + scatter, 2 * gather) if layout.sp else (gather + reduce, gather)
            return (2 * gather + 2 * scatter, gather + scatter) if layout.sp else (2 * reduce, reduce)

        def layer_comm(layer: int) -> tuple[float, float]:
            block = block_of(layer) or BlockConfig()
            (attn_all, attn_fwd), (mlp_all, mlp_fwd) = part_comm(block.attention), part_comm(block.mlp)
            return attn_all + mlp_all, attn_fwd + mlp_fwd

        # full recomputation runs each recomputed layer's forward again, its collectives included, up to the last
        # one whose output the backward keeps: torch's non-reentrant checkpoint stops before each checkpoint's
        # final reduction
        def last(checkpoint: list[int]) -> float:
            """A checkpoint's last forward collective: its last part's (none in a run of identities)."""
            blocks_ = [block_of(i) or BlockConfig() for i in checkpoint]
            kinds = [k for b in blocks_ for k in (b.attention, b.mlp) if k != NO_OP]
            return 0.0 if not kinds else gather if kinds[-1] == LINEAR else scatter if layout.sp else reduce

        each = sum(layer_comm(i)[0] for i in st.layers)
        again = sum(layer_comm(i)[1] for i in rerun) - sum(last(c) for c in checkpoints)
        tp_comm = micro * (each + again + edges) * (1 - (eff.tp_overlap if tp_comm_overlap else 0.0))
    cp_comm = 0.0
    # (each attending layer at its own key/value heads: a heterogeneous layer's own query groups)
    # (counted under CP only: each count hashes a model config, a search's millions of times)
    attending = collections.Counter(layer_model(i) for i in st.layers if attends(i)) if cp > 1 else {}
    rerun_by = collections.Counter(layer_model(i) for i in rerun if attends(i)) if cp > 1 else {}
    core_again = layout.recompute == "selective" and "core_attn" in model.recompute_modules  # (every attention)
    for own, n in attending.items():
        again = n if core_again else rerun_by[own]  # the attentions that run again in the backward
        if layout.cp_comm_type != "p2p":
            every, forward = _exposed_cp(own, layout, m, a, cl, eff)
            cp_comm += micro * (n * every + again * forward)
            continue
        # K and V blocks (and their gradients) around the ring, under each block's attention
        blocks = ring_blocks(own, m, tp, cp, a)
        ring = sum(k * _collective("p2p", block, cp, tp * cp, cl, eff) for block, k in blocks)
        mla, heads = model.multi_latent_attention, model.num_attention_heads
        core_q = heads * (model.mla_q_head_dim + model.v_head_dim) / 2 if mla else q
        out = heads * model.v_head_dim if mla else q
        attn_time = 3.5 * 2 * m * seq_length * core_q / tp / (g.matmul_rate(a) * eff.attention)
        # each ring step launches its own attention kernels and merges its partial output by log-sum-exp
        merge = 3 * (cp - 1) * 3 * m * out / tp * a / (g.memory_bandwidth * eff.memory) + 4 * cp * g.launch_seconds
        cp_comm += micro * n * (max(0.0, ring - attn_time) + merge)
        # the recomputed attention passes K and V round again
        ring_fwd = (cp - 1) * _collective("p2p", blocks[0][0], cp, tp * cp, cl, eff)  # (the K/V blocks)
        cp_comm += micro * again * (max(0.0, ring_fwd - attn_time / 3.5) + merge / 3)
    ep_comm = 0.0
    if model.num_experts and ep > 1:
        moe_layers = sum(1 for i in st.layers if model.is_moe_layer(i))
        # every TP rank routes the whole (gathered) sequence: MoELayer gathers it first, under SP too; with expert
        # TP below TP each expert-TP group sends its 1 / (TP / ETP) share, over an EP group ETP ranks apart
        tokens = m * model.moe_router_topk * h * a * layout.expert_tp / tp
        if layout.recompute == "selective" and "moe" in model.recompute_modules:
            again = moe_layers
        else:
            again = sum(1 for i in rerun if model.is_moe_layer(i))
        # dispatch and combine, forward and backward (+ again, recomputed)
        span = layout.expert_tp * ep
        ep_comm = micro * (4 * moe_layers + 2 * again) * _collective("all_to_all", tokens, ep, span, cl, eff)
    pp_comm = 0.0
    if pp > 1:  # each micro-batch's activation forward and gradient backward, per model chunk
        send = act / (tp if layout.sp else 1)
        # neighbouring stages are world / PP ranks apart: inside a node only when the whole job is (else some
        # stage boundary crosses nodes, and the pipeline goes at its pace)
        pp_comm = 2 * micro * vp * _collective("p2p", send, 2, layout.world, cl, eff)

    # Data parallelism (fp32 gradients, or bf16 with grads_bf16; compute-precision parameters), as our runtime
    # schedules it
    dp_cp = layout.dp * cp
    edp = layout.edp  # experts are replicated (and reduced, and sharded) over expert-DP, not DP x CP
    span = tp * dp_cp
    n = st.total
    grad_bytes = 2 if bf16 and grads_bf16 else 4  # per gradient, in the reduction

    def over_dp(kind: str, bytes_per_param: float) -> float:
        """One collective over the dense parameters' group and one over the experts'."""
        return sum(
            _collective(kind, bytes_per_param * count, size, span, cl, eff)
            for count, size in ((st.dense, dp_cp), (st.expert, edp))
        )

    dp_comm = 0.0
    if dp_cp > 1 or layout.edp > 1:  # (experts' over expert-DP, which expert TP below TP makes larger than DP x CP)
        if layout.sharding == "fsdp2":  # gathers (forward, backward) and reduce-scatters every micro-batch,
            comm = 2 * over_dp("all_gather", a)  # layer by layer under the step
            comm = micro * (comm + over_dp("reduce_scatter", grad_bytes))
            # except at each micro-batch's edges: the chunks' own units (embeddings, output layer, final norm)
            # and each chunk's first layer are gathered before anything runs, and reduce-scattered after the
            # backward
            first = vp * sum(layer_params(model, st.layers[0], tp, ep, layout.etp)) if st.layers else 0
            edge = n - sum(sum(layer_params(model, i, tp, ep, layout.etp)) for i in st.layers) + first
            edges = micro * (
                _collective("all_gather", a * edge, dp_cp, span, cl, eff)
                + _collective("reduce_scatter", grad_bytes * edge, dp_cp, span, cl, eff)
            )
            exposed = edges + max(0.0, comm - edges - eff.dp_overlap * compute)
        else:
            kind = "all_reduce" if layout.sharding in ("none", "layer-wise") else "reduce_scatter"
            reduce = over_dp(kind, grad_bytes)
            gather = over_dp("all_gather", a) if layout.sharding in ("dist-opt", "zero2") else 0.0
            if layout.sharding == "layer-wise":  # dist_muon: gradients all-reduced whole; after the step each rank's
                # updated tensors gathered, flattened and padded to the largest rank's, one all-gather per group
                widths = layer_wise_split_of(model, layout, r_busiest, bf16).widths
                gather = sum(_collective("all_gather", a * w * size, size, span, cl, eff) for size, w in widths)
            overlapped = layout.overlaps_grad_reduce  # (else each reduction after its backward, all exposed)
            if layout.sharding == "zero2":  # every micro-batch's gradients, each under its own backward
                hidden = eff.dp_overlap * 2 / 3 * per_mb if overlapped else 0.0
                exposed = micro * max(0.0, reduce - hidden)
                comm = micro * reduce + gather
            else:  # once a step, each model chunk's buckets under the backward left after its last one
                exposed = _exposed_reduction(layout, micro, per_mb, reduce, eff) if overlapped else reduce
                comm = reduce + gather
            # the updated weights' all-gather, under the next forward or (without the flag) after the step
            exposed += _exposed_gather(layout, micro, per_mb, gather, eff) if layout.overlaps_param_gather else gather
        dp_comm = exposed + eff.contention * (comm - exposed)
    # optimizer: the slowest stage's step (its state's traffic, and muon's Newton-Schulz), not the busiest's
    optimizer = optimizer_seconds(model, layout, stages, bf16, state_bytes, muon, cl, eff, _collective)
    return StepTime(compute, tp_comm, cp_comm, ep_comm, bubble, pp_comm, dp_comm, optimizer)


def cp_collectives(model: ModelConfig, layout: Layout, tokens: float, a: int) -> list[tuple[str, float]]:
    """One layer's a2a or allgather context-parallel collectives, forward and backward, for one micro-batch of
    `tokens` on this rank: (kind, bytes as `_collective` takes them). a2a: q, k and v from sequence to head
    shards and the output back, the gradients of each the other way (key/value heads that do not divide over
    CP are repeated to one per query head first); allgather: the whole sequence's keys and values gathered,
    their gradients reduce-scattered."""
    tp, cp = layout.tp, layout.cp
    if model.multi_latent_attention:  # the up-projected heads, at the query/key and value head sizes
        heads = model.num_attention_heads
        q = k = heads * model.mla_q_head_dim
        v = out = heads * model.v_head_dim
    else:
        q = out = model.num_attention_heads * model.head_dim
        k = v = model.query_groups * model.head_dim
        if layout.cp_comm_type == "a2a" and (model.query_groups // tp) % cp:
            k = v = q
    if layout.cp_comm_type == "a2a":
        return [("all_to_all", tokens * w / tp * a) for w in (q, k, v, out)] * 2
    return [(kind, cp * tokens * w / tp * a) for kind in ("all_gather", "reduce_scatter") for w in (k, v)]


def _exposed_cp(
    model: ModelConfig, layout: Layout, tokens: float, a: int, cl: Cluster, eff: Efficiency
) -> tuple[float, float]:
    """`cp_collectives` in seconds, none of them under compute (attention waits for them): (all of them, the
    forward's, which a recomputed attention runs again)."""
    calls = cp_collectives(model, layout, tokens, a)
    span = layout.tp * layout.cp
    seconds = [_collective(kind, b, layout.cp, span, cl, eff) for kind, b in calls]
    return sum(seconds), sum(seconds[: len(seconds) // 2])


def ring_blocks(model: ModelConfig, tokens: float, tp: int, cp: int, a: int) -> list[tuple[float, int]]:
    """Context parallelism's ring in one layer and micro-batch, as (bytes of one block, blocks each rank sends):
    a block is one rank's `tokens` of keys and values, its TP share of the heads. The forward passes keys and
    values on cp - 1 times and the backward again; their gradients, accumulated in fp32, go round cp times (the
    last hop takes each to its owner). Multi-latent attention rings its up-projected keys and values: every
    head, at the query/key and the value head sizes."""
    if model.multi_latent_attention:
        width = model.num_attention_heads * (model.mla_q_head_dim + model.v_head_dim)
    else:
        width = 2 * model.query_groups * model.head_dim
    block = tokens * width / tp
    return [(block * a, 2 * (cp - 1)), (block * 4, cp)]


def throughput(
    model: ModelConfig,
    layout: Layout,
    seq_length: int,
    global_batch_size: int,
    t: StepTime,
    cl: Cluster,
    bf16: bool = True,
):
    """(tokens/s per GPU, model TFLOP/s per GPU, MFU: against the bf16 peak, or the fp32 one of an fp32 run, as
    pretrain's log reports it)."""
    tokens = global_batch_size * seq_length
    tps = tokens / t.total / layout.world
    # (in the convention of the published figures the model is held against: full, not causally halved,
    # attention, as Megatron counted it when it published them and as torchtitan counts it)
    flops = _model_flops_per_token(model, seq_length) * tps
    return tps, flops / 1e12, flops / (cl.gpu.mfu_peak if bf16 else cl.gpu.fp32_rate)


@functools.lru_cache(maxsize=1024)
def _model_flops_per_token(model: ModelConfig, seq_length: int) -> float:
    # (a search's layouts share a few: the model's FLOPs do not depend on the layout)
    return flops_per_token(model, seq_length, causal=False)
