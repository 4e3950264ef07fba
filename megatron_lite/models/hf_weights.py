"""Hugging Face <-> megatron_lite weights: full (layout-free) state dicts of the classes models/hf.py supports,
both ways. The map is linear, so it also carries gradients.

Pitfalls handled here: QKV is fused grouped per query group (not [q; k; v]); SwiGLU fc1 is [gate; up];
GPT-2's Conv1D weights are transposed relative to nn.Linear and its c_attn is [q; k; v] over all heads;
Phi-3 fuses qkv_proj ([q; k; v]) and gate_up_proj; Nemotron's LayerNorm1P holds gamma - 1, the others gamma;
Mixtral's, Qwen3-MoE's, Qwen2-MoE's, DeepSeek's and GLM-4-MoE's experts are 3-D module tensors in memory and one
file per expert on disk; GLM-4-MoE's MoE layers are named as DeepSeek-V3's (mlp.gate.e_score_correction_bias,
mlp.shared_experts), its attention as Qwen3's (q/k/v_proj with an optional bias, q_norm / k_norm); Llama 4's
feed_forward (fused experts stored [E, in, out], transposed against ours) in models/hf_llama4.py.
"""

from __future__ import annotations

import torch

from megatron_lite.config import ConfigError, ModelConfig
from megatron_lite.models import hf_decilm, hf_gpt_oss, hf_llama4, hf_nemotron_h, hf_qwen2moe
from megatron_lite.models.hf import LLAMA_LIKE
from megatron_lite.models.hf_deepseek import DEEPSEEK, DEEPSEEK_V2
from megatron_lite.models.hf_glm4moe import GLM4_MOE


def _group_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[q; k; v] (heads in order) -> grouped per query group: [q_g..., k_g, v_g] for each group g."""
    rest = q.shape[1:]
    return torch.cat(
        [q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)], dim=1
    ).reshape(-1, *rest)


def _ungroup_qkv(qkv: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = config.query_groups, config.head_dim
    per = config.num_attention_heads // g
    rest = qkv.shape[1:]
    x = qkv.reshape(g, (per + 2) * d, *rest)
    q, k, v = x.split([per * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _experts_from_hf(hf: dict, p: str, ours: str, num_experts: int) -> dict:
    """Mixtral and Qwen3-MoE experts, from transformers' fused module tensors (mlp.gate, mlp.experts.gate_up_proj
    [E, 2I, H] = [gate; up], mlp.experts.down_proj [E, H, I]) or from the on-disk names save_pretrained writes:
    Mixtral's block_sparse_moe.gate, block_sparse_moe.experts.{e}.w1 = gate, w3 = up, w2 = down; Qwen3-MoE's
    mlp.gate, mlp.experts.{e}.gate_proj / up_proj / down_proj."""
    out = {}
    if p + "mlp.experts.gate_up_proj" in hf:
        out[f"{ours}.router.weight"] = hf[p + "mlp.gate.weight"]
        for e in range(num_experts):
            out[f"{ours}.experts.{e}.linear_fc1.weight"] = hf[p + "mlp.experts.gate_up_proj"][e]
            out[f"{ours}.experts.{e}.linear_fc2.weight"] = hf[p + "mlp.experts.down_proj"][e]
        return out
    if p + "mlp.gate.weight" in hf:  # Qwen3-MoE on disk
        out[f"{ours}.router.weight"] = hf[p + "mlp.gate.weight"]
        for e in range(num_experts):
            w = f"{p}mlp.experts.{e}."
            out[f"{ours}.experts.{e}.linear_fc1.weight"] = torch.cat(
                [hf[w + "gate_proj.weight"], hf[w + "up_proj.weight"]], dim=0
            )
            out[f"{ours}.experts.{e}.linear_fc2.weight"] = hf[w + "down_proj.weight"]
        return out
    q = p + "block_sparse_moe."
    out[f"{ours}.router.weight"] = hf[q + "gate.weight"]
    for e in range(num_experts):
        w = f"{q}experts.{e}."
        out[f"{ours}.experts.{e}.linear_fc1.weight"] = torch.cat([hf[w + "w1.weight"], hf[w + "w3.weight"]], dim=0)
        out[f"{ours}.experts.{e}.linear_fc2.weight"] = hf[w + "w2.weight"]
    return out


def _rope_rows(n: int, pe: int, offset: int, block: int, inverse: bool) -> torch.Tensor:
    """Row order that turns DeepSeek's interleaved RoPE pairs (x0, x1), (x2, x3), ... into our rotate-half
    layout [x0, x2, ..., x1, x3, ...] (or back, `inverse`), for the pe rows at `offset` of each of the n blocks of
    `block` rows. The same order on queries and keys leaves every q.k, hence the model, unchanged."""
    half = torch.cat([torch.arange(0, pe, 2), torch.arange(1, pe, 2)])
    if inverse:
        half = torch.argsort(half)
    rows = torch.arange(n * block).view(n, block).clone()
    rows[:, offset : offset + pe] = rows[:, offset : offset + pe][:, half]
    return rows.reshape(-1)


def mla_rope_rows(c: ModelConfig, inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(query-projection rows, key/value down-projection rows) from DeepSeek's interleaved RoPE order to ours (or
    back, `inverse`): the rows of every weight, or LoRA B, whose output holds RoPE dims."""
    h, qd, pe = c.num_attention_heads, c.mla_q_head_dim, c.qk_pos_emb_head_dim
    q = _rope_rows(h, pe, c.qk_head_dim, qd, inverse)
    return q, _rope_rows(1, pe, c.kv_lora_rank, c.kv_lora_rank + pe, inverse)


def _mla_from_hf(hf: dict, att: str, ours: str, c: ModelConfig, interleaved: bool) -> dict:
    """DeepSeek-V3 attention: q_proj or q_a_proj / q_a_layernorm / q_b_proj, kv_a_proj_with_mqa / kv_a_layernorm /
    kv_b_proj, o_proj (same row layouts as ours, RoPE rows reordered when the checkpoint interleaves them)."""
    q_rows, kv_rows = mla_rope_rows(c, inverse=False) if interleaved else (slice(None), slice(None))
    out = {}
    if c.q_lora_rank is None:
        out[f"{ours}.linear_q_proj.weight"] = hf[att + "q_proj.weight"][q_rows]
    else:
        out[f"{ours}.linear_q_down_proj.weight"] = hf[att + "q_a_proj.weight"]
        out[f"{ours}.q_layernorm.weight"] = hf[att + "q_a_layernorm.weight"]
        out[f"{ours}.linear_q_up_proj.weight"] = hf[att + "q_b_proj.weight"][q_rows]
    out[f"{ours}.linear_kv_down_proj.weight"] = hf[att + "kv_a_proj_with_mqa.weight"][kv_rows]
    out[f"{ours}.kv_layernorm.weight"] = hf[att + "kv_a_layernorm.weight"]
    out[f"{ours}.linear_kv_up_proj.weight"] = hf[att + "kv_b_proj.weight"]
    return out


def _mla_to_hf(ours: dict, m: str, att: str, c: ModelConfig, interleaved: bool) -> dict:
    """The inverse of _mla_from_hf (RoPE rows interleaved again for rope_interleave=true, DeepSeek's layout)."""
    q_rows, kv_rows = mla_rope_rows(c, inverse=True) if interleaved else (slice(None), slice(None))
    hf = {}
    if c.q_lora_rank is None:
        hf[att + "q_proj.weight"] = ours[f"{m}.linear_q_proj.weight"][q_rows]
    else:
        hf[att + "q_a_proj.weight"] = ours[f"{m}.linear_q_down_proj.weight"]
        hf[att + "q_a_layernorm.weight"] = ours[f"{m}.q_layernorm.weight"]
        hf[att + "q_b_proj.weight"] = ours[f"{m}.linear_q_up_proj.weight"][q_rows]
    hf[att + "kv_a_proj_with_mqa.weight"] = ours[f"{m}.linear_kv_down_proj.weight"][kv_rows]
    hf[att + "kv_a_layernorm.weight"] = ours[f"{m}.kv_layernorm.weight"]
    hf[att + "kv_b_proj.weight"] = ours[f"{m}.linear_kv_up_proj.weight"]
    return hf


def _shared_and_bias_from_hf(hf: dict, p: str, ours: str, c: ModelConfig) -> dict:
    """DeepSeek-V3's MoE extras: the router's score-correction bias (our expert bias) and the shared experts."""
    out = {}
    if c.moe_router_enable_expert_bias and p + "mlp.gate.e_score_correction_bias" in hf:  # (absent from gradients)
        out[f"{ours}.router.expert_bias"] = hf[p + "mlp.gate.e_score_correction_bias"]
    if c.moe_shared_expert_intermediate_size:
        s = p + "mlp.shared_experts."
        out[f"{ours}.shared_expert.linear_fc1.weight"] = torch.cat(
            [hf[s + "gate_proj.weight"], hf[s + "up_proj.weight"]], dim=0
        )
        out[f"{ours}.shared_expert.linear_fc2.weight"] = hf[s + "down_proj.weight"]
    return out


def _our_layer(i: int, c: ModelConfig) -> str:
    """Our name of HF layer i: a decoder layer, or past the last one a multi-token-prediction depth's layer."""
    return f"decoder.layers.{i}" if i < c.num_layers else f"mtp.layers.{i - c.num_layers}.transformer_layer"


def _mtp_from_hf(hf: dict, p: str, ours: str) -> dict:
    """DeepSeek-V3's multi-token-prediction extras of one depth: enorm, hnorm, eh_proj ([embedding, hidden] in
    its columns, as ours) and shared_head.norm. Its embed_tokens and shared_head.head are copies of the model's
    embedding and output layer, which MTP shares here."""
    out = {f"{ours}.{n}.weight": hf[f"{p}{n}.weight"] for n in ("enorm", "hnorm", "eh_proj")}
    out[f"{ours}.final_layernorm.weight"] = hf[p + "shared_head.norm.weight"]
    return out


def _mtp_to_hf(ours: dict, m: str, p: str, on_disk: bool) -> dict:
    """The inverse of _mtp_from_hf; on disk also the depth's copies of the embedding and output layer, as
    DeepSeek-V3's checkpoints hold them."""
    hf = {f"{p}{n}.weight": ours[f"{m}.{n}.weight"] for n in ("enorm", "hnorm", "eh_proj")}
    hf[p + "shared_head.norm.weight"] = ours[f"{m}.final_layernorm.weight"]
    if on_disk:  # (clones: safetensors refuses to write one storage under two names)
        hf[p + "embed_tokens.weight"] = ours["embedding.word_embeddings.weight"].clone()
        head = ours.get("output_layer.weight", ours["embedding.word_embeddings.weight"])
        hf[p + "shared_head.head.weight"] = head.clone()
    return hf


def state_dict_from_hf(
    hf: dict[str, torch.Tensor], config: ModelConfig, arch: str, rope_interleave: bool = True
) -> dict[str, torch.Tensor]:
    """HF tensors (or their gradients: the map is linear) -> our full, unpadded state dict. `rope_interleave`:
    DeepSeek-V3's config flag (its RoPE dims stored as interleaved pairs; true in its checkpoints)."""
    out: dict[str, torch.Tensor] = {}
    L = "decoder.layers"
    if arch == hf_nemotron_h.NEMOTRON_H:
        return hf_nemotron_h.state_dict_from_hf(hf, config)
    if arch == hf_decilm.DECILM:
        return hf_decilm.state_dict_from_hf(hf, config)
    if arch in LLAMA_LIKE:
        out["embedding.word_embeddings.weight"] = hf["model.embed_tokens.weight"]
        for i in range(config.num_layers + config.mtp_num_layers):  # (DeepSeek-V3: MTP layers after the last)
            p = f"model.layers.{i}."
            o = _our_layer(i, config)
            att = p + "self_attn."
            for kind in ("weight", "bias"):  # (LayerNorm: a bias too)
                if p + f"input_layernorm.{kind}" in hf:
                    out[f"{o}.input_layernorm.{kind}"] = hf[p + f"input_layernorm.{kind}"]
                    out[f"{o}.pre_mlp_layernorm.{kind}"] = hf[p + f"post_attention_layernorm.{kind}"]
                if f"{att}qkv_proj.{kind}" in hf:  # Phi-3: [q; k; v] in one projection
                    q, k, v = hf[f"{att}qkv_proj.{kind}"].split(
                        [config.num_attention_heads * config.head_dim, *[config.query_groups * config.head_dim] * 2]
                    )
                    out[f"{o}.self_attention.linear_qkv.{kind}"] = _group_qkv(q, k, v, config.query_groups)
                if f"{att}q_proj.{kind}" in hf and not config.multi_latent_attention:
                    out[f"{o}.self_attention.linear_qkv.{kind}"] = _group_qkv(
                        hf[f"{att}q_proj.{kind}"],
                        hf[f"{att}k_proj.{kind}"],
                        hf[f"{att}v_proj.{kind}"],
                        config.query_groups,
                    )
            if config.multi_latent_attention:
                out.update(_mla_from_hf(hf, att, f"{o}.self_attention", config, rope_interleave))
            out[f"{o}.self_attention.linear_proj.weight"] = hf[att + "o_proj.weight"]
            if att + "o_proj.bias" in hf:
                out[f"{o}.self_attention.linear_proj.bias"] = hf[att + "o_proj.bias"]
            if config.qk_layernorm and not config.multi_latent_attention:
                out[f"{o}.self_attention.q_layernorm.weight"] = hf[att + "q_norm.weight"]
                out[f"{o}.self_attention.k_layernorm.weight"] = hf[att + "k_norm.weight"]
            if arch == hf_gpt_oss.GPT_OSS:  # (its sinks, router and experts)
                out.update(hf_gpt_oss.layer_from_hf(hf, p, o, config))
            elif arch == hf_llama4.LLAMA4:  # (feed_forward: fused experts [E, in, out], a shared expert)
                out.update(hf_llama4.layer_from_hf(hf, p, o, config, i))
            elif config.num_experts and config.is_moe_layer(i):
                out.update(_experts_from_hf(hf, p, f"{o}.mlp", config.num_experts))
                if arch == hf_qwen2moe.QWEN2_MOE:  # (a gated shared expert, mlp.shared_expert: singular)
                    out.update(hf_qwen2moe.shared_from_hf(hf, p, f"{o}.mlp"))
                else:
                    out.update(_shared_and_bias_from_hf(hf, p, f"{o}.mlp", config))
            elif p + "mlp.gate_up_proj.weight" in hf:  # Phi-3: [gate; up], our layout
                out[f"{o}.mlp.linear_fc1.weight"] = hf[p + "mlp.gate_up_proj.weight"]
                out[f"{o}.mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
            elif config.activation == "swiglu":
                out[f"{o}.mlp.linear_fc1.weight"] = torch.cat(
                    [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], dim=0
                )
                out[f"{o}.mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
            else:  # Nemotron: up_proj -> squared ReLU -> down_proj
                for kind in ("weight", "bias"):
                    if p + f"mlp.up_proj.{kind}" in hf:
                        out[f"{o}.mlp.linear_fc1.{kind}"] = hf[p + f"mlp.up_proj.{kind}"]
                        out[f"{o}.mlp.linear_fc2.{kind}"] = hf[p + f"mlp.down_proj.{kind}"]
        for k in range(config.mtp_num_layers):
            out.update(_mtp_from_hf(hf, f"model.layers.{config.num_layers + k}.", f"mtp.layers.{k}"))
        for kind in ("weight", "bias"):
            if f"model.norm.{kind}" in hf:
                out[f"decoder.final_layernorm.{kind}"] = hf[f"model.norm.{kind}"]
        if not config.tied_embeddings:
            out["output_layer.weight"] = hf["lm_head.weight"]
        return out
    if arch == "GPT2LMHeadModel":
        h = config.hidden_size
        out["embedding.word_embeddings.weight"] = hf["transformer.wte.weight"]
        out["embedding.position_embeddings.weight"] = hf["transformer.wpe.weight"]
        for i in range(config.num_layers):
            p = f"transformer.h.{i}."
            for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
                out[f"{L}.{i}.{ours}.weight"] = hf[f"{p}{theirs}.weight"]
                out[f"{L}.{i}.{ours}.bias"] = hf[f"{p}{theirs}.bias"]
            # Conv1D stores [in, out]; c_attn's output columns are [q; k; v] over all heads.
            q, k, v = hf[p + "attn.c_attn.weight"].t().split(h, dim=0)
            out[f"{L}.{i}.self_attention.linear_qkv.weight"] = _group_qkv(q, k, v, config.query_groups)
            qb, kb, vb = hf[p + "attn.c_attn.bias"].split(h, dim=0)
            out[f"{L}.{i}.self_attention.linear_qkv.bias"] = _group_qkv(qb, kb, vb, config.query_groups)
            out[f"{L}.{i}.self_attention.linear_proj.weight"] = hf[p + "attn.c_proj.weight"].t()
            out[f"{L}.{i}.self_attention.linear_proj.bias"] = hf[p + "attn.c_proj.bias"]
            out[f"{L}.{i}.mlp.linear_fc1.weight"] = hf[p + "mlp.c_fc.weight"].t()
            out[f"{L}.{i}.mlp.linear_fc1.bias"] = hf[p + "mlp.c_fc.bias"]
            out[f"{L}.{i}.mlp.linear_fc2.weight"] = hf[p + "mlp.c_proj.weight"].t()
            out[f"{L}.{i}.mlp.linear_fc2.bias"] = hf[p + "mlp.c_proj.bias"]
        out["decoder.final_layernorm.weight"] = hf["transformer.ln_f.weight"]
        out["decoder.final_layernorm.bias"] = hf["transformer.ln_f.bias"]
        if not config.tied_embeddings:
            out["output_layer.weight"] = hf["lm_head.weight"]
        return {k: v.contiguous() for k, v in out.items()}
    raise ConfigError(f"architecture {arch!r} is not supported")


def state_dict_to_hf(
    ours: dict[str, torch.Tensor], config: ModelConfig, arch: str, on_disk: bool = False, rope_interleave: bool = True
) -> dict[str, torch.Tensor]:
    """The inverse of `state_dict_from_hf`. By default the names of transformers' modules (tied models get
    `lm_head.weight` = the embedding); with `on_disk` the names of a Hub checkpoint file: Mixtral experts
    as block_sparse_moe.experts.{e}.w1/w3/w2, and no `lm_head.weight` when the embeddings are tied."""
    hf: dict[str, torch.Tensor] = {}
    L = "decoder.layers"
    # Hugging Face norms hold gamma itself, except Nemotron's LayerNorm1P, which holds gamma - 1 as we do with
    # --apply-layernorm-1p (DeciLM's too: its export wrote gamma - 1, an exploratory run found)
    shift = int(config.apply_layernorm_1p) - int(arch == "NemotronForCausalLM")
    if shift:  # (every norm: the layers', the latents', the final one, and MTP's enorm and hnorm)
        norm = ("layernorm.weight", ".enorm.weight", ".hnorm.weight")
        ours = {k: v + shift if k.endswith(norm) else v for k, v in ours.items()}
    if arch == hf_nemotron_h.NEMOTRON_H:
        return hf_nemotron_h.state_dict_to_hf(ours, config, on_disk)
    if arch == hf_decilm.DECILM:
        return hf_decilm.state_dict_to_hf(ours, config, on_disk)
    if arch in LLAMA_LIKE:
        hf["model.embed_tokens.weight"] = ours["embedding.word_embeddings.weight"]
        for i in range(config.num_layers + config.mtp_num_layers):
            p = f"model.layers.{i}."
            o = _our_layer(i, config)
            for kind in ("weight", "bias"):
                if f"{o}.input_layernorm.{kind}" in ours:
                    hf[p + f"input_layernorm.{kind}"] = ours[f"{o}.input_layernorm.{kind}"]
                    hf[p + f"post_attention_layernorm.{kind}"] = ours[f"{o}.pre_mlp_layernorm.{kind}"]
                if f"{o}.self_attention.linear_proj.{kind}" in ours:
                    hf[p + f"self_attn.o_proj.{kind}"] = ours[f"{o}.self_attention.linear_proj.{kind}"]
                key = f"{o}.self_attention.linear_qkv.{kind}"
                if key in ours and arch == "Phi3ForCausalLM":
                    hf[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(_ungroup_qkv(ours[key], config), dim=0)
                elif key in ours:
                    q, k, v = _ungroup_qkv(ours[key], config)
                    hf[f"{p}self_attn.q_proj.{kind}"], hf[f"{p}self_attn.k_proj.{kind}"] = q, k
                    hf[f"{p}self_attn.v_proj.{kind}"] = v
            if config.multi_latent_attention:
                hf.update(_mla_to_hf(ours, f"{o}.self_attention", p + "self_attn.", config, rope_interleave))
            elif config.qk_layernorm:
                hf[p + "self_attn.q_norm.weight"] = ours[f"{o}.self_attention.q_layernorm.weight"]
                hf[p + "self_attn.k_norm.weight"] = ours[f"{o}.self_attention.k_layernorm.weight"]
            moe = config.num_experts and config.is_moe_layer(i)
            gpt_oss = arch == hf_gpt_oss.GPT_OSS  # (its sinks, router and experts)
            if gpt_oss:
                hf.update(hf_gpt_oss.layer_to_hf(ours, o, p, config))
            if moe and arch in (*DEEPSEEK, GLM4_MOE):  # shared experts (V3's and GLM-4-MoE's: the bias too)
                m = f"{o}.mlp"
                if arch != DEEPSEEK_V2:
                    bias = ours.get(f"{m}.router.expert_bias", torch.zeros(config.num_experts))  # (none: zeros)
                    hf[p + "mlp.gate.e_score_correction_bias"] = bias
                if config.moe_shared_expert_intermediate_size:
                    gate, up = ours[f"{m}.shared_expert.linear_fc1.weight"].chunk(2, dim=0)
                    hf[p + "mlp.shared_experts.gate_proj.weight"] = gate
                    hf[p + "mlp.shared_experts.up_proj.weight"] = up
                    hf[p + "mlp.shared_experts.down_proj.weight"] = ours[f"{m}.shared_expert.linear_fc2.weight"]
            if moe and arch == hf_qwen2moe.QWEN2_MOE:
                hf.update(hf_qwen2moe.shared_to_hf(ours, f"{o}.mlp", p))
            if arch == hf_llama4.LLAMA4:  # (its feed_forward: on disk as in memory)
                hf.update(hf_llama4.layer_to_hf(ours, o, p, config, i))
            elif gpt_oss:
                pass
            elif moe and on_disk:
                m = f"{o}.mlp"
                # Mixtral: block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2; Qwen3-MoE: mlp.experts.{e}.*_proj
                q, names = (
                    (p + "block_sparse_moe.", ("w1", "w3", "w2"))
                    if arch == "MixtralForCausalLM"
                    else (p + "mlp.", ("gate_proj", "up_proj", "down_proj"))
                )
                hf[q + "gate.weight"] = ours[f"{m}.router.weight"]
                for e in range(config.num_experts):
                    gate, up = ours[f"{m}.experts.{e}.linear_fc1.weight"].chunk(2, dim=0)
                    hf[f"{q}experts.{e}.{names[0]}.weight"], hf[f"{q}experts.{e}.{names[1]}.weight"] = gate, up
                    hf[f"{q}experts.{e}.{names[2]}.weight"] = ours[f"{m}.experts.{e}.linear_fc2.weight"]
            elif moe:
                m, n = f"{o}.mlp", config.num_experts
                hf[p + "mlp.gate.weight"] = ours[f"{m}.router.weight"]
                hf[p + "mlp.experts.gate_up_proj"] = torch.stack(
                    [ours[f"{m}.experts.{e}.linear_fc1.weight"] for e in range(n)]
                )
                hf[p + "mlp.experts.down_proj"] = torch.stack(
                    [ours[f"{m}.experts.{e}.linear_fc2.weight"] for e in range(n)]
                )
            elif arch == "Phi3ForCausalLM":
                hf[p + "mlp.gate_up_proj.weight"] = ours[f"{o}.mlp.linear_fc1.weight"]
                hf[p + "mlp.down_proj.weight"] = ours[f"{o}.mlp.linear_fc2.weight"]
            elif config.activation == "swiglu":
                gate, up = ours[f"{o}.mlp.linear_fc1.weight"].chunk(2, dim=0)
                hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"] = gate, up
                hf[p + "mlp.down_proj.weight"] = ours[f"{o}.mlp.linear_fc2.weight"]
            else:
                for kind in ("weight", "bias"):
                    if f"{o}.mlp.linear_fc1.{kind}" in ours:
                        hf[p + f"mlp.up_proj.{kind}"] = ours[f"{o}.mlp.linear_fc1.{kind}"]
                        hf[p + f"mlp.down_proj.{kind}"] = ours[f"{o}.mlp.linear_fc2.{kind}"]
        for k in range(config.mtp_num_layers):
            hf.update(_mtp_to_hf(ours, f"mtp.layers.{k}", f"model.layers.{config.num_layers + k}.", on_disk))
        for kind in ("weight", "bias"):
            if f"decoder.final_layernorm.{kind}" in ours:
                hf[f"model.norm.{kind}"] = ours[f"decoder.final_layernorm.{kind}"]
        if not (on_disk and config.tied_embeddings):
            hf["lm_head.weight"] = ours.get("output_layer.weight", ours["embedding.word_embeddings.weight"])
        return {k: v.contiguous() for k, v in hf.items()}
    if arch == "GPT2LMHeadModel":
        hf["transformer.wte.weight"] = ours["embedding.word_embeddings.weight"]
        hf["transformer.wpe.weight"] = ours["embedding.position_embeddings.weight"]
        for i in range(config.num_layers):
            p = f"transformer.h.{i}."
            for ours_name, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
                hf[f"{p}{theirs}.weight"] = ours[f"{L}.{i}.{ours_name}.weight"]
                hf[f"{p}{theirs}.bias"] = ours[f"{L}.{i}.{ours_name}.bias"]
            q, k, v = _ungroup_qkv(ours[f"{L}.{i}.self_attention.linear_qkv.weight"], config)
            hf[p + "attn.c_attn.weight"] = torch.cat([q, k, v], dim=0).t()
            qb, kb, vb = _ungroup_qkv(ours[f"{L}.{i}.self_attention.linear_qkv.bias"], config)
            hf[p + "attn.c_attn.bias"] = torch.cat([qb, kb, vb], dim=0)
            hf[p + "attn.c_proj.weight"] = ours[f"{L}.{i}.self_attention.linear_proj.weight"].t()
            hf[p + "attn.c_proj.bias"] = ours[f"{L}.{i}.self_attention.linear_proj.bias"]
            hf[p + "mlp.c_fc.weight"] = ours[f"{L}.{i}.mlp.linear_fc1.weight"].t()
            hf[p + "mlp.c_fc.bias"] = ours[f"{L}.{i}.mlp.linear_fc1.bias"]
            hf[p + "mlp.c_proj.weight"] = ours[f"{L}.{i}.mlp.linear_fc2.weight"].t()
            hf[p + "mlp.c_proj.bias"] = ours[f"{L}.{i}.mlp.linear_fc2.bias"]
        hf["transformer.ln_f.weight"] = ours["decoder.final_layernorm.weight"]
        hf["transformer.ln_f.bias"] = ours["decoder.final_layernorm.bias"]
        if not (on_disk and config.tied_embeddings):
            hf["lm_head.weight"] = ours.get("output_layer.weight", ours["embedding.word_embeddings.weight"])
        return {k: v.contiguous() for k, v in hf.items()}
    raise ConfigError(f"architecture {arch!r} is not supported")
