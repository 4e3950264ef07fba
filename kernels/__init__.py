"""Triton kernels for megatron_lite (installed as megatron_lite.kernels).

Each op has three layers (Triton kernels + launcher, an autograd Function, this functional entry) and a
plain-PyTorch reference beside it that is both the fallback (no Triton, or CPU tensors outside the
interpreter) and the tests' oracle. `LAUNCHES` counts kernel launches so tests can prove a kernel ran.
"""

from megatron_lite.kernels._common import HAVE_TRITON, LAUNCHES, compile_for_gpu, triton_usable
from megatron_lite.kernels.cross_entropy import fused_linear_cross_entropy, fused_linear_cross_entropy_reference
from megatron_lite.kernels.flash_attention import (
    document_bounds,
    flash_attention,
    flash_attention_backward,
    flash_attention_backward_reference,
    flash_attention_reference,
)
from megatron_lite.kernels.gemm import linear, linear_reference, matmul_into
from megatron_lite.kernels.moe import (
    grouped_gemm,
    grouped_gemm_reference,
    moe_permute,
    moe_permute_reference,
    moe_unpermute,
    moe_unpermute_reference,
)
from megatron_lite.kernels.nf4 import NF4Weight, dequantize_nf4, dequantize_nf4_reference, nf4_linear, quantize_nf4
from megatron_lite.kernels.norms import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from megatron_lite.kernels.quick_geglu import quick_geglu, quick_geglu_reference
from megatron_lite.kernels.rope import apply_rope, apply_rope_reference
from megatron_lite.kernels.swiglu import swiglu, swiglu_reference, swiglu_stacked, swiglu_stacked_reference

__all__ = [
    "HAVE_TRITON",
    "NF4Weight",
    "quantize_nf4",
    "dequantize_nf4",
    "dequantize_nf4_reference",
    "nf4_linear",
    "linear",
    "linear_reference",
    "matmul_into",
    "LAUNCHES",
    "compile_for_gpu",
    "triton_usable",
    "rms_norm",
    "rms_norm_reference",
    "layer_norm",
    "layer_norm_reference",
    "swiglu",
    "swiglu_reference",
    "swiglu_stacked",
    "swiglu_stacked_reference",
    "quick_geglu",
    "quick_geglu_reference",
    "apply_rope",
    "apply_rope_reference",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_reference",
    "document_bounds",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_backward_reference",
    "flash_attention_reference",
    "moe_permute",
    "moe_permute_reference",
    "moe_unpermute",
    "moe_unpermute_reference",
    "grouped_gemm",
    "grouped_gemm_reference",
]
