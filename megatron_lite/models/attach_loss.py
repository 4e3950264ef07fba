"""A loss that joins the backward without changing a model's output (the MoE auxiliary losses, multi-token
prediction): an autograd function passes the output through and hands the loss the gradient `scale`."""

from __future__ import annotations

import torch


class AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(loss)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return g, torch.full_like(loss, ctx.scale), None


def attach_loss(y: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """`y`, with `loss` receiving the gradient `scale` in the backward."""
    return AttachLoss.apply(y, loss, scale)
