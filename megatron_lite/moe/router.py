"""Top-k routing in fp32 (or fp64, --moe-router-dtype): scores, selection, capacity-based dropping and the
load-balancing losses.

softmax (Mixtral): top-k of the logits, then a softmax over the k selected (equal to renormalised top-k of
the full softmax); with --moe-router-pre-softmax, a softmax over all experts, then top-k, not renormalised.
sigmoid (DeepSeek-V3): sigmoid scores; an optional per-expert bias is added for the selection only; the k
selected scores are normalised to sum to one.
Group-limited top-k (--moe-router-num-groups G --moe-router-group-topk g, Megatron's and DeepSeek-V3's): the
experts form G equal groups, each scored by the sum of its best k // g selection scores; the top-k is taken
within the g best groups only. --moe-router-topk-scaling-factor then scales the selected weights.
sinkhorn (--moe-router-load-balancing-type sinkhorn, Megatron's S-BASE routing): in training the experts are the
top-k of exp(logits) balanced by Sinkhorn's alternating row / column normalisation (fp32, no gradient), so the
micro-batch's tokens spread evenly over the experts; their weights are sigmoid(logit) at top-1, the softmax over
all experts otherwise (not renormalised); in evaluation the top-k of those weights picks. No auxiliary loss.

Load-balancing loss (Switch/GShard, Megatron's normalisation): coeff * E * sum_e f_e * P_e with
f_e = tokens routed to e / (tokens * k) and P_e the mean score of e over the tokens; `seq_aux_loss`
computes it per sequence and averages; z-loss = coeff * mean(logsumexp(logits)^2). Counts come from the
routing before capacity dropping. All statistics are over this micro-batch's tokens (the full sequence:
the MoE layer gathers it under sequence parallelism), so they do not depend on the layout.

Randomness (Megatron's --moe-input-jitter-eps, --moe-router-force-load-balancing): drawn from the default
generator, which is the same on every TP rank, as the router's input is (the whole sequence on each), so every TP
rank routes alike and TP (with or without SP) draws what one process draws; recomputation (full, or selective
"moe") replays it, as checkpoint() restores the generators. Elsewhere the noise follows the default generator as
dropout on replicated activations does: DP and EP replicas (seeded alike) draw the same stream for their own
tokens, pipeline stages (seeded per stage) and CP ranks (a part of each sequence) draw other numbers than one
process does, so those layouts do not reproduce a one-process run by design. Megatron draws the forced logits
from its expert-parallel tracker (another stream per EP rank); jitter it draws from the default generator too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.parameters import ParamMeta, set_param_meta


@dataclass
class Routing:
    probs: torch.Tensor  # [T, k] weights of the selected experts (0 where dropped)
    indices: torch.Tensor  # [T, k] selected experts
    keep: torch.Tensor  # [T, k] bool: False where capacity dropped the pair
    counts: torch.Tensor  # [E] tokens routed to each expert, before dropping
    aux_loss: torch.Tensor | None
    z_loss: torch.Tensor | None
    capacity: int | None = None  # the most tokens an expert keeps of these (with a capacity factor)


class TopKRouter(nn.Module):
    """Top-k routing. `cp`: the context-parallel group, when this rank holds only a part of each sequence: the
    auxiliary losses are then this part's share of the whole sequence's losses (expert counts summed over CP,
    this part's scores over the whole sequence's token count), so the shares add up over CP to the loss one
    process computes (the training step weighs them by 1 / (micro-batches x DP), not x CP)."""

    def __init__(self, config: ModelConfig, tp_size: int, device=None, dtype=torch.float32, cp=None) -> None:
        super().__init__()
        self.config = config
        self.cp = cp if cp is not None and cp.size > 1 else None
        e = config.num_experts
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size, device=device, dtype=dtype))
        # Under tensor parallelism the routing weights multiply TP-partial expert outputs (the reduction
        # comes after the combine), so the router's gradient is partial on each TP rank.
        set_param_meta(self, "weight", ParamMeta(("normal", config.init_method_std), sequence_parallel=tp_size > 1))
        # Megatron's router has a bias with --add-bias-linear (gpt-oss's), drawn by init_method as the weight is, and
        # partial over TP as the weight is
        self.bias = None
        if config.add_bias_linear:
            self.bias = nn.Parameter(torch.empty(e, device=device, dtype=dtype))
            set_param_meta(self, "bias", ParamMeta(("normal", config.init_method_std), sequence_parallel=tp_size > 1))
        if config.moe_router_enable_expert_bias:
            self.expert_bias = nn.Parameter(torch.empty(e, device=device, dtype=torch.float32), requires_grad=False)
            set_param_meta(self, "expert_bias", ParamMeta(("zeros",)))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor, seq_batch: tuple[int, int]) -> Routing:
        """x: [T, hidden] with T = seq * batch, sequence-major (the [seq, batch] layout flattened)."""
        c = self.config
        k, e = c.moe_router_topk, c.num_experts
        dt = torch.float64 if c.moe_router_dtype == "fp64" else torch.float32
        eps = c.moe_input_jitter_eps
        if eps is not None and self.training:
            # (Megatron's Uniform(1 - eps, 1 + eps).rsample: low + rand * (high - low), in the input's dtype; only in
            # training, as Switch Transformer's and Hugging Face's jitter: Megatron's applies in evaluation too)
            low, high = 1.0 - eps, 1.0 + eps
            x = x * (low + torch.rand(x.shape, dtype=x.dtype, device=x.device) * (high - low))
        logits = F.linear(x.to(dt), self.weight.to(dt), None if self.bias is None else self.bias.to(dt))
        if c.moe_router_force_load_balancing:
            logits = _RandomLogits.apply(logits)
        z_loss = None
        cp = self.cp.size if self.cp is not None else 1
        if c.moe_z_loss_coeff:  # (this part's share of the mean over the whole sequence)
            z_loss = c.moe_z_loss_coeff * torch.logsumexp(logits, dim=-1).pow(2).sum() / (logits.shape[0] * cp)
        if c.moe_router_load_balancing_type == "sinkhorn":
            probs, indices = self._sinkhorn_topk(logits)
            aux_scores = None  # (no auxiliary loss: its coefficient is 0, validation says)
        elif c.moe_router_score_function == "softmax":
            scores = torch.softmax(logits, dim=-1)
            if c.moe_router_pre_softmax:
                probs, indices = self._topk(scores)
            else:
                top, indices = self._topk(logits)
                probs = torch.softmax(top, dim=-1)
            aux_scores = scores
        else:
            scores = torch.sigmoid(logits)
            select = scores + self.expert_bias if self.expert_bias is not None else scores
            _, indices = self._topk(select)
            probs = scores.gather(-1, indices)
            if k > 1:
                probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
            aux_scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        if c.moe_router_topk_scaling_factor is not None:
            probs = probs * c.moe_router_topk_scaling_factor
        counts = torch.bincount(indices.reshape(-1), minlength=e)
        aux_indices, aux_counts = indices, counts
        if self.expert_bias is not None or c.moe_router_num_groups:
            # the balance losses count a plain top-k of the unbiased scores, without groups (Megatron's
            # compute_routing_scores_for_aux_loss; DeepSeek-V3's sequence-wise loss likewise)
            aux_indices = torch.topk(aux_scores, k, dim=-1).indices
            aux_counts = torch.bincount(aux_indices.reshape(-1), minlength=e)
        aux_loss = self._balance_loss(aux_scores, aux_indices, aux_counts, seq_batch)
        keep = self._capacity_keep(probs, indices, x.shape[0])
        probs = (probs * keep).float()  # the experts' side stays fp32 whatever the routing ran in
        aux_loss, z_loss = (v.float() if v is not None else None for v in (aux_loss, z_loss))
        capacity = expert_capacity(c, x.shape[0])
        return Routing(probs, indices, keep, counts, aux_loss, z_loss, capacity)

    def _sinkhorn_topk(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Megatron's sinkhorn_load_balancing: weights and experts of [T, E] logits."""
        k = self.config.moe_router_topk
        scores = torch.sigmoid(logits) if k == 1 else torch.softmax(logits, dim=-1)
        if self.training:
            with torch.no_grad():
                indices = torch.topk(sinkhorn(logits.detach().float()), k, dim=-1).indices
        else:
            indices = torch.topk(scores, k, dim=-1).indices
        return scores.gather(-1, indices), indices

    def _topk(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of [T, E] selection scores, within the best groups when routing is group-limited."""
        c = self.config
        k, groups = c.moe_router_topk, c.moe_router_num_groups
        if groups is None:
            return torch.topk(scores, k, dim=-1)
        t, e = scores.shape
        per_group = scores.view(t, groups, e // groups)
        n = c.moe_router_group_score_topn or k // c.moe_router_group_topk  # (Megatron's rule by default)
        group_scores = per_group.topk(n, dim=-1).values.sum(-1)  # [T, G]
        best = group_scores.topk(c.moe_router_group_topk, dim=-1).indices
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)
        masked = scores.masked_fill(~allowed.repeat_interleave(e // groups, dim=1), float("-inf"))
        return torch.topk(masked, k, dim=-1)

    def _balance_loss(self, scores, indices, counts, seq_batch) -> torch.Tensor | None:
        c = self.config
        kind, coeff, k, e = c.moe_router_load_balancing_type, c.moe_aux_loss_coeff, c.moe_router_topk, c.num_experts
        if kind == "none" or not coeff:
            return None
        cp = self.cp.size if self.cp is not None else 1
        t = scores.shape[0] * cp  # the whole sequences' tokens (each CP rank holds an equal part)
        if kind == "aux_loss":
            f = self._over_cp(counts.float()) / (t * k)
            return coeff * e * (f * scores.sum(0) / t).sum()
        s, b = seq_batch  # per sequence: tokens t = i * b + j belong to sequence j
        s_all = s * cp
        per_seq = self._over_cp(F.one_hot(indices, e).sum(1).float().view(s, b, e).sum(0)) / (s_all * k)  # [b, E]
        return coeff * e * (per_seq * scores.view(s, b, e).sum(0) / s_all).sum(-1).mean()

    def _over_cp(self, counts: torch.Tensor) -> torch.Tensor:
        """Expert counts of the whole sequences: summed over the context-parallel ranks (no gradient)."""
        if self.cp is None:
            return counts
        counts = counts.detach().clone()
        with self.cp.blocked():  # (exposed: the loss waits for it)
            dist.all_reduce(counts, group=self.cp.pg)
        return counts

    def _capacity_keep(self, probs, indices, t: int) -> torch.Tensor:
        c = self.config
        capacity = expert_capacity(c, t)
        if capacity is None:
            return torch.ones_like(indices, dtype=torch.bool)
        e = c.num_experts
        # each expert's routed tokens by their probability, the others at -inf (not probs + 1, which ties
        # probabilities closer than fp32's resolution near 1)
        # (in the routing's dtype, fp64 under --moe-router-dtype fp64: fp32 would tie what fp64 tells apart)
        dtype = torch.promote_types(probs.dtype, torch.float32)
        routed = torch.full((t, e), float("-inf"), device=probs.device, dtype=dtype)
        routed = routed.scatter(1, indices, probs.detach().to(dtype))
        is_routed = routed > float("-inf")
        if c.moe_token_drop_policy == "probs":  # keep each expert's most confident tokens
            top = torch.topk(routed, capacity, dim=0).indices
            kept = torch.zeros_like(routed, dtype=torch.bool).scatter(0, top, True) & is_routed
        else:  # position: the earliest tokens of the sequence
            kept = is_routed & (torch.cumsum(is_routed.int(), dim=0) <= capacity)
        return kept.gather(1, indices)


def sinkhorn(logits: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """exp(logits) [T, E] scaled by row factors r and column factors c to rows summing to 1/T and columns to 1/E,
    alternately, until the column factors move by under `tol` on average (Megatron's loop and constants: the
    column step last, 1e-8 in each denominator)."""
    cost = torch.exp(logits)
    t, e = cost.shape
    r = torch.ones(t, device=cost.device, dtype=cost.dtype)
    c = torch.ones(e, device=cost.device, dtype=cost.dtype)
    while True:
        r = 1.0 / (t * ((cost * c).sum(1) + 1e-8))
        c_new = 1.0 / (e * ((cost * r[:, None]).sum(0) + 1e-8))
        moved = (c_new - c).abs().mean()
        c = c_new
        if not moved > tol:
            return cost * r[:, None] * c


def expert_capacity(c: ModelConfig, t: int) -> int | None:
    """The most of `t` tokens one expert keeps under the capacity factor, Megatron's get_capacity of t * top-k
    routed pairs (a token goes to an expert at most once, so never more than t); None when dropless."""
    if c.moe_expert_capacity_factor is None:
        return None
    return min(t, math.ceil(t * c.moe_router_topk / c.num_experts * c.moe_expert_capacity_factor))


class _RandomLogits(torch.autograd.Function):
    """--moe-router-force-load-balancing (Megatron's RandomSTE): standard normal logits in place of the router's,
    so tokens spread evenly over the experts; the backward hands their gradient to the real logits unchanged (a
    straight-through estimator), so the router's weight still gets one."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(logits).normal_()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad
