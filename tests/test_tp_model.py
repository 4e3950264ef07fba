"""The whole model under tensor (and sequence) parallelism equals the single-process model.

Logits, loss and the gradient of every parameter agree to 1e-5 per tensor (||a-b||/||b||) at TP=2 and
TP=4, with and without --sequence-parallel, for a Llama configuration (GQA, RoPE, SwiGLU, untied) and a
GPT-2 configuration (learned positions, biases, tied embeddings), with a vocabulary TP=4 must pad.
"""

from __future__ import annotations

import pytest
import torch

from megatron_lite.config import ParallelConfig
from megatron_lite.models.gpt_model import GPTModel
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.tensor_parallel.grads import allreduce_sequence_parallel_grads
from megatron_lite.tensor_parallel.sharding import ShardSpec

from dist_pool import get_context
from models import CONFIGS, VOCAB, perturbed_full_state, rel, specs, unshard_all

TOL = 1e-5
SEQ, BATCH = 16, 2


def forward_backward(config, parallel, full_state, ids, labels, reduce_sp_grads=True):
    """Runs on every rank (and, with a virtual context, on one process)."""
    ctx = get_context(parallel) if parallel.tp > 1 else ParallelContext.virtual(parallel, device=torch.device("cpu"))
    ctx.seed(0)
    model = GPTModel(config, ctx)
    model.load_full_state_dict(full_state)
    logits = model(ids)
    loss = model(ids, labels=labels).mean()
    loss.backward()
    if reduce_sp_grads:
        allreduce_sequence_parallel_grads(model, ctx.tp, etp=ctx.etp)
    grads = {model.global_name(n): p.grad for n, p in model.named_parameters() if p.requires_grad}  # (not expert_bias)
    return {"logits": logits.detach(), "loss": loss.detach(), "grads": grads}


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return ids, labels


def _compare(dist, name, tp, sp, reduce_sp_grads=True):
    config = CONFIGS[name]()
    full = perturbed_full_state(config)
    ids, labels = _inputs()
    ref = forward_backward(config, ParallelConfig(), full, ids, labels)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp)
    world = 4
    out = dist(world, forward_backward, config, parallel, full, ids, labels, reduce_sp_grads)
    errors = {}
    padded = config.padded_vocab_size(tp)
    logits = ShardSpec(2, (VOCAB,), (padded,), tp).unshard([out[r]["logits"] for r in range(tp)])
    errors["logits"] = rel(logits, ref["logits"][..., :VOCAB])
    errors["loss"] = rel(out[0]["loss"], ref["loss"])
    spec_map = specs(config, parallel, world)
    grads = unshard_all([o["grads"] for o in out], spec_map, tp)
    ref_grads = unshard_all([ref["grads"]], specs(config, ParallelConfig(), 1), 1)  # padding trimmed
    for k, g in grads.items():
        errors[k] = rel(g, ref_grads[k])
        if spec_map[k] is None:  # replicated parameters: every TP rank holds the same gradient
            for rank in range(1, tp):
                errors[f"{k} (rank {rank} vs 0)"] = rel(out[rank]["grads"][k], out[0]["grads"][k])
    assert set(grads) == set(ref["grads"])
    return errors


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen3", "deepseek"])
def test_tp_equals_single_process(dist, name, tp, sp):
    errors = _compare(dist, name, tp, sp)
    bad = {k: v for k, v in errors.items() if not v < TOL}
    assert not bad, f"{name} TP={tp} SP={sp}: relative errors above {TOL}: {bad}"


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_missing_sequence_parallel_grad_reduce_is_caught(dist, name):
    """The comparison above can fail: skip the TP all-reduce of norm-weight (and bias, position
    embedding) gradients under sequence parallelism and the norm gradients disagree."""
    errors = _compare(dist, name, 2, True, reduce_sp_grads=False)
    norm = {k: v for k, v in errors.items() if "layernorm.weight" in k and "rank" not in k}
    assert norm and min(norm.values()) > 1e-2, norm
    assert errors["logits"] < TOL  # the forward is still right; only the reduction is missing


def test_missing_qk_layernorm_grad_reduce_is_caught(dist):
    """--qk-layernorm without sequence parallelism: each TP rank normalises only its own heads, so the q/k
    norm weights' gradients are partial there too; without the TP sum they disagree."""
    errors = _compare(dist, "qwen3", 2, False, reduce_sp_grads=False)
    qk = {k: v for k, v in errors.items() if ("q_layernorm" in k or "k_layernorm" in k) and "rank" not in k}
    assert len(qk) == 4 and min(qk.values()) > 1e-2, qk
    assert errors["logits"] < TOL
