"""Cross-entropy over a vocabulary split across tensor-parallel ranks, without gathering the logits.

Each rank holds logits for its slice of the (padded) vocabulary. Three small all-reduces over TP give the
global max, the target's logit and the sum of exponentials; only [tokens]-sized tensors cross the wire.
Padded vocabulary columns (index >= vocab_size) are masked out of the softmax, so padding never changes
the loss: TP=4 with a padded vocabulary computes what one process computes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.parallel_context import Group
from megatron_lite.tensor_parallel.mappings import all_reduce

IGNORE_INDEX = -100


def counted_labels(labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """The labels with every token the loss mask leaves out set to IGNORE_INDEX: its loss is then 0 and every
    counted token's loss gets the same gradient from a masked sum, which lets the fused cross-entropy make its
    gradients in the forward (models/gpt_model.py)."""
    return labels.masked_fill(loss_mask == 0, IGNORE_INDEX)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group: Group, vocab_size: int, ignore_index: int):
        local_vocab = logits.shape[-1]
        start = group.rank * local_vocab
        real = max(0, min(local_vocab, vocab_size - start))  # real (unpadded) columns on this rank

        x = logits.float()
        if real < local_vocab:
            x = x.clone()
            x[..., real:] = float("-inf")
        logits_max = x.max(dim=-1).values
        if group.size > 1:
            with group.blocked():
                dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group.pg)
        x = x - logits_max.unsqueeze(-1)  # a new tensor: the input logits are never modified

        outside = (target < start) | (target >= start + local_vocab)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target_logit = all_reduce(target_logit, group)

        exp = x.exp_()
        sum_exp = all_reduce(exp.sum(dim=-1), group)
        loss = torch.log(sum_exp) - target_logit
        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside | ignored, local_target, ignored)
        ctx.input_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, no_target_here, local_target, ignored = ctx.saved_tensors
        grad = softmax  # reused in place: the saved buffer is not needed after this
        hit = (~no_target_here).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: Group, vocab_size: int, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token loss from vocabulary-sharded logits.

    logits: [..., vocab_size_padded / TP], this rank's contiguous slice of the padded vocabulary.
    target: [...] global token ids. Tokens whose target equals `ignore_index` get loss 0 and no gradient.
    vocab_size: the real vocabulary size; columns at or beyond it are padding and take no probability.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size, ignore_index)
