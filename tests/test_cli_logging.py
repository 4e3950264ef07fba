"""What a run reports: the memory breakdown, W&B (offline) and TensorBoard records under Megatron's names, and the
console lines as Megatron prints them. (Split from tests/test_pretrain_cli.py.)"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import pytest
import torch
from test_pretrain_cli import TINY, _run


def test_memory_breakdown_is_logged(tmp_path, capsys, monkeypatch):
    import json

    jsonl = tmp_path / "m.jsonl"
    argv = ["--mock-data", "--vocab-size", "100", "--log-memory-breakdown", "--log-jsonl", str(jsonl)]
    rc, _, err = _run([*argv, "--use-distributed-optimizer"], capsys, monkeypatch)
    assert rc == 0, err
    rec = [json.loads(line) for line in jsonl.read_text().splitlines()][-1]
    params = rec["mem_params_bytes"]
    # fp32 on one rank: 2 layers x (QKV + proj + fc1 + fc2 = 12 h^2) + tied embedding, biases and norms.
    assert params >= (2 * 12 * 32 * 32 + 101 * 32) * 4
    # One fp32 gradient per parameter (buckets unpadded at DP=1); ZeRO-1 reduces this rank's part in place.
    assert rec["mem_grads_bytes"] == params
    assert rec["mem_optimizer_bytes"] == 2 * params  # two Adam moments (an fp32 weight is its own main weight)
    assert rec["mem_activations_bytes"] > 0


def _wandb_history(run_dir) -> list[dict]:
    """The history rows of an offline W&B run."""
    return [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
        for record in _wandb_records(run_dir)
        if record.WhichOneof("record_type") == "history"
    ]


def _wandb_records(run_dir) -> list:
    """The records of an offline W&B run, read back from its .wandb file (a LevelDB-style log of protobuf
    records: 32 KiB blocks, each piece behind a 7-byte header, after the 7-byte file header)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = next(run_dir.glob("*.wandb")).read_bytes()
    pos, piece, rows = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # a block's zero-filled tail
            pos += left
            continue
        piece, pos = piece + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a whole record, or its last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(piece)
            rows.append(record)
            piece = b""
    return rows


def test_a_halted_run_is_not_a_finished_one_in_wandb_and_its_config_has_the_layout(tmp_path):
    """From a logging review: W&B marked a run that halted (or raised) as finished with exit code 0, since
    finish() was called without the outcome; and its config lacked world_size, data_parallel_size and the
    resolved ffn_hidden_size / kv_channels / num_query_groups (null), which runs are grouped by."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [*TINY, "--mock-data", "--vocab-size", "100", "--wandb-project", "p", "--check-for-nan-in-loss-and-grad"]
    env = {**os.environ, "WANDB_MODE": "offline", "WORLD_SIZE": "1", "RANK": "0"}
    codes, jobs = {}, {}
    for name, fault in (("ok", None), ("halted", "nan,rank=0,iteration=2")):  # (both at once: W&B's start-up waits)
        run_env = {**env, "MEGATRON_LITE_INJECT_FAULT": fault} if fault else env
        jobs[name] = subprocess.Popen([sys.executable, os.path.join(root, "pretrain", "pretrain_gpt.py"), *argv,
                                       "--wandb-save-dir", str(tmp_path / name)], env=run_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=tmp_path)  # fmt: skip
    for name, job in jobs.items():
        job.communicate(timeout=300)
        out = job
        run = next((tmp_path / name / "wandb").glob("offline-run-*"))
        exits = [r.exit.exit_code for r in _wandb_records(run) if r.WhichOneof("record_type") == "exit"]
        codes[name] = (out.returncode, exits)
        config = {i.key: json.loads(i.value_json) for r in _wandb_records(run) if r.WhichOneof("record_type") ==
                  "run" for i in r.run.config.update}  # fmt: skip
        assert config.get("world_size") == 1 and config.get("data_parallel_size") == 1, sorted(config)[:20]
        assert (config["ffn_hidden_size"], config["kv_channels"], config["num_query_groups"]) == (128, 8, 4)
    assert codes == {"ok": (0, [0]), "halted": (3, [3])}, codes


def test_wandb_mode_follows_a_self_hosted_servers_login(tmp_path, monkeypatch):
    """`wandb login --host` stores the key under the server's host: the run went offline (no upload, one word in
    the log) because only api.wandb.ai was looked for."""
    from megatron_lite.training.logger import _wandb_mode

    (tmp_path / ".netrc").write_text("machine wandb.example.org\n  login user\n  password k\n")
    os.chmod(tmp_path / ".netrc", 0o600)
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert _wandb_mode() == "online"
    monkeypatch.delenv("WANDB_BASE_URL")
    assert _wandb_mode() == "offline"


def test_wandb_entity_and_validation_perplexity(tmp_path):
    """--wandb-entity reaches the (offline, real) W&B run, written under --save as Megatron's default
    --wandb-save-dir (it was the working directory, on every node); validation logs Megatron's perplexity
    exp(lm_loss). As Megatron's training_log, W&B gets each iteration's own loss, grad norm and learning rate
    (--tensorboard-log-interval, default 1) while the console and JSONL show --log-interval's window means (W&B
    had the window's, every --log-interval only)."""
    import math
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [*TINY, "--mock-data", "--vocab-size", "100", "--eval-iters", "2", "--eval-interval", "3"]
    argv += ["--log-interval", "3"]
    argv += ["--wandb-project", "p", "--wandb-entity", "team-x", "--save", str(tmp_path / "ckpt")]
    argv += ["--log-jsonl", str(tmp_path / "m.jsonl")]
    env = {**os.environ, "WANDB_MODE": "offline", "WORLD_SIZE": "1", "RANK": "0"}
    env.pop("WANDB_API_KEY", None)
    out = subprocess.run(
        [sys.executable, os.path.join(root, "pretrain", "pretrain_gpt.py"), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert not (tmp_path / "wandb").exists()
    logs = list((tmp_path / "ckpt" / "wandb" / "wandb").glob("offline-run-*/logs/debug.log"))
    assert len(logs) == 1 and "finishing run team-x/p/" in logs[0].read_text()  # entity/project/run id
    valid = [json.loads(line)["validation"] for line in open(tmp_path / "m.jsonl") if '"validation"' in line]
    assert valid and all(abs(v["ppl"] - math.exp(v["lm_loss"])) < 1e-9 * v["ppl"] for v in valid)
    # Megatron's W&B keys (a dashboard built on its runs shows ours), ours-only metrics under train/, and its
    # flat arguments as the run's config (runs filter on num_layers)
    run = next((tmp_path / "ckpt" / "wandb" / "wandb").glob("offline-run-*"))
    blob = b"".join(p.read_bytes() for p in run.rglob("*.wandb"))
    for key in (
        b"lm loss",
        b"learning-rate",
        b"grad-norm",
        b"batch-size",
        b"lm loss validation",
        b"train/tokens_per_sec",
    ):
        assert key in blob, key
    assert b"train/lm_loss" not in blob
    config = b"".join(p.read_bytes() for p in run.rglob("config.yaml")) or blob
    assert b"num_layers" in config and b"tensor_model_parallel_size" in config
    rows = {r["_step"]: r for r in _wandb_history(run)}
    assert sorted(rows) == [1, 2, 3] and all("lm loss" in r and "grad-norm" in r for r in rows.values())
    (window,) = [r for r in map(json.loads, open(tmp_path / "m.jsonl")) if "lm_loss" in r]
    assert window["lm_loss"] == pytest.approx(sum(r["lm loss"] for r in rows.values()) / 3, rel=1e-6)
    assert window["grad_norm"] == pytest.approx(rows[3]["grad-norm"]) != pytest.approx(rows[2]["grad-norm"])
    assert "iteration-time" in rows[3] and "lm loss validation" in rows[3] and "iteration-time" not in rows[2]


def test_wandb_config_names_the_vocabulary_as_megatron(monkeypatch):
    """W&B's flat config has Megatron's vocab_size (the tokenizer's) and padded_vocab_size (the embedding's rows,
    a multiple of 128 x TP); it had data.vocab_size (the --vocab-size flag, None with a real tokenizer) and
    model.vocab_size, and no padded size."""
    from megatron_lite.arguments import parse_args
    from megatron_lite.training.logger import _flat_config

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    _, job = parse_args([*TINY, "--mock-data", "--vocab-size", "1000", "--tensor-model-parallel-size", "2"])
    flat = _flat_config(job)
    assert (flat["vocab_size"], flat["padded_vocab_size"]) == (1000, 1024)
    assert not [k for k in flat if k.endswith(".vocab_size")]
    # (where the weights came from, checkpoint/origin.py, is no setting: not among W&B's)
    flat = _flat_config(dataclasses.replace(job, origin={"hf_dir": "/x/hf", "converted_from": "/x"}))
    assert not [k for k in flat if "origin" in k or "hf_dir" in k or "converted_from" in k], flat


# Megatron's training_log and evaluate_and_print_results, as a parser written for its logs reads them
MEGATRON_TRAIN_LINE = re.compile(
    r" iteration\s+(\d+)/\s+(\d+) \| consumed samples:\s+(\d+) \| elapsed time per iteration \(ms\): ([\d.]+) \| "
    r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \| learning rate: ([\d.E+-]+) \| global batch size:\s+(\d+) \| "
    r"lm loss: ([\d.E+-]+) \| loss scale: ([\d.]+) \| grad norm: ([\d.]+) \| num zeros: (\d+) \| "
    r"params norm: ([\d.]+) \| number of skipped iterations:\s+(\d+) \|"
)
MEGATRON_VALID_LINE = re.compile(
    r" validation loss at iteration (\d+)( on (?:validation|test) set)? \| lm loss value: ([\d.E+-]+) \| "
    r"lm loss PPL: ([\d.E+-]+) \| "
)


def test_the_decoupled_rate_is_logged_as_megatron_logs_it(tmp_path, capsys, monkeypatch):
    """--decoupled-lr trained the embeddings at its rate but was never logged (Megatron: "decoupled learning
    rate" after "learning rate", W&B's decoupled-learning-rate)."""
    log = tmp_path / "m.jsonl"
    argv = ["--mock-data", "--vocab-size", "100", "--decoupled-lr", "5e-4", "--log-jsonl", str(log)]
    rc, out, err = _run(argv, capsys, monkeypatch)
    assert rc == 0, err
    rates = [json.loads(line)["decoupled_lr"] for line in log.read_text().splitlines()]
    shown = re.findall(r"\| learning rate: [\d.E+-]+ \| decoupled learning rate: ([\d.E+-]+) \| global batch", out)
    assert len(rates) == 3 and [float(x) for x in shown] == pytest.approx(rates, rel=1e-6) and rates[0] > 1e-4


def test_tensorboard_plots_an_evaluation_at_the_samples_consumed_by_then():
    from megatron_lite.training.logger import MetricsLogger

    class Writer:
        calls: list = []

        def add_scalar(self, key, value, step):
            self.calls.append((key, step))

    from megatron_lite.training.configs import LoggingConfig

    logger = MetricsLogger.__new__(MetricsLogger)
    logger.enabled, logger.train_iters, logger._jsonl, logger._wandb, logger._tb = True, 9, None, None, Writer()
    logger._samples, logger.config = 0, LoggingConfig()
    logger.step(4, {"lm_loss": 1.0, "consumed_samples": 16})
    logger.log(4, {"lm_loss": 1.0, "consumed_samples": 16})
    logger.log(6, {"lm_loss": 1.0, "ppl": 2.7}, kind="validation", samples=24)  # (no training line at 6)
    assert ("lm loss validation vs samples", 24) in Writer.calls and ("lm loss vs samples", 16) in Writer.calls
    # (an exploratory run: the peak went to train/peak_memory_bytes, where a dashboard or golden-value tool ported
    # from Megatron reads mem-max-allocated-bytes, as --log-memory-to-tensorboard writes it, with no "vs samples")
    logger.log(8, {"peak_memory_bytes": 123, "max_rss_bytes": 5})
    assert {("mem-max-allocated-bytes", 8), ("train/max_rss_bytes", 8)} <= set(Writer.calls), Writer.calls
    assert not [k for k, _ in Writer.calls if k.startswith(("train/peak", "mem-max-allocated-bytes vs"))]


def test_tensorboard_gets_each_iterations_values(tmp_path, capsys, monkeypatch):
    """A real TensorBoard event file (skipped where the package is absent, as in CI): each iteration's own lm loss
    and grad norm every --tensorboard-log-interval, the window's iteration time at --log-interval, the window's
    mean loss in the JSONL; --tensorboard-queue-size reaches the writer."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    queues = []
    real = SummaryWriter.__init__
    monkeypatch.setattr(SummaryWriter, "__init__", lambda self, *a, **k: queues.append(k) or real(self, *a, **k))
    argv = ["--mock-data", "--vocab-size", "100", "--train-iters", "4", "--log-interval", "4"]
    argv += ["--tensorboard-dir", str(tmp_path / "tb"), "--tensorboard-log-interval", "2"]
    rc, _, err = _run([*argv, "--tensorboard-queue-size", "7", "--log-jsonl", str(tmp_path / "m.jsonl")],
                      capsys, monkeypatch)  # fmt: skip
    assert rc == 0, err
    assert [q.get("max_queue") for q in queues] == [7]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    loss = {e.step: e.value for e in events.Scalars("lm loss")}
    assert sorted(loss) == [2, 4] and [e.step for e in events.Scalars("grad-norm")] == [2, 4]
    assert [e.step for e in events.Scalars("iteration-time")] == [4]
    (window,) = [r for r in map(json.loads, open(tmp_path / "m.jsonl")) if "lm_loss" in r]
    assert window["lm_loss"] != pytest.approx(loss[4], rel=1e-6)  # (the mean of iterations 1-4)


def test_the_console_reads_as_megatrons(tmp_path, capsys, monkeypatch):
    """The iteration line has Megatron's fields, labels, formats and order (a regex written for its logs reads
    ours), values equal to the JSONL record's; evaluations print its validation line, the run's end evaluating the
    validation set again (Megatron's pretrain(); it was skipped when just evaluated) and then the test set."""
    log = tmp_path / "m.jsonl"
    argv = ["--mock-data", "--vocab-size", "100", "--log-params-norm", "--log-num-zeros-in-grad", "--eval-iters", "1"]
    rc, out, err = _run([*argv, "--eval-interval", "3", "--log-jsonl", str(log)], capsys, monkeypatch)
    assert rc == 0, err
    records = [json.loads(line) for line in log.read_text().splitlines()]
    train = [r for r in records if "lm_loss" in r]
    lines = MEGATRON_TRAIN_LINE.findall(out)
    assert [int(m[0]) for m in lines] == [r["iteration"] for r in train] == [1, 2, 3]
    for m, r in zip(lines, train):
        assert (int(m[1]), int(m[2]), int(m[6])) == (3, r["consumed_samples"], r["global_batch_size"])
        assert float(m[7]) == pytest.approx(r["lm_loss"], rel=1e-6) and float(m[5]) == pytest.approx(r["lr"], rel=1e-6)
        assert float(m[3]) == pytest.approx(1000 * r["iteration_time"], abs=0.06)
        assert float(m[9]) == pytest.approx(r["grad_norm"], abs=6e-4) and int(m[10]) == r["num_zeros_in_grad"]
    evals = MEGATRON_VALID_LINE.findall(out)
    assert [(int(i), where) for i, where, _, _ in evals] == [(3, ""), (3, " on validation set"), (3, " on test set")]
    logged = [r.get("validation", r.get("test")) for r in records if "lm_loss" not in r]
    for (_, _, loss, ppl), r in zip(evals, logged):
        assert float(loss) == pytest.approx(r["lm_loss"], rel=1e-6) and float(ppl) == pytest.approx(r["ppl"], rel=1e-6)


def test_wandb_and_tensorboard_get_a_skipped_iterations_loss(capsys, monkeypatch):
    """From a logging review: Megatron's training_log writes each iteration's loss_dict to W&B and TensorBoard,
    skipped or not, so an fp16 run's loss-scale warm-up (every step skipped on an overflow) is plotted from iteration
    1; ours left the skipped steps' losses out. The console's window mean still leaves them out, as Megatron's."""
    from megatron_lite.training.logger import MetricsLogger

    steps = []
    real = MetricsLogger.step
    monkeypatch.setattr(MetricsLogger, "step", lambda self, i, m: (steps.append((i, dict(m))), real(self, i, m)))
    argv = ["--mock-data", "--vocab-size", "100", "--fp16", "--initial-loss-scale", "1e30"]  # (every step overflows)
    rc, out, err = _run([*argv, "--log-num-zeros-in-grad"], capsys, monkeypatch)
    assert rc == 0, err
    assert out.count("number of skipped iterations:   1 |") == 3 and "lm loss:" not in out
    assert [i for i, m in steps if "lm_loss" in m] == [1, 2, 3], steps
    assert all(math.isfinite(m["lm_loss"]) and m["grad_norm"] is None for _, m in steps)
    # (an exploratory run: the zeros of a skipped step's inf/NaN gradients were logged; Megatron's step gives none)
    assert "num zeros" not in out and all(m.get("num_zeros_in_grad") is None for _, m in steps), out


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_moe_per_layer_losses_go_to_wandb_every_iteration_under_megatrons_names(kind, capsys, monkeypatch):
    """From a logging review: Megatron's --moe-per-layer-logging writes each layer's losses every iteration as
    moe/<loss>_layer_<i> (load_balancing_loss, seq_load_balancing_loss, z_loss); ours went every --log-interval as
    train/moe_layer<i>_aux_loss, the sequence-level loss under the plain one's name."""
    from megatron_lite.training.logger import MetricsLogger, _megatron_key

    steps = []
    real = MetricsLogger.step
    monkeypatch.setattr(MetricsLogger, "step", lambda self, i, m: (steps.append((i, dict(m))), real(self, i, m)))
    moe = ["--mock-data", "--vocab-size", "100", "--num-experts", "4", "--disable-bias-linear", "--log-interval", "3"]
    moe += ["--moe-router-load-balancing-type", kind, "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]
    rc, out, err = _run([*moe, "--moe-per-layer-logging"], capsys, monkeypatch)
    assert rc == 0, err
    balancing = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}[kind]
    want = {f"moe/{name}_layer_{i}" for name in (balancing, "z_loss") for i in (0, 1)}
    assert [i for i, _ in steps] == [1, 2, 3]
    for _, m in steps:
        assert want <= {_megatron_key(k) for k in m}, m
        assert all(m[k] > 0 for k in m if k.startswith("moe_layer"))


def test_megatrons_report_memory_line_on_a_gpu(monkeypatch):
    """From a logging review: Megatron prints "[Rank N] (after K iterations) memory (MB) | allocated: ... | max
    allocated: ... | reserved: ... | max reserved: ..." once, which users grep; on a CPU there is no allocator to
    report (the allocator's numbers are faked here: the line's format is what is tested)."""
    from megatron_lite.training import memory

    assert memory.report_memory("(after 5 iterations)", torch.device("cpu")) is None
    values = {"memory_allocated": 1, "max_memory_allocated": 2, "memory_reserved": 3, "max_memory_reserved": 4}
    for name, mb in values.items():
        monkeypatch.setattr(torch.cuda, name, lambda device, mb=mb: mb * 1024 * 1024)
    line = memory.report_memory("(after 5 iterations)", torch.device("cuda", 0))
    assert line == (
        "(after 5 iterations) memory (MB) | allocated: 1.0 | max allocated: 2.0 | reserved: 3.0 | max reserved: 4.0"
    )


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize(
    "flags, bad",
    [
        (["--log-jsonl", "/proc/nope/x.jsonl"], "--log-jsonl /proc/nope"),
        (["--wandb-project", "p", "--wandb-save-dir", "/proc/nope"], "--wandb-save-dir /proc/nope"),
        (["--wandb-project", "p", "--save", "/proc/nope", "--skip-train"], "--wandb-save-dir /proc/nope/wandb"),
    ],
)
def test_a_log_directory_that_cannot_be_written_is_refused_at_start_up(capsys, monkeypatch, flags, bad):
    """(From an exploratory run) the logs passed the permission bits as --save did: the logging rank failed
    opening them with a FileNotFoundError traceback, the other ranks then in a collective. The rank that logs now
    makes and writes their directories at start-up (W&B's default one beside --save included)."""
    from test_pretrain_cli import _one_line_error

    monkeypatch.setenv("WANDB_MODE", "offline")
    rc, out, err = _run(["--mock-data", "--vocab-size", "100", *flags], capsys, monkeypatch)
    _one_line_error(rc, err, f"{bad} cannot be written: making the directory failed: ", "(ENOENT)")
    assert "iteration " not in out, out


def test_the_logging_rank_alone_probes_the_logs_and_every_rank_says_why(tmp_path, pretrain_job):
    """Under PP=2 rank 1 logs (the last stage): its failed probe is every rank's one line, no traceback."""
    args = ["--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "32"]
    args += ["--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16"]
    args += ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2"]
    args += ["--pipeline-model-parallel-size", "2", "--log-jsonl", "/proc/nope/x.jsonl"]
    out = pretrain_job(2, args, exit_code=2)
    assert "Traceback" not in out, out
    assert out.count("--log-jsonl /proc/nope cannot be written: making the directory failed") == 2, out
