"""The flag values a checkpoint carries: `pretrain_gpt.py --load DIR` alone rebuilds the run that wrote it.

arguments.parse_args takes these as defaults for flags not given, and refuses an explicit flag that would
change the weights' architecture (ARCH_DESTS) unless --use-checkpoint-args.
"""

from __future__ import annotations

# Flags whose value defines the weights: given explicitly with a different value than the checkpoint's, they
# are an error unless --use-checkpoint-args (then the checkpoint's value wins).
ARCH_DESTS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "group_query_attention",
    "num_query_groups",
    "kv_channels",
    "max_position_embeddings",
    "normalization",
    "norm_epsilon",
    "apply_layernorm_1p",
    "swiglu",
    "openai_gelu",
    "squared_relu",
    "rotary_percent",
    "position_embedding_type",
    "rotary_base",
    "use_rope_scaling",
    "rope_scaling_factor",
    "window_size",
    "untie_embeddings_and_output_weights",
    "disable_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rotary_scaling_factor",
    "mscale_all_dim",
    "make_vocab_size_divisible_by",
    "mtp_num_layers",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_router_enable_expert_bias",
    "moe_router_group_score_topn",
)


def defaults_from_checkpoint(saved: dict) -> dict:
    """Flag values (argparse dests) of the job that wrote a checkpoint: the model, data, batch, schedule and
    optimizer settings. The layout, logging and checkpoint flags are not taken over."""
    m, t, o, d = saved["model"], saved["training"], saved["optimizer"], saved["data"]
    out = {
        k: m[k]
        for k in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "kv_channels",
            "max_position_embeddings",
            "normalization",
            "norm_epsilon",
            "position_embedding_type",
            "rotary_base",
            "add_qkv_bias",
            "untie_embeddings_and_output_weights",
            "make_vocab_size_divisible_by",
            "init_method_std",
            "hidden_dropout",
            "attention_dropout",
        )
    }
    out["apply_layernorm_1p"] = m.get("apply_layernorm_1p", False)
    out["qk_layernorm"] = m.get("qk_layernorm", False)  # (absent from older checkpoints)
    for k, default in (
        ("multi_latent_attention", False),
        ("q_lora_rank", None),
        ("kv_lora_rank", 32),
        ("qk_head_dim", 128),
        ("qk_pos_emb_head_dim", 64),
        ("v_head_dim", 128),
    ):
        out[k] = m.get(k, default)
    out["mscale_all_dim"] = m.get("mla_mscale_all_dim", 0.0)
    out["mtp_num_layers"] = m.get("mtp_num_layers", 0)  # (absent from older checkpoints)
    out["mtp_loss_scaling_factor"] = m.get("mtp_loss_scaling_factor", 0.1)
    rs = m["rope_scaling"]
    mla_yarn = m.get("multi_latent_attention") and rs is not None and rs.get("rope_type") == "yarn"
    out["rotary_scaling_factor"] = rs["factor"] if mla_yarn else 1.0
    out["group_query_attention"] = m["num_query_groups"] is not None
    out["num_query_groups"] = m["num_query_groups"] if m["num_query_groups"] is not None else 1
    out["swiglu"] = m["activation"] == "swiglu"
    out["openai_gelu"] = m["activation"] == "gelu_tanh"
    out["squared_relu"] = m["activation"] == "squared_relu"
    out["rotary_percent"] = m.get("rotary_percent", 1.0)
    out["use_rope_scaling"] = m["rope_scaling"] is not None
    if m["rope_scaling"] is not None:
        out["rope_scaling_factor"] = m["rope_scaling"]["factor"]
        out["rope_scaling_params"] = m["rope_scaling"]
    out["window_size"] = m.get("sliding_window")
    out["disable_bias_linear"] = not m["add_bias_linear"]
    out.update({k: v for k, v in m.items() if k.startswith("moe_") or k == "num_experts"})
    out.update(
        {
            k: t[k]
            for k in (
                "micro_batch_size",
                "global_batch_size",
                "seq_length",
                "train_iters",
                "seed",
                "log_interval",
                "eval_interval",
                "eval_iters",
            )
        }
    )
    if t.get("rampup_batch_size"):
        out["rampup_batch_size"] = list(t["rampup_batch_size"])
    if t.get("train_samples") is not None:  # a sample-based run: its iterations follow from the samples again
        out.update(train_samples=t["train_samples"], train_iters=None)
    out.update({k: v for k, v in o.items()})
    paths = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
    out.update({k: v for k, v in d.items() if k not in paths})
    out.update({k: list(d.get(k) or ()) or None for k in paths})
    return out
