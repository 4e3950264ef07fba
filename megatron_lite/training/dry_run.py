"""--dry-run: validate the whole configuration for the world size and print, per rank, the parameters and
an estimate of memory, building the model on the meta device (nothing is allocated)."""

from __future__ import annotations

import dataclasses
import os

from megatron_lite.config import ConfigError
from megatron_lite.distributed.ddp import tied_embedding_copies
from megatron_lite.layout_validation import validate_layout
from megatron_lite.models.gpt_model import build_model
from megatron_lite.optimizer.optimizer import state_bytes_per_param
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.parameters import named_param_meta, owns_copy
from megatron_lite.pipeline_parallel.schedules import build_schedule, max_in_flight
from megatron_lite.planner.memory import parameter_state_bytes
from megatron_lite.planner.search import sharding_of
from megatron_lite.training.configs import JobConfig


def _vocab(job: JobConfig) -> int:
    """The vocabulary the run would have, branch by branch as builder.resolve_data finds it (and refused where
    the run would refuse it), without reading any data. Where the run reads it from the tokenizer, a dry run on
    a machine without the tokenizer's files takes --vocab-size instead, when given."""
    from megatron_lite.data.builder import check_vocabulary_flags
    from megatron_lite.data.tokenizers import tokenizer_from_flags

    d = job.data
    check_vocabulary_flags(d)

    def from_tokenizer() -> int:
        try:
            return tokenizer_from_flags(d).vocab_size
        except ConfigError:
            if d.vocab_size and d.tokenizer_type != "NullTokenizer":
                return d.vocab_size
            raise

    if d.mock_data:
        null = d.tokenizer_type in (None, "NullTokenizer")
        return d.vocab_size + 1 if null else from_tokenizer()  # (NullTokenizer's end-of-document id)
    if d.sft:
        return from_tokenizer()
    if d.data_path or d.train_data_path:
        return from_tokenizer()
    from megatron_lite.data.embedded import EMBEDDED_VOCAB

    return EMBEDDED_VOCAB  # the embedded corpus's tokenizer (the data flags given none)


def activation_bytes(job: JobConfig, bytes_per_value: int) -> float:
    """Per-layer activation memory of one micro-batch (Korthikanti et al. 2022: s b h (34 + 5 a s / h)
    bytes in 16-bit, divided by TP with sequence parallelism); selective recomputation drops the attention
    term, full recomputation keeps only each layer's input. Under CP, per rank: seq / CP tokens."""
    m, t, p = job.model, job.training, job.parallel
    # Under context parallelism a rank holds seq / CP tokens (whose queries still see every key).
    full, s, b, h, a = t.seq_length, t.seq_length // p.cp, t.micro_batch_size, m.hidden_size, m.num_attention_heads
    scale = bytes_per_value / 2
    if m.recompute_granularity == "full":
        return 2 * s * b * h * scale / (p.tp if p.sequence_parallel else 1)
    per = s * b * h * (34 + (0 if m.recompute_granularity == "selective" else 5 * a * full / h))
    return per * scale / p.tp if p.sequence_parallel else (s * b * h * 10 + (per - s * b * h * 10) / p.tp) * scale


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


ACCELERATOR_BYTES = 80 * 2**30  # an H100/A100 80 GB; the warning below is against this


def dry_run(job: JobConfig, ckpt_path: str | None = None) -> int:
    """`ckpt_path`: the checkpoint the run would load (its vocabulary counts, as in the run)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    vocab = _vocab(job)
    if ckpt_path is not None:  # (as the run: an embedding larger than the tokenizer's ids, Qwen's, is the checkpoint's)
        from megatron_lite.checkpoint.checkpointing import read_metadata

        vocab = max(vocab, read_metadata(ckpt_path)["config"]["model"]["vocab_size"])
    model_cfg = dataclasses.replace(job.model, vocab_size=vocab)
    validate_layout(model_cfg, job.parallel, world, job.training)
    job = dataclasses.replace(job, training=job.training.resolve_train_iters(job.parallel.data_parallel_size(world)))
    job.optimizer.validate_schedule(job.training.train_iters, job.training.train_samples)
    low = job.optimizer.bf16 or job.optimizer.fp16
    sharding = sharding_of(job.optimizer)
    per_layer = activation_bytes(dataclasses.replace(job, model=model_cfg), 2 if low else 4)
    dp = job.parallel.data_parallel_size(world)
    micro = job.training.global_batch(dp) // (job.training.micro_batch_size * dp)
    print(f"dry run: world size {world}, {job.parallel}")
    groups: dict[tuple[int, float], list[int]] = {}
    total = mtp = 0
    for rank in range(world):
        ctx = ParallelContext.virtual(job.parallel, world, rank)
        chunks = build_model(model_cfg, ctx, device="meta")
        if job.lora is not None:
            from megatron_lite.lora.apply import apply_lora

            apply_lora(chunks, model_cfg, job.lora, ctx, seed=0)
        owned = [(chunks.global_name(n), p) for n, p, meta in named_param_meta(chunks) if owns_copy(meta, ctx)]
        total += sum(p.numel() for _, p in owned)
        mtp += sum(p.numel() for n, p in owned if n.startswith("mtp."))
        if ctx.dp_cp.rank != 0:
            continue  # data-parallel replicas hold the same (experts aside, which the total counts)
        layers = sum(len(c.decoder.layers) + (len(c.mtp.layers) if c.mtp is not None else 0) for c in chunks)
        in_flight = max(
            max_in_flight(
                build_schedule(ctx.pp.size, ctx.vp_size, micro, ctx.pp.rank, group=ctx.parallel.microbatch_group_size)
            ),
            1,
        )
        act = per_layer * layers / len(chunks) * in_flight  # micro-batches alive at once, each through a chunk
        metas = list(named_param_meta(chunks))
        dense = sum(p.numel() for _, p, m in metas if p.requires_grad and not m.expert)
        expert = sum(p.numel() for _, p, m in metas if p.requires_grad and m.expert)
        frozen = sum(p.numel() for p in chunks.parameters() if not p.requires_grad)
        # QLoRA stores the adapted layers' weights in NF4
        nf4 = sum(m.weight.numel() for m in chunks.modules() if getattr(m, "lora", None) is not None)
        nf4 = nf4 if job.lora is not None and job.lora.qlora else 0
        whole = sum(p.numel() for p in tied_embedding_copies(chunks, ctx))  # (ZeRO-2 keeps their gradients whole)
        trained = sum(
            parameter_state_bytes(
                dense, expert, ctx.dp_cp.size, ctx.edp.size, sharding, low, job.optimizer.grad_reduce_in_bf16,
                state_bytes_per_param(job.optimizer), whole,
            )
        )  # fmt: skip
        groups.setdefault((dense + expert + frozen, trained, frozen, nf4, act), []).append(rank)
    worst = 0.0
    for (n, trained, frozen, nf4, act), ranks in sorted(groups.items(), reverse=True):
        # a frozen (LoRA base) weight has no gradient or optimizer state: its bytes only (NF4: 4.127 bits)
        states = trained + (frozen - nf4) * (2 if low else 4) + nf4 * 4.127 / 8
        worst = max(worst, states + act)
        print(
            f"  ranks {ranks} (and their data-parallel replicas): {_count(n)} parameters, {_bytes(states)} "
            f"weights+gradients+optimizer, ~{_bytes(act)} activations at the schedule's peak"
        )

    # (DeepSeek-V3's 671B are its main model's: its checkpoint's 685B include the multi-token-prediction module)
    extra = f" + {_count(mtp)} in multi-token prediction" if mtp else ""
    print(
        f"dry run ok: {model_cfg.num_layers} layers, vocabulary {model_cfg.vocab_size}, "
        f"{_count(total - mtp)} parameters{extra} (vocabulary padding included)"
    )
    if worst > ACCELERATOR_BYTES:
        print(
            f"warning: the largest rank needs ~{_bytes(worst)}, more than an 80 GiB accelerator; shard further "
            "(tensor/pipeline parallelism, recomputation, --use-distributed-optimizer, --use-torch-fsdp2); "
            "tools/plan_parallelism.py lists the layouts that fit"
        )
    return 0
