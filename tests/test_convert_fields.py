"""Config fields of transformers' classes beyond tests/test_convert.py's one config per family: tied and untied
embeddings, one KV head, head_dim != hidden / heads, a vocabulary that TP padding does not divide, RoPE scalings
and partial rotation, biases, dense layers between MoE layers. Each variant converts HF -> ours -> HF: our logits
are transformers' (fp32, 1e-5), and the export loads in transformers with the same logits and config fields. A
field we cannot honour is one line naming it, its value and what is supported, and changes transformers' logits
(so refusing it is needed)."""

from __future__ import annotations

import contextlib
import copy
import io
import pathlib

import pytest
import torch
import transformers
from test_convert import _rel, convert, ours_at

from megatron_lite.config import ParallelConfig

V = 251  # (odd: our vocabulary is padded to a multiple of 128 x TP)
IDS = [(7 * i + 3) % V for i in range(20)]
SMALL = dict(vocab_size=V, max_position_embeddings=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 8}
MLA = dict(SMALL, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
           qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, moe_intermediate_size=24, n_routed_experts=8,
           num_experts_per_tok=2)  # fmt: skip


def _variants() -> dict:
    T = transformers
    return {
        # Llama-3.2-1B's shape: tied embeddings with Llama-3 RoPE scaling; one KV head
        "llama_tied_llama3_mqa": T.LlamaConfig(
            num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, rope_parameters=LLAMA3, **SMALL
        ),
        "llama_yarn_head_dim": T.LlamaConfig(
            num_attention_heads=4, num_key_value_heads=2, head_dim=24, rope_parameters=YARN, **SMALL
        ),
        "mistral_tied_head_dim": T.MistralConfig(
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=24,
            sliding_window=5,
            tie_word_embeddings=True,
            **SMALL,
        ),
        "qwen2_untied_head_dim": T.Qwen2Config(
            num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False, **SMALL
        ),
        # Qwen3-0.6B ties its embeddings
        "qwen3_tied_mqa": T.Qwen3Config(
            num_attention_heads=4, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, **SMALL
        ),
        # MoE on every third layer but layer 2 (decoder_sparse_step with mlp_only_layers), top-1 not renormalised
        "qwen3_moe_sparse_step": T.Qwen3MoeConfig(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=1,
            moe_intermediate_size=40,
            decoder_sparse_step=3,
            mlp_only_layers=[2],
            norm_topk_prob=False,
            **dict(SMALL, num_hidden_layers=6),
        ),
        # "swish" is transformers' other name of silu (it was refused)
        "mixtral_tied_top1_swish": T.MixtralConfig(
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=24,
            num_local_experts=4,
            num_experts_per_tok=1,
            sliding_window=6,
            tie_word_embeddings=True,
            hidden_act="swish",
            **SMALL,
        ),
        "phi3_tied_mqa": T.Phi3Config(
            num_attention_heads=4,
            num_key_value_heads=1,
            partial_rotary_factor=0.75,
            tie_word_embeddings=True,
            pad_token_id=0,
            **SMALL,
        ),
        "nemotron_yarn_biases": T.NemotronConfig(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
            rope_parameters={**YARN, "partial_rotary_factor": 0.25},
            **SMALL,
        ),
        # DeepSeek-V2-Lite's YaRN (mscale = mscale_all_dim = 0.707), tied
        "deepseek_v2_lite_yarn": T.DeepseekV2Config(
            q_lora_rank=None,
            n_shared_experts=2,
            first_k_dense_replace=1,
            tie_word_embeddings=True,
            routed_scaling_factor=1.5,
            rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
            **MLA,
        ),
        # rotate-half RoPE rows with MoE, four groups, no scaling of the routed weights
        "deepseek_v3_groups": T.DeepseekV3Config(
            q_lora_rank=None,
            n_shared_experts=1,
            first_k_dense_replace=0,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.0,
            rope_interleave=False,
            **MLA,
        ),
        "gpt2_untied_exact_gelu": T.GPT2Config(
            vocab_size=V,
            n_positions=32,
            n_embd=64,
            n_layer=2,
            n_head=4,
            activation_function="gelu",
            tie_word_embeddings=False,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
    }


# config.json fields an export writes in another equivalent form: (what is rewritten, why)
REWRITTEN = {
    "architectures", "transformers_version", "_name_or_path", "dtype", "torch_dtype",
    "decoder_sparse_step", "mlp_only_layers",  # Qwen3-MoE: every dense layer listed, step 1
    "num_nextn_predict_layers", "scoring_func", "topk_method",  # DeepSeek-V3: absent fields written
}  # fmt: skip


def _model(cfg):
    """A transformers model of `cfg` whose norms and biases are not their initial ones and zeros."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _convert(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = convert.main(list(argv))
    return rc, err.getvalue()


def _import(model, root: pathlib.Path) -> tuple[int, str]:
    model.save_pretrained(root / "hf")
    return _convert("--loader", "hf", "--saver", "megatron_lite", "--load-dir", str(root / "hf"), "--save-dir",
                    str(root / "ours"))  # fmt: skip


def _ours(ckpt: str):
    logits, _ = ours_at(ckpt, ParallelConfig(), IDS)
    return (logits[0] if logits.dim() == 3 else logits)[:, :V]


@pytest.mark.parametrize("name", list(_variants()))
def test_variant_converts_both_ways_with_transformers_logits(tmp_path, name):
    model = _model(_variants()[name])
    ref = _logits(model)
    rc, err = _import(model, tmp_path)
    assert rc == 0, err
    assert _rel(_ours(str(tmp_path / "ours")), ref) < 1e-5
    rc, err = _convert("--loader", "megatron_lite", "--saver", "hf", "--load-dir", str(tmp_path / "ours"),
                       "--save-dir", str(tmp_path / "back"))  # fmt: skip
    assert rc == 0, err
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(model)
    assert _rel(_logits(back), ref) < 1e-5
    a, b = model.config.to_dict(), back.config.to_dict()
    for key, value in a.items():
        if key in REWRITTEN or value is None:
            continue
        value = "silu" if (key, value) == ("hidden_act", "swish") else value  # (written by its usual name)
        if key == "rope_parameters":  # (YaRN's mscale is written as the attention_factor it gives)
            value = {k: v for k, v in value.items() if k != "mscale"}
            assert {k: b[key].get(k) for k in value} == value, (key, value, b[key])
        else:
            assert b.get(key) == value, (key, value, b.get(key))


@pytest.mark.parametrize("name", ["qwen2_untied_head_dim", "nemotron_yarn_biases"])
def test_a_variant_at_tp2_gives_transformers_logits(dist, tmp_path, name):
    model = _model(_variants()[name])
    assert _import(model, tmp_path)[0] == 0
    ref = _logits(model)
    for logits, _ in dist(2, ours_at, str(tmp_path / "ours"), ParallelConfig(tensor_model_parallel_size=2), IDS):
        assert _rel((logits[0] if logits.dim() == 3 else logits)[:, :V], ref) < 1e-5


def _without(cfg, **fields):
    out = copy.deepcopy(cfg)
    for k, v in fields.items():
        setattr(out, k, v)
    return out


# (config, the same config without the field, what the one line must say)
REFUSED = {
    # transformers windows every Qwen3-MoE layer (it has no layer_types); it was dropped without a word
    "qwen3_moe_sliding_window": lambda: (
        cfg := transformers.Qwen3MoeConfig(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            use_sliding_window=True,
            sliding_window=5,
            **SMALL,
        ),
        _without(cfg, use_sliding_window=False, sliding_window=None),
        "use_sliding_window=true (sliding_window 5) is not supported for Qwen3MoeForCausalLM; supported: "
        "use_sliding_window=false",
    ),
    # transformers scales DeepSeek's softmax by mscale(factor, mscale_all_dim)^2 under any scaled RoPE; it was
    # applied under YaRN only
    "deepseek_v3_llama3_mscale_all_dim": lambda: (
        cfg := transformers.DeepseekV3Config(
            q_lora_rank=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            rope_parameters={**LLAMA3, "mscale_all_dim": 1.0},
            **MLA,
        ),
        _without(cfg, rope_parameters=dict(LLAMA3)),
        "mscale_all_dim=1 with rope_type 'llama3' is not supported for DeepseekV3ForCausalLM; supported: "
        "mscale_all_dim with rope_type 'yarn' only",
    ),
    # a window on every Qwen3 layer (transformers 5's layer_types): the message said nothing of what runs
    "qwen3_sliding_window_every_layer": lambda: (
        cfg := transformers.Qwen3Config(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=0,
            **SMALL,
        ),
        _without(cfg, use_sliding_window=False, sliding_window=None, layer_types=["full_attention"] * 2),
        "layer_types ['sliding_attention'] are not supported for Qwen3ForCausalLM; supported: full_attention on "
        "every layer (use_sliding_window=false)",
    ),
    # Llama 4 normalises q and k after RoPE, cancelling YaRN's attention factor in transformers; ours kept it
    "llama4_yarn_qk_norm": lambda: (
        cfg := transformers.Llama4TextConfig(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size_mlp=96,
            num_local_experts=2,
            rope_parameters=dict(YARN),
            **dict(SMALL, intermediate_size=32),
        ),
        _without(cfg, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        "YaRN RoPE scaling (attention_factor 1.139) with use_qk_norm=true is not supported for Llama4ForCausalLM",
    ),
}


def test_a_top_level_original_length_wins_over_the_rope_dicts_as_in_transformers(tmp_path):
    """Phi-3's rule, which transformers 5 applies to every class: config.json's top-level
    original_max_position_embeddings overrides the one in rope_parameters (it was read from the dict: 22% off)."""
    import json

    model = _model(transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, rope_parameters=YARN,
                                            **SMALL))  # fmt: skip
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config["original_max_position_embeddings"] = 4096
    path.write_text(json.dumps(config))
    ref = _logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval())
    assert _rel(ref, _logits(model)) > 1e-4  # (the top-level value matters in transformers)
    rc, err = _convert("--loader", "hf", "--saver", "megatron_lite", "--load-dir", str(tmp_path / "hf"), "--save-dir",
                       str(tmp_path / "ours"))  # fmt: skip
    assert rc == 0, err
    assert _rel(_ours(str(tmp_path / "ours")), ref) < 1e-5


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_field_that_changes_the_math_and_is_not_honoured_is_one_line(tmp_path, name):
    cfg, without, message = REFUSED[name]()
    model = _model(cfg)
    plain = transformers.AutoModelForCausalLM.from_config(without).eval()
    plain.load_state_dict(model.state_dict())
    assert _rel(_logits(plain), _logits(model)) > 1e-4  # the field matters in transformers
    rc, err = _import(model, tmp_path)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: config.json ") and message in lines[0], err
