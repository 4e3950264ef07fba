"""An independent reference for training: 10 single-process iterations of megatron_lite equal a
transformers LlamaForCausalLM (or Qwen3ForCausalLM) with the same weights trained by torch.optim.AdamW (or, for
--optimizer sgd, torch.optim.SGD with momentum), with the learning rate computed here from Megatron's warmup + cosine
formula and no weight decay on norms and biases (with --apply-wd-to-qk-layernorm, on the other norms)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from test_hf_reference import V, _llama, _qwen3

from megatron_lite.config import ParallelConfig
from megatron_lite.data.mock import MockGPTDataset, collate
from megatron_lite.distributed.ddp import DistributedDataParallel
from megatron_lite.models.gpt_model import GPTModel
from megatron_lite.models.hf import config_from_hf
from megatron_lite.models.hf_weights import state_dict_from_hf
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.optimizer.lr_scheduler import LRScheduler
from megatron_lite.optimizer.optimizer import MixedPrecisionOptimizer
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.training.step import train_step

ITERS, WARMUP, LR, MIN_LR, WD, CLIP = 10, 3, 2e-3, 2e-4, 0.1, 0.5
SEQ, BATCH = 16, 4


DECOUPLED_LR, DECOUPLED_MIN_LR = 5e-3, 1e-3


START_WD, END_WD = 0.02, 0.3


def megatron_wd(step: int, style: str) -> float:
    """Megatron's weight-decay increment (OptimizerParamScheduler.get_wd) over the whole run (ITERS steps)."""
    ratio = step / ITERS
    coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
    return START_WD + coeff * (END_WD - START_WD)


def megatron_lr(step: int, lr: float = LR, min_lr: float = MIN_LR) -> float:
    """Megatron: linear warmup from 0 over WARMUP steps, cosine from the peak to the floor until ITERS."""
    if step <= WARMUP:
        return lr * step / WARMUP
    ratio = (step - WARMUP) / (ITERS - WARMUP)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (lr - min_lr)


@pytest.mark.parametrize(
    "decoupled,optimizer,wd_style,qk_wd",
    [
        (False, "adam", "constant", None),
        (True, "adam", "constant", None),
        (False, "sgd", "constant", None),
        (True, "adam", "cosine", None),
        (False, "sgd", "linear", None),
        (False, "adam", "constant", False),
        (False, "adam", "constant", True),
    ],
    ids=["one-lr", "decoupled-lr", "sgd", "wd-cosine-decoupled", "wd-linear-sgd", "qwen3", "qwen3-wd-on-qk-norms"],
)
def test_ten_iterations_equal_transformers_with_torch_optimizers(decoupled, optimizer, wd_style, qk_wd):
    """With --decoupled-lr the reference puts the embeddings and lm_head in AdamW groups of their own, at
    Megatron's schedule with the decoupled peak and floor. With --weight-decay-incr-style linear|cosine, the
    reference sets the decaying groups' weight decay from Megatron's formula, step by step. `qk_wd` (Qwen3's
    per-head q/k norms): --apply-wd-to-qk-layernorm, which puts q_norm and k_norm in the decaying group (Megatron's
    get_standard_config_overrides), or not. The weights must agree at the end."""
    qwen3 = qk_wd is not None
    hf_config = _qwen3() if qwen3 else _llama()  # the same configurations as the logits reference
    hf_config.architectures = ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"]
    torch.manual_seed(0)
    hf = (transformers.Qwen3ForCausalLM if qwen3 else transformers.LlamaForCausalLM)(hf_config).float().train()
    config = config_from_hf(hf_config)
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    ctx.seed(0)
    model = GPTModel(config, ctx)
    model.load_full_state_dict(state_dict_from_hf(hf.state_dict(), config, hf_config.architectures[0]))

    optim = OptimizerConfig(
        lr=LR,
        min_lr=MIN_LR,
        lr_decay_style="cosine",
        lr_warmup_iters=WARMUP,
        weight_decay=WD,
        clip_grad=CLIP,
        adam_beta2=0.95,
        optimizer=optimizer,
        sgd_momentum=0.8,
        decoupled_lr=DECOUPLED_LR if decoupled else None,
        decoupled_min_lr=DECOUPLED_MIN_LR if decoupled else None,
        weight_decay_incr_style=wd_style,
        start_weight_decay=None if wd_style == "constant" else START_WD,
        end_weight_decay=None if wd_style == "constant" else END_WD,
        apply_wd_to_qk_layernorm=bool(qk_wd),
    )
    ddp = DistributedDataParallel(model, ctx)
    opt = MixedPrecisionOptimizer(model, ddp.main_grad, optim, ctx)
    sched = LRScheduler(optim, ITERS)

    outer = {
        n for n in dict(hf.named_parameters()) if decoupled and n in ("model.embed_tokens.weight", "lm_head.weight")
    }
    assert len(outer) == (2 if decoupled else 0)  # untied: two matrices
    named = [(n, p) for n, p in hf.named_parameters() if n not in outer]
    qk_norm = {n for n, _ in named if qk_wd and n.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight"))}
    assert len(qk_norm) == (4 if qk_wd else 0)  # two layers, a q and a k norm each
    decay = [p for n, p in named if p.ndim > 1 or n in qk_norm]
    no_decay = [p for n, p in named if p.ndim == 1 and n not in qk_norm]
    groups = [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]
    if decoupled:
        groups.append({"params": [dict(hf.named_parameters())[n] for n in outer], "weight_decay": WD, "outer": True})
    if optimizer == "sgd":
        ref_opt = torch.optim.SGD(groups, lr=LR, momentum=0.8)
    else:
        ref_opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)
    data = MockGPTDataset(V, SEQ, seed=3)
    clipped = 0
    for it in range(ITERS):
        batch = collate([data[it * BATCH + i] for i in range(BATCH)])
        ours = train_step(ddp, opt, sched, [batch], ctx)

        ref_opt.zero_grad()
        logits = hf(batch["tokens"]).logits
        loss = F.cross_entropy(logits.reshape(-1, V), batch["labels"].reshape(-1))
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP))
        for g in ref_opt.param_groups:
            g["lr"] = megatron_lr(it, DECOUPLED_LR, DECOUPLED_MIN_LR) if g.get("outer") else megatron_lr(it)
            if wd_style != "constant" and g["weight_decay"] > 0:
                g["weight_decay"] = megatron_wd(it, wd_style)
        ref_opt.step()

        assert ours.lr == megatron_lr(it)
        assert abs(ours.lm_loss - loss.item()) <= 1e-5 * loss.item(), (it, ours.lm_loss, loss.item())
        assert abs(ours.grad_norm - norm) <= 1e-5 * norm, (it, ours.grad_norm, norm)
        clipped += norm > CLIP
    assert clipped > 0  # the clipping path was exercised
    expected = state_dict_from_hf(hf.state_dict(), config, hf_config.architectures[0])
    for name, weight in model.full_state_dict().items():
        err = (weight - expected[name]).abs().max().item()
        assert err <= 1e-5 * expected[name].abs().max().item(), (name, err)
