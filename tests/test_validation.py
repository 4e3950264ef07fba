"""Every bad layout stops at start-up with one line naming the flags, their values and a valid alternative,
before any process group exists (so no rank can be left waiting in a collective). The alternative the
message suggests is checked to be valid."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch.distributed as dist

from megatron_lite.config import ConfigError, ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.layout_validation import validate_layout
from megatron_lite.parallel_context import initialize

from models import llama_config

P = ParallelConfig
T = TrainingConfig

# (world size, model overrides, parallel, training, message pattern, a fix the message proposes)
CASES = {
    "world not divisible by TP x PP x CP": (
        6,
        {},
        P(tensor_model_parallel_size=4),
        None,
        r"^world size 6 is not divisible by --tensor-model-parallel-size 4 x "
        r"--pipeline-model-parallel-size 1 x --context-parallel-size 1 = 4; .*one of \[1, 2, 3, 6\]",
        ("parallel", P(tensor_model_parallel_size=2)),
    ),
    "world not divisible with PP and CP": (
        8,
        {},
        P(tensor_model_parallel_size=2, pipeline_model_parallel_size=3),
        None,
        r"^world size 8 is not divisible by --tensor-model-parallel-size 2 x "
        r"--pipeline-model-parallel-size 3 x --context-parallel-size 1 = 6",
        ("parallel", P(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    ),
    "heads not divisible by TP": (
        8,
        {"num_attention_heads": 12, "num_query_groups": 12, "hidden_size": 96},
        P(tensor_model_parallel_size=8),
        None,
        r"^--num-attention-heads 12 is not divisible by --tensor-model-parallel-size 8; use "
        r"--tensor-model-parallel-size in \[1, 2, 4\]",
        ("parallel", P(tensor_model_parallel_size=4)),
    ),
    "query groups not divisible by TP": (
        4,
        {"num_query_groups": 2},
        P(tensor_model_parallel_size=4),
        None,
        r"^--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4; use "
        r"--tensor-model-parallel-size in \[1, 2\]",
        ("parallel", P(tensor_model_parallel_size=2)),
    ),
    "one query group (--group-query-attention's default) not divisible by TP": (
        2,
        {"num_query_groups": 1},
        P(tensor_model_parallel_size=2),
        None,
        r"^--num-query-groups 1 \(1 is also --group-query-attention's default\) is not divisible",
        ("model", {"num_query_groups": 2}),
    ),
    "ffn hidden size not divisible by TP": (
        4,
        {"ffn_hidden_size": 90},
        P(tensor_model_parallel_size=4),
        None,
        r"^--ffn-hidden-size 90 is not divisible by --tensor-model-parallel-size 4; "
        r"use --ffn-hidden-size 88 or 92",
        ("model", {"ffn_hidden_size": 92}),
    ),
    "layers not divisible by PP": (
        4,
        {"num_layers": 10},
        P(pipeline_model_parallel_size=4),
        None,
        r"^--num-layers 10 is not divisible by --pipeline-model-parallel-size 4 x 1 virtual stages = 4; use "
        r"--num-layers 8 or 12 or a pipeline size in \[1, 2\]",
        ("model", {"num_layers": 12}),
    ),
    "layers not divisible by PP: an uneven first stage": (  # (an exploratory run: not named, though it runs)
        4,
        {"num_layers": 10},
        P(pipeline_model_parallel_size=4),
        None,
        r"^--num-layers 10 is not divisible by .* or a pipeline size in \[1, 2\], or an uneven first stage: "
        r"--decoder-first-pipeline-num-layers 1$",
        ("parallel", P(pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=1)),
    ),
    "layers not divisible by PP x VP: an uneven first stage": (
        4,
        {"num_layers": 12},
        P(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2),
        None,
        r"or an uneven first stage: --decoder-first-pipeline-num-layers 6 with "
        r"--num-virtual-stages-per-pipeline-rank 2$",
        (
            "parallel",
            P(
                pipeline_model_parallel_size=4,
                virtual_pipeline_model_parallel_size=2,
                decoder_first_pipeline_num_layers=6,
            ),
        ),
    ),
    "layers not divisible by PP x VP": (
        4,
        {"num_layers": 12},
        P(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2),
        None,
        r"^--num-layers 12 is not divisible by --pipeline-model-parallel-size 4 x 2 virtual stages = 8; use "
        r"--num-layers 8 or 16",
        ("model", {"num_layers": 16}),
    ),
    "interleaving needs micro-batches multiple of PP": (
        4,
        {"num_layers": 8},
        P(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        T(micro_batch_size=1, global_batch_size=6, seq_length=16),
        r"^the interleaved schedule needs micro-batches per step \(3 = --global-batch-size 6 / "
        r"\(--micro-batch-size 1 x data-parallel 2\)\) to be a multiple of --pipeline-model-parallel-size 2; "
        r"use --global-batch-size 4 or 8$",  # (global batches, each a fix: it said "1 or 2 x 2")
        ("training", T(micro_batch_size=1, global_batch_size=8, seq_length=16)),
    ),
    "a batch ramp under interleaving": (  # (accepted, then the first step's schedule refused 1 micro-batch)
        2,
        {"num_layers": 8},
        P(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        T(micro_batch_size=1, global_batch_size=8, seq_length=16, rampup_batch_size=(1, 1, 64)),
        r"^--rampup-batch-size 1 1 64: with virtual pipeline stages each batch the ramp runs must hold a multiple "
        r"of --pipeline-model-parallel-size 2 micro-batches .*; its batch of 1 does not: use START and INCREMENT "
        r"multiples of 2$",
        # (INCREMENT 1 is not 2 micro-batches, but over 2 samples the ramp runs 2, then the final 8: as Megatron)
        ("training", T(micro_batch_size=1, global_batch_size=8, seq_length=16, rampup_batch_size=(2, 1, 2))),
    ),
    "global batch not divisible by micro batch x DP": (
        4,
        {},
        P(),
        T(micro_batch_size=2, global_batch_size=10, seq_length=16),
        r"^--global-batch-size 10 is not divisible by --micro-batch-size 2 x data-parallel size 4 = 8; use "
        r"--global-batch-size 8 or 16",
        ("training", T(micro_batch_size=2, global_batch_size=16, seq_length=16)),
    ),
    "sequence not divisible by TP under SP": (
        4,
        {},
        P(tensor_model_parallel_size=4, sequence_parallel=True),
        T(seq_length=30),
        r"^--seq-length 30 is not divisible by --tensor-model-parallel-size 4 with --sequence-parallel; use "
        r"--seq-length 28 or 32 or drop --sequence-parallel",
        ("training", T(seq_length=32)),
    ),
    "sequence not divisible by 2 x CP": (
        4,
        {},
        P(context_parallel_size=4),
        T(seq_length=20),
        r"^--seq-length 20 is not divisible by 2 x --context-parallel-size 4 = 8 .*use --seq-length 16 or 24",
        ("training", T(seq_length=24)),
    ),
    "a sequence length learned positions have room for": (  # (68 was offered past 66, then refused for it)
        2,
        {"position_embedding_type": "learned_absolute", "max_position_embeddings": 66},
        P(context_parallel_size=2),
        T(seq_length=66),
        r"^--seq-length 66 is not divisible by 2 x --context-parallel-size 2 = 4 .*use --seq-length 64$",
        ("training", T(seq_length=64)),
    ),
    "bucket size not positive": (  # (from the overlap review: it made one bucket per parameter)
        1,
        {},
        P(),
        T(ddp_bucket_size=0),
        r"^--ddp-bucket-size 0 must be a positive number of elements",
        ("training", T(ddp_bucket_size=100)),
    ),
    "CP part not divisible by TP under SP": (  # (seq must divide by lcm(2 CP, CP TP) = 8, not 2 CP TP = 16)
        8,
        {},
        P(context_parallel_size=2, tensor_model_parallel_size=4, sequence_parallel=True),
        T(seq_length=28),
        r"^--seq-length 28 / --context-parallel-size 2 = 14 tokens per CP rank is not divisible by "
        r"--tensor-model-parallel-size 4 with --sequence-parallel; use --seq-length 24 or 32$",
        ("training", T(seq_length=24)),
    ),
    "heads not divisible by CP under a2a": (
        4,
        {"num_attention_heads": 6, "num_query_groups": 6, "hidden_size": 48},
        P(context_parallel_size=4, cp_comm_type="a2a"),
        T(seq_length=16),
        r"^--cp-comm-type a2a splits attention heads .* --num-attention-heads 6 / --tensor-model-parallel-size 1 "
        r"= 6 is not divisible by --context-parallel-size 4; use --cp-comm-type p2p",
        ("parallel", P(context_parallel_size=4)),
    ),
    "unknown CP communication type": (
        2,
        {},
        P(context_parallel_size=2, cp_comm_type="ring"),
        None,
        r"^--cp-comm-type ring is not supported; use one of p2p, a2a, allgather, a2a\+p2p",
        ("parallel", P(context_parallel_size=2)),
    ),
    "hierarchical CP sizes not multiplying to CP": (
        4,
        {},
        P(context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=(2, 3)),
        T(seq_length=16),
        r"^--hierarchical-context-parallel-sizes 2 3 must be two sizes whose product is --context-parallel-size 4",
        ("parallel", P(context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=(2, 2))),
    ),
    "uneven first stage of no layer": (
        2,
        {"num_layers": 4},
        P(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=0),
        None,
        r"^--decoder-first/last-pipeline-num-layers \[0\] must each be at least 1 \(as in Megatron\)",
        ("parallel", P(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1)),
    ),
    "uneven stages over the layers": (
        2,
        {"num_layers": 4},
        P(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=3, decoder_last_pipeline_num_layers=3),
        None,
        r"^--decoder-first/last-pipeline-num-layers \[3, 3\] do not fit in --num-layers 4",
        ("parallel", P(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=3)),
    ),
    "a2a+p2p without its sizes": (
        4,
        {},
        P(context_parallel_size=4, cp_comm_type="a2a+p2p"),
        T(seq_length=16),
        r"^--cp-comm-type a2a\+p2p and --hierarchical-context-parallel-sizes A P go together",
        ("parallel", P(context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=(1, 4))),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_layout_one_line_before_any_collective(case, monkeypatch):
    world, model_kw, parallel, training, pattern, (what, fix) = CASES[case]
    model = llama_config(**model_kw)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert not dist.is_initialized()
    with pytest.raises(ConfigError) as err:
        initialize(model, parallel, training)
    msg = str(err.value)
    assert "\n" not in msg
    assert re.search(pattern, msg), msg
    # Stopped before joining any process group: no collective was, or could have been, started.
    assert not dist.is_initialized()
    # The alternative the message proposes is valid.
    if what == "parallel":
        parallel = fix
    elif what == "model":
        model = dataclasses.replace(model, **fix)
    else:
        training = fix
    validate_layout(model, parallel, world, training)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (
            {"num_attention_heads": 8, "num_query_groups": 3},
            r"--num-attention-heads 8 is not divisible by --num-query-groups 3",
        ),
        (
            {"hidden_size": 60, "num_attention_heads": 8},
            r"--hidden-size 60 is not divisible by --num-attention-heads 8",
        ),
        ({"normalization": "BatchNorm"}, r"--normalization BatchNorm is not supported"),
        (
            {"recompute_granularity": "full"},
            r"--recompute-granularity full needs --recompute-method uniform\|block",
        ),
        (
            {"recompute_granularity": "full", "recompute_method": "uniform"},
            r"--recompute-granularity full needs --recompute-num-layers >= 1",
        ),
        # (the flag not given is not named as None: a flag-defaults review)
        ({"recompute_method": "block"}, r"^--recompute-method block applies only with --recompute-granularity full"),
        (
            {"recompute_granularity": "selective", "recompute_modules": ("core_attn", "experts")},
            r"--recompute-modules experts not supported",
        ),
        ({"hidden_dropout": 1.5}, r"--hidden-dropout 1.5 must be in \[0, 1\)"),
    ],
)
def test_bad_model_config_one_line(kwargs, pattern):
    with pytest.raises(ConfigError) as err:
        llama_config(**kwargs)
    assert "\n" not in str(err.value)
    assert re.search(pattern, str(err.value)), str(err.value)


def test_good_layout_single_process_needs_no_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    ctx = initialize(llama_config(), ParallelConfig(), TrainingConfig(seq_length=16))
    assert ctx.tp.size == 1 and ctx.dp.size == 1 and not dist.is_initialized()


def test_model_config_defaults_are_megatron_gpt():
    c = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100)
    assert (c.normalization, c.activation, c.position_embedding_type) == (
        "LayerNorm",
        "gelu",
        "learned_absolute",
    )
    assert c.tied_embeddings and c.add_bias_linear and c.ffn_size == 256 and c.head_dim == 16
    assert c.padded_vocab_size(1) == 128 and c.padded_vocab_size(4) == 512


@pytest.mark.parametrize(
    "modules,pattern",
    [
        (("core_attn", "moe"), r"--recompute-modules moe has nothing to recompute without --num-experts; drop it"),
        (
            ("mla_up_proj",),
            r"--recompute-modules mla_up_proj has nothing to recompute without --multi-latent-attention",
        ),
        (("shared_experts",), r"--recompute-modules shared_experts has nothing to recompute without shared experts"),
        (
            ("mlp", "--num-experts", "4", "--disable-bias-linear"),
            r"--recompute-modules mlp is a dense layer's MLP \(as in Megatron\) and every layer here is MoE; use moe",
        ),
    ],
)
def test_recompute_modules_naming_nothing_in_the_model_are_refused_at_start_up(modules, pattern):
    from megatron_lite.arguments import parse_args

    argv = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
    argv += "--train-iters 2 --recompute-granularity selective --recompute-modules " + " ".join(modules)
    with pytest.raises(ConfigError, match=pattern):
        parse_args(argv.split())
