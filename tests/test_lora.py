"""LoRA inside the parallel layers (megatron_lite/lora): fine-tuning at TP=2 with sequence parallelism, at
TP=2 without it, at PP=2 and at DP=2 equals one process per iteration (lm_loss and grad_norm within 1e-4),
base weights stay bit-identical, only adapters are trained; the adapted model at init equals the base.
Likewise a mixture-of-experts model with adapters on its routed experts, at EP=2, EP=2 x DP=2 and TP=2 + SP
(expert-TP 2: the experts' adapters split like their weights), and at expert-TP below TP (1 under 2, with EP=1
and 2; 2 under 4)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_train_equivalence import OPTIM, _compare

from megatron_lite.config import ParallelConfig
from megatron_lite.lora.apply import LoraConfig, apply_lora

from dist_pool import get_context
from models import deepseek_config, gpt2_config, llama_config

P = ParallelConfig
ITERS = 6
LORA = LoraConfig(rank=4, alpha=8.0)
EXPERT_LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("linear_qkv", "linear_proj", "experts"))
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_aux_loss_coeff=1e-2)


def moe_config(**kw):
    return llama_config(**MOE, **kw)


def moe_bias_config(**kw):  # aux-loss-free balancing: a router bias updated outside the gradient
    return moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, **kw)


CONFIG = {
    "llama": llama_config,
    "gpt2": gpt2_config,
    "moe": moe_config,
    "moe-bias": moe_bias_config,
    "deepseek": lambda **kw: deepseek_config(vocab_size=250, **kw),  # MLA: adapters on the latent projections
    # QLoRA at TP=2: every shard's rows whole 64-value blocks (linear_proj's 64 and linear_fc2's 128 columns)
    "llama-wide": lambda **kw: llama_config(hidden_size=128, ffn_hidden_size=256, **kw),
    "moe-wide": lambda **kw: llama_config(**{**MOE, "moe_ffn_hidden_size": 128}, hidden_size=128, **kw),
}
QLORA = dataclasses.replace(LORA, qlora=True)
EXPERT_QLORA = dataclasses.replace(EXPERT_LORA, qlora=True)


def lora_run(
    name: str,
    parallel: ParallelConfig,
    gbs: int,
    mbs: int,
    layers: int = 2,
    lora: LoraConfig = LORA,
    optim_kw: dict | None = None,
    save: str | None = None,
):
    """(per-iteration history, base unchanged, trainable names, adapter count); with `save`, also the
    `adam_step` of a checkpoint saved there after the last iteration."""
    import torch.distributed as dist

    from megatron_lite.data.mock import MockGPTDataset, collate
    from megatron_lite.data.samplers import micro_batch_indices
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.optimizer.lr_scheduler import LRScheduler
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.training.step import train_step
    from megatron_lite.training.wrap import wrap_for_training

    ctx = (
        get_context(parallel)
        if dist.is_initialized()
        else ParallelContext.virtual(parallel, device=torch.device("cpu"))
    )
    config = CONFIG[name](num_layers=layers)
    ctx.seed(1234)
    model = build_model(config, ctx, seed=1234)
    n_adapter = apply_lora(model, config, lora, ctx, seed=7)
    if lora.qlora:
        from megatron_lite.lora.qlora import quantize_base

        _, per_shard = quantize_base(model, ctx)
        assert not per_shard, per_shard  # (these tests' shards are whole blocks: quantised as the full weights)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    # adapters start at B = 0: a visible step in a few iterations
    optim = dataclasses.replace(OPTIM, lr=1e-2, **(optim_kw or {}))
    ddp, opt = wrap_for_training(model, ctx, optim)
    sched = LRScheduler(optim, ITERS)
    data = MockGPTDataset(250, 16, seed=1)
    history = []
    for it in range(ITERS):
        idx = micro_batch_indices(it * gbs, gbs, mbs, ctx.dp.rank, ctx.dp.size)
        m = train_step(ddp, opt, sched, [collate([data[i] for i in ix]) for ix in idx], ctx)
        history.append((m.lm_loss, m.grad_norm, m.lr))
    full = {n: getattr(p, "full_tensor", lambda p=p: p)() for n, p in model.named_parameters()}  # (FSDP2: DTensors)
    unchanged = all(torch.equal(full[n], frozen[n]) for n in frozen)
    if save is None:
        return history, unchanged, trainable, n_adapter
    import json
    import os

    from megatron_lite.checkpoint.checkpointing import TrainState, save_checkpoint

    path = save_checkpoint(save, TrainState(ITERS, ITERS * gbs), model, opt, sched, ctx, {})
    with open(os.path.join(path, "metadata.json")) as f:
        return history, unchanged, trainable, n_adapter, json.load(f)["adam_step"]


LAYOUTS = {
    "tp2-sp": (2, P(tensor_model_parallel_size=2, sequence_parallel=True), 4, 2),
    "tp2": (2, P(tensor_model_parallel_size=2), 4, 2),
    "pp2": (2, P(pipeline_model_parallel_size=2), 4, 1),
    "dp2": (2, P(), 4, 2),
}


MOE_LAYOUTS = {
    "ep2": (2, P(expert_model_parallel_size=2), 4, 2),
    "tp2-sp": (2, P(tensor_model_parallel_size=2, sequence_parallel=True), 4, 2),  # expert-TP 2 as well
    "ep2-dp2": (4, P(expert_model_parallel_size=2), 4, 1),  # two copies of each expert's adapters
}


@pytest.mark.parametrize(
    "layout,lora",
    [(layout, EXPERT_LORA) for layout in MOE_LAYOUTS]
    + [("ep2", dataclasses.replace(EXPERT_LORA, qlora=True))],  # QLoRA: the experts' weights in NF4 too
    ids=list(MOE_LAYOUTS) + ["ep2-qlora"],
)
def test_expert_lora_equals_one_process(dist, layout, lora):
    world, parallel, gbs, mbs = MOE_LAYOUTS[layout]
    # the reference's micro-batches are the ranks' (the load-balancing loss is per micro-batch)
    ref, unchanged, trainable, n = lora_run("moe", P(), gbs, mbs, 2, lora)
    assert unchanged and any(".mlp.experts." in t for t in trainable) and all(".lora." in t for t in trainable)
    for history, unchanged, _, _ in dist(world, lora_run, "moe", parallel, gbs, mbs, 2, lora):
        assert unchanged
        _compare(history, ref)


ETP1 = dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1, sequence_parallel=True)


@pytest.mark.parametrize(
    "world,parallel,optim_kw",
    [(2, P(**ETP1), None), (2, P(**ETP1), {"use_distributed_optimizer": True}),
     (2, P(**ETP1), {"use_torch_fsdp2": True}), (2, P(expert_model_parallel_size=2, **ETP1), None),
     (4, P(**{**ETP1, "tensor_model_parallel_size": 4, "expert_tensor_parallel_size": 2}), None)],
    ids=["ep1", "ep1-distributed-optimizer", "ep1-fsdp2", "ep2", "tp4-etp2"],
)  # fmt: skip
def test_expert_lora_at_expert_tp_below_tp_equals_one_process(dist, tmp_path, world, parallel, optim_kw):
    """An expert-TP size below TP (each expert-TP group computes its slice of the tokens): the experts'
    replicated adapter halves were summed over TP, whose other expert-TP groups hold other slices (which the
    expert-DP reduction adds already) or other experts (EP=2), so start-up refused the layout. Now summed over
    expert-TP: per iteration lm_loss and grad_norm within 1e-5 of one process (grad_norm 0.5600 for 0.5518 at
    iteration 1 with the TP sum), and the checkpointed adapters, which --saver hf-peft exports, too."""
    from megatron_lite.checkpoint.hf_convert import read_model_tensors
    from megatron_lite.lora.peft import split_lora

    ref, _, _, _, _ = lora_run("moe", P(), 4, 2, 2, EXPERT_LORA, save=str(tmp_path / "ref"))
    save = str(tmp_path / "etp1")
    for history, unchanged, _, _, _ in dist(world, lora_run, "moe", parallel, 4, 2, 2, EXPERT_LORA, optim_kw, save):
        assert unchanged
        for it, (got, want) in enumerate(zip(history, ref)):
            for what, a, b in (("lm_loss", got[0], want[0]), ("grad_norm", got[1], want[1])):
                assert abs(a - b) <= 1e-5 * abs(b), f"iteration {it + 1}: {what} {a} vs {b}"
    (_, want), (_, got) = (split_lora(read_model_tensors(d, base=False)[1]) for d in (str(tmp_path / "ref"), save))
    assert set(got) == set(want) and any(".mlp.experts." in k for k in want)
    for k in want:
        # (as a whole tensor: Adam's steps on near-zero gradients round elementwise, as the dense adapters' do)
        assert (got[k] - want[k]).norm() <= 1e-5 * want[k].norm() and want[k].norm() > 0, k


def test_lora_keeps_the_router_bias_of_aux_loss_free_balancing():
    """The expert bias is part of the frozen base: under LoRA it stays as loaded (it was updated every step)."""
    history, unchanged, trainable, _ = lora_run("moe-bias", P(), 4, 2, 2, EXPERT_LORA)
    assert unchanged and all(".lora." in t for t in trainable) and len(history) == ITERS


def test_expert_adapters_start_as_the_identity_one_pair_per_expert_projection():
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    config = moe_config(num_layers=2)
    ctx = ParallelContext.virtual(P(), device=torch.device("cpu"))
    base = build_model(config, ctx, seed=3)
    adapted = build_model(config, ctx, seed=3)
    n = apply_lora(adapted, config, LoraConfig(rank=4, alpha=8.0, target_modules=("experts",)), ctx, seed=1)
    ids = torch.randint(0, 250, (2, 16))
    torch.testing.assert_close(adapted(ids), base(ids), rtol=1e-5, atol=1e-6)
    h, f, r = config.hidden_size, config.moe_ffn_size, 4
    assert n == 2 * 4 * (r * (h + 2 * f) + r * (f + h))  # 2 layers x 4 experts: fc1 (gate and up), fc2
    assert n == sum(p.numel() for p in adapted.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", ["llama", "gpt2", "deepseek"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_equals_one_process(dist, name, layout):
    world, parallel, gbs, mbs = LAYOUTS[layout]
    layers = 4 if "pp" in layout else 2
    ref, unchanged, trainable, _ = lora_run(name, P(), gbs, gbs, layers)
    assert unchanged and trainable and all(".lora." in n for n in trainable)
    assert all(h[1] > 0 for h in ref)  # the adapters get gradients from the first step (B = 0, A does not)
    for history, unchanged, _, _ in dist(world, lora_run, name, parallel, gbs, mbs, layers):
        assert unchanged  # base weights bit-identical after training
        _compare(history, ref)


@pytest.mark.parametrize(
    "layout,optim_kw",
    [((0, 4), {}), ((4, 0), {"use_distributed_optimizer": True})],
    ids=["embedding-alone", "loss-alone-distributed-optimizer"],
)
def test_lora_with_a_pipeline_stage_that_trains_nothing(dist, tmp_path, layout, optim_kw):
    """--pipeline-model-parallel-layout "E|ttttL" and "Etttt|L" under LoRA: one stage holds only frozen base
    weights. Its optimizer has nothing to step (building it crashed), the first stage's backward has nothing to
    run through (it raised), and the checkpoint's adam_step is the steps taken even where global rank 0 holds
    no optimizer state (it read 0 there: a resume restarted Adam's bias correction over warm moments)."""
    parallel = P(pipeline_model_parallel_size=2, pipeline_layout=layout)
    ref, _, _, _ = lora_run("llama", P(), 4, 4, 4)
    save = str(tmp_path / "ckpt")
    for history, unchanged, _, _, adam_step in dist(2, lora_run, "llama", parallel, 4, 1, 4, LORA, optim_kw, save):
        assert unchanged and adam_step == ITERS
        _compare(history, ref)


@pytest.mark.parametrize("name,lora", [("llama-wide", QLORA), ("moe-wide", EXPERT_QLORA)], ids=["dense", "experts"])
def test_qlora_equals_one_process_at_tp2(dist, name, lora):
    """QLoRA at TP=2 with SP: each shard is quantised as its part of the full weight (it had its own block
    statistics, so TP=2 trained another quantised model than TP=1)."""
    ref, _, _, _ = lora_run(name, P(), 4, 2, 2, lora)
    for history, unchanged, _, _ in dist(2, lora_run, name, LAYOUTS["tp2-sp"][1], 4, 2, 2, lora):
        assert unchanged
        _compare(history, ref)


def _nf4_shards_and_full(name: str, lora: LoraConfig) -> list:
    """(each quantised weight's dequantised shard, the same rows / columns of its TP=1 quantisation's)."""
    from megatron_lite.kernels.nf4 import dequantize_nf4_reference
    from megatron_lite.lora.qlora import quantize_base
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.parameters import param_meta

    config = CONFIG[name](num_layers=2)
    models = []
    for ctx in (get_context(LAYOUTS["tp2-sp"][1]), ParallelContext.virtual(P(), device=torch.device("cpu"))):
        model = build_model(config, ctx, seed=5)
        apply_lora(model, config, lora, ctx, seed=7)
        metas = {n: param_meta(m, "weight") for n, m in model.named_modules() if getattr(m, "lora", None)}
        assert not quantize_base(model, ctx)[1]
        models.append((model, metas))
    (shards, metas), (full, _) = models
    full_nf4 = {n: m for n, m in full.named_modules() if n.endswith(".nf4")}
    out = []
    for n, m in shards.named_modules():
        if n.endswith(".nf4"):
            meta = metas[n.removesuffix(".nf4")]
            whole = dequantize_nf4_reference(full_nf4[n].weight())
            out.append((dequantize_nf4_reference(m.weight()), meta.shard.shard(whole, meta.shard_rank)))
    return out


@pytest.mark.parametrize("name,lora", [("llama-wide", QLORA), ("moe-wide", EXPERT_QLORA)], ids=["dense", "experts"])
def test_qlora_shards_dequantise_to_the_full_weights_rows(dist, name, lora):
    """Bit for bit: a TP=2 shard's NF4 weight is the TP=1 quantisation's, rows and columns cut like the weight."""
    for pairs in dist(2, _nf4_shards_and_full, name, lora):
        assert len(pairs) >= 8
        for shard, full in pairs:
            assert torch.equal(shard, full)


def _per_shard_weights(name: str) -> list[str]:
    from megatron_lite.lora.qlora import quantize_base
    from megatron_lite.models.gpt_model import build_model

    ctx, config = get_context(LAYOUTS["tp2"][1]), CONFIG[name](num_layers=1)
    model = build_model(config, ctx, seed=5)
    apply_lora(model, config, QLORA, ctx, seed=7)
    return quantize_base(model, ctx)[1]


def test_qlora_names_the_shards_it_quantises_on_their_own(dist):
    """Hidden 64, FFN 96 at TP=2: linear_proj's 32 and linear_fc2's 48 columns are not whole blocks, so those
    shards are quantised on their own and named (start-up says their rounding depends on the TP size)."""
    for names in dist(2, _per_shard_weights, "llama"):
        assert names == [
            "0.decoder.layers.0.self_attention.linear_proj.weight",
            "0.decoder.layers.0.mlp.linear_fc2.weight",
        ]


def test_adapters_start_as_the_identity_and_only_they_train():
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    config = llama_config(num_layers=2)
    ctx = ParallelContext.virtual(P(), device=torch.device("cpu"))
    base = build_model(config, ctx, seed=3)
    adapted = build_model(config, ctx, seed=3)
    n = apply_lora(adapted, config, LoraConfig(rank=4, alpha=8.0), ctx, seed=1)
    ids = torch.randint(0, 250, (2, 16))
    # B = 0: the same function (to rounding: adding the zero LoRA output changes memory layouts downstream)
    torch.testing.assert_close(adapted(ids), base(ids), rtol=1e-5, atol=1e-6)
    h, d, f = config.hidden_size, config.head_dim, config.ffn_size
    q, kv = config.num_attention_heads * d, config.query_groups * d
    r = 4  # one (A, B) pair per projection, r * (in + out) each: q, k, v; o; gate, up; down
    per_layer = r * ((h + q) + 2 * (h + kv)) + r * (q + h) + 2 * r * (h + f) + r * (f + h)
    assert n == 2 * per_layer == sum(p.numel() for p in adapted.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--lora-target-modules", "q_proj", "experts"], "--lora-target-modules experts: the model has no experts"),
        (["--qlora", "--use-torch-fsdp2"], "--qlora with --use-torch-fsdp2 is not supported"),
        (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"],
         "--lora-rank with --tp-comm-overlap is not supported yet; drop --tp-comm-overlap"),
        (["--lora-target-modules", "q_proj", "lm_head"], "--lora-target-modules lm_head: choose from"),
        # every layer MoE, no shared expert: no linear_fc1 / linear_fc2 anywhere (PEFT: "not found")
        (["--num-experts", "4", "--disable-bias-linear", "--lora-target-modules", "up_proj", "down_proj"],
         "--lora-target-modules linear_fc1 linear_fc2: every layer is MoE without a shared expert"),
        # a GELU MLP's fc1 is one projection (PEFT's up_proj): no gate to adapt alone
        (["--lora-target-modules", "gate_proj"],
         r"--lora-target-modules gate_proj \(linear_fc1_gate\): this model's MLP \(gelu_tanh\) has no gate"),
        # without a rank there are no adapters: the run would have trained every weight
        (["--lora-rank", "0", "--lora-target-modules", "q_proj"], "--lora-target-modules sets up LoRA adapters: add"),
        (["--lora-rank", "0", "--lora-dropout", "0.1"], "--lora-dropout sets up LoRA adapters: add --lora-rank R"),
        (["--lora-alpha", "0"], "--lora-alpha 0 must be > 0"),  # (adapters that add nothing, and learn nothing)
    ],
)  # fmt: skip
def test_what_lora_does_not_compose_with_is_refused_with_the_flags(flags, message):
    from megatron_lite.arguments import parse_args
    from megatron_lite.config import ConfigError

    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-iters 4 --mock-data"
    with pytest.raises(ConfigError, match=message):
        parse_args([*base.split(), "--lora-rank", "4", *flags])


def dropout_masks(config_kw: dict) -> dict[str, list[bool]]:
    """Each adapter's dropped input (--lora-dropout 0.5) in one training forward at TP=2 + SP: which
    entries were zeroed, per adapter pair, on this rank."""
    from megatron_lite.models.gpt_model import build_model

    ctx = get_context(P(tensor_model_parallel_size=2, sequence_parallel=True))
    config = llama_config(num_layers=1, **config_kw)
    ctx.seed(5)
    model = build_model(config, ctx, seed=5)
    targets = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2") + (("experts",) if config.num_experts else ())
    apply_lora(model, config, LoraConfig(rank=4, alpha=8.0, dropout=0.5, target_modules=targets), ctx, seed=1)
    seen = {}

    def record(name, inputs):
        seen.setdefault(name, (inputs[0] == 0).flatten())

    for name, module in model.named_modules():
        if name.endswith(".lora.pairs." + name.rsplit(".", 1)[-1]):
            module.register_forward_pre_hook(lambda m, a, name=name: record(name, a))
    model.train()
    model(torch.randint(0, config.vocab_size, (2, 16)))
    return {k: v.tolist() for k, v in seen.items()}


def test_expert_lora_dropout_leaves_the_default_generator_alone(dist):
    """(From a review: at an expert-TP size below TP the TP ranks give an expert different token counts; an
    expert adapter's dropout drew from the default generator, which on CUDA advances by the tensor's size, so the
    generator the column-parallel adapters need equal across TP parted. Each expert adapter forks one now.)"""
    assert dist(1, _expert_dropout_draws) == [4]


def _expert_dropout_draws() -> int:
    from megatron_lite.models.gpt_model import build_model

    ctx = get_context(P())
    config = llama_config(num_layers=1, num_experts=2, moe_ffn_hidden_size=48)
    ctx.seed(5)
    model = build_model(config, ctx, seed=5)
    apply_lora(model, config, LoraConfig(rank=4, alpha=8.0, dropout=0.5, target_modules=("experts",)), ctx, seed=1)
    adapters = [m for n, m in model.named_modules() if n.endswith(".lora") and ".experts." in n]
    assert len(adapters) == 4  # (fc1 and fc2 of two experts)
    model.train()
    for adapter in adapters:
        x = torch.randn(3, adapter.pairs[next(iter(adapter.pairs))].A.shape[1])
        before, own = torch.get_rng_state(), ctx.rng.get_states()["expert-replicated"]
        adapter(x)
        assert torch.equal(torch.get_rng_state(), before)
        assert not torch.equal(ctx.rng.get_states()["expert-replicated"], own)  # (its mask drawn there)
    return len(adapters)


@pytest.mark.parametrize("kind", ["dense", "experts"])
def test_lora_dropout_draws_a_mask_per_adapter_and_per_rank_where_the_input_is_split(dist, kind):
    """As PEFT's per-module dropout, q, k and v (gate and up) each drop their input with their own mask; a
    row-parallel adapter (o, down, an expert's fc2) sees this rank's slice of the features and drops it with
    the model-parallel (expert-parallel) generator, not with the same mask on both TP ranks; a column-parallel
    one sees the whole input on each rank and drops it alike there (its TP-summed gradient needs that)."""
    one, two = dist(2, dropout_masks, dict(num_experts=2, moe_ffn_hidden_size=48) if kind == "experts" else {})
    assert one.keys() == two.keys() and one
    for name in one:
        row = name.rsplit(".", 1)[-1] in ("proj", "fc2")
        assert (one[name] != two[name]) == row, name
        assert 0.3 < sum(one[name]) / len(one[name]) < 0.7, name
    fused = sorted(k for k in one if k.rsplit(".", 1)[-1] in ("q", "k", "v", "gate", "up"))
    assert fused or kind == "experts"
    for a, b in zip(fused, fused[1:]):
        assert a.rsplit(".", 1)[0] != b.rsplit(".", 1)[0] or one[a] != one[b], (a, b)
