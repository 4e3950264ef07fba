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
    the weight is stored as gamma - 1, zeros at init, and applied as 1 + weight (the sum in fp32).
    `out_dtype` (--fp32-residual-connection): the output's dtype, the compute dtype, whatever the input's (an fp32
    residual stream is normalised in fp32 and the branch reads the result rounded once, as Megatron's mixed norms)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        sequence_parallel: bool = False,
        device=None,
        dtype=torch.float32,
        kernel_impl: str = "torch",
        zero_centered: bool = False,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.out_dtype = out_dtype
        self.triton = kernel_impl == "triton"
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        init = ("zeros",) if zero_centered else ("ones",)
        set_param_meta(self, "weight", ParamMeta(init, sequence_parallel=sequence_parallel))

    def gamma(self) -> torch.Tensor:
        # (zero-centred: 1 + weight kept in fp32, as Transformer Engine's zero-centred gamma; rounded to a bf16
        # weight's dtype it moved in steps of 2^-7 and 2^-8, and a weight below about 0.004 did nothing)
        return self.weight.float() + 1.0 if self.zero_centered else self.weight

    def _out(self, y: torch.Tensor, s: torch.Tensor | None):
        if self.out_dtype is not None:
            y = y.to(self.out_dtype)
        return (y, s) if s is not None else y


class RMSNorm(_Norm):
    """Llama's RMSNorm: statistics in fp32, the weight applied in the input dtype (as transformers does).
    With `residual`, normalises x + residual and returns (normalised, x + residual) in one pass."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        fn = K.rms_norm if self.triton else K.rms_norm_reference
        # (an fp32 residual beside a bf16 x: the sum and its norm in fp32, the kernel's and the reference's)
        out = fn(x, self.gamma(), self.eps, residual=residual)
        y, s = out if residual is not None else (out, None)
        if self.zero_centered and x.dtype != torch.float32:
            # (an fp32 gamma makes transformers' weight * xhat fp32: the rows keep their dtype, rounded once)
            y = y.to(x.dtype)
        return self._out(y, s)


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
        out_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(hidden_size, eps, sequence_parallel, device, dtype, kernel_impl, zero_centered, out_dtype)
        self.bias = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        set_param_meta(self, "bias", ParamMeta(("zeros",), sequence_parallel=sequence_parallel))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.triton:
            out = K.layer_norm(x, self.gamma(), self.bias, self.eps, residual=residual)
            return self._out(*(out if residual is not None else (out, None)))
        s = x + residual if residual is not None else x
        w = self.gamma()
        if w.dtype == s.dtype == self.bias.dtype:
            y = F.layer_norm(s, (s.shape[-1],), w, self.bias, self.eps)
        else:  # (an fp32 gamma on lower-precision rows, or bf16 weights on an fp32 stream: in fp32, rounded once)
            y = F.layer_norm(s.float(), (s.shape[-1],), w.float(), self.bias.float(), self.eps).to(s.dtype)
        return self._out(y, s if residual is not None else None)


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
        # (the compute dtype: under FSDP2 the built dtype is fp32, but that pair is refused at start-up)
        out_dtype=dtype if config.fp32_residual_connection else None,
    )
