"""LoRA adapters inside the tensor-parallel layers (QLoRA's NF4 base weights come with kernels/nf4.py)."""
