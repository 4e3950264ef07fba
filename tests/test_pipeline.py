"""Pipeline parallelism: schedules checked as data, and training equal to one process.

Equivalence (gloo, fp32, 10 iterations, dropout 0): PP=2 and PP=4 with 1F1B, PP=2 with 2 virtual stages,
PP=2 x TP=2 with sequence parallelism, PP=2 x DP=2, and PP=2 x TP=2 x DP=2 with tied embeddings (8 ranks):
per-iteration lm_loss and grad_norm within 1e-4 of the single-process run."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest
from test_train_equivalence import _compare, train_run

from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.layout_validation import stage_layer_counts
from megatron_lite.pipeline_parallel.schedules import (
    BACKWARD,
    FORWARD,
    Action,
    ScheduleError,
    build_schedule,
    check_schedules,
    compute_order,
    max_in_flight,
    validate,
)


@pytest.mark.parametrize("pp,vp", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (4, 2), (3, 3), (1, 2)])
def test_schedules_are_consistent_and_deadlock_free(pp, vp):
    for m in (1, 2, 3, 4, 6, 8, 12):
        try:
            validate(pp, vp, m)
        except ScheduleError:
            assert vp > 1 and m % pp
            continue
        check_schedules(pp, vp, m)
        check_schedules(pp, vp, m, forward_only=True)
        for r in range(pp):
            acts = build_schedule(pp, vp, m, r)
            if vp == 1:  # Megatron's 1F1B bound on activations kept alive
                assert max_in_flight(acts) <= min(pp - r, m)
            else:
                assert max_in_flight(acts) <= min((pp - r - 1) * 2 + (vp - 1) * pp + 1, m * vp)


@pytest.mark.parametrize("pp,vp", [(2, 1), (4, 1), (2, 2), (4, 2), (3, 3), (8, 4)])
def test_batches_complete_under_nccls_grouped_point_to_point(pp, vp):
    """Under NCCL a batch_isend_irecv completes only when each of its operations meets its partner in the batch
    the peer runs, and a rank's batches run in turn. The interleaved schedule's batches, formed between
    computes, did not: at PP=2 x VP=2 rank 0's send of a gradient waited for a receive queued behind rank 1's
    own send, which waited for rank 0 (gloo, which buffers sends, never showed it)."""
    from megatron_lite.pipeline_parallel.schedules import _simulate_batches

    for m in (pp, 2 * pp, 3 * pp + (vp == 1)):
        for forward_only in (False, True):
            _simulate_batches([build_schedule(pp, vp, m, r, forward_only) for r in range(pp)])
    # what locked there, in small: each rank's send in a batch ahead of the receive its peer's send waits for
    a = Action
    rank0 = [a(FORWARD, 0, 0), a("SF", 0, 0, 1), a(FORWARD, 1, 0), a("RB", 0, 0, 1)]
    rank1 = [a(BACKWARD, 0, 0), a("SB", 0, 0, 0), a(FORWARD, 1, 0), a("RF", 0, 0, 0)]
    with pytest.raises(ScheduleError, match="deadlock under grouped point-to-point"):
        _simulate_batches([rank0, rank1])


def test_the_schedule_printer_prints_readable_actions():
    """`python -m megatron_lite.pipeline_parallel.schedules 4 2 8` (docs/parallelism.md's): every action
    readable, the ends of message batches as | (they printed as X-1.-1), and no arguments is the usage, not a
    traceback."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "megatron_lite.pipeline_parallel.schedules"]
    out = subprocess.run([*cmd, "4", "2", "8"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.count("rank ") == 4, out.stderr
    for line in out.stdout.splitlines():
        actions = line.split(": ", 1)[1].split()
        assert all(a == "|" or re.fullmatch(r"(F|B)\d+\.\d+|(SF|RF|SB|RB)\d+\.\d+@\d", a) for a in actions), line
    usage = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert usage.returncode == 1 and usage.stderr.startswith("usage: ") and "Traceback" not in usage.stderr


def test_1f1b_order_is_warmup_steady_cooldown():
    order = [(k, mb) for k, mb, _ in compute_order(4, 1, 6, 1)]
    assert order[:2] == [(FORWARD, 0), (FORWARD, 1)]  # p - r - 1 = 2 warm-up forwards
    assert order[2:8] == [(FORWARD, 2), (BACKWARD, 0), (FORWARD, 3), (BACKWARD, 1), (FORWARD, 4), (BACKWARD, 2)]
    assert [k for k, _ in order[-3:]] == [BACKWARD] * 3


def _megatron_interleaved_order(pp: int, vp: int, m: int, rank: int, g: int) -> list[tuple]:
    """Megatron-Core's get_schedule_table and get_pp_rank_microbatches written out: forwards in groups of g
    micro-batches through chunk 0, 1, ... (the last group the rest), backwards the same with chunks reversed,
    (pp - rank - 1) * 2 + (vp - 1) * g warm-up forwards, then one forward and one backward, then the cool-down."""
    table = []
    for lo in range(0, m, g):
        hi = m if lo + g >= m else lo + g
        table += [(mb, c) for c in range(vp) for mb in range(lo, hi)]
    warmup = min((pp - rank - 1) * 2 + (vp - 1) * g, m * vp)
    fwd = [(FORWARD, mb, c) for mb, c in table]
    bwd = [(BACKWARD, mb, vp - 1 - c) for mb, c in table]
    order = fwd[:warmup]
    for k in range(m * vp - warmup):
        order += [fwd[warmup + k], bwd[k]]
    return order + bwd[m * vp - warmup :]


def test_microbatch_group_size_orders_as_megatron():
    """--microbatch-group-size-per-virtual-pipeline-stage G (it was "no such flag"): Megatron's order for every
    G it accepts (PP <= G <= M, a last group of 0 or >= PP), deadlock-free, so M need not be a multiple of PP (M=10
    at PP=4, G=5); the default G is PP; what Megatron refuses is refused in one line."""
    for pp, vp in ((2, 2), (3, 2), (4, 2), (2, 3)):
        for m in range(pp, 3 * pp + 3):
            for g in range(pp, m + 1):
                if 0 < m % g < pp:
                    with pytest.raises(ScheduleError, match=f"leave a last group of 0 or at least {pp}"):
                        validate(pp, vp, m, g)
                    continue
                for r in range(pp):
                    assert compute_order(pp, vp, m, r, group=g) == _megatron_interleaved_order(pp, vp, m, r, g)
                check_schedules(pp, vp, m, group=g)
                check_schedules(pp, vp, m, forward_only=True, group=g)
        m = 2 * pp
        assert all(compute_order(pp, vp, m, r) == _megatron_interleaved_order(pp, vp, m, r, pp) for r in range(pp))
    with pytest.raises(ScheduleError, match=r"must lie in \[--pipeline-model-parallel-size 4, 10\]"):
        validate(4, 2, 10, 3)


def test_microbatch_group_size_flag_equals_one_process(dist):
    """PP=2 x VP=2 with 3 micro-batches in one group of 3 (refused without the flag: 3 is not a multiple of 2)."""
    from megatron_lite.arguments import parse_args

    parallel = P(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, microbatch_group_size=3)
    ref = train_run("llama", ParallelConfig(), 6, 6, layers=4)
    for history in dist(2, train_run, "llama", parallel, 6, 2, layers=4):
        _compare(history, ref)
    flags = "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
    flags += "--global-batch-size 3 --train-iters 2 --mock-data --vocab-size 64 --pipeline-model-parallel-size 2 "
    flags += "--num-virtual-stages-per-pipeline-rank 2"
    from megatron_lite.layout_validation import validate_layout

    notes = []

    def check(argv):
        ns, job = parse_args(argv)
        validate_layout(job.model, job.parallel, 2, job.training)
        notes[:] = ns.schedule_notes
        return job

    with pytest.raises(ConfigError, match="to be a multiple of --pipeline-model-parallel-size 2"):
        check(flags.split())
    assert check([*flags.split(), "--microbatch-group-size-per-virtual-pipeline-stage", "3"]).parallel.vp == 2
    # without virtual stages Megatron takes the flag and leaves it unused (it was refused here): said at start-up
    job = check([*flags.split()[:-2], "--microbatch-group-size-per-virtual-pipeline-stage", "3"])
    assert job.parallel.vp == 1 and job.parallel.microbatch_group_size is None
    assert any(n.startswith("--microbatch-group-size-per-virtual-pipeline-stage 3 has no effect") for n in notes)
    with pytest.raises(ConfigError, match="--microbatch-group-size-per-virtual-pipeline-stage 3 with 2 micro"):
        ramp = flags.replace("--train-iters 2", "--train-samples 20").split()
        check([*ramp, "--microbatch-group-size-per-virtual-pipeline-stage", "3", "--rampup-batch-size", "2", "1", "8"])


def test_checker_catches_a_broken_schedule(monkeypatch):
    import megatron_lite.pipeline_parallel.schedules as S

    real = S.compute_order

    def swapped(pp, vp, m, rank, forward_only=False, group=None):  # rank 1 runs its backwards in reverse order
        order = real(pp, vp, m, rank, forward_only, group)
        if rank == 1:
            b = [x for x in order if x[0] == BACKWARD][::-1]
            it = iter(b)
            order = [next(it) if x[0] == BACKWARD else x for x in order]
        return order

    monkeypatch.setattr(S, "compute_order", swapped)
    with pytest.raises(ScheduleError):
        S.check_schedules(3, 1, 4)


def test_interleaving_needs_microbatches_multiple_of_pp():
    with pytest.raises(ScheduleError, match="multiple of --pipeline-model-parallel-size 2"):
        validate(2, 2, 3)


def test_uneven_stages():
    p = ParallelConfig(
        pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=1
    )
    assert stage_layer_counts(10, p) == [1, 4, 4, 1]
    assert stage_layer_counts(
        7, ParallelConfig(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=3)
    ) == [3, 4]
    with pytest.raises(ConfigError, match="do not split evenly"):
        stage_layer_counts(9, p)
    # With virtual stages, as Megatron (it was refused): each rank's layers split evenly over its chunks, chunk c
    # of rank r being stage c * pp + r; the offsets Megatron's get_transformer_layer_offset gives, for
    # (14 layers, PP 4, VP 2, first 2, last 4): 0 1 3 5 | 7 8 10 12
    vp2 = dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)
    counts = stage_layer_counts(14, ParallelConfig(**vp2, decoder_first_pipeline_num_layers=2,
                                                   decoder_last_pipeline_num_layers=4))  # fmt: skip
    assert counts == [1, 2, 2, 2, 1, 2, 2, 2]
    assert [sum(counts[:i]) for i in range(8)] == [0, 1, 3, 5, 7, 8, 10, 12]
    for n, first, fragment in ((7, 1, "--decoder-first-pipeline-num-layers (1) must be divisible by the 2"),
                               (6, 2, "the layers of each middle pipeline rank (1) must be divisible")):  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            stage_layer_counts(n, ParallelConfig(**vp2, decoder_first_pipeline_num_layers=first,
                                                 decoder_last_pipeline_num_layers=2))  # fmt: skip
    with pytest.raises(ConfigError, match="leaves no layer for the other 2 pipeline stage"):  # (it said "do not split")
        stage_layer_counts(4, ParallelConfig(pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=2,
                                             decoder_last_pipeline_num_layers=2))  # fmt: skip


def test_uneven_stages_with_virtual_stages_equal_one_process(dist):
    """--decoder-first-pipeline-num-layers 4 with 2 virtual stages per rank (6 layers: 2 | 1 | 2 | 1)."""
    parallel = P(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                 decoder_first_pipeline_num_layers=4)  # fmt: skip
    ref = train_run("llama", ParallelConfig(), 8, 8, layers=6)
    for history in dist(2, train_run, "llama", parallel, 8, 1, layers=6):
        _compare(history, ref)
    from megatron_lite.arguments import parse_args

    flags = "--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
    flags += "--global-batch-size 8 --train-iters 2 --mock-data --vocab-size 64 --pipeline-model-parallel-size 4 "
    flags += "--decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 2"
    _, job = parse_args([*flags.split(), "--num-virtual-stages-per-pipeline-rank", "2"])
    assert job.parallel.vp == 2
    with pytest.raises(ConfigError, match="use --num-virtual-stages-per-pipeline-rank"):  # (as Megatron refuses)
        parse_args([*flags.split(), "--num-layers-per-virtual-pipeline-stage", "1"])


def test_megatron_pipeline_layout_strings():
    """Megatron's grammar (E, t, m, L, '|', x*n, (...)*n, cosmetic commas) to layers per stage; a misplaced or
    miscounted part is one line."""
    from megatron_lite.layout_validation import parse_pipeline_layout as parse

    assert parse("Et*3|(t*4|)*14,t*2mL", 16, 61, 1) == (3,) + (4,) * 14 + (2,)  # DeepSeek-V3 on PP=16
    assert parse("Et|tt|t|L", 2, 4) == (1, 2, 1, 0)
    assert parse("Et|*3t*2L", 2, 3) == (1, 0, 0, 2)  # ('|' repeats as any character does in Megatron's)
    # Megatron's own DeepSeek-V3 layout gives the MTP layer a stage of its own before the loss's (it was refused):
    # it runs in the loss's stage here, the same math, and start-up says so
    assert parse("Et*3|(tt|)*29,m|L", 16, 61, 1) == (3,) + (2,) * 29 + (0, 0) == parse("Et*3|(tt|)*29,|mL", 16, 61, 1)
    from megatron_lite.megatron_flags import accepted_no_ops

    said = accepted_no_ops(argparse.Namespace(pipeline_model_parallel_layout="Et*3|(tt|)*29,m|L"))
    assert any("MTP layers a stage of their own (...|m|L): they run in the loss's stage here" in x for x in said)
    for text, args, fragment in [
        ("Et*3|(tt|)*28,t|m|tL", (16, 61, 1), "the MTP layers (m) must come last in the loss's stage"),
        ("Etx|L", (1, 1), "unexpected 'x'"),
        ("Et|t|L", (2, 2), "has 3 stages, not a multiple of --pipeline-model-parallel-size 2"),
        ("tE|tL", (2, 2), "E (the embedding) must open the first stage"),
        ("Et|tt", (2, 3), "L (the loss) must close the last stage"),
        ("Et|tL", (2, 3), "it places 2 layers (t) for --num-layers 3"),
        ("(t*2)*999999999", (1, 3), "unrolls to more than 100000 characters"),
        ("E(t*99999)*14000L", (1, 1), "unrolls to more than 100000 characters"),  # (before 1.4e9 are built)
        ("Ett||ttL", (3, 4), "pipeline rank(s) [1] hold no layer in any of their stages"),
        ("Ett|m|L", (3, 2, 1), "hold no layer in any of their stages (the MTP layers' own stage, ...|m|L, runs in"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            parse(text, *args)
    assert stage_layer_counts(4, P(pipeline_model_parallel_size=2, pipeline_layout=(3, 1))) == [3, 1]
    # the model's chunks hold those layers: virtual stage s = chunk * PP + rank
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    from models import llama_config

    layout = (1, 2, 1, 0)
    parallel = P(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_layout=layout)
    for rank in range(2):
        chunks = build_model(llama_config(num_layers=4), ParallelContext.virtual(parallel, 2, rank), device="meta")
        assert [len(c.decoder.layers) for c in chunks] == [layout[c * 2 + rank] for c in range(2)]
    with pytest.raises(ConfigError, match="the job has 2 x 1 stages and --num-layers 5"):
        stage_layer_counts(5, P(pipeline_model_parallel_size=2, pipeline_layout=(3, 1)))


def test_embedding_and_loss_counted_in_the_pipeline_split():
    """Megatron's --account-for-embedding/loss-in-pipeline-split: an even split of the layers plus one for each,
    the first / last stage holding one fewer; a split that is not exact is one line."""
    both = dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    assert stage_layer_counts(62, P(pipeline_model_parallel_size=16, **both)) == [3] + [4] * 14 + [3]
    assert stage_layer_counts(6, P(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, **both)) == [
        1,
        2,
        2,
        1,
    ]
    loss_only = P(pipeline_model_parallel_size=2, account_for_loss_in_pipeline_split=True)
    assert stage_layer_counts(5, loss_only) == [3, 2]
    with pytest.raises(ConfigError, match="use --num-layers 46 or 62"):
        stage_layer_counts(61, P(pipeline_model_parallel_size=16, **both))
    with pytest.raises(ConfigError, match="drop --decoder-first/last-pipeline-num-layers"):
        stage_layer_counts(6, P(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=2, **both))


P = ParallelConfig
LAYOUTS = {
    "pp2": (2, P(pipeline_model_parallel_size=2), 8, 1),
    "pp4": (4, P(pipeline_model_parallel_size=4), 8, 1),
    "pp2-vp2": (2, P(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), 8, 1),
    "pp2-tp2-sp": (4, P(pipeline_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True), 8, 2),
    "pp2-dp2": (4, P(pipeline_model_parallel_size=2), 8, 1),
    "pp2-uneven": (2, P(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1), 4, 1),
    # --pipeline-model-parallel-layout "Et|tt|t|L", "E|t|tt|tL" and "Et|t||ttL": a last stage with the loss alone,
    # a first with the embedding alone, a middle one with nothing (such stages pass activations and gradients on)
    "pp2-vp2-layout-loss-alone": (
        2,
        P(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_layout=(1, 2, 1, 0)),
        8,
        1,
    ),
    "pp2-vp2-layout-embedding-alone": (
        2,
        P(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_layout=(0, 1, 2, 1)),
        8,
        1,
    ),
    # "Ett||tt|L": the second rank's first virtual stage holds nothing at all (no parameter to take a dtype from)
    "pp2-vp2-layout-empty-first-chunk": (
        2,
        P(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_layout=(2, 0, 2, 0)),
        8,
        1,
    ),
    "pp2-vp2-layout-empty-middle": (
        2,
        P(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_layout=(1, 1, 0, 2)),
        8,
        1,
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_equals_single_process(dist, layout):
    world, parallel, gbs, mbs = LAYOUTS[layout]
    ref = train_run("llama", ParallelConfig(), gbs, gbs, layers=4)
    for history in dist(world, train_run, "llama", parallel, gbs, mbs, layers=4):
        _compare(history, ref)


@pytest.mark.slow
def test_pp2_tp2_dp2_tied_embeddings_8_ranks(dist):
    parallel = P(pipeline_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)
    ref = train_run("gpt2", ParallelConfig(), 8, 8, layers=4)
    for history in dist(8, train_run, "gpt2", parallel, 8, 1, layers=4):
        _compare(history, ref)


def test_pp2_tied_embeddings(dist):
    """With --skip-embedding-weight-decay and a strong decay: the last stage's copy of the word embeddings (its
    output layer) is spared decay as the embeddings are, so the two copies stay one weight (a mutation that
    decayed the copy passed every test; the 8-rank test above keeps the default decay of both)."""
    from test_train_equivalence import OPTIM

    optim = dataclasses.replace(OPTIM, weight_decay=5.0, lr=0.02, skip_embedding_weight_decay=True)
    ref = train_run("gpt2", ParallelConfig(), 8, 8, layers=4, optim=optim)
    for history in dist(2, train_run, "gpt2", P(pipeline_model_parallel_size=2), 8, 2, layers=4, optim=optim):
        _compare(history, ref)


def live_outputs(parallel, m, forward_only=False):
    import torch

    from megatron_lite.data.mock import MockGPTDataset, collate
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.pipeline_parallel.executor import run_pipeline

    from dist_pool import get_context
    from models import llama_config

    ctx = get_context(parallel)
    ctx.seed(0)
    chunks = build_model(llama_config(num_layers=4), ctx)
    data = MockGPTDataset(250, 16, seed=0)
    batches = [collate([data[i]]) for i in range(m)]
    stats = {}
    run_pipeline(list(chunks), ctx, batches, (16, 1, 64), torch.float32, 1.0, forward_only, stats=stats)
    if forward_only:
        return ctx.pp.rank, stats["max_live_inputs"]
    return ctx.pp.rank, stats["max_live_outputs"], stats["max_held_bytes"]


@pytest.mark.parametrize("pp,vp", [(4, 1), (2, 2)])
def test_activations_alive_respect_the_bound(dist, pp, vp):
    """Outputs awaiting their backward stay within the schedule's bound; and the bytes a rank holds for the
    pipeline (those outputs and the tensors of its sends in flight) do not grow with the micro-batches: a sent
    output keeps only its graph, and a send's tensor goes once a reply proves it received (from a review: every
    sent tensor lived to the end of the step, 63 of 64 at 32 micro-batches on a PP=4 middle stage)."""
    parallel = P(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp if vp > 1 else None)
    m = 8
    message = 16 * 1 * 64 * 4  # one activation, [seq, micro-batch, hidden] fp32
    many = dict((rank, held) for rank, _, held in dist(pp, live_outputs, parallel, 4 * m))
    for rank, live, held in dist(pp, live_outputs, parallel, m):
        bound = min(pp - rank, m) if vp == 1 else min((pp - rank - 1) * 2 + (vp - 1) * pp + 1, m * vp)
        assert 1 <= live <= bound, (rank, live, bound)
        assert live == max_in_flight(build_schedule(pp, vp, m, rank))  # what the schedule promised, no more
        assert many[rank] == held <= (bound + 1) * message + 64, (rank, held, many[rank])


@pytest.mark.parametrize("pp,vp", [(2, 1), (2, 2)])
def test_evaluation_keeps_no_received_input(dist, pp, vp):
    """A forward-only step (evaluation) has no backward to read a received activation, so none is kept, as
    Megatron's schedules pop them (from a review: every one lived to the step's end, micro-batches x chunks on
    each later stage: 16 GiB a rank for the 70B example script)."""
    parallel = P(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp if vp > 1 else None)
    assert [live for _, live in sorted(dist(pp, live_outputs, parallel, 8, True))] == [0] * pp


def test_the_layout_flag_sets_the_virtual_stages():
    """As in Megatron the layout's stage count over PP gives the virtual stages; flags that would split the
    layers otherwise are refused in one line."""
    from megatron_lite.arguments import parse_args

    base = "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1".split()
    base += ["--global-batch-size", "4", "--pipeline-model-parallel-size", "2", "--train-iters", "2"]
    _, job = parse_args([*base, "--pipeline-model-parallel-layout", "Et|tt|t|L"])
    assert job.parallel.vp == 2 and job.parallel.pipeline_layout == (1, 2, 1, 0)
    _, job = parse_args([*base, "--pipeline-model-parallel-layout", "Ettt|tL"])
    assert job.parallel.vp == 1 and job.parallel.pipeline_layout == (3, 1)
    for extra, fragment in [
        (["--num-virtual-stages-per-pipeline-rank", "4"], "the virtual-stage flags give 4"),
        (["--decoder-first-pipeline-num-layers", "1"], "drop --decoder-first/last-pipeline-num-layers"),
        (["--num-layers-per-virtual-pipeline-stage", "1"], "drop --num-layers-per-virtual-pipeline-stage"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            parse_args([*base, "--pipeline-model-parallel-layout", "Et|tt|t|L", *extra])
    # more stages than pipeline ranks at PP=1: virtual stages without a pipeline, refused before any collective
    from megatron_lite.layout_validation import validate_layout

    # the embedding and loss counted in the split count in --num-layers-per-virtual-pipeline-stage too (Megatron)
    account = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    base2 = [*base[: base.index("--num-layers")], "--num-layers", "2", *base[base.index("--num-layers") + 2 :]]
    _, job = parse_args([*base2, *account, "--num-layers-per-virtual-pipeline-stage", "1"])
    assert job.parallel.vp == 2 and stage_layer_counts(2, job.parallel) == [0, 1, 1, 0]
    pp1 = [*base[: base.index("--pipeline-model-parallel-size")], "--train-iters", "2"]
    _, job = parse_args([*pp1, "--pipeline-model-parallel-layout", "Ett|ttL"])
    assert job.parallel.pp == 1 and job.parallel.vp == 2
    with pytest.raises(ConfigError, match="need --pipeline-model-parallel-size > 1"):
        validate_layout(job.model, job.parallel, 1, job.training)
