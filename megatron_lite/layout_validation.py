"""Start-up checks across the model, layout and training configs: the pipeline's layer split
(`stage_layer_counts`) and every check that depends on how the job is split (`validate_layout`). They run
before any process group exists, so a bad layout stops every rank with one line instead of hanging in a
collective.
"""

from __future__ import annotations

import math
import re

from megatron_lite.config import (
    ConfigError,
    ModelConfig,
    ParallelConfig,
    TrainingConfig,
    _nearest_multiples,
    divisors,
)

# (Megatron repeats any one character, '|' too: "E|*2tL" is "E||tL")
_LAYOUT_REPEAT = (re.compile(r"\(([^()]+)\)\*(\d+)"), re.compile(r"([^()*])\*(\d+)"))


def unroll_layout(text: str) -> str:
    """A layout's repeats written out, commas and spaces dropped."""
    grown = [0]  # characters the repeats of one pass add, counted before each is built

    def repeat(m: re.Match) -> str:
        grown[0] += len(m.group(1)) * int(m.group(2))
        if grown[0] > 100_000:
            raise ConfigError(f"--pipeline-model-parallel-layout {text!r} unrolls to more than 100000 characters")
        return m.group(1) * int(m.group(2))

    unrolled = text.replace(",", "").replace(" ", "")
    for pattern in _LAYOUT_REPEAT:  # (parentheses do not nest in Megatron's grammar either)
        grown[0] = len(unrolled)
        unrolled = pattern.sub(repeat, unrolled)
    return unrolled


def standalone_mtp(stages: list[str]) -> bool:
    """Megatron's stage of MTP layers alone before the loss's ("...|m|L", as in its DeepSeek-V3 layout)."""
    return len(stages) >= 2 and set(stages[-2]) == {"m"} and stages[-1] == "L"


def parse_pipeline_layout(text: str, pp: int, num_layers: int, mtp_num_layers: int = 0) -> tuple[int, ...]:
    """Megatron's --pipeline-model-parallel-layout: the layers of every virtual stage, in stage order s = chunk *
    PP + pipeline rank, separated by '|': E the embedding, t a transformer layer, m a multi-token-prediction layer,
    L the loss; "x*n" and "(...)*n" repeat, commas are cosmetic ("Et*3|(t*4|)*14,t*2mL": DeepSeek-V3's 61 layers and
    its MTP layer on PP=16). Returns the decoder layers
    of each stage. The embedding must open the first stage and the loss close the last; the MTP layers share the
    loss's stage (Megatron's stage of MTP layers alone just before the loss's, "...|m|L", runs them in the loss's
    stage: the same math, that stage left empty), and every pipeline rank holds a layer, the embedding or the
    loss."""
    flag = "--pipeline-model-parallel-layout"
    unrolled = unroll_layout(text)
    bad = sorted(set(unrolled) - set("EtmL|"))
    if bad:
        raise ConfigError(
            f"{flag} {text!r}: unexpected {''.join(bad)!r}; use E (embedding), t (layer), m (MTP layer), L (loss), "
            "'|' between stages, x*n and (...)*n to repeat"
        )
    stages = unrolled.split("|")
    moved = standalone_mtp(stages)
    if moved:  # (Megatron's mtp_standalone: here they run in the loss's stage, one stage later)
        stages[-2:] = ["", stages[-2] + stages[-1]]
    if len(stages) % pp:
        raise ConfigError(
            f"{flag} {text!r} has {len(stages)} stages, not a multiple of --pipeline-model-parallel-size {pp}"
        )
    flat = "".join(stages)
    problems = []
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        problems.append("E (the embedding) must open the first stage, once")
    if flat.count("L") != 1 or not stages[-1].endswith("L"):
        problems.append("L (the loss) must close the last stage, once")
    if flat.count("t") != num_layers:
        problems.append(f"it places {flat.count('t')} layers (t) for --num-layers {num_layers}")
    if flat.count("m") != mtp_num_layers:
        problems.append(f"it places {flat.count('m')} MTP layers (m) for --mtp-num-layers {mtp_num_layers}")
    elif mtp_num_layers and stages[-1].rstrip("L")[-mtp_num_layers:] != "m" * mtp_num_layers:
        problems.append("the MTP layers (m) must come last in the loss's stage, just before L (e.g. ...|tmL)")
    idle = [r for r in range(1, pp - 1) if not any("t" in stages[c * pp + r] for c in range(len(stages) // pp))]
    if idle:  # (such a rank would hold no parameter: nothing for its optimizer or data-parallel reduction)
        problems.append(
            f"pipeline rank(s) {idle} hold no layer in any of their stages"
            + (" (the MTP layers' own stage, ...|m|L, runs in the loss's stage here)" if moved else "")
        )
    if problems:
        raise ConfigError(f"{flag} {text!r}: {'; '.join(problems)}")
    return tuple(stage.count("t") for stage in stages)


def stage_layer_counts(num_layers: int, parallel: ParallelConfig, world_size: int = 0, tp_cp: int = 1) -> list[int]:
    """Layers of each virtual stage s = chunk * PP + pipeline rank: an even split, Megatron's uneven
    first/last stages (--decoder-first/last-pipeline-num-layers) with the rest split evenly between the
    other stages, or a --pipeline-model-parallel-layout. Never drops a layer: a split that is not exact is a
    one-line error."""
    pp, vp = parallel.pp, parallel.vp
    extra = int(parallel.account_for_embedding_in_pipeline_split) + int(parallel.account_for_loss_in_pipeline_split)
    if extra:
        flags = "--account-for-embedding/loss-in-pipeline-split"
        others = (parallel.decoder_first_pipeline_num_layers, parallel.decoder_last_pipeline_num_layers)
        if parallel.pipeline_layout is not None or any(x is not None for x in others):
            raise ConfigError(f"{flags} split the layers evenly: drop --decoder-first/last-pipeline-num-layers and "
                              "--pipeline-model-parallel-layout, or these")  # fmt: skip
        if (num_layers + extra) % (pp * vp):
            fits = [int(x) - extra for x in _nearest_multiples(num_layers + extra, pp * vp).split(" or ")]
            raise ConfigError(
                f"--num-layers {num_layers} + {extra} ({flags}) is not divisible by {pp} x {vp} pipeline stages; "
                f"use --num-layers {' or '.join(str(x) for x in fits if x > 0)}"
            )
        counts = [(num_layers + extra) // (pp * vp)] * (pp * vp)
        counts[0] -= int(parallel.account_for_embedding_in_pipeline_split)
        counts[-1] -= int(parallel.account_for_loss_in_pipeline_split)
        if min(counts) < 0 or (pp > 2 and 0 in counts[1:-1]):
            raise ConfigError(f"{flags} leave a stage without layers; use fewer pipeline stages")
        return counts
    if parallel.pipeline_layout is not None:
        counts = list(parallel.pipeline_layout)
        if len(counts) != pp * vp or sum(counts) != num_layers:
            raise ConfigError(
                f"--pipeline-model-parallel-layout gives {len(counts)} stages of {sum(counts)} layers; the job has "
                f"{pp} x {vp} stages and --num-layers {num_layers}"
            )
        return counts
    first, last = parallel.decoder_first_pipeline_num_layers, parallel.decoder_last_pipeline_num_layers
    stages = pp * vp
    if first is None and last is None:
        if num_layers % stages:
            ok_pp = [d for d in divisors(max(world_size // tp_cp, 1)) if num_layers % (d * vp) == 0]
            raise ConfigError(
                f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
                f"{vp} virtual stages = {stages}; use --num-layers {_nearest_multiples(num_layers, stages)}"
                + (f" or a pipeline size in {ok_pp}" if ok_pp else " or fewer virtual stages")
                + _uneven_hint(num_layers, pp, vp)
            )
        return [num_layers // stages] * stages
    if pp < 2:
        raise ConfigError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
    fixed = [x for x in (first, last) if x is not None]
    if any(x < 1 for x in fixed):
        # (a 0 fits in any --num-layers: saying it does not misled; Megatron's rule, and a stage of no layer is a
        # --pipeline-model-parallel-layout's)
        raise ConfigError(
            f"--decoder-first/last-pipeline-num-layers {fixed} must each be at least 1 (as in Megatron); for a "
            "stage without layers use --pipeline-model-parallel-layout"
        )
    if sum(fixed) > num_layers:
        raise ConfigError(f"--decoder-first/last-pipeline-num-layers {fixed} do not fit in --num-layers {num_layers}")
    middle = pp - len(fixed)
    rest = num_layers - sum(fixed)
    if (middle == 0 and rest) or (middle > 0 and rest % middle):
        raise ConfigError(
            f"--num-layers {num_layers} minus the uneven stages {fixed} leaves {rest} layers, which do not split "
            f"evenly over the other {middle} pipeline stage(s); adjust --decoder-first/last-pipeline-num-layers"
        )
    if middle > 0 and rest == 0:  # (Megatron builds empty ranks; here every rank holds a layer)
        raise ConfigError(
            f"--num-layers {num_layers} minus the uneven stages {fixed} leaves no layer for the other {middle} "
            "pipeline stage(s), and a pipeline rank without layers is not supported; lower "
            "--decoder-first/last-pipeline-num-layers or --pipeline-model-parallel-size"
        )
    each = rest // middle if middle else 0
    per_rank = [first if first is not None else each] + [each] * (pp - 2) + [last if last is not None else each]
    # With virtual stages (as Megatron's): each rank's layers split evenly over its chunks, chunk c of rank r
    # being stage c * pp + r
    for r, n in enumerate(per_rank):
        if n % vp:
            what = (
                "--decoder-first-pipeline-num-layers"
                if r == 0 and first is not None
                else "--decoder-last-pipeline-num-layers"
                if r == pp - 1 and last is not None
                else "the layers of each middle pipeline rank"
            )
            raise ConfigError(f"{what} ({n}) must be divisible by the {vp} virtual stages per pipeline rank")
    return [per_rank[r] // vp for _ in range(vp) for r in range(pp)]


def _uneven_hint(num_layers: int, pp: int, vp: int) -> str:
    """An uneven first stage that fits (an exploratory run: the even split's error did not name them, though
    they ran): the size nearest an even share whose rest splits evenly over the other ranks and their chunks."""
    if pp < 2:
        return ""
    fits = [f for f in range(vp, num_layers, vp) if (num_layers - f) % ((pp - 1) * vp) == 0]
    if not fits:
        return ""
    first = min(fits, key=lambda f: abs(f - num_layers / pp))
    # (uneven stages take their virtual stages from --num-virtual-stages-per-pipeline-rank only, as in Megatron)
    chunks = f" with --num-virtual-stages-per-pipeline-rank {vp}" if vp > 1 else ""
    return f", or an uneven first stage: --decoder-first-pipeline-num-layers {first}{chunks}"


CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")


def _validate_context_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    cp, tp = parallel.cp, parallel.tp
    if parallel.cp_comm_type not in CP_COMM_TYPES:
        raise ConfigError(
            f"--cp-comm-type {parallel.cp_comm_type} is not supported; use one of {', '.join(CP_COMM_TYPES)}"
        )
    sizes = parallel.hierarchical_context_parallel_sizes
    if (parallel.cp_comm_type == "a2a+p2p") != (sizes is not None):
        raise ConfigError(
            "--cp-comm-type a2a+p2p and --hierarchical-context-parallel-sizes A P go together (A ranks exchange "
            "heads all-to-all, a ring runs over the P groups); give both or neither"
        )
    if sizes is not None and (len(sizes) != 2 or min(sizes) < 1 or sizes[0] * sizes[1] != cp):
        raise ConfigError(
            f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} must be two sizes whose product is "
            f"--context-parallel-size {cp}, e.g. 2 {max(cp // 2, 1)}"
        )
    if cp == 1:
        return
    local_heads = model.num_attention_heads // tp
    if sizes is not None and local_heads % sizes[0]:
        raise ConfigError(
            f"--hierarchical-context-parallel-sizes {sizes[0]} {sizes[1]} splits attention heads over groups of "
            f"{sizes[0]}: --num-attention-heads {model.num_attention_heads} / --tensor-model-parallel-size {tp} = "
            f"{local_heads} is not divisible by {sizes[0]}"
        )
    if parallel.cp_comm_type == "a2a" and local_heads % cp:
        raise ConfigError(
            f"--cp-comm-type a2a splits attention heads over context-parallel ranks: --num-attention-heads "
            f"{model.num_attention_heads} / --tensor-model-parallel-size {tp} = {local_heads} is not divisible by "
            f"--context-parallel-size {cp}; use --cp-comm-type p2p or a CP size dividing {local_heads}"
        )
    if model.num_experts is not None and model.moe_router_load_balancing_type == "sinkhorn":
        raise ConfigError(
            f"--moe-router-load-balancing-type sinkhorn with --context-parallel-size {cp} is not supported (the "
            "balancing runs over a micro-batch's tokens, and each rank holds a part of each sequence); use CP 1"
        )
    if model.num_experts is not None and model.moe_expert_capacity_factor is not None:
        raise ConfigError(
            f"--moe-expert-capacity-factor with --context-parallel-size {cp} is not supported yet (capacity is per "
            "rank, one process would count it over the whole sequence); use dropless MoE or CP 1"
        )
    if model.sliding_window is not None and parallel.cp_comm_type not in ("a2a", "allgather"):
        raise ConfigError(
            f"--window-size with --cp-comm-type {parallel.cp_comm_type} is not supported: a sliding window runs under "
            "--cp-comm-type a2a or allgather (as Transformer Engine's), which attend over the whole sequence"
        )
    if model.attention_dropout > 0:
        raise ConfigError(
            f"--attention-dropout {model.attention_dropout} with --context-parallel-size {cp}: context-parallel "
            "attention has no dropout; use --attention-dropout 0"
        )


def _check_expert_slices(model: ModelConfig, parallel: ParallelConfig) -> None:
    """An expert-TP size below TP: what the token slices of moe/layer.py do not cover yet."""
    flag = f"--expert-tensor-parallel-size {parallel.etp} below --tensor-model-parallel-size {parallel.tp}"
    if not parallel.sequence_parallel:  # (the slices split the sequence as SP does; Megatron's MoE trains only with it)
        raise ConfigError(f"{flag} needs --sequence-parallel (Megatron's MoE layer refuses TP without it); add it")
    if model.moe_expert_capacity_factor is not None:
        raise ConfigError(f"{flag} with --moe-expert-capacity-factor is not supported yet; use dropless MoE")


def _seq_lengths(seq: int, step: int, model: ModelConfig) -> str:
    """The multiples of `step` nearest --seq-length, those learned positions have room for (68 was suggested past
    --max-position-embeddings 66, then refused for it)."""
    lo, hi = (seq // step) * step, (seq // step + 1) * step
    cap = model.max_position_embeddings if model.position_embedding_type == "learned_absolute" else None
    options = [str(n) for n in (lo, hi) if n > 0 and (cap is None or n <= cap)]
    return " or ".join(options) if options else f"{hi} with --max-position-embeddings {hi}"


def validate_layout(
    model: ModelConfig, parallel: ParallelConfig, world_size: int, training: TrainingConfig | None = None
) -> None:
    """Every check that depends on how the job is split. Runs before any collective."""
    tp, pp, cp, vp = parallel.tp, parallel.pp, parallel.cp, parallel.vp
    for flag, value in (
        ("--tensor-model-parallel-size", tp),
        ("--pipeline-model-parallel-size", pp),
        ("--context-parallel-size", cp),
        ("--expert-model-parallel-size", parallel.ep),
        ("--expert-tensor-parallel-size", parallel.etp),
        ("--num-virtual-stages-per-pipeline-rank", vp),
    ):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be a positive integer")
    if world_size % (tp * pp * cp):
        raise ConfigError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp} = {tp * pp * cp}; "
            f"choose sizes whose product divides {world_size} (one of {divisors(world_size)}) "
            f"or launch a multiple of {tp * pp * cp} ranks"
        )
    etp, ep = parallel.etp, parallel.ep
    if world_size % (etp * ep * pp):
        # (not given, it is TP's, as in Megatron: an exploratory run's line named a flag its user never typed)
        default = " (not given: --tensor-model-parallel-size's)" if parallel.expert_tensor_parallel_size is None else ""
        fits = [e for e in divisors(etp) if world_size % (e * ep * pp) == 0]
        raise ConfigError(
            f"world size {world_size} is not divisible by --expert-tensor-parallel-size {etp}{default} x "
            f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp} = {etp * ep * pp}; "
            f"choose sizes whose product divides {world_size}"
            + (f" (--expert-tensor-parallel-size {fits[-1]} does)" if fits else "")
        )
    heads, groups = model.num_attention_heads, model.query_groups
    # TP sizes that would work with everything else unchanged.
    ok_tp = [
        d for d in divisors(groups) if heads % d == 0 and model.ffn_size % d == 0 and world_size % (d * pp * cp) == 0
    ]
    if heads % tp:
        raise ConfigError(
            f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}; "
            f"use --tensor-model-parallel-size in {ok_tp}"
        )
    if groups % tp:
        implied = " (1 is also --group-query-attention's default)" if groups == 1 and heads > 1 else ""
        raise ConfigError(
            f"--num-query-groups {groups}{implied} is not divisible by --tensor-model-parallel-size {tp}; "
            f"use --tensor-model-parallel-size in {ok_tp} or more query groups"
        )
    from megatron_lite.models.hybrid_pattern import validate_hybrid_layout

    validate_hybrid_layout(model, tp, cp)
    from megatron_lite.models.heterogeneous import validate_heterogeneous_layout

    validate_heterogeneous_layout(model, tp)
    if model.multi_latent_attention:  # the down-projections split their latent outputs across TP
        for flag, size in (
            ("--q-lora-rank", model.q_lora_rank),
            ("--kv-lora-rank + --qk-pos-emb-head-dim", model.kv_lora_rank + model.qk_pos_emb_head_dim),
        ):
            if size is not None and size % tp:
                raise ConfigError(
                    f"{flag} ({size}) is not divisible by --tensor-model-parallel-size {tp} (multi-latent attention "
                    f"splits its down-projections across TP); use --tensor-model-parallel-size in "
                    f"{[d for d in ok_tp if size % d == 0]}"
                )
    if model.num_experts is not None:
        ep = parallel.ep
        if model.num_experts % ep:
            ok = [d for d in divisors(model.num_experts) if world_size % (d * parallel.etp * pp) == 0]
            raise ConfigError(
                f"--num-experts {model.num_experts} is not divisible by --expert-model-parallel-size {ep}; "
                f"use --expert-model-parallel-size in {ok}"
            )
        if tp % parallel.etp:  # (each expert-TP group handles a slice of its TP group's tokens: moe/layer.py)
            raise ConfigError(
                f"--expert-tensor-parallel-size {parallel.etp} not dividing --tensor-model-parallel-size {tp} is "
                "not supported yet; use a divisor of it (1 keeps every expert whole)"
            )
        if parallel.etp != tp:
            _check_expert_slices(model, parallel)
        if model.moe_ffn_size % parallel.etp:
            raise ConfigError(
                f"--moe-ffn-hidden-size {model.moe_ffn_size} is not divisible by --expert-tensor-parallel-size "
                f"{parallel.etp}"
            )
        shared = model.moe_shared_expert_intermediate_size
        if shared is not None and shared % tp:  # (the shared expert is a dense MLP split over TP)
            raise ConfigError(
                f"--moe-shared-expert-intermediate-size {shared} is not divisible by --tensor-model-parallel-size "
                f"{tp}; use {_nearest_multiples(shared, tp)}"
            )
    elif parallel.ep > 1:
        raise ConfigError(f"--expert-model-parallel-size {parallel.ep} needs --num-experts")
    if model.ffn_size % tp and not all(model.moe_layers):  # (every layer MoE: no dense MLP is built)
        raise ConfigError(
            f"--ffn-hidden-size {model.ffn_size} is not divisible by --tensor-model-parallel-size {tp}; "
            f"use --ffn-hidden-size {_nearest_multiples(model.ffn_size, tp)}"
        )
    if vp > 1 and pp == 1:
        raise ConfigError(
            f"{vp} virtual stages (--num-virtual-stages-per-pipeline-rank, --num-layers-per-virtual-pipeline-stage or "
            "a --pipeline-model-parallel-layout with more stages than ranks) need --pipeline-model-parallel-size > 1"
        )
    stage_layer_counts(model.num_layers, parallel, world_size, tp * cp)  # raises on a split that cannot be made
    _validate_context_parallel(model, parallel)
    if parallel.tp_comm_overlap and not (tp > 1 and parallel.sequence_parallel):
        raise ConfigError(
            f"--tp-comm-overlap overlaps sequence parallelism's all-gather and reduce-scatter: it needs "
            f"--sequence-parallel and --tensor-model-parallel-size > 1 (got {tp}"
            f"{'' if parallel.sequence_parallel else ', no --sequence-parallel'}); add them or drop the flag"
        )
    if training is None:
        return
    seq = training.seq_length
    if training.train_samples is None and training.train_iters < 1:
        raise ConfigError(f"--train-iters {training.train_iters} must be >= 1")
    training.validate_rampup(parallel.data_parallel_size(world_size))
    if training.train_samples is not None:
        training.resolve_train_iters(parallel.data_parallel_size(world_size))  # raises if not one global batch
    for flag, value in (
        ("--log-interval", training.log_interval),
        ("--eval-interval", training.eval_interval),
    ):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be >= 1")
    # (found by an exploratory run: a negative --exit-interval exited at its multiples, Python's modulo; a seed numpy
    # cannot take failed at the first dataset build. A negative --eval-iters is Megatron's "no evaluation", as 0:
    # its examples/llama/train_llama3.sh passes -1)
    for flag, value, off in (
        ("--exit-interval", training.exit_interval, "leave it out to train to the end"),
        ("--exit-duration-in-mins", training.exit_duration_in_mins, "0, or leaving it out, sets no limit"),
    ):
        if value is not None and value < 0:
            raise ConfigError(f"{flag} {value:g} must be >= 0 ({off})")
    if not 0 <= training.seed < 2**32:  # (the dataset's shuffle is numpy's RandomState(seed), as Megatron's)
        raise ConfigError(f"--seed {training.seed} is out of range: give an integer from 0 to {2**32 - 1}")
    if training.global_batch_size is not None and training.global_batch_size < 1:
        raise ConfigError(f"--global-batch-size {training.global_batch_size} must be positive")
    if seq < 1 or training.micro_batch_size < 1:
        raise ConfigError(f"--seq-length {seq} and --micro-batch-size {training.micro_batch_size} must be positive")
    if training.ddp_bucket_size is not None and training.ddp_bucket_size < 1:  # (it made a bucket per parameter)
        raise ConfigError(
            f"--ddp-bucket-size {training.ddp_bucket_size} must be a positive number of elements; drop it for "
            "Megatron's default (max(40M, 1M x DP x CP))"
        )
    if model.mtp_num_layers >= seq:
        raise ConfigError(
            f"--mtp-num-layers {model.mtp_num_layers} predicts past --seq-length {seq}: no token would carry its "
            f"last depth's loss; use fewer than {seq} depths"
        )
    if model.position_embedding_type == "learned_absolute" and seq > model.max_position_embeddings:
        raise ConfigError(
            f"--seq-length {seq} exceeds --max-position-embeddings {model.max_position_embeddings}; "
            f"raise --max-position-embeddings to at least {seq}"
        )
    if cp > 1 and seq % (2 * cp):
        raise ConfigError(
            f"--seq-length {seq} is not divisible by 2 x --context-parallel-size {cp} = {2 * cp} (the zigzag "
            f"split cuts the sequence into 2 x CP chunks); use --seq-length {_seq_lengths(seq, 2 * cp, model)}"
        )
    if cp > 1 and parallel.sequence_parallel and tp > 1 and (seq // cp) % tp:
        step = cp * math.lcm(2, tp)  # both splits: 2 x CP chunks, and each CP rank's part over TP
        raise ConfigError(
            f"--seq-length {seq} / --context-parallel-size {cp} = {seq // cp} tokens per CP rank is not divisible "
            f"by --tensor-model-parallel-size {tp} with --sequence-parallel; use --seq-length "
            f"{_seq_lengths(seq, step, model)}"
        )
    if parallel.sequence_parallel and tp > 1 and seq % tp:
        raise ConfigError(
            f"--seq-length {seq} is not divisible by --tensor-model-parallel-size {tp} with "
            f"--sequence-parallel; use --seq-length {_seq_lengths(seq, tp, model)} or drop --sequence-parallel"
        )
    dp = parallel.data_parallel_size(world_size)
    mbs = training.micro_batch_size
    gbs = training.global_batch_size
    if gbs is not None and (gbs < 1 or gbs % (mbs * dp)):
        raise ConfigError(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x data-parallel size "
            f"{dp} = {mbs * dp}; use --global-batch-size {_nearest_multiples(gbs, mbs * dp)}"
        )
    micro = training.global_batch(dp) // (mbs * dp)
    ramp = training.rampup_batch_size
    group = parallel.microbatch_group_size
    if group is not None:
        if vp == 1:
            raise ConfigError(
                f"--microbatch-group-size-per-virtual-pipeline-stage {group} groups the interleaved schedule's "
                "micro-batches: add virtual stages (--num-virtual-stages-per-pipeline-rank) or drop it"
            )
        from megatron_lite.pipeline_parallel.schedules import ScheduleError, validate

        sizes = [micro]
        if ramp:  # (each batch the ramp runs: each step's count must group too)
            sizes += [b // (mbs * dp) for _, b in training.rampup_batches(dp)]
        try:
            for m in sizes:
                validate(pp, vp, m, group)
        except ScheduleError as e:
            raise ConfigError(str(e)) from None
    elif vp > 1 and ramp and (odd := [b for _, b in training.rampup_batches(dp) if (b // (mbs * dp)) % pp]):
        # (each batch the ramp runs must interleave too)
        raise ConfigError(
            f"--rampup-batch-size {' '.join(map(str, ramp))}: with virtual pipeline stages each batch the ramp "
            f"runs must hold a multiple of --pipeline-model-parallel-size {pp} micro-batches (--micro-batch-size "
            f"{mbs} x data-parallel {dp} samples each); its batch of {odd[0]} does not: use START and INCREMENT "
            f"multiples of {pp * mbs * dp}"
        )
    if vp > 1 and group is None and micro % pp:
        raise ConfigError(
            f"the interleaved schedule needs micro-batches per step ({micro} = --global-batch-size "
            f"{training.global_batch(dp)} / (--micro-batch-size {mbs} x data-parallel {dp})) to be a multiple of "
            f"--pipeline-model-parallel-size {pp}; use --global-batch-size "
            f"{_nearest_multiples(micro * mbs * dp, pp * mbs * dp)}"
        )
