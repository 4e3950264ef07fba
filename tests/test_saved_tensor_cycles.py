"""Saved-tensor hooks must not keep a step's activations past its backward. A hook that packs the tensor itself
gives an output's node a reference to itself (the tensor holds its grad_fn), a cycle through C++ that Python's
collector cannot see: where the node never runs in the backward (a MoE router's scores with no balancing loss
on them) the cycle, and everything the hook's closure reads, outlives the step. --recompute-modules layernorm
runs each MLP under such hooks; so does the activation meter."""

from __future__ import annotations

import gc

import torch

from megatron_lite.config import ParallelConfig
from megatron_lite.models.gpt_model import GPTModel
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.training import memory

from live_memory import LiveBytes
from models import VOCAB, llama_config

S, B = 32, 2


def _moe_model(modules: tuple[str, ...] = ("layernorm",), **kw) -> GPTModel:
    recompute = dict(recompute_granularity="selective", recompute_modules=modules) if modules else {}
    config = llama_config(num_layers=3, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, **recompute, **kw)
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    return GPTModel(config, ctx, seed=7).train()


def _step(model: GPTModel, seed: int) -> None:
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))
    model(ids, labels=ids).mean().backward()


def _left_after_a_step(model: GPTModel) -> int:
    """Bytes a second step leaves alive, its gradients aside."""
    _step(model, 0)
    with LiveBytes() as live:
        _step(model, 1)
        gc.collect()
    grads = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    return sum({ptr: n for ref, ptr, n in live.made if not ref.expired() and ptr not in grads}.values())


def test_layernorm_recompute_keeps_nothing_after_the_backward():
    """Per step, each MoE layer's pre-MLP sum and router scores stayed alive for good (with Megatron's default
    --moe-aux-loss-coeff 0): the [s, b, h] residual a layer a micro-batch on a real run, until it ran out of
    memory. Now a step leaves what it leaves without the recomputation (its caches, the MoE statistics' rows)."""
    plain, recomputed = _left_after_a_step(_moe_model(())), _left_after_a_step(_moe_model())
    assert recomputed - plain < S * B * 64 * 4, (recomputed, plain)  # (less than one [s, b, h] in all)


def test_the_activation_meter_counts_each_micro_batch_once():
    """The meter's hooks kept the same cycles alive: each micro-batch's leftovers counted on top of the next's,
    the peak of four micro-batches over one's."""
    peaks = []
    for micro_batches in (1, 4):
        model = _moe_model(moe_aux_loss_coeff=0.0)
        context, meter = memory.measure(model)
        with context:
            for i in range(micro_batches):
                _step(model, i)
        peaks.append(meter.peak)
        assert meter.current == 0, meter.current
    assert peaks[1] == peaks[0], peaks
