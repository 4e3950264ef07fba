"""Model settings the planner accepts but does not price, said with the plan instead of silently ignored.

Each changes the tensors a layer saves for its backward (their parameters, where they have any, are counted).
(fp8, an fp32 residual stream, expert capacity, the attention output's and the shared expert's gates,
quick-GEGLU, --qk-l2-norm, --softmax-type, --moe-router-dtype fp64, --moe-input-jitter-eps and
--moe-apply-probs-on-input are priced: planner/memory.py, precision.py, attention_memory.py.)"""

from __future__ import annotations

from megatron_lite.config import ModelConfig


def unmodelled_settings(model: ModelConfig) -> list[str]:
    """One line per setting of `model` whose memory the planner's estimate leaves out (empty when none)."""
    out = []
    if model.kernel_impl == "triton" and model.attention_dropout > 0:
        out.append(
            f"--attention-dropout {model.attention_dropout:g} (attention runs through SDPA, not the flash kernel it "
            "is priced as)"
        )
    return out
