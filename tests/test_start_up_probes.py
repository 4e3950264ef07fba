"""Start-up checks that must hold on every rank before training: the output directories are made and written
(each rank its own probe file), and one rank's failure there is every rank's one line at the configuration
agreement, not a hang."""

from __future__ import annotations

from megatron_lite.config import ConfigError


def _agree_with_error(failing: tuple[int, ...]) -> str:
    import torch
    import torch.distributed as dist

    from megatron_lite.resilience.supervisor import check_config_agreement

    error = f"--save /x{dist.get_rank()} cannot be written" if dist.get_rank() in failing else None
    try:
        check_config_agreement({"lr": 1e-3}, torch.device("cpu"), error=error)
    except ConfigError as e:
        return str(e)
    return "agreed"


def test_a_start_up_failure_of_one_rank_is_every_ranks_one_line(dist):
    """(From a review: a node that could not write --save exited with its line, and the other nodes waited in
    the agreement's all-gather for --distributed-timeout-minutes, then printed a hang report that said nothing of
    why.)"""
    assert dist(4, _agree_with_error, (2,)) == ["--save /x2 cannot be written (rank 2)"] * 4
    assert set(dist(4, _agree_with_error, (1, 3))) == {"--save /x1 cannot be written (rank 1; ranks [1, 3] failed so)"}
    assert dist(2, _agree_with_error, ()) == ["agreed"] * 2


def _agree_on(config_of_rank: dict) -> str:
    import torch
    import torch.distributed as dist

    from megatron_lite.resilience.supervisor import check_config_agreement

    try:
        check_config_agreement(config_of_rank[dist.get_rank()], torch.device("cpu"))
    except ConfigError as e:
        return str(e)
    return "agreed"


def test_where_the_weights_came_from_is_not_a_setting_the_ranks_must_share(dist):
    """(From a review: an old checkpoint's Hugging Face origin is found on each node's own files, so a node
    without the downloaded model refused the resume as 'different configurations'.)"""
    origins = {0: {"lr": 1e-3, "origin": {"converted_from": "/hf"}}, 1: {"lr": 1e-3, "origin": None}}
    assert dist(2, _agree_on, origins) == ["agreed"] * 2
    flags = {0: {"lr": 1e-3}, 1: {"lr": 2e-3}}
    assert all("different configurations" in line for line in dist(2, _agree_on, flags))


def test_write_probes_of_ranks_sharing_a_host_and_pid_do_not_collide(tmp_path):
    """(From a review: the probe was named by host name and pid, which repeat across containers: one rank
    removed the other's file and that one was refused, 119 times in 10000 with two threads.)"""
    import threading

    from megatron_lite.training.configs import check_writable_dir

    failures = []

    def probe():
        for _ in range(300):
            try:
                check_writable_dir("--save", str(tmp_path))
            except ConfigError as e:
                failures.append(str(e))

    threads = [threading.Thread(target=probe) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures and not list(tmp_path.iterdir()), failures[:2]


def test_non_persistent_directories_are_probed_at_start_up_and_named(tmp_path, capsys, monkeypatch):
    """(From a review: --non-persistent-local-ckpt-dir /proc/nope trained to the first non-persistent save,
    which then failed as a --save failure.)"""
    from test_pretrain_cli import _one_line_error, _run

    for kind in ("local", "global"):
        argv = ["--mock-data", "--vocab-size", "100", "--non-persistent-save-interval", "2", "--save",
                str(tmp_path / kind), "--non-persistent-ckpt-type", kind, f"--non-persistent-{kind}-ckpt-dir",
                "/proc/nope"]  # fmt: skip
        rc, out, err = _run(argv, capsys, monkeypatch)
        want = "/proc/nope/0" if kind == "local" else "/proc/nope"
        _one_line_error(rc, err, f"--non-persistent-{kind}-ckpt-dir {want} cannot be written", "(ENOENT)")
        assert "iteration " not in out, out
