"""Triton kernels for megatron_lite (installed as megatron_lite.kernels).

Each op has three layers (Triton kernels + launcher, an autograd Function, this functional entry) and a
plain-PyTorch reference beside it that is both the fallback (no Triton, or CPU tensors outside the
interpreter) and the tests' oracle. `LAUNCHES` counts kernel launches so tests can prove a kernel ran.
"""

if __name__ == "kernels":  # (not megatron_lite.kernels: see below)
    # The repository root on sys.path (`python -c` or a notebook started there) makes this folder the top-level
    # `kernels`, a name the Hugging Face `kernels` package owns and transformers imports (`from kernels import
    # CUDAProperties` failed here). Hand the name over to the installed package, if there is one.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _rest = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _rest)
    if _spec is not None and _spec.loader is not None:
        _real = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _real  # (the import statement returns what sys.modules holds after this runs)
        _spec.loader.exec_module(_real)

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
