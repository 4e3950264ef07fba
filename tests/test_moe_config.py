"""MoE configuration checks: a bad MoE setting is one line naming the flag, and the experts' parameters are placed
and named by global expert (moved out of test_moe.py, which holds the training equivalences)."""

from __future__ import annotations

import dataclasses

import pytest
from test_moe import moe_config

from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.layout_validation import validate_layout
from megatron_lite.models.gpt_model import build_model
from megatron_lite.parallel_context import ParallelContext

P = ParallelConfig


@pytest.mark.parametrize(
    "model_kw,parallel,world,fragment",
    [
        (
            {"num_experts": 6},
            P(expert_model_parallel_size=4),
            4,
            "--num-experts 6 is not divisible by --expert-model-parallel-size 4",
        ),
        (
            {},
            P(expert_model_parallel_size=2, tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
            6,
            "world size 6 is not divisible",
        ),
        ({"moe_router_topk": 5}, P(), 1, "--moe-router-topk 5 must be between 1 and --num-experts 4"),
        (
            {"moe_router_enable_expert_bias": True},
            P(),
            1,
            "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid",
        ),
        ({"moe_router_num_groups": 2}, P(), 1, "--moe-router-num-groups and --moe-router-group-topk go together"),
        ({"moe_router_num_groups": 3, "moe_router_group_topk": 1}, P(), 1, "--moe-router-num-groups 3 must divide"),
        (
            {"moe_router_num_groups": 4, "moe_router_group_topk": 1},
            P(),
            1,
            "--moe-router-topk 2 must be between --moe-router-group-topk 1 and the experts of those groups (1)",
        ),
        (
            {},
            P(expert_tensor_parallel_size=4, tensor_model_parallel_size=2),
            4,
            "--expert-tensor-parallel-size 4 not dividing --tensor-model-parallel-size 2 is not supported yet",
        ),
        (
            {"moe_expert_capacity_factor": 1.0},
            P(
                expert_model_parallel_size=2,
                expert_tensor_parallel_size=1,
                tensor_model_parallel_size=2,
                sequence_parallel=True,
            ),
            2,
            "--expert-tensor-parallel-size 1 below --tensor-model-parallel-size 2 with --moe-expert-capacity-factor",
        ),
        (
            {},
            P(expert_model_parallel_size=2, expert_tensor_parallel_size=1, tensor_model_parallel_size=2),
            2,
            "--expert-tensor-parallel-size 1 below --tensor-model-parallel-size 2 needs --sequence-parallel",
        ),
        (  # (Sinkhorn balances a micro-batch's tokens, and each CP rank holds a part of each sequence)
            {"moe_router_load_balancing_type": "sinkhorn", "moe_aux_loss_coeff": 0.0},
            P(context_parallel_size=2),
            2,
            "--moe-router-load-balancing-type sinkhorn with --context-parallel-size 2 is not supported",
        ),
        (  # (an exploratory review: accepted, the tokens dropped; Megatron's config refuses it)
            {
                "moe_router_load_balancing_type": "sinkhorn",
                "moe_aux_loss_coeff": 0.0,
                "moe_expert_capacity_factor": 1.0,
            },
            P(),
            1,
            "--moe-expert-capacity-factor 1.0 with --moe-router-load-balancing-type sinkhorn: Megatron drops tokens "
            "only with aux_loss, seq_aux_loss, global_aux_loss or none balancing",
        ),
        (
            {"moe_expert_capacity_factor": 1.0},
            P(context_parallel_size=2),
            2,
            "--moe-expert-capacity-factor with --context-parallel-size 2 is not supported yet",
        ),
        (  # (a ValueError from the sharding once the model was built)
            {"moe_shared_expert_intermediate_size": 17},
            P(tensor_model_parallel_size=2),
            2,
            "--moe-shared-expert-intermediate-size 17 is not divisible by --tensor-model-parallel-size 2",
        ),
        (  # (Megatron builds no gate without a shared expert, and says nothing)
            {"moe_shared_expert_gate": True},
            P(),
            1,
            "--moe-shared-expert-gate gates the MoE layers' shared expert and this model has none: add --num-experts "
            "and --moe-shared-expert-intermediate-size",
        ),
        (  # (from the MoE review: without groups it was ignored without a word)
            {"moe_router_group_score_topn": 2},
            P(),
            1,
            "--moe-router-group-score-topn 2 scores groups: it needs --moe-router-num-groups",
        ),
        (  # the dense width counts where a layer is dense (an all-MoE model's was refused for nothing)
            {"ffn_hidden_size": 97, "moe_layer_freq": (1, 0)},
            P(tensor_model_parallel_size=2),
            2,
            "--ffn-hidden-size 97 is not divisible by --tensor-model-parallel-size 2",
        ),
    ],
)
def test_bad_moe_configuration_is_one_line(model_kw, parallel, world, fragment):
    with pytest.raises(ConfigError) as err:
        validate_layout(moe_config(**model_kw), parallel, world)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_an_all_moe_model_needs_no_dense_width_divisible_by_tp():
    validate_layout(moe_config(ffn_hidden_size=97), P(tensor_model_parallel_size=2), 2)


def test_dense_and_expert_parameters_are_placed_and_named_by_global_expert():
    config = moe_config()
    names = []
    for rank in range(2):
        ctx = ParallelContext.virtual(P(expert_model_parallel_size=2), 2, rank)
        model = build_model(config, ctx, device="meta")
        names.append({model.global_name(n) for n, _ in model.named_parameters() if "experts" in n})
    assert names[0].isdisjoint(names[1])  # each expert lives on one EP rank
    one = build_model(config, ParallelContext.virtual(P()), device="meta")
    assert names[0] | names[1] == {one.global_name(n) for n, _ in one.named_parameters() if "experts" in n}
    assert dataclasses.replace(config, num_experts=None).is_moe_layer(0) is False


def test_every_group_chosen_routes_as_plain_top_k():
    """--moe-router-group-topk equal to --moe-router-num-groups, above --moe-router-topk (Megatron's
    deepseek-proxy functional test: 8 groups of 8, top-2): every group is chosen, so the routing is plain top-k,
    which Megatron runs and which was refused here."""
    import torch

    from megatron_lite.moe.router import TopKRouter

    plain = moe_config(hidden_size=16, num_experts=16, moe_router_topk=2, moe_aux_loss_coeff=0.0)
    grouped = dataclasses.replace(plain, moe_router_num_groups=4, moe_router_group_topk=4)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    a, b = TopKRouter(plain, tp_size=1), TopKRouter(grouped, tp_size=1)
    with torch.no_grad():
        a.weight.copy_(torch.randn(a.weight.shape, generator=torch.Generator().manual_seed(1)))
        b.weight.copy_(a.weight)
    ra, rb = a(x, (32, 1)), b(x, (32, 1))
    assert torch.equal(ra.indices, rb.indices) and torch.equal(ra.probs, rb.probs) and not ra.probs.isnan().any()
    with pytest.raises(ConfigError, match="--moe-router-topk 2 must be between --moe-router-group-topk 3"):
        dataclasses.replace(plain, moe_router_num_groups=4, moe_router_group_topk=3)
