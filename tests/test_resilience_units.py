"""Pieces of the fault-tolerance machinery without launching jobs: the start-up configuration check, the
loss-spike detector, the fault-injection grammar and the flags' validation."""

from __future__ import annotations

import os
import re

import pytest

from megatron_lite.config import ConfigError
from megatron_lite.resilience.guards import SpikeDetector
from megatron_lite.resilience.inject import Fault, parse


def _agree(config: dict) -> str:
    import torch
    import torch.distributed as dist

    from megatron_lite.resilience.supervisor import check_config_agreement

    mine = dict(config, lr=config["lr"] * (1 + dist.get_rank() // 2))  # ranks 2 and 3 differ
    if "data" in config:  # (a node-local index cache: each "node" of two ranks its own)
        mine = dict(config, data={**config["data"], "data_cache_path": f"/local/node{dist.get_rank() // 2}"})
    try:
        check_config_agreement(mine, torch.device("cpu"))
    except ConfigError as e:
        return str(e)
    return "agreed"


def test_ranks_with_different_configurations_are_refused_before_training(dist):
    results = dist(4, _agree, {"lr": 1e-3, "layers": 2})
    assert len(set(results)) == 1  # every rank raises the same error
    assert "launched with different configurations" in results[0]
    assert "ranks [0, 1]" in results[0] and "ranks [2, 3]" in results[0]
    assert dist(2, _agree, {"lr": 1e-3}) == ["agreed", "agreed"]
    # (from a data review: a per-node --data-cache-path was refused as another configuration)
    assert dist(4, _agree, {"lr": 1e-3, "data": {"seq_length": 8}}) == ["agreed"] * 4


def test_a_refused_configuration_names_what_differs(dist):
    """The error names the setting that differs and each group of ranks' value, not only hashes: a rank whose own
    file system held another checkpoint had "different configurations" to guess from the same flags."""
    results = dist(4, _agree, {"lr": 1e-3, "found": {"starting_checkpoint": "ck/iter_0000004"}})
    assert len(set(results)) == 1
    assert "lr: ranks [0, 1]: 0.001; ranks [2, 3]: 0.002" in results[0], results[0]
    assert "found.starting_checkpoint" not in results[0]  # (the same everywhere: not named)


def test_spike_detector():
    d = SpikeDetector(window=20, threshold=6.0)
    losses = [3.0 + 0.01 * ((i * 7) % 5) for i in range(20)]
    assert all(d.observe(x) is None for x in losses)
    z = d.observe(3.5)
    assert z is not None and z > 6
    assert d.observe(3.03) is None  # the spike did not enter the history
    assert len(d.losses) == 20
    # with the NaN check off, a NaN loss stays out of the history: the next spike is still seen (it raised)
    assert d.observe(float("nan")) is None and d.observe(float("inf")) is None
    assert d.observe(3.5) > 6
    # a lasting shift: half a window of spikes in a row becomes the history, and the new level is no spike (from
    # a review: every later iteration was one, and --spiky-loss-policy rollback halted the run)
    d = SpikeDetector(window=20, threshold=6.0)
    for x in losses:
        d.observe(x)
    shifted = [3.3 + x - 3.0 for x in losses]
    flagged = [d.observe(x) is not None for x in shifted]
    assert flagged == [True] * 9 + [False] * 11 and d.rebased
    assert list(d.losses) == shifted[:20] and d.observe(3.32) is None
    assert d.observe(3.9) > 6  # and a spike above the new level is still one
    # a loss back to the level ends the run of spikes: the next run counts from one
    d.observe(3.31)
    assert d.in_a_row == []


def test_fault_injection_grammar():
    assert parse("kill,rank=1,iteration=6;slow,rank=0,seconds=0.5") == [
        Fault("kill", 1, 6),
        Fault("slow", 0, None, 0, 0.5),
    ]
    with pytest.raises(ValueError, match="unknown fault"):
        parse("explode,rank=0")
    # (from a review: each was a TypeError or ValueError traceback once the model was built)
    from megatron_lite.config import ConfigError

    for text, fragment in (
        ("kill,iteration=3", "'kill,iteration=3' needs rank=R"),
        ("kill,rank=1,iter=3", "unknown field 'iter'; use rank, iteration"),
        ("slow,rank=0,seconds=abc", "seconds='abc' is not a number"),
    ):
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            parse(text)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--nan-policy", "ignore"], "--nan-policy ignore is not one of skip, halt, rollback"),
        (["--nan-policy", "rollback"], "--nan-policy rollback rolls back to the last checkpoint: it needs --save"),
        (["--check-for-spiky-loss", "--spiky-loss-policy", "rollback"], "--spiky-loss-policy rollback rolls back"),
        (["--exit-signal-handler", "--exit-signal", "SIGHUP"], "--exit-signal SIGHUP is not one of"),
        (["--check-for-spiky-loss", "--spiky-loss-window", "3"], "--spiky-loss-window 3 must be >= 10"),
        (["--check-for-spiky-loss", "--spiky-loss-zscore", "nan"], "--spiky-loss-zscore nan positive"),
        # accepted and then inert: each acts on a check that is off
        (["--spiky-loss-policy", "rollback", "--save", "x"], "--spiky-loss-policy rollback acts on the loss spikes"),
        (["--nan-policy", "skip", "--no-check-for-nan-in-loss-and-grad"], "--nan-policy skip acts on the non-finite"),
        # 0 made the hang watchdog report a healthy run as hung; below 0 the store's socket failed in C++
        (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes 0 must be a positive"),
        (["--distributed-timeout-minutes", "-1"], "--distributed-timeout-minutes -1 must be a positive"),
    ],
)
def test_fault_tolerance_flags_are_validated(flags, message):
    from megatron_lite.arguments import parse_args

    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-iters 4 --mock-data"
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_args([*base.split(), *flags])


def test_backend_timeout_is_pushed_back_only_where_the_flight_recorder_sees_hangs():
    """gloo blocks the host in a hung collective, so the recorder reports at the timeout and the backend's own
    error comes later; NCCL returns once queued, the recorder is blind there, and NCCL keeps the timeout."""
    from megatron_lite.training.pretrain import backend_timeout

    assert backend_timeout("gloo", 600, recorder_on=True) == 2 * 600 + 60
    assert backend_timeout("nccl", 600, recorder_on=True) == 600
    assert backend_timeout("gloo", 600, recorder_on=False) == 600


def _recorded_ops() -> list[str]:
    import torch
    import torch.distributed as dist

    from megatron_lite.config import ParallelConfig
    from megatron_lite.resilience.flight_recorder import FlightRecorder
    from megatron_lite.tensor_parallel import mappings

    from dist_pool import get_context

    ctx = get_context(ParallelConfig(tensor_model_parallel_size=2))
    rec = FlightRecorder(600, store=dist.HashStore(), exit_on_hang=False).install()
    try:
        x = torch.ones(4, 3)
        mappings.all_gather_dim0(x, ctx.tp)  # sequence parallelism's gather
        mappings.reduce_scatter_tensor(torch.empty(2, 3), x, group=ctx.tp.pg)  # what ZeRO's buckets call
        mappings.all_gather_tensor(torch.empty(8, 3), x, group=ctx.tp.pg)  # the distributed optimizer's gather
        dist.all_gather_object([None, None], {"rank": ctx.rank}, group=ctx.tp.pg)  # start-up's agreement checks
    finally:
        rec.uninstall()
    return [e.op for e in rec.history]


def test_the_flight_recorder_sees_the_single_tensor_collectives(dist):
    """Sequence parallelism's and ZeRO's all-gathers and reduce-scatters reach the flight recorder (they were
    bound at import, before the recorder wrapped torch.distributed, so a hang in one went unreported); so does an
    object gather, once (not as its two inner tensor gathers)."""
    for ops in dist(2, _recorded_ops):
        assert len(ops) == 4, ops
        assert "gather" in ops[0] and "scatter" in ops[1] and "gather" in ops[2], ops
        assert ops[3] == "all_gather_object", ops


def _group_by_position() -> list[str]:
    """An all-reduce and an object gather on a one-rank group passed by position, then by name: the groups their
    entries were counted under."""
    import torch
    import torch.distributed as dist

    from megatron_lite.resilience.flight_recorder import FlightRecorder

    rank = dist.get_rank()
    mine = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]  # (every rank makes every group)
    rec = FlightRecorder(600, store=dist.HashStore(), exit_on_hang=False).install()
    try:
        dist.all_reduce(torch.ones(2), dist.ReduceOp.SUM, mine)
        dist.all_gather_object([None], rank, mine)
        dist.all_reduce(torch.ones(2), group=mine)
    finally:
        rec.uninstall()
    return [e.group for e in rec.history]


def test_a_group_passed_by_position_is_the_group_counted(dist):
    """A collective's group given by position is recorded under that group's ranks (it was counted under the
    world's, so a hang in it would have compared counts with ranks outside the group)."""
    for rank, groups in enumerate(dist(2, _group_by_position)):
        assert groups == [str(rank)] * 3, groups


def _pipeline_then_all_reduce() -> list:
    """A three-stage pipeline's exchanges (the middle stage's one batch has both its peers: the world's ranks),
    then an all-reduce over the world, under the flight recorder: (op, group, seq) of each entry."""
    import torch
    import torch.distributed as dist

    from megatron_lite.config import ParallelConfig
    from megatron_lite.resilience.flight_recorder import FlightRecorder

    from dist_pool import get_context

    ctx = get_context(ParallelConfig(pipeline_model_parallel_size=3))
    rank, x = ctx.rank, torch.ones(2)
    rec = FlightRecorder(600, store=dist.HashStore(), exit_on_hang=False).install()
    try:
        for _ in range(2):
            ops = [dist.P2POp(dist.isend, x, rank + 1)] if rank < 2 else []
            ops += [dist.P2POp(dist.irecv, torch.empty(2), rank - 1)] if rank > 0 else []
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        dist.all_reduce(x)
    finally:
        rec.uninstall()
    return [(e.op, e.group, e.seq) for e in rec.history]


def test_pipeline_exchanges_do_not_shift_the_collective_counts(dist):
    """From a review: the middle stage's exchanges (peers 0 and 2: the world's ranks) were counted with the world's
    collectives, so its all-reduce was #3 where the other stages' was #1, and a hang report named it as having
    gone past a collective it waited in."""
    histories = dist(3, _pipeline_then_all_reduce)
    assert [h[-1] for h in histories] == [("all_reduce", "0,1,2", 1)] * 3, histories
    assert histories[1][0] == ("batch_isend_irecv", "0,1,2", 1), histories[1]  # (still named by its ranks)


def _published(seq_by_group: dict, current: dict | None, now: float) -> dict:
    """A rank's state as its watchdog publishes it to the store."""
    return {"time": now, "counts": seq_by_group, "last": {}, "current": current}


def test_the_hang_report_is_about_the_skipped_collective_whichever_rank_fires_first():
    """Rank 1 skipped all-reduce #3 and waits in #4; rank 0 waits in #3. Rank 1 entered its wait first, so on a
    loaded machine its watchdog can fire first and end the job before rank 0's does (CI saw this): both
    reports must name rank 0's wait in #3 and rank 1 as the one that went past it."""
    from megatron_lite.resilience.flight_recorder import Entry, hang_report

    now = 1000.0

    def entry(seq: int, start: float) -> Entry:
        return Entry("0,1", seq, "all_reduce", [[8]], "training/step.py:10 (reduce)", start)

    e3, e4 = entry(3, now - 14), entry(4, now - 17)
    waits = {"since": None, "waiting": False}
    peers = {
        0: _published({"0,1": 3}, {**e3.__dict__, **waits, "since": e3.start}, now),
        1: _published({"0,1": 4}, {**e4.__dict__, **waits, "since": e4.start}, now),
    }
    from_rank_1 = hang_report(1, 15.0, e4, 17.0, peers)
    from_rank_0 = hang_report(0, 15.0, e3, 16.0, peers)
    for report in (from_rank_0, from_rank_1):
        first = report.splitlines()[0]
        assert first.startswith("hang: rank 0 has waited") and "#3 all_reduce on ranks [0,1]" in first, report
        assert "rank 1: AHEAD: went past #3 on this group to #4" in report, report
        assert "summary: ranks [0] wait in all_reduce #3 on ranks [0,1]; rank(s) [1] skipped it" in report, report
    assert "reported by rank 1, which waits 17 s in the later #4 all_reduce" in from_rank_1
    assert "reported by" not in from_rank_0


def test_the_hang_report_names_a_missing_rank():
    """Rank 1 computes forever (never reaches #3): rank 0's report calls it missing."""
    from megatron_lite.resilience.flight_recorder import Entry, hang_report

    e3 = Entry("0,1", 3, "all_reduce", [[8]], "x.py:1 (f)", 984.0)
    peers = {
        0: _published({"0,1": 3}, {**e3.__dict__, "since": 984.0, "waiting": False}, 1000.0),
        1: _published({"0,1": 2}, None, 1000.0),
    }
    report = hang_report(0, 15.0, e3, 16.0, peers)
    assert report.startswith("hang: rank 0 has waited 16 s")
    assert "rank 1: MISSING: has not entered #3" in report and "computing (in no collective)" in report
    assert "rank(s) [1] never reached it" in report


def test_the_hang_report_follows_a_missing_rank_into_another_group():
    """Pipeline-like hang: ranks 0 and 1 share a data-parallel all-reduce; rank 1 never reaches it because it
    waits in a send/recv with rank 3, which computes forever (and rank 2, in the same p2p group, is dead). The
    report names the all-reduce, then follows rank 1's wait to the ranks that hold it up."""
    from megatron_lite.resilience.flight_recorder import Entry, hang_report

    now = 1000.0
    ar = Entry("0,1", 5, "all_reduce", [[8]], "ddp.py:1 (sync)", now - 20)
    p2p = Entry("1,2,3", 7, "batch_isend_irecv", [], "schedule.py:9 (send)", now - 30)
    peers = {
        0: _published({"0,1": 5}, {**ar.__dict__, "since": ar.start, "waiting": False}, now),
        1: _published({"0,1": 4, "p2p:1,2,3": 7}, {**p2p.__dict__, "since": p2p.start, "waiting": False}, now),
        3: _published({"p2p:3,4": 6}, None, now),  # (a p2p entry is keyed by each rank's own peers)
    }
    report = hang_report(0, 15.0, ar, 20.0, peers)
    assert "rank 1: MISSING: has not entered #5" in report, report
    held = [line for line in report.splitlines() if line.strip().startswith("held up by:")]
    assert len(held) == 1, report
    assert "rank 1 waits in #7 batch_isend_irecv on ranks [1,2,3] at schedule.py:9" in held[0], report
    assert "rank 2, which published no state" in held[0] and "rank 3, which is computing" in held[0], report
    assert "rank 1, which" not in held[0], report  # rank 1 entered its own wait
    # rank 3 in an exchange of its own (with counts that cannot be compared): not named as holding rank 1 up
    e3 = Entry("2,3", 2, "batch_isend_irecv", [], "schedule.py:9 (recv)", now - 25)
    peers[3] = _published({"p2p:2,3": 2}, {**e3.__dict__, "since": e3.start, "waiting": False}, now)
    held = [line for line in hang_report(0, 15.0, ar, 20.0, peers).splitlines() if "held up by:" in line]
    assert len(held) == 1 and "rank 2, which published" in held[0] and "rank 3" not in held[0], held


@pytest.mark.parametrize("peer_busy", [True, False])
def test_a_point_to_point_hang_does_not_compare_counts_across_ranks(peer_busy):
    """Each rank keys its batch_isend_irecv by its own peers (rank 0: "0,1"; rank 1, a middle stage: "0,1,2"), so
    rank 1's count under "0,1" says nothing: it is in an exchange of its own, or computing, never 'MISSING'."""
    from megatron_lite.resilience.flight_recorder import Entry, hang_report

    now = 1000.0
    mine = Entry("0,1", 4, "batch_isend_irecv", [], "schedule.py:9 (send)", now - 20)
    theirs = Entry("0,1,2", 9, "batch_isend_irecv", [], "schedule.py:9 (recv)", now - 18)
    peers = {
        0: _published({"p2p:0,1": 4}, {**mine.__dict__, "since": mine.start}, now),
        1: _published({"p2p:0,1,2": 9}, {**theirs.__dict__, "since": theirs.start} if peer_busy else None, now),
        2: _published({"p2p:1,2": 3}, None, now),
    }
    report = hang_report(0, 15.0, mine, 20.0, peers)
    assert "MISSING" not in report and "AHEAD" not in report, report
    summary = next(line for line in report.splitlines() if line.startswith("summary:"))
    if peer_busy:
        assert "rank(s) [1] wait in exchanges of their own" in summary, report
        assert (
            "rank 1 waits in #9 batch_isend_irecv on ranks [0,1,2]" in report and "rank 2, which is computing" in report
        )
    else:
        assert "rank(s) [1] are in no point-to-point exchange" in summary, report
        assert "computing (in no collective)" in report, report


def test_a_rank_that_entered_the_collective_and_waits_elsewhere_is_not_counted_as_waiting_in_it():
    """Three pipeline stages: rank 0 went through the loss all-reduce #7 on the world without the others and waits
    in the embedding all-reduce #3 on [0,2], which rank 2 (in #7) has not entered. Rank 0 has entered #7 as often
    as the others, but is not in it: the report said all three waited in #7 and named no cause."""
    from megatron_lite.resilience.flight_recorder import Entry, hang_report

    now = 1000.0
    loss = Entry("0,1,2", 7, "all_reduce", [[1]], "step.py:203 (train_step)", now - 16)
    emb = Entry("0,2", 3, "all_reduce", [[128, 32]], "step.py:153 (allreduce_embedding_grads)", now - 17)
    peers = {
        0: _published({"0,1,2": 7, "0,2": 3, "p2p:0,1": 9}, {**emb.__dict__, "since": emb.start}, now),
        1: _published({"0,1,2": 7, "p2p:0,1,2": 12}, {**loss.__dict__, "since": loss.start}, now),
        2: _published({"0,1,2": 7, "0,2": 2, "p2p:1,2": 9}, {**loss.__dict__, "since": loss.start}, now),
    }
    report = hang_report(2, 15.0, loss, 16.0, peers)
    summary = next(line for line in report.splitlines() if line.startswith("summary:"))
    assert summary.startswith("summary: ranks [1, 2] wait in all_reduce #7"), report
    assert "rank(s) [0] entered it and are now outside it" in summary, report
    assert "held up by: rank 0 waits in #3 all_reduce on ranks [0,2]" in report, report
    assert "not yet entered by rank 2" in report, report


def test_a_rank_waiting_in_an_overlapped_collective_it_launched_the_next_of_is_waiting_in_it():
    """From a review: overlapped gradient buckets launch reduce-scatter #6 before waiting for #5, so a rank
    waiting in #5 has counted 6 on the group: the report called it (even the reporting rank) AHEAD, as having
    skipped #5."""
    from megatron_lite.resilience.flight_recorder import Entry, hang_report

    now = 1000.0
    e5 = Entry("0,1", 5, "reduce_scatter_tensor", [[64]], "ddp.py:260 (_land)", now - 16)
    peers = {
        0: _published({"0,1": 6}, {**e5.__dict__, "since": e5.start, "waiting": True}, now),
        1: _published({"0,1": 4}, None, now),  # (never reached #5)
    }
    report = hang_report(0, 15.0, e5, 16.0, peers)
    assert "AHEAD" not in report and "skipped" not in report, report
    summary = next(line for line in report.splitlines() if line.startswith("summary:"))
    assert summary.startswith("summary: ranks [0] wait in reduce_scatter_tensor #5") and "[1] never reached" in summary


def test_the_hang_report_follows_a_chain_of_waits_without_looping():
    """Rank 1 waits on rank 2 in group [1,2]; rank 2 waits on rank 1 in group [1,2]'s next collective: a
    cycle. The report follows each wait once and ends."""
    from megatron_lite.resilience.flight_recorder import Entry, hang_report

    now = 1000.0
    ar = Entry("0,1", 2, "all_reduce", [[8]], "a.py:1 (f)", now - 20)
    w1 = Entry("1,2", 3, "all_to_all_single", [], "b.py:1 (g)", now - 25)
    w2 = Entry("2,3", 1, "all_gather", [], "c.py:1 (h)", now - 25)
    w3 = Entry("1,3", 4, "all_reduce", [], "d.py:1 (k)", now - 25)
    peers = {
        0: _published({"0,1": 2}, {**ar.__dict__, "since": ar.start}, now),
        1: _published({"0,1": 1, "1,2": 3, "1,3": 3}, {**w1.__dict__, "since": w1.start}, now),
        2: _published({"1,2": 2, "2,3": 1}, {**w2.__dict__, "since": w2.start}, now),
        3: _published({"2,3": 0, "1,3": 4}, {**w3.__dict__, "since": w3.start}, now),
    }
    report = hang_report(0, 15.0, ar, 20.0, peers)
    held = [line for line in report.splitlines() if line.strip().startswith("held up by:")]
    assert [h.split(" waits in ")[0].split()[-1] for h in held] == ["1", "2", "3"], report
    assert "rank 1, which waits in #3 all_to_all_single on ranks [1,2]" in held[2], report


@pytest.mark.parametrize("flag", ["--save", "--log-jsonl", "--data-cache-path"])
def test_output_paths_that_cannot_be_made_are_refused_at_start_up(tmp_path, capsys, monkeypatch, flag):
    """A --save (or --log-jsonl, ...) under a regular file: one line before any process group. (--save failed at
    the first save on rank 0 alone, after the training before it, the other ranks waiting in a barrier.)"""
    from test_pretrain_cli import _one_line_error, _run

    (tmp_path / "afile").write_text("")
    rc, _, err = _run(["--mock-data", "--vocab-size", "100", flag, str(tmp_path / "afile" / "x")], capsys, monkeypatch)
    _one_line_error(rc, err, flag, "afile is a file, not a directory")
    if flag == "--log-jsonl":  # (and a directory where a file goes)
        rc, _, err = _run(["--mock-data", "--vocab-size", "100", flag, str(tmp_path)], capsys, monkeypatch)
        _one_line_error(rc, err, flag, "is a directory")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_save_directory_that_cannot_be_written_is_refused_before_training(capsys, monkeypatch):
    """--save /proc/nope passed the permission bits (root), trained, then failed at the first save saying "the
    previous checkpoint is untouched: free space there": the directory is made and written at start-up."""
    from test_pretrain_cli import _one_line_error, _run

    rc, out, err = _run(["--mock-data", "--vocab-size", "100", "--save", "/proc/nope"], capsys, monkeypatch)
    _one_line_error(rc, err, "--save /proc/nope cannot be written: making the directory failed: ", "(ENOENT)")
    assert "iteration " not in out, out


def test_a_frozen_rank_is_reported_unresponsive_not_as_the_one_waiting():
    """From the resilience review: rank 1 froze (SIGSTOP, its host lost) just after publishing its state in
    all-reduce #13; rank 0 went on and waits in #17. The report blamed rank 0 (AHEAD, 'skipped it') from rank
    1's 20 s old state; a state older than a live rank's republishing is now a rank that stopped responding."""
    from megatron_lite.resilience.flight_recorder import Entry, hang_report

    now = 1000.0
    e13 = Entry("0,1", 13, "all_reduce", [[1]], "step.py:84 (global_token_count)", now - 20.5)
    e17 = Entry("0,1", 17, "all_reduce", [[1]], "step.py:84 (global_token_count)", now - 16.0)
    peers = {
        0: _published({"0,1": 17}, {**e17.__dict__, "since": e17.start, "waiting": False}, now),
        1: _published({"0,1": 13}, {**e13.__dict__, "since": e13.start, "waiting": False}, now - 20.0),
    }
    report = hang_report(0, 15.0, e17, 16.0, peers, frozen={1})
    assert report.startswith("hang: rank 0 has waited 16 s") and "#17 all_reduce" in report.splitlines()[0], report
    assert "rank 1: UNRESPONSIVE: published nothing in 3 s" in report and "AHEAD" not in report, report
    # (its state is up to a second old: it said "where they stopped" of a PP rank reported 38 iterations behind)
    assert "rank(s) [1] stopped responding (their last state was published up to a second before" in report, report
    # a live rank's state is read as it is, however far its host's clock is from this one's (the diff review: a
    # staleness judged by clocks made one host running 10 s ahead call every other rank unresponsive)
    assert "UNRESPONSIVE" not in hang_report(0, 15.0, e17, 16.0, peers)


def test_the_recorder_finds_a_frozen_rank_by_its_unchanging_state_not_by_clocks(monkeypatch):
    """build_report reads the peers' states twice: one that did not change between the reads is frozen, one that
    did is live, whatever the time it carries (a host 100 s ahead)."""
    from megatron_lite.resilience import flight_recorder as fr

    monkeypatch.setattr(fr.time, "sleep", lambda s: None)
    reads = iter([
        {0: {"time": 5.0}, 1: {"time": 900.0}, 2: {"time": 100.0}},
        {0: {"time": 6.0}, 1: {"time": 901.0}, 2: {"time": 100.0}},
    ])  # fmt: skip
    seen = {}
    rec = fr.FlightRecorder.__new__(fr.FlightRecorder)
    rec.rank, rec.timeout_s, rec.history = 0, 15.0, []
    monkeypatch.setattr(rec, "_publish", lambda: None, raising=False)
    monkeypatch.setattr(rec, "_snapshot", lambda: {"time": 7.0}, raising=False)
    monkeypatch.setattr(rec, "_peers", lambda: next(reads), raising=False)
    monkeypatch.setattr(fr, "hang_report", lambda *a: seen.setdefault("frozen", a[5]) and "" or "")
    rec.build_report(fr.Entry("0,1,2", 1, "all_reduce", [[1]], "x.py:1 (f)", 0.0), 16.0)
    assert seen["frozen"] == {2}


def test_a_different_collective_at_the_same_place_is_a_mismatch():
    """From the resilience review: rank 0 called all_reduce where rank 1 called broadcast (#2 on the group both):
    the summary said both waited in broadcast #2. Different shapes in an all-reduce are a mismatch too; an
    all-to-all's may differ."""
    from megatron_lite.resilience.flight_recorder import Entry, hang_report

    now = 1000.0

    def waiting(op: str, shapes: list, rank_time: float = now) -> dict:
        e = Entry("0,1", 2, op, shapes, "x.py:1 (f)", now - 16)
        return _published({"0,1": 2}, {**e.__dict__, "since": e.start, "waiting": False}, rank_time)

    mine = Entry("0,1", 2, "broadcast", [[4]], "x.py:1 (f)", now - 16)
    for theirs, mismatch in (
        (("all_reduce", [[4]]), True),
        (("broadcast", [[8]]), True),
        (("broadcast", [[4]]), False),
    ):
        report = hang_report(1, 15.0, mine, 16.0, {0: waiting(*theirs), 1: waiting("broadcast", [[4]])})
        summary = next(line for line in report.splitlines() if line.startswith("summary:"))
        assert ("[0] called a different collective there (MISMATCH)" in summary) == mismatch, report
    a2a = Entry("0,1", 2, "all_to_all_single", [[4], [6]], "x.py:1 (f)", now - 16)
    peers = {0: waiting("all_to_all_single", [[6], [4]]), 1: waiting("all_to_all_single", [[4], [6]])}
    assert "MISMATCH" not in hang_report(1, 15.0, a2a, 16.0, peers)


def _straggler_on_rank(computes: list[float], stages: list[int]) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_lite.resilience.straggler import straggler_report

    r = dist.get_rank()
    return straggler_report(computes[r] + 0.1, computes[r], torch.device("cpu"), stages[r])


def test_the_straggler_slowdown_is_against_the_other_ranks_of_its_stage(dist):
    """From the resilience review: the slowest rank was compared with a median it was part of (two ranks: never
    above 2x, 8.6x read as 1.81x), over every pipeline stage (an uneven split looked like a straggler)."""
    # two stages: stage 1 holds more layers (3.0 s); rank 3 is 10% slower than its stage peer
    reports = dist(4, _straggler_on_rank, [1.0, 1.0, 3.0, 3.3], [0, 0, 1, 1])
    assert all(r["straggler_slowest_rank"] == 3 for r in reports)
    assert reports[0]["straggler_slowdown"] == pytest.approx(1.1)
    # two ranks of one stage, one 8.6x slower
    reports = dist(2, _straggler_on_rank, [0.5, 4.3], [0, 0])
    assert reports[0]["straggler_slowdown"] == pytest.approx(8.6)
    from megatron_lite.resilience.straggler import describe

    assert "(8.60x the median of its pipeline stage's other ranks)" in describe(reports[0])
    # a straggler in the lighter stage (from the diff review: the slowest in seconds was always in the heavier one)
    reports = dist(4, _straggler_on_rank, [1.0, 3.0, 5.0, 5.0], [0, 0, 1, 1])
    assert reports[0]["straggler_slowest_rank"] == 1 and reports[0]["straggler_slowdown"] == pytest.approx(3.0)


def test_a_non_finite_loss_with_finite_gradients_is_not_called_skipped():
    """From the resilience review: the optimizer skips on the gradients alone, so a non-finite loss beside a
    finite gradient norm is applied; --nan-policy skip said the update was skipped on every rank."""
    from types import SimpleNamespace

    from megatron_lite.resilience.supervisor import OK, SKIPPED, Supervisor
    from megatron_lite.training.configs import ResilienceConfig

    logs = []
    ctx = SimpleNamespace(rank=0, device="cpu")
    guard = Supervisor(ResilienceConfig(nan_policy="skip"), True, ctx, SimpleNamespace(info=logs.append))
    applied = SimpleNamespace(
        lm_loss=float("inf"), grad_norm=1.5, num_tokens=10, comm_exposed_seconds=0.0, updated=True
    )
    assert guard.after_step(7, 0, applied, None, 0.1) == OK
    assert (
        logs[-1]
        == "iteration 7: non-finite lm_loss (inf) (grad norm 1.5): the gradients were finite and the update was applied"
    )
    skipped = SimpleNamespace(**{**vars(applied), "grad_norm": float("nan"), "updated": False})
    assert guard.after_step(8, 0, skipped, None, 0.1) == SKIPPED and "update skipped on every rank" in logs[-1]


@pytest.mark.parametrize("handler", [True, False])
def test_data_workers_outlive_the_exit_signal(handler):
    """torchrun stops its workers by signalling each one's process group, and Slurm signals every process of the
    job: --num-workers' data-loading processes get --exit-signal too. Under --exit-signal-handler they must keep
    serving batches until the iteration ends and the job saves (from a review: they died of it, and the next batch
    raised "DataLoader worker ... is killed by signal: Terminated" on every rank: no checkpoint)."""
    import os
    import signal
    import time
    from types import SimpleNamespace

    import torch

    from megatron_lite.arguments import parse_args
    from megatron_lite.data.mock import MockGPTDataset
    from megatron_lite.training.batches import Batches

    flags = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 8 --train-iters 4 --mock-data"
    _, job = parse_args([*flags.split(), "--global-batch-size", "2", *(["--exit-signal-handler"] if handler else [])])
    ctx = SimpleNamespace(dp=SimpleNamespace(size=1, rank=0), device=torch.device("cpu"))
    batches = Batches(MockGPTDataset(64, 8), job, ctx, num_workers=1)
    batches.get(0)
    workers = batches._loader._workers
    for w in workers:
        os.kill(w.pid, signal.SIGTERM)
    # (dying may take a loaded machine longer than the half second the survivors are given: waited for)
    deadline = time.monotonic() + (0.5 if handler else 20)
    while time.monotonic() < deadline and (handler or any(w.is_alive() for w in workers)):
        time.sleep(0.05)
    assert all(w.is_alive() for w in workers) == handler
    if handler:
        assert [b["tokens"].shape for b in batches.get(2)] == [torch.Size([1, 8])] * 2
    # and they end with the run (pretrain's finally): multiprocessing's own exit would signal them, then wait
    batches.close()
    assert not any(w.is_alive() for w in workers)


def test_loader_workers_follow_a_jump_in_consumed_samples():
    """--num-workers: a batch asked for at consumed samples other than the loader's next (an --iterations-to-skip
    iteration or a skipped bad batch consumed samples unread; a rollback goes back) is read from there, as without
    workers (a mutation that kept the workers' order passed every test)."""
    from types import SimpleNamespace

    import torch

    from megatron_lite.arguments import parse_args
    from megatron_lite.data.mock import MockGPTDataset
    from megatron_lite.training.batches import Batches

    flags = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 8 --train-iters 8 --mock-data"
    _, job = parse_args([*flags.split(), "--global-batch-size", "2"])
    ctx = SimpleNamespace(dp=SimpleNamespace(size=1, rank=0), device=torch.device("cpu"))
    data = MockGPTDataset(64, 8)
    plain, workers = Batches(data, job, ctx, num_workers=0), Batches(data, job, ctx, num_workers=1)
    try:
        for consumed in (0, 2, 6, 2, 4):  # 4 skipped, then a rollback to 2
            want, got = plain.get(consumed), workers.get(consumed)
            assert len(want) == len(got) and all(torch.equal(w["tokens"], g["tokens"]) for w, g in zip(want, got))
    finally:
        workers.close()
