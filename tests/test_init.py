"""The same seed gives the same full weights at TP=1, 2 and 4; vocabulary padding is zero, never drawn
from the random stream of real rows, and trimmed from the full state; and the init follows Megatron's
scheme (normal(std), output projections scaled by 1/sqrt(2 * layers), norms 1, biases 0)."""

from __future__ import annotations

import math

import pytest
import torch
from test_megatron_flags import MOCK

from megatron_lite.arguments import parse_args
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


def test_tp_ranks_share_the_default_generator_and_part_in_the_model_parallel_one():
    """Megatron's seeding across TP: the default generator alike on every TP rank (dropout on activations each rank
    holds whole draws one mask), the model-parallel one different (attention dropout on each rank's heads, and SP's
    hidden dropout on each rank's sequence shard, draw masks of their own: the same seed there would correlate
    the masks of different heads and positions)."""
    draws = []
    for rank in range(2):
        ctx = ParallelContext.virtual(ParallelConfig(tensor_model_parallel_size=2), 2, rank, device=torch.device("cpu"))
        ctx.seed(1234)
        default = torch.rand(64)
        with ctx.rng.fork("model-parallel"):
            draws.append((default, torch.rand(64)))
    assert torch.equal(draws[0][0], draws[1][0])
    assert not torch.equal(draws[0][1], draws[1][1])


# Megatron's init flags (moved from test_megatron_flags.py) ------------------------------------------------
def test_embedding_init_method_std_initialises_the_embeddings_and_spares_them_weight_decay(tmp_path):
    """Megatron's --embedding-init-method-std (refused before): the word and position embeddings are drawn with
    that std, the rest with --init-method-std, and the embeddings take no weight decay (Megatron's
    default_skip_embedding_weight_decay, by name)."""
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.optimizer.optimizer import group_name, optimizer_groups
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.parameters import named_param_meta

    flags = [*MOCK, "--position-embedding-type", "learned_absolute", "--untie-embeddings-and-output-weights"]
    _, job = parse_args([*flags, "--embedding-init-method-std", "0.5"])
    ctx = ParallelContext.virtual(job.parallel, 1)
    model = build_model(job.model, ctx, seed=1)
    stds = {name: p[:100].float().std().item() for name, p in model.named_parameters()}  # (not padded rows)
    assert stds["0.embedding.word_embeddings.weight"] == pytest.approx(0.5, rel=0.05)
    assert stds["0.embedding.position_embeddings.weight"] == pytest.approx(0.5, rel=0.05)
    assert stds["0.output_layer.weight"] == pytest.approx(0.02, rel=0.05)
    assert stds["0.decoder.layers.0.self_attention.linear_qkv.weight"] == pytest.approx(0.02, rel=0.05)
    entries = [(p, group_name(n, m), p.ndim) for n, p, m in named_param_meta(model)]
    decayed = {id(p) for g in optimizer_groups(entries, job.optimizer) if g["weight_decay"] for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decayed}
    assert "0.output_layer.weight" in names and "0.decoder.layers.0.self_attention.linear_qkv.weight" in names
    assert not any("embedding" in n for n in names)
    _, plain = parse_args(flags)  # (without the flag the embeddings decay)
    assert plain.model.embedding_init_method_std is None and not plain.optimizer.skip_embedding_weight_decay


@pytest.mark.slow
def test_embedding_init_method_std_under_pp2_with_tied_embeddings_equals_one_process(tmp_path, pretrain_job):
    """The last stage's copy of the tied word embeddings is initialised and spared weight decay as the
    embeddings are (by its group name), so PP2 logs what one process logs; Megatron's rule by name alone would
    decay the copy ("output_layer.weight") and not the first stage's."""
    from test_pretrain_torchrun import records

    args = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-iters 6 --micro-batch-size 1 "
        "--global-batch-size 4 --lr 1e-2 --weight-decay 0.5 --log-interval 1 --eval-iters 0 --hidden-dropout 0 "
        "--attention-dropout 0 --distributed-backend gloo --embedding-init-method-std 0.5"
    ).split()
    pretrain_job(1, [*args, "--log-jsonl", str(tmp_path / "one.jsonl")])
    pretrain_job(2, [*args, "--pipeline-model-parallel-size", "2", "--log-jsonl", str(tmp_path / "pp2.jsonl")])
    one, pp2 = records(tmp_path / "one.jsonl"), records(tmp_path / "pp2.jsonl")
    assert len(one) == len(pp2) == 6
    for a, b in zip(one, pp2):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-5 * a["lm_loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (a, b)


@pytest.mark.parametrize("embedding_std", [None, "0.5"])
def test_init_method_xavier_uniform_draws_every_weight_from_its_full_fans(embedding_std):
    """Megatron's --init-method-xavier-uniform (refused before): init_method and scaled_init_method are
    torch.nn.init.xavier_uniform_, the embeddings' too unless --embedding-init-method-std differs; the bound
    sqrt(6 / (fan_in + fan_out)) is the full tensor's (Megatron's CPU initialisation), so TP2 draws the same."""
    import math

    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    flags = [*MOCK, "--init-method-xavier-uniform", "--untie-embeddings-and-output-weights", "--swiglu"]
    flags += ["--embedding-init-method-std", embedding_std] if embedding_std else []
    _, job = parse_args(flags)
    model = build_model(job.model, ParallelContext.virtual(job.parallel, 1), seed=3)
    h, f = 768, job.model.ffn_size
    expected = {  # (full shapes: [out, in])
        "decoder.layers.0.self_attention.linear_qkv.weight": (3 * h, h),
        "decoder.layers.1.self_attention.linear_proj.weight": (h, h),
        "decoder.layers.0.mlp.linear_fc1.weight": (2 * f, h),
        "decoder.layers.1.mlp.linear_fc2.weight": (h, f),
        "output_layer.weight": (100, h),
        "embedding.word_embeddings.weight": (100, h),
    }
    params = dict(model[0].named_parameters())
    for name, (out, inp) in expected.items():
        w = params[name][:out].float()  # (the vocabulary's padding rows stay zero)
        bound = math.sqrt(6.0 / (out + inp))
        if "embedding" in name and embedding_std:
            assert w.std().item() == pytest.approx(0.5, rel=0.05), name
            continue
        assert w.abs().max().item() <= bound and w.abs().max().item() > 0.99 * bound, name
        assert w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.03), name
    assert params["decoder.layers.0.input_layernorm.weight"].eq(1).all()  # (not weights drawn normal)
