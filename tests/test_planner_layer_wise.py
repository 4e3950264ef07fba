"""The planner's step-time memory of --optimizer dist_muon, held to what the runtime allocates: the weights'
all-gather after each step (optimizer/layer_wise_optimizer.py) and, with bf16 gradients, the step's fp32 copies of
the busiest rank's owned gradients. On a CPU --log-memory-breakdown measures no transients, so a dispatch mode counts
the bytes of every tensor the gather makes while it lives (views and in-place ops make none)."""

from __future__ import annotations

import weakref

import pytest
import test_planner as tp_
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lite.planner.layout import Layout
from megatron_lite.planner.memory import layer_wise_split_of, rank_memory
from megatron_lite.planner.params import trained_tensors

from models import deepseek_config, gpt2_config, llama_config, nemotron_h_config

# MoE with a tied vocabulary of 2048: at DP=2 x EP=2 the rank with the embedding steps more than half the dense
# weights, and each rank its experts whole (expert-DP 1)
tp_.MODELS["moe_tied_vocab"] = lambda **kw: tp_.moe_llama(
    vocab_size=2048, untie_embeddings_and_output_weights=False, **kw
)


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors made inside the mode that are still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # (a new tensor, not a view or in place, nor a collective's output handed back unannotated)
        given = {
            t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        if all(r.alias_info is None for r in func._schema.returns):
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                    n = t.untyped_storage().nbytes()
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._free, n)
        return out


def measure_gather(name: str, layout: Layout, bf16: bool) -> dict:
    """test_planner.measure, with the peak the step's all-gather holds and each all-gather's buffers' bytes."""
    from megatron_lite.optimizer import layer_wise_optimizer as lw

    peaks, buffers = [], []
    gather, all_gather = lw.LayerWiseDistributedOptimizer._gather_params, lw.all_gather_tensor

    def metered(self):
        with LiveBytes() as meter:
            gather(self)
        peaks.append(meter.peak)

    def spy(out, inp, group=None):
        buffers.append((out.numel() * out.element_size(), inp.numel() * inp.element_size()))
        return all_gather(out, inp, group=group)

    lw.LayerWiseDistributedOptimizer._gather_params, lw.all_gather_tensor = metered, spy
    try:
        result = tp_.measure(name, layout, optimizer="dist_muon", bf16=bf16, iters=0)
    finally:
        lw.LayerWiseDistributedOptimizer._gather_params, lw.all_gather_tensor = gather, all_gather
    return {**result, "gather_peak": max(peaks), "buffers": buffers}


@pytest.mark.parametrize("bf16", [False, True])
def test_dist_muon_weight_gather_is_priced(dist, bf16):
    """MoE at DP=2: the dense weights all-gathered over DP, the experts over expert-DP, each group in place (this
    rank's part of the output its input) into one buffer of the largest group's width x group size. The planner's
    transient is what the step adds past the activations (freed by then): its gather equals the measured peak of the
    gather's allocations. The planner priced none (at 8xH100, Llama-3 8B, 57 of 539 'fitting' layer-wise rows did
    not fit at the step), and the runtime held a flat input, a torch.cat copy of the rank's own weights and,
    while the next was made, the previous group's buffer (or a collective's work held its input a while on)."""
    layout = Layout(dp=2, sharding="layer-wise", micro_batch_size=2)
    results = dist(2, measure_gather, "moe", layout, bf16)
    config = layout.model_config(tp_.MODELS["moe"](num_layers=4, kernel_impl="torch"))
    est = rank_memory(config, layout, tp_.SEQ, tp_.GBS, bf16, 0)
    a = 2 if bf16 else 4
    widths = layer_wise_split_of(config, layout, 0, bf16).widths
    assert [g for g, _ in widths] == [2, 2]  # (dense and expert groups)
    for r in results:  # every all-gather's output and input, as the split's widths say
        assert sorted(r["buffers"]) == sorted((a * w * g, a * w) for g, w in widths)
    measured = max(r["gather_peak"] for r in results)
    assert measured == a * max(w * g for g, w in widths)
    # past the activations the step holds the gather (at this batch the activations weigh more; at one short
    # micro-batch, less: the split is the same)
    assert est.activations + est.transient == max(est.activations, measured)
    short = rank_memory(config, Layout(dp=2, sharding="layer-wise", micro_batch_size=1), 8, 2, bf16, 0)
    assert short.activations < measured
    assert short.activations + short.transient == pytest.approx(measured)


def measure_fp32_copies(name: str, layout: Layout) -> dict:
    """test_planner.measure under bf16 with bf16 gradients, with the bytes of the step's fp32 gradient copies."""
    from megatron_lite.optimizer import optimizer as opt

    copies, fp32 = [], opt.fp32

    def spy(grads):
        out = fp32(grads)
        copies.append(sum(o.numel() * o.element_size() for g, o in zip(grads, out) if g is not o))
        return out

    opt.fp32 = spy
    try:
        result = tp_.measure(name, layout, optimizer="dist_muon", bf16=True, grads_bf16=True, iters=0)
    finally:
        opt.fp32 = fp32
    return {**result, "copies": max(copies)}


def test_dist_muon_bf16_gradients_copied_by_the_busiest_rank(dist):
    """With bf16 gradients the step copies the gradients of the parameters this rank owns to fp32: whole tensors, so
    the busiest rank's (the split's owned), not an even share of the stage. At DP=2 x EP=2 with a tied vocabulary
    the rank that steps the embedding copies 24% more than the even split the planner priced."""
    layout = Layout(dp=2, ep=2, sharding="layer-wise", micro_batch_size=2)
    results = dist(2, measure_fp32_copies, "moe_tied_vocab", layout)
    config = layout.model_config(tp_.MODELS["moe_tied_vocab"](num_layers=4, kernel_impl="torch"))
    split = layer_wise_split_of(config, layout, 0, True)
    busiest = max(results, key=lambda r: r["memory"]["mem_optimizer_bytes"])
    assert busiest["memory"]["mem_optimizer_bytes"] == split.optimizer
    assert busiest["copies"] == 4 * split.owned
    # past the activations (at one short micro-batch, fewer than the copies) the step holds the copies, more than
    # the weights' all-gather after it
    short = rank_memory(config, Layout(dp=2, ep=2, sharding="layer-wise", micro_batch_size=1), 8, 2, True, 0, True)
    assert short.activations < busiest["copies"]
    assert short.activations + short.transient == pytest.approx(busiest["copies"])


ORDERED = {  # what the order inside a layer, of the layers and of the embeddings and output layer turns on
    "gpt2": lambda: gpt2_config(num_layers=4),  # LayerNorm's weight and bias, the linears' biases, positions
    "mla_mtp": lambda: deepseek_config(num_layers=4, qk_layernorm=True, normalization="LayerNorm", mtp_num_layers=1),
    "hybrid": lambda: nemotron_h_config(num_layers=4),  # Mamba's own parameters first, MoE's untrained expert_bias
    "gated_qk": lambda: llama_config(
        num_layers=4, qk_layernorm=True, add_qkv_bias=True, softmax_type="learnable", attention_output_gate=True
    ),
    "moe": lambda: tp_.moe_llama(  # the shared expert's gate
        num_layers=4, moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True
    ),
}


@pytest.mark.parametrize("name", ORDERED)
def test_the_split_takes_the_trained_tensors_in_the_runtimes_order(name):
    """dist_muon's split breaks ties of size by the order of the trained parameters, so the planner's list of them
    (params.trained_tensors: elements, Muon's or Adam's, expert or not) is the built model's named_parameters on
    every rank: embeddings first, no untrained expert_bias, LayerNorm's weight and bias two tensors."""
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.optimizer.optimizer import group_name, runs_muon
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.parameters import named_param_meta

    for layout in (Layout(), Layout(tp=2, sequence_parallel=True), Layout(pp=2, vp=2)):
        config = layout.model_config(ORDERED[name]())
        for rank in range(layout.world):
            ctx = ParallelContext.virtual(layout.parallel_config(), layout.world, rank)
            net = build_model(config, ctx, device="meta")
            built = [
                (p.numel(), runs_muon(group_name(n, m), p.ndim), m.expert)
                for n, p, m in named_param_meta(net)
                if p.requires_grad
            ]
            planned = [(n, matrix is not None, e) for n, matrix, e in trained_tensors(config, layout, ctx.pp.rank)]
            assert planned == built, (name, layout.describe(), rank)
