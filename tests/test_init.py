"""The same seed gives the same full weights at TP=1, 2 and 4; vocabulary padding is zero, never drawn
from the random stream of real rows, and trimmed from the full state; and the init follows Megatron's
scheme (normal(std), output projections scaled by 1/sqrt(2 * layers), norms 1, biases 0)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_lite.config import ParallelConfig
from megatron_lite.models.gpt_model import GPTModel
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.parameters import named_param_meta

from models import CONFIGS, VOCAB


def _full_weights(config, tp: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """Build the model as each of `tp` ranks would (no processes needed) and reassemble full tensors."""
    ranks = [
        GPTModel(
            config,
            ParallelContext.virtual(ParallelConfig(tensor_model_parallel_size=tp), tp, r, device=torch.device("cpu")),
            seed=seed,
        )
        for r in range(tp)
    ]
    out = {}
    for name, _, meta in named_param_meta(ranks[0]):
        spec = meta.shard
        shards = [dict(m.named_parameters())[name].detach() for m in ranks]
        if spec is None:
            assert all(torch.equal(s, shards[0]) for s in shards), f"{name} differs across TP ranks"
            out[name] = shards[0]
        else:
            for r, s in enumerate(shards):  # padding rows are zero
                assert not s.movedim(spec.dim, 0)[~spec.padding_mask(r)].any(), name
            out[name] = spec.unshard(shards)
    return out


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_same_seed_same_full_weights_at_any_tp(name):
    config = CONFIGS[name]()
    ref = _full_weights(config, 1)
    assert ref["embedding.word_embeddings.weight"].shape[0] == VOCAB  # trimmed to the real vocabulary
    for tp in (2, 4):
        assert config.padded_vocab_size(tp) > VOCAB  # this vocabulary really is padded at TP=2 and 4
        full = _full_weights(config, tp)
        assert full.keys() == ref.keys()
        for k in ref:
            assert torch.equal(full[k], ref[k]), f"TP={tp}: {k} differs from TP=1"
    other = _full_weights(config, 1, seed=4)
    assert not torch.equal(
        other["decoder.layers.0.mlp.linear_fc1.weight"], ref["decoder.layers.0.mlp.linear_fc1.weight"]
    )


def test_padding_does_not_shift_the_stream_of_real_rows():
    """A larger padding multiple changes nothing in the real rows."""
    a = _full_weights(CONFIGS["llama"](make_vocab_size_divisible_by=1), 1)
    b = _full_weights(CONFIGS["llama"](make_vocab_size_divisible_by=128), 1)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_megatron_init_scheme():
    config = CONFIGS["gpt2"](num_layers=8, hidden_size=128, init_method_std=0.05)
    w = _full_weights(config, 1)
    std = lambda k: float(w[k].std())  # noqa: E731
    assert std("decoder.layers.0.self_attention.linear_qkv.weight") == pytest.approx(0.05, rel=0.05)
    assert std("embedding.word_embeddings.weight") == pytest.approx(0.05, rel=0.05)
    scaled = 0.05 / math.sqrt(2 * 8)
    assert std("decoder.layers.3.self_attention.linear_proj.weight") == pytest.approx(scaled, rel=0.05)
    assert std("decoder.layers.3.mlp.linear_fc2.weight") == pytest.approx(scaled, rel=0.05)
    assert torch.equal(w["decoder.layers.0.input_layernorm.weight"], torch.ones(128))
    assert not w["decoder.layers.0.mlp.linear_fc1.bias"].any()
    # Distinct parameters draw from distinct streams.
    a, b = w["decoder.layers.0.mlp.linear_fc1.weight"], w["decoder.layers.1.mlp.linear_fc1.weight"]
    assert not torch.equal(a, b)


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2), (2, 2)])
def test_the_tracked_generators_draw_independent_streams(tp, ep):
    """Megatron's seeds: the model-parallel generator at +2718 + tp rank, the expert-parallel one at +1024 +
    100 ep rank + etp rank. The expert one was at +2718 too, so on every rank with ep rank 0 and etp = tp rank it
    replayed the model-parallel stream (expert LoRA dropout masks equal to attention dropout's). The tracker
    refuses a seed already in use, as Megatron's does."""
    from megatron_lite.tensor_parallel.random import RNGStatesTracker

    parallel = ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    for rank in range(tp * ep):
        ctx = ParallelContext.virtual(parallel, tp * ep, rank, device=torch.device("cpu"))
        ctx.seed(1234)
        draws = {}
        for name in ("model-parallel", "expert-parallel"):
            with ctx.rng.fork(name):
                draws[name] = torch.rand(64)
        assert not torch.equal(draws["model-parallel"], draws["expert-parallel"]), (tp, ep, rank)
    tracker = RNGStatesTracker()
    tracker.add("a", 7)
    with pytest.raises(ValueError, match="RNG seed 7 of 'b' is already used by 'a'"):
        tracker.add("b", 7)
