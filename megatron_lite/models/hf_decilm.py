"""Llama-Nemotron (DeciLM: config.json architectures DeciLMForCausalLM, model_type nemotron-nas; remote code, no
transformers class) <-> megatron_lite: its config.json in our fields and back, and its weights. hf.py and
hf_weights.py dispatch here whole.

Each layer is a Llama layer whose parts its block_configs entry shapes (models/heterogeneous.py): normal attention
(input_layernorm, self_attn.q/k/v/o_proj with the block's own key/value heads), a linear in its place
(input_layernorm, self_attn.linear_attn) or nothing; the same for the MLP (post_attention_layernorm, mlp.gate/up/
down_proj of the block's own size, or mlp.linear_mlp, or nothing). The names are those of DeciLM's modelling code
and of Megatron's own converter (tools/checkpoint/loader_llama_mistral.py, Llama-Nemotron). Refused: what changes
the math and has no form here (biases, another activation, the attention features models/heterogeneous.py refuses).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from megatron_lite.config import ConfigError, ModelConfig, RopeScaling
from megatron_lite.models.heterogeneous import LINEAR, NORMAL, ffn_mult_to_intermediate_size, parse_block_configs

DECILM = "DeciLMForCausalLM"
MODEL_TYPE = "nemotron-nas"


def config_kwargs(c: Any, rope: tuple[float, RopeScaling | None]) -> dict:
    """The ModelConfig of a DeciLM config.json: Llama's fields, and its block_configs kept as the heterogeneous
    layers' text. The model-wide query groups and FFN size (which no layer with its own uses) are the first normal
    block's, as Megatron's converter takes them."""
    for bad, what in (
        (getattr(c, "hidden_act", "silu") != "silu", f"hidden_act={getattr(c, 'hidden_act', None)}"),
        (getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False), "attention_bias / mlp_bias"),
        (not getattr(c, "block_configs", None), "no block_configs"),
    ):
        if bad:
            raise ConfigError(f"config.json {what} is not supported for {DECILM}")
    text = json.dumps({"model_type": MODEL_TYPE, "block_configs": list(c.block_configs)})
    heads, hidden = c.num_attention_heads, c.hidden_size
    blocks = parse_block_configs(text, heads, hidden)
    groups = next((b.num_query_groups for b in blocks if b.attention == NORMAL and b.num_query_groups), None)
    ffn = next((b.ffn_hidden_size for b in blocks if b.mlp == NORMAL and b.ffn_hidden_size), None)
    base, scaling = rope
    return dict(
        num_layers=c.num_hidden_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=getattr(c, "head_dim", None) or hidden // heads,
        ffn_hidden_size=ffn,
        vocab_size=c.vocab_size,
        max_position_embeddings=c.max_position_embeddings,
        normalization="RMSNorm",
        norm_epsilon=float(getattr(c, "rms_norm_eps", 1e-6)),
        activation="swiglu",
        position_embedding_type="rope",
        rotary_base=base,
        rope_scaling=scaling,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=not getattr(c, "tie_word_embeddings", False),
        hidden_dropout=0.0,
        attention_dropout=float(getattr(c, "attention_dropout", 0.0)),
        heterogeneous_layers_config_encoded_json=text,
    )


def export_problems(c: ModelConfig) -> list[str]:
    """What DeciLM's Llama layers cannot compute (an exploratory run: a LayerNorm, squared-ReLU or position-free model
    was written as a DeciLM one, which computes something else)."""
    if c.heterogeneous_blocks is None:
        return ["no block configs (--heterogeneous-layers-config-path)"]
    problems = []
    for bad, what in (
        (c.normalization != "RMSNorm", f"{c.normalization} (DeciLM's norms are RMSNorm)"),
        (c.activation != "swiglu", f"activation {c.activation} (DeciLM's MLPs are SwiGLU)"),
        (c.position_embedding_type != "rope", f"--position-embedding-type {c.position_embedding_type} (rope)"),
        (c.rotary_percent != 1.0, f"--rotary-percent {c.rotary_percent} (DeciLM rotates every dim)"),
        (c.qk_layernorm, "q/k norms"),
        (c.add_qkv_bias or c.add_bias_linear, "biases"),
        (c.sliding_window, "a sliding window"),
        (c.head_dim * c.num_attention_heads != c.hidden_size, f"--kv-channels {c.head_dim} x heads != hidden"),
    ):
        if bad:
            problems.append(what)
    for i, b in enumerate(c.heterogeneous_blocks):  # (DeciLM sizes an FFN by ffn_mult alone: a multiple of 256)
        ffn = c.layer_config(i).ffn_size
        if b.mlp == NORMAL and ffn_mult_to_intermediate_size(_ffn_mult(ffn, c.hidden_size), c.hidden_size) != ffn:
            # (a size from a block's own ffn_mult always passes: that mult gives it, so does this one)
            problems.append(f"block {i}'s FFN size {ffn} (DeciLM's ffn_mult gives multiples of 256 only)")
    return problems


def _ffn_mult(ffn: int, hidden: int) -> float:
    """An ffn_mult DeciLM turns into `ffn` (int(2 ffn_mult hidden / 3) rounded up to 256) where one does."""
    return round(1.5 * ffn / hidden, 12)


def _decilm_blocks(c: ModelConfig) -> list[dict]:
    """The block configs in DeciLM's keys, each size written out: a block's null size (the model's
    --num-query-groups or --ffn-hidden-size) and Megatron's num_query_groups / ffn_hidden_size keys, which DeciLM
    does not read, became sizes it does (null went through, and the export loaded nowhere)."""
    blocks = json.loads(c.heterogeneous_layers_config_encoded_json)["block_configs"]
    out = []
    for i, (block, b) in enumerate(zip(blocks, c.heterogeneous_blocks)):
        own = c.layer_config(i)
        attention = {k: v for k, v in block["attention"].items() if k != "num_query_groups"}
        per_group = c.num_attention_heads // own.query_groups if b.attention == NORMAL else None
        ffn = {k: v for k, v in (block.get("ffn") or block.get("mlp")).items() if k != "ffn_hidden_size"}
        mult = ffn.get("ffn_mult") if b.mlp == NORMAL else None  # (a given one as it is: 1.0 is 256 at hidden 64)
        mult = _ffn_mult(own.ffn_size, c.hidden_size) if b.mlp == NORMAL and mult is None else mult
        rest = {k: v for k, v in block.items() if k not in ("attention", "ffn", "mlp")}
        out.append({**rest, "attention": {**attention, "n_heads_in_group": per_group},
                    "ffn": {**ffn, "ffn_mult": mult}})  # fmt: skip
    return out


def config_fields(c: ModelConfig, out: dict) -> dict:
    """config.json for DECILM from the Llama fields hf.hf_config_dict wrote (`out`): the block configs in place of
    the model-wide key/value heads and intermediate size, which DeciLM does not read."""
    out = {k: v for k, v in out.items() if k not in ("num_key_value_heads", "intermediate_size", "head_dim")}
    return out | dict(model_type=MODEL_TYPE, block_configs=_decilm_blocks(c), attention_bias=False, mlp_bias=False)


def state_dict_from_hf(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    from megatron_lite.models.hf_weights import _group_qkv

    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    for i, b in enumerate(config.heterogeneous_blocks):
        p, o, own = f"model.layers.{i}.", f"decoder.layers.{i}.", config.layer_config(i)
        if b.attention != "no_op":
            out[o + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        if b.attention == LINEAR:
            out[o + "self_attention.weight"] = hf[p + "self_attn.linear_attn.weight"]
        elif b.attention == NORMAL:
            q, k, v = (hf[f"{p}self_attn.{x}_proj.weight"] for x in "qkv")
            out[o + "self_attention.linear_qkv.weight"] = _group_qkv(q, k, v, own.query_groups)
            out[o + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        if b.mlp != "no_op":
            out[o + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        if b.mlp == LINEAR:
            out[o + "mlp.weight"] = hf[p + "mlp.linear_mlp.weight"]
        elif b.mlp == NORMAL:
            out[o + "mlp.linear_fc1.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
            out[o + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not config.tied_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def state_dict_to_hf(ours: dict[str, torch.Tensor], config: ModelConfig, on_disk: bool) -> dict[str, torch.Tensor]:
    """The inverse of state_dict_from_hf (`on_disk`: no lm_head.weight when the embeddings are tied)."""
    from megatron_lite.models.hf_weights import _ungroup_qkv

    hf = {"model.embed_tokens.weight": ours["embedding.word_embeddings.weight"]}
    for i, b in enumerate(config.heterogeneous_blocks):
        p, o, own = f"model.layers.{i}.", f"decoder.layers.{i}.", config.layer_config(i)
        if b.attention != "no_op":
            hf[p + "input_layernorm.weight"] = ours[o + "input_layernorm.weight"]
        if b.attention == LINEAR:
            hf[p + "self_attn.linear_attn.weight"] = ours[o + "self_attention.weight"]
        elif b.attention == NORMAL:
            q, k, v = _ungroup_qkv(ours[o + "self_attention.linear_qkv.weight"], own)
            hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"] = q, k
            hf[p + "self_attn.v_proj.weight"] = v
            hf[p + "self_attn.o_proj.weight"] = ours[o + "self_attention.linear_proj.weight"]
        if b.mlp != "no_op":
            hf[p + "post_attention_layernorm.weight"] = ours[o + "pre_mlp_layernorm.weight"]
        if b.mlp == LINEAR:
            hf[p + "mlp.linear_mlp.weight"] = ours[o + "mlp.weight"]
        elif b.mlp == NORMAL:
            gate, up = ours[o + "mlp.linear_fc1.weight"].chunk(2, dim=0)
            hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"] = gate, up
            hf[p + "mlp.down_proj.weight"] = ours[o + "mlp.linear_fc2.weight"]
    hf["model.norm.weight"] = ours["decoder.final_layernorm.weight"]
    if not (on_disk and config.tied_embeddings):
        hf["lm_head.weight"] = ours.get("output_layer.weight", ours["embedding.word_embeddings.weight"])
    return {k: v.contiguous() for k, v in hf.items()}


def remote_code_files(directory: str | None) -> tuple[str, ...]:
    """DeciLM's modelling code in a model directory: the Python files beside its config.json (configuration_decilm.py,
    modeling_decilm.py and the modules they import), kept with a converted checkpoint's config.json and exported
    with it so that the export opens with trust_remote_code as the download did. Copied as files, never run."""
    if directory is None or not os.path.isdir(directory):
        return ()
    return tuple(sorted(f for f in os.listdir(directory) if f.endswith(".py")))


def exported_auto_map(base: dict | None, code_files: tuple[str, ...]) -> dict | None:
    """The original config.json's auto_map where every module it names goes along ("configuration_decilm.
    DeciLMConfig" is configuration_decilm.py; a Hub reference "repo--module.Class" the module likewise), else None:
    an auto_map naming code that is not there makes transformers fail to open the directory."""
    auto_map = (base or {}).get("auto_map")
    if not isinstance(auto_map, dict) or not auto_map:
        return None
    refs = [r for v in auto_map.values() for r in (v if isinstance(v, list) else [v]) if isinstance(r, str)]
    modules = {r.split("--")[-1].rsplit(".", 1)[0] + ".py" for r in refs}
    return auto_map if modules <= set(code_files) else None
