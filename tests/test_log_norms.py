"""--log-params-norm and --log-num-zeros-in-grad (Megatron's): on one process they are the plain L2 norm of
every parameter after the step and the count of zero gradient entries; under other layouts (TP, SP, ZeRO-2,
FSDP2, PP) test_pretrain_layouts.py checks that the job logs the same values as one process."""

from __future__ import annotations

import torch

from megatron_lite.config import ParallelConfig
from megatron_lite.data.mock import MockGPTDataset, collate
from megatron_lite.models.gpt_model import build_model
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.optimizer.lr_scheduler import LRScheduler
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.training.step import train_step
from megatron_lite.training.wrap import wrap_for_training

from models import gpt2_config


def test_params_norm_and_zero_gradients_on_one_process():
    config = gpt2_config(num_layers=2)  # tied embeddings: the shared weight counted once
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    model = build_model(config, ctx, seed=1)
    optim = OptimizerConfig(lr=1e-2, lr_decay_style="constant")
    ddp, opt = wrap_for_training(model, ctx, optim)
    data = MockGPTDataset(250, 16, seed=1)
    batch = collate([data[i] for i in range(4)])
    m = train_step(ddp, opt, LRScheduler(optim, 3), [batch], ctx, log_params_norm=True, log_num_zeros_in_grad=True)
    params = list({id(p): p for p in model.parameters()}.values())
    expected_norm = torch.sqrt(sum(p.detach().double().pow(2).sum() for p in params))
    assert abs(m.params_norm - float(expected_norm)) <= 1e-6 * float(expected_norm)
    zeros = sum(int((ddp.main_grad(p) == 0).sum()) for p in params)
    unused_positions = (config.max_position_embeddings - 16) * config.hidden_size  # rows no token reached
    assert m.num_zeros_in_grad == zeros and zeros >= unused_positions > 0


def test_zero_gradients_leave_the_vocabulary_padding_out():
    """A vocabulary padded to a multiple of 128 (as TP pads it further): its padding rows' gradients are always
    zero and not counted, so the count is the same at any TP size (an exploratory run's TP=2 counted 4960 zeros
    for one process's 864, all of them padding)."""
    config = gpt2_config(num_layers=1, make_vocab_size_divisible_by=128)
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    model = build_model(config, ctx, seed=1)
    optim = OptimizerConfig(lr=1e-2, lr_decay_style="constant")
    ddp, opt = wrap_for_training(model, ctx, optim)
    data = MockGPTDataset(config.vocab_size, 16, seed=1)
    batch = collate([data[i] for i in range(4)])
    m = train_step(ddp, opt, LRScheduler(optim, 3), [batch], ctx, log_num_zeros_in_grad=True)
    params = dict({id(p): (n, p) for n, p in model.named_parameters()})
    vocab = [p for n, p in params.values() if "word_embeddings" in n or "output_layer" in n]
    assert vocab and all(p.shape[0] == 256 for p in vocab)  # (250 padded)
    zeros = 0
    for _, p in params.values():
        g = ddp.main_grad(p)
        if any(p is v for v in vocab):
            assert int(g[config.vocab_size :].count_nonzero()) == 0  # (the padding: always zero)
            g = g[: config.vocab_size]
        zeros += int((g == 0).sum())
    assert m.num_zeros_in_grad == zeros
