"""Llama 4's text model (transformers' Llama4ForCausalLM) <-> megatron_lite through tools/checkpoint/convert.py,
against real transformers models with every weight random: our logits equal transformers' (within 1e-5, fp32: the
NoPE layers, the RoPE layers' q/k L2 norms, interleaved llama3 RoPE, the sigmoid top-1 on the experts' inputs with
the shared expert, dense layers of intermediate_size_mlp between); the export loads in transformers bit-exact with
the same logits; two training steps give transformers' loss and gradient norm; a Llama4ForConditionalGeneration
checkpoint's text model converts (chunked attention and temperature tuning past their lengths:
tests/test_llama4_long.py)."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F
import transformers
from convert_flow import IDS, converts_both_ways, randomised, tp2_equals_transformers
from safetensors.torch import save_file
from test_convert import V, _hf_logits, _load_ours, _rel, _tensors, convert

from megatron_lite.config import ConfigError, ParallelConfig, RopeScaling

CASES = {
    # Scout/Maverick's shape: MoE every 2nd layer (1, 3), a NoPE layer every 4th (3), q/k L2 norms on the RoPE
    # layers, llama3 RoPE scaling; chunk and floor scale just over the 16 tokens run
    "interleaved-moe-llama3": dict(
        interleave_moe_layer_step=2, attention_chunk_size=16, floor_scale=17,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8, "rope_theta": 500000.0},
    ),
    # every layer MoE, NoPE layers 0 and 2 (listed), no q/k norms, tied embeddings, no chunking or tuning
    "listed-nope-tied": dict(
        no_rope_layers=[0, 1, 0, 1], use_qk_norm=False, tie_word_embeddings=True, attention_chunk_size=None,
        attn_temperature_tuning=False,
    ),
    # YaRN (exported too: it was refused on the way back, from an exploratory run), with the q/k norms at the
    # attention factor they keep, and without them at the factor YaRN derives
    "yarn-qk-norm": dict(
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "attention_factor": 1.0, "rope_theta": 500000.0},
    ),
    "yarn": dict(
        use_qk_norm=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "rope_theta": 500000.0},
    ),
}  # fmt: skip


def _config(**kw) -> transformers.Llama4TextConfig:
    return transformers.Llama4TextConfig(
        **{
            "vocab_size": V,
            "hidden_size": 64,
            "intermediate_size": 32,
            "intermediate_size_mlp": 96,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_local_experts": 4,
            "max_position_embeddings": 64,
            "rms_norm_eps": 1e-5,
            **kw,
        }
    )


def _random_model(config) -> transformers.Llama4ForCausalLM:
    # (the router large, so the top-1 is clear and its sigmoid far from 0.5)
    return randomised(transformers.Llama4ForCausalLM(config), big=("router.weight",))


def _converted(tmp_path, model) -> tuple[str, str, str]:
    hf_dir, ours, back = (str(tmp_path / k) for k in ("hf", "ours", "back"))
    model.save_pretrained(hf_dir)
    assert convert.main(["--loader", "hf", "--saver", "megatron_lite", "--load-dir", hf_dir, "--save-dir", ours]) == 0
    return hf_dir, ours, back


@pytest.mark.parametrize("case", list(CASES))
def test_llama4_converts_both_ways_with_transformers_logits(tmp_path, case):
    model = _random_model(_config(**CASES[case]))
    fields = ("moe_layers", "no_rope_layers", "use_qk_norm", "attention_chunk_size", "layer_types",
              "attn_temperature_tuning", "intermediate_size_mlp", "head_dim", "tie_word_embeddings")  # fmt: skip
    config, _ = converts_both_ways(model, tmp_path, fields)
    c = model.config
    assert [config.is_moe_layer(i) for i in range(4)] == [i in c.moe_layers for i in range(4)]
    assert [config.skips_rope(i) for i in range(4)] == [not r for r in c.no_rope_layers]
    assert config.qk_l2_norm == c.use_qk_norm and config.rotary_interleaved and config.moe_apply_probs_on_input
    assert (config.ffn_hidden_size, config.moe_ffn_hidden_size) == (96, 32)


def test_llama4_at_tp2_gives_transformers_logits_and_greedy_generation(dist, tmp_path):
    """Split over TP=2 (the L2-normed heads, the shared expert's and the dense layers' MLPs split), generating
    with our KV cache past the 16-token chunk and floor scale (tests/test_llama4_long.py has them small)."""
    tp2_equals_transformers(dist, _random_model(_config(**CASES["interleaved-moe-llama3"])), tmp_path)


def test_the_l2_norm_skips_the_nope_layers_and_the_rope_is_interleaved(tmp_path):
    """Megatron's --qk-l2-norm on every layer, or RoPE by halves, gives other logits than transformers'."""
    import dataclasses

    model = _random_model(_config(**CASES["interleaved-moe-llama3"]))
    _, ours, _ = _converted(tmp_path, model)
    ref = _hf_logits(model, IDS)
    ours_model, ctx, config = _load_ours(ours, ParallelConfig())
    from megatron_lite.models.gpt_model import build_model

    for change in (dict(qk_l2_norm_rope_only=False), dict(rotary_interleaved=False)):
        other = build_model(dataclasses.replace(config, **change), ctx, seed=0)
        other[0].load_full_state_dict(ours_model[0].full_state_dict())
        with torch.no_grad():
            logits = other(torch.tensor([IDS]))[0].float()
        assert _rel(logits[..., :V], ref) > 1e-3, change


def test_two_training_steps_give_transformers_loss_and_grad_norm():
    """One process, SGD: each step's lm loss and gradient norm equal those of transformers' model trained alike."""
    from megatron_lite.data.mock import MockGPTDataset, collate
    from megatron_lite.distributed.ddp import DistributedDataParallel
    from megatron_lite.models.gpt_model import GPTModel
    from megatron_lite.models.hf import config_from_hf
    from megatron_lite.models.hf_weights import state_dict_from_hf
    from megatron_lite.optimizer.config import OptimizerConfig
    from megatron_lite.optimizer.lr_scheduler import LRScheduler
    from megatron_lite.optimizer.optimizer import MixedPrecisionOptimizer
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.training.step import train_step

    hf = _random_model(_config(**CASES["interleaved-moe-llama3"])).train()
    config = config_from_hf(hf.config)
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    ctx.seed(0)
    model = GPTModel(config, ctx)
    model.load_full_state_dict(state_dict_from_hf(hf.state_dict(), config, "Llama4ForCausalLM"))
    optim = OptimizerConfig(lr=0.05, min_lr=0.05, lr_decay_style="constant", weight_decay=0.0, clip_grad=0.0,
                            optimizer="sgd", sgd_momentum=0.0)  # fmt: skip
    ddp = DistributedDataParallel(model, ctx)
    opt = MixedPrecisionOptimizer(model, ddp.main_grad, optim, ctx)
    sched = LRScheduler(optim, 2)
    ref_opt = torch.optim.SGD(hf.parameters(), lr=0.05)
    data = MockGPTDataset(V, 16, seed=3)
    for it in range(2):
        batch = collate([data[it * 2 + i] for i in range(2)])
        ours = train_step(ddp, opt, sched, [batch], ctx)
        ref_opt.zero_grad()
        loss = F.cross_entropy(hf(batch["tokens"]).logits.reshape(-1, V), batch["labels"].reshape(-1))
        loss.backward()
        norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in hf.parameters()])))
        ref_opt.step()
        assert abs(ours.lm_loss - loss.item()) <= 1e-5 * loss.item(), (it, ours.lm_loss, loss.item())
        assert abs(ours.grad_norm - norm) <= 1e-5 * norm, (it, ours.grad_norm, norm)


def test_a_conditional_generation_checkpoints_text_model_converts(tmp_path):
    """Llama4ForConditionalGeneration's tensors are the text model's under language_model. beside the vision
    tower's: the text model converts (the vision tensors noted, not converted) and exports as Llama4ForCausalLM."""
    model = _random_model(_config(**CASES["interleaved-moe-llama3"]))
    hf_dir, ours, back = (str(tmp_path / k) for k in ("vlm", "ours", "back"))
    model.save_pretrained(str(tmp_path / "text"))
    text = _tensors(str(tmp_path / "text"))
    vision = {"vision_model.patch_embedding.linear.weight": torch.randn(8, 12),
              "multi_modal_projector.linear_1.weight": torch.randn(64, 8)}  # fmt: skip
    (tmp_path / "vlm").mkdir()
    save_file({"language_model." + k: v for k, v in text.items()} | vision, f"{hf_dir}/model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    text_config = json.loads((tmp_path / "text" / "config.json").read_text())
    text_config.pop("architectures")
    raw = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": text_config,
           "vision_config": {"model_type": "llama4_vision_model"}}  # fmt: skip
    (tmp_path / "vlm" / "config.json").write_text(json.dumps(raw))
    assert convert.main(["--loader", "hf", "--saver", "megatron_lite", "--load-dir", hf_dir, "--save-dir", ours]) == 0
    ours_model, _, _ = _load_ours(ours, ParallelConfig())
    with torch.no_grad():
        logits = ours_model(torch.tensor([IDS]))[0].float()
    ref = _hf_logits(model, IDS)
    assert _rel(logits[..., :V], ref) <= 1e-5, _rel(logits[..., :V], ref)
    assert convert.main(["--loader", "megatron_lite", "--saver", "hf", "--load-dir", ours, "--save-dir", back]) == 0
    b = _tensors(back)
    assert b.keys() == text.keys() and all(torch.equal(text[k], b[k]) for k in text)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    assert type(reloaded) is transformers.Llama4ForCausalLM and torch.equal(_hf_logits(reloaded, IDS), ref)


@pytest.mark.parametrize(
    "changes,fragment",
    [
        ({"num_experts_per_tok": 2}, "num_experts_per_tok=2 is not supported"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_what_llama4_we_cannot_compute_is_refused(changes, fragment):
    """Read by transformers' config class and, as without transformers installed, from config.json alone."""
    from megatron_lite.checkpoint.hf_convert import _fallback_config
    from megatron_lite.models.hf import config_from_hf

    config = _config(**changes)
    for read in (config, _fallback_config(config.to_dict())):
        with pytest.raises(ConfigError, match=re.escape(fragment)) as err:
            config_from_hf(read)
        assert "\n" not in str(err.value)


def test_a_llama4_config_json_without_transformers_reads_as_with_it():
    """Fields left at their class defaults (no_rope_layers, moe_layers derived) read alike without transformers."""
    from megatron_lite.checkpoint.hf_convert import _fallback_config
    from megatron_lite.models.hf import config_from_hf

    raw = {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "vocab_size": V, "hidden_size": 64,
           "intermediate_size": 32, "intermediate_size_mlp": 96, "num_hidden_layers": 8, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_local_experts": 4, "interleave_moe_layer_step": 2}  # fmt: skip
    ours = config_from_hf(_fallback_config(raw))
    with_it = transformers.Llama4TextConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    assert ours == config_from_hf(with_it)
    assert (ours.no_rope_freq, ours.moe_layers, ours.head_dim) == (4, (0, 1, 0, 1, 0, 1, 0, 1), 128)


@pytest.mark.parametrize(
    "changes,fragment",
    [
        ({"qk_l2_norm_rope_only": False}, "--qk-l2-norm on the NoPE layers (Megatron's"),
        ({"rotary_interleaved": False}, "RoPE rotating halves"),
        ({"moe_apply_probs_on_input": False}, "routing weights on the experts' outputs"),
        ({"moe_shared_expert_intermediate_size": 64}, "a shared expert of 64"),
        ({"qk_l2_norm": False}, "--qk-l2-norm-rope-only (Llama 4's) limits --qk-l2-norm to the RoPE layers"),
        (
            {"rope_scaling": RopeScaling(rope_type="yarn", factor=4.0, attention_factor=1.2)},
            "YaRN with an attention factor other than 1 under --qk-l2-norm",
        ),
    ],
)
def test_what_llama4_cannot_compute_is_refused_on_export(changes, fragment):
    """A Megatron model with Llama 4's flags is exported as Llama 4; what its class cannot express is one line."""
    from megatron_lite.models.hf import _architecture, check_exportable, hf_config_dict

    from models import CONFIGS

    four = dict(num_layers=4, moe_layer_freq=(0, 1, 0, 1))
    llama4 = CONFIGS["llama4"](**four)
    assert _architecture(llama4) == "Llama4ForCausalLM"
    fields = hf_config_dict(llama4, "Llama4ForCausalLM")
    assert (fields["no_rope_layers"], fields["moe_layers"], fields["use_qk_norm"]) == ([1, 0, 1, 0], [1, 3], True)
    with pytest.raises(ConfigError, match=re.escape(fragment)) as err:
        check_exportable(CONFIGS["llama4"](**four | changes), "Llama4ForCausalLM")
    assert "\n" not in str(err.value)


def test_feed_forward_adapters_are_not_exported_to_peft():
    """Llama 4's MLPs are feed_forward.*: adapters on them (which PEFT's names would put on mlp.*) are one line."""
    from megatron_lite.lora.config import LoraConfig
    from megatron_lite.lora.peft import to_peft

    from models import CONFIGS

    key = "decoder.layers.0.mlp.linear_fc1.lora.pairs.gate"
    adapters = {f"{key}.A": torch.zeros(4, 64), f"{key}.B": torch.zeros(96, 4)}
    lora = LoraConfig(4, 8.0, 0.0, ("linear_fc1",))
    with pytest.raises(ConfigError, match=r"not mapped onto Llama 4's feed_forward modules; .*--merge-lora"):
        to_peft(adapters, CONFIGS["llama4"](), lora, "Llama4ForCausalLM")


@pytest.mark.parametrize("name", ["dense-interleaved", "llama4"])
def test_a_megatron_model_exported_as_llama4_gives_our_logits_in_transformers(name):
    """Trained here, not converted: --rotary-interleaved alone (a dense Llama 4: no MoE or NoPE layer, no q/k norm,
    which no other class computes), and tests/models.py's Llama 4 (NoPE layer 2 without the L2 norm, its MoE)."""
    from megatron_lite.models.gpt_model import GPTModel
    from megatron_lite.models.hf import _architecture, hf_config_dict
    from megatron_lite.models.hf_weights import state_dict_to_hf
    from megatron_lite.parallel_context import ParallelContext

    from models import CONFIGS, llama_config

    config = llama_config(rotary_interleaved=True) if name == "dense-interleaved" else CONFIGS["llama4"]()
    assert _architecture(config) == "Llama4ForCausalLM"
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    ctx.seed(0)
    ours = GPTModel(config, ctx).eval()
    fields = {k: v for k, v in hf_config_dict(config, "Llama4ForCausalLM").items() if k != "architectures"}
    hf = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**fields)).eval()
    hf.load_state_dict(state_dict_to_hf(ours.full_state_dict(), config, "Llama4ForCausalLM"))
    with torch.no_grad():
        logits = ours(torch.tensor([IDS]))[0].float()
    assert _rel(logits[..., :V], _hf_logits(hf, IDS)) <= 1e-5
