"""An independent reference: our model with weights copied from `transformers` models of the same config
gives the same logits and gradients (within 1e-5 per tensor). Our own one-process run cannot catch a bug
that it shares with the parallel runs; transformers can."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from megatron_lite.config import ParallelConfig
from megatron_lite.models.gpt_model import GPTModel
from megatron_lite.models.hf import config_from_hf
from megatron_lite.models.hf_weights import state_dict_from_hf, state_dict_to_hf
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.parameters import named_param_meta

from models import rel

TOL = 1e-5
V = 250


def _llama():
    # GQA (8 heads on 2 groups), non-default RoPE base and norm epsilon.
    return transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _llama3_scaled():
    # Llama-3 RoPE scaling and a head_dim that is not hidden / heads.
    return transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        rms_norm_eps=3e-6,
        max_position_embeddings=64,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
        rope_theta=50000.0,
        tie_word_embeddings=False,
    )


def _qwen2():
    # QKV bias (q/k/v only, not o_proj), tied embeddings.
    return transformers.Qwen2Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


def _gpt2():
    return transformers.GPT2Config(
        vocab_size=V,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        layer_norm_epsilon=1e-4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


def _mixtral():
    return transformers.MixtralConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_theta=1e6,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _qwen3():
    # Per-head q/k norms before RoPE, a head_dim that is not hidden / heads, tied embeddings.
    return transformers.Qwen3Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


def _qwen3_moe(norm_topk_prob=False):
    # Layer 0 dense (mlp_only_layers), layer 1 MoE; top-k of the full softmax, not renormalised, unless
    # norm_topk_prob.
    return transformers.Qwen3MoeConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=80,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=[0],
        rope_theta=1e6,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _nemotron():
    # LayerNorm1P (zero-centred gamma) with biases, squared ReLU, RoPE on 3/8 of each head, biases everywhere.
    return transformers.NemotronConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.375,
        rope_theta=20000.0,
        norm_eps=1e-4,
        attention_bias=True,
        mlp_bias=True,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _phi3():
    # Fused qkv_proj ([q; k; v]) and gate_up_proj, RoPE on 3/4 of each head (Phi-4-mini's factor).
    return transformers.Phi3Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        partial_rotary_factor=0.75,
        rope_theta=25000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=None,  # (transformers zeroes a padding row's embedding gradient; Megatron has no padding row)
        eos_token_id=None,
        bos_token_id=None,
    )


def _qwen3_yarn():
    # YaRN over an original context of 16 (so the ramp between extrapolated and interpolated dims falls inside
    # head_dim), with transformers' default attention factor 0.1 ln(factor) + 1.
    config = _qwen3()
    config.rope_parameters = {
        "rope_type": "yarn",
        "rope_theta": 100000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 8.0,
        "beta_slow": 0.5,
    }
    return config


def _deepseek_v3():
    # Multi-latent attention with a query latent, DeepSeek's interleaved RoPE rows, one dense layer then MoE layers
    # with sigmoid routing, a score-correction bias (set below), two expert groups and a shared expert.
    return transformers.DeepseekV3Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _deepseek_v3_dense_yarn():
    # No query latent, RoPE rows not interleaved, dense layers only, YaRN with DeepSeek's mscale_all_dim (the
    # softmax scale grows by mscale^2).
    config = _deepseek_v3()
    config.q_lora_rank = None
    config.rope_interleave = False
    config.first_k_dense_replace = config.num_hidden_layers
    config.rope_parameters = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 8.0,
        "beta_slow": 0.5,
        "mscale": 1.0,
        "mscale_all_dim": 0.7,
    }
    return config


def _deepseek_v2_lite(**overrides):
    # DeepSeek-V2-Lite's shape: no query latent, greedy top-k of the softmax (not renormalised), two shared experts.
    fields = dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=2,
        first_k_dense_replace=1,
        topk_method="greedy",
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return transformers.DeepseekV2Config(**{**fields, **overrides})


def _deepseek_v2_groups():
    # DeepSeek-V2's group_limited_greedy (groups ranked by their best score) with a query latent and scaled weights.
    config = _deepseek_v2_lite()
    config.q_lora_rank = 32
    config.topk_method = "group_limited_greedy"
    config.n_group, config.topk_group = 4, 2  # top-3 experts from the best 2 of 4 groups: the groups matter
    config.num_experts_per_tok = 3
    config.routed_scaling_factor = 2.0
    return config


def _deepseek_v2_groups_by_best():
    # DeepSeek-V2's own proportions (top-6 in 3 groups): groups ranked by their best score, where Megatron's rule
    # would sum their top 6 // 3 = 2 (a converted checkpoint carries transformers' rule).
    config = _deepseek_v2_groups()
    config.n_routed_experts, config.n_group, config.topk_group, config.num_experts_per_tok = 16, 4, 2, 4
    return config


def _deepseek_v3_groups_top2():
    # transformers' DeepSeek-V3 ranks groups by their top 2 scores whatever top-k / topk_group is (here 4)
    config = _deepseek_v3()
    config.n_routed_experts, config.n_group, config.topk_group, config.num_experts_per_tok = 16, 2, 1, 4
    config.initializer_range = 0.3  # router logits that vary by token (else the correction bias alone picks)
    return config


CASES = {
    "llama": (_llama, transformers.LlamaForCausalLM),
    "llama3_rope_scaling": (_llama3_scaled, transformers.LlamaForCausalLM),
    "qwen2": (_qwen2, transformers.Qwen2ForCausalLM),
    "gpt2": (_gpt2, transformers.GPT2LMHeadModel),
    "mixtral": (_mixtral, transformers.MixtralForCausalLM),
    "qwen3": (_qwen3, transformers.Qwen3ForCausalLM),
    "qwen3_moe": (_qwen3_moe, transformers.Qwen3MoeForCausalLM),
    "qwen3_moe_norm_topk": (lambda: _qwen3_moe(norm_topk_prob=True), transformers.Qwen3MoeForCausalLM),
    "nemotron": (_nemotron, transformers.NemotronForCausalLM),
    "qwen3_yarn": (_qwen3_yarn, transformers.Qwen3ForCausalLM),
    "phi3": (_phi3, transformers.Phi3ForCausalLM),
    "deepseek_v3": (_deepseek_v3, transformers.DeepseekV3ForCausalLM),
    "deepseek_v3_dense_yarn": (_deepseek_v3_dense_yarn, transformers.DeepseekV3ForCausalLM),
    "deepseek_v2_lite": (_deepseek_v2_lite, transformers.DeepseekV2ForCausalLM),
    # values wider than the query/key heads (24 > 12 + 8): nothing pads or cuts them
    "deepseek_v2_wide_values": (lambda: _deepseek_v2_lite(v_head_dim=24), transformers.DeepseekV2ForCausalLM),
    "deepseek_v2_groups": (_deepseek_v2_groups, transformers.DeepseekV2ForCausalLM),
    "deepseek_v2_groups_by_best": (_deepseek_v2_groups_by_best, transformers.DeepseekV2ForCausalLM),
    "deepseek_v3_groups_top2": (_deepseek_v3_groups_top2, transformers.DeepseekV3ForCausalLM),
    # more groups kept than experts picked (topk_group 3 > top-2): transformers allows it, Megatron's rule would not
    "deepseek_v3_wide_groups": (
        lambda: _with(_deepseek_v3_groups_top2(), n_group=4, topk_group=3, num_experts_per_tok=2),
        transformers.DeepseekV3ForCausalLM,
    ),
}


def _with(config, **fields):
    for k, v in fields.items():
        setattr(config, k, v)
    return config


def _hf_model(name):
    make_config, cls = CASES[name]
    hf_config = make_config()
    hf_config.architectures = [cls.__name__]
    torch.manual_seed(0)
    hf = cls(hf_config).float().eval()
    with torch.no_grad():  # move norms and biases off their 1 / 0 init so a misplaced one shows
        gen = torch.Generator().manual_seed(1)
        for p in hf.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
        for n, b in hf.named_buffers():  # DeepSeek-V3's score-correction bias: it must change which experts win
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    return hf, hf_config, cls.__name__


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_grads_equal_transformers(name, device):
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on a GPU too
    hf, hf_config, arch = _hf_model(name)
    hf = hf.to(device)
    config = config_from_hf(hf_config)
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device(device))
    ctx.seed(0)
    model = GPTModel(config, ctx).eval()
    interleave = getattr(hf_config, "rope_interleave", True)  # (DeepSeek-V3's RoPE row layout)
    model.load_full_state_dict(state_dict_from_hf(hf.state_dict(), config, arch, interleave))

    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (2, 24), generator=gen).to(device)
    labels = torch.randint(0, V, (2, 24), generator=gen).to(device)

    ref_logits = hf(ids).logits
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, V), labels.reshape(-1))
    ref_loss.backward()
    logits = model(ids)[..., :V]
    loss = model(ids, labels=labels).mean()
    loss.backward()

    errors = {
        "logits": rel(logits.detach(), ref_logits.detach()),
        "loss": rel(loss.detach(), ref_loss.detach()),
    }
    hf_grads = state_dict_from_hf({n: p.grad for n, p in hf.named_parameters()}, config, arch, interleave)
    # (not the expert bias: it moves by the routed counts, not by gradients, as transformers' buffer)
    ours = {model.global_name(n): (p, meta.shard) for n, p, meta in named_param_meta(model) if p.requires_grad}
    assert set(hf_grads) == set(ours)
    for k, g in hf_grads.items():
        p, spec = ours[k]
        mine = p.grad if spec is None else spec.unshard([p.grad])  # trims vocab padding
        errors[k] = rel(mine, g)
    bad = {k: v for k, v in errors.items() if not v < TOL}
    assert not bad, f"{name}: {bad}"


@pytest.mark.parametrize("name", list(CASES))
def test_hf_state_dict_round_trip_is_exact(name):
    hf, hf_config, arch = _hf_model(name)
    config = config_from_hf(hf_config)
    original = hf.state_dict()
    interleave = getattr(hf_config, "rope_interleave", True)
    back = state_dict_to_hf(
        state_dict_from_hf(original, config, arch, interleave), config, arch, rope_interleave=interleave
    )
    for k, v in back.items():
        assert torch.equal(v, original[k]), k
    assert set(back) == set(original)


def test_mixtral_on_disk_names_map_like_module_names(tmp_path):
    """save_pretrained writes block_sparse_moe.experts.{e}.w1/w2/w3; reading those gives the same weights."""
    from safetensors.torch import load_file

    hf, hf_config, arch = _hf_model("mixtral")
    config = config_from_hf(hf_config)
    hf.save_pretrained(tmp_path)
    on_disk = {}
    for f in tmp_path.glob("*.safetensors"):
        on_disk.update(load_file(str(f)))
    assert any("block_sparse_moe.experts.0.w1" in k for k in on_disk)  # really the on-disk naming
    from_disk = state_dict_from_hf(on_disk, config, arch)
    from_modules = state_dict_from_hf(hf.state_dict(), config, arch)
    assert from_disk.keys() == from_modules.keys()
    for k in from_modules:
        assert torch.equal(from_disk[k], from_modules[k]), k
