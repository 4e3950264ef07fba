"""Normalisation layers: the Triton kernels or their PyTorch references (--kernel-impl)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite import kernels as K
from megatron_lite.config import ModelConfig
from megatron_lite.parameters import ParamMeta, set_param_meta


class _Norm(nn.Module):
    """A weight over the hidden size (ones at init), replicated across TP; `sequence_parallel` marks its
    gradient partial when each rank normalises only its sequence shard. `zero_centered` (--apply-layernorm-1p):
    the weight is stored as gamma - 1, zeros at init, and applied as 1 + weight (the sum in fp32)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        sequence_parallel: bool = False,
        device=None,
        dtype=torch.float32,
        kernel_impl: str = "torch",
        zero_centered: bool = False,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.triton = kernel_impl == "triton"
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        init = ("zeros",) if zero_centered else ("ones",)
        set_param_meta(self, "weight", ParamMeta(init, sequence_parallel=sequence_parallel))

    def gamma(self) -> torch.Tensor:
        # (zero-centred: 1 + weight kept in fp32, as Transformer Engine's zero-centred gamma; rounded to a bf16
        # weight's dtype it moved in steps of 2^-7 and 2^-8, and a weight below about 0.004 did nothing)
        return self.weight.float() + 1.0 if self.zero_centered else self.weight


class RMSNorm(_Norm):
    """Llama's RMSNorm: statistics in fp32, the weight applied in the input dtype (as transformers does).
    With `residual`, normalises x + residual and returns (normalised, x + residual) in one pass."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        fn = K.rms_norm if self.triton else K.rms_norm_reference
        out = fn(x, self.gamma(), self.eps, residual=residual)
        if not self.zero_centered or x.dtype == torch.float32:
            return out
        # (an fp32 gamma makes transformers' weight * xhat fp32: the rows keep their dtype, rounded once)
        return (out[0].to(x.dtype), out[1]) if residual is not None else out.to(x.dtype)


class LayerNorm(_Norm):
    def __init__(
        self,
        hidden_size: int,
        eps: float,
        sequence_parallel: bool = False,
        device=None,
        dtype=torch.float32,
        kernel_impl: str = "torch",
        zero_centered: bool = False,
    ) -> None:
        super().__init__(hidden_size, eps, sequence_parallel, device, dtype, kernel_impl, zero_centered)
        self.bias = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        set_param_meta(self, "bias", ParamMeta(("zeros",), sequence_parallel=sequence_parallel))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.triton:
            return K.layer_norm(x, self.gamma(), self.bias, self.eps, residual=residual)
        s = x + residual if residual is not None else x
        w = self.gamma()
        if w.dtype == s.dtype:
            y = F.layer_norm(s, (s.shape[-1],), w, self.bias, self.eps)
        else:  # (a zero-centred fp32 gamma on lower-precision rows: the norm in fp32, rounded once)
            y = F.layer_norm(s.float(), (s.shape[-1],), w, self.bias.float(), self.eps).to(s.dtype)
        return (y, s) if residual is not None else y


def build_norm(
    config: ModelConfig, sequence_parallel: bool, device=None, dtype=torch.float32, size: int | None = None
) -> nn.Module:
    """A norm over the hidden size (or `size`). Its parameters are replicated across TP; when each rank
    normalises only part of the activations (its sequence shard under sequence parallelism, its heads for
    --qk-layernorm), `sequence_parallel` marks their gradients partial, for a TP all-reduce."""
    cls = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    return cls(
        size or config.hidden_size,
        config.norm_epsilon,
        sequence_parallel,
        device=device,
        dtype=dtype,
        kernel_impl=config.kernel_impl,
        zero_centered=config.apply_layernorm_1p,
    )
