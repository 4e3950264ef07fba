"""Triton kernels (importable as megatron_lite.kernels); filled in by the kernels issue."""
