"""Multi-token prediction (--mtp-num-layers, DeepSeek-V3): its inputs, an independent reference built from
transformers' DeepSeek-V3 modules, and training under every layout equal to one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from test_hf_reference import _deepseek_v3
from test_train_equivalence import TOL, train_run
from torch import nn

from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.layout_validation import validate_layout
from megatron_lite.models.gpt_model import GPTModel
from megatron_lite.models.hf import config_from_hf
from megatron_lite.models.hf_weights import state_dict_from_hf, state_dict_to_hf
from megatron_lite.models.mtp import mtp_inputs
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.parameters import named_param_meta

from models import gpt2_config, llama_config, rel

V = 250


def test_each_depth_reads_the_tokens_labels_and_mask_k_ahead():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 100, (2, 9), generator=gen)
    labels = torch.randint(0, 100, (2, 9), generator=gen)
    mask = (torch.rand(2, 9, generator=gen) > 0.3).float()
    docs = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])
    out = mtp_inputs({"tokens": tokens, "labels": labels, "loss_mask": mask, "document_ids": docs}, 3)
    assert out["mtp_tokens"].shape == (2, 3, 9)
    for b in range(2):
        for k in range(1, 4):
            for i in range(9):
                ahead = i + k < 9
                assert out["mtp_tokens"][b, k - 1, i] == (tokens[b, i + k] if ahead else 0)
                assert out["mtp_position_ids"][b, k - 1, i] == (i + k if ahead else 0)
                same_doc = ahead and docs[b, i + k] == docs[b, i]
                counted = same_doc and mask[b, i + k] > 0
                assert out["mtp_loss_mask"][b, k - 1, i] == (mask[b, i + k] if same_doc else 0)
                # a token the mask leaves out is labelled -100 (counted_labels), so the fused loss ignores it
                assert out["mtp_labels"][b, k - 1, i] == (labels[b, i + k] if counted else -100)


def _hf_mtp_reference(depths: int):
    """transformers' DeepSeek-V3 with `depths` MTP modules assembled from its own classes (transformers runs no
    MTP): per depth enorm, hnorm, eh_proj, a DeepseekV3DecoderLayer numbered after the last, shared_head.norm.
    Returns the model, the modules, the config and the checkpoint's state dict (DeepSeek's on-disk names)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as M

    hf_config = _deepseek_v3()
    hf_config.num_nextn_predict_layers = depths
    hf_config.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(hf_config).float().eval()
    h, n = hf_config.hidden_size, hf_config.num_hidden_layers
    mtp = nn.ModuleList(
        nn.ModuleDict(
            {
                "enorm": M.DeepseekV3RMSNorm(h, hf_config.rms_norm_eps),
                "hnorm": M.DeepseekV3RMSNorm(h, hf_config.rms_norm_eps),
                "eh_proj": nn.Linear(2 * h, h, bias=False),
                "layer": M.DeepseekV3DecoderLayer(hf_config, n + k),
                "norm": M.DeepseekV3RMSNorm(h, hf_config.rms_norm_eps),
            }
        )
        for k in range(depths)
    ).float()
    mtp.apply(hf._init_weights)  # (modules built outside a PreTrainedModel start uninitialised)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for module in (hf, mtp):
            for p in module.parameters():
                if p.ndim == 1:
                    p.add_(0.1 * torch.randn(p.shape, generator=gen))
            for name, b in module.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    state = dict(hf.state_dict())
    for k, m in enumerate(mtp):
        p = f"model.layers.{n + k}."
        state.update({p + name: t for name, t in m["layer"].state_dict().items()})
        for ours, theirs in (
            ("enorm", "enorm"),
            ("hnorm", "hnorm"),
            ("eh_proj", "eh_proj"),
            ("norm", "shared_head.norm"),
        ):
            state[f"{p}{theirs}.weight"] = m[ours].weight
        state[p + "embed_tokens.weight"] = hf.model.embed_tokens.weight
        state[p + "shared_head.head.weight"] = hf.lm_head.weight
    return hf, mtp, hf_config, state


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    out = torch.zeros_like(x)
    out[:, : x.shape[1] - k] = x[:, k:]
    return out


@pytest.mark.parametrize("depths", [1, 2])
def test_mtp_loss_and_gradients_equal_transformers_modules(depths):
    """The loss main + factor / D x sum over depths of each depth's token mean, and every gradient, against
    transformers' DeepSeek-V3 modules wired as Megatron's MTP block wires them (depth k+1 reads depth k's normalised
    output), with the checkpoint converted."""
    hf, mtp, hf_config, state = _hf_mtp_reference(depths)
    config = config_from_hf(hf_config, mtp_num_layers=depths)
    factor = config.mtp_loss_scaling_factor
    gen = torch.Generator().manual_seed(2)
    b, s = 2, 24
    ids = torch.randint(0, V, (b, s), generator=gen)
    labels = torch.randint(0, V, (b, s), generator=gen)
    mask = (torch.rand(b, s, generator=gen) > 0.2).float()

    # The reference: every depth reads the previous one's normalised output (the main model's final norm first).
    hidden = hf.model(ids).last_hidden_state
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    causal = torch.full((s, s), float("-inf")).triu(1).expand(b, 1, s, s)
    rope = hf.model.rotary_emb(hidden, positions)
    ref_loss = (
        F.cross_entropy(hf.lm_head(hidden).reshape(-1, V), labels.reshape(-1), reduction="none") * mask.reshape(-1)
    ).sum() / mask.sum()
    ref_depths = []
    for k, m in enumerate(mtp, start=1):
        embedded = hf.model.embed_tokens(_shift(ids, k))
        x = m["eh_proj"](torch.cat([m["enorm"](embedded), m["hnorm"](hidden)], -1))
        hidden = m["norm"](m["layer"](x, attention_mask=causal, position_ids=positions, position_embeddings=rope))
        token = F.cross_entropy(hf.lm_head(hidden).reshape(-1, V), _shift(labels, k).reshape(-1), reduction="none")
        mask_k = _shift(mask, k).reshape(-1)
        ref_depths.append((token * mask_k).sum() / mask_k.sum())
    (ref_loss + factor / depths * sum(ref_depths)).backward()

    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    model = GPTModel(config, ctx).train()
    model.load_full_state_dict(state_dict_from_hf(state, config, "DeepseekV3ForCausalLM"))
    mb = mtp_inputs({"tokens": ids, "labels": labels, "loss_mask": mask}, depths)
    counts = mb["mtp_loss_mask"].sum((0, 2))
    model.mtp.loss_scales = [model.mtp.weight / float(n) for n in counts]
    token_loss = model(ids, labels=labels, mtp={k: v for k, v in mb.items() if k.startswith("mtp_")})
    ((token_loss * mask).sum() / mask.sum()).backward()
    depth_losses = model.mtp.take_loss_sums() / counts

    errors = {"loss": rel(((token_loss * mask).sum() / mask.sum()).detach(), ref_loss.detach())}
    for k in range(depths):
        errors[f"mtp_{k + 1} loss"] = rel(depth_losses[k], ref_depths[k].detach())
    grads = {n: p.grad for n, p in hf.named_parameters()}
    for k, m in enumerate(mtp):
        p = f"model.layers.{hf_config.num_hidden_layers + k}."
        grads.update({p + n: t.grad for n, t in m["layer"].named_parameters()})
        for ours, theirs in (
            ("enorm", "enorm"),
            ("hnorm", "hnorm"),
            ("eh_proj", "eh_proj"),
            ("norm", "shared_head.norm"),
        ):
            grads[f"{p}{theirs}.weight"] = m[ours].weight.grad
    hf_grads = state_dict_from_hf(grads, config, "DeepseekV3ForCausalLM")
    ours = {model.global_name(n): (p, meta.shard) for n, p, meta in named_param_meta(model) if p.requires_grad}
    assert set(hf_grads) == set(ours)
    assert any(k.startswith("mtp.layers.") for k in ours)
    for k, g in hf_grads.items():
        p, spec = ours[k]
        errors[k] = rel(p.grad if spec is None else spec.unshard([p.grad]), g)
    bad = {k: v for k, v in errors.items() if not v < 1e-5}
    assert not bad, bad


def test_mtp_state_dict_round_trip_is_exact():
    """Our weights to DeepSeek-V3's on-disk names (with each depth's copies of the embedding and head) and back."""
    _, _, hf_config, state = _hf_mtp_reference(2)
    config = config_from_hf(hf_config, mtp_num_layers=2)
    ours = state_dict_from_hf(state, config, "DeepseekV3ForCausalLM")
    back = state_dict_to_hf(ours, config, "DeepseekV3ForCausalLM")  # (transformers' fused expert tensors)
    copies = {k for k in state if k.endswith(("embed_tokens.weight", "shared_head.head.weight")) and ".layers." in k}
    assert len(copies) == 4 and set(back) == set(state) - copies
    for k, v in back.items():
        assert torch.equal(v, state[k]), k
    on_disk = state_dict_to_hf(ours, config, "DeepseekV3ForCausalLM", on_disk=True)
    for k in copies:
        assert torch.equal(on_disk[k], state[k]), k


MTP_LAYOUTS = {
    # (world, layout, global batch, micro-batch): TP with SP and gradient accumulation, CP (each depth's inputs
    # cut from the whole sequence before the zigzag split), PP (the last stage's copy of the word embeddings,
    # its gradient summed with the first stage's), EP (the MTP layer's experts spread too).
    "tp2-sp-dp2": (4, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), 8, 2),
    "tp2-cp2": (4, ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=2), 4, 2),
    "tp2-pp2": (4, ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 4, 1),
    "ep2-dp2": (2, ParallelConfig(expert_model_parallel_size=2), 4, 1),
}


def _compare_mtp(history, ref):
    for it, ((loss, norm, _, mtp), (rloss, rnorm, _, rmtp)) in enumerate(zip(history, ref)):
        assert abs(loss - rloss) <= TOL * abs(rloss), f"iteration {it + 1}: lm_loss {loss} vs {rloss}"
        assert abs(norm - rnorm) <= TOL * abs(rnorm), f"iteration {it + 1}: grad_norm {norm} vs {rnorm}"
        for k, (a, b) in enumerate(zip(mtp, rmtp)):
            assert abs(a - b) <= TOL * abs(b), f"iteration {it + 1}: mtp_{k + 1} loss {a} vs {b}"


@pytest.mark.parametrize("layout", list(MTP_LAYOUTS))
def test_mtp_trains_like_one_process(dist, layout):
    """DeepSeek-shaped (multi-latent attention, MoE with a shared expert, untied embeddings) with two depths."""
    world, parallel, gbs, mbs = MTP_LAYOUTS[layout]
    ref = train_run("deepseek", ParallelConfig(), gbs, gbs, mtp=2)
    assert all(len(h[3]) == 2 and all(v > 0 for v in h[3]) for h in ref)
    no_mtp = train_run("deepseek", ParallelConfig(), gbs, gbs, iters=3)
    assert ref[0][1] != pytest.approx(no_mtp[0][1], rel=1e-3)  # the depths' losses reach the gradients
    for rank_history in dist(world, train_run, "deepseek", parallel, gbs, mbs, mtp=2):
        _compare_mtp(rank_history, ref)


def test_mtp_with_moe_auxiliary_losses_under_virtual_pipeline_stages_trains_like_one_process(dist):
    """From the pipeline review: the MTP depths' MoE layers with aux and z losses (every MTP layout trains with a
    coefficient of 0) under interleaved 1F1B; the reference's micro-batches are the same (the aux loss is per
    micro-batch)."""
    ref = train_run("deepseekaux", ParallelConfig(), 4, 1, mtp=2, layers=4, iters=4)
    parallel = ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    for rank_history in dist(2, train_run, "deepseekaux", parallel, 4, 1, mtp=2, layers=4, iters=4):
        _compare_mtp(rank_history, ref)


def test_mtp_with_tied_embeddings_under_pipelining_trains_like_one_process(dist):
    """Tied embeddings (Nemotron-shaped, RoPE): the last stage's one copy of the word embeddings serves MTP's
    lookup and the output layer."""
    ref = train_run("nemotron", ParallelConfig(), 4, 4, mtp=1)
    for rank_history in dist(2, train_run, "nemotron", ParallelConfig(pipeline_model_parallel_size=2), 4, 1, mtp=1):
        _compare_mtp(rank_history, ref)


@pytest.mark.parametrize("pp", [1, 2])
def test_mtp_with_learned_positions_is_refused(pp):
    """As Megatron's validate_args (an exploratory port found one process took it: a depth was fed the shifted
    positions, 0 past the end, a rule no reference shares)."""
    with pytest.raises(ConfigError, match="--mtp-num-layers 1 with learned absolute positions .*: add --position-emb"):
        validate_layout(gpt2_config(mtp_num_layers=1), ParallelConfig(pipeline_model_parallel_size=pp), pp)


def test_more_depths_than_the_sequence_holds_are_refused():
    from megatron_lite.config import TrainingConfig

    with pytest.raises(ConfigError, match="--mtp-num-layers 4 predicts past --seq-length 4"):
        validate_layout(llama_config(mtp_num_layers=4), ParallelConfig(), 1, TrainingConfig(seq_length=4))


def test_lora_leaves_the_depths_without_adapters():
    """transformers' DeepSeek-V3, PEFT's base, has no MTP layers: adapters go on the main model only."""
    from megatron_lite.lora.apply import LoraConfig, apply_lora

    from models import deepseek_config

    config = deepseek_config(num_layers=2, mtp_num_layers=1)
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    model = GPTModel(config, ctx)
    apply_lora(
        model, config, LoraConfig(rank=4, alpha=8.0, target_modules=("linear_qkv", "linear_proj", "experts")), ctx, 0
    )
    adapted = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(n.startswith("decoder.") for n in adapted) and not any(n.startswith("mtp.") for n in adapted)


def test_a_checkpoint_with_mtp_layers_converts_both_ways(tmp_path):
    """A DeepSeek-V3 directory whose config.json has num_nextn_predict_layers 2 and the layers after the last
    converts with two depths (restored from our checkpoint by --load), and back to the same tensors and config; a
    config.json that announces layers the files lack (transformers' save_pretrained: its default 1, no tensors)
    converts without them."""
    import json

    from safetensors.torch import load_file, save_file

    from megatron_lite.checkpoint.hf_convert import hf_to_megatron_lite, megatron_lite_to_hf

    _, _, hf_config, state = _hf_mtp_reference(2)
    src, ours, back = (tmp_path / k for k in ("hf", "ours", "back"))
    src.mkdir()
    on_disk = state_dict_to_hf(
        state_dict_from_hf(state, config_from_hf(hf_config, mtp_num_layers=2), "DeepseekV3ForCausalLM"),
        config_from_hf(hf_config, mtp_num_layers=2),
        "DeepseekV3ForCausalLM",
        on_disk=True,
    )
    save_file({k: v.clone() for k, v in on_disk.items()}, str(src / "model.safetensors"))
    hf_config.to_json_file(str(src / "config.json"))
    lines = []
    hf_to_megatron_lite(str(src), str(ours), log=lines.append)
    megatron_lite_to_hf(str(ours), str(back), log=lines.append)
    written = {}
    for f in back.glob("*.safetensors"):
        written.update(load_file(str(f)))
    assert set(written) == set(on_disk) and all(torch.equal(written[k], on_disk[k]) for k in on_disk)
    assert json.loads((back / "config.json").read_text())["num_nextn_predict_layers"] == 2
    assert not any("differs" in line for line in lines)

    # only one of the two depths in the files: a one-line error
    part = {k: v.clone() for k, v in on_disk.items() if not k.startswith("model.layers.4.")}
    save_file(part, str(src / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"num_nextn_predict_layers 2 but the files lack layer\(s\) \[4\]"):
        hf_to_megatron_lite(str(src), str(tmp_path / "partial"), log=lines.append)

    # the same directory without the MTP tensors
    save_file(
        {k: v.clone() for k, v in on_disk.items() if not k.startswith(("model.layers.3.", "model.layers.4."))},
        str(src / "model.safetensors"),
    )
    lines.clear()
    hf_to_megatron_lite(str(src), str(tmp_path / "ours2"), log=lines.append)
    assert any("num_nextn_predict_layers 2 but no such layers" in line for line in lines)


def test_full_recomputation_recomputes_the_depths_with_the_same_gradients():
    """Full uniform recomputation checkpoints each depth's layer too (as Megatron's MTP): same loss and gradients.
    (That the depths' activations are really dropped is test_planner's deepseekmtp-full memory case.)"""
    from models import deepseek_config

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 200, (2, 16), generator=gen)
    batch = mtp_inputs({"tokens": ids, "labels": torch.roll(ids, -1, 1), "loss_mask": torch.ones(2, 16)}, 2)
    mtp = {k: v for k, v in batch.items() if k.startswith("mtp_")}
    results = []
    for recompute in (None, "full"):
        kw = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
        config = deepseek_config(num_layers=2, mtp_num_layers=2, **kw)
        ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
        ctx.seed(0)
        model = GPTModel(config, ctx, seed=5).train()
        model.mtp.loss_scales = [0.05, 0.05]
        loss = model(ids, labels=batch["labels"], mtp=mtp).sum()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys()
    assert any(n.startswith("mtp.") for n in grads_a)
    for n in grads_a:
        assert rel(grads_b[n], grads_a[n]) < 1e-6, n
