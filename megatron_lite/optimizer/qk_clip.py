"""QK-clip after the optimizer step (Megatron-Core's optimizer/qk_clip.py clip_qk; the model side and the rule
are in models/qk_clip.py).

Each attention layer's max logit per local head is max-reduced over the data-parallel x context-parallel group
(every replica of those heads), then each layer's fused QKV rows are scaled in the model and in the optimizer's
main copy of them (`OptimizerBase.scale_rows`: whole parameters, the distributed optimizer's flat parts, FSDP2's
dim-0 shards, dist_muon's owner). Under TP each rank clips its own query groups. The returned (logged) value is
the max over every layer, head and pipeline stage.

As in Megatron's train_step, this runs after every optimizer step, one that was skipped (an fp16 overflow, a
NaN gradient) included: the step's logits came from the current weights, which the skipped update left as they
were. (A NaN or infinite max logit clips nothing: models/qk_clip.py's group_eta.)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_lite.parallel_context import Group, ParallelContext


def _max_over(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size > 1:
        with group.blocked():
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group.pg)
    return x


@torch.no_grad()
def clip_qk(chunks: list, optimizer, config, ctx: ParallelContext) -> float | None:
    """After the optimizer step: clip every attention layer of this rank's model `chunks` (with --qk-clip) and
    return the step's largest attention logit over the whole model (None unless --qk-clip or
    --log-max-attention-logit). Collectives: one max over DP x CP, one over TP x PP."""
    if not (config.qk_clip or config.log_max_attention_logit):
        return None
    # (the attention modules: SelfAttention, MultiLatentAttention)
    layers = [m for chunk in chunks for m in chunk.modules() if hasattr(m, "qk_clip_row_scales")]
    heads = [layer.core_attention.local_heads for layer in layers]
    found = [layer.core_attention.take_max_logits() for layer in layers]
    local = [
        f.float() if f is not None else torch.full((n,), -math.inf, device=ctx.device) for f, n in zip(found, heads)
    ]
    stacked = _max_over(torch.cat(local) if local else torch.zeros(0, device=ctx.device), ctx.dp_cp)
    if config.qk_clip:
        for layer, max_logits in zip(layers, stacked.split(heads)):
            for weight, scale in layer.qk_clip_row_scales(max_logits, config.qk_clip_threshold, config.qk_clip_alpha):
                if bool((scale != 1).any()):  # (bit-equal weights where no group exceeded the threshold)
                    optimizer.scale_rows(weight, scale)
    overall = stacked.max().reshape(1) if stacked.numel() else torch.full((1,), -math.inf, device=ctx.device)
    return float(_max_over(overall, ctx.mp)[0])
