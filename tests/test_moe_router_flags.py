"""Megatron's --moe-input-jitter-eps, --moe-router-force-load-balancing, --moe-apply-probs-on-input,
--moe-pad-expert-input-to-capacity and --moe-router-load-balancing-type sinkhorn: each against its formula
written out by hand (the jitter drawn by torch.distributions.Uniform's rsample, as Megatron draws it), and training
under a layout equal to one process where the layout keeps the random streams (TP with SP: the router's noise comes
from the default generator, the same on every TP rank) or has no randomness (EP), and under recomputation (the
noise replayed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from test_moe import OPTIM, _compare, moe_config, moe_run

from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.moe.layer import MoELayer
from megatron_lite.moe.router import TopKRouter
from megatron_lite.parallel_context import ParallelContext

P = ParallelConfig
PLAIN = dict(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)  # (the unit tests' oracles route alone)


def _router(**kw) -> tuple[TopKRouter, torch.Tensor]:
    config = moe_config(hidden_size=16, **PLAIN, **kw)
    router = TopKRouter(config, tp_size=1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    return router, torch.randn(48, 16, generator=gen)


def _top2_softmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    top, idx = logits.topk(2, dim=-1)
    return torch.exp(top) / torch.exp(top).sum(-1, keepdim=True), idx


def test_input_jitter_multiplies_the_router_input_by_uniform_noise_in_training():
    router, x = _router(moe_input_jitter_eps=0.3)
    torch.manual_seed(11)
    got = router.train()(x, (48, 1))
    torch.manual_seed(11)  # Megatron's draw: Uniform(1 - eps, 1 + eps).rsample(input.shape)
    noise = torch.distributions.Uniform(torch.tensor(0.7), torch.tensor(1.3)).rsample(x.shape)
    probs, idx = _top2_softmax((x * noise) @ router.weight.detach().T)
    assert torch.equal(got.indices, idx)
    torch.testing.assert_close(got.probs, probs, rtol=1e-6, atol=1e-7)
    plain_probs, plain_idx = _top2_softmax(x @ router.weight.detach().T)
    assert not torch.equal(plain_idx, idx)  # (the noise is large enough to move some tokens)
    evaluated = router.eval()(x, (48, 1))  # no jitter outside training (Switch Transformer's, Hugging Face's)
    assert torch.equal(evaluated.indices, plain_idx)
    torch.testing.assert_close(evaluated.probs, plain_probs, rtol=1e-6, atol=1e-7)


def test_forced_balancing_routes_by_normal_logits_and_passes_their_gradient_through():
    router, x = _router(moe_router_force_load_balancing=True)
    torch.manual_seed(5)
    got = router.train()(x, (48, 1))
    weigh = torch.linspace(-1.0, 1.0, 96).view(48, 2)
    (got.probs * weigh).sum().backward()
    torch.manual_seed(5)
    z = torch.randn(48, 4).requires_grad_()  # Megatron's RandomSTE: logits.clone().normal_()
    probs, idx = _top2_softmax(z)
    assert torch.equal(got.indices, idx)
    torch.testing.assert_close(got.probs, probs.detach(), rtol=1e-6, atol=1e-7)
    (probs * weigh).sum().backward()
    torch.testing.assert_close(router.weight.grad, z.grad.T @ x, rtol=1e-5, atol=1e-6)  # straight through
    # the load is even whatever the weights say: skew them all towards expert 0
    with torch.no_grad():
        router.weight[0] += 100.0
    counts = router(torch.randn(4000, 16), (4000, 1)).counts.float()
    assert (counts - 2000).abs().max() < 150, counts  # (4000 tokens x 2 over 4 experts: 2000 each, +-3 sd)


SINKHORN = dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0)


def test_sinkhorn_routing_balances_the_tokens_and_weighs_them_by_sigmoid_scores():
    """Worked by hand: four tokens whose logits [d, 0] all prefer expert 0 (d = 2, 1, 0.5, 0.1). Sinkhorn's
    balanced matrix gives token i expert 0 with share sigmoid(d_i + b), b set by the column sums (the shares add to
    2): b is about -0.88, so the two strongest tokens keep expert 0 and the two weakest move to expert 1, each
    weighted by the sigmoid of its own logit there. Evaluation takes the plain top-1 of those sigmoids (all expert
    0). Top-2 weighs by the softmax over all experts, not renormalised over the two."""
    router = TopKRouter(moe_config(hidden_size=16, num_experts=2, moe_router_topk=1, **SINKHORN), tp_size=1)
    d = torch.tensor([2.0, 1.0, 0.5, 0.1])
    x = torch.zeros(4, 16)
    x[:, 0] = d
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0, 0] = 1.0  # logits [d_i, 0]
    got = router.train()(x, (4, 1))
    assert got.indices.view(-1).tolist() == [0, 0, 1, 1] and got.counts.tolist() == [2, 2]
    torch.testing.assert_close(got.probs.view(-1), torch.sigmoid(torch.tensor([2.0, 1.0, 0.0, 0.0])))
    assert got.aux_loss is None
    evaluated = router.eval()(x, (4, 1))
    assert evaluated.indices.view(-1).tolist() == [0, 0, 0, 0]
    torch.testing.assert_close(evaluated.probs.view(-1), torch.sigmoid(d))
    router, x = _router(moe_router_topk=2, moe_router_load_balancing_type="sinkhorn")
    got = router.train()(x, (48, 1))
    softmax = torch.softmax(x @ router.weight.detach().T, dim=-1)
    torch.testing.assert_close(got.probs, softmax.gather(-1, got.indices))
    assert (got.probs.sum(-1) < 1).all()


def _hand_expert(expert, x: torch.Tensor) -> torch.Tensor:
    f1, f2 = expert.linear_fc1, expert.linear_fc2
    gate, up = (x @ f1.weight.T + f1.bias).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ f2.weight.T + f2.bias


def test_probs_on_input_scale_the_expert_input_not_its_output():
    """Top-1 with the softmax over all experts (Megatron's required --moe-router-pre-softmax): the output is
    expert_e(p * x) (fc2's bias not weighed), not p * expert_e(x); the router's gradient flows through the input."""
    kw = dict(hidden_size=16, moe_router_topk=1, moe_router_pre_softmax=True, add_bias_linear=True, **PLAIN)
    layers = {}
    for on in (True, False):
        config = moe_config(moe_apply_probs_on_input=on, **kw)
        layers[on] = layer = MoELayer(config, ParallelContext.virtual(P(), device=torch.device("cpu"))).train()
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    x = torch.randn(6, 2, 16, generator=gen)
    layer = layers[True]
    got = layer(x)
    got.square().sum().backward()
    w = layer.router.weight.detach().clone().requires_grad_()
    t = x.reshape(-1, 16)
    scores = torch.softmax(t @ w.T + layer.router.bias.detach(), dim=-1)
    p, e = scores.max(-1)
    experts = layer.experts.local_experts
    with torch.no_grad():
        for m in experts.parameters():
            m.requires_grad_(False)
    want = torch.stack([_hand_expert(experts[int(e[n])], p[n] * t[n]) for n in range(t.shape[0])])
    want.square().sum().backward()
    torch.testing.assert_close(got.reshape(-1, 16), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.router.weight.grad, w.grad, rtol=1e-4, atol=1e-5)
    on_output = torch.stack([p[n] * _hand_expert(experts[int(e[n])], t[n]) for n in range(t.shape[0])])
    torch.testing.assert_close(layers[False](x).reshape(-1, 16), on_output, rtol=1e-5, atol=1e-5)
    assert (want - on_output).abs().max() > 0.1  # (the two differ)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_padding_to_capacity_gives_the_experts_capacity_rows_and_the_same_output(monkeypatch, dispatcher):
    from megatron_lite.moe.experts import ExpertMLP

    seen = []
    forward = ExpertMLP.forward
    monkeypatch.setattr(ExpertMLP, "forward", lambda self, x, *a: seen.append(x.shape[0]) or forward(self, x, *a))
    out = {}
    for pad in (True, False):
        config = moe_config(moe_expert_capacity_factor=1.5, moe_token_dispatcher_type=dispatcher, **PLAIN,
                            moe_pad_expert_input_to_capacity=pad)  # fmt: skip
        layer = MoELayer(config, ParallelContext.virtual(P(), device=torch.device("cpu")))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        x = torch.randn(16, 2, config.hidden_size, generator=gen, requires_grad=True)
        out[pad] = layer(x)
        out[pad].square().sum().backward()
        out[pad] = (out[pad], x.grad, layer.experts.local_experts[0].linear_fc1.weight.grad)
        seen.append(None)
    padded, unpadded = seen[: seen.index(None)], seen[seen.index(None) + 1 : -1]
    assert padded == [24] * 4  # ceil(32 tokens x 2 / 4 experts x 1.5) rows each
    assert len(set(unpadded)) > 1 and max(unpadded) <= 24  # (the routing is uneven: the padding does something)
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kw,fragment",
    [
        (dict(moe_input_jitter_eps=0.0), "--moe-input-jitter-eps 0.0 must be > 0"),
        (dict(moe_pad_expert_input_to_capacity=True), "needs --moe-expert-capacity-factor"),
        (dict(moe_apply_probs_on_input=True), "--moe-apply-probs-on-input with --moe-router-topk 2"),
        (dict(num_experts=None, moe_router_force_load_balancing=True), "--moe-router-force-load-balancing acts on"),
        (dict(moe_router_load_balancing_type="sinkhorn"), "sinkhorn with --moe-aux-loss-coeff 0.01"),
        (dict(SINKHORN, moe_router_score_function="sigmoid"), "--moe-router-score-function sigmoid has no effect"),
    ],
)
def test_bad_settings_are_one_line(kw, fragment):
    with pytest.raises(ConfigError, match=fragment) as err:
        moe_config(**kw).validate()
    assert "\n" not in str(err.value)


def test_megatrons_flags_reach_the_config():
    from megatron_lite.arguments import parse_args

    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-iters 1 --mock-data "
    base += "--vocab-size 100 --num-experts 4 --moe-router-topk 1 --moe-router-pre-softmax "
    base += "--moe-expert-capacity-factor 1"
    flags = " --moe-input-jitter-eps 0.01 --moe-router-force-load-balancing --moe-pad-expert-input-to-capacity "
    model = parse_args((base + flags + "--moe-apply-probs-on-input").split())[1].model
    assert (model.moe_input_jitter_eps, model.moe_router_force_load_balancing) == (0.01, True)
    assert model.moe_pad_expert_input_to_capacity and model.moe_apply_probs_on_input
    # a negative (dropless) factor given: said so (it asked for the factor given, from an exploratory run)
    with pytest.raises(ConfigError, match=r"--moe-expert-capacity-factor -1 is dropless \(a negative factor\)"):
        parse_args((base + " --moe-expert-capacity-factor -1" + flags).split())
    with pytest.raises(ConfigError, match="needs --moe-expert-capacity-factor"):
        parse_args((base.replace(" --moe-expert-capacity-factor 1", "") + flags).split())


def test_resume_takes_the_flags_from_the_checkpoint_and_finetune_keeps_where_the_weight_applies():
    from megatron_lite.arguments import parse_args
    from megatron_lite.checkpoint_flags import flags_from_checkpoint
    from megatron_lite.flag_parser import build_parser

    pretrain = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-iters 4 --mock-data "
    pretrain += "--vocab-size 100 --num-experts 4 --moe-router-topk 1 --moe-router-pre-softmax "
    pretrain += "--moe-apply-probs-on-input --moe-input-jitter-eps 0.01 --moe-router-force-load-balancing "
    pretrain += "--moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity"
    saved = parse_args(pretrain.split())[1].to_dict()

    def load(argv: str):
        return flags_from_checkpoint(build_parser(), argv.split(), build_parser().parse_args(argv.split()), saved, "c")

    ns = load("--load c --train-iters 8")
    assert (ns.moe_input_jitter_eps, ns.moe_router_force_load_balancing) == (0.01, True)
    assert ns.moe_pad_expert_input_to_capacity and ns.moe_apply_probs_on_input
    ns = load("--load c --finetune --seq-length 32 --train-iters 8 --mock-data")
    assert ns.moe_apply_probs_on_input and ns.moe_router_topk == 1
    assert (ns.moe_input_jitter_eps, ns.moe_router_force_load_balancing) == (None, False)


def test_export_to_hugging_face_refuses_weights_on_the_experts_inputs():
    from megatron_lite.models.hf import check_exportable

    config = moe_config(moe_router_topk=1, moe_router_pre_softmax=True)
    check_exportable(config, "Qwen3MoeForCausalLM")
    for arch in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        with pytest.raises(ConfigError, match=r"routing weights on the experts' inputs \(--moe-apply-probs-on-input"):
            check_exportable(dataclasses.replace(config, moe_apply_probs_on_input=True), arch)
    # (Sinkhorn's evaluation weighs a top-1 expert by sigmoid(logit); Mixtral's softmax over one expert gives 1)
    with pytest.raises(ConfigError, match=r"Sinkhorn routing's expert weights"):
        check_exportable(dataclasses.replace(config, moe_router_pre_softmax=False, **SINKHORN), "MixtralForCausalLM")


TOP1 = dict(moe_router_topk=1, moe_router_pre_softmax=True)
LAYOUTS = {
    # the router's noise from the default generator: the same on both TP ranks and in one process
    "jitter-tp2-sp": (P(tensor_model_parallel_size=2, sequence_parallel=True), dict(moe_input_jitter_eps=0.2), {}),
    "forced-balancing-tp2": (P(tensor_model_parallel_size=2), dict(moe_router_force_load_balancing=True), {}),
    "probs-on-input-ep2": (P(expert_model_parallel_size=2), dict(TOP1, moe_apply_probs_on_input=True), {}),
    # (the scaled input's gradient, partial over TP, gives the router a partial gradient summed over TP)
    "probs-on-input-tp2-sp": (
        P(tensor_model_parallel_size=2, sequence_parallel=True),
        dict(TOP1, moe_apply_probs_on_input=True),
        {},
    ),
    # Sinkhorn over the micro-batch's whole sequences: the MoE layer gathers them under SP (Megatron's balances each
    # rank's part of the sequence), and each EP rank balances its own micro-batches as one process does
    "sinkhorn-top1-ep2": (P(expert_model_parallel_size=2), dict(SINKHORN, moe_router_topk=1), {}),
    "sinkhorn-top2-tp2-sp": (P(tensor_model_parallel_size=2, sequence_parallel=True), SINKHORN, {}),
}
PAD = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
for name, parallel, dispatcher in (
    ("alltoall", P(expert_model_parallel_size=2), "alltoall"),
    ("alltoall-overlapped", P(expert_model_parallel_size=2, overlap_moe_expert_parallel_comm=True), "alltoall"),
    ("allgather", P(expert_model_parallel_size=2), "allgather"),
):  # padded (EP=2) against unpadded (one process), the same capacity factor
    LAYOUTS[f"pad-to-capacity-ep2-{name}"] = (
        parallel,
        dict(PAD, moe_token_dispatcher_type=dispatcher),
        dict(moe_pad_expert_input_to_capacity=False),
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_flags_train_as_one_process_does(dist, layout):
    parallel, kw, ref_kw = LAYOUTS[layout]
    config = moe_config(**kw)
    skew = 0.5 if config.moe_expert_capacity_factor else 0.0
    ref = moe_run(dataclasses.replace(config, **ref_kw), P(), 8, 2, iters=3, skew=skew)
    if skew:
        assert ref[0]["dropped"] > 0
    for history in dist(2, moe_run, config, parallel, 8, 2, 3, skew):
        _compare(history, ref)


@pytest.mark.parametrize("recompute", ["full", "moe"])
def test_recomputation_replays_the_routers_noise(recompute):
    """Without the same noise in the recomputed forward, the backward's gradients (grad norm) would differ."""
    config = moe_config(moe_input_jitter_eps=0.2, moe_router_force_load_balancing=True)
    if recompute == "full":
        again = dataclasses.replace(config, recompute_granularity="full", recompute_method="uniform",
                                    recompute_num_layers=1)  # fmt: skip
    else:
        again = dataclasses.replace(config, recompute_granularity="selective", recompute_modules=("moe",))
    optim = dataclasses.replace(OPTIM, lr_warmup_iters=0)
    ref, got = (moe_run(c, P(), 4, 2, iters=1, optim=optim) for c in (config, again))
    for g, r in zip(got, ref):
        assert (g["lm_loss"], g["grad_norm"]) == (r["lm_loss"], r["grad_norm"])


@pytest.mark.parametrize(
    "tokens, topk, experts, factor, capacity",
    # worked by hand: ceil(tokens x top-k / experts x factor), Megatron's get_capacity
    [(10, 2, 4, 1.1, 6), (16, 1, 4, 1.3, 6), (7, 2, 8, 1.0, 2), (12, 2, 4, 0.7, 5), (8, 1, 2, 1.0, 4)],
)
def test_capacity_rounds_up_as_megatron(tokens, topk, experts, factor, capacity):
    """Every distributed capacity test compares with one process, which shares the rule; these sizes are not whole
    numbers, where rounding down (a mutation that passed every test) keeps fewer tokens."""
    from megatron_lite.moe.router import expert_capacity

    config = moe_config(num_experts=experts, moe_router_topk=topk, moe_expert_capacity_factor=factor,
                        moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)  # fmt: skip
    assert expert_capacity(config, tokens) == capacity


def test_the_position_policy_keeps_each_experts_first_capacity_tokens():
    """--moe-token-drop-policy position: an expert keeps exactly the first `capacity` tokens routed to it (8 tokens,
    2 experts, factor 1: 4 each; six go to expert 0, whose last two drop), whatever their probabilities."""
    config = moe_config(num_experts=2, moe_router_topk=1, moe_expert_capacity_factor=1.0, moe_aux_loss_coeff=0.0,
                        moe_z_loss_coeff=None, moe_token_drop_policy="position")  # fmt: skip
    router = TopKRouter(config, tp_size=1)
    indices = torch.tensor([[0]] * 6 + [[1]] * 2)
    keep = router._capacity_keep(torch.linspace(0.1, 0.9, 8).view(8, 1), indices, 8).view(-1).tolist()
    assert keep == [True, True, True, True, False, False, True, True], keep
