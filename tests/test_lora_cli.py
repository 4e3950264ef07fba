"""LoRA fine-tuning end to end, as a user runs it: a tiny Llama (and a tiny Mixtral) from transformers converted
to megatron_lite, fine-tuned with `pretrain_gpt.py --finetune --lora-rank 4 --sft` on prompt/response JSONL
(loss on responses only) at TP=2 (Mixtral: EP=2, adapters on its experts too), exported with
`convert.py --saver hf-peft`; PEFT on the Hugging
Face base gives the logits of our fine-tuned model (fp32, 1e-4), and `--merge-lora` writes full weights
that give them too."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from test_pretrain_torchrun import ROOT

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow

WORDS = [f"w{i}" for i in range(120)]


def _tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<|endoftext|>", "[UNK]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def _tool(path: str):
    spec = importlib.util.spec_from_file_location(path.replace("/", "_")[:-3], ROOT / path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _convert(*args: str) -> None:
    assert _tool("tools/checkpoint/convert.py").main(list(args)) == 0


CASES = {
    # dense: adapters on every projection, at TP=2 with sequence parallelism
    "llama": (
        lambda: transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False),
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ),
    # mixture of experts: adapters on q, k, v and every routed expert, experts split over EP=2
    "mixtral": (
        lambda: transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                           num_experts_per_tok=2, tie_word_embeddings=False),
        ["--expert-model-parallel-size", "2", "--lora-target-modules", "q_proj", "k_proj", "v_proj", "experts"],
    ),
    # DeepSeek-V3 whose config.json keeps its RoPE rows rotate-half (rope_interleave false), as ours: the adapters'
    # B rows were still put in DeepSeek's interleaved order, onto that base (PEFT 1.9e-2 off; the merge was right)
    "deepseek_rotate_half": (
        lambda: transformers.DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=96,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                              q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
                                              v_head_dim=10, first_k_dense_replace=2, rope_interleave=False,
                                              tie_word_embeddings=False),
        ["--lora-target-modules", "linear_qkv"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("arch", list(CASES))
def test_lora_fine_tune_export_and_load_in_peft(tmp_path, arch, pretrain_job):
    hf_dir, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "lora"
    make_config, layout = CASES[arch]
    hf_class = transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    hf_class.from_config(make_config()).save_pretrained(hf_dir, safe_serialization=True)
    _tokenizer(hf_dir / "tokenizer.json")
    _convert("--loader", "hf", "--saver", "megatron_lite", "--load-dir", str(hf_dir), "--save-dir", str(ckpt))
    gen = torch.Generator().manual_seed(1)
    with open(tmp_path / "sft.jsonl", "w") as f:
        for _ in range(40):
            words = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (12,), generator=gen)]
            f.write(json.dumps({"prompt": " ".join(words[:5]), "response": " ".join(words[5:])}) + "\n")
    args = [
        "--load", str(ckpt), "--finetune", "--save", str(out), "--lora-rank", "4", "--lora-alpha", "8",
        "--sft", "--data-path", str(tmp_path / "sft.jsonl"), "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", str(hf_dir / "tokenizer.json"), "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "4", "--lr", "2e-2", "--lr-decay-style", "constant",
        "--log-interval", "1", "--eval-iters", "0", "--distributed-backend", "gloo", *layout,
    ]  # fmt: skip
    run = pretrain_job(2, args)
    assert "LoRA rank 4" in run and "the base frozen" in run
    _convert("--loader", "megatron_lite", "--saver", "hf-peft", "--load-dir", str(out), "--save-dir",
             str(tmp_path / "adapter"))  # fmt: skip
    _convert("--loader", "megatron_lite", "--saver", "hf", "--merge-lora", "--load-dir", str(out), "--save-dir",
             str(tmp_path / "merged"))  # fmt: skip

    # our fine-tuned model, one process, from the checkpoint the two-process job wrote
    from megatron_lite.checkpoint.hf_convert import model_config_from_dict, read_model_tensors, saved_lora_config
    from megatron_lite.config import ParallelConfig
    from megatron_lite.lora.apply import apply_lora
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    meta, tensors = read_model_tensors(str(out))
    config = model_config_from_dict(meta["config"]["model"])
    lora = saved_lora_config(meta["config"])
    assert ("experts" in lora.target_modules) == (arch == "mixtral")
    model = build_model(config, ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu")), seed=1)
    apply_lora(model, config, lora, ParallelContext.virtual(ParallelConfig()), seed=0)
    model[0].load_full_state_dict(tensors)
    model.eval()
    ids = torch.randint(2, 122, (2, 16), generator=gen)
    with torch.no_grad():
        ours = model(ids)[..., :128]
        base = hf_class.from_pretrained(hf_dir).eval()
        with_adapter = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        assert (with_adapter(ids).logits - ours).abs().max() < 1e-4
        with with_adapter.disable_adapter():
            assert (with_adapter(ids).logits - ours).abs().max() > 1e-3  # fine-tuning changed the model
        merged = hf_class.from_pretrained(tmp_path / "merged").eval()
        assert (merged(ids).logits - ours).abs().max() < 1e-4
        # tools/generate.py on the LoRA checkpoint generates from base + adapters (it once read the base alone)
        prompt = [int(i) for i in ids[0, :6]]
        expected = with_adapter.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, 6:].tolist()
    out_json = tmp_path / "gen.json"
    argv = ["--load", str(out), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "6", "--greedy",
            "--output-json", str(out_json)]  # fmt: skip
    assert _tool("tools/generate.py").main(argv) == 0
    assert json.loads(out_json.read_text())["generated_ids"] == expected
    # the checkpoint holds the adapters alone (and their Adam moments) and names the base they were trained on,
    # whose weights training left untouched
    from safetensors import safe_open

    from megatron_lite.checkpoint.checkpointing import find_checkpoint

    path = find_checkpoint(str(out))
    keys = [k for f in sorted(os.listdir(path)) if f.startswith("tensors_") and f.endswith(".safetensors")
            for k in safe_open(os.path.join(path, f), "pt").keys()]  # fmt: skip
    assert keys and all(".lora." in k for k in keys), [k for k in keys if ".lora." not in k][:5]
    assert lora.base == find_checkpoint(str(ckpt))
    base_ckpt = read_model_tensors(str(ckpt))[1]
    assert all(torch.equal(tensors[k], v) for k, v in base_ckpt.items())


def test_qlora_from_the_command_line(tmp_path, pretrain_job):
    """--qlora on one process: the adapted layers' weights go to NF4 after the base loads, training runs,
    and the memory breakdown counts the NF4 storage as the parameters' bytes."""
    args = [
        "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
        "--mock-data", "--vocab-size", "100", "--normalization", "RMSNorm", "--swiglu",
        "--position-embedding-type", "rope", "--disable-bias-linear", "--lora-rank", "4", "--qlora",
        "--log-interval", "1", "--eval-iters", "0", "--log-memory-breakdown", "--log-jsonl", str(tmp_path / "q.jsonl"),
    ]  # fmt: skip
    out = pretrain_job(1, args)
    assert "QLoRA:" in out and "bits per parameter" in out
    rec = [json.loads(line) for line in open(tmp_path / "q.jsonl") if "lm_loss" in line][-1]
    h, f, r = 128, 256, 4  # adapters: r (in + out) per projection; q, k, v, o, gate, up, down
    adapters = 2 * (r * (3 * (h + h)) + r * (h + h) + 2 * r * (h + f) + r * (f + h))
    assert rec["mem_optimizer_bytes"] == 8 * adapters  # Adam moments of the adapters only (fp32 weights)


def test_lora_start_up_names_the_projections_it_adapts(pretrain_job):
    """From a review: PEFT's `q_proj v_proj` were logged (and trained) as linear_qkv, k included; on an all-MoE
    model the default dense-MLP targets adapt nothing, yet the log listed them."""
    base = [
        "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "96",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
        "--mock-data", "--vocab-size", "100", "--swiglu", "--disable-bias-linear", "--position-embedding-type",
        "rope", "--lora-rank", "4", "--eval-iters", "0",
    ]  # fmt: skip
    out = pretrain_job(1, [*base, "--lora-target-modules", "q_proj", "v_proj"])
    h, q, kv = 64, 64, 64  # (4 heads, no GQA) r (in + out) per adapter: q and v only
    assert f"on linear_q linear_v: {4 * ((h + q) + (h + kv)) / 1e6:.3f}M trainable" in out, out[-2000:]
    out = pretrain_job(1, [*base, "--num-experts", "2", "--moe-ffn-hidden-size", "32"])
    assert "on linear_qkv linear_proj: " in out and "(linear_fc1 linear_fc2: no layer has a dense MLP" in out


def test_qlora_names_every_stages_shards_quantised_on_their_own(pretrain_job):
    """TP=2 x PP=2: the first stage's dense linear_fc2 (96 / 2 = 48 columns, not whole 64-value blocks) is
    quantised per shard; start-up names it although the logging rank (the last stage, whose experts' shards are
    whole blocks) quantised none that way."""
    args = [
        "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--ffn-hidden-size", "96",
        "--num-experts", "4", "--moe-layer-freq", "[0,1]", "--moe-ffn-hidden-size", "128", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1", "--mock-data",
        "--vocab-size", "100", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--lora-rank", "4", "--qlora",
        "--lora-target-modules", "linear_fc2", "experts", "--eval-iters", "0",
    ]  # fmt: skip
    out = pretrain_job(4, args)
    assert "QLoRA: 1 weights (stage 0 0.decoder.layers.0.mlp.linear_fc2.weight, ...) quantised per" in out, out[-3000:]


def test_qlora_resumes_exactly_and_merges_onto_its_base(tmp_path, pretrain_job):
    """A QLoRA checkpoint holds the adapters and records its base: a job started again (auto-resume) loads the
    base, quantises it, loads the adapters and continues exactly; --merge-lora folds the adapters into the
    unquantised base."""
    model = [
        "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--mock-data",
        "--vocab-size", "100", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--log-interval", "1", "--eval-iters", "0", "--lr", "1e-2",
        "--lr-decay-style", "constant",
    ]  # fmt: skip

    def run(*extra, env=None):
        return pretrain_job(1, [*model, *extra], env=env)

    run("--train-iters", "1", "--save", str(tmp_path / "base"))
    lora = ["--load", str(tmp_path / "base"), "--finetune", "--lora-rank", "4", "--qlora", "--train-iters", "4"]
    run(*lora, "--save", str(tmp_path / "q"), "--exit-interval", "2", "--log-jsonl", str(tmp_path / "a.jsonl"))
    run(*lora, "--save", str(tmp_path / "straight"), "--log-jsonl", str(tmp_path / "s.jsonl"))
    # a rollback reads the job's own adapters-only checkpoint onto the quantised base
    nan = {"MEGATRON_LITE_INJECT_FAULT": "nan,rank=0,iteration=3"}
    rolled = run(*lora, "--save", str(tmp_path / "rb"), "--save-interval", "2", "--nan-policy", "rollback", env=nan)
    assert f"rolled back to {tmp_path / 'rb'}/iter_0000002: iteration 2" in rolled, rolled[-3000:]
    # the base goes on training meanwhile: the adapters resume on the iteration they were trained on, not the newest
    run("--train-iters", "2", "--load", str(tmp_path / "base"), "--save", str(tmp_path / "base"))
    resumed = run(*lora, "--save", str(tmp_path / "q"), "--log-jsonl", str(tmp_path / "b.jsonl"))
    assert "loaded the LoRA base" in resumed and "iter_0000001" in resumed and "iteration 2" in resumed

    def losses(name):
        return {r["iteration"]: r["lm_loss"] for r in map(json.loads, open(tmp_path / name)) if "lm_loss" in r}

    straight, first, second = losses("s.jsonl"), losses("a.jsonl"), losses("b.jsonl")
    assert [first[1], first[2], second[3], second[4]] == [straight[i] for i in (1, 2, 3, 4)]
    _convert("--loader", "megatron_lite", "--saver", "hf", "--merge-lora", "--load-dir", str(tmp_path / "q"),
             "--save-dir", str(tmp_path / "merged"))  # fmt: skip
    assert (tmp_path / "merged" / "config.json").exists()
    # generation from the QLoRA checkpoint runs its adapters on its recorded base in NF4, not the bare base
    logprobs = {}
    for name in ("base", "q"):
        argv = ["--load", str(tmp_path / name), "--prompt-ids", "5,17,33,2,9", "--max-new-tokens", "3", "--greedy",
                "--output-json", str(tmp_path / f"{name}.json")]  # fmt: skip
        assert _tool("tools/generate.py").main(argv) == 0
        logprobs[name] = json.loads((tmp_path / f"{name}.json").read_text())["prompt_logprobs"]
    assert max(abs(a - b) for a, b in zip(logprobs["base"], logprobs["q"])) > 1e-3
