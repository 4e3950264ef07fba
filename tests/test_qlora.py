"""QLoRA (megatron_lite/lora/qlora.py): the adapted layers' frozen weights in NF4, dequantised on use and
again in the backward. The layer equals a dense layer holding the dequantised weight, forward and backward;
only the input is saved; the model trains its adapters with the NF4 codes unchanged; the memory breakdown
shows the base at 4.127 bits per parameter and optimizer state for the adapters only."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from megatron_lite.config import ParallelConfig
from megatron_lite.kernels.nf4 import dequantize_nf4_reference, nf4_linear, quantize_nf4
from megatron_lite.lora.apply import apply_lora
from megatron_lite.lora.config import LoraConfig
from megatron_lite.lora.qlora import NF4Storage, nf4_bytes, quantize_base

from models import llama_config


def assert_equals_dense_reconstruction(model, dense) -> None:
    """The QLoRA model computes the dense model with each quantised weight replaced by its NF4 reconstruction."""
    twins = dict(dense.named_modules())
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, NF4Storage):
                twins[name.removesuffix(".nf4")].weight.copy_(dequantize_nf4_reference(module.weight()))
    ids = torch.randint(0, 250, (2, 16))
    torch.testing.assert_close(model(ids), dense(ids), rtol=1e-5, atol=1e-5)


def test_nf4_linear_is_the_dense_layer_of_the_dequantised_weight():
    from megatron_lite.training.memory import ActivationMeter

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=gen) * 0.05
    storage = NF4Storage(quantize_nf4(w))
    dense = dequantize_nf4_reference(storage.weight())
    x = torch.randn(4, 7, 128, generator=gen, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    meter = ActivationMeter(torch.nn.Linear(1, 1))
    with meter.measuring():
        y = nf4_linear(x, storage.weight())
    assert meter.peak == x.numel() * 4  # the input only: no dense weight kept for the backward
    torch.testing.assert_close(y, F.linear(x2, dense), rtol=0, atol=1e-6)
    dy = torch.randn_like(y)
    y.backward(dy)
    F.linear(x2, dense).backward(dy)
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=1e-6)


def test_qlora_model_trains_adapters_on_an_nf4_base():
    from megatron_lite.data.mock import MockGPTDataset, collate
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.optimizer.config import OptimizerConfig
    from megatron_lite.optimizer.lr_scheduler import LRScheduler
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.training import memory
    from megatron_lite.training.step import train_step
    from megatron_lite.training.wrap import wrap_for_training

    # dimensions whose weights fill whole 64 x 256 statistics blocks: exactly 4.127 bits per parameter
    config = llama_config(num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=4,
                          ffn_hidden_size=1024)  # fmt: skip
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    model = build_model(config, ctx, seed=1)
    dense = build_model(config, ctx, seed=1)
    n_adapter = apply_lora(model, config, LoraConfig(rank=4, alpha=8.0, qlora=True), ctx, seed=2)
    n_quantised, _ = quantize_base(model, ctx)
    assert abs(8 * nf4_bytes(model) / n_quantised - (4 + 8 / 64 + 32 / (64 * 256))) < 1e-9
    assert_equals_dense_reconstruction(model, dense)

    codes = {n: b.clone() for n, b in model.named_buffers()}
    optim = dataclasses.replace(OptimizerConfig(lr=1e-2), lr_decay_style="constant")
    ddp, opt = wrap_for_training(model, ctx, optim)
    sched = LRScheduler(optim, 3)
    data = MockGPTDataset(250, 16, seed=1)
    losses = []
    for it in range(3):
        m = train_step(ddp, opt, sched, [collate([data[4 * it + j] for j in range(4)])], ctx, measure_activations=True)
        losses.append(m.lm_loss)
    assert all(torch.equal(b, codes[n]) for n, b in model.named_buffers())  # the NF4 base never changes
    b = memory.breakdown(model, ddp, opt, m.activation_bytes)
    dense_params = sum(p.numel() * 4 for p in model.parameters())  # embeddings, norms, output layer, adapters
    assert b["mem_params_bytes"] == dense_params + nf4_bytes(model)
    assert b["mem_optimizer_bytes"] == 8 * n_adapter  # Adam moments of the adapters only (fp32 weights)
    assert b["mem_grads_bytes"] == 4 * n_adapter


def test_qlora_on_experts_dequantises_each_expert_and_keeps_its_codes():
    """Adapted experts store their frozen weights in NF4 like the adapted dense layers: the model at init is the
    dense model holding each expert's NF4 reconstruction, training moves only adapters, and every expert's
    weight counts at NF4's size."""
    from megatron_lite.data.mock import MockGPTDataset, collate
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.moe.experts import ExpertWeight
    from megatron_lite.optimizer.config import OptimizerConfig
    from megatron_lite.optimizer.lr_scheduler import LRScheduler
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.training.step import train_step
    from megatron_lite.training.wrap import wrap_for_training

    config = llama_config(num_layers=2, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128)
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    model, dense = build_model(config, ctx, seed=1), build_model(config, ctx, seed=1)
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("linear_qkv", "experts"), qlora=True)
    apply_lora(model, config, lora, ctx, seed=2)
    n_quantised, _ = quantize_base(model, ctx)
    experts = [m for m in model.modules() if isinstance(m, ExpertWeight)]
    assert len(experts) == 2 * 4 * 2 and all(m.weight is None and m.nf4 is not None for m in experts)
    assert n_quantised == sum(m.nf4.weight().numel for m in model.modules() if getattr(m, "nf4", None) is not None)
    assert_equals_dense_reconstruction(model, dense)

    codes = {n: b.clone() for n, b in model.named_buffers()}
    optim = dataclasses.replace(OptimizerConfig(lr=1e-2), lr_decay_style="constant")
    ddp, opt = wrap_for_training(model, ctx, optim)
    sched = LRScheduler(optim, 2)
    data = MockGPTDataset(250, 16, seed=1)
    for it in range(2):
        train_step(ddp, opt, sched, [collate([data[4 * it + j] for j in range(4)])], ctx)
    assert all(torch.equal(b, codes[n]) for n, b in model.named_buffers())
    assert all(p.grad is None or ".lora." in n for n, p in model.named_parameters())
