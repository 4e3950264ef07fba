"""LoRA export and resume paths a review found broken: a fine-tuned Phi-3 (whose checkpoint's own directory holds
no Hugging Face config) exported as a Llama adapter PEFT mostly ignored; Nemotron's non-gated fc1 adapter had no
PEFT name; Qwen3-MoE dense-layer adapters PEFT cannot load; a resume with fewer --lora-target-modules or another
--lora-alpha that dropped or rescaled trained adapters. Real transformers and PEFT; single-process runs."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
from test_pretrain_cli import _one_line_error

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _convert(*args: str) -> int:
    spec = importlib.util.spec_from_file_location("convert_for_lora_paths", ROOT / "tools/checkpoint/convert.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(list(args))


def _fine_tune(tmp_path, hf_config, monkeypatch, *lora: str) -> tuple[str, str]:
    """An HF model converted to `ckpt`, fine-tuned with LoRA for 4 iterations into `out` (a directory of its own,
    with no hf/ config beside it)."""
    from megatron_lite.training.pretrain import main

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path / "hf")
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert _convert("--loader", "hf", "--saver", "megatron_lite", "--load-dir", str(tmp_path / "hf"),
                    "--save-dir", ckpt) == 0  # fmt: skip
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    argv = ["--load", ckpt, "--finetune", "--save", out, "--mock-data", "--vocab-size", str(hf_config.vocab_size - 1),
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "4",
            "--lr", "2e-2", "--lr-decay-style", "constant", "--eval-iters", "0", "--lora-rank", "4", *lora]  # fmt: skip
    assert main(argv) == 0
    return ckpt, out


def test_a_fine_tuned_phi3_is_not_exported_as_a_llama_adapter(tmp_path, capsys, monkeypatch):
    """The original class is found through the run's --load (the converted checkpoint's hf/config.json): Phi-3's
    fused projections have no PEFT adapter of ours, so the export is refused for --merge-lora, which writes a
    Phi-3 (before: a Llama adapter on q_proj/k_proj/v_proj, names Phi-3 lacks, written without a word)."""
    cfg = transformers.Phi3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)  # fmt: skip
    _, out = _fine_tune(tmp_path, cfg, monkeypatch)
    capsys.readouterr()
    rc = _convert("--loader", "megatron_lite", "--saver", "hf-peft", "--load-dir", out, "--save-dir",
                  str(tmp_path / "adapter"))  # fmt: skip
    _one_line_error(rc, capsys.readouterr().err, "not Phi3ForCausalLM", "--merge-lora")
    assert _convert("--loader", "megatron_lite", "--saver", "hf", "--merge-lora", "--load-dir", out, "--save-dir",
                    str(tmp_path / "merged")) == 0  # fmt: skip
    merged = transformers.AutoConfig.from_pretrained(tmp_path / "merged")
    assert merged.architectures == ["Phi3ForCausalLM"]


def test_nemotron_adapters_load_in_peft_with_our_logits(tmp_path, monkeypatch):
    """Nemotron's MLP is not gated: its fc1 adapter is PEFT's mlp.up_proj (it had no name, and the export
    stopped). PEFT on the HF base gives the fine-tuned model's logits."""
    from megatron_lite.checkpoint.hf_convert import model_config_from_dict, read_model_tensors, saved_lora_config
    from megatron_lite.config import ParallelConfig
    from megatron_lite.lora.apply import apply_lora
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    cfg = transformers.NemotronConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      partial_rotary_factor=0.5, initializer_range=0.5)  # fmt: skip
    _, out = _fine_tune(tmp_path, cfg, monkeypatch)
    assert _convert("--loader", "megatron_lite", "--saver", "hf-peft", "--load-dir", out, "--save-dir",
                    str(tmp_path / "adapter")) == 0  # fmt: skip
    # --target-dtype applies to the adapter's tensors (it was ignored, fp32 written)
    assert _convert("--loader", "megatron_lite", "--saver", "hf-peft", "--target-dtype", "bf16", "--load-dir", out,
                    "--save-dir", str(tmp_path / "bf16")) == 0  # fmt: skip
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(tmp_path / "bf16" / "adapter_model.safetensors").values()} == {torch.bfloat16}
    meta, tensors = read_model_tensors(out)
    config = model_config_from_dict(meta["config"]["model"])
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    model = build_model(config, ctx)
    apply_lora(model, config, saved_lora_config(meta["config"]), ctx, seed=0)
    model[0].load_full_state_dict(tensors)
    ids = torch.randint(2, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        untuned = base(ids).logits  # (before PEFT wraps it: it adapts the base module in place)
        tuned = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        ours, theirs = model.eval()(ids)[..., :128], tuned(ids).logits
    assert (ours - theirs).abs().max() < 1e-4, (ours - theirs).abs().max()
    assert (ours - untuned).abs().max() > 1e-3, (ours - untuned).abs().max()  # (the adapters do matter)
    # the adapter names its base (the directory converted from), so PEFT's auto class loads both from it alone
    with torch.no_grad():
        auto = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()
        assert (auto(ids).logits - theirs).abs().max() < 1e-6
    assert _convert("--loader", "megatron_lite", "--saver", "hf-peft", "--load-dir", out, "--save-dir",
                    str(tmp_path / "named"), "--base-model-name-or-path", "org/base") == 0  # fmt: skip
    assert peft.PeftConfig.from_pretrained(tmp_path / "named").base_model_name_or_path == "org/base"
    # a newer checkpoint saved beside the converted one (--load ckpt --save ckpt) leaves the base found
    ckpt = str(tmp_path / "ckpt")
    argv = ["--load", ckpt, "--save", ckpt, "--mock-data", "--vocab-size", "127", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1", "--eval-iters", "0",
            "--no-load-optim", "--lora-rank", "4"]  # fmt: skip
    from megatron_lite.training.pretrain import main

    assert main(argv) == 0
    assert _convert("--loader", "megatron_lite", "--saver", "hf-peft", "--load-dir", ckpt, "--save-dir",
                    str(tmp_path / "beside")) == 0  # fmt: skip
    base = peft.PeftConfig.from_pretrained(tmp_path / "beside").base_model_name_or_path
    assert base == str(tmp_path / "hf"), base


def test_qwen3_moe_dense_layer_adapters_are_refused_for_peft():
    """PEFT converts Qwen3-MoE's (qwen2_moe's) gate/up/down targets onto the fused experts, as DeepSeek's: a
    dense layer's adapters would not load (a size mismatch in PEFT), so the export says so."""
    from megatron_lite.config import ConfigError
    from megatron_lite.lora.config import LoraConfig
    from megatron_lite.lora.peft import to_peft

    from models import qwen3_config

    config = qwen3_config(num_experts=4, moe_router_topk=2, moe_layer_freq=(0, 1), num_layers=2)
    state = {"decoder.layers.0.mlp.linear_fc1.lora.pairs.gate.A": torch.zeros(4, 8)}
    with pytest.raises(ConfigError, match="PEFT cannot target Qwen3MoeForCausalLM's dense"):
        to_peft(state, config, LoraConfig(rank=4), "Qwen3MoeForCausalLM")


def test_without_peft_tables_qwen2_moe_shared_expert_adapters_are_refused(monkeypatch):
    """Where PEFT's conversion tables cannot be read (no PEFT, transformers 4, tables renamed), the export assumes
    Qwen2-MoE's gate/up/down targets may be moved onto its experts, as its versions do for Qwen3-MoE."""
    import sys

    from megatron_lite.config import ConfigError
    from megatron_lite.lora.config import LoraConfig
    from megatron_lite.lora.peft import to_peft

    from models import qwen3_config

    monkeypatch.setitem(sys.modules, "peft.utils.transformers_weight_conversion", None)  # (an ImportError)
    config = qwen3_config(num_experts=4, moe_router_topk=2, moe_layer_freq=(0, 1), num_layers=2)
    state = {"decoder.layers.1.mlp.shared_expert.linear_fc1.lora.pairs.gate.A": torch.zeros(4, 8)}
    with pytest.raises(ConfigError, match="PEFT cannot target Qwen2MoeForCausalLM's dense or shared-expert"):
        to_peft(state, config, LoraConfig(rank=4), "Qwen2MoeForCausalLM")


def test_a_resume_keeps_every_trained_adapter_at_its_scale(tmp_path, capsys, monkeypatch):
    """Resuming a LoRA run with fewer --lora-target-modules would drop the other adapters, and another
    --lora-alpha would rescale them: both are one-line errors, from the flags, before any process group (the
    load-time check behind them, for callers of load_checkpoint, is tested below)."""
    from megatron_lite.training.pretrain import main

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    _, out = _fine_tune(tmp_path, cfg, monkeypatch, "--lora-alpha", "12")
    capsys.readouterr()
    for extra, fragment in (
        (["--lora-target-modules", "linear_qkv"], "--lora-target-modules linear_qkv differs from the adapters"),
        (["--lora-alpha", "64"], "--lora-alpha 64 conflicts with the LoRA adapters"),
        # (a checkpoint whose linear_qkv trained k too, resumed with PEFT's q_proj v_proj: the message says why)
        (["--lora-target-modules", "q_proj", "v_proj"], "its linear_qkv adapts every part of that layer"),
    ):
        rc = main(["--load", out, "--save", out, "--train-iters", "5", *extra])
        _one_line_error(rc, capsys.readouterr().err, fragment)


def test_load_checkpoint_refuses_adapters_the_model_does_not_build(tmp_path, monkeypatch):
    """Behind the flags: a model built with fewer adapters than a checkpoint holds refuses it at load."""
    from megatron_lite.checkpoint.checkpointing import find_checkpoint, load_checkpoint, read_metadata
    from megatron_lite.checkpoint.hf_convert import model_config_from_dict
    from megatron_lite.config import ConfigError, ParallelConfig
    from megatron_lite.lora.apply import apply_lora
    from megatron_lite.lora.config import LoraConfig
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    _, out = _fine_tune(tmp_path, cfg, monkeypatch)
    path = find_checkpoint(out)
    config = model_config_from_dict(read_metadata(path)["config"]["model"])
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    model = build_model(config, ctx)
    apply_lora(model, config, LoraConfig(rank=4, target_modules=("linear_qkv",)), ctx, seed=0)
    with pytest.raises(ConfigError, match="holds LoRA adapters this run does not build"):
        load_checkpoint(path, model, None, None, ctx, load_rng=False)


def test_a_peft_export_at_a_dtype_casts_the_fp32_main_weights(tmp_path, monkeypatch):
    """From a review: a --bf16 run's adapters exported with --saver hf-peft --target-dtype fp32 were the bf16
    rounding of the trained weights upcast (3e-4 off), while --saver hf --merge-lora --target-dtype fp32 folds in
    the fp32 main weights the checkpoint holds. Both now cast the main weights, as the merge documents."""
    from safetensors.torch import load_file

    from megatron_lite.checkpoint.hf_convert import read_model_tensors

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    _, out = _fine_tune(tmp_path, cfg, monkeypatch, "--bf16")
    assert _convert("--loader", "megatron_lite", "--saver", "hf-peft", "--load-dir", out, "--save-dir",
                    str(tmp_path / "adapter"), "--target-dtype", "fp32") == 0  # fmt: skip
    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    _, main = read_model_tensors(out, main=True, base=False)
    _, rounded = read_model_tensors(out, base=False)
    ours = "decoder.layers.1.self_attention.linear_proj.lora.pairs.proj.A"
    assert main[ours].dtype == torch.float32 and rounded[ours].dtype == torch.bfloat16
    assert not torch.equal(main[ours], rounded[ours].float())  # (training moved A off bf16's grid)
    exported = tensors["base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"]
    assert exported.dtype == torch.float32 and torch.equal(exported, main[ours])


def test_a_peft_adapter_given_where_a_model_is_read_is_refused_naming_it(tmp_path, capsys, monkeypatch):
    """From a review: adapters are exported to PEFT, not imported from it. A PEFT adapter directory given to
    `--loader hf` said it "has no config.json"; one saved beside a model's weights (which transformers'
    from_pretrained puts on the base its adapter_config.json names) converted the bare weights without a word; and
    pretrain's --load called it "not a megatron_lite checkpoint directory". Each now names the adapter and the way
    in: fold it into its base with PEFT, then convert that."""
    import shutil

    from megatron_lite.training.pretrain import main

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(cfg)
    base.save_pretrained(tmp_path / "hf")
    adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    adapted.save_pretrained(tmp_path / "adapter")  # (PEFT's own adapter_config.json + adapter_model.safetensors)
    both = tmp_path / "both"
    shutil.copytree(tmp_path / "hf", both)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(tmp_path / "adapter" / f, both / f)
    for src in (tmp_path / "adapter", both):
        capsys.readouterr()
        rc = _convert("--loader", "hf", "--saver", "megatron_lite", "--load-dir", str(src), "--save-dir",
                      str(tmp_path / "out"))  # fmt: skip
        _one_line_error(rc, capsys.readouterr().err, f"{src} holds a PEFT adapter (adapter_config.json)",
                        "merge_and_unload")  # fmt: skip
        assert not (tmp_path / "out").exists()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    capsys.readouterr()
    rc = main(["--load", str(tmp_path / "adapter"), "--mock-data", "--vocab-size", "100", "--num-layers", "1",
               "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
               "--micro-batch-size", "1"])  # fmt: skip
    _one_line_error(rc, capsys.readouterr().err, "holds a PEFT adapter (adapter_config.json)", "merge_and_unload")
