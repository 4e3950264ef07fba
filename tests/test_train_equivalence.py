"""Training-level equivalence: 10 iterations (fp32, dropout 0, mock data) under TP=2 with sequence
parallelism, DP=2, and TP=2 x DP=2 with gradient accumulation give per-iteration lm_loss and grad_norm
equal to the single-process run within 1e-4 relative."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from megatron_lite.config import ParallelConfig
from megatron_lite.data.builder import build_datasets, resolve_data
from megatron_lite.data.config import DataConfig
from megatron_lite.data.gpt_dataset import GPTDataset
from megatron_lite.data.indexed import IndexedDataset
from megatron_lite.data.mock import MockGPTDataset, collate
from megatron_lite.data.samplers import micro_batch_indices
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.optimizer.lr_scheduler import LRScheduler
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.training.step import eval_step, train_step
from megatron_lite.training.wrap import build_training_model, wrap_for_training

from dist_pool import get_context
from models import CONFIGS

TOL = 1e-4
EMBEDDED_VOCAB = 4096
ITERS, SEQ = 10, 16
OPTIM = OptimizerConfig(
    lr=3e-3, min_lr=3e-4, lr_decay_style="cosine", lr_warmup_iters=2, weight_decay=0.1, clip_grad=1.0
)


def _dataset(data: str, vocab: int):
    """'mock', 'embedded' (the embedded corpus), or 'documents:PREFIX' / 'packed:PREFIX': an indexed dataset
    whose EOD id is vocab - 1, with and without --reset-position-ids --reset-attention-mask."""
    if data == "mock":
        return MockGPTDataset(vocab, SEQ, seed=7)
    if data.startswith(("documents:", "packed:")):
        kind, prefix = data.split(":", 1)
        indexed = IndexedDataset(prefix)
        reset = kind == "documents"
        return GPTDataset(
            indexed, (0, len(indexed)), ITERS * 8, SEQ, 7, os.path.dirname(prefix), vocab - 1, False, reset, reset
        )
    source = resolve_data(DataConfig())  # the embedded corpus: real text, a trained BPE tokenizer
    return build_datasets(source, DataConfig(), (ITERS * 8, 0, 0), SEQ, seed=7)[0]


def train_run(
    name,
    parallel,
    gbs,
    mbs,
    overlap=False,
    bucket_size=None,
    optim=OPTIM,
    data="mock",
    layers=2,
    iters=ITERS,
    kernel_impl="torch",
    distributed_optimizer=False,
    zero_stage=1,
    fsdp2=False,
    overlap_param_gather=False,
    bf16=False,
    mtp=0,
    count_samples=False,
    evaluate=False,
):
    """Per iteration (lm_loss, grad_norm, lr), and with `mtp` depths (--mtp-num-layers) each depth's loss too.
    `bf16`: bf16 weights (FSDP2: bf16 compute on its fp32 shards) with fp32 main weights, as --bf16.
    `count_samples`: the schedule advances by the samples each step reports taking, as a --train-samples or
    --rampup-batch-size run's does (else by one global batch a step). `evaluate`: then the validation loss per
    token of the next global batch, as evaluate() reduces it (returned after the history)."""
    if dist.is_initialized():
        ctx = get_context(parallel)
    else:
        ctx = ParallelContext.virtual(parallel, device=torch.device("cpu"))
    config = CONFIGS[name](num_layers=layers, kernel_impl=kernel_impl, **({"mtp_num_layers": mtp} if mtp else {}))
    if data == "embedded":
        config = dataclasses.replace(config, vocab_size=EMBEDDED_VOCAB)
    ctx.seed(1234)
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = build_training_model(config, ctx, 1234, dtype, fsdp2)
    flags = dict(
        bf16=bf16,
        use_distributed_optimizer=distributed_optimizer,
        zero_stage=zero_stage,
        use_torch_fsdp2=fsdp2,
        overlap_param_gather=overlap_param_gather,
    )
    ddp, opt = wrap_for_training(
        model,
        ctx,
        dataclasses.replace(optim, **flags),
        overlap_grad_reduce=overlap,
        bucket_size=bucket_size,
        compute_dtype=dtype if bf16 else None,
    )
    sched = LRScheduler(optim, iters, samples_per_step=gbs, rampup=count_samples)
    dataset = _dataset(data, config.vocab_size)
    history = []
    for it in range(iters):
        idx = micro_batch_indices(it * gbs, gbs, mbs, ctx.dp.rank, ctx.dp.size)
        batches = [collate([dataset[i] for i in ix], ctx.device) for ix in idx]
        m = train_step(ddp, opt, sched, batches, ctx)
        history.append((m.lm_loss, m.grad_norm, m.lr, *([m.mtp_losses] if mtp else [])))
    if evaluate:
        idx = micro_batch_indices(iters * gbs, gbs, mbs, ctx.dp.rank, ctx.dp.size)
        total, tokens = eval_step(ddp, [collate([dataset[i] for i in ix], ctx.device) for ix in idx], ctx)
        return history, total / tokens
    return history


def _compare(history, ref):
    for it, ((loss, norm, lr), (rloss, rnorm, rlr)) in enumerate(zip(history, ref)):
        assert abs(loss - rloss) <= TOL * abs(rloss), f"iteration {it + 1}: lm_loss {loss} vs {rloss}"
        assert abs(norm - rnorm) <= TOL * abs(rnorm), f"iteration {it + 1}: grad_norm {norm} vs {rnorm}"
        assert lr == rlr


LAYOUTS = {
    "tp2-sp": (2, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), 4, 2),
    "dp2": (2, ParallelConfig(), 4, 2),
    "tp2-dp2-accumulate": (4, ParallelConfig(tensor_model_parallel_size=2), 8, 1),
}


@pytest.mark.parametrize("data", ["mock", "embedded"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_training_equals_single_process(dist, name, layout, data):
    world, parallel, gbs, mbs = LAYOUTS[layout]
    ref = train_run(name, ParallelConfig(), gbs, gbs, data=data)  # one process, the whole batch at once
    results = dist(world, train_run, name, parallel, gbs, mbs, data=data)
    for rank_history in results:
        _compare(rank_history, ref)
    losses = [h[0] for h in ref]
    assert losses[-1] < losses[0]  # it trains


EVAL_LAYOUTS = {
    "tp2-sp": (2, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), 4, 2),
    "cp2": (2, ParallelConfig(context_parallel_size=2), 4, 2),
    "pp2": (2, ParallelConfig(pipeline_model_parallel_size=2), 4, 1),
    "cp2-dp2": (4, ParallelConfig(context_parallel_size=2), 4, 1),
}


@pytest.mark.parametrize("layout", list(EVAL_LAYOUTS))
def test_validation_loss_equals_single_process(dist, layout):
    """The validation loss per token after three iterations, on every rank (the logging rank is the last stage's
    first; each rank returns it): its sums are reduced over data and context parallelism (a CP rank holds a part
    of each sequence's tokens) and, pipelined, from the last stage."""
    world, parallel, gbs, mbs = EVAL_LAYOUTS[layout]
    ref_history, ref = train_run("llama", ParallelConfig(), gbs, gbs, iters=3, evaluate=True)
    for history, loss in dist(world, train_run, "llama", parallel, gbs, mbs, iters=3, evaluate=True):
        _compare(history, ref_history)
        assert abs(loss - ref) <= TOL * abs(ref), (loss, ref)


QK_LAYOUTS = {
    # Each TP rank normalises only its own heads with the shared q/k norm weights: their gradients are
    # partial sums over TP, with or without sequence parallelism.
    "tp2": (2, ParallelConfig(tensor_model_parallel_size=2), 4, 2),
    "tp2-sp-dp2": (4, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), 8, 2),
    "tp2-cp2": (4, ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=2), 4, 2),
    "tp2-pp2": (4, ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 4, 1),
}


@pytest.mark.parametrize("layout", list(QK_LAYOUTS))
@pytest.mark.parametrize("name", ["qwen3", "nemotron", "deepseek"])
def test_newer_architectures_train_like_one_process(dist, name, layout):
    """--qk-layernorm (Qwen3), --rotary-percent 0.5 with --squared-relu and 1p LayerNorms (Nemotron), and
    multi-latent attention with sigmoid-routed MoE (DeepSeek-V3: latents gathered across TP, the shared RoPE key
    part's gradient summed over TP), under tensor, sequence, context (positions split in zigzag) and pipeline
    parallelism."""
    world, parallel, gbs, mbs = QK_LAYOUTS[layout]
    ref = train_run(name, ParallelConfig(), gbs, gbs)
    for rank_history in dist(world, train_run, name, parallel, gbs, mbs):
        _compare(rank_history, ref)


SINK_LAYOUTS = {
    "tp2-sp-dp2": QK_LAYOUTS["tp2-sp-dp2"],
    "tp2-pp2": QK_LAYOUTS["tp2-pp2"],
    # (heads split over CP after the all-to-all: each rank takes its heads' offsets)
    "tp2-cp2-a2a": (4, ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=2, cp_comm_type="a2a"), 4, 2),
    "cp2-allgather": (2, ParallelConfig(context_parallel_size=2, cp_comm_type="allgather"), 4, 2),
}


RING_SINK_LAYOUTS = {  # (no window, which the ring does not run: the offset joins each row after the ring's merge)
    "cp2-p2p": (2, ParallelConfig(context_parallel_size=2), 4, 2),
}


@pytest.mark.parametrize("layout", list(RING_SINK_LAYOUTS))
def test_attention_sinks_under_ring_attention_train_like_one_process(dist, layout):
    """Learned sinks under the ring (p2p): the offsets' gradient is this rank's rows' share, summed over CP with the
    other gradients (checked exactly, with a2a+p2p, by tests/test_attention_variants.py -k under_context)."""
    world, parallel, gbs, mbs = RING_SINK_LAYOUTS[layout]
    ref = train_run("sinks-full", ParallelConfig(), gbs, gbs)
    for rank_history in dist(world, train_run, "sinks-full", parallel, gbs, mbs):
        _compare(rank_history, ref)


@pytest.mark.parametrize("layout", list(SINK_LAYOUTS))
def test_attention_sinks_and_skipped_windows_train_like_one_process(dist, layout):
    """gpt-oss's attention (a learned softmax offset per head, split over TP with the heads; a sliding window on
    every other layer) under tensor, sequence, data, pipeline and context parallelism."""
    world, parallel, gbs, mbs = SINK_LAYOUTS[layout]
    ref = train_run("sinks", ParallelConfig(), gbs, gbs)
    for rank_history in dist(world, train_run, "sinks", parallel, gbs, mbs):
        _compare(rank_history, ref)


GATED_LAYOUTS = {
    "tp2-sp-dp2": QK_LAYOUTS["tp2-sp-dp2"],
    "tp2-pp2": QK_LAYOUTS["tp2-pp2"],  # (the NoPE layer is the second stage's: global layer numbers)
    "tp2-cp2": QK_LAYOUTS["tp2-cp2"],  # (the gate and the L2 norm are per token; RoPE on this rank's positions)
}


LLAMA4_LAYOUTS = {
    "pp2": (2, ParallelConfig(pipeline_model_parallel_size=2), 4, 1),  # (its NoPE, MoE layer is the 2nd stage's)
    "ep2-dp2": (2, ParallelConfig(expert_model_parallel_size=2), 4, 2),
}


@pytest.mark.parametrize("layout", list(LLAMA4_LAYOUTS))
def test_llama4_trains_like_one_process(dist, layout):
    """Llama 4 as converted from Hugging Face (tests/test_convert_llama4.py): the L2 norm on the RoPE layer only,
    interleaved RoPE, a sigmoid top-1 MoE layer weighing the expert's input, with its shared expert."""
    world, parallel, gbs, mbs = LLAMA4_LAYOUTS[layout]
    ref = train_run("llama4", ParallelConfig(), gbs, gbs)
    for rank_history in dist(world, train_run, "llama4", parallel, gbs, mbs):
        _compare(rank_history, ref)


@pytest.mark.parametrize("layout", list(GATED_LAYOUTS))
def test_l2_norm_nope_and_output_gate_train_like_one_process(dist, layout):
    """Llama 4's L2-normalised queries and keys with a NoPE layer (--qk-l2-norm --no-rope-freq 2) and Qwen3-Next's
    output gate (--attention-output-gate: gate rows in each query group of linear_qkv, split over TP with their
    heads) under tensor, sequence, data, pipeline and context parallelism."""
    world, parallel, gbs, mbs = GATED_LAYOUTS[layout]
    ref = train_run("gatednope", ParallelConfig(), gbs, gbs)
    for rank_history in dist(world, train_run, "gatednope", parallel, gbs, mbs):
        _compare(rank_history, ref)
