"""Megatron's flag values read as our config values: its per-layer lists and list expressions, its derived
defaults (the SwiGLU width, MLA's YaRN), and the list forms of flags that take one value here."""

from __future__ import annotations

import argparse
import json
import math
import re

from megatron_lite.config import ConfigError, RopeScaling, yarn_mscale


def list_expression(text: str) -> list[int]:
    """Megatron's list expressions for per-layer patterns, e.g. "([0]*3+[1]*58)", "[1,0]*4" or "4*[1,0]": lists of
    integers, concatenated with + and repeated with * N (or N *), in parentheses. Parsed, never eval'd."""
    tokens = re.findall(r"\d+|[\[\](),+*]|\S", text)
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take(expected: str | None = None) -> str:
        nonlocal pos
        tok = peek()
        if tok is None or (expected is not None and tok != expected):
            raise ValueError(f"expected {expected or 'more'} at token {pos}, got {tok!r}")
        pos += 1
        return tok

    def atom() -> list[int]:
        if peek() == "(":
            if text.count("(") > 32:
                raise ValueError("parentheses nested too deep")
            take("(")
            out = expr()
            take(")")
            return out
        take("[")
        out = []
        while peek() != "]":
            out.append(int(take()))
            if peek() == ",":
                take(",")
        take("]")
        return out

    def term() -> list[int]:
        # (a count may lead, as Python reads "2*[1,0]": the product is the same either way round)
        lead = 1
        while peek() is not None and peek().isdigit():
            lead *= int(take())
            take("*")
        out = atom()
        while peek() == "*":
            take("*")
            lead *= int(take())
        if lead > 100_000 or len(out) * lead > 100_000:  # (a layer pattern; never a list worth exhausting memory)
            raise ValueError("pattern too long")
        return out * lead

    def expr() -> list[int]:
        out = term()
        while peek() == "+":
            take("+")
            out = out + term()
            if len(out) > 100_000:
                raise ValueError("pattern too long")
        return out

    result = expr()
    if pos != len(tokens):
        raise ValueError(f"unexpected {tokens[pos]!r}")
    return result


def layer_freq(text, flag: str = "--moe-layer-freq") -> int | tuple[int, ...]:
    """Megatron's --moe-layer-freq (and --window-attn-skip-freq, of the same type): an integer N, or a per-layer
    pattern ("0,1,1", "[0,1,1]" or a list expression such as "([0]*3+[1]*58)")."""
    if isinstance(text, (int, tuple, list)):
        return text if isinstance(text, int) else tuple(text)
    body = str(text).strip()
    try:
        if any(c in body for c in "*+"):
            values = list_expression(body)
        else:
            values = [int(x) for x in body.strip("[]() ").split(",") if x.strip()]
    except ValueError:
        raise ConfigError(
            f"{flag} {text!r} must be an integer, a comma-separated 0/1 list or a list expression such as "
            "'([0]*3+[1]*58)'"
        ) from None
    return values[0] if len(values) == 1 and not any(c in body for c in "*+[](),") else tuple(values)


def balancing(ns: argparse.Namespace) -> tuple[str, float]:
    """Megatron's --moe-router-load-balancing-type and --moe-aux-loss-coeff take a list (one coefficient per
    balancing type, the losses added); one type per run here."""
    kinds, coeffs = ns.moe_router_load_balancing_type, ns.moe_aux_loss_coeff
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    coeffs = [coeffs] if isinstance(coeffs, (int, float)) else list(coeffs)
    if len(kinds) > 1:
        raise ConfigError(
            f"--moe-router-load-balancing-type {' '.join(kinds)}: combining balancing losses is not supported; give "
            "one type (and one --moe-aux-loss-coeff)"
        )
    if len(coeffs) > 1:
        raise ConfigError(
            f"--moe-aux-loss-coeff {' '.join(map(str, coeffs))}: one coefficient per balancing type, and "
            f"--moe-router-load-balancing-type gives one ({kinds[0]})"
        )
    return kinds[0], coeffs[0]


def capacity_factor(ns: argparse.Namespace) -> float | None:
    """--moe-expert-capacity-factor: a negative value means dropless in Megatron (its config sets None)."""
    cf = ns.moe_expert_capacity_factor
    if cf is not None and cf < 0 and getattr(ns, "moe_pad_expert_input_to_capacity", False):
        # (refused as Megatron refuses it; the refusal had asked for the factor that was given)
        raise ConfigError(
            f"--moe-expert-capacity-factor {cf:g} is dropless (a negative factor), so there is no capacity for "
            "--moe-pad-expert-input-to-capacity to pad to: give a positive factor or drop the padding"
        )
    return None if cf is not None and cf < 0 else cf


def cp_comm_type(values, num_layers: int | None) -> str:
    """Megatron's --cp-comm-type: one value, or one per layer. Every layer here shares its attention's
    communication, so a list is taken when its values agree."""
    if isinstance(values, str):
        return values
    if len(values) > 1 and num_layers is not None and len(values) != num_layers:
        raise ConfigError(
            f"--cp-comm-type gives {len(values)} values for --num-layers {num_layers}: give one, or one per layer"
        )
    if len(set(values)) > 1:
        raise ConfigError(
            f"--cp-comm-type {' '.join(values)}: a different type per layer is not supported; give one for all layers"
        )
    return values[0]


def main_grads_bf16(ns: argparse.Namespace) -> bool:
    """Megatron's --main-grads-dtype bf16 (with --use-precision-aware-optimizer): bf16 main gradients, which
    --grad-reduce-in-bf16 gives here; --main-params-dtype fp16 has no counterpart (fp32 main weights only)."""
    if getattr(ns, "main_params_dtype", None) == "fp16":
        raise ConfigError("--main-params-dtype fp16 is not supported: main weights are fp32; drop the flag")
    if getattr(ns, "main_grads_dtype", None) in (None, "fp32"):  # (fp32: the default, which Megatron takes alone)
        return False
    if not ns.use_precision_aware_optimizer:
        raise ConfigError(
            f"--main-grads-dtype {ns.main_grads_dtype} needs --use-precision-aware-optimizer (as in Megatron)"
        )
    if ns.main_grads_dtype == "bf16" and not ns.bf16:
        raise ConfigError("--main-grads-dtype bf16 needs --bf16 (bf16 main gradients reduce bf16 weights' gradients)")
    return ns.main_grads_dtype == "bf16"


def mla_yarn(ns: argparse.Namespace) -> RopeScaling | None:
    """Megatron's RoPE for multi-latent attention: YaRN unless --rope-type rope, over an original context of 4096
    (MLATransformerConfig's), beta_fast 32, beta_slow 1, cos / sin times mscale(f, --mscale) / mscale(f,
    --mscale-all-dim). A factor of 1 is plain RoPE (nothing is interpolated and both mscales are 1)."""
    f, kind = ns.rotary_scaling_factor, ns.rope_type
    if f <= 0:
        raise ConfigError(f"--rotary-scaling-factor {f} must be > 0")
    if kind == "yarn" and not ns.multi_latent_attention:
        raise ConfigError(
            "--rope-type yarn is supported with --multi-latent-attention only (for Llama-3 scaling use "
            "--use-rope-scaling --rope-scaling-factor)"
        )
    if not ns.multi_latent_attention or f == 1.0:
        return None
    if kind == "rope":
        raise ConfigError(
            f"--rotary-scaling-factor {f} with --rope-type rope: the factor scales YaRN only; drop one of them"
        )
    return RopeScaling(
        factor=f,
        original_max_position_embeddings=4096,
        rope_type="yarn",
        beta_fast=32.0,
        beta_slow=1.0,
        attention_factor=yarn_mscale(f, ns.mscale) / yarn_mscale(f, ns.mscale_all_dim),
        truncate=True,
    )


def ffn_hidden_size(ns: argparse.Namespace) -> int | None:
    """--ffn-hidden-size, or Megatron's default: 4 x hidden, and with --swiglu 2/3 of that rounded down to a
    multiple of 64 (the gate and up projections together then hold about what one 4 x hidden one would)."""
    if ns.ffn_hidden_size is not None or not ns.swiglu:
        return ns.ffn_hidden_size
    size = int((4 * ns.hidden_size * 2 / 3) / 64) * 64
    if size == 0:
        raise ConfigError(
            f"--swiglu without --ffn-hidden-size: Megatron's default, 8 x hidden / 3 rounded down to a multiple of "
            f"64, is 0 for --hidden-size {ns.hidden_size}; give --ffn-hidden-size"
        )
    return size


def heterogeneous_json(ns: argparse.Namespace) -> str | None:
    """The block configs' text: --heterogeneous-layers-config-encoded-json, else the file of
    --heterogeneous-layers-config-path (Megatron's HeterogeneousTransformerConfig reads the path only when the
    text is empty), else None (a homogeneous model)."""
    if text := ns.heterogeneous_layers_config_encoded_json:
        try:  # (its errors below name the path flag, the usual source)
            json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"--heterogeneous-layers-config-encoded-json is not JSON ({e}): give a config.json's text with a "
                "block_configs list"
            ) from None
        return text
    path = ns.heterogeneous_layers_config_path
    if path is None:
        return None
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise ConfigError(
            f"--heterogeneous-layers-config-path {path} cannot be read ({e.strerror}): give the path of the "
            "model's config.json"
        ) from None


def activation(ns: argparse.Namespace) -> str:
    chosen = [f for f in ("swiglu", "openai_gelu", "squared_relu", "quick_geglu") if getattr(ns, f, False)]
    if len(chosen) > 1:
        raise ConfigError(
            f"--{chosen[0].replace('_', '-')} and --{chosen[1].replace('_', '-')} both pick the activation"
        )
    if not chosen:
        # Megatron's GELU with biases is its fused bias-GELU (on unless --no-bias-gelu-fusion; off without
        # biases), which is the tanh approximation: exact GELU there differed by 2e-4 in the logits
        fused = not getattr(ns, "disable_bias_linear", False) and not getattr(ns, "no_bias_gelu_fusion", False)
        return "gelu_tanh" if fused else "gelu"
    return chosen[0] if chosen[0] != "openai_gelu" else "gelu_tanh"


def data_paths(ns: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """--data-path and --{train,valid,test}-data-path, or Megatron's files holding them for blends too long for a
    command line: --data-args-path (the --data-path words, whitespace-separated) and --per-split-data-args-path
    (JSON: {"train": [...] or "...", "valid": ..., "test": ...})."""
    import json

    out = {
        k: tuple(getattr(ns, k) or ()) for k in ("data_path", "train_data_path", "valid_data_path", "test_data_path")
    }
    given = [k for k, v in out.items() if v]
    for flag, path in (
        ("--data-args-path", ns.data_args_path),
        ("--per-split-data-args-path", ns.per_split_data_args_path),
    ):
        if path is None:
            continue
        if given:
            raise ConfigError(f"{flag} {path} and --{given[0].replace('_', '-')}: give the datasets one way")
        try:
            text = open(path, encoding="utf-8").read()
        except OSError as e:
            raise ConfigError(f"{flag} {path}: {e.strerror}") from None
        if flag == "--data-args-path":
            out["data_path"] = tuple(text.split())
            if not out["data_path"]:
                raise ConfigError(f"{flag} {path} is empty: write the --data-path words in it")
            given = ["data_args_path"]
            continue
        try:
            splits = json.loads(text)
            if not isinstance(splits, dict):
                raise ValueError(f"a JSON {type(splits).__name__}, not an object")
            unknown = set(splits) - {"train", "valid", "test"}
            if unknown:
                raise ValueError(f"keys {sorted(unknown)}")
            for split, value in splits.items():
                if not isinstance(value, str) and not (
                    isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value)
                ):
                    raise ValueError(f'"{split}" holds {json.dumps(value)}, not a string or a list of strings')
        except ValueError as e:
            raise ConfigError(
                f'{flag} {path}: expected JSON {{"train": [...], "valid": [...], "test": [...]}} ({e})'
            ) from None
        for split, value in splits.items():
            out[f"{split}_data_path"] = tuple(value.split() if isinstance(value, str) else map(str, value))
    return out


def whole(flag: str, value: float) -> int:
    """A count Megatron's argparse reads as a float ("1000.0"): taken when it is a whole number."""
    if not math.isfinite(value) or value != int(value):
        raise ConfigError(f"{flag} {value:g} must be a whole number of iterations")
    return int(value)


def qk_clip(ns: argparse.Namespace) -> dict:
    """ModelConfig's QK-clip fields (models/qk_clip.py), named as Megatron's flags."""
    return {name: getattr(ns, name) for name in ("qk_clip", "qk_clip_alpha", "qk_clip_threshold",
                                                 "log_max_attention_logit")}  # fmt: skip
