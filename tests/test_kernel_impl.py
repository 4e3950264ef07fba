"""The model with --kernel-impl triton (norms, residual-add norm, SwiGLU, quick-GEGLU, RoPE, flash attention,
fused linear cross-entropy) computes what --kernel-impl torch computes: losses and every gradient, on one process
and at TP=2 with sequence parallelism; and 20 training steps give the same loss curve. On a CPU the kernels run
under the Triton interpreter."""

from __future__ import annotations

import dataclasses

import head_start
import pytest
import torch
from test_kernels_bf16 import DTYPES
from test_train_equivalence import train_run

from megatron_lite import kernels as K
from megatron_lite.config import ParallelConfig
from megatron_lite.models.gpt_model import GPTModel
from megatron_lite.models.mtp import mtp_inputs
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.pipeline_parallel.executor import documents
from megatron_lite.tensor_parallel.cross_entropy import counted_labels
from megatron_lite.tensor_parallel.grads import allreduce_sequence_parallel_grads

from dist_pool import get_context
from models import CONFIGS, DEVICE, VOCAB, needs_triton_on_cpu, record_calls, rel

TOL = 1e-5


def loss_and_grads(name, impl, parallel=None, **overrides):
    parallel = parallel or ParallelConfig()
    ctx = get_context(parallel) if parallel.tp > 1 else ParallelContext.virtual(parallel, device=DEVICE)
    ctx.seed(0)
    config = dataclasses.replace(CONFIGS[name](), kernel_impl=impl, **overrides)
    model = GPTModel(config, ctx, seed=3).train()
    gen = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, VOCAB, (2, 16), generator=gen), torch.randint(0, VOCAB, (2, 16), generator=gen)
    loss = model(ids.to(ctx.device), labels=labels.to(ctx.device))
    launches = sum(K.LAUNCHES.values())
    loss.mean().backward()
    allreduce_sequence_parallel_grads(model, ctx.tp, etp=ctx.etp)
    assert (sum(K.LAUNCHES.values()) > launches) == (impl == "triton")  # the kernels ran, on this rank too
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}  # (not expert_bias)


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen3", "nemotron", "deepseek"])
def test_triton_model_equals_torch_model(name):
    launches = sum(K.LAUNCHES.values())
    ours, ours_g = loss_and_grads(name, "triton")
    assert sum(K.LAUNCHES.values()) > launches
    for kind in ("flash_attention_fwd", "cross_entropy_grad", "layer_norm_fwd" if name == "gpt2" else "rope_fwd"):
        assert K.LAUNCHES[kind] > 0, kind
    ref, ref_g = loss_and_grads(name, "torch")
    assert rel(ours, ref) < TOL
    bad = {k: rel(ours_g[k], ref_g[k]) for k in ref_g if not rel(ours_g[k], ref_g[k]) < TOL}
    assert not bad, bad


def test_triton_gpt_oss_model_equals_torch_model(monkeypatch):
    """gpt-oss's activation (quick-GEGLU, offset 1, clamped) in the Triton kernel, in the dense layer's MLP and
    between the experts' grouped GEMMs: torch's loss and every gradient, with both clamps biting."""
    calls = record_calls(monkeypatch, K, "quick_geglu")
    before = K.LAUNCHES["quick_geglu_bwd"], K.LAUNCHES["grouped_gemm_fwd"]
    ours, ours_g = loss_and_grads("gptoss", "triton")
    assert K.LAUNCHES["quick_geglu_bwd"] >= before[0] + 2 and K.LAUNCHES["grouped_gemm_fwd"] > before[1]
    assert len(calls) == 2  # the dense MLP's and the experts'
    for h, offset, clamp in calls:
        f = h.shape[-1] // 2
        assert (offset, clamp) == (1.0, 0.2) and (h[..., :f] > clamp).any() and (h[..., f:].abs() > clamp).any()
    ref, ref_g = loss_and_grads("gptoss", "torch")
    assert len(calls) == 2  # (torch's path runs the reference)
    assert rel(ours, ref) < TOL
    bad = {k: rel(ours_g[k], ref_g[k]) for k in ref_g if not rel(ours_g[k], ref_g[k]) < TOL}
    assert not bad, bad


def test_triton_deepseek_with_megatron_recompute_modules_equals_torch():
    """mla_up_proj (the flash kernel's saved q, k, v made again from the latents), moe_act (around the grouped
    GEMMs) and shared_experts recomputed on the Triton path give the torch path's loss and gradients without
    recomputation."""
    modules = ("layernorm", "mla_up_proj", "moe_act", "shared_experts")
    ours, ours_g = loss_and_grads("deepseek", "triton", recompute_granularity="selective", recompute_modules=modules)
    assert K.LAUNCHES["grouped_gemm_fwd"] > 0
    ref, ref_g = loss_and_grads("deepseek", "torch")
    assert rel(ours, ref) < TOL
    bad = {k: rel(ours_g[k], ref_g[k]) for k in ref_g if not rel(ours_g[k], ref_g[k]) < TOL}
    assert not bad, bad


def test_loss_takes_the_vocab_parallel_path_where_triton_cannot_run(monkeypatch):
    """A --kernel-impl triton model whose tensors Triton cannot run (CPU tensors on a GPU machine) computes its loss
    through the vocab-parallel path, as every other kernel falls back to its reference, instead of raising."""
    ref, _ = loss_and_grads("llama", "torch")
    monkeypatch.setattr(K, "triton_usable", lambda *tensors: False)  # what a CPU tensor on a GPU machine reports
    before = K.LAUNCHES["cross_entropy_stats"]
    ours, _ = loss_and_grads("llama", "triton")
    assert K.LAUNCHES["cross_entropy_stats"] == before  # the fused loss did not run ...
    assert rel(ours, ref) < TOL  # ... and the loss is the same


@needs_triton_on_cpu
def test_triton_model_at_tp2_sp_equals_torch(dist):
    parallel = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    results = {impl: dist(2, loss_and_grads, "llama", impl, parallel) for impl in ("triton", "torch")}
    for (loss, grads), (rloss, rgrads) in zip(results["triton"], results["torch"]):
        assert rel(loss, rloss) < TOL
        assert all(rel(grads[k], rgrads[k]) < TOL for k in rgrads)


def masked_loss_and_grads(name, impl, mtp_depths=0, promised=True):
    """As the training loop calls the model: labels outside the loss mask set to -100 (counted_labels) and the
    per-token losses summed under the mask with one scale (with MTP depths, theirs attached). Not `promised`: as
    a user may, the labels as they are, each token's loss weighted differently, no grads_in_forward."""
    ctx = ParallelContext.virtual(ParallelConfig(), device=DEVICE)
    ctx.seed(0)
    config = dataclasses.replace(CONFIGS[name](), kernel_impl=impl, mtp_num_layers=mtp_depths)
    model = GPTModel(config, ctx, seed=3).train()
    gen = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, VOCAB, (2, 16), generator=gen), torch.randint(0, VOCAB, (2, 16), generator=gen)
    mask = (torch.rand(2, 16, generator=gen) > 0.3).float()
    mb = {"tokens": ids, "labels": labels, "loss_mask": mask}
    mb = {k: v.to(ctx.device) for k, v in (mtp_inputs(mb, mtp_depths) if mtp_depths else mb).items()}
    if promised:
        loss = model(
            mb["tokens"], labels=counted_labels(mb["labels"], mb["loss_mask"]), grads_in_forward=True, **documents(mb)
        )
        ((loss.float() * mb["loss_mask"]).sum() * 0.3).backward()
    else:
        loss = model(mb["tokens"], labels=mb["labels"], **documents(mb))
        weights = torch.rand(loss.shape, generator=torch.Generator().manual_seed(2)).to(loss.device)
        (loss.float() * weights).sum().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("name,mtp_depths", [("llama", 0), ("deepseek", 2)])
def test_masked_training_loss_computes_each_chunks_logits_once(name, mtp_depths):
    """Under the training loop's masked sum the fused cross-entropy makes its gradients in the forward (the last
    loss computed: the main one, or the last MTP depth's) and the backward recomputes no logits but those of the
    losses before it; the result equals the torch path's."""
    import warnings

    before = K.LAUNCHES["cross_entropy_stats"], K.LAUNCHES["cross_entropy_grad"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the recompute warning would fail the test
        ours, ours_g = masked_loss_and_grads(name, "triton", mtp_depths)
    stats, grads = K.LAUNCHES["cross_entropy_stats"] - before[0], K.LAUNCHES["cross_entropy_grad"] - before[1]
    # one chunk per loss here: a loss made in the forward runs stats once, a recomputed one twice
    assert (stats, grads) == (1 + 2 * mtp_depths, 1 + mtp_depths)
    ref, ref_g = masked_loss_and_grads(name, "torch", mtp_depths)
    assert rel(ours, ref) < TOL
    bad = {k: rel(ours_g[k], ref_g[k]) for k in ref_g if not rel(ours_g[k], ref_g[k]) < TOL}
    assert not bad, bad


@pytest.mark.parametrize("name,mtp_depths", [("llama", 0), ("deepseek", 2)])
def test_a_loss_weighted_per_token_is_exact_without_the_promise(name, mtp_depths):
    """The model makes its loss gradients in the forward only when the caller promises the training loop's sum
    (grads_in_forward=True): by default the backward recomputes the logits, so any use of the per-token losses
    is exact, with no warning on a CPU and no device assert on a GPU."""
    import warnings

    before = K.LAUNCHES["cross_entropy_stats"], K.LAUNCHES["cross_entropy_grad"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the broken-promise warning would fail the test
        ours, ours_g = masked_loss_and_grads(name, "triton", mtp_depths, promised=False)
    stats, grads = K.LAUNCHES["cross_entropy_stats"] - before[0], K.LAUNCHES["cross_entropy_grad"] - before[1]
    assert (stats, grads) == (2 * (1 + mtp_depths), 1 + mtp_depths)  # every loss's chunk recomputed once
    ref, ref_g = masked_loss_and_grads(name, "torch", mtp_depths, promised=False)
    assert rel(ours, ref) < TOL
    bad = {k: rel(ours_g[k], ref_g[k]) for k in ref_g if not rel(ours_g[k], ref_g[k]) < TOL}
    assert not bad, bad


def twenty_steps() -> dict:
    """The loss curve of 20 steps under each --kernel-impl, and the kernel launches they made."""
    before = dict(K.LAUNCHES)
    optim = OptimizerConfig(lr=3e-3, lr_warmup_iters=2, lr_decay_style="cosine")
    curves = {
        impl: [
            h[0] for h in train_run("llama", ParallelConfig(), 2, 2, optim=optim, layers=1, iters=20, kernel_impl=impl)
        ]
        for impl in ("triton", "torch")
    }
    return {"curves": curves, "launches": {k: n - before.get(k, 0) for k, n in K.LAUNCHES.items()}}


# (the interpreter's half-minute: started ahead in the background, tests/head_start.py)
head_start.register_call("twenty_steps", "test_kernel_impl", "twenty_steps")


@needs_triton_on_cpu
@pytest.mark.head_start("twenty_steps")
def test_twenty_steps_same_loss_curve():
    run = head_start.call_result("twenty_steps")
    curves, launches = run["curves"], run["launches"]
    assert len(curves["triton"]) == 20
    assert launches.get("flash_attention_fwd", 0) > 0  # the triton run ran the kernels
    # the training loop's loss makes its gradients in the forward: no chunk's logits computed twice
    assert launches.get("cross_entropy_stats", 0) == launches.get("cross_entropy_grad", 0) > 0
    for a, b in zip(curves["triton"], curves["torch"]):
        assert abs(a - b) <= 1e-4 * abs(b), (a, b)


def moe_loss_and_grads(impl, parallel=None, lora=None):
    from test_moe import moe_config

    from megatron_lite.lora.apply import apply_lora

    parallel = parallel or ParallelConfig()
    ctx = get_context(parallel) if parallel.ep > 1 else ParallelContext.virtual(parallel, device=DEVICE)
    ctx.seed(0)
    config = moe_config(kernel_impl=impl, moe_expert_capacity_factor=1.0)
    model = GPTModel(config, ctx, seed=3)
    if lora is not None:
        apply_lora(model, config, lora, ctx, seed=5)
        with torch.no_grad():  # B starts at zero; nonzero, the adapters shape the output and A gets gradients
            for n, p in model.named_parameters():
                if n.endswith(".B"):
                    p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    model.train()
    gen = torch.Generator().manual_seed(1 + ctx.dp.rank)
    ids, labels = torch.randint(0, VOCAB, (2, 16), generator=gen), torch.randint(0, VOCAB, (2, 16), generator=gen)
    loss = model(ids.to(ctx.device), labels=labels.to(ctx.device))
    launches = K.LAUNCHES["grouped_gemm_bwd"]
    loss.mean().backward()
    assert (K.LAUNCHES["grouped_gemm_bwd"] > launches) == (impl == "triton")  # on this rank too
    return loss.detach(), {model.global_name(n): p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("ep", [1, pytest.param(2, marks=needs_triton_on_cpu)])
def test_triton_moe_equals_torch_moe(dist, ep):
    launches = K.LAUNCHES["grouped_gemm_fwd"]
    if ep == 1:
        results = {impl: [moe_loss_and_grads(impl)] for impl in ("triton", "torch")}
        assert K.LAUNCHES["grouped_gemm_fwd"] > launches  # the grouped GEMM really ran
    else:
        parallel = ParallelConfig(expert_model_parallel_size=2)
        results = {impl: dist(2, moe_loss_and_grads, impl, parallel) for impl in ("triton", "torch")}
    for (loss, grads), (rloss, rgrads) in zip(results["triton"], results["torch"]):
        assert rel(loss, rloss) < TOL
        assert grads.keys() == rgrads.keys()
        bad = {k: rel(grads[k], rgrads[k]) for k in rgrads if not rel(grads[k], rgrads[k]) < TOL}
        assert not bad, bad


def test_triton_moe_with_expert_adapters_equals_torch():
    """LoRA on the experts in the grouped-GEMM path (each expert's adapters on its own rows) and in the
    per-expert loop compute the same loss and adapter gradients."""
    from megatron_lite.lora.config import LoraConfig

    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("experts",))
    launches = K.LAUNCHES["grouped_gemm_fwd"]
    (loss, grads), (rloss, rgrads) = (moe_loss_and_grads(impl, lora=lora) for impl in ("triton", "torch"))
    assert K.LAUNCHES["grouped_gemm_fwd"] > launches
    assert rel(loss, rloss) < TOL
    assert grads.keys() == rgrads.keys() and all(".lora." in k for k in grads)
    assert all(grads[k].abs().max() > 0 for k in grads)
    bad = {k: rel(grads[k], rgrads[k]) for k in rgrads if not rel(grads[k], rgrads[k]) < TOL}
    assert not bad, bad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["llama", "gpt2", "deepseek"])
def test_greedy_generation_with_triton_kernels_follows_torch(name, dtype):
    """tools/generate.py runs --kernel-impl triton by default on a GPU, in bf16 with --bf16: the prompt's forward
    and every cached decoding step (one query against the cache: flash attention's bottom-right mask, MLA's
    latents, the MoE kernels) give torch's logits within the dtype's rounding, and each greedy token is torch's
    top token on the same sequence up to that rounding (bf16 may break a near-tie the other way)."""
    from megatron_lite.inference.generation import _forward, generate
    from megatron_lite.inference.kv_cache import KVCache
    from megatron_lite.models.gpt_model import build_model

    ctx = ParallelContext.virtual(ParallelConfig(), device=DEVICE)
    models = {
        impl: build_model(dataclasses.replace(CONFIGS[name](), kernel_impl=impl), ctx, seed=3, dtype=dtype)
        for impl in ("triton", "torch")
    }
    prompt, new = [(11 * i + 5) % VOCAB for i in range(9)], 12
    # what each decoding step runs in Triton (MLA decodes on its absorbed latents, in PyTorch)
    kinds = {"llama": ["flash_attention_fwd", "rms_norm_fwd", "rope_fwd", "swiglu_fwd"],
             "gpt2": ["flash_attention_fwd", "layer_norm_fwd"],
             "deepseek": ["rms_norm_fwd", "rope_fwd", "grouped_gemm_fwd"]}[name]  # fmt: skip
    before = {k: K.LAUNCHES[k] for k in kinds}
    out = generate(models["triton"], ctx, prompt, new, prompt_logprobs=False)
    ids = out["generated_ids"]
    ran = {k: K.LAUNCHES[k] - before[k] for k in kinds}
    assert min(ran.values()) >= new, f"the decoding steps did not all run the Triton kernels: {ran}"
    assert len(ids) == new
    seq = prompt + ids
    with torch.no_grad():
        logits = {impl: _forward(m.eval(), ctx, seq[:-1], KVCache(len(seq)), every=True) for impl, m in models.items()}
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert rel(logits["triton"], logits["torch"]) < tol
    ref = logits["torch"][len(prompt) - 1 :]  # torch's logits where each generated token was chosen
    chosen = ref.gather(1, torch.tensor(ids, device=ref.device)[:, None])[:, 0]
    margin = 3 * tol * ref.pow(2).mean(1).sqrt()  # the dtype's rounding of a logit, per position
    short = (ref.max(1).values - chosen) > margin
    assert not short.any(), f"greedy tokens {short.nonzero()[:, 0].tolist()} are not torch's top token"
    # each step's own logits (the cached decoding, not the whole-sequence forward above) through its log-probability
    # of the token chosen: a step that misread the cache moves them even where the greedy token stays the same
    steps = torch.tensor(out["logprobs"], device=ref.device)
    off = (steps - (chosen - ref.logsumexp(1))).abs()
    assert (off <= margin).all(), f"the decoding steps' log-probabilities are off torch's by {off.tolist()}"
