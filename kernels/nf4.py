"""NF4: 4-bit NormalFloat weights with double-quantised block scales (QLoRA; bitsandbytes' `quantize_4bit`
with quant_type="nf4", blocksize=64, compress_statistics=True), and their dequantisation.

Format (as bitsandbytes lays it out): the weight is flattened row-major and cut into blocks of 64; each
block keeps its absolute maximum, and each value becomes the index of the nearest of the 16 NF4 levels
(the quantiles of a standard normal, rescaled to [-1, 1], with an exact 0) after division by that maximum.
Two codes share a byte, the even element in the high nibble. Double quantisation stores the block maxima
minus their mean as 8-bit codes of bitsandbytes' dynamic map, in blocks of 256 with an fp32 maximum each:
4 + 8/64 + 32/(64*256) = 4.127 bits per parameter.

Quantisation runs once (loading a base model) in PyTorch; dequantisation, on every use of the weight, is a
Triton kernel (the block scales, one per 64 weights, decoded in PyTorch first) with the PyTorch reference
beside it as fallback and test oracle; `nf4_linear` is the layer that uses it (an autograd Function that
dequantises again in the backward rather than keep the weight)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_lite.kernels import _common
from megatron_lite.kernels._common import HAVE_TRITON, interpreting, launched, on_tensor_device, triton_usable

# The 16 NF4 levels (QLoRA appendix; bitsandbytes' code book), ascending.
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
BLOCKSIZE = 64
STATS_BLOCKSIZE = 256
BLOCK = 1024


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed dynamic 8-bit map (7 exponent bits): for each exponent e in 0..6, the midpoints
    of 2**e + 1 points evenly spaced on [0.1, 1], scaled by 10**(e - 6), and their negatives; then 0 and 1,
    sorted. 256 values in [-0.993, 1]."""
    values: list[float] = []
    for e in range(7):
        b = torch.linspace(0.1, 1, 2**e + 1, dtype=torch.float32)
        means = (b[:-1] + b[1:]) / 2
        values += (10 ** (-6 + e) * means).tolist() + (-(10 ** (-6 + e)) * means).tolist()
    values += [0.0, 1.0]
    return torch.tensor(sorted(values), dtype=torch.float32)


def _nearest(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the nearest level (levels ascending); a value exactly between two takes the lower index,
    NaN takes 0, as bitsandbytes' kernels do."""
    midpoints = (levels[:-1] + levels[1:]) / 2
    idx = torch.bucketize(x, midpoints, right=False)  # boundaries[i-1] < x <= boundaries[i] -> i
    return torch.where(torch.isnan(x), torch.zeros_like(idx), idx)


def _block_absmax(x: torch.Tensor, blocksize: int) -> torch.Tensor:
    n = x.numel()
    padded = torch.nn.functional.pad(x, (0, -n % blocksize))  # zeros never raise a maximum
    return padded.view(-1, blocksize).abs().amax(dim=1)


@dataclass
class NF4Weight:
    """A quantised weight: packed codes and its (double-quantised) block scales."""

    packed: torch.Tensor  # uint8 [(n + 1) // 2]
    shape: torch.Size
    dtype: torch.dtype  # of the original weight (the dequantised dtype)
    blocksize: int
    absmax: torch.Tensor | None  # fp32 [blocks], without double quantisation
    qabsmax: torch.Tensor | None = None  # uint8 [blocks]: codes of (absmax - offset) in the dynamic map
    stats_absmax: torch.Tensor | None = None  # fp32 [ceil(blocks / 256)]
    offset: float = 0.0
    code8: torch.Tensor | None = None  # the dynamic map (256 fp32)
    # A tensor-parallel shard quantised as part of its full weight (lora/qlora.py): the full weight's row of
    # each of its rows (None: the same rows) and full-weight block of each of its column blocks (int32), so that
    # its blocks find their double-quantisation statistics (`stats_absmax` is then the full weight's). None:
    # the weight is whole.
    block_rows: torch.Tensor | None = None
    block_cols: torch.Tensor | None = None
    blocks_per_row: int = 0  # the full weight's

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def double_quant(self) -> bool:
        return self.qabsmax is not None

    def nbytes(self) -> int:
        """Bytes per weight storage: codes, scales and their scales (the two code books are shared)."""
        parts = [self.packed, self.absmax, self.qabsmax, self.stats_absmax, self.block_rows, self.block_cols]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def bits_per_parameter(self) -> float:
        return 8 * self.nbytes() / self.numel

    def block_scales(self) -> torch.Tensor:
        """Each block's absolute maximum as dequantisation uses it (fp32)."""
        if not self.double_quant:
            return self.absmax
        idx = torch.arange(self.qabsmax.numel(), device=self.qabsmax.device)
        if self.block_cols is not None:  # the blocks' indices in the full weight
            per_row = self.block_cols.numel()
            rows = idx // per_row if self.block_rows is None else self.block_rows.long()[idx // per_row]
            idx = rows * self.blocks_per_row + self.block_cols.long()[idx % per_row]
        return self.code8[self.qabsmax.long()] * self.stats_absmax[idx // STATS_BLOCKSIZE] + self.offset


def double_quantize(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
    """(8-bit codes of the block maxima minus their mean, each 256 codes' fp32 maximum, the mean, the dynamic
    map the codes index)."""
    offset = absmax.mean()
    centred = absmax - offset
    stats = _block_absmax(centred, STATS_BLOCKSIZE)
    pad = torch.nn.functional.pad(centred, (0, -centred.numel() % STATS_BLOCKSIZE)).view(-1, STATS_BLOCKSIZE)
    code8 = dynamic_map().to(absmax.device)
    qabsmax = _nearest(pad / stats[:, None], code8).reshape(-1)[: absmax.numel()].to(torch.uint8)
    return qabsmax, stats, float(offset), code8


@on_tensor_device
def quantize_nf4(w: torch.Tensor, blocksize: int = BLOCKSIZE, double_quant: bool = True) -> NF4Weight:
    x = w.detach().reshape(-1).float()
    n = x.numel()
    absmax = _block_absmax(x, blocksize)
    padded = torch.nn.functional.pad(x, (0, -n % blocksize)).view(-1, blocksize)
    scaled = padded * (1.0 / absmax)[:, None]  # as the kernels do: times the reciprocal
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=x.device)
    codes = _nearest(scaled, levels).reshape(-1)[:n].to(torch.uint8)
    if n % 2:
        codes = torch.cat([codes, torch.full((1,), 7, dtype=torch.uint8, device=x.device)])  # the 0.0 level
    packed = (codes[0::2] << 4) | codes[1::2]
    q = NF4Weight(packed, w.shape, w.dtype, blocksize, absmax)
    if double_quant:
        qabsmax, stats, offset, code8 = double_quantize(absmax)
        q = NF4Weight(packed, w.shape, w.dtype, blocksize, None, qabsmax, stats, offset, code8)
    return q


def dequantize_nf4_reference(q: NF4Weight) -> torch.Tensor:
    codes = torch.stack([q.packed >> 4, q.packed & 15], dim=1).reshape(-1)[: q.numel].long()
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=q.packed.device)
    scale = q.block_scales()[torch.arange(q.numel, device=q.packed.device) // q.blocksize]
    return (levels[codes] * scale).to(q.dtype).reshape(q.shape)


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _nf4_dequant(P, LEVELS, SCALES, OUT, n, BLOCKSIZE: tl.constexpr, BLOCK: tl.constexpr):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # a weight may pass 2^31 values
        mask = idx < n
        byte = tl.load(P + idx // 2, mask=mask, other=0).to(tl.int32)
        code = tl.where(idx % 2 == 0, byte >> 4, byte & 15)
        level = tl.load(LEVELS + code, mask=mask, other=0.0)
        scale = tl.load(SCALES + idx // BLOCKSIZE, mask=mask, other=0.0)
        tl.store(OUT + idx, (level * scale).to(OUT.dtype.element_ty), mask=mask)


@on_tensor_device
def dequantize_nf4(q: NF4Weight) -> torch.Tensor:
    """The dense weight in its original dtype (Triton; the reference where Triton cannot run)."""
    if not triton_usable(q.packed):
        return dequantize_nf4_reference(q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.packed.device)
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=q.packed.device)
    # The block scales (one per 64 weights) are decoded in PyTorch: decoding them in the kernel lets the GPU
    # compiler contract code * max + offset into one FMA, one rounding fewer than the reference, so a dequantised
    # weight would differ from the reference (and from bitsandbytes, which also decodes the scales first).
    block = max(BLOCK, _common.INTERPRETER_BLOCK) if interpreting() else BLOCK  # (never below the GPU's)
    _nf4_dequant[(triton.cdiv(q.numel, block),)](
        q.packed, levels, q.block_scales().float().contiguous(), out, q.numel, BLOCKSIZE=q.blocksize, BLOCK=block
    )
    launched("nf4_dequant")
    return out


class _NF4Linear(torch.autograd.Function):
    """y = x W^T with W dequantised from NF4; the backward dequantises again instead of keeping W (only x is
    saved). W is frozen: no gradient for it."""

    @staticmethod
    def forward(ctx, x, q: NF4Weight):
        ctx.q = q
        ctx.save_for_backward(x)
        return torch.nn.functional.linear(x, dequantize_nf4(q).to(x.dtype))

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return dy @ dequantize_nf4(ctx.q).to(dy.dtype), None


@on_tensor_device
def nf4_linear(x: torch.Tensor, q: NF4Weight) -> torch.Tensor:
    """A linear layer whose frozen weight is stored in NF4 (QLoRA's base)."""
    return _NF4Linear.apply(x, q)


COMPILE_CASES = (
    [
        (
            f"nf4_dequant_{t}",
            _nf4_dequant,
            {
                "P": "*u8",
                "LEVELS": "*fp32",
                "SCALES": "*fp32",
                "OUT": f"*{t}",
                "n": "i32",
                "BLOCKSIZE": "constexpr",
                "BLOCK": "constexpr",
            },  # fmt: skip
            {"BLOCKSIZE": BLOCKSIZE, "BLOCK": BLOCK},
        )
        for t in ("bf16", "fp32")
    ]
    if HAVE_TRITON
    else []
)
