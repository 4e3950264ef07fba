"""Llama-Nemotron (DeciLM, model_type nemotron-nas: remote code, no transformers class) <-> megatron_lite through
tools/checkpoint/convert.py. Oracles: a real transformers Llama-3 whose weights, written as a DeciLM checkpoint of
all-plain blocks, convert to the same tensors as the Llama checkpoint and give transformers' Llama logits; and a
hand-built DeciLM state dict with no-op and linear blocks that comes back bit for bit."""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import pytest
import torch
import transformers
from convert_flow import IDS, randomised
from safetensors.torch import save_file
from test_convert import V, _hf_logits, _load_ours, _rel, _tensors, convert
from test_heterogeneous import MIXED as TRAINED

from megatron_lite.checkpoint.hf_convert import read_model_tensors
from megatron_lite.config import ParallelConfig

from models import decilm_block

# test_heterogeneous.MIXED as a DeciLM checkpoint holds it: every FFN sized by ffn_mult (DeciLM reads no other size;
# 7.0 at hidden 64 is int(298.7) rounded up to 512), not by Megatron's ffn_hidden_size
MIXED = [decilm_block("normal", 2, "normal", ffn_mult=7.0), *TRAINED[1:]]
LLAMA = dict(vocab_size=V, hidden_size=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=256,
             num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0)  # fmt: skip


def _decilm_config(blocks: list[dict], **kw) -> dict:
    """A DeciLM config.json: Llama's fields (without the model-wide key/value heads and intermediate size) and the
    blocks."""
    fields = {k: v for k, v in LLAMA.items() if k not in ("num_key_value_heads", "intermediate_size")}
    return {"architectures": ["DeciLMForCausalLM"], "model_type": "nemotron-nas", **fields, "hidden_act": "silu",
            "tie_word_embeddings": False, "num_hidden_layers": len(blocks), "block_configs": blocks, **kw}  # fmt: skip


def _to_ours_and_back(hf_dir: str, tmp_path: pathlib.Path, name: str) -> tuple[str, str]:
    ours, back = str(tmp_path / f"{name}-ours"), str(tmp_path / f"{name}-back")
    assert convert.main(["--loader", "hf", "--saver", "megatron_lite", "--load-dir", hf_dir, "--save-dir", ours]) == 0
    assert convert.main(["--loader", "megatron_lite", "--saver", "hf", "--load-dir", ours, "--save-dir", back]) == 0
    return ours, back


def test_plain_blocks_are_llama_3_both_ways(tmp_path):
    """Llama-3's weights under a DeciLM config.json whose blocks are all plain (8 heads / n_heads_in_group 2 = the
    4 key/value heads; ffn_mult 1.0 at hidden 64: int(42.67) -> 256, the intermediate size): the same tensors as the
    Llama conversion, transformers' Llama logits, and the export is the DeciLM checkpoint bit for bit."""
    llama = randomised(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)))
    llama_dir, decilm_dir = str(tmp_path / "llama"), tmp_path / "decilm"
    llama.save_pretrained(llama_dir)
    decilm_dir.mkdir()
    for f in pathlib.Path(llama_dir).glob("*.safetensors"):
        shutil.copy(f, decilm_dir)
    blocks = [decilm_block("normal", 2, "normal", ffn_mult=1.0)] * 2
    (decilm_dir / "config.json").write_text(json.dumps(_decilm_config(blocks)))
    ours_llama = str(tmp_path / "llama-ours")
    assert convert.main(["--loader", "hf", "--saver", "megatron_lite", "--load-dir", llama_dir, "--save-dir",
                         ours_llama]) == 0  # fmt: skip
    ours, back = _to_ours_and_back(str(decilm_dir), tmp_path, "decilm")
    a, b = read_model_tensors(ours)[1], read_model_tensors(ours_llama)[1]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model, _, config = _load_ours(ours, ParallelConfig())
    assert config.heterogeneous_blocks is not None
    with torch.no_grad():
        logits = model(torch.tensor([IDS]))[0].float()[..., :V]
    assert _rel(logits, _hf_logits(llama, IDS)) <= 1e-5
    theirs, mine = _tensors(str(decilm_dir)), _tensors(back)
    assert theirs.keys() == mine.keys() and all(torch.equal(theirs[k], mine[k]) for k in theirs)
    written = json.loads((pathlib.Path(back) / "config.json").read_text())
    assert written["architectures"] == ["DeciLMForCausalLM"] and written["model_type"] == "nemotron-nas"
    assert written["block_configs"] == blocks and "num_key_value_heads" not in written


def _decilm_tensors(blocks: list[dict]) -> dict[str, torch.Tensor]:
    """DeciLM's tensors by its names, random, for the blocks of test_heterogeneous.MIXED written out by hand: 8 heads
    of 8 dims at hidden 64; key/value heads 8 / n_heads_in_group; FFN sizes 64 (ffn_hidden_size) and 256 (ffn_mult
    1.3: int(55.47) -> 256)."""
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g)

    out = {"model.embed_tokens.weight": w(V, 64), "model.norm.weight": w(64), "lm_head.weight": w(V, 64)}
    ffn = {0: 512, 2: 256}
    for i, b in enumerate(blocks):
        p, attention, mlp = f"model.layers.{i}.", b["attention"], b["ffn"]
        if not attention["no_op"]:
            out[p + "input_layernorm.weight"] = w(64)
        if attention["replace_with_linear"]:
            out[p + "self_attn.linear_attn.weight"] = w(64, 64)
        elif not attention["no_op"]:
            kv = 8 // attention["n_heads_in_group"] * 8
            for name, rows in (("q", 64), ("k", kv), ("v", kv), ("o", 64)):
                out[f"{p}self_attn.{name}_proj.weight"] = w(rows, 64)
        if not mlp["no_op"]:
            out[p + "post_attention_layernorm.weight"] = w(64)
        if mlp["replace_with_linear"]:
            out[p + "mlp.linear_mlp.weight"] = w(64, 64)
        elif not mlp["no_op"]:
            f = ffn[i]
            out.update({p + "mlp.gate_proj.weight": w(f, 64), p + "mlp.up_proj.weight": w(f, 64),
                        p + "mlp.down_proj.weight": w(64, f)})  # fmt: skip
    return out


def test_noop_and_linear_blocks_round_trip_bit_exactly(tmp_path):
    """No-op attention and MLP (no tensors), linear ones (linear_attn / linear_mlp beside their norms), each layer's
    own key/value heads and FFN size: converted and exported, every tensor and the blocks come back as they were."""
    hf_dir = tmp_path / "decilm"
    hf_dir.mkdir()
    tensors = _decilm_tensors(MIXED)
    save_file(tensors, str(hf_dir / "model.safetensors"))
    (hf_dir / "config.json").write_text(json.dumps(_decilm_config(MIXED)))
    ours, back = _to_ours_and_back(str(hf_dir), tmp_path, "mixed")
    mine = _tensors(back)
    assert mine.keys() == tensors.keys() and all(torch.equal(mine[k], tensors[k]) for k in tensors)
    assert json.loads((pathlib.Path(back) / "config.json").read_text())["block_configs"] == MIXED
    model, _, config = _load_ours(ours, ParallelConfig())  # (and it loads as the mixed model)
    assert [b.attention for b in config.heterogeneous_blocks] == ["normal", "no_op", "linear", "normal", "no_op"]
    weights = {model.global_name(n): p for n, p in model.named_parameters()}
    assert torch.equal(weights["decoder.layers.1.mlp.weight"], tensors["model.layers.1.mlp.linear_mlp.weight"])


def test_a_downloads_remote_code_is_never_run_or_asked_about(tmp_path, monkeypatch):
    """A Llama-Nemotron download names its remote code (auto_map, configuration_decilm.py): its config.json is read
    without transformers' AutoConfig, which asked "run the custom code? [y/N]" (and failed with y); the code file
    here would raise if anything ran it."""
    from megatron_lite.checkpoint.hf_convert import load_hf_config

    def no_auto_config(*args, **kwargs):
        raise AssertionError("AutoConfig.from_pretrained called on a DeciLM download")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_auto_config)
    auto_map = {"AutoConfig": "configuration_decilm.DeciLMConfig", "AutoModelForCausalLM": "modeling_decilm.X"}
    (tmp_path / "config.json").write_text(json.dumps(_decilm_config(MIXED, auto_map=auto_map)))
    (tmp_path / "configuration_decilm.py").write_text("raise RuntimeError('remote code ran')\n")
    save_file(_decilm_tensors(MIXED), str(tmp_path / "model.safetensors"))
    config, raw = load_hf_config(str(tmp_path))
    assert config.block_configs == MIXED and config.hidden_size == 64 and raw["auto_map"] == auto_map


CONFIGURATION_DECILM = """from transformers import PretrainedConfig


class DeciLMConfig(PretrainedConfig):
    model_type = "nemotron-nas"

    def __init__(self, block_configs=None, **kwargs):
        self.block_configs = block_configs
        super().__init__(**kwargs)
"""


def test_the_export_carries_the_downloads_remote_code(tmp_path):
    """auto_map and the modelling code of a download (kept under the checkpoint's hf/, never run) are exported with
    the weights, so the export opens with trust_remote_code as the download did; the export dropped both."""
    hf_dir = tmp_path / "decilm"
    hf_dir.mkdir()
    auto_map = {"AutoConfig": "configuration_decilm.DeciLMConfig", "AutoModelForCausalLM": "modeling_decilm.X"}
    code = {"configuration_decilm.py": CONFIGURATION_DECILM, "modeling_decilm.py": "from .block_config import *\n",
            "block_config.py": "# imported by modeling_decilm\n"}  # fmt: skip
    for name, text in code.items():
        (hf_dir / name).write_text(text)
    (hf_dir / "config.json").write_text(json.dumps(_decilm_config(MIXED, auto_map=auto_map)))
    save_file(_decilm_tensors(MIXED), str(hf_dir / "model.safetensors"))
    _, back = _to_ours_and_back(str(hf_dir), tmp_path, "remote")
    assert json.loads((pathlib.Path(back) / "config.json").read_text())["auto_map"] == auto_map
    assert {name: (pathlib.Path(back) / name).read_text() for name in code} == code


@pytest.mark.parametrize(
    "changes, fragment",
    [
        (dict(normalization="LayerNorm"), "LayerNorm (DeciLM's norms are RMSNorm)"),
        (dict(activation="squared_relu"), "activation squared_relu (DeciLM's MLPs are SwiGLU)"),
        (dict(position_embedding_type="none"), "--position-embedding-type none (rope)"),
        (dict(rotary_percent=0.5), "--rotary-percent 0.5"),
        (dict(ffn_hidden_size=96), "block 0's FFN size 96 (DeciLM's ffn_mult gives multiples of 256 only)"),
    ],
)
def test_what_decilm_cannot_compute_is_refused_on_export(changes, fragment):
    """An exploratory run's finding: the DeciLM export checked none of these, and wrote a model DeciLM computes
    otherwise (0.16 off in the logits for LayerNorm; squared ReLU's fc1 split into a gate and an up half)."""
    from megatron_lite.config import ConfigError
    from megatron_lite.models.hf import hf_config_dict
    from megatron_lite.models.hf_decilm import DECILM

    from models import hetero_json, llama_config

    blocks = hetero_json([decilm_block("normal", None, "normal")] * 2)  # (the model's sizes)
    make = lambda **kw: llama_config(heterogeneous_layers_config_encoded_json=blocks, **{"ffn_hidden_size": 256, **kw})
    hf_config_dict(make(), DECILM)  # (the model without the change exports)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        hf_config_dict(make(**changes), DECILM)


def test_blocks_sized_by_the_model_or_megatrons_keys_export_as_decilm_reads_them():
    """An exploratory run's finding: a block's null n_heads_in_group / ffn_mult (the model's --num-query-groups and
    --ffn-hidden-size) and Megatron's num_query_groups / ffn_hidden_size keys went into config.json as they were,
    which DeciLM does not read: the export converted back to other shapes and loaded nowhere. Each block's sizes are
    now written in DeciLM's keys, and read back as the same layers."""
    from megatron_lite.models.hf import config_from_hf, hf_config_dict
    from megatron_lite.models.hf_decilm import DECILM

    from models import hetero_json, llama_config

    blocks = [decilm_block("normal", None, "normal"), decilm_block("normal", 4, "normal", ffn_hidden_size=512)]
    blocks[1]["attention"] = {"num_query_groups": 4, "no_op": False, "replace_with_linear": False}
    config = llama_config(heterogeneous_layers_config_encoded_json=hetero_json(blocks), ffn_hidden_size=256)
    out = hf_config_dict(config, DECILM)
    exported = out["block_configs"]
    assert [b["attention"]["n_heads_in_group"] for b in exported] == [2, 2]  # (8 heads in 4 groups)
    assert [b["ffn"]["ffn_mult"] for b in exported] == [6.0, 12.0]
    assert not [
        k for b in exported for part in b.values() for k in part if k in ("num_query_groups", "ffn_hidden_size")
    ]
    back = config_from_hf(transformers.PretrainedConfig(**out))
    sizes = lambda c: [(c.layer_config(i).query_groups, c.layer_config(i).ffn_size) for i in range(2)]
    assert sizes(back) == sizes(config) == [(4, 256), (4, 512)]


def test_layernorm_1p_norms_are_exported_as_gamma():
    """An exploratory run's finding: under --apply-layernorm-1p (gamma - 1 stored) the DeciLM export wrote the norms
    as stored, where DeciLM's hold gamma (0.75 off in the logits); the other Llama classes' exports add the 1."""
    from megatron_lite.models.hf_decilm import DECILM
    from megatron_lite.models.hf_weights import state_dict_to_hf

    from models import hetero_config, perturbed_full_state

    config = hetero_config(apply_layernorm_1p=True)
    ours = perturbed_full_state(config)
    hf = state_dict_to_hf(ours, config, DECILM)
    for our_key, hf_key in (
        ("decoder.layers.0.input_layernorm.weight", "model.layers.0.input_layernorm.weight"),
        ("decoder.layers.0.pre_mlp_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"),
        ("decoder.final_layernorm.weight", "model.norm.weight"),
    ):
        torch.testing.assert_close(hf[hf_key], ours[our_key] + 1, msg=hf_key)
