"""--dry-run: validate the whole configuration for the world size and print, per rank, the parameters and
an estimate of memory, building the model on the meta device (nothing is allocated)."""

from __future__ import annotations

import dataclasses
import os

import torch

from megatron_lite.config import ConfigError, ModelConfig
from megatron_lite.distributed.ddp import tied_embedding_copies
from megatron_lite.layout_validation import validate_layout
from megatron_lite.models.gpt_model import build_model
from megatron_lite.optimizer.layer_wise_optimizer import busiest_state_bytes
from megatron_lite.optimizer.optimizer import group_name, muon_state_bytes, state_bytes_per_param
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.parameters import named_param_meta, owns_copy
from megatron_lite.planner.layout import Layout
from megatron_lite.planner.memory import parameter_state_bytes, rank_memory
from megatron_lite.planner.search import job_layout, sharding_of
from megatron_lite.training.configs import JobConfig
from megatron_lite.training.profiling import validate_profile


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


def _check_data(job: JobConfig) -> None:
    """The indexed datasets, as the run checks them at start-up, where this machine has them (a dry run plans on
    any machine: a dataset absent here is a note, one present with ids past the vocabulary an error)."""
    from megatron_lite.data.builder import check_data, resolve_data

    d = job.data
    if d.mock_data or d.sft or not (d.data_path or d.train_data_path):
        return
    try:
        source = resolve_data(d, log=print)
    except ConfigError as e:  # (a tokenizer not on this machine: _vocab took --vocab-size and said so)
        print(f"note: the data is not checked on this machine: {e}", flush=True)
        return
    absent = [p for _, p in source.prefixes if not (os.path.isfile(p + ".idx") and os.path.isfile(p + ".bin"))]
    if absent:
        print(f"note: on this machine the run would stop: {absent[0]}.idx/.bin not found", flush=True)
        return
    # (no scan of a .bin here: hours on a multi-TB corpus, and a cache written on a planning machine)
    if unchecked := check_data(source, d, print, scan=False):
        print(f"note: the token ids of {unchecked[0]} (and any others) are checked by the run's first start (a scan "
              "of the .bin, cached)", flush=True)  # fmt: skip


def activation_bytes(
    job: JobConfig, model: ModelConfig, layout: Layout, world: int, pp_rank: int, kernel_impl: str
) -> tuple[float, float]:
    """(activations at the schedule's peak on a rank of pipeline stage `pp_rank`, what the step rebuilds or
    copies on top: a recomputed layer, bf16 gradients' fp32 copies): the planner's model, which follows what our
    layers save (within 5% of the activation meter in every case checked, most within 1%). It replaced
    Korthikanti et al.'s GPT formula, which counted attention scores no flash kernel keeps (7x at 1024 tokens)
    and left out MoE's routed copies, the output layer and the loss (0.4x for MoE, 0.02x under full recompute)."""
    dp = job.parallel.data_parallel_size(world)
    low = job.optimizer.bf16 or job.optimizer.fp16
    # (a GPU's dropout masks are bool; PyTorch's CPU dropout keeps its noise in the activations' dtype: the figure
    # of the kernels this machine would run is priced as they run here)
    on_cpu = kernel_impl == "torch" and (not torch.cuda.is_available() or job.distributed_backend == "gloo")
    mask = (2 if low else 4) if on_cpu else 1
    mem = rank_memory(
        dataclasses.replace(model, kernel_impl=kernel_impl), layout, job.training.seq_length,
        job.training.global_batch(dp), low, pp_rank, low and job.optimizer.grad_reduce_in_bf16,
        state_bytes_per_param(job.optimizer), job.lora, mask,
    )  # fmt: skip
    return mem.activations, mem.transient


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
    # the run's start-up checks, in its order (the dry run said "ok" to what the run refused: --profile-ranks
    # past the world, data whose ids exceed the vocabulary)
    validate_layout(model_cfg, job.parallel, world, job.training)
    job = dataclasses.replace(job, training=job.training.resolve_train_iters(job.parallel.data_parallel_size(world)))
    job.optimizer.validate_schedule(job.training.train_iters, job.training.train_samples)
    validate_profile(job.logging, world, job.distributed_backend != "gloo")  # (planned for GPUs on any machine)
    _check_data(job)
    low = job.optimizer.bf16 or job.optimizer.fp16
    sharding = sharding_of(job.optimizer)
    # (a dry run on a machine without a GPU prices the PyTorch kernels it would run; a GPU run's are Triton's)
    gpu_default = model_cfg.kernel_impl == "torch" and not torch.cuda.is_available()
    kernels = [model_cfg.kernel_impl] + (["triton"] if gpu_default else [])
    layout = job_layout(job, world)
    by_stage: dict[int, tuple] = {}  # (every rank of a pipeline stage holds the same activations)
    print(f"dry run: world size {world}, {job.parallel}")
    groups: dict[tuple[int, float], list[int]] = {}
    total = mtp = routed = 0
    for rank in range(world):
        ctx = ParallelContext.virtual(job.parallel, world, rank)
        chunks = build_model(model_cfg, ctx, device="meta")
        if job.lora is not None:
            from megatron_lite.lora.apply import apply_lora

            apply_lora(chunks, model_cfg, job.lora, ctx, seed=0)
        owned = [(chunks.global_name(n), p, m) for n, p, m in named_param_meta(chunks) if owns_copy(m, ctx)]
        total += sum(p.numel() for _, p, _ in owned)
        mtp += sum(p.numel() for n, p, _ in owned if n.startswith("mtp."))
        routed += sum(p.numel() for n, p, m in owned if m.expert and not n.startswith("mtp."))
        if ctx.dp_cp.rank != 0:
            continue  # data-parallel replicas hold the same (experts aside, which the total counts)
        if ctx.pp.rank not in by_stage:
            by_stage[ctx.pp.rank] = tuple(
                activation_bytes(job, model_cfg, layout, world, ctx.pp.rank, k) for k in kernels
            )
        act = by_stage[ctx.pp.rank]
        metas = list(named_param_meta(chunks))
        dense = sum(p.numel() for _, p, m in metas if p.requires_grad and not m.expert)
        expert = sum(p.numel() for _, p, m in metas if p.requires_grad and m.expert)
        frozen = sum(p.numel() for p in chunks.parameters() if not p.requires_grad)
        # QLoRA stores the adapted layers' weights in NF4
        nf4 = sum(m.weight.numel() for m in chunks.modules() if getattr(m, "lora", None) is not None)
        nf4 = nf4 if job.lora is not None and job.lora.qlora else 0
        whole = sum(p.numel() for p in tied_embedding_copies(chunks, ctx))  # (ZeRO-2 keeps their gradients whole)
        state = state_bytes_per_param(job.optimizer)
        if job.optimizer.is_muon:  # (this rank's own mix of Muon's matrices and Adam's embeddings, norms, biases)
            state = muon_state_bytes((group_name(n, m), p.ndim, p.numel()) for n, p, m in metas if p.requires_grad)
        weights, grads, optimizer = parameter_state_bytes(
            dense, expert, ctx.dp_cp.size, ctx.edp.size, sharding, low, job.optimizer.grad_reduce_in_bf16,
            state, whole,
        )  # fmt: skip
        if sharding == "layer-wise":  # (whole tensors a rank: the busiest data-parallel rank's, as the planner)
            named = [(group_name(n, m), p, m) for n, p, m in metas if p.requires_grad]
            optimizer = busiest_state_bytes(named, ctx, low)
        trained = weights + grads + optimizer
        groups.setdefault((dense + expert + frozen, trained, frozen, nf4, act), []).append(rank)
    worst = 0.0
    for (n, trained, frozen, nf4, act), ranks in sorted(groups.items(), reverse=True):
        # a frozen (LoRA base) weight has no gradient or optimizer state: its bytes only (NF4: 4.127 bits)
        states = trained + (frozen - nf4) * (2 if low else 4) + nf4 * 4.127 / 8
        (saved, extra), *gpu = act
        worst = max(worst, states + saved + extra)
        also = f" + ~{_bytes(extra)} rebuilt or copied during the backward and step" if extra else ""
        also += f" (~{_bytes(gpu[0][0])} activations with a GPU's Triton kernels)" if gpu else ""
        activations = f"~{_bytes(saved)} activations at the schedule's peak{also}"
        print(
            f"  ranks {ranks} (and their data-parallel replicas): {_count(n)} parameters, {_bytes(states)} "
            f"weights+gradients+optimizer, {activations}"
        )

    # (DeepSeek-V3's 671B are its main model's: its checkpoint's 685B include the multi-token-prediction module)
    extra = f" + {_count(mtp)} in multi-token prediction" if mtp else ""
    # the model's count, as Hugging Face's; the padded rows (a multiple of --make-vocab-size-divisible-by x TP)
    # are the layout's, said apart
    rows = model_cfg.padded_vocab_size(job.parallel.tp) - model_cfg.vocab_size
    padding = rows * model_cfg.hidden_size * (2 if model_cfg.untie_embeddings_and_output_weights else 1)
    main = total - mtp - padding
    if routed:  # (a token's: its top-k of the routed experts, every other weight)
        extra += f", {_count(main - routed + routed * model_cfg.moe_router_topk / model_cfg.num_experts)} active"
    print(
        f"dry run ok: {model_cfg.num_layers} layers, vocabulary {model_cfg.vocab_size}, {_count(main)} parameters"
        f"{extra}" + (f" ({_count(main + padding)} with the vocabulary padded to {rows + model_cfg.vocab_size})"
                      if rows else "")
    )  # fmt: skip
    if worst > ACCELERATOR_BYTES:
        print(
            f"warning: the largest rank needs ~{_bytes(worst)}, more than an 80 GiB accelerator; shard further "
            "(tensor/pipeline parallelism, recomputation, --use-distributed-optimizer, --use-torch-fsdp2); "
            "tools/plan_parallelism.py lists the layouts that fit"
        )
    return 0
