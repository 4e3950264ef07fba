"""LoRA adapters leave megatron_lite in the formats Hugging Face users load: a tiny Llama converted from
transformers, LoRA-fine-tuned a few steps here, exported as a PEFT adapter that `PeftModel.from_pretrained`
puts on the Hugging Face base with our logits (fp32, 1e-4), and merged into full weights that equal
W + (alpha / r) B A and give the same logits in transformers."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.lora.apply import LoraConfig, apply_lora
from megatron_lite.lora.peft import merge, split_lora, to_peft, write_peft

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LORA = LoraConfig(rank=4, alpha=8.0)


def fine_tune(hf_cfg, lora: LoraConfig):
    """(HF base model, our model converted from it and LoRA-fine-tuned 4 steps here, its full state, config)."""
    from megatron_lite.data.mock import MockGPTDataset, collate
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.models.hf import config_from_hf
    from megatron_lite.models.hf_weights import state_dict_from_hf
    from megatron_lite.optimizer.config import OptimizerConfig
    from megatron_lite.optimizer.lr_scheduler import LRScheduler
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.training.step import train_step
    from megatron_lite.training.wrap import wrap_for_training

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    arch = type(hf).__name__
    config = config_from_hf(hf_cfg, make_vocab_size_divisible_by=1)
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    model = build_model(config, ctx, seed=1)
    model[0].load_full_state_dict(state_dict_from_hf(hf.state_dict(), config, arch))
    apply_lora(model, config, lora, ctx, seed=3)
    optim = OptimizerConfig(lr=2e-2, lr_decay_style="constant", weight_decay=0.0)
    ddp, opt = wrap_for_training(model, ctx, optim)
    sched = LRScheduler(optim, 4)
    data = MockGPTDataset(200, 16, seed=2)
    for it in range(4):
        train_step(ddp, opt, sched, [collate([data[4 * it + j] for j in range(4)])], ctx)
    model.eval()
    return hf, model, model[0].full_state_dict(), config


@pytest.fixture(scope="module")
def tuned():
    hf_cfg = transformers.LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, rope_theta=5000.0,
                                      tie_word_embeddings=False)  # fmt: skip
    return fine_tune(hf_cfg, LORA)


IDS = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(5))


def peft_gives_our_logits(hf, model, tensors, adapter_config, directory):
    """Write our adapter, load it with PEFT on the Hugging Face base and check: our logits (1e-4), the adapter
    matters (the base alone differs by more than 1e-3), every A and B arrived. Returns (PEFT model, its logits)."""
    write_peft(str(directory), tensors, adapter_config)
    peft_model = peft.PeftModel.from_pretrained(hf, str(directory)).eval()
    with torch.no_grad():
        theirs = peft_model(IDS).logits
        assert (model(IDS)[..., :200] - theirs).abs().max() < 1e-4
        with peft_model.disable_adapter():
            assert (peft_model(IDS).logits - theirs).abs().max() > 1e-3
    loaded = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(tensors)  # every projection's A and B arrived
    return peft_model, theirs


def test_peft_loads_our_adapter_with_our_logits(tuned, tmp_path):
    hf, model, state, config = tuned
    _, adapters = split_lora(state)
    assert any(v.abs().max() > 0 for k, v in adapters.items() if k.endswith(".B"))  # training moved B
    tensors, adapter_config = to_peft(adapters, config, LORA, "LlamaForCausalLM")
    peft_gives_our_logits(hf, model, tensors, adapter_config, tmp_path / "adapter")


def test_merged_export_is_base_plus_scaled_b_a(tuned):
    from megatron_lite.models.hf_weights import state_dict_to_hf

    hf, model, state, config = tuned
    base, adapters = split_lora(state)
    merged = merge(state, config, LORA)
    assert not any(".lora." in k for k in merged)
    hf_merged = state_dict_to_hf(merged, config, "LlamaForCausalLM")
    hf_base = state_dict_to_hf(base, config, "LlamaForCausalLM")
    scale = LORA.alpha / LORA.rank
    for hf_name, ours in (("self_attn.q_proj", "self_attention.linear_qkv.lora.pairs.q"),
                          ("self_attn.v_proj", "self_attention.linear_qkv.lora.pairs.v"),
                          ("mlp.up_proj", "mlp.linear_fc1.lora.pairs.up"),
                          ("mlp.down_proj", "mlp.linear_fc2.lora.pairs.fc2")):  # fmt: skip
        a, b = adapters[f"decoder.layers.1.{ours}.A"], adapters[f"decoder.layers.1.{ours}.B"]
        expected = hf_base[f"model.layers.1.{hf_name}.weight"] + scale * b @ a
        torch.testing.assert_close(hf_merged[f"model.layers.1.{hf_name}.weight"], expected, rtol=0, atol=1e-6)
    fresh = transformers.LlamaForCausalLM(hf.config).eval()
    fresh.load_state_dict(hf_merged, strict=False)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert (fresh(ids).logits - model(ids)[..., :200]).abs().max() < 1e-4


def test_peft_target_names_adapt_only_the_named_projections(tmp_path):
    """From a review: PEFT's default Llama targets `q_proj v_proj` trained k_proj too (q, k and v are one fused
    layer here), and `gate_proj` adapted up_proj: a recipe ported from PEFT trained another model. Now each named
    projection alone gets an adapter (the fused layer's other parts add zeros); the export names exactly those
    modules, PEFT gives our logits, the merge equals the adapted function, and the parameter count is theirs."""
    from megatron_lite.lora.config import target_modules

    targets = target_modules(["q_proj", "v_proj", "gate_proj"])
    assert targets == ("linear_q", "linear_v", "linear_fc1_gate")
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=targets)
    hf_cfg = transformers.LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4,
                                      tie_word_embeddings=False)  # fmt: skip
    hf, model, state, config = fine_tune(hf_cfg, lora)
    _, adapters = split_lora(state)
    assert {k.split(".lora.pairs.")[1] for k in adapters} == {"q.A", "q.B", "v.A", "v.B", "gate.A", "gate.B"}
    tensors, adapter_config = to_peft(adapters, config, lora, "LlamaForCausalLM")
    assert adapter_config["target_modules"] == ["gate_proj", "q_proj", "v_proj"]
    peft_model, _ = peft_gives_our_logits(hf, model, tensors, adapter_config, tmp_path / "adapter")
    ours = sum(v.numel() for v in adapters.values())
    assert ours == sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    plain = transformers.LlamaForCausalLM(hf_cfg).eval()
    from megatron_lite.models.hf_weights import state_dict_to_hf

    plain.load_state_dict(state_dict_to_hf(merge(state, config, lora), config, "LlamaForCausalLM"), strict=False)
    with torch.no_grad():
        assert (plain(IDS).logits - model(IDS)[..., :200]).abs().max() < 1e-4


def test_gpt2_export_is_refused():
    from models import gpt2_config

    with pytest.raises(Exception, match="Llama-like"):
        to_peft({}, gpt2_config(), LORA, "GPT2LMHeadModel")


EXPERT_LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("linear_qkv", "experts"))


@pytest.fixture(scope="module")
def tuned_mixtral():
    """A tiny Mixtral from transformers with adapters on q/k/v and on every routed expert, fine-tuned here."""
    hf_cfg = transformers.MixtralConfig(vocab_size=200, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, tie_word_embeddings=False)  # fmt: skip
    return fine_tune(hf_cfg, EXPERT_LORA)


def test_peft_loads_our_expert_adapters_with_our_logits(tuned_mixtral, tmp_path):
    """PEFT adapts Mixtral's fused expert parameters (target_parameters); our per-expert pairs, stacked in its
    layout, give our logits on the Hugging Face base."""
    from megatron_lite.models.hf_weights import state_dict_to_hf

    hf, model, state, config = tuned_mixtral
    base, adapters = split_lora(state)
    expert_b = [v for k, v in adapters.items() if ".mlp.experts." in k and k.endswith(".B")]
    assert len(expert_b) == 2 * 2 * 4 and all(v.abs().max() > 0 for v in expert_b)  # every expert's B trained
    tensors, adapter_config = to_peft(adapters, config, EXPERT_LORA, "MixtralForCausalLM")
    assert adapter_config["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
    _, theirs = peft_gives_our_logits(hf, model, tensors, adapter_config, tmp_path / "adapter")
    with torch.no_grad():
        # the experts' adapters matter on their own: without them (attention's alone) the logits differ
        no_experts = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
        write_peft(str(tmp_path / "attn_only"), no_experts, {**adapter_config, "target_parameters": []})
        fresh = transformers.MixtralForCausalLM(hf.config).eval()  # (PEFT wrapped `hf` in place)
        fresh.load_state_dict(state_dict_to_hf(base, config, "MixtralForCausalLM"), strict=False)
        attn_only = peft.PeftModel.from_pretrained(fresh, str(tmp_path / "attn_only")).eval()
        assert (attn_only(IDS).logits - theirs).abs().max() > 1e-3


def test_peft_gate_up_proj_adapts_the_experts_fc1_alone(tmp_path):
    """From a review: PEFT's target parameter name gate_up_proj meant our `experts`, which adapted each expert's
    fc2 too (a recipe ported from PEFT trained more, and the export listed experts.down_proj). It is experts_fc1
    now (experts_fc2 the other half; both together are `experts`), and PEFT loads the export with our logits."""
    from megatron_lite.lora.config import target_modules

    assert target_modules(["gate_up_proj"]) == ("experts_fc1",)
    assert target_modules(["experts_fc1", "q_proj", "experts_fc2"]) == ("experts", "linear_q")
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("linear_qkv", *target_modules(["gate_up_proj"])))
    hf_cfg = transformers.MixtralConfig(vocab_size=200, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, tie_word_embeddings=False)  # fmt: skip
    hf, model, state, config = fine_tune(hf_cfg, lora)
    _, adapters = split_lora(state)
    experts = {k for k in adapters if ".mlp.experts." in k}
    assert experts and all(".linear_fc1.lora." in k for k in experts), sorted(experts)[:4]
    tensors, adapter_config = to_peft(adapters, config, lora, "MixtralForCausalLM")
    assert adapter_config["target_parameters"] == ["experts.gate_up_proj"]
    peft_gives_our_logits(hf, model, tensors, adapter_config, tmp_path / "adapter")


def test_merged_expert_export_is_base_plus_scaled_b_a(tuned_mixtral):
    from megatron_lite.models.hf_weights import state_dict_to_hf

    hf, model, state, config = tuned_mixtral
    base, adapters = split_lora(state)
    hf_merged = state_dict_to_hf(merge(state, config, EXPERT_LORA), config, "MixtralForCausalLM")
    hf_base = state_dict_to_hf(base, config, "MixtralForCausalLM")
    scale = EXPERT_LORA.alpha / EXPERT_LORA.rank
    for e in range(4):
        for hf_name, ours in (
            ("gate_up_proj", "linear_fc1.lora.pairs.fc1"),
            ("down_proj", "linear_fc2.lora.pairs.fc2"),
        ):
            a, b = (
                adapters[f"decoder.layers.1.mlp.experts.{e}.{ours}.A"],
                adapters[f"decoder.layers.1.mlp.experts.{e}.{ours}.B"],
            )
            expected = hf_base[f"model.layers.1.mlp.experts.{hf_name}"][e] + scale * b @ a
            torch.testing.assert_close(
                hf_merged[f"model.layers.1.mlp.experts.{hf_name}"][e], expected, rtol=0, atol=1e-6
            )
    fresh = transformers.MixtralForCausalLM(hf.config).eval()
    fresh.load_state_dict(hf_merged, strict=False)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert (fresh(ids).logits - model(ids)[..., :200]).abs().max() < 1e-4


def test_expert_adapters_trained_with_dropout_export_without_it():
    """PEFT refuses dropout on expert parameters, and dropout changes no output at inference: an adapter trained
    with --lora-dropout exports with lora_dropout 0 (it was refused, leaving a large MoE the full merged export);
    without experts the trained dropout is written."""
    from models import llama_config

    config = llama_config(num_experts=2, moe_router_topk=2, moe_ffn_hidden_size=48)
    lora = LoraConfig(rank=4, alpha=8.0, dropout=0.1, target_modules=("experts", "linear_qkv"))
    q = "decoder.layers.0.self_attention.linear_qkv.lora.pairs.q."
    attention = {q + "A": torch.zeros(4, 64), q + "B": torch.zeros(64, 4)}
    experts = {
        f"decoder.layers.0.mlp.experts.{e}.linear_fc1.lora.pairs.fc1.{m}": torch.zeros(shape)
        for e in range(2)
        for m, shape in (("A", (4, 64)), ("B", (96, 4)))
    }
    _, adapter_config = to_peft({**attention, **experts}, config, lora, "MixtralForCausalLM")
    assert adapter_config["lora_dropout"] == 0.0 and adapter_config["target_parameters"]
    _, adapter_config = to_peft(attention, config, lora, "MixtralForCausalLM")
    assert adapter_config["lora_dropout"] == 0.1


def test_merge_folds_every_adapter_kind_into_the_function():
    """Merged weights give the adapted model's logits for every kind of adapted layer at once: grouped QKV,
    output projection, dense and shared-expert gate/up and down, routed experts. (Before, a shared expert's
    adapters were dropped from the merge.)"""
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    from models import llama_config

    config = llama_config(num_layers=2, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                          moe_shared_expert_intermediate_size=40, moe_layer_freq=(1, 0))  # fmt: skip
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
                                                         "experts"))  # fmt: skip
    adapted = build_model(config, ctx, seed=1)
    apply_lora(adapted, config, lora, ctx, seed=2)
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if n.endswith(".B"):
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    state = adapted[0].full_state_dict()
    kinds = {k.split(".lora.pairs.")[0].split(".")[-1] for k in state if ".lora." in k}
    assert any(".shared_expert" in k and ".lora." in k for k in state), sorted(state)[:20]
    assert kinds == {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}
    plain = build_model(config, ctx, seed=7)
    plain[0].load_full_state_dict(merge(state, config, lora))
    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids), adapted(ids), rtol=1e-4, atol=1e-5)


DEEPSEEK_LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
                                                              "experts"))  # fmt: skip


DEEPSEEK_PEFT_LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("linear_qkv", "linear_proj", "experts"))


def _deepseek_config():
    return transformers.DeepseekV3Config(
        vocab_size=200, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=12,
        qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        n_shared_experts=1, first_k_dense_replace=1, tie_word_embeddings=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tuned_deepseek_peft():
    """Adapters PEFT can carry on DeepSeek-V3: the latent projections, o_proj and the routed experts."""
    return fine_tune(_deepseek_config(), DEEPSEEK_PEFT_LORA)


@pytest.fixture(scope="module")
def tuned_deepseek():
    """A tiny DeepSeek-V3 (query latent, interleaved RoPE rows, a dense layer then MoE with a shared expert) with
    adapters on every projection: linear_qkv means the four latent projections on an MLA model."""
    return fine_tune(_deepseek_config(), DEEPSEEK_LORA)


def test_peft_loads_our_deepseek_adapters_with_our_logits(tuned_deepseek_peft, tmp_path):
    """PEFT names (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, routed experts) and the RoPE rows
    of the B matrices in DeepSeek's interleaved order: transformers' logits equal ours."""
    hf, model, state, config = tuned_deepseek_peft
    _, adapters = split_lora(state)
    tensors, adapter_config = to_peft(adapters, config, DEEPSEEK_PEFT_LORA, "DeepseekV3ForCausalLM")
    mla = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    assert mla == set(adapter_config["target_modules"]) and adapter_config["target_parameters"]
    peft_gives_our_logits(hf, model, tensors, adapter_config, tmp_path / "adapter")


def test_merged_deepseek_export_gives_our_logits_in_transformers(tuned_deepseek):
    from megatron_lite.models.hf_weights import state_dict_to_hf

    hf, model, state, config = tuned_deepseek
    merged = merge(state, config, DEEPSEEK_LORA)
    fresh = transformers.DeepseekV3ForCausalLM(hf.config).eval()
    fresh.load_state_dict(state_dict_to_hf(merged, config, "DeepseekV3ForCausalLM"), strict=False)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert (fresh(ids).logits - model(ids)[..., :200]).abs().max() < 1e-4


def test_deepseek_dense_mlp_adapters_are_not_exported_to_peft(tuned_deepseek):
    """PEFT would put them on the routed experts (it maps gate/up/down_proj to the fused expert parameters)."""
    _, _, state, config = tuned_deepseek
    with pytest.raises(Exception, match="--merge-lora"):
        to_peft(split_lora(state)[1], config, DEEPSEEK_LORA, "DeepseekV3ForCausalLM")


def test_adapters_on_multi_token_prediction_layers_are_not_exported_to_peft():
    """transformers' DeepSeek-V3 has no MTP layers to carry them: an error naming the layer, not a dropped adapter."""
    from megatron_lite.models.hf import config_from_hf

    config = config_from_hf(_deepseek_config(), mtp_num_layers=1)
    key = "mtp.layers.0.transformer_layer.self_attention.linear_proj.lora"
    adapters = {f"{key}.A.weight": torch.zeros(4, 40), f"{key}.B.weight": torch.zeros(64, 4)}
    with pytest.raises(ConfigError, match="multi-token-prediction layers .*mtp.layers.0.*--merge-lora"):
        to_peft(adapters, config, DEEPSEEK_PEFT_LORA, "DeepseekV3ForCausalLM")


def test_qwen2_moe_dense_and_shared_expert_adapters_load_in_peft_with_our_logits(tmp_path):
    """Qwen2-MoE's dense layer, its shared expert (one module, mlp.shared_expert.*) and its routed experts: where
    the installed PEFT leaves its gate/up/down targets on those modules (0.21 with transformers 5.25), PEFT loads
    the adapter and gives our logits; where it would move them onto the experts, the export refuses them."""
    from megatron_lite.lora.peft import peft_moves_mlp_targets

    hf_cfg = transformers.Qwen2MoeConfig(
        vocab_size=200, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=2,
        shared_expert_intermediate_size=40, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, mlp_only_layers=[0], tie_word_embeddings=False,
    )  # fmt: skip
    hf, model, state, config = fine_tune(hf_cfg, DEEPSEEK_LORA)
    adapters = split_lora(state)[1]
    assert any(".shared_expert.linear_fc2.lora." in k for k in adapters) and any(
        k.startswith("decoder.layers.0.mlp.linear_fc1.lora.") for k in adapters
    )
    if peft_moves_mlp_targets("Qwen2MoeForCausalLM"):
        with pytest.raises(ConfigError, match="PEFT cannot target Qwen2MoeForCausalLM's dense or shared-expert"):
            to_peft(adapters, config, DEEPSEEK_LORA, "Qwen2MoeForCausalLM")
        return
    tensors, adapter_config = to_peft(adapters, config, DEEPSEEK_LORA, "Qwen2MoeForCausalLM")
    assert any(".mlp.shared_expert.down_proj.lora_B" in k for k in tensors), sorted(tensors)
    peft_gives_our_logits(hf, model, tensors, adapter_config, tmp_path / "adapter")
