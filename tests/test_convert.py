"""Hugging Face <-> megatron_lite conversion against real `transformers` models built from small random
configs that set a non-default value for every field that changes the math: HF -> ours -> HF is
bit-exact; our logits at TP=2 equal transformers' within 1e-4; greedy generation with our KV cache equals
transformers' greedy `generate`; unsupported fields are one-line errors; a converted checkpoint trains."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors import safe_open
from test_hf_reference import _deepseek_v2_lite

from megatron_lite.checkpoint.hf_convert import HF_DEFAULTS, MODEL_TYPES_CLASSES
from megatron_lite.config import ParallelConfig, RopeScaling

from dist_pool import get_context

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tool(path: str):
    """A script under tools/ as a module (loaded by path, without putting its folder on sys.path)."""
    spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem + "_tool", ROOT / path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


convert = _tool("tools/checkpoint/convert.py")
generate_cli = _tool("tools/generate.py")

V, SEQ, NEW = 250, 16, 8
PROMPT = [5, 17, 33, 2, 90, 41, 7, 200, 13, 64]
COMMON = dict(vocab_size=V, max_position_embeddings=64, initializer_range=0.05)


def _configs() -> dict:
    llama3 = {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 2.0,
        "high_freq_factor": 8.0,
        "original_max_position_embeddings": 16,
    }
    return {
        # Llama-3 RoPE scaling (non-default factors), a head_dim that is not hidden/heads, GQA, eps, base.
        "llama": transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            rms_norm_eps=3e-6,
            rope_theta=50000.0,
            rope_scaling=llama3,
            tie_word_embeddings=False,
            **COMMON,
        ),
        # A sliding window shorter than the test sequence.
        "mistral": transformers.MistralConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            sliding_window=6,
            rms_norm_eps=2e-5,
            rope_theta=20000.0,
            **COMMON,
        ),
        # QKV bias, tied embeddings.
        "qwen2": transformers.Qwen2Config(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            **COMMON,
        ),
        "mixtral": transformers.MixtralConfig(
            hidden_size=64,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=10,
            rms_norm_eps=2e-5,
            rope_theta=30000.0,
            **COMMON,
        ),
        # Per-head q/k norms, head_dim 128 by default (not hidden / heads); YaRN with DeepSeek's mscale ratio.
        "qwen3": transformers.Qwen3Config(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 100000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 8,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
            },
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            **COMMON,
        ),
        # q/k norms and experts, but a dense MLP on layer 1 (mlp_only_layers); renormalised top-k.
        "qwen3_moe": transformers.Qwen3MoeConfig(
            hidden_size=64,
            intermediate_size=72,
            moe_intermediate_size=40,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            rms_norm_eps=1e-5,
            **COMMON,
        ),
        # LayerNorm1P, squared ReLU, RoPE on half of each head (the default), GQA.
        "nemotron": transformers.NemotronConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            norm_eps=2e-5,
            rope_theta=30000.0,
            **COMMON,
        ),
        # Fused qkv_proj and gate_up_proj, a sliding window shorter than the test sequence, RoPE on half of each head.
        "phi3": transformers.Phi3Config(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=7,
            partial_rotary_factor=0.5,
            rms_norm_eps=2e-5,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
            **COMMON,
        ),
        # Phi-4's shape: the Llama math in Phi-3's fused projections, so the export must go back to Phi-3, not Llama.
        "phi4": transformers.Phi3Config(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=250000.0,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
            **COMMON,
        ),
        # Multi-latent attention (query latent, interleaved RoPE rows), one dense layer then MoE layers with sigmoid
        # routing, the score-correction bias, two expert groups and a shared expert; YaRN with DeepSeek-V3's
        # mscale = mscale_all_dim = 1 (the softmax scale grows by mscale(40)^2, 1.87x)
        "deepseek_v3": transformers.DeepseekV3Config(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 40.0,
                "original_max_position_embeddings": 8,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=24,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=24,
            qk_nope_head_dim=12,
            qk_rope_head_dim=8,
            v_head_dim=10,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            **COMMON,
        ),
        # DeepSeek-V2-Lite's shape: no query latent, RoPE on interleaved pairs, softmax top-k (greedy), two shared
        # experts.
        "deepseek_v2": _deepseek_v2_lite(num_hidden_layers=4, **COMMON),
        # gelu_new, an inner size that is not 4 x hidden, a non-default epsilon, tied embeddings.
        "gpt2": transformers.GPT2Config(
            vocab_size=V,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_inner=80,
            n_positions=64,
            layer_norm_epsilon=1e-4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            initializer_range=0.05,
        ),
    }


ARCHS = list(_configs())


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (hf model, hf dir, our checkpoint dir, hf dir written back)."""
    out = {}
    root = tmp_path_factory.mktemp("convert")
    for name, cfg in _configs().items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        hf_dir, ours, back = (str(root / f"{name}_{k}") for k in ("hf", "ours", "back"))
        model.save_pretrained(hf_dir)
        assert (
            convert.main(["--loader", "hf", "--saver", "megatron_lite", "--load-dir", hf_dir, "--save-dir", ours]) == 0
        )
        assert convert.main(["--loader", "megatron_lite", "--saver", "hf", "--load-dir", ours, "--save-dir", back]) == 0
        out[name] = (model, hf_dir, ours, back)
    return out


def _tensors(path: str) -> dict:
    out = {}
    for f in sorted(pathlib.Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("name", ARCHS)
def test_round_trip_is_bit_exact(converted, name):
    model, hf_dir, _, back = converted[name]
    a, b = _tensors(hf_dir), _tensors(back)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    assert type(reloaded) is type(model)
    for field in ("sliding_window", "head_dim", "rms_norm_eps", "tie_word_embeddings", "n_inner", "layer_norm_epsilon"):
        assert getattr(reloaded.config, field, None) == getattr(model.config, field, None), field
    assert torch.equal(_hf_logits(reloaded, PROMPT), _hf_logits(model, PROMPT))


def test_a_bf16_deepseek_v3_round_trips_with_its_dtypes(tmp_path):
    """A DeepSeek-V3 cast to bf16 whole (model.to(torch.bfloat16), buffers included) before save_pretrained: its
    e_score_correction_bias came back float32 (the import cast it), so HF -> ours -> HF was not bit-exact."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_configs()["deepseek_v3"]).to(torch.bfloat16)
    hf_dir, ours, back = (str(tmp_path / k) for k in ("hf", "ours", "back"))
    model.save_pretrained(hf_dir)
    assert convert.main(["--loader", "hf", "--saver", "megatron_lite", "--load-dir", hf_dir, "--save-dir", ours]) == 0
    assert convert.main(["--loader", "megatron_lite", "--saver", "hf", "--load-dir", ours, "--save-dir", back]) == 0
    a, b = _tensors(hf_dir), _tensors(back)
    assert any(k.endswith("e_score_correction_bias") and v.dtype == torch.bfloat16 for k, v in a.items())
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (k, a[k].dtype, b[k].dtype)


def _load_ours(ckpt: str, parallel: ParallelConfig):
    """(model, context, config) of our checkpoint in `ckpt`, without dropout, under `parallel` (this rank's part
    in a worker of the pool, else one process)."""
    import dataclasses

    import torch.distributed as dist

    from megatron_lite.checkpoint.checkpointing import find_checkpoint, load_checkpoint, read_metadata
    from megatron_lite.checkpoint.hf_convert import model_config_from_dict
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    path = find_checkpoint(ckpt)
    config = model_config_from_dict(read_metadata(path)["config"]["model"])
    config = dataclasses.replace(config, hidden_dropout=0.0, attention_dropout=0.0)
    ctx = (
        get_context(parallel)
        if dist.is_initialized()
        else ParallelContext.virtual(parallel, device=torch.device("cpu"))
    )
    model = build_model(config, ctx)
    load_checkpoint(path, model, None, None, ctx, load_rng=False)
    return model, ctx, config


def ours_at(ckpt: str, parallel: ParallelConfig, ids: list[int], prompt: list[int] = PROMPT):
    """On every rank: full-vocabulary logits of `ids` (last stage, else None) and greedy ids continuing
    `prompt` (our KV cache)."""
    from megatron_lite.inference.generation import _forward, generate
    from megatron_lite.inference.kv_cache import KVCache

    model, ctx, _ = _load_ours(ckpt, parallel)
    model.eval()
    with torch.no_grad():
        logits = _forward(model, ctx, ids, KVCache(len(ids)), every=True)
    out = generate(model, ctx, prompt, NEW)
    return logits, out["generated_ids"]


def _hf_greedy(model, ids):
    with torch.no_grad():
        seq = model.generate(
            torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return seq[0, len(ids) :].tolist()


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", ARCHS)
def test_tp2_logits_and_greedy_generation_equal_transformers(dist, converted, name):
    model, _, ours, _ = converted[name]
    ids = [(7 * i + 3) % V for i in range(SEQ)]  # 16 tokens: longer than Mistral's and Mixtral's windows
    ref = _hf_logits(model, ids)
    greedy = _hf_greedy(model, PROMPT)
    for logits, generated in dist(2, ours_at, ours, ParallelConfig(tensor_model_parallel_size=2), ids):
        assert _rel(logits, ref) < 1e-4, (name, _rel(logits, ref))
        assert generated == greedy, name


def test_window_matters(converted):
    """The Mistral test would not notice a dropped window unless the window changes the logits."""
    model, *_ = converted["mistral"]
    ids = [(7 * i + 3) % V for i in range(SEQ)]
    unwindowed = transformers.MistralForCausalLM(
        transformers.MistralConfig(**{**model.config.to_dict(), "sliding_window": None})
    )
    unwindowed.load_state_dict(model.state_dict())
    assert _rel(_hf_logits(unwindowed.eval(), ids), _hf_logits(model, ids)) > 1e-3


@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen3_moe", "deepseek_v3", "deepseek_v2"])
def test_pp2_tp2_generation_equals_transformers(dist, converted, name):
    model, _, ours, _ = converted[name]
    greedy = _hf_greedy(model, PROMPT)
    parallel = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    for _, generated in dist(4, ours_at, ours, parallel, PROMPT):
        assert generated == greedy


def batched_and_alone(ckpt: str, parallel: ParallelConfig):
    """On every rank: generate_batch's results for prompts of three lengths, and generate's for each alone, greedy
    (one of them stopping early at a token it makes), sampled, and scoring (max_new_tokens 0)."""
    from megatron_lite.inference.generation import SamplingConfig, generate, generate_batch

    model, ctx, config = _load_ours(ckpt, parallel)
    prompts = [PROMPT[3:], PROMPT, PROMPT[:4]]
    stop = (generate(model, ctx, prompts[1], NEW)["generated_ids"][2],)  # (the second prompt's third token)
    out = {}
    for name, new, sampling, stops in (
        ("greedy", NEW, None, stop),
        ("sampled", NEW, SamplingConfig(greedy=False, temperature=1.5, top_p=0.9, seed=3), ()),
        ("scored", 0, None, ()),
    ):
        out[name] = (
            generate_batch(model, ctx, prompts, new, sampling, stops),
            [generate(model, ctx, p, new, sampling, stops) for p in prompts],
        )
    # what a full cache holds on this rank, against cache_bytes (the GPU check's estimate)
    from megatron_lite.inference.generation import _forward_batch
    from megatron_lite.inference.kv_cache import KVCache, cache_bytes

    cache = KVCache(12)
    with torch.no_grad():
        _forward_batch(model, ctx, torch.tensor([p[:4] for p in prompts]), cache)
    held = sum(t.numel() * t.element_size() for kv in cache._store.values() for t in kv)
    layers = sum(len(c.decoder.layers) for c in model)
    out["cache"] = (held, cache_bytes(config, ctx.tp.size, layers, len(prompts), 12, torch.float32))
    return out, stop


def _assert_same_results(batched, alone):
    for b, a in zip(batched, alone, strict=True):
        assert b.keys() == a.keys() and b["generated_ids"] == a["generated_ids"], (b, a)
        for key in ("logprobs", "prompt_logprobs"):
            if key in a:
                assert len(b[key]) == len(a[key]), key
                assert torch.allclose(torch.tensor(b[key]), torch.tensor(a[key]), atol=1e-5), (key, b[key], a[key])


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_a_batch_of_prompts_generates_what_each_alone_does(dist, converted, name):
    """Batched generation (Megatron's static batching: every sequence at the same positions, a longer prompt's
    tail fed a token a step) under TP2 x PP2 gives each prompt what it gets alone: its tokens (greedy, with one
    stopping early at a stop id while the others go on; and sampled, each from its own seeded generator), their
    log-probabilities and its prompt's (also when only scored)."""
    _, _, ours, _ = converted[name]
    parallel = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    for rank, (out, stop) in enumerate(dist(4, batched_and_alone, ours, parallel)):
        batched, alone = out["greedy"]
        lengths = [len(r["generated_ids"]) for r in alone]
        assert min(lengths) < NEW == max(lengths), (lengths, stop)  # (one stops early, another goes on)
        held, estimated = out.pop("cache")
        assert held == estimated > 0, (held, estimated)
        for batched, alone in out.values():
            _assert_same_results(batched, alone)
        if rank >= 2:  # (the last stage's: the scores)
            assert [len(r["prompt_logprobs"]) for r in out["scored"][0]] == [len(PROMPT) - 4, len(PROMPT) - 1, 3]


def test_generate_cli_greedy_and_logprobs(converted, tmp_path):
    model, _, ours, _ = converted["llama"]
    out = tmp_path / "out.json"
    ids = ",".join(map(str, PROMPT))
    argv = ["--load", ours, "--prompt-ids", ids, "--max-new-tokens", str(NEW), "--greedy", "--output-json", str(out)]
    assert generate_cli.main([*argv, "--top-n-logprobs", "3"]) == 0
    r = json.loads(out.read_text())
    assert r["generated_ids"] == _hf_greedy(model, PROMPT)
    full = PROMPT + r["generated_ids"]
    logp = torch.log_softmax(_hf_logits(model, full), dim=-1)
    expected = [float(logp[i, full[i + 1]]) for i in range(len(full) - 1)]
    n = len(PROMPT) - 1
    assert len(r["prompt_logprobs"]) == n and len(r["logprobs"]) == NEW
    assert torch.allclose(torch.tensor(r["prompt_logprobs"]), torch.tensor(expected[:n]), atol=1e-4)
    assert torch.allclose(torch.tensor(r["logprobs"]), torch.tensor(expected[n:]), atol=1e-4)
    # Megatron's top_n_logprobs: at each generated token the 3 most likely of transformers' distribution
    assert len(r["top_n_logprobs"]) == NEW
    for step, top in enumerate(r["top_n_logprobs"]):
        values, ids_ = torch.topk(logp[n + step], 3)
        assert list(map(int, top)) == ids_.tolist()
        assert torch.allclose(torch.tensor(list(top.values())), values, atol=1e-4)
    # Sampling: the seed decides, and the same seed gives the same tokens.
    runs = []
    for seed in (1, 1, 2):
        sample = ["--temperature", "1.5", "--top-p", "0.9", "--seed", str(seed)]
        argv = ["--load", ours, "--prompt-ids", ids, "--max-new-tokens", "12", *sample, "--output-json", str(out)]
        assert generate_cli.main(argv) == 0
        runs.append(json.loads(out.read_text())["generated_ids"])
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_generation_scores_prompts_and_stops_as_transformers(converted, tmp_path, capsys):
    """From a generation review: --max-new-tokens 0 scores the prompt (Megatron's tokens_to_generate=0; it was
    refused); the prompt's logits are made only when its log-probabilities are written (a prefill made [prompt,
    vocab] fp32 log-probabilities always: 2 GB at 4096 x 64000); --prompt-ids stops at the converted model's
    eos as transformers' generate does (it ran on), unless --ignore-eos; options --greedy leaves unused are said,
    and a stop id outside the vocabulary, an empty prompt and a temperature too small to sample with are one
    line (a misleading line, nothing, and a traceback)."""
    from megatron_lite.checkpoint.checkpointing import find_checkpoint, load_checkpoint, read_metadata
    from megatron_lite.checkpoint.hf_convert import model_config_from_dict
    from megatron_lite.inference.generation import generate
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    model, hf_dir, ours, _ = converted["llama"]
    out = tmp_path / "out.json"
    ids = ",".join(map(str, PROMPT))
    assert (
        generate_cli.main(["--load", ours, "--prompt-ids", ids, "--max-new-tokens", "0", "--output-json", str(out)])
        == 0
    )
    r = json.loads(out.read_text())
    logp = torch.log_softmax(_hf_logits(model, PROMPT), dim=-1)
    assert r["generated_ids"] == [] and r["logprobs"] == []
    expected = logp[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(r["prompt_logprobs"]), expected, atol=1e-4)
    # the prompt's forward through the output layer: its last row alone unless the prompt is scored
    path = find_checkpoint(ours)
    config = model_config_from_dict(read_metadata(path)["config"]["model"])
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    ours_model = build_model(config, ctx)
    load_checkpoint(path, ours_model, None, None, ctx, load_rng=False)
    rows = []
    head = ours_model[0].output_layer.register_forward_hook(lambda m, args, y: rows.append(y.shape[0]))
    plain = generate(ours_model, ctx, PROMPT, 3, prompt_logprobs=False)
    scored = generate(ours_model, ctx, PROMPT, 3)
    head.remove()
    assert rows == [1, 1, 1, len(PROMPT), 1, 1] and plain["generated_ids"] == scored["generated_ids"]
    assert plain["prompt_logprobs"] is None and len(scored["prompt_logprobs"]) == len(PROMPT) - 1
    # stopping: the model's eos (its generation config) ends --prompt-ids generation, as transformers' generate
    greedy_ids = _hf_greedy(model, PROMPT)
    eos = greedy_ids[-1]
    gen_cfg = json.loads((pathlib.Path(hf_dir) / "generation_config.json").read_text())
    edited = tmp_path / "ours"
    import shutil

    shutil.copytree(ours, edited)
    (edited / "hf" / "generation_config.json").write_text(json.dumps({**gen_cfg, "eos_token_id": eos}))
    greedy = ["--prompt-ids", ids, "--max-new-tokens", str(NEW), "--greedy", "--output-json", str(out)]
    assert generate_cli.main(["--load", str(edited), *greedy]) == 0
    assert json.loads(out.read_text())["generated_ids"] == greedy_ids[: greedy_ids.index(eos) + 1]
    assert generate_cli.main(["--load", str(edited), *greedy, "--ignore-eos"]) == 0
    assert len(json.loads(out.read_text())["generated_ids"]) == NEW
    capsys.readouterr()
    assert generate_cli.main(["--load", ours, *greedy, "--top-k", "5"]) == 0
    assert "note: --greedy takes the most likely token: --top-k has no effect" in capsys.readouterr().err
    for argv, fragment in (
        (["--prompt-ids", ids, "--stop-ids", "99999"], "--stop-ids 99999 is outside the model's vocabulary [0, 250)"),
        (["--prompt-ids", ","], "--prompt-ids ',' is not a comma-separated list of token ids"),
        (["--prompt-ids", ids, "--top-k", "0", "--temperature", "1e-310"], "--temperature 1e-310 is too small to"),
        # (checked before the model generates: it was an IsADirectoryError traceback after the work, from a review)
        (["--prompt-ids", ids, "--output-json", str(tmp_path)], f"--output-json {tmp_path} is a directory"),
    ):
        assert generate_cli.main(["--load", ours, *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and fragment in err[0], err
    # Megatron's generation scripts spell --top_k / --top_p (their top_p 0: no filter); a missing parent is made
    sampled = ["--prompt-ids", ids, "--max-new-tokens", "4", "--seed", "3", "--ignore-eos"]
    runs = [[*sampled, "--top-k", "5"], [*sampled, "--top_k", "5", "--top_p", "0"]]
    for i, argv in enumerate(runs):
        assert generate_cli.main(["--load", ours, *argv, "--output-json", str(tmp_path / str(i) / "o.json")]) == 0
    assert len({(tmp_path / str(i) / "o.json").read_text() for i in range(2)}) == 1


def test_a_prompts_file_generates_each_prompt_with_the_model_loaded_once(converted, tmp_path, capsys):
    """Megatron's generation takes a list of prompts; --prompts-file (JSONL) runs each in turn and --output-json
    writes a list, each entry what transformers' greedy generate gives; a bad line is one line naming it."""
    model, _, ours, _ = converted["llama"]
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.json"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in (PROMPT, PROMPT[:4], PROMPT[3:])))
    argv = ["--load", ours, "--prompts-file", str(prompts), "--max-new-tokens", str(NEW), "--greedy", "--ignore-eos"]
    assert generate_cli.main([*argv, "--output-json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [r["prompt_ids"] for r in results] == [PROMPT, PROMPT[:4], PROMPT[3:]]
    assert [r["generated_ids"] for r in results] == [_hf_greedy(model, r["prompt_ids"]) for r in results]
    # one at a time (the default batches them, by length), under Megatron's name for --max-new-tokens
    argv1 = [*argv, "--inference-max-requests", "1", "--output-json", str(tmp_path / "one.json")]
    assert generate_cli.main([a.replace("--max-new-tokens", "--num-tokens-to-generate") for a in argv1]) == 0
    for one, batched in zip(json.loads((tmp_path / "one.json").read_text()), results, strict=True):
        assert one["generated_ids"] == batched["generated_ids"]
        assert torch.allclose(torch.tensor(one["logprobs"]), torch.tensor(batched["logprobs"]), atol=1e-5)
    capsys.readouterr()
    assert generate_cli.main([*argv, "--inference-max-requests", "0"]) == 2
    assert "--inference-max-requests 0 must be >= 1" in capsys.readouterr().err
    prompts.write_text(json.dumps({"prompt_ids": PROMPT}) + "\n" + '{"text": "no"}\n')
    capsys.readouterr()
    assert generate_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--prompts-file {prompts} line 2: not" in err[0], err


def _edit_config(src: str, dst: pathlib.Path, **changes) -> str:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_a_qwen2_sliding_window_on_no_layer_converts(converted, tmp_path):
    """use_sliding_window=true with max_window_layers at least the layer count windows no layer (transformers:
    full attention everywhere); it was refused whatever max_window_layers said."""
    src = _edit_config(converted["qwen2"][1], tmp_path / "hf", use_sliding_window=True, layer_types=None,
                       max_window_layers=2, sliding_window=3)  # fmt: skip
    out = str(tmp_path / "o")
    assert convert.main(["--loader", "hf", "--saver", "megatron_lite", "--load-dir", src, "--save-dir", out]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    ids = PROMPT + PROMPT  # (longer than the window)
    logits, _ = ours_at(out, ParallelConfig(), ids)
    assert _rel(logits[0, :, :V] if logits.dim() == 3 else logits[:, :V], _hf_logits(hf, ids)) < 1e-5


@pytest.mark.parametrize(
    "name,changes,fragment",
    [
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "'dynamic'"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act"),
        # (layer_types null: transformers derives them, the windowed layers max_window_layers.. here)
        (
            "qwen2",
            {"use_sliding_window": True, "max_window_layers": 1, "layer_types": None, "sliding_window": 4},
            "layer_types",
        ),
        ("gpt2", {"activation_function": "relu"}, "activation_function"),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scaling"),
        # (a class of none of ours; its model_type decides, as in transformers: a llama one listing Gemma is a Llama)
        ("llama", {"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}, "GemmaForCausalLM"),
        # transformers renormalises a top-1 sigmoid weight to 1; Megatron's router (ours) leaves a top-1 alone
        ("deepseek_v3", {"num_experts_per_tok": 1, "n_group": 1, "topk_group": 1}, "num_experts_per_tok=1"),
        ("deepseek_v3", {"norm_topk_prob": False}, "norm_topk_prob=false"),
        # transformers runs the attention latents' norms at 1e-6 whatever rms_norm_eps says
        ("deepseek_v3", {"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),
        # (only the fields the config has: it said topk_method=None of a config without one)
        ("deepseek_v3", {"scoring_func": "softmax"}, "config.json scoring_func='softmax' is not supported"),
    ],
)
def test_unsupported_fields_are_refused(converted, tmp_path, capsys, name, changes, fragment):
    src = _edit_config(converted[name][1], tmp_path / "hf", **changes)
    rc = convert.main(
        ["--loader", "hf", "--saver", "megatron_lite", "--load-dir", src, "--save-dir", str(tmp_path / "o")]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and fragment in err[0], err


@pytest.mark.parametrize(
    "base,changes,fragment",
    [
        ("gpt2", {"qk_layernorm": True}, "q/k norms"),
        ("gpt2", {"sliding_window": 3}, "a sliding window"),
        ("gpt2", {"num_query_groups": 2}, "grouped-query attention"),
        ("gpt2", {"kv_channels": 8}, "--kv-channels 8"),
        ("mixtral", {"moe_router_topk_scaling_factor": 2.5}, "--moe-router-topk-scaling-factor 2.5"),
        ("mixtral", {"moe_router_num_groups": 2, "moe_router_group_topk": 1}, "group-limited routing"),
        ("mixtral", {"add_qkv_bias": True}, "QKV bias"),
        ("qwen2", {"sliding_window": 4}, "a sliding window"),
        ("phi3", {"rope_scaling": RopeScaling()}, "llama3 RoPE scaling"),
        ("phi3", {"rope_scaling": RopeScaling(rope_type="yarn", factor=4.0)}, "yarn RoPE scaling"),
        ("deepseek", {"norm_epsilon": 1e-5}, "--norm-epsilon 1e-05 on the attention latents"),
    ],
)
def test_what_the_hf_class_cannot_compute_is_refused_on_export(base, changes, fragment):
    """Export names what the target class would silently drop (each of these gave other logits in
    transformers, or failed to load there), and passes the same model without it."""
    from megatron_lite.config import ConfigError
    from megatron_lite.models.hf import _architecture, hf_config_dict

    from models import deepseek_config, gpt2_config, llama_config

    make, arch = {
        "gpt2": (gpt2_config, "GPT2LMHeadModel"),
        "mixtral": (lambda **kw: llama_config(num_experts=4, moe_router_topk=2, **kw), "MixtralForCausalLM"),
        "qwen2": (lambda **kw: llama_config(add_qkv_bias=True, **kw), "Qwen2ForCausalLM"),
        "phi3": (lambda **kw: llama_config(rotary_percent=0.5, **kw), "Phi3ForCausalLM"),
        "deepseek": (deepseek_config, "DeepseekV3ForCausalLM"),
    }[base]
    clean = make()
    hf_config_dict(clean, _architecture(clean))  # the model without the feature exports
    model = make(**changes)
    assert _architecture(model) == arch
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        hf_config_dict(model, arch)


def test_exporting_a_trained_model_no_hf_class_computes_is_one_line(tmp_path, capsys, monkeypatch):
    """A GPT-2-shaped model trained with --disable-bias-linear: the export's refusal came after the weights were
    mapped, so a missing bias was a KeyError traceback instead of the line that says why. generate.py's
    refusals name its own flags (they named --seq-length, --max-position-embeddings and --num-layers)."""
    from megatron_lite.training.pretrain import main as pretrain_main

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    flags = "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 1 "
    flags += "--global-batch-size 1 --train-iters 1 --lr 1e-3 --eval-iters 0 --mock-data --vocab-size 128"
    assert pretrain_main([*flags.split(), "--disable-bias-linear", "--save", str(tmp_path / "ours")]) == 0
    capsys.readouterr()
    args = ["--loader", "megatron_lite", "--saver", "hf", "--load-dir", str(tmp_path / "ours")]
    assert convert.main([*args, "--save-dir", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: cannot export to GPT2LMHeadModel: GPT-2 needs biases (drop --disable-bias-linear)", err
    ids = ["--load", str(tmp_path / "ours"), "--prompt-ids", ",".join(["5"] * 12)]
    # the last token generated is never fed back: 12 + 5 tokens take 16 positions, all there are (transformers
    # generates them; 5 was refused here)
    assert generate_cli.main([*ids, "--max-new-tokens", "5", "--greedy"]) == 0
    capsys.readouterr()
    for extra, expected in (
        (["--max-new-tokens", "8"], "the prompt's 12 tokens and --max-new-tokens 8 exceed the checkpoint's 16 learned"),
        (
            ["--pipeline-model-parallel-size", "3", "--max-new-tokens", "2"],
            "layers do not split evenly over --pipeline-model-parallel-size 3",
        ),
    ):
        assert generate_cli.main([*ids, *extra]) == 2
        err = capsys.readouterr().err
        assert expected in err and "--seq-length" not in err and "--num-layers" not in err, err


def test_exporting_a_model_trained_with_a_capacity_factor_says_transformers_drops_nothing(
    tmp_path, capsys, monkeypatch
):
    """Our router drops the tokens over an expert's capacity in evaluation too, as Megatron's; Mixtral never does,
    so the export's logits differ where a batch overflows (1e-2 relative at factor 1): the export says so."""
    from megatron_lite.training.pretrain import main as pretrain_main

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    flags = "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 1 "
    flags += "--global-batch-size 1 --train-iters 1 --lr 1e-3 --eval-iters 0 --mock-data --vocab-size 128 "
    flags += "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear "
    flags += "--untie-embeddings-and-output-weights --num-experts 4 --moe-router-topk 2"
    for factor in (None, "1.0"):
        extra = [] if factor is None else ["--moe-expert-capacity-factor", factor]
        assert pretrain_main([*flags.split(), *extra, "--save", str(tmp_path / f"ours{factor}")]) == 0
        capsys.readouterr()
        args = ["--loader", "megatron_lite", "--saver", "hf", "--load-dir", str(tmp_path / f"ours{factor}")]
        assert convert.main([*args, "--save-dir", str(tmp_path / f"hf{factor}")]) == 0
        out = capsys.readouterr()
        noted = "MixtralForCausalLM never drops tokens" in out.out + out.err
        assert noted == (factor is not None), out


def test_every_norm_is_exported_as_gamma_under_layernorm_1p():
    """--apply-layernorm-1p stores gamma - 1; a Hugging Face DeepSeek holds gamma in every norm, MTP's enorm and
    hnorm included (they had been written as gamma - 1, zeros at init)."""
    from megatron_lite.models.hf_weights import state_dict_to_hf

    from models import deepseek_config, perturbed_full_state

    config = deepseek_config(mtp_num_layers=1, apply_layernorm_1p=True)
    ours = perturbed_full_state(config)
    hf = state_dict_to_hf(ours, config, "DeepseekV3ForCausalLM")
    n = config.num_layers
    for our_key, hf_key in (
        ("mtp.layers.0.enorm.weight", f"model.layers.{n}.enorm.weight"),
        ("mtp.layers.0.hnorm.weight", f"model.layers.{n}.hnorm.weight"),
        ("mtp.layers.0.final_layernorm.weight", f"model.layers.{n}.shared_head.norm.weight"),
        ("decoder.layers.0.self_attention.kv_layernorm.weight", "model.layers.0.self_attn.kv_a_layernorm.weight"),
        ("decoder.final_layernorm.weight", "model.norm.weight"),
    ):
        torch.testing.assert_close(hf[hf_key], ours[our_key] + 1, msg=hf_key)


def test_phi3_export_loads_in_transformers_without_a_base_config():
    """Without the config.json the weights came with, Phi-3's class default pad_token_id (32000) lay past a
    smaller vocabulary and transformers refused to build the model."""
    from megatron_lite.models.hf import _architecture, hf_config_dict

    from models import llama_config

    config = llama_config(rotary_percent=0.5)
    assert config.vocab_size < 32000
    out = hf_config_dict(config, _architecture(config))
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**out))
    assert model.model.embed_tokens.num_embeddings == config.vocab_size


def test_an_export_replaces_the_weights_of_an_earlier_one(monkeypatch, tmp_path):
    """Exporting into a directory that holds an earlier export leaves only the new weights: a stale
    model.safetensors beside a new index (or stale shards beside a new single file) would be read by
    transformers and by us differently."""
    from safetensors.torch import load_file

    from megatron_lite.checkpoint import hf_convert, hf_files

    out = str(tmp_path / "hf")
    a, b = {"w": torch.zeros(64, 64), "v": torch.zeros(64)}, {"w": torch.ones(64, 64), "v": torch.ones(64)}
    hf_convert.write_hf_dir(out, a, {"a": 1}, [])
    monkeypatch.setattr(hf_files, "SHARD_BYTES", 1024)  # B in shards, as a model over 5 GiB is
    hf_convert.write_hf_dir(out, b, {"b": 1}, [])
    files = sorted(os.listdir(out))
    assert "model.safetensors" not in files and "model.safetensors.index.json" in files, files
    assert torch.equal(hf_convert.read_hf_tensors(out)["w"], b["w"])
    monkeypatch.setattr(hf_files, "SHARD_BYTES", 5 << 30)
    hf_convert.write_hf_dir(out, a, {"a": 1}, [])  # and back to one file: no shard or index left over
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert torch.equal(load_file(os.path.join(out, "model.safetensors"))["w"], a["w"])


def test_generate_from_text_encodes_and_stops_as_transformers(tmp_path):
    """generate.py --prompt on a converted Llama whose tokenizer's post-processor adds <|begin_of_text|>: the
    prompt is encoded as transformers encodes it (BOS included; without it the model continued another prompt)
    and generation stops at the tokenizer's eos_token, as transformers' generate does."""
    from test_preprocess import _llama3_style_folder

    tok_dir = tmp_path / "tok"
    _llama3_style_folder(tok_dir, "w6")  # (an end token this random model does emit, so greedy has a stop)
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=8, eos_token_id=6, initializer_range=0.5)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    args = ["--loader", "hf", "--saver", "megatron_lite", "--load-dir", str(tmp_path / "hf")]
    assert convert.main([*args, "--save-dir", str(tmp_path / "ours")]) == 0
    text, out = "w1 w2 w3", tmp_path / "o.json"
    argv = ["--load", str(tmp_path / "ours"), "--prompt", text, "--max-new-tokens", "20", "--greedy"]
    assert generate_cli.main([*argv, "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    enc = tok(text, return_tensors="pt")
    hf = model.generate(**enc, max_new_tokens=20, do_sample=False, pad_token_id=0)[0, enc.input_ids.shape[1] :]
    assert r["prompt_ids"] == enc.input_ids[0].tolist() == [8, 1, 2, 3]
    assert r["generated_ids"] == hf.tolist() and hf.tolist()[-1] == 6 and len(hf) < 20, (r["generated_ids"], hf)
    # generation_config.json's end tokens (Llama-3-Instruct's two): generation stopped at the tokenizer's alone.
    # The checkpoint moved elsewhere still finds its tokenizer in its hf/ (the recorded absolute path is gone).
    toks = hf.tolist()
    at = next(i for i in range(1, len(toks)) if toks[i] != 6 and toks[i] not in toks[:i])
    end = toks[at]
    gen = json.loads((tmp_path / "ours" / "hf" / "generation_config.json").read_text())
    (tmp_path / "ours" / "hf" / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [6, end]}))
    (tmp_path / "ours").rename(tmp_path / "moved")
    argv[1] = str(tmp_path / "moved")
    assert generate_cli.main([*argv, "--output-json", str(out)]) == 0
    ended = model.generate(**enc, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=[6, end])
    assert json.loads(out.read_text())["generated_ids"] == ended[0, 4:].tolist() == toks[: at + 1]


def test_pickled_weights_are_refused(converted, tmp_path, capsys):
    src = _edit_config(converted["llama"][1], tmp_path / "hf")
    os.remove(os.path.join(src, "model.safetensors"))
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    rc = convert.main(
        ["--loader", "hf", "--saver", "megatron_lite", "--load-dir", src, "--save-dir", str(tmp_path / "o")]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "pickled" in err and "safetensors" in err


def test_help_lists_every_architecture_that_converts(converted, capsys):
    """--help's list is the converter's own (it had left out both DeepSeek architectures)."""
    with pytest.raises(SystemExit):
        convert.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for model, *_ in converted.values():
        assert type(model).__name__ in text, type(model).__name__


def test_an_hf_directory_given_as_our_checkpoint_names_the_tools_flag(converted, tmp_path, capsys):
    """--loader megatron_lite --load-dir <a Hugging Face directory>: the line names --load-dir and what to give
    (it named --load and advised an empty directory "to start from scratch")."""
    hf_dir = converted["llama"][1]
    rc = convert.main(["--loader", "megatron_lite", "--saver", "hf", "--load-dir", hf_dir, "--save-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and f"--load-dir {hf_dir} is not a megatron_lite checkpoint directory" in err, err
    assert "--load " not in err and "scratch" not in err


@pytest.mark.parametrize("model_type", list(HF_DEFAULTS))
def test_defaults_without_transformers_match_transformers(model_type):
    """The fallback defaults (used when transformers is not installed) are transformers' class defaults."""
    cls = getattr(transformers, MODEL_TYPES_CLASSES[model_type])
    defaults = cls().to_dict()
    rope = defaults.get("rope_parameters") or {}
    legacy = {
        "rope_theta": rope.get("rope_theta", defaults.get("rope_theta")),
        "partial_rotary_factor": rope.get("partial_rotary_factor", defaults.get("partial_rotary_factor", 1.0)),
    }
    for field, value in HF_DEFAULTS[model_type].items():
        got = legacy[field] if field in legacy else defaults.get(field, getattr(cls(), field, None))
        assert got == value, (model_type, field, got, value)


@pytest.mark.parametrize("drop", [None, "original_max_position_embeddings"])
def test_the_config_read_without_transformers_is_the_one_read_with_it(converted, tmp_path, drop):
    """Every converted model's config.json, as written by transformers' save_pretrained, read by the fallback
    (no transformers installed) gives the model transformers' reading gives. transformers 5 writes Qwen3-MoE's
    expert count as num_local_experts, which the fallback read as its default 128; and a RoPE scaling without
    its original length (transformers takes max_position_embeddings) was a traceback."""
    from megatron_lite.checkpoint.hf_convert import _fallback_config
    from megatron_lite.models.hf import config_from_hf

    for name, (_, hf_dir, _, _) in converted.items():
        raw = json.loads((pathlib.Path(hf_dir) / "config.json").read_text())
        if drop is not None:
            scaling = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
            if drop not in scaling:
                continue
            del scaling[drop]
            hf_dir = str(tmp_path / name)
            os.makedirs(hf_dir)
            (pathlib.Path(hf_dir) / "config.json").write_text(json.dumps(raw))
        ours = config_from_hf(_fallback_config(raw))
        assert ours == config_from_hf(transformers.AutoConfig.from_pretrained(hf_dir)), name


def test_converted_checkpoint_continues_pretraining(converted, capsys, monkeypatch, tmp_path):
    from megatron_lite.training.pretrain import main

    _, _, ours, _ = converted["qwen2"]
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    argv = ["--load", ours, "--mock-data", "--vocab-size", "100", "--train-iters", "3", "--seq-length", "16"]
    argv += ["--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3", "--log-interval", "1"]
    argv += ["--eval-iters", "0", "--save", str(tmp_path / "ft")]
    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "iteration 0" in out.out and "using 250" in out.out and "iteration        3/       3 |" in out.out
    # ... and the result converts back to a model transformers loads.
    assert (
        convert.main(
            [
                "--loader",
                "megatron_lite",
                "--saver",
                "hf",
                "--load-dir",
                str(tmp_path / "ft"),
                "--save-dir",
                str(tmp_path / "hf"),
            ]
        )
        == 0
    )
    assert transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")) is not None


def test_scripts_run_as_scripts():
    """Run as `python tools/checkpoint/convert.py`, a script's folder comes first on sys.path, so a file there
    named like a standard-library module shadows it for torch too (tools/checkpoint/inspect.py did: every
    README convert command failed at import while the tests, loading the module by path, passed)."""
    scripts = [p for d in ("tools", "pretrain") for p in (ROOT / d).rglob("*.py")]
    assert not [p for p in scripts if p.stem in sys.stdlib_module_names]
    run = [sys.executable, str(ROOT / "tools" / "checkpoint" / "convert.py"), "--help"]
    out = subprocess.run(run, capture_output=True, text=True, cwd=ROOT / "tools" / "checkpoint")
    assert out.returncode == 0 and "--saver" in out.stdout, out.stderr[-2000:]


def test_inspect(converted, tmp_path):
    _, _, ours, _ = converted["mixtral"]
    run = [sys.executable, str(ROOT / "tools" / "checkpoint" / "inspect_checkpoint.py"), ours, "--verify"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for fragment in (
        "iteration    0",
        "saved under  1 process(es)\n",
        "converted    from MixtralForCausalLM at ",
        "training     none: converted weights",  # (not a conversion's placeholder settings, as if trained)
        "num_experts=4",
        ", softmax router",  # (the router's kind: sigmoid with an expert bias for DeepSeek-V3's)
        "sliding_window=10",
        "in 1 file (checksums verified)",
    ):
        assert fragment in out.stdout, (fragment, out.stdout)
    # piped into head: the tool's output cut short is no traceback
    piped = subprocess.run(" ".join(run[:-1]) + " | head -n 1", shell=True, capture_output=True, text=True)
    assert piped.stdout.startswith("checkpoint") and "Traceback" not in piped.stderr, piped.stderr
    line = next(x for x in out.stdout.splitlines() if "model/decoder.layers.1.mlp.experts.3.linear_fc1.weight" in x)
    assert line.split()[1:4] == ["[96,", "64]", "float32"], line
    d = json.loads(subprocess.run([*run, "--json"], capture_output=True, text=True, timeout=120).stdout)
    assert d["parameters"] == sum(p.numel() for p in converted["mixtral"][0].parameters())
    assert d["total_bytes"] == sum(f.stat().st_size for f in pathlib.Path(ours).rglob("tensors_*.safetensors"))


def test_bad_tool_flags_are_one_line(capsys):
    """The tools' flag errors are one line, as pretrain_gpt.py's are."""
    for tool, argv in ((convert, ["--loader", "x"]), (generate_cli, ["--load", "c", "--bogus", "1"])):
        with pytest.raises(SystemExit) as e:
            tool.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
        assert "--help lists the flags" in err[0]


def test_hf_loads_convert_only_to_megatron_lite(tmp_path, capsys):
    """--loader hf with --saver hf-peft wrote a megatron_lite checkpoint (every HF load went the one way)."""
    args = ["--loader", "hf", "--saver", "hf-peft", "--load-dir", str(tmp_path / "in")]
    args += ["--save-dir", str(tmp_path / "o")]
    assert convert.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--loader hf converts to --saver megatron_lite, not hf-peft" in err[0], err
    assert not (tmp_path / "o").exists()
    # (from a review: --merge-lora beside another saver or loader exited 0 and folded nothing)
    for loader, saver in (("megatron_lite", "hf-peft"), ("hf", "megatron_lite")):
        argv = ["--loader", loader, "--saver", saver, "--merge-lora", "--load-dir", "in", "--save-dir", "o"]
        assert convert.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--merge-lora folds LoRA adapters into the weights --saver hf writes" in err[0]


def test_a_deepseek_v3_model_type_transformers_does_not_know_converts(converted, tmp_path):
    """Kimi-K2 ships DeepseekV3ForCausalLM weights under model_type "kimi_k2" (remote code transformers cannot
    load): its config.json is read over DeepSeek-V3's defaults, and the weights convert as DeepSeek-V3's."""
    import json
    import shutil

    _, hf_dir, ours, _ = converted["deepseek_v3"]
    kimi = tmp_path / "kimi"
    shutil.copytree(hf_dir, kimi)
    cfg = json.loads((kimi / "config.json").read_text())
    cfg["model_type"] = "kimi_k2"
    (kimi / "config.json").write_text(json.dumps(cfg))
    out = str(tmp_path / "kimi_ours")
    assert convert.main(["--loader", "hf", "--saver", "megatron_lite", "--load-dir", str(kimi), "--save-dir", out]) == 0
    a, b = (_checkpoint_tensors(d) for d in (ours, out))
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _checkpoint_tensors(ckpt: str) -> dict:
    """Every tensor of our checkpoint directory (its safetensors files, wherever they sit)."""
    out = {}
    for f in sorted(pathlib.Path(ckpt).rglob("*.safetensors")):
        if "/hf/" in str(f):
            continue
        with safe_open(str(f), framework="pt") as h:
            out.update({f"{f.name}:{k}": h.get_tensor(k) for k in h.keys()})
    return out


def test_mla_kv_cache_holds_the_latents(converted):
    """Decoding with multi-latent attention caches each token's key/value latent and RoPE key part (as
    transformers does), not every head's keys and values; generation through it equals transformers' (the TP=2
    and PP=2 tests above)."""
    import dataclasses

    from megatron_lite.checkpoint.checkpointing import find_checkpoint, load_checkpoint, read_metadata
    from megatron_lite.checkpoint.hf_convert import model_config_from_dict
    from megatron_lite.inference.generation import _forward
    from megatron_lite.inference.kv_cache import KVCache
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    model, _, ours, _ = converted["deepseek_v3"]
    path = find_checkpoint(ours)
    config = dataclasses.replace(model_config_from_dict(read_metadata(path)["config"]["model"]), hidden_dropout=0.0)
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    ours_model = build_model(config, ctx)
    load_checkpoint(path, ours_model, None, None, ctx, load_rng=False)
    ours_model.eval()
    cache = KVCache(len(PROMPT))
    with torch.no_grad():
        logits = _forward(ours_model, ctx, PROMPT, cache, every=True)
    assert _rel(logits, _hf_logits(model, PROMPT)) < 1e-4
    for latents, k_pe in cache._store.values():
        assert latents.shape[2:] == (1, config.kv_lora_rank) and k_pe.shape[2:] == (1, config.qk_pos_emb_head_dim)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (1, 1.0), (7, 0.8), (0, 0.7), (40, 0.9)])
def test_sampling_keeps_what_transformers_keeps(top_k, top_p):
    """temperature, then top-k (ties with the k-th kept), then top-p over what is left: the distribution equals
    softmax of the scores transformers' warpers leave, in that order, on 200 random rows (with ties for top-k)."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from megatron_lite.inference.generation import SamplingConfig, sampling_distribution

    gen = torch.Generator().manual_seed(top_k)
    config = SamplingConfig(greedy=False, temperature=0.7, top_p=top_p, top_k=top_k)
    warpers = [TemperatureLogitsWarper(0.7)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    for row in range(200):
        logits = torch.randn(50, generator=gen, dtype=torch.float64) * 3
        if row % 4 == 0 and top_p == 1:  # ties, at the k-th value too (at top-p's edge which tie stays is arbitrary)
            logits = logits.round()
        scores = logits.unsqueeze(0)
        for w in warpers:
            scores = w(None, scores)
        expected = torch.softmax(scores[0], -1)
        torch.testing.assert_close(sampling_distribution(logits, config), expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "parallel,fragment",
    [
        (dict(context_parallel_size=2), "--context-parallel-size 2"),
        (dict(tensor_model_parallel_size=2, sequence_parallel=True), "--sequence-parallel"),
    ],
)
def test_generation_refuses_cp_and_sp(parallel, fragment):
    """Under CP the prompt and cache were read as each rank's zigzag shard (other tokens, rank by rank): a
    one-line refusal before any step, as under SP."""
    from megatron_lite.inference.generation import SamplingConfig, generate
    from megatron_lite.parallel_context import ParallelContext

    ctx = ParallelContext.virtual(ParallelConfig(**parallel), world_size=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=re.escape(fragment)):
        generate([], ctx, PROMPT, 2)  # (refused before the model is touched)
    with pytest.raises(ValueError, match="--temperature nan"):
        SamplingConfig(greedy=False, temperature=float("nan"))


def test_a_model_type_transformers_does_not_know_is_refused_for_other_classes(converted, tmp_path, capsys):
    """The config fallback is for DeepSeek classes under an unknown type (Kimi-K2) only; otherwise one line."""
    src = _edit_config(converted["llama"][1], tmp_path / "hf", model_type="not_a_llama")
    rc = convert.main(["--loader", "hf", "--saver", "megatron_lite", "--load-dir", src, "--save-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "transformers cannot read it" in err[0], err


def test_a_deepseek_v3_keeping_rotate_half_rope_rows_round_trips_bit_exact(tmp_path):
    """rope_interleave=false (RoPE rows already rotate-half, as ours): the export wrote them interleaved with
    rope_interleave=true (the same logits, other tensors); the checkpoint review found HF -> ours -> HF not
    bit-exact there. Now written back as they came."""
    cfg = transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
        v_head_dim=10, first_k_dense_replace=2, rope_interleave=False, **COMMON,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    hf_dir, ours, back = (str(tmp_path / k) for k in ("hf", "ours", "back"))
    model.save_pretrained(hf_dir)
    assert convert.main(["--loader", "hf", "--saver", "megatron_lite", "--load-dir", hf_dir, "--save-dir", ours]) == 0
    assert convert.main(["--loader", "megatron_lite", "--saver", "hf", "--load-dir", ours, "--save-dir", back]) == 0
    a, b = _tensors(hf_dir), _tensors(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    assert reloaded.config.rope_interleave is False
    assert torch.equal(_hf_logits(reloaded, PROMPT), _hf_logits(model, PROMPT))


def test_generation_says_which_generation_config_settings_it_does_not_apply(converted, tmp_path, capsys):
    """From a generation review: a model's generation_config.json with repetition_penalty 1.5 (or sampling
    defaults) made transformers' generate() give other tokens than ours, without a word; its eos ids are read,
    the rest is now named once."""
    import shutil

    _, _, ours, _ = converted["llama"]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ours, ckpt)
    side = ckpt / "hf" / "generation_config.json"
    base = json.loads(side.read_text()) if side.exists() else {}
    argv = ["--load", str(ckpt), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "2", "--greedy"]
    side.write_text(json.dumps({**base, "eos_token_id": 3, "transformers_version": "5", "temperature": 0.6}))
    assert generate_cli.main(argv) == 0
    # (ids alone, and a temperature without do_sample, which transformers' greedy search ignores: nothing to say)
    assert "generation_config.json also sets" not in capsys.readouterr().err
    side.write_text(json.dumps({**base, "eos_token_id": 3, "repetition_penalty": 1.5, "do_sample": True}))
    assert generate_cli.main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("generation_config.json also sets do_sample=True, repetition_penalty=1.5, which") == 1, err
