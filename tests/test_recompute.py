"""Activation recomputation (full uniform, full block, selective) gives gradients identical to no
recomputation at TP=2 with dropout on: the recomputed forward must replay the same dropout masks from
both the shared generator and the per-TP-rank generator."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from megatron_lite.config import ParallelConfig
from megatron_lite.models.attention import CoreAttention
from megatron_lite.models.gpt_model import GPTModel
from megatron_lite.models.mlp import MLP
from megatron_lite.models.transformer import TransformerLayer
from megatron_lite.moe.layer import MoELayer
from megatron_lite.tensor_parallel.grads import allreduce_sequence_parallel_grads
from megatron_lite.training import memory

from dist_pool import get_context
from live_memory import LiveBytes
from models import CONFIGS, VOCAB

RECOMPUTE = {
    "none": {},
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "selective": dict(recompute_granularity="selective"),
    "selective-all": dict(recompute_granularity="selective", recompute_modules=("core_attn", "layernorm", "mlp")),
}


# Megatron's modules for MoE and multi-latent attention (DeepSeek-shaped: a dense layer, then MoE layers with a
# shared expert)
DEEPSEEK_RECOMPUTE = {
    "none": {},
    "moe": dict(recompute_granularity="selective", recompute_modules=("moe",)),
    "moe_act": dict(recompute_granularity="selective", recompute_modules=("moe_act",)),
    "shared_experts": dict(recompute_granularity="selective", recompute_modules=("shared_experts",)),
    "mla_up_proj": dict(recompute_granularity="selective", recompute_modules=("mla_up_proj",)),
    # the whole MoE layer recomputed: its shared expert and experts' activation are not checkpointed again inside
    "moe-nested": dict(recompute_granularity="selective", recompute_modules=("moe", "moe_act", "shared_experts")),
    "deepseek-recipe": dict(
        recompute_granularity="selective",
        recompute_modules=("core_attn", "layernorm", "mla_up_proj", "moe_act", "shared_experts", "mlp"),
    ),
}


def run_with_recompute(
    name: str, sp: bool, recompute: str, dropout: float, lora_targets: tuple[str, ...] = (), **model_kw
):
    """`lora_targets`: adapters (dropout 0.2, nonzero B) on these layers, the rest frozen."""
    table = DEEPSEEK_RECOMPUTE if name == "deepseek" else RECOMPUTE
    config = CONFIGS[name](
        num_layers=3, hidden_dropout=dropout, attention_dropout=dropout, **table[recompute], **model_kw
    )
    ctx = get_context(ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=sp))
    ctx.seed(123)
    model = GPTModel(config, ctx, seed=7).train()
    if lora_targets:
        from megatron_lite.lora.apply import apply_lora
        from megatron_lite.lora.config import LoraConfig

        apply_lora(model, config, LoraConfig(rank=4, dropout=0.2, target_modules=lora_targets), ctx, seed=5)
        with torch.no_grad():  # B starts at zero; nonzero, each dropout mask shapes the output
            for n, p in model.named_parameters():
                if n.endswith(".B"):
                    p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    calls = {"layer": 0, "core_attn": 0, "mlp": 0, "moe": 0}
    for m in model.modules():
        # (isinstance: a MoE layer's shared expert is an MLP subclass, SharedExpertMLP, with its gate)
        kinds = ((TransformerLayer, "layer"), (CoreAttention, "core_attn"), (MLP, "mlp"), (MoELayer, "moe"))
        kind = next((k for cls, k in kinds if isinstance(m, cls)), None)
        if kind:
            m.register_forward_pre_hook(lambda *_, kind=kind: calls.__setitem__(kind, calls[kind] + 1))
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
    labels = torch.randint(0, VOCAB, (2, 16), generator=gen)
    losses = []
    measuring, meter = memory.measure(model)
    with measuring:
        for step in range(2):  # two steps: the generators must also be left where no recomputation leaves them
            with LiveBytes() if step == 0 else contextlib.nullcontext() as live:
                loss = model(ids, labels=labels).mean()
            if step == 0:
                forward_live = live.alive()  # what the backward will need, however it is kept
            loss.backward()
            losses.append(loss.detach())
    allreduce_sequence_parallel_grads(model, ctx.tp, etp=ctx.etp)
    return {
        "losses": torch.stack(losses),
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "calls": calls,
        "rng_after": torch.get_rng_state(),
        "activation_peak": meter.peak,
        "forward_live": forward_live,
    }


def _assert_identical(mine: dict, base: dict, what) -> None:
    """Bit-identical losses, gradients (None where the reference has none) and generator state after the run."""
    assert torch.equal(mine["losses"], base["losses"]), what
    for k, g in base["grads"].items():
        assert (g is None and mine["grads"][k] is None) or torch.equal(mine["grads"][k], g), (*what, k)
    assert torch.equal(mine["rng_after"], base["rng_after"]), what


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2+sp"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_recompute_gradients_identical_with_dropout(dist, name, sp):
    runs = {r: dist(2, run_with_recompute, name, sp, r, 0.2) for r in RECOMPUTE}
    no_dropout = dist(2, run_with_recompute, name, sp, "none", 0.0)
    base = runs["none"]
    # Dropout on activations every TP rank holds whole draws the same mask on each (the default generator, seeded
    # alike across TP): the norm weights' gradients, which no rank splits, are the same bits on both ranks
    norms = [n for n, g in base[0]["grads"].items() if "norm" in n and g is not None]
    assert norms and all(torch.equal(base[0]["grads"][n], base[1]["grads"][n]) for n in norms), norms
    for rank in range(2):
        # Dropout is really on: the loss differs from the dropout-free run.
        assert not torch.allclose(base[rank]["losses"], no_dropout[rank]["losses"])
        for recompute, out in runs.items():
            _assert_identical(out[rank], base[rank], (recompute, rank))
    # Recomputation really happened (two steps, three layers): forward starts counted per module kind
    # (pre-hooks: non-reentrant checkpointing may stop a recomputation before a module returns).
    calls = {r: out[0]["calls"] for r, out in runs.items()}
    assert calls["none"] == {"layer": 6, "core_attn": 6, "mlp": 6, "moe": 0}
    assert calls["full-uniform"]["layer"] == 12
    assert calls["full-block"]["layer"] == 6 + 4
    assert calls["selective"] == {"layer": 6, "core_attn": 12, "mlp": 6, "moe": 0}
    assert calls["selective-all"] == {"layer": 6, "core_attn": 12, "mlp": 12, "moe": 0}


def test_config_dataclass_is_frozen():
    config = CONFIGS["llama"]()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_layers = 3


def test_megatron_recompute_modules_for_moe_and_mla(dist):
    """DeepSeek-shaped at TP=2 with SP and dropout: each of Megatron's MoE / MLA modules gives the same losses and
    gradients as no recomputation, recomputes what it names, and keeps fewer activations."""
    runs = {r: dist(2, run_with_recompute, "deepseek", True, r, 0.2) for r in DEEPSEEK_RECOMPUTE}
    base = runs["none"]
    for recompute, out in runs.items():
        for rank in range(2):
            _assert_identical(out[rank], base[rank], (recompute, rank))
        # mla_up_proj drops the q, k, v the attention saves; with dropout SDPA takes its math path, which saves
        # its own copies instead (checked without dropout below)
        if recompute not in ("none", "mla_up_proj"):
            assert out[0]["activation_peak"] < base[0]["activation_peak"], recompute
    no_dropout = {r: dist(2, run_with_recompute, "deepseek", True, r, 0.0) for r in ("none", "mla_up_proj")}
    for rank in range(2):
        _assert_identical(no_dropout["mla_up_proj"][rank], no_dropout["none"][rank], ("mla_up_proj", rank))
    assert no_dropout["mla_up_proj"][0]["activation_peak"] < no_dropout["none"][0]["activation_peak"]
    # LoRA adapters with dropout on the up-projections: the regenerated q, k, v draw the forward's masks
    up = ("linear_q_up_proj", "linear_kv_up_proj")
    adapted = {r: dist(2, run_with_recompute, "deepseek", True, r, 0.0, up) for r in ("none", "mla_up_proj")}
    for rank in range(2):
        _assert_identical(adapted["mla_up_proj"][rank], adapted["none"][rank], ("mla_up_proj", "lora", rank))
    # two steps, three layers (one dense: its MLP; two MoE: their shared experts are MLPs too)
    calls = {r: out[0]["calls"] for r, out in runs.items()}
    assert calls["none"] == {"layer": 6, "core_attn": 6, "mlp": 6, "moe": 4}
    assert calls["moe"] == {"layer": 6, "core_attn": 6, "mlp": 6 + 4, "moe": 8}  # "mlp" here: the shared experts
    assert calls["moe-nested"] == calls["moe"]
    assert calls["shared_experts"] == {"layer": 6, "core_attn": 6, "mlp": 6 + 4, "moe": 4}
    assert calls["mla_up_proj"] == {"layer": 6, "core_attn": 6, "mlp": 6, "moe": 4}  # q, k, v made again, not attention
    assert calls["deepseek-recipe"] == {"layer": 6, "core_attn": 12, "mlp": 6 + 2 + 4, "moe": 4}


def test_moe_act_frees_memory_on_squared_relu_experts(dist):
    """--recompute-modules moe_act on squared-ReLU experts (Nemotron's activation): identical losses and gradients,
    and fewer activations kept (the activation keeps only fc1's output, which the regeneration needs anyway)."""
    runs = {
        r: dist(2, run_with_recompute, "deepseek", True, r, 0.0, activation="squared_relu") for r in ("none", "moe_act")
    }
    for rank in range(2):
        _assert_identical(runs["moe_act"][rank], runs["none"][rank], ("moe_act", "squared_relu", rank))
    assert runs["moe_act"][0]["activation_peak"] < runs["none"][0]["activation_peak"]
    # and counted from every tensor the forward left alive (a closure keeping fc1's output counts too)
    assert runs["moe_act"][0]["forward_live"] < runs["none"][0]["forward_live"]


@pytest.mark.parametrize("kernel_impl", ["torch", "triton"])
def test_layernorm_recompute_frees_each_norms_output(kernel_impl):
    """From the recompute review: `--recompute-modules layernorm` checkpointed each norm alone, and freed nothing
    (the attention's and the MLP's first GEMMs kept the norm's output for their weight gradients; with the fused
    add+norm the checkpoint even kept both its inputs). As Megatron's CheckpointWithoutOutput, the output is now
    dropped after the forward and made again in the backward, and the PyTorch norms keep only their input: per
    layer, at least 1.5 of the norms' two [s, b, h] outputs fewer bytes alive after the forward with the Triton
    norms (which save only their input), 3 with PyTorch's (whose temporaries the old checkpoint freed, 1.85);
    the same gradients to the bit."""
    from megatron_lite.parallel_context import ParallelContext

    from models import triton_on_cpu_tensors

    if kernel_impl == "triton" and not triton_on_cpu_tensors():
        pytest.skip("the Triton kernels need the interpreter here")
    layers, s, b = 3, 32, 2
    out = {}
    for modules in ((), ("layernorm",)):
        kw = dict(recompute_granularity="selective", recompute_modules=modules) if modules else {}
        config = CONFIGS["llama"](num_layers=layers, kernel_impl=kernel_impl, **kw)
        ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
        model = GPTModel(config, ctx, seed=7).train()
        ids = torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(5))
        with LiveBytes() as live:
            loss = model(ids, labels=ids).mean()
        alive = live.alive()
        loss.backward()
        out[modules] = (alive, {n: p.grad.clone() for n, p in model.named_parameters()}, config.hidden_size)
    (plain, grads, h), (recomputed, regrads, _) = out[()], out[("layernorm",)]
    least = 1.5 if kernel_impl == "triton" else 3.0
    freed = (plain - recomputed) / (layers * s * b * h * 4)  # in [s, b, h] per layer
    assert freed >= least, freed
    assert all(torch.equal(regrads[n], g) for n, g in grads.items())
