"""NF4 with double-quantised scales (kernels/nf4.py) against the rules as the QLoRA paper states them and as
bitsandbytes lays them out (bitsandbytes does not run here: no CUDA, and its CPU build is not installed):
the 16 levels, nearest-level codes, 64-element blocks with their own maximum, two codes per byte (even
element high), the dynamic 8-bit map for the block maxima in blocks of 256; the dequantisation error bound;
4.127 bits per parameter; the Triton kernel equal to the reference; real converted weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_lite.kernels import LAUNCHES
from megatron_lite.kernels.nf4 import (
    NF4_LEVELS,
    dequantize_nf4,
    dequantize_nf4_reference,
    dynamic_map,
    quantize_nf4,
)

LEVELS = torch.tensor(NF4_LEVELS)
HALF_GAP = float((LEVELS[1:] - LEVELS[:-1]).max() / 2)  # the farthest a value can be from its level


def _codes(q) -> torch.Tensor:
    return torch.stack([q.packed >> 4, q.packed & 15], dim=1).reshape(-1)[: q.numel].long()


def test_levels_are_the_normal_float_code_book():
    assert len(NF4_LEVELS) == 16 and NF4_LEVELS[0] == -1.0 and NF4_LEVELS[7] == 0.0 and NF4_LEVELS[15] == 1.0
    assert all(a < b for a, b in zip(NF4_LEVELS, NF4_LEVELS[1:]))
    # Dettmers et al.: quantiles of N(0, 1), 8 on the positive side and 7 on the negative, normalised to
    # [-1, 1]: the positive levels are Phi^-1 of evenly spaced probabilities in [0.5, 0.9677] (offset 0.9677)
    normal = torch.distributions.Normal(0.0, 1.0)
    offset = 0.9677083
    pos = normal.icdf(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1].float())
    neg = -normal.icdf(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1].float())
    ours = torch.cat([neg, torch.zeros(1), pos]).sort().values
    ours = ours / ours.abs().max()
    assert torch.allclose(ours, LEVELS, atol=1e-6)


@pytest.mark.parametrize("shape", [(96, 130), (1, 63), (3, 77)])  # partial last blocks, an odd count
def test_codes_blocks_and_packing_follow_the_rules(shape):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=gen) * 0.02
    q = quantize_nf4(w, double_quant=False)
    flat = w.reshape(-1)
    n = flat.numel()
    assert q.packed.dtype == torch.uint8 and q.packed.numel() == (n + 1) // 2
    assert q.absmax.numel() == -(-n // 64)
    for b in range(q.absmax.numel()):  # each block, the last partial one included, has its own maximum
        assert q.absmax[b] == flat[b * 64 : (b + 1) * 64].abs().max()
    scaled = flat / q.absmax[torch.arange(n) // 64]
    brute = (scaled[:, None] - LEVELS[None, :]).abs().argmin(dim=1)  # nearest level, by brute force
    assert torch.equal(_codes(q), brute)
    assert int(q.packed[0]) >> 4 == int(brute[0]) and int(q.packed[0]) & 15 == int(brute[1])  # even element high
    if n % 2:
        assert int(q.packed[-1]) & 15 == 7  # padded with the 0.0 level


def test_double_quantised_scales():
    code8 = dynamic_map()
    assert code8.numel() == 256 and torch.all(code8[1:] > code8[:-1])
    assert code8[127] == 0.0 and code8[255] == 1.0 and abs(float(code8[0]) + 0.99296875) < 1e-6
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(300, 256, generator=gen) * 0.02  # 1200 blocks, 5 stats blocks
    single, double = quantize_nf4(w, double_quant=False), quantize_nf4(w)
    assert torch.equal(single.packed, double.packed)  # the 4-bit codes do not depend on how scales are stored
    assert double.qabsmax.dtype == torch.uint8 and double.stats_absmax.numel() == -(-1200 // 256)
    assert abs(double.offset - float(single.absmax.mean())) < 1e-6
    centred = single.absmax - double.offset
    normalised = centred / double.stats_absmax[torch.arange(1200) // 256]
    assert torch.equal(double.qabsmax.long(), (normalised[:, None] - code8[None, :]).abs().argmin(dim=1))
    # with block maxima as alike as a weight's, the 8-bit scales stay within a percent or so
    rel = ((double.block_scales() - single.absmax).abs() / single.absmax).max()
    assert rel < 0.02, rel


@pytest.mark.parametrize("double_quant", [False, True])
def test_dequantisation_error_is_within_the_nf4_bound(double_quant):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 200, generator=gen)
    q = quantize_nf4(w, double_quant=double_quant)
    deq = dequantize_nf4_reference(q)
    assert deq.shape == w.shape and deq.dtype == w.dtype
    n = w.numel()
    scale = q.block_scales()[torch.arange(n) // 64]
    exact = quantize_nf4(w, double_quant=False).absmax[torch.arange(n) // 64]
    # |w - level * s'| <= |w/s - level| * s' + |w/s| * |s - s'| <= HALF_GAP * s' + |s - s'|
    bound = HALF_GAP * scale + (exact - scale).abs() + 1e-6
    assert torch.all((w.reshape(-1) - deq.reshape(-1)).abs() <= bound)


def test_four_point_one_two_seven_bits_per_parameter():
    q = quantize_nf4(torch.randn(256, 64 * 256))  # whole stats blocks
    assert abs(q.bits_per_parameter() - (4 + 8 / 64 + 32 / (64 * 256))) < 1e-9
    assert abs(quantize_nf4(torch.randn(256, 256), double_quant=False).bits_per_parameter() - 4.5) < 1e-9


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


def _on(q, device: str, dtype: torch.dtype = torch.float32):
    moved = {f: getattr(q, f).to(device) for f in ("packed", "absmax", "qabsmax", "stats_absmax", "code8")
             if getattr(q, f) is not None}  # fmt: skip
    return dataclasses.replace(q, dtype=dtype, **moved)


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape", [(33, 65), (1, 7), (256, 320)])
def test_triton_dequantisation_equals_the_reference(double_quant, shape):
    gen = torch.Generator().manual_seed(3)
    q = _on(quantize_nf4(torch.randn(shape, generator=gen), double_quant=double_quant), DEVICE)
    before = LAUNCHES["nf4_dequant"]
    got = dequantize_nf4(q)
    assert LAUNCHES["nf4_dequant"] == before + 1  # the kernel ran, not the fallback
    assert torch.equal(got, dequantize_nf4_reference(q))


def test_these_tests_run_the_gpus_blocks_and_a_launch_reads_the_interpreters(monkeypatch):
    """tests/conftest.py gives these tests the GPU's 1024-element blocks (their odd shapes cross block
    boundaries); under the interpreter, model-level tests run bigger blocks (kernels/_common.py:
    INTERPRETER_BLOCK, fewer programs), read at each launch, with the same result."""
    from megatron_lite.kernels import _common, nf4

    assert _common.INTERPRETER_BLOCK == nf4.BLOCK == 1024
    if not _common.interpreting():
        pytest.skip("the interpreter's block size: under TRITON_INTERPRET=1 only")
    grids, kernel = [], nf4._nf4_dequant

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(nf4, "_nf4_dequant", Spy())
    q = quantize_nf4(torch.randn(33, 65, generator=torch.Generator().manual_seed(5)))
    for block in (1024, 16384):
        monkeypatch.setattr(_common, "INTERPRETER_BLOCK", block)
        assert torch.equal(dequantize_nf4(q), dequantize_nf4_reference(q))
    assert grids == [(3,), (1,)]  # 2145 elements


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="bf16 needs a GPU: the Triton interpreter has no bf16 arithmetic"
)
def test_triton_dequantisation_to_bf16_on_gpu():
    q = _on(quantize_nf4(torch.randn(512, 384, generator=torch.Generator().manual_seed(4))), "cuda", torch.bfloat16)
    got, ref = dequantize_nf4(q), dequantize_nf4_reference(q)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref)


def test_real_converted_weights():
    """Every matrix of a Llama built by transformers and converted to our layout: codes are the nearest
    levels and the error stays within the bound."""
    transformers = pytest.importorskip("transformers")
    from megatron_lite.models.hf import config_from_hf
    from megatron_lite.models.hf_weights import state_dict_from_hf

    cfg = transformers.LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    ours = state_dict_from_hf(hf.state_dict(), config_from_hf(cfg), "LlamaForCausalLM")
    checked = 0
    for name, w in ours.items():
        if w.ndim != 2:
            continue
        q = quantize_nf4(w)
        n = w.numel()
        scale = q.block_scales()[torch.arange(n) // 64]
        exact = quantize_nf4(w, double_quant=False).absmax[torch.arange(n) // 64]
        flat = w.reshape(-1).float()
        brute = (flat / exact)[:, None].sub(LEVELS[None, :]).abs().argmin(dim=1)
        assert torch.equal(_codes(q), brute), name
        err = (flat - dequantize_nf4(q).reshape(-1)).abs()
        assert torch.all(err <= HALF_GAP * scale + (exact - scale).abs() + 1e-6), name
        checked += 1
    assert checked >= 9  # embeddings, output layer, QKV, projection, fc1, fc2 of each layer
