"""What a Hugging Face directory must hold before its weights are mapped, and what a mapped state dict must be.

A conversion that skips a missing tensor writes a checkpoint that fails at `--load`, or (exported) a model that
transformers fills with random weights and only warns about; one whose shapes disagree with config.json fails in
a reshape deep in the mapping. Both are checked here against the model config.json describes, built on the meta
device (nothing allocated), so the error names the tensor and the likely cause.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from megatron_lite.config import ConfigError, ModelConfig, ParallelConfig

# Tensors of checkpoints quantised for inference (GPTQ/AWQ packs, bitsandbytes, FP8 block scales).
QUANTISED_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale", ".qweight", ".qzeros", ".scales", ".absmax",
                      ".quant_map", ".quant_state.bitsandbytes__nf4", ".SCB")  # fmt: skip
QUANTISED_DTYPES = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "int8", "uint8") if hasattr(torch, n)}
CAUSE = "an incomplete download, or a config.json that does not describe these files"
EXPORT_CAUSE = "a damaged checkpoint: inspect it with tools/checkpoint/inspect_checkpoint.py --verify"


def normalize_hf_names(hf: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """The Hub's own GPT-2 checkpoints (openai-community/gpt2, distilgpt2) name their tensors without the
    `transformer.` prefix that GPT2LMHeadModel saves (`wte.weight`, `h.0.attn.c_attn.weight`); transformers loads
    both."""
    from megatron_lite.models.hf_llama4 import LLAMA4_VLM, text_tensors

    if arch == LLAMA4_VLM:  # (its text model, under language_model.)
        return text_tensors(hf)
    if arch == "GPT2LMHeadModel" and "wte.weight" in hf and "transformer.wte.weight" not in hf:
        return {k if k.startswith("lm_head.") else f"transformer.{k}": v for k, v in hf.items()}
    return hf


def check_not_quantised(hf: dict[str, torch.Tensor], raw: dict, where: str, log) -> None:
    """Quantised weights (FP8 DeepSeek-V3/R1 on the Hub, GPTQ, AWQ, bitsandbytes) are refused before any mapping:
    they would be read as unscaled weights. A config.json that still names a quantisation over bf16/fp32 weights
    (DeepSeek's fp8_cast_bf16 leaves it) is converted; the export does not carry it."""
    method = (raw.get("quantization_config") or {}).get("quant_method") or (raw.get("quantization_config") and "?")
    # (dtypes of weights only: GPT-2's attn.bias mask buffer was stored as uint8 by some transformers releases)
    packed = sorted(
        k
        for k, t in hf.items()
        if k.endswith(QUANTISED_SUFFIXES) or (t.dtype in QUANTISED_DTYPES and k.endswith("weight"))
    )
    if packed:
        dtypes = sorted({str(hf[k].dtype).removeprefix("torch.") for k in packed[:50]})
        raise ConfigError(
            f"{where} is a quantised checkpoint ({method or 'no quantization_config'}; {len(packed)} tensors such "
            f"as {packed[0]} in {'/'.join(dtypes)}): dequantise it to bf16 (and drop quantization_config from its "
            "config.json) first, then convert that"
        )
    if method:
        log(f"{where}: config.json names quantization {method!r} but the weights are not quantised: converted as they "
            "are (the quantization_config is dropped)")  # fmt: skip
    # any other integer weight (an int32 one was accepted and cast without a word; GPT-2's mask buffers aside)
    ints = sorted(
        k
        for k, t in hf.items()
        if not t.is_floating_point() and k.endswith(("weight", "bias")) and not k.endswith(("attn.bias", "masked_bias"))
    )
    if ints:
        raise ConfigError(
            f"{where} holds {len(ints)} weight(s) of an integer dtype, e.g. {ints[0]} in "
            f"{str(hf[ints[0]].dtype).removeprefix('torch.')}: a model's weights are floating point ({CAUSE})"
        )


def check_hf_shapes(
    hf: dict[str, torch.Tensor], config: ModelConfig, arch: str, where: str, rope_interleave: bool = True
) -> None:
    """Each Hugging Face tensor against the shape config.json gives it, named as the files name it: our expected
    tensors, on the meta device, through the export's mapping (either form of a fused module). A wrong one was
    named as ours after the mapping (`decoder.layers.0.mlp.linear_fc1.weight`), not `up_proj`."""
    from megatron_lite.models.hf_weights import state_dict_to_hf

    meta = {k: torch.empty(shape, device="meta") for k, shape in expected_tensors(config).items()}
    expected = {}
    for on_disk in (True, False):
        mapped = state_dict_to_hf(meta, config, arch, on_disk=on_disk, rope_interleave=rope_interleave)
        expected.update({k: tuple(t.shape) for k, t in mapped.items()})
    wrong = [
        f"{k} {tuple(hf[k].shape)} (expected {expected[k]})"
        for k in sorted(hf)
        if k in expected and tuple(hf[k].shape) != expected[k]
    ]
    if wrong:
        raise ConfigError(f"{where}: {len(wrong)} tensor(s) of the wrong shape, e.g. {'; '.join(wrong[:2])} ({CAUSE})")


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our full, unpadded tensor names and shapes for `config` (one process: every expert and layer)."""
    try:
        hash(config)
    except TypeError:  # (a field given as a list, by a caller outside the flags: built afresh)
        return _build_expected(config)
    return dict(_expected_tensors(config))  # (a copy: the caller may change it)


@functools.lru_cache(maxsize=2)
def _expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """(Cached: a conversion asks twice, and a DeepSeek-V3-sized model builds its 30k tensors on the meta
    device in 10 s each time.)"""
    return _build_expected(config)


def _build_expected(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.models.weights import full_shape
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.parameters import named_param_meta

    model = build_model(config, ParallelContext.virtual(ParallelConfig(), device=torch.device("meta")), device="meta")
    return {model.global_name(n): tuple(full_shape(p, meta)) for n, p, meta in named_param_meta(model)}


def check_state_dict(
    ours: dict[str, torch.Tensor], config: ModelConfig, where: str, log, extra_ok: bool = False, cause: str = CAUSE
) -> dict[str, torch.Tensor]:
    """`ours` against the model `config` describes: a missing tensor, a shape that differs, or (unless
    `extra_ok`) a tensor it has no place for is one line. A router's expert bias the files lack is zeros, as
    transformers initialises it."""
    expected = expected_tensors(config)
    missing = [k for k in expected if k not in ours]
    bias = [k for k in missing if k.endswith("router.expert_bias")]
    if bias:
        log(f"{where}: no expert score-correction bias for {len(bias)} MoE layer(s): zeros, as transformers takes")
        ours = {**ours, **{k: torch.zeros(expected[k]) for k in bias}}
        missing = [k for k in missing if k not in bias]
    if missing:
        raise ConfigError(f"{where} lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:3]} ({cause})")
    wrong = [
        f"{k} {tuple(ours[k].shape)} (expected {expected[k]})" for k in expected if tuple(ours[k].shape) != expected[k]
    ]
    if wrong:
        raise ConfigError(f"{where}: {len(wrong)} tensor(s) of the wrong shape, e.g. {'; '.join(wrong[:2])} ({cause})")
    unplaced = sorted(set(ours) - set(expected))
    if unplaced and not extra_ok:
        raise ConfigError(
            f"{where} holds tensors the model config.json describes has no place for, e.g. {unplaced[:3]} (a bias "
            "with attention_bias / mlp_bias false?); fix config.json or remove them"
        )
    return ours


@contextlib.contextmanager
def mapping_errors(where: str):
    """Turns a KeyError (a tensor the mapping reads is absent) or a RuntimeError (a reshape of a tensor whose
    shape config.json does not give) into one line."""
    try:
        yield
    except KeyError as error:
        raise ConfigError(f"{where} lacks the tensor {error.args[0]} ({CAUSE})") from None
    except RuntimeError as error:
        first = str(error).strip().splitlines()[0]
        raise ConfigError(f"{where}: a tensor's shape does not fit config.json ({first}; {CAUSE})") from None
