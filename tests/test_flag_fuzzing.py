"""Found by fuzzing the entry point's flags (2026-12-07, about 3,000 configurations): values a check let through
(a number that must be finite given inf or NaN; a factor of 0 or below), values that raised a traceback, errors
that named another flag, and whole families of flags taken without a word while their feature was off. Each is one
line at start-up now, or a note in the dry run's and the run's first lines."""

from __future__ import annotations

import pytest
from test_pretrain_cli import _one_line_error, _run

MOE = ["--num-experts", "4", "--moe-router-pre-softmax", "--disable-bias-linear"]


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--fp16", "--loss-scale", "inf"], "--loss-scale inf must be a finite number"),  # (every step skipped, exit 0)
        (["--loss-scale-window", "inf"], "--loss-scale-window inf must be a whole number"),  # (OverflowError)
        (["--position-embedding-type", "rope", "--rotary-percent", "nan"], "--rotary-percent nan must be in (0, 1]"),
        (
            ["--position-embedding-type", "rope", "--rotary-percent", "1e308"],
            "--rotary-percent 1e+308 must be in (0, 1]",
        ),
        ([*MOE, "--moe-expert-capacity-factor", "nan"], "--moe-expert-capacity-factor nan must be a finite number"),
        ([*MOE, "--moe-expert-capacity-factor", "inf"], "--moe-expert-capacity-factor inf must be a finite number"),
        ([*MOE, "--moe-aux-loss-coeff", "nan"], "--moe-aux-loss-coeff nan must be a finite number"),  # (halted at 1)
        (["--lr", "inf"], "--lr inf must be a finite number"),
        (
            ["--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-factor", "-1"],
            "--rope-scaling-factor -1.0 must be > 0",
        ),  # (trained on, unsaid; 0 and NaN: a NaN loss)
        (["--embedding-init-method-std", "-1"], "--embedding-init-method-std -1.0 must be >= 0"),  # (a traceback)
        (["--qk-l2-norm-rope-only"], "--qk-l2-norm-rope-only (Llama 4's) limits --qk-l2-norm"),  # (its field's name)
        (["--heterogeneous-layers-config-encoded-json", "abc"], "--heterogeneous-layers-config-encoded-json is not"),
        (
            ["--heterogeneous-layers-config-encoded-json", '{"block_configs": [{}]}'],
            "--heterogeneous-layers-config-path (or -encoded-json): block 0 needs an 'attention' and an 'ffn' object",
        ),
        (["--seq-length", "0"], "--seq-length 0 must be a positive integer"),  # (said as --max-position-embeddings)
        (["--max-position-embeddings", "0"], "--max-position-embeddings 0 must be a positive integer"),  # (unset)
        (["--tokenizer-model", "/nonexistent/tok.json"], "--tokenizer-model /nonexistent/tok.json needs --tokenizer"),
        (["--wandb-project", "team/proj"], "--wandb-project team/proj: W&B project names cannot contain /"),
        # (a storage overflow's traceback in the build; a loop over the layers that never ended)
        (["--hidden-size", "1000000000000"], "--hidden-size 1000000000000, --ffn-hidden-size 4000000000000 make"),
        (["--num-layers", "1000000000000"], "--num-layers 1000000000000 is beyond any model (at most 100000)"),
        (["--vocab-size", "10000000000000"], "--vocab-size 10000000000000 and --hidden-size 32 make about"),
        ([*MOE, "--num-experts", "40000000000"], "--num-experts 40000000000 make about 6.6e+14 parameters, beyond"),
        (["--ffn-hidden-size", "1" + "0" * 400], "make about 1e+402 parameters, beyond any model"),  # (no float)
    ],  # fmt: skip
)
def test_values_let_through_or_raising_are_one_line(argv, said, capsys, monkeypatch):
    for dry in ([], ["--dry-run"]):
        rc, _, err = _run(["--mock-data", "--vocab-size", "64", *argv, *dry], capsys, monkeypatch)
        _one_line_error(rc, err, said)


def test_families_of_flags_given_while_their_feature_is_off_are_said(capsys, monkeypatch):
    """Taken without a word (Megatron takes most of them so too): the MoE flags without --num-experts, MLA's without
    --multi-latent-attention, Mamba's without a hybrid pattern, WSD's without its decay style, the dynamic loss
    scale's without --fp16."""
    given = ["--moe-router-topk", "4", "--moe-aux-loss-coeff", "0.5", "--kv-lora-rank", "8", "--mscale", "2.0",
             "--mamba-state-dim", "16", "--lr-wsd-decay-style", "cosine", "--hysteresis", "4"]  # fmt: skip
    rc, out, err = _run(["--mock-data", "--vocab-size", "64", *given, "--dry-run"], capsys, monkeypatch)
    assert rc == 0, err
    for note in ("--moe-router-topk has no effect without --num-experts",
                 "--moe-aux-loss-coeff has no effect without --num-experts",
                 "--kv-lora-rank has no effect without --multi-latent-attention",
                 "--mscale has no effect without --multi-latent-attention",
                 "--mamba-state-dim has no effect without --hybrid-override-pattern",
                 "--lr-wsd-decay-style has no effect without --lr-decay-style WSD",
                 "--hysteresis has no effect without --fp16"):  # fmt: skip
        assert note in out + err, (note, out + err)
    rc, out, err = _run(["--mock-data", "--vocab-size", "64", *MOE, "--moe-router-topk", "2", "--dry-run"], capsys,
                        monkeypatch)  # fmt: skip
    assert rc == 0 and "has no effect without --num-experts" not in out + err, out + err


def test_a_tokenizer_file_without_data_says_so_rather_than_ask_for_its_type(capsys, monkeypatch):
    """A review's: `--tokenizer-model t.json` alone asked for --tokenizer-type, which, added, was refused as a
    tokenizer without data: each line sent the user to the other."""
    rc, _, err = _run(["--tokenizer-model", "t.json"], capsys, monkeypatch)
    _one_line_error(rc, err, "--tokenizer-model t.json without data", "add --data-path or --mock-data")


def test_an_expert_grid_that_does_not_fit_names_the_default_it_took(capsys, monkeypatch):
    """An exploratory run's: with --expert-tensor-parallel-size not given (TP's, as in Megatron), the line named it
    as if typed, and said nothing of the size that fits."""
    argv = ["--mock-data", "--vocab-size", "64", *MOE, "--moe-router-topk", "2", "--tensor-model-parallel-size", "2",
            "--sequence-parallel", "--expert-model-parallel-size", "4"]  # fmt: skip
    rc, _, err = _run(argv, capsys, monkeypatch, world=4)
    _one_line_error(rc, err, "--expert-tensor-parallel-size 2 (not given: --tensor-model-parallel-size's) x "
                    "--expert-model-parallel-size 4", "(--expert-tensor-parallel-size 1 does)")  # fmt: skip
