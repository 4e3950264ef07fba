"""Generation for hybrid Mamba models (Nemotron-H): the prompt's chunked scan leaves each Mamba layer's conv window and
SSM state in the cache, and each decoding step runs the one-token recurrence on them. Greedy and sampled tokens
equal those of the same model recomputing the whole sequence at every step (no cache); a converted transformers
NemotronHForCausalLM's generate(do_sample=False) gives the same tokens and per-step logits (tools/generate.py too);
a batch of prompts of different lengths gives each prompt's own result; TP=2, PP=2 and two virtual stages a rank give
one process's."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from convert_flow import randomised
from test_convert import convert, generate_cli
from test_convert_nemotron_h import _config as _hf_config

from megatron_lite.config import ParallelConfig
from megatron_lite.inference.generation import SamplingConfig, _forward_batch, generate, generate_batch
from megatron_lite.inference.generation import sampling_distribution as _distribution
from megatron_lite.inference.kv_cache import KVCache
from megatron_lite.models.gpt_model import build_model
from megatron_lite.parallel_context import ParallelContext

from models import llama_config, perturbed_full_state, rel

PROMPT, NEW = [5, 17, 33, 2, 90, 41, 7], 8
SAMPLED = SamplingConfig(greedy=False, temperature=1.2, seed=5)


def _config():
    """Mamba, attention, Mamba, MLP, at odd sizes: 6 Mamba heads of 5 dims in 2 groups of state 3, 4 attention heads
    of 9 dims, no positions (as Nemotron-H)."""
    return llama_config(
        num_layers=4,
        hybrid_override_pattern="M*M-",
        hidden_size=36,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=20,
        activation="squared_relu",
        position_embedding_type="none",
        mamba_num_heads=6,
        mamba_head_dim=5,
        mamba_state_dim=3,
        mamba_num_groups=2,
    )


def _model(ctx: ParallelContext | None = None):
    """The same weights under any layout: norm weights and the Mamba vectors (dt_bias, A_log, D, conv bias) moved
    off their init."""
    config = _config()
    ctx = ctx or ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    model = build_model(config, ctx)
    state = perturbed_full_state(config, seed=3)
    for chunk in model:
        chunk.load_full_state_dict(state)
        chunk.eval()
    return model, ctx, config


def _recomputed(model, config, prompt, sampling: SamplingConfig):
    """Tokens chosen from the logits of one forward over the whole sequence so far, at every step (no cache), and
    those logits."""
    gen, seq, logits = torch.Generator().manual_seed(sampling.seed), list(prompt), []
    with torch.no_grad():
        for _ in range(NEW):
            row = model(torch.tensor([seq]))[0, -1, : config.vocab_size].float()
            if sampling.greedy:
                token = row.argmax()
            else:
                token = torch.multinomial(_distribution(row, sampling), 1, generator=gen)
            logits.append(row)
            seq.append(int(token))
    return seq[len(prompt) :], torch.stack(logits)


def _stepped(model, ctx, prompt, generated):
    """The logits our cache gives at each generated position: the prompt's forward, then one token a step."""
    cache, steps = KVCache(len(prompt) + len(generated)), []
    with torch.no_grad():
        steps.append(_forward_batch(model, ctx, torch.tensor([prompt]), cache)[0, -1])
        for token in generated[:-1]:
            steps.append(_forward_batch(model, ctx, torch.tensor([[token]]), cache)[0, -1])
    return torch.stack(steps)


def test_cached_generation_equals_recomputing_the_whole_sequence():
    model, ctx, config = _model()
    tokens, logits = _recomputed(model, config, PROMPT, SamplingConfig())
    assert generate(model, ctx, PROMPT, NEW)["generated_ids"] == tokens
    assert rel(_stepped(model, ctx, PROMPT, tokens), logits) < 1e-5
    sampling = SamplingConfig(greedy=False, temperature=1.5, top_k=40, seed=7)
    sampled, _ = _recomputed(model, config, PROMPT, sampling)
    assert generate(model, ctx, PROMPT, NEW, sampling)["generated_ids"] == sampled
    # several tokens on a cache holding a state (the scan from it), then steps: one forward's logits
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        whole = model(ids)[0, :, : config.vocab_size]
        cache = KVCache(ids.shape[1])
        parts = [_forward_batch(model, ctx, ids[:, a:b], cache, every=True)[0] for a, b in ((0, 4), (4, 9), (9, 15))]
    assert rel(torch.cat(parts), whole) < 1e-5
    # --max-new-tokens 0 scores the prompt
    scored = generate(model, ctx, PROMPT, 0)["prompt_logprobs"]
    expected = torch.log_softmax(whole[: len(PROMPT) - 1], -1).gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1))
    assert torch.allclose(torch.tensor(scored), expected.squeeze(1), atol=1e-5)


def test_a_batch_of_prompts_of_different_lengths_gives_each_prompts_own_result():
    """The shortest prompt's forward, then one position a step, a longer prompt feeding its own tokens: each Mamba
    state runs over its own sequence's tokens. Greedy and sampled."""
    model, ctx, _ = _model()
    prompts = [PROMPT, [9, 4, 200, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    for sampling in (SamplingConfig(), SAMPLED):
        batch = generate_batch(model, ctx, prompts, NEW, sampling)
        for prompt, got in zip(prompts, batch):
            alone = generate(model, ctx, prompt, NEW, sampling)
            assert got["generated_ids"] == alone["generated_ids"]
            assert torch.allclose(torch.tensor(got["logprobs"]), torch.tensor(alone["logprobs"]), atol=1e-5)
            assert torch.allclose(torch.tensor(got["prompt_logprobs"][: len(prompt) - 1]),
                                  torch.tensor(alone["prompt_logprobs"]), atol=1e-5)  # fmt: skip


def test_generation_bytes_count_the_mamba_states():
    """The fits-in-memory check counts each Mamba layer's conv window and SSM state beside the attention layers'
    keys and values (and nothing for the MLP layer)."""
    from torch.utils._pytree import tree_leaves

    from megatron_lite.inference.generation import generation_bytes

    model, ctx, _ = _model()
    cache = KVCache(12)
    with torch.no_grad():
        for a, b in ((0, 5), (5, 6), (6, 7)):
            _forward_batch(model, ctx, torch.arange(a, b).repeat(2, 1), cache)
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tree_leaves(cache._store)}
    held.update((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tree_leaves(cache._mamba))
    assert generation_bytes(model, ctx, 2, 12, scored_rows=0) == sum(held.values())


def _layouts_generate(layouts, prompts):
    """In a pool worker: each layout's greedy and sampled results for `prompts`."""
    from dist_pool import get_context

    out = []
    for parallel in layouts:
        model, ctx, _ = _model(get_context(parallel))
        for sampling in (SamplingConfig(), SAMPLED):
            out.append(generate_batch(model, ctx, prompts, NEW, sampling))
    return out


def test_tp2_pp2_and_virtual_stages_generate_one_process_tokens(dist):
    """TP=2: each rank's 3 Mamba heads (1 group) and their conv channels keep their own state; PP=2 (M* | M-) and two
    virtual stages a rank (one layer each)."""
    prompts = [PROMPT, [9, 4, 200, 3]]
    layouts = [
        ParallelConfig(tensor_model_parallel_size=2),
        ParallelConfig(pipeline_model_parallel_size=2),
        ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
    ]
    model, ctx, _ = _model()
    ref = [generate_batch(model, ctx, prompts, NEW, s) for s in (SamplingConfig(), SAMPLED)]
    for rank, results in enumerate(dist(2, _layouts_generate, layouts, prompts)):
        for i, got in enumerate(results):
            want = ref[i % 2]
            assert [g["generated_ids"] for g in got] == [w["generated_ids"] for w in want], (rank, layouts[i // 2])
            if "logprobs" in got[0]:  # (the last stage's)
                for g, w in zip(got, want):
                    assert torch.allclose(torch.tensor(g["logprobs"]), torch.tensor(w["logprobs"]), atol=1e-5)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A random transformers NemotronHForCausalLM (Mamba, attention, Mamba, MLP; transformers' chunks of 4 tokens)
    and our checkpoint of it."""
    tmp = tmp_path_factory.mktemp("nemotron_h")
    model = randomised(transformers.NemotronHForCausalLM(_hf_config(hybrid_override_pattern="M*M-")))
    model.save_pretrained(tmp / "hf")
    argv = ["--loader", "hf", "--saver", "megatron_lite", "--load-dir", str(tmp / "hf")]
    assert convert.main([*argv, "--save-dir", str(tmp / "ours")]) == 0
    return model, str(tmp / "ours")


def test_greedy_generation_equals_transformers_generate(converted, tmp_path):
    """transformers' own cache (its conv and SSM states, its selective-state update) as the oracle: the same tokens
    and, at every step, the same logits; tools/generate.py on the checkpoint the same tokens."""
    from test_convert import _load_ours

    hf, ours = converted
    prompt = [(7 * i + 3) % 250 for i in range(10)]  # (10 tokens: transformers' prefill crosses its chunks)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    tokens, hf_logits = out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()
    model, ctx, _ = _load_ours(ours, ParallelConfig())
    model.eval()
    assert generate(model, ctx, prompt, NEW)["generated_ids"] == tokens
    logits = _stepped(model, ctx, prompt, tokens)[:, : hf_logits.shape[-1]]
    assert rel(logits, hf_logits) < 1e-5, rel(logits, hf_logits)
    argv = ["--load", ours, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(NEW), "--greedy"]
    assert generate_cli.main([*argv, "--ignore-eos", "--output-json", str(tmp_path / "out.json")]) == 0
    assert json.loads((tmp_path / "out.json").read_text())["generated_ids"] == tokens
