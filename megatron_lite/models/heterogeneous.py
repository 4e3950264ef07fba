"""Heterogeneous layers (Llama-Nemotron's "block configs"; Megatron-Core's HeterogeneousTransformerConfig and
heterogeneous_layer_specs.py). No torch here: the config, the FLOPs count and the converters read it.

--heterogeneous-layers-config-path names a Hugging Face config.json (DeciLM, model_type nemotron-nas) whose
"block_configs" list holds one entry per decoder layer; --heterogeneous-layers-config-encoded-json gives its text
(the config keeps the text, so a checkpoint carries it). Each entry has

    "attention": {"no_op", "replace_with_linear", "n_heads_in_group"}   (or Megatron's "num_query_groups")
    "ffn" (or "mlp"): {"no_op", "replace_with_linear", "ffn_mult"}      (or Megatron's "ffn_hidden_size")

A layer's attention is normal attention with num_attention_heads / n_heads_in_group query groups (the model's
--num-query-groups when null); a no-op (the layer's attention and its pre-norm skipped: the stream passes
through); or replace_with_linear: x + W norm(x), W one [hidden, hidden] linear, column-parallel over TP with its
output gathered (Megatron's ColumnParallelLinearGathered). The MLP the same, its size from ffn_mult as DeciLM's
_ffn_mult_to_intermediate_size (Megatron's MLPConfig.ffn_mult_to_intermediate_size): int(2 ffn_mult hidden / 3)
rounded up to a multiple of 256.

Megatron keeps only those fields and ignores the rest; DeciLM's other attention features (window_length,
sparsify, num_sink_tokens, unshifted_sink, use_prefill_window_in_sink_attention) change the math where set, so
here a set one is refused, not ignored."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_lite.config import ModelConfig

NORMAL, LINEAR, NO_OP = "normal", "linear", "no_op"
# (named for both: the model holds the blocks' text, not which flag gave it; naming the path alone blamed a flag
# the user of -encoded-json never typed, a review's and a fuzzer's)
FLAG = "--heterogeneous-layers-config-path (or -encoded-json)"
# Keys a block's part may carry that have no effect when null / false (DeciLM writes them in every block)
_ATTENTION_KEYS = {"no_op", "replace_with_linear", "n_heads_in_group", "num_query_groups"}
_MLP_KEYS = {"no_op", "replace_with_linear", "ffn_mult", "ffn_hidden_size"}
_INERT = {
    "window_length",
    "sparsify",
    "num_sink_tokens",
    "unshifted_sink",
    "use_prefill_window_in_sink_attention",
    "prefill_window",
}


@dataclass(frozen=True)
class BlockConfig:
    """One decoder layer's parts: `attention` and `mlp` are normal | linear | no_op; the sizes None where the
    model's own (--num-query-groups, --ffn-hidden-size) apply or the part has none."""

    attention: str = NORMAL
    num_query_groups: int | None = None
    mlp: str = NORMAL
    ffn_hidden_size: int | None = None


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - n % k


def ffn_mult_to_intermediate_size(ffn_mult: float, hidden_size: int) -> int:
    """DeciLM's _ffn_mult_to_intermediate_size (Megatron's MLPConfig.ffn_mult_to_intermediate_size)."""
    return find_multiple(int(2 * ffn_mult * hidden_size / 3), 256)


def _kind(part: dict, where: str) -> str:
    no_op, linear = bool(part.get("no_op")), bool(part.get("replace_with_linear"))
    if no_op and linear:
        raise _error(f"{where} sets both no_op and replace_with_linear: keep one")
    return NO_OP if no_op else LINEAR if linear else NORMAL


def _error(what: str):
    from megatron_lite.config import ConfigError

    return ConfigError(f"{FLAG}: {what}")


def _check_keys(part: dict, known: set[str], where: str) -> None:
    for key, value in part.items():
        if key in known or (key in _INERT and value in (None, False, 0)):
            continue
        raise _error(
            f"{where} sets {key}={value!r}, which is not implemented (Megatron builds no_op, replace_with_linear "
            f"and the sizes only): set it to null in the block configs or use a homogeneous model"
        )


def _size(part: dict, name: str, where: str, whole: bool = True) -> int | float | None:
    value = part.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (whole and value != int(value)):
        raise _error(f"{where} has {name}={value!r}: it must be a positive {'whole ' if whole else ''}number or null")
    return int(value) if whole else value


def parse_block_configs(text: str, num_attention_heads: int, hidden_size: int) -> tuple[BlockConfig, ...]:
    """The per-layer blocks of a config.json's text, as Megatron's HeterogeneousTransformerConfig reads them."""
    try:
        hf = json.loads(text)
    except json.JSONDecodeError as e:
        raise _error(
            f"the config is not JSON ({e}): give a Hugging Face config.json with a block_configs list"
        ) from None
    blocks = hf.get("block_configs") if isinstance(hf, dict) else None
    if not isinstance(blocks, list) or not blocks:
        raise _error("the config has no block_configs list: give a DeciLM (nemotron-nas) config.json")
    out = []
    for i, block in enumerate(blocks):
        attention = block.get("attention") if isinstance(block, dict) else None
        mlp = (block.get("ffn") or block.get("mlp")) if isinstance(block, dict) else None
        if not isinstance(attention, dict) or not isinstance(mlp, dict):
            raise _error(f"block {i} needs an 'attention' and an 'ffn' object")
        where = f"block {i} attention"
        _check_keys(attention, _ATTENTION_KEYS, where)
        attn_kind, groups = _kind(attention, where), _size(attention, "num_query_groups", where)
        per_group = _size(attention, "n_heads_in_group", where)
        if groups is None and per_group is not None:
            if num_attention_heads % per_group:
                raise _error(
                    f"{where} has n_heads_in_group={per_group}, which does not divide --num-attention-heads "
                    f"{num_attention_heads}: use a divisor of {num_attention_heads}"
                )
            groups = num_attention_heads // per_group
        if groups is not None and attn_kind != NORMAL:
            raise _error(f"{where} is {attn_kind} and has a query-group count: set n_heads_in_group to null")
        where = f"block {i} ffn"
        _check_keys(mlp, _MLP_KEYS, where)
        mlp_kind, ffn = _kind(mlp, where), _size(mlp, "ffn_hidden_size", where)
        mult = _size(mlp, "ffn_mult", where, whole=False)
        if ffn is None and mult is not None:
            ffn = ffn_mult_to_intermediate_size(mult, hidden_size)
        if ffn is not None and mlp_kind != NORMAL:
            raise _error(f"{where} is {mlp_kind} and has an FFN size: set ffn_mult to null")
        out.append(BlockConfig(attn_kind, groups, mlp_kind, ffn))
    return tuple(out)


def validate_heterogeneous(c: ModelConfig) -> None:
    """Start-up checks of a heterogeneous model alone: the blocks against --num-layers and the heads, and what is
    not built with them (one line naming the flag, the layer, the value and the fix)."""
    from megatron_lite.config import ConfigError

    if c.heterogeneous_layers_config_encoded_json is None:
        return
    blocks = c.heterogeneous_blocks
    if len(blocks) != c.num_layers:
        raise _error(
            f"the config has {len(blocks)} block_configs but --num-layers is {c.num_layers}: give --num-layers "
            f"{len(blocks)}"
        )
    for i, b in enumerate(blocks):
        if b.num_query_groups is not None and c.num_attention_heads % b.num_query_groups:
            raise _error(
                f"block {i} attention has {b.num_query_groups} query groups, which do not divide "
                f"--num-attention-heads {c.num_attention_heads}: use n_heads_in_group dividing the heads"
            )
    norm_regen = c.recompute_granularity == "selective" and "layernorm" in c.recompute_modules
    for flag, on in (
        ("--num-experts", c.num_experts is not None),
        ("--multi-latent-attention", c.multi_latent_attention),
        ("--is-hybrid-model / --hybrid-override-pattern", c.hybrid),
        ("--mtp-num-layers", c.mtp_num_layers > 0),
        ("--apply-residual-connection-post-layernorm", c.apply_residual_connection_post_layernorm),
        ("--recompute-modules layernorm", norm_regen),
        ("--fp8-format", c.fp8 is not None),
    ):
        if on:
            raise ConfigError(f"{flag} is not supported with heterogeneous layers ({FLAG}): drop {flag}")


def validate_heterogeneous_layout(c: ModelConfig, tp: int) -> None:
    """Each layer's own sizes split across TP as Megatron splits them (whole query groups, the FFN and, for a
    linear replacement, the hidden size by TP)."""
    if c.heterogeneous_layers_config_encoded_json is None:
        return
    if any(LINEAR in (b.attention, b.mlp) for b in c.heterogeneous_blocks) and c.hidden_size % tp:
        raise _error(
            f"a linear replacement splits --hidden-size {c.hidden_size} across --tensor-model-parallel-size {tp}: "
            "use a TP size that divides it"
        )
    for i in range(c.num_layers):
        b, layer = c.heterogeneous_blocks[i], c.layer_config(i)
        if b.attention == NORMAL and layer.query_groups % tp:
            raise _error(
                f"block {i} attention has {layer.query_groups} query groups, not divisible by "
                f"--tensor-model-parallel-size {tp}: use a TP size that divides every layer's query groups"
            )
        if b.mlp == NORMAL and layer.ffn_size % tp:
            raise _error(
                f"block {i} ffn has FFN size {layer.ffn_size}, not divisible by --tensor-model-parallel-size "
                f"{tp}: use a TP size that divides every layer's FFN size"
            )


def layer_kinds(c: ModelConfig, layer: int) -> str:
    """Layer `layer`'s residual branches in the hybrid symbols: "*-" both, "*" attention only (its MLP a
    no-op), "-" MLP only, "" neither (the layer is an identity)."""
    b = c.heterogeneous_blocks[layer]
    return ("*" if b.attention != NO_OP else "") + ("-" if b.mlp != NO_OP else "")


def _layer_parts(c: ModelConfig, layer: int) -> tuple:
    """Layer `layer`'s (attention kind, query groups, MLP kind, FFN size) as built: the sizes resolved (the model's
    where a block leaves them null; a homogeneous model's layers all plain) and None for a part that has none."""
    b = c.heterogeneous_blocks[layer] if c.heterogeneous_blocks is not None else BlockConfig()
    layer_c = c.layer_config(layer)
    return (
        b.attention,
        layer_c.query_groups if b.attention == NORMAL else None,
        b.mlp,
        layer_c.ffn_size if b.mlp == NORMAL else None,
    )


def _describe(parts: tuple) -> str:
    attention, groups, mlp, ffn = parts
    return (
        f"attention {attention}{f' ({groups} query groups)' if groups is not None else ''}, "
        f"MLP {mlp}{f' (FFN {ffn})' if ffn is not None else ''}"
    )


def first_block_difference(theirs: ModelConfig, ours: ModelConfig, whose: str = "the checkpoint's") -> str | None:
    """The first layer whose parts or sizes differ between two models of the same depth, said in one short line
    (both tuples of blocks in full ran to kilobytes for an 80-layer model), or None where every layer is built
    alike (a homogeneous model and plain blocks of its sizes are the same layers)."""
    counts = [len(c.heterogeneous_blocks or ()) or c.num_layers for c in (theirs, ours)]
    if counts[0] != counts[1]:
        return f"{whose} {counts[0]} layers; this run's {counts[1]}"
    for i in range(counts[0]):
        a, b = _layer_parts(theirs, i), _layer_parts(ours, i)
        if a != b:
            return f"block {i}: {whose} {_describe(a)}; this run's {_describe(b)}"
    return None


def check_given_blocks(text: str, flag: str, saved_model: dict, path: str) -> None:
    """--load with a block-config flag given (`flag`, whose blocks are `text`: the encoded JSON, else the path's
    file): its blocks must build the checkpoint's layers. Compared as blocks, not as text: the same blocks written
    as other JSON (a converted checkpoint keeps re-serialised text; Megatron's usual
    `--heterogeneous-layers-config-encoded-json "$(cat config.json)"`) are the same model."""
    import dataclasses

    from megatron_lite.checkpoint.compatibility import model_config_from_dict

    theirs = model_config_from_dict(saved_model)
    ours = dataclasses.replace(theirs, heterogeneous_layers_config_encoded_json=text)
    if (difference := first_block_difference(theirs, ours)) is not None:
        from megatron_lite.config import ConfigError

        raise ConfigError(
            f"{flag} conflicts with the checkpoint in {path} ({difference}): drop the flag, or pass "
            "--use-checkpoint-args to take the checkpoint's block configs"
        )
