"""The schedule of a resumed run (Megatron's --use-checkpoint-opt_param-scheduler keeps the checkpoint's, in
samples), and the values the optimizer's flags must have (one line each, as Megatron's asserts)."""

from __future__ import annotations

import json
import math

import pytest
import torch.distributed as dist

from megatron_lite.config import ConfigError
from megatron_lite.optimizer.config import OptimizerConfig
from megatron_lite.training.pretrain import main

RUN = (
    "--mock-data --vocab-size 100 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --log-interval 1 --eval-iters 0 --train-iters 8 "
    "--lr-warmup-iters 2 --lr-decay-style cosine --weight-decay-incr-style linear --start-weight-decay 0 "
    "--end-weight-decay 0.1"
).split()


def _job(argv, jsonl, capsys, monkeypatch) -> tuple[list[dict], str]:
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert main([*argv, "--log-jsonl", str(jsonl)]) == 0
    assert not dist.is_initialized()
    rows = [json.loads(line) for line in open(jsonl)]
    return [r for r in rows if "lm_loss" in r and "kind" not in r], capsys.readouterr().out


def test_the_checkpoints_schedule_keeps_its_lengths(tmp_path, capsys, monkeypatch):
    """Saved at iteration 3 of 8, resumed with --use-checkpoint-opt_param-scheduler: with a longer --train-iters
    the weight decay still rises over the first run's 32 samples (the losses are the straight run's: the decay
    followed the new length); with another --global-batch-size the warmup and decay keep their samples (8 and
    32), as Megatron keeps them (they became 2 and 8 batches of the new size: warmup began again)."""
    ckpt = str(tmp_path / "ckpt")
    straight, _ = _job([*RUN, "--save", ckpt, "--save-interval", "3"], tmp_path / "a.jsonl", capsys, monkeypatch)
    keep = ["--load", ckpt, "--ckpt-step", "3", "--use-checkpoint-opt_param-scheduler"]
    longer, _ = _job([*RUN, *keep, "--train-iters", "16", "--exit-interval", "8"], tmp_path / "b.jsonl", capsys,
                     monkeypatch)  # fmt: skip
    assert [r["lm_loss"] for r in longer] == [r["lm_loss"] for r in straight[3:]]
    wider, out = _job([*RUN, *keep, "--global-batch-size", "8"], tmp_path / "c.jsonl", capsys, monkeypatch)
    assert "the checkpoint's warmup and decay lengths in samples (batches of 4) kept" in out

    def megatron_lr(samples, warmup=8, decay=32):
        if samples <= warmup:
            return 1e-3 * samples / warmup
        return 1e-3 * 0.5 * (math.cos(math.pi * min(1.0, (samples - warmup) / (decay - warmup))) + 1)

    assert [r["lr"] for r in wider] == pytest.approx([megatron_lr(12 + 8 * i) for i in range(5)], rel=1e-9)
    _, out = _job([*RUN, "--load", ckpt, "--ckpt-step", "3", "--global-batch-size", "8"], tmp_path / "d.jsonl",
                  capsys, monkeypatch)  # fmt: skip
    assert "--global-batch-size 8 differs from the checkpoint's 4: the schedule's iteration lengths" in out
    # a checkpoint saved before the lengths were: no claim that they were kept
    meta_path = tmp_path / "ckpt" / "iter_0000003" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    del meta["scheduler"]["lengths"]
    meta_path.write_text(json.dumps(meta))
    _, out = _job([*RUN, *keep, "--global-batch-size", "8"], tmp_path / "e.jsonl", capsys, monkeypatch)
    assert "lengths in samples (batches of 4) kept" not in out and "predates schedule lengths in samples" in out


def test_a_run_that_loads_no_schedule_is_not_told_its_flags_differ(tmp_path, capsys, monkeypatch):
    """--finetune, --no-load-optim, or a checkpoint without schedule state (a conversion's): the flags are the
    schedule, so nothing is compared with the checkpoint's (a LoRA fine-tune of a converted model was told its
    --lr "differs from the checkpoint's" placeholder, with Megatron's stop that does not apply); a resume that
    loads the schedule still is."""
    ckpt = str(tmp_path / "ckpt")
    _job([*RUN, "--save", ckpt, "--save-interval", "3", "--train-iters", "3"], tmp_path / "a.jsonl", capsys,
         monkeypatch)  # fmt: skip
    other = ["--load", ckpt, "--lr", "5e-4", "--global-batch-size", "8"]
    for flags in (["--finetune"], ["--no-load-optim"]):
        _, out = _job([*RUN, *other, *flags], tmp_path / "b.jsonl", capsys, monkeypatch)
        assert "differs from the checkpoint's" not in out, flags
    meta_path = tmp_path / "ckpt" / "iter_0000003" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    _, out = _job([*RUN, *other], tmp_path / "c.jsonl", capsys, monkeypatch)
    assert "--lr 0.0005 differs from the checkpoint's 0.001" in out and "--global-batch-size 8 differs" in out
    meta["scheduler"] = None
    meta_path.write_text(json.dumps(meta))
    _, out = _job([*RUN, *other, "--no-load-rng"], tmp_path / "d.jsonl", capsys, monkeypatch)
    assert "differs from the checkpoint's" not in out


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(lr=1e-3, lr_warmup_init=1e-2), "--lr-warmup-init 0.01 must be in [0, --lr 0.001]"),
        (dict(fp16=True, min_loss_scale=0.0), "--min-loss-scale 0.0 must be in (0, --initial-loss-scale"),
        (dict(fp16=True, initial_loss_scale=16.0, min_loss_scale=1024.0), "--min-loss-scale 1024.0 must be in (0,"),
        (dict(fp16=True, loss_scale_window=0), "--loss-scale-window 0 must be >= 1"),
        (dict(loss_scale=0.0), "--loss-scale 0.0 must be > 0"),
        (dict(weight_decay=-0.1), "--weight-decay -0.1 must be >= 0"),
        (dict(adam_eps=-1.0), "--adam-eps -1.0 must be >= 0"),
        (dict(lr_decay_iters=0), "--lr-decay-iters 0 must be >= 1"),
        # (a NaN passed the range checks: the run trained at a NaN rate, or lost its clipping, or the scale's error
        # named --min-loss-scale)
        (dict(min_lr=float("nan")), "--min-lr nan must be in [0, --lr"),
        (dict(clip_grad=float("nan")), "--clip-grad nan must be >= 0"),
        (dict(fp16=True, initial_loss_scale=float("nan")), "--initial-loss-scale nan must be a finite number > 0"),
    ],
)
def test_optimizer_values_megatron_asserts_on_are_one_line(kw, fragment):
    with pytest.raises(ConfigError) as e:
        OptimizerConfig(**kw)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_optimizer_flags_megatron_reads_its_own_way(tmp_path, capsys, monkeypatch):
    """From an optimizer review against Megatron: the dynamic scaler's values are checked only under --fp16 (where
    it runs: an fp32 run with --initial-loss-scale 0.5 was refused); a sample-based WSD run is told the -samples
    flag (it was told --lr-wsd-decay-iters, then refused it); a constant --loss-scale acts under --bf16 as in
    Megatron (it was dropped); a longer --train-iters on resume says the decay moved with it (silent)."""
    OptimizerConfig(initial_loss_scale=0.5)  # (no fp16: nothing scales)
    with pytest.raises(ConfigError, match="needs --lr-wsd-decay-samples N"):
        OptimizerConfig(lr_decay_style="WSD").validate_schedule(10, 400)
    with pytest.raises(ConfigError, match="needs --lr-wsd-decay-iters N"):
        OptimizerConfig(lr_decay_style="WSD").validate_schedule(10)
    bf16 = [*RUN, "--bf16", "--train-iters", "3"]
    plain, _ = _job(bf16, tmp_path / "a.jsonl", capsys, monkeypatch)
    scaled, _ = _job([*bf16, "--loss-scale", "1024"], tmp_path / "b.jsonl", capsys, monkeypatch)
    assert [r["loss_scale"] for r in scaled] == [1024.0] * 3
    # (a power of two scales and unscales exactly)
    assert [(r["lm_loss"], r["grad_norm"]) for r in scaled] == [(r["lm_loss"], r["grad_norm"]) for r in plain]
    ckpt = str(tmp_path / "ckpt")
    _job([*RUN, "--train-iters", "4", "--save", ckpt], tmp_path / "c.jsonl", capsys, monkeypatch)
    _, out = _job([*RUN, "--load", ckpt, "--train-iters", "6"], tmp_path / "d.jsonl", capsys, monkeypatch)
    assert "the LR decay 24 (--train-iters 6 x --global-batch-size 4; the checkpoint's 16)" in out
    _, out = _job([*RUN, "--load", ckpt, "--train-iters", "8", "--lr-decay-iters", "8"], tmp_path / "e.jsonl", capsys,
                  monkeypatch)  # fmt: skip
    assert "the LR decay 32 (--lr-decay-iters 8 x --global-batch-size 4; the checkpoint's 16)" in out


def test_a_batch_ramp_needs_a_sample_based_run(capsys, monkeypatch):
    """Megatron refuses --rampup-batch-size with --train-iters: the ramp's steps take fewer samples than the
    iteration lengths count, so the decay never reached --min-lr."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main([*RUN, "--rampup-batch-size", "2", "2", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --rampup-batch-size 2 2 8 needs a sample-based run") and "\n" not in err


def test_a_checkpoint_of_an_iteration_based_ramp_still_resumes(monkeypatch):
    """Saved before the refusal (a ramp with --train-iters was accepted): --load alone goes on as it ran, with a
    note; a ramp or --train-iters given again is refused as for a new run."""
    import megatron_lite.checkpoint.checkpointing as ck
    from megatron_lite.arguments import parse_args

    base = [*RUN[: RUN.index("--train-iters")], "--global-batch-size", "8"]
    _, job = parse_args([*base, "--train-samples", "64", "--rampup-batch-size", "2", "2", "16"])
    config = job.to_dict()
    config["training"].update(train_samples=None, train_iters=10)  # as the old iteration-based ramp saved it
    monkeypatch.setattr(ck, "find_checkpoint", lambda *a, **k: "ckpt/iter_0000003")
    monkeypatch.setattr(ck, "read_metadata", lambda path: {"config": config})
    ns, job = parse_args(["--load", "ckpt"])
    assert job.training.rampup_batch_size == (2, 2, 16) and job.training.train_iters == 10
    assert any("which Megatron refuses" in n for n in ns.schedule_notes)
    with pytest.raises(ConfigError, match="needs a sample-based run"):
        parse_args(["--load", "ckpt", "--train-iters", "12"])


# From a review of the training loop against Megatron-LM (2026-12-04) ------------------------------------------
def _without(argv: list[str], *flags: str) -> list[str]:
    """argv less the given flags and their values."""
    out, skip = [], False
    for a in argv:
        if a.startswith("--"):
            skip = a in flags
        if not skip:
            out.append(a)
    return out


WSD = _without(RUN, "--lr-warmup-iters", "--lr-decay-style")


def test_use_checkpoint_schedule_takes_the_wsd_decay_from_the_flags(tmp_path, capsys, monkeypatch):
    """Megatron's OptimizerParamScheduler restores lr, min lr, warmup and decay lengths and style and the weight
    decay; the WSD anneal (--lr-wsd-decay-iters) is its flags'. The checkpoint's 2 iterations were kept, so the lr
    stayed at its peak until iteration 8; with the flags' 6 it anneals linearly from iteration 3 (position 2)."""
    ckpt = str(tmp_path / "ckpt")
    wsd = [*WSD, "--lr-decay-style", "WSD", "--lr-wsd-decay-style", "linear", "--min-lr", "1e-4"]
    _job([*wsd, "--lr-wsd-decay-iters", "2", "--save", ckpt, "--save-interval", "4", "--exit-interval", "4"],
         tmp_path / "a.jsonl", capsys, monkeypatch)  # fmt: skip
    resumed, out = _job([*wsd, "--lr-wsd-decay-iters", "6", "--load", ckpt, "--use-checkpoint-opt_param-scheduler"],
                        tmp_path / "b.jsonl", capsys, monkeypatch)  # fmt: skip
    assert [r["iteration"] for r in resumed] == [5, 6, 7, 8]
    # the lr iteration i steps with: position i - 1 of 8, the anneal over the last 6 from 1e-3 to 1e-4
    expected = [1e-4 + (1e-3 - 1e-4) * (1 - (i - 1 - 2) / 6) for i in range(5, 9)]
    assert [r["lr"] for r in resumed] == pytest.approx(expected, rel=1e-9)
    assert "lr_wsd_decay_iters kept" not in out


def test_a_sample_based_ramp_asks_the_data_for_its_train_samples(tmp_path, capsys, monkeypatch):
    """The train split was asked for train_iters x the final batch (1296 samples for a --train-samples 1000 ramp),
    where Megatron asks for --train-samples: a split's epochs, and so the order of its samples, depend on it."""
    import megatron_lite.training.datasets as datasets

    from models import record_calls

    calls = record_calls(monkeypatch, datasets, "build_datasets")  # (source, data, num_samples, ...)
    ramp = _without(RUN, "--train-iters", "--lr-warmup-iters", "--global-batch-size")
    ramp += ["--global-batch-size", "8", "--train-samples", "100", "--rampup-batch-size", "4", "4", "20",
             "--exit-interval", "1"]  # fmt: skip
    _job(ramp, tmp_path / "a.jsonl", capsys, monkeypatch)
    assert calls[0][2][0] == 100, calls
    # --skip-train: the validation split for one evaluation, eval_iters x the batch (it was sized for the evaluations
    # of a whole run, (train_iters // eval_interval + 1) x eval_iters batches: another epoch count, another order)
    skip = _without(RUN, "--eval-iters") + ["--eval-iters", "2", "--eval-interval", "2", "--skip-train"]
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert main(skip) == 0
    assert calls[-1][2][1:] == (2 * 4, 2 * 4), calls


def test_a_batch_ramp_saves_before_each_larger_batch(tmp_path, capsys, monkeypatch):
    """As Megatron's train(): a checkpoint whenever the ramped-up batch grows (there: the micro-batch count), so a
    run resumes at each size. Batches of 4 up to 12 over 40 samples: 4 4 4 | 8 8 | 12 ... (iterations 3 and 5)."""
    ckpt = tmp_path / "ckpt"
    ramp = _without(RUN, "--train-iters", "--lr-warmup-iters", "--global-batch-size")
    ramp += ["--global-batch-size", "12", "--train-samples", "96", "--rampup-batch-size", "4", "4", "40",
             "--save", str(ckpt), "--save-interval", "1000"]  # fmt: skip
    rows, out = _job(ramp, tmp_path / "a.jsonl", capsys, monkeypatch)
    sizes = [r["global_batch_size"] for r in rows]
    grows = [i for i in range(1, len(sizes)) if sizes[i] != sizes[i - 1]]  # the iterations before a larger batch
    assert grows and sorted(p.name for p in ckpt.glob("iter_*")) == [f"iter_{i:07d}" for i in [*grows, len(rows)]]
    assert out.count("(--rampup-batch-size): saving first") == len(grows)
    # a growth at a --save-interval iteration saves once (it was written twice)
    ramp[ramp.index("--save-interval") + 1] = str(grows[0])
    _, out = _job([*ramp, "--save", str(tmp_path / "ckpt2")], tmp_path / "b.jsonl", capsys, monkeypatch)
    assert out.count(f"iter_{grows[0]:07d}") == 1, out


def test_a_time_limit_reached_during_an_evaluation_ends_it_unlogged(tmp_path, capsys, monkeypatch):
    """Megatron's evaluate() checks --exit-duration-in-mins after each batch and stops there, printing nothing; the
    loop then saves and exits. Ours ran every --eval-iters batch and logged a validation loss first."""
    argv = _without(RUN, "--eval-iters")
    argv += ["--eval-iters", "50", "--eval-interval", "1", "--exit-duration-in-mins", "1e-9"]
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "exiting during the validation evaluation: --exit-duration-in-mins reached" in out
    assert "validation loss" not in out and "exiting at iteration 1" in out


def test_a_time_limit_reached_in_the_final_validation_skips_the_test_set(tmp_path, capsys, monkeypatch):
    """From the review of the change above: evaluate() said nothing of stopping early, so after a final validation
    ended by --exit-duration-in-mins the test set still ran a batch (and said so too)."""
    import megatron_lite.resilience.guards as guards
    import megatron_lite.training.pretrain as pretrain

    calls = []

    def over_time(*_):  # the loop's check after each of the 8 iterations is in time; the final validation's not
        calls.append(1)
        return len(calls) > 8

    # (the loop asks through guards.should_exit, the evaluations through the name pretrain imported)
    monkeypatch.setattr(guards, "over_time", over_time)
    monkeypatch.setattr(pretrain, "over_time", over_time)
    argv = _without(RUN, "--eval-iters") + ["--eval-iters", "2", "--eval-interval", "100", "--split", "8,1,1",
                                            "--exit-duration-in-mins", "100"]  # fmt: skip
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "exiting during the validation evaluation" in out and "test evaluation" not in out, out


def test_a_finetune_restarted_from_its_own_save_notes_a_changed_schedule(tmp_path, capsys, monkeypatch):
    """A --load BASE --finetune --save OWN job restarted resumes OWN whole, its schedule state included: a longer
    --train-iters (or another --lr) then moves the LR as on any resume, and says so (it moved silently, the flags
    read as a fresh fine-tune's)."""
    base, own = str(tmp_path / "base"), str(tmp_path / "own")
    _job([*RUN, "--train-iters", "3", "--save", base], tmp_path / "a.jsonl", capsys, monkeypatch)
    tune = [*RUN, "--load", base, "--finetune", "--save", own]
    first, out = _job([*tune, "--train-iters", "4"], tmp_path / "b.jsonl", capsys, monkeypatch)
    assert [r["iteration"] for r in first] == [1, 2, 3, 4]
    longer, out = _job([*tune, "--train-iters", "6"], tmp_path / "c.jsonl", capsys, monkeypatch)
    assert [r["iteration"] for r in longer] == [5, 6]  # (resumed at 4, not fine-tuned from the base again)
    assert "the LR decay 24 (--train-iters 6 x --global-batch-size 4; the checkpoint's 16)" in out
    _, out = _job([*tune, "--train-iters", "8", "--lr", "5e-4"], tmp_path / "d.jsonl", capsys, monkeypatch)
    assert "--lr 0.0005 differs from the checkpoint's 0.001" in out
    # a fresh fine-tune (no checkpoint of its own yet) has no schedule to compare with
    _, out = _job([*RUN, "--load", base, "--finetune", "--save", str(tmp_path / "fresh")], tmp_path / "e.jsonl",
                  capsys, monkeypatch)  # fmt: skip
    assert "differs from the checkpoint's" not in out


def test_no_auto_resume_starts_from_load_as_its_help_says(tmp_path, capsys, monkeypatch):
    """--save holding a checkpoint is resumed over --load BASE too; --no-auto-resume starts from BASE instead. Its
    --help said it applied only with "no --load" (from a README walk-through checking each script's --help)."""
    from megatron_lite.flag_parser import build_parser

    (action,) = [a for a in build_parser()._actions if "--no-auto-resume" in a.option_strings]
    assert "no --load" not in action.help and "start from --load" in action.help
    base, own = str(tmp_path / "base"), str(tmp_path / "own")
    _job([*RUN, "--train-iters", "3", "--save", base], tmp_path / "a.jsonl", capsys, monkeypatch)
    _job([*RUN, "--train-iters", "5", "--save", own], tmp_path / "b.jsonl", capsys, monkeypatch)
    resumed, _ = _job([*RUN, "--load", base, "--save", own], tmp_path / "c.jsonl", capsys, monkeypatch)
    assert [r["iteration"] for r in resumed] == [6, 7, 8]  # (own's newest, iteration 5)
    fresh, _ = _job([*RUN, "--load", base, "--save", own, "--no-auto-resume"], tmp_path / "d.jsonl", capsys,
                    monkeypatch)  # fmt: skip
    assert [r["iteration"] for r in fresh] == [4, 5, 6, 7, 8]  # (base's iteration 3)


def test_a_ramp_resumed_past_a_batch_needs_only_the_batches_ahead_to_split(tmp_path, capsys, monkeypatch):
    """From an exploratory review: a ramp 2 2 24 run resumed at DP=2 after its ramp was refused ("the ramp's
    global batch of 2 samples (after 0 samples) is not a multiple of ... 4"), every batch left being 8; Megatron
    checks each step's batch as it runs. The batches the resumed run still takes must split; a resume inside the
    ramp is refused at the first of those that does not."""
    from megatron_lite.arguments import parse_args
    from megatron_lite.layout_validation import validate_layout

    argv = _without(RUN, "--train-iters", "--lr-warmup-iters", "--global-batch-size")
    argv += ["--global-batch-size", "8", "--train-samples", "64", "--rampup-batch-size", "2", "2", "24"]
    ckpt = str(tmp_path / "ckpt")
    _job([*argv, "--save", ckpt, "--save-interval", "3", "--exit-interval", "10"], tmp_path / "a.jsonl", capsys,
         monkeypatch)  # fmt: skip
    # (batches 2 x4, 4 x2, 6 x1, then 8: saved as each grows; resumed at 4, the 4s split into 4 and the 6 not)
    for step, refused in ((10, None), (4, r"global batch of 6 samples \(after 16 samples\)")):
        _, job = parse_args([*argv, "--load", ckpt, "--ckpt-step", str(step)])
        if refused is None:
            validate_layout(job.model, job.parallel, 2, job.training)
        else:
            with pytest.raises(ConfigError, match=refused):
                validate_layout(job.model, job.parallel, 2, job.training)
    finetune = [*argv, "--load", ckpt, "--ckpt-step", "10", "--finetune", "--save", str(tmp_path / "ft")]
    _, job = parse_args(finetune)  # (from sample 0 again)
    with pytest.raises(ConfigError, match=r"global batch of 2 samples \(after 0 samples\)"):
        validate_layout(job.model, job.parallel, 2, job.training)
    # (a review's: the fine-tune restarted from its own --save goes on from its samples, not 0: it was refused)
    _job([*finetune, "--exit-interval", "10"], tmp_path / "e.jsonl", capsys, monkeypatch)
    _, job = parse_args(finetune)
    validate_layout(job.model, job.parallel, 2, job.training)
