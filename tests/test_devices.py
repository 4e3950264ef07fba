"""Single-process checks that run on every available device: meta-device construction then
initialisation equals direct construction; recomputation replays dropout through the device's RNG
tracker; bf16 weights track fp32. CUDA variants are skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.config import ParallelConfig
from megatron_lite.models.gpt_model import GPTModel
from megatron_lite.parallel_context import ParallelContext

from models import CONFIGS, VOCAB, rel

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


def _ctx(device: str) -> ParallelContext:
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device(device))
    ctx.seed(11)
    return ctx


def _batch(device: str):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 32), generator=gen)
    return ids.to(device), torch.roll(ids, -1, dims=1).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_meta_then_init_equals_direct(name, device):
    config = CONFIGS[name]()
    direct = GPTModel(config, _ctx(device), seed=5)
    lazy = GPTModel(config, _ctx(device), seed=5, device="meta")
    lazy.to_empty(device=device)
    lazy.init_weights(5)
    for (n, a), (_, b) in zip(direct.state_dict().items(), lazy.state_dict().items()):
        assert torch.equal(a, b), n
    ids, labels = _batch(device)
    assert torch.equal(direct(ids, labels=labels), lazy(ids, labels=labels))


@pytest.mark.parametrize("device", DEVICES)
def test_recompute_replays_dropout_single_process(device):
    kw = dict(hidden_dropout=0.2, attention_dropout=0.2, num_layers=3)
    grads = {}
    for mode, extra in {
        "none": {},
        "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        "selective": dict(recompute_granularity="selective", recompute_modules=("core_attn", "mlp")),
    }.items():
        model = GPTModel(CONFIGS["llama"](**kw, **extra), _ctx(device), seed=5).train()
        ids, labels = _batch(device)
        model(ids, labels=labels).mean().backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
    for mode in ("full", "selective"):
        for n, g in grads["none"].items():
            assert torch.equal(grads[mode][n], g), f"{mode}: {n}"


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_tracks_fp32(device):
    config = CONFIGS["llama"]()
    ids, labels = _batch(device)
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = GPTModel(config, _ctx(device), seed=5, dtype=dtype)
        loss = model(ids, labels=labels).float().mean()
        loss.backward()
        assert all(p.grad.dtype == dtype and torch.isfinite(p.grad).all() for p in model.parameters())
        losses[dtype] = loss.detach()
    assert rel(losses[torch.bfloat16], losses[torch.float32]) < 2e-2
