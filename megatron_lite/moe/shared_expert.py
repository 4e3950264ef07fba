"""The MoE layer's shared expert: a dense MLP every token passes through, with Megatron's optional gate
(--moe-shared-expert-gate, Qwen2-MoE's shared_expert_gate): its output times sigmoid(x . w) per token.

The gate's weight is [1, hidden], drawn normal(0, --init-method-std) as Megatron's init_method draws it, and
replicated across TP. It reads the layer's input as this rank holds it: under sequence parallelism its sequence
shard (so its gradient is partial and is summed over TP, as a norm's is, Megatron's `sequence_parallel`
attribute); without, the whole sequence, the same on every TP rank (its gradient too).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.models.mlp import MLP
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.parameters import ParamMeta, set_param_meta


class SharedExpertMLP(MLP):
    def __init__(self, config: ModelConfig, ctx: ParallelContext, device=None, dtype=torch.float32) -> None:
        shared = config.moe_shared_expert_intermediate_size
        # (a dense MLP of its own width; the MoE-only flags off: Llama 4's --moe-apply-probs-on-input weighs the
        # routed experts' inputs, not the shared expert's; a hybrid model's pattern without its E layers, which need
        # experts, and still hybrid: its fc2 starts at Megatron's hybrid std / sqrt(L), as the routed experts' do)
        pattern = config.hybrid_override_pattern
        moe_free = dict(hybrid_override_pattern=pattern.replace("E", "-"), is_hybrid_model=True,
                        hybrid_attention_ratio=0.0, hybrid_mlp_ratio=0.0) if pattern else {}  # fmt: skip
        dense = dataclasses.replace(config, ffn_hidden_size=shared, num_experts=None, moe_shared_expert_gate=False,
                                    moe_apply_probs_on_input=False, **moe_free)  # fmt: skip
        super().__init__(dense, ctx, device, dtype)
        if config.moe_shared_expert_gate:
            self.gate_weight = nn.Parameter(torch.empty(1, config.hidden_size, device=device, dtype=dtype))
            meta = ParamMeta(("normal", config.init_method_std), sequence_parallel=ctx.sequence_parallel)
            set_param_meta(self, "gate_weight", meta)
        else:
            self.gate_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [seq (shard), batch, hidden] -> same (the MLP gathers and reduce-scatters the sequence itself)."""
        y = super().forward(x)
        if self.gate_weight is not None:
            y = y * torch.sigmoid(F.linear(x, self.gate_weight))
        return y
