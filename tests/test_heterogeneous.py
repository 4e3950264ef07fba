"""Heterogeneous layers (Llama-Nemotron's block configs; Megatron's --heterogeneous-layers-config-path).

Oracles: the homogeneous Llama model (blocks that are all plain); each layer run as a homogeneous one-layer model
of that layer's own query groups and FFN size, the linear replacements as x + W norm(x) written out, a no-op
layer as the identity; one process for TP=2 and PP=2 training and for a checkpoint loaded under another layout;
DeciLM's intermediate sizes of published Llama-Nemotron configs worked out by hand."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_checkpoint_reshard import SAVE_AT
from test_checkpoint_reshard import _compare as _compare_resumed
from test_checkpoint_reshard import run as reshard_run
from test_train_equivalence import _compare, train_run

from megatron_lite.arguments import parse_args
from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.layout_validation import validate_layout
from megatron_lite.models.gpt_model import GPTModel
from megatron_lite.models.heterogeneous import ffn_mult_to_intermediate_size
from megatron_lite.parallel_context import ParallelContext

from models import HETERO_BLOCKS, VOCAB, decilm_block, hetero_config, hetero_json, llama_config

P = ParallelConfig


def _ctx() -> ParallelContext:
    return ParallelContext.virtual(P(), device=torch.device("cpu"))


def test_ffn_mult_gives_deciLMs_intermediate_sizes():
    """int(2 ffn_mult hidden / 3) rounded up to a multiple of 256, on Llama-3.3-Nemotron-Super-49B's hidden 8192:
    5.25 is Llama-3-70B's 28672 (= 5.25 x 2/3 x 8192, a multiple of 256), 2.625 half of it, 0.5 gives 2730.67 ->
    2730 -> 2816 (11 x 256)."""
    assert ffn_mult_to_intermediate_size(5.25, 8192) == 28672
    assert ffn_mult_to_intermediate_size(2.625, 8192) == 14336
    assert ffn_mult_to_intermediate_size(0.5, 8192) == 2816
    assert ffn_mult_to_intermediate_size(1.0, 64) == 256  # int(42.67) = 42 -> 256


def _loss_and_grads(model: GPTModel, tokens: torch.Tensor, weights: torch.Tensor):
    model.zero_grad(set_to_none=True)
    logits = model(tokens)[..., :VOCAB]
    (logits * weights).sum().backward()
    return logits.detach(), {model.global_name(n): p.grad for n, p in model.named_parameters()}


def test_plain_blocks_are_the_homogeneous_model():
    """Blocks whose n_heads_in_group and ffn_mult give the model's own sizes (8 heads / 2 = llama_config's 4 query
    groups; ffn_mult 1.0 at hidden 64: 256), or leave them null (the model's), build the homogeneous Llama: the
    same tensors, and with its weights the same logits and gradients, bit for bit."""
    blocks = [decilm_block("normal", 2, "normal", ffn_mult=1.0), decilm_block("normal", None, "normal")]
    homo = GPTModel(llama_config(ffn_hidden_size=256), _ctx(), seed=3)
    het = GPTModel(llama_config(ffn_hidden_size=256, heterogeneous_layers_config_encoded_json=hetero_json(blocks)),
                   _ctx(), seed=5)  # fmt: skip
    state = homo.full_state_dict()
    assert {k: v.shape for k, v in het.full_state_dict().items()} == {k: v.shape for k, v in state.items()}
    het.load_full_state_dict(state)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    w = torch.randn(2, 12, VOCAB, generator=torch.Generator().manual_seed(1))
    (a, ga), (b, gb) = _loss_and_grads(het, tokens, w), _loss_and_grads(homo, tokens, w)
    assert torch.equal(a, b)
    assert ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)


# The mixed model's layers as written by hand: attention (kind, query groups), MLP (kind, FFN size); the last
# layer is a no-op twice over
LAYERS = [("normal", 4, "normal", 64), ("no_op", None, "linear", None), ("linear", None, "normal", 256),
          ("normal", 2, "no_op", None), ("no_op", None, "no_op", None)]  # fmt: skip
MIXED = [*HETERO_BLOCKS, decilm_block("no_op", None, "no_op")]


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def test_mixed_layers_are_each_layer_run_on_its_own():
    """Each layer of a mixed model equals a homogeneous one-layer model of that layer's query groups and FFN size
    holding its weights (its attention half or MLP half alone where the other is a no-op); a linear replacement is
    x + W rmsnorm(x) written out; a layer of two no-ops returns its input. Logits and every gradient."""
    config = llama_config(num_layers=5, heterogeneous_layers_config_encoded_json=hetero_json(MIXED))
    het = GPTModel(config, _ctx(), seed=4)
    state = {k: v + 0.1 * torch.randn_like(v) if v.ndim == 1 else v for k, v in het.full_state_dict().items()}
    het.load_full_state_dict(state)  # (norm weights away from 1)
    assert not any(k.startswith("decoder.layers.4.") for k in state)  # (the no-op layer holds nothing)
    leaves = {k: v.clone().requires_grad_() for k, v in state.items()}
    oracles, copied = [], {}  # per layer a homogeneous one-layer model; its parameter -> the mixed model's name
    for i, (_, groups, _, ffn) in enumerate(LAYERS):
        one = GPTModel(llama_config(num_layers=1, num_query_groups=groups or 4, ffn_hidden_size=ffn or 96), _ctx())
        mine = one.full_state_dict()
        for name in mine:
            theirs = name.replace("decoder.layers.0.", f"decoder.layers.{i}.")
            if theirs in state and (theirs != name or i == 0):
                mine[name] = state[theirs]
                copied[(i, name)] = theirs
        one.load_full_state_dict(mine)
        oracles.append(one)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    w = torch.randn(2, 12, VOCAB, generator=torch.Generator().manual_seed(1))

    first = oracles[0]
    pos = torch.arange(12).unsqueeze(0).expand(2, 12)
    x, rope = first.embedding(tokens, pos), first.rotary_pos_emb(pos)
    for i, (attention, _, mlp, _) in enumerate(LAYERS):
        layer, name = oracles[i].decoder.layers[0], f"decoder.layers.{i}."
        if attention == "normal":
            x = x + layer.self_attention(layer.input_layernorm(x), rope)
        elif attention == "linear":
            x = x + _rms(x, leaves[name + "input_layernorm.weight"]) @ leaves[name + "self_attention.weight"].T
        if mlp == "normal":
            x = x + layer.mlp(layer.pre_mlp_layernorm(x))
        elif mlp == "linear":
            x = x + _rms(x, leaves[name + "pre_mlp_layernorm.weight"]) @ leaves[name + "mlp.weight"].T
    want = first.output_layer(first.decoder.final_layernorm(x), weight=first.output_weight()).transpose(0, 1)
    want = want[..., :VOCAB]
    (want * w).sum().backward()
    got, grads = _loss_and_grads(het, tokens, w)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
    want_grads = {k: v.grad for k, v in leaves.items() if v.grad is not None}
    for i, one in enumerate(oracles):
        for n, p in one.named_parameters():
            if (i, one.global_name(n)) in copied and p.grad is not None:
                want_grads[copied[(i, one.global_name(n))]] = p.grad
    assert want_grads.keys() == grads.keys()
    for k, g in grads.items():
        assert torch.allclose(g, want_grads[k], rtol=1e-4, atol=1e-6), k
    h = torch.randn(12, 2, 64)  # and the no-op layer is the identity
    assert torch.equal(het.decoder.layers[4](h, rope), h)


# Training under TP=2 (sequence parallel: the linear replacements' outputs gathered, then split along the
# sequence) and PP=2 (the layers of both kinds on each stage) equals one process.
LAYOUTS = {
    "tp2-sp": (2, P(tensor_model_parallel_size=2, sequence_parallel=True), 2),
    "pp2": (2, P(pipeline_model_parallel_size=2), 1),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trains_like_one_process(dist, layout):
    world, parallel, mbs = LAYOUTS[layout]
    ref = train_run("hetero", P(), 4, 4, layers=4, iters=3)
    for history in dist(world, train_run, "hetero", parallel, 4, mbs, layers=4, iters=3):
        assert len(history) == len(ref) == 3
        _compare(history, ref)


# A pipeline stage of identity layers holds no parameter (Llama-3.1-Nemotron-Ultra-253B has runs of four and more):
# PP=3 with the middle stage's two layers no-ops. It stopped at the first step (the stage's dtype was read from a
# parameter), the other ranks waiting on it.
_N, _I = decilm_block("normal", 2, "normal", ffn_hidden_size=64), decilm_block("no_op", None, "no_op")
IDENTITY_STAGE = dict(heterogeneous_layers_config_encoded_json=hetero_json([_N, _I, _I, _N]))
PP3 = P(pipeline_model_parallel_size=3, decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=1)


@pytest.mark.parametrize("optimizer", ["ddp", "distributed_optimizer", "fsdp2"])
def test_a_stage_of_identity_layers_trains_saves_and_loads(dist, tmp_path, optimizer):
    """Trained at PP=3 (DDP, the distributed optimizer, FSDP2) as one process, lm_loss and grad_norm; saved there
    and loaded at PP=3 and on one process, the runs continue as the one-process run."""
    ckpt, kw = str(tmp_path / "identity"), {} if optimizer == "ddp" else {optimizer: True}
    ref = reshard_run(IDENTITY_STAGE, P(), 8)
    for history in dist(3, reshard_run, IDENTITY_STAGE, PP3, 1, ckpt, **kw):
        _compare_resumed(history, ref, f"PP=3 {optimizer}")
    continued = [h for h in ref if h[0] > SAVE_AT]
    for history in dist(3, reshard_run, IDENTITY_STAGE, PP3, 1, None, ckpt, **kw):
        _compare_resumed(history, continued, f"PP=3 {optimizer} loaded")
    _compare_resumed(reshard_run(IDENTITY_STAGE, P(), 8, None, ckpt), continued, "one process loaded")


def _generate_at(parallel, prompts):
    from megatron_lite.inference.generation import generate_batch
    from megatron_lite.models.gpt_model import build_model

    from dist_pool import get_context

    ctx = get_context(parallel) if parallel.pp > 1 else ParallelContext.virtual(parallel, device=torch.device("cpu"))
    model = build_model(llama_config(num_layers=4, **IDENTITY_STAGE), ctx, seed=7)
    return [r["generated_ids"] for r in generate_batch(model, ctx, prompts, 6)]


def test_a_stage_of_identity_layers_generates(dist):
    """Greedy generation at PP=3 with the middle stage empty gives the one-process tokens on every rank."""
    prompts = [[5, 6, 7, 8], [9, 4, 60]]
    want = _generate_at(P(), prompts)
    assert dist(3, _generate_at, PP3, prompts) == [want] * 3


def test_checkpoint_loads_under_another_layout(dist, tmp_path):
    """Saved at TP=2 with sequence parallelism, loaded at PP=2 and on one process: the runs continue as the
    original (tests/test_checkpoint_reshard.py's run: 4 layers, Adam, a cosine schedule)."""
    ckpt, kw = str(tmp_path / "hetero"), dict(heterogeneous_layers_config_encoded_json=hetero_json(HETERO_BLOCKS))
    original = dist(2, reshard_run, kw, P(tensor_model_parallel_size=2, sequence_parallel=True), 2, ckpt)
    continued = [h for h in original[0] if h[0] > SAVE_AT]
    assert len(continued) == 3
    for history in dist(2, reshard_run, kw, P(pipeline_model_parallel_size=2), 2, None, ckpt):
        _compare_resumed(history, continued, "pp2")
    _compare_resumed(reshard_run(kw, P(), 8, None, ckpt), continued, "one process")
    homogeneous = {}  # and a homogeneous model (llama_config's FFN 96) does not take it
    with pytest.raises(ConfigError, match=r"holds other layers \(block 0: the checkpoint's attention normal \(4 query "
                       r"groups\), MLP normal \(FFN 64\); this run's attention normal \(4 query groups\), MLP normal "
                       r"\(FFN 96\)\)"):  # fmt: skip
        reshard_run(homogeneous, P(), 8, None, ckpt)


def test_another_checkpoints_blocks_are_named_by_the_first_difference():
    """80 layers (Llama-Nemotron-sized) differing in layer 7 only: one short line naming that block, both sides'
    parts and sizes (ffn_mult 1.0 at hidden 64: 256), where both tuples of blocks were printed (14 KB)."""
    from megatron_lite.checkpoint.compatibility import check_model_structure

    saved = [decilm_block("normal", 2, "normal", ffn_mult=1.0)] * 40 + [decilm_block("no_op", None, "normal")] * 40
    ours = list(saved)
    ours[7] = decilm_block("no_op", None, "normal", ffn_mult=1.0)

    def config(blocks):
        return llama_config(num_layers=80, heterogeneous_layers_config_encoded_json=hetero_json(blocks))

    meta = {"config": {"model": dataclasses.asdict(config(saved))}}
    model = GPTModel(config(ours), _ctx(), device="meta")
    with pytest.raises(ConfigError) as e:
        check_model_structure("ckpt", meta, model)
    want = (
        "ckpt holds other layers (block 7: the checkpoint's attention normal (4 query groups), MLP normal (FFN "
        "256); this run's attention no_op, MLP normal (FFN 256)): give --heterogeneous-layers-config-path the "
    )
    assert str(e.value).startswith(want) and len(str(e.value)) < 400, str(e.value)


FLAGS = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 8 --group-query-attention --num-query-groups 4 "
    "--seq-length 16 --vocab-size 100 --normalization RMSNorm --swiglu --position-embedding-type rope "
    "--disable-bias-linear --train-iters 1 --micro-batch-size 1"
).split()


def _job(blocks, *extra: str):
    return parse_args([*FLAGS, "--heterogeneous-layers-config-encoded-json", hetero_json(blocks), *extra])[1]


def test_the_path_flag_reads_the_config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(hetero_json(HETERO_BLOCKS))
    job = parse_args([*FLAGS, "--heterogeneous-layers-config-path", str(path)])[1]
    assert job.model == _job(HETERO_BLOCKS).model
    assert [b.attention for b in job.model.heterogeneous_blocks] == ["normal", "no_op", "linear", "normal"]
    with pytest.raises(ConfigError, match="--heterogeneous-layers-config-path .*missing.json cannot be read"):
        parse_args([*FLAGS, "--heterogeneous-layers-config-path", str(tmp_path / "missing.json")])


def _window(block: dict) -> dict:
    return {**block, "attention": {**block["attention"], "window_length": 4096}}


@pytest.mark.parametrize(
    "blocks, extra, message",
    [
        (HETERO_BLOCKS[:3], [], "has 3 block_configs but --num-layers is 4: give --num-layers 3"),
        ([decilm_block("normal", 3)] * 4, [], "block 0 attention has n_heads_in_group=3, which does not divide"),
        ([_window(HETERO_BLOCKS[0])] * 4, [], "block 0 attention sets window_length=4096, which is not implemented"),
        ([decilm_block("normal", 8)] * 4, ["--tensor-model-parallel-size", "2"], "block 0 attention has 1 query gro"),
        ([decilm_block("no_op", 2)] * 4, [], "block 0 attention is no_op and has a query-group count"),
        (
            [decilm_block("normal", 2.5)] * 4,
            [],
            "block 0 attention has n_heads_in_group=2.5: it must be a positive whol",
        ),
        (HETERO_BLOCKS, ["--num-experts", "4"], "--num-experts is not supported with heterogeneous layers"),
        (HETERO_BLOCKS, ["--mtp-num-layers", "1"], "--mtp-num-layers is not supported with heterogeneous layers"),
    ],
)
def test_bad_block_configs_are_one_line_at_start_up(blocks, extra, message):
    with pytest.raises(ConfigError, match=r"--heterogeneous-layers-config-path|not supported") as e:
        job = _job(blocks, *extra)
        validate_layout(job.model, job.parallel, 2, job.training)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_encoded_json_is_kept_in_the_checkpoints_model_config():
    job = _job(HETERO_BLOCKS)
    saved = job.to_dict()["model"]["heterogeneous_layers_config_encoded_json"]
    assert json.loads(saved)["block_configs"] == list(HETERO_BLOCKS)


def test_flops_count_each_layers_own_sizes():
    """6 N (N the model's matmul weights: each layer's own attention and MLP, the linears, nothing for a no-op) plus
    q.k^T and p.v over half the sequence in the layers that keep their attention (layers 0, 2 and 3 of MIXED: the
    linear replacement of layer 1's MLP and layer 2's attention have no scores)."""
    from megatron_lite.training.flops import flops_per_token

    config = llama_config(num_layers=5, heterogeneous_layers_config_encoded_json=hetero_json(MIXED))
    model = GPTModel(config, _ctx(), device="meta")
    n = sum(p.numel() for name, p in model.named_parameters() if p.ndim == 2 and "embedding" not in name)
    s, heads, d = 128, 8, 8
    attention_layers = 2  # (0 and 3; layer 2's attention is a linear)
    assert flops_per_token(config, s) == pytest.approx(6 * n + 6 * attention_layers * s * heads * d, rel=1e-12)


def test_generation_with_the_kv_cache_is_the_full_forward():
    """Each attention layer caches its own query groups' keys and values (the cache is per layer): a prompt of 6
    then 4 tokens one at a time give the logits of the whole sequence at once."""
    from megatron_lite.inference.kv_cache import KVCache

    model = GPTModel(llama_config(num_layers=5, heterogeneous_layers_config_encoded_json=hetero_json(MIXED)), _ctx())
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, cache = model.eval()(tokens), KVCache(16)
        steps = [model(tokens[:, :6], position_ids=torch.arange(6).expand(2, 6), kv_cache=cache)]
        cache.advance(6)
        for i in range(6, 10):
            steps.append(model(tokens[:, i : i + 1], position_ids=torch.full((2, 1), i), kv_cache=cache))
            cache.advance(1)
    assert torch.allclose(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    # what generation's memory check prices is what the cache holds: each layer at its own query groups, a no-op
    # or linear attention at nothing (it priced every layer at the model's groups)
    from megatron_lite.inference.generation import generation_bytes

    held = sum(t.numel() * t.element_size() for kv in cache._store.values() for t in kv)
    assert held == generation_bytes([model], _ctx(), 2, 16, 0), (held, generation_bytes([model], _ctx(), 2, 16, 0))


def test_load_alone_takes_the_checkpoints_block_configs():
    from megatron_lite.checkpoint_flags import flags_from_checkpoint
    from megatron_lite.flag_parser import build_parser

    saved = _job(HETERO_BLOCKS).to_dict()
    ns = flags_from_checkpoint(build_parser(), FLAGS, build_parser().parse_args(FLAGS), saved, "ckpt")
    assert ns.heterogeneous_layers_config_encoded_json == hetero_json(HETERO_BLOCKS)


def test_load_compares_the_given_block_configs_as_blocks(tmp_path):
    """--load with the block-config flags: the same blocks written as other JSON (indented, as a config.json is) are
    taken, by either flag; other blocks given by either flag are refused in one line naming the first differing
    block (the path was ignored without a word, the JSON compared as text); --use-checkpoint-args takes the
    checkpoint's."""
    from megatron_lite.checkpoint_flags import flags_from_checkpoint
    from megatron_lite.flag_parser import build_parser
    from megatron_lite.flag_values import heterogeneous_json

    saved = _job(HETERO_BLOCKS).to_dict()
    indented = json.dumps({"architectures": ["DeciLMForCausalLM"], "block_configs": list(HETERO_BLOCKS)}, indent=2)
    other = hetero_json([decilm_block("normal", 2, "normal", ffn_hidden_size=128)] * 4)
    (tmp_path / "same.json").write_text(indented)
    (tmp_path / "other.json").write_text(other)

    def load(*flags: str):
        argv = [*FLAGS, *flags]
        ns = flags_from_checkpoint(build_parser(), argv, build_parser().parse_args(argv), saved, "ckpt")
        return json.loads(heterogeneous_json(ns))["block_configs"]

    assert load("--heterogeneous-layers-config-encoded-json", indented) == list(HETERO_BLOCKS)
    assert load("--heterogeneous-layers-config-path", str(tmp_path / "same.json")) == list(HETERO_BLOCKS)
    differs = (
        "conflicts with the checkpoint in ckpt (block 0: the checkpoint's attention normal (4 query groups), MLP "
        "normal (FFN 64); this run's attention normal (4 query groups), MLP normal (FFN 128)): drop the flag"
    )
    for flag, value in (("encoded-json", other), ("path", str(tmp_path / "other.json"))):
        with pytest.raises(ConfigError) as e:
            load(f"--heterogeneous-layers-config-{flag}", value)
        assert str(e.value).startswith(f"--heterogeneous-layers-config-{flag} {differs}"), str(e.value)
        assert "\n" not in str(e.value) and len(str(e.value)) < 400
    taken = load("--heterogeneous-layers-config-path", str(tmp_path / "other.json"), "--use-checkpoint-args")
    assert taken == list(HETERO_BLOCKS)


def test_what_does_not_model_heterogeneous_layers_says_so():
    """LoRA's adapters and the Hugging Face export read the model's one set of sizes: refused. (The planner prices
    each layer at its own: tests/test_planner.py -k heterogeneous.)"""
    from megatron_lite.lora.config import LoraConfig, lora_for_model
    from megatron_lite.models.hf import check_exportable

    model = _job(HETERO_BLOCKS).model
    with pytest.raises(ConfigError, match="--lora-rank 8 with heterogeneous layers"):
        lora_for_model(LoraConfig(), model)
    with pytest.raises(ConfigError, match="heterogeneous layers"):
        check_exportable(model, "LlamaForCausalLM")


def test_the_dry_run_prices_no_gathered_keys_where_nothing_attends():
    """Under --cp-comm-type allgather a layer keeps the whole sequence's keys and values; a no-op or linear
    attention gathers none, so its priced bytes stay what they are without CP (a review: they grew with CP as a
    normal layer's do)."""
    from megatron_lite.planner.layout import Layout
    from megatron_lite.planner.memory import layer_activation_bytes

    model = hetero_config(num_layers=4)
    for layer, attends in ((0, True), (1, False), (2, False), (3, True)):
        one, four = (
            layer_activation_bytes(model, Layout(cp=cp, cp_comm_type="allgather"), 4, layer, "none") for cp in (1, 4)
        )
        assert (four > one) == attends, (layer, one, four)
