"""A Megatron script's flags mean here what they mean in Megatron-LM (megatron/training/arguments.py): its
derived defaults, its older spellings, and the flags of its examples that change nothing here."""

from __future__ import annotations

import re

import pytest

from megatron_lite.arguments import parse_args
from megatron_lite.checkpoint_flags import defaults_from_checkpoint
from megatron_lite.config import ConfigError
from megatron_lite.megatron_flags import accepted_no_ops

BASE = "--num-layers 2 --hidden-size 768 --num-attention-heads 12 --seq-length 32 --train-iters 4".split()
MOCK = [*BASE, "--mock-data", "--vocab-size", "100"]


def test_swiglu_without_a_width_takes_megatrons_default():
    """validate_args: int(4 h x 2/3 / 64) x 64, 2048 at h = 768 (it was 4 h = 3072: the MLP 1.5x too wide); a
    checkpoint saved before keeps the 4 h its weights were built with."""
    assert parse_args([*MOCK, "--swiglu"])[1].model.ffn_size == 2048
    assert parse_args([*MOCK, "--swiglu", "--ffn-hidden-size", "3000"])[1].model.ffn_size == 3000
    assert parse_args(MOCK)[1].model.ffn_size == 3072
    with pytest.raises(ConfigError, match="is 0 for --hidden-size 16; give --ffn-hidden-size"):
        parse_args([*MOCK, "--hidden-size", "16", "--num-attention-heads", "4", "--swiglu"])
    _, job = parse_args([*MOCK, "--swiglu"])
    saved = job.to_dict()
    saved["model"]["ffn_hidden_size"] = None  # (as saved before)
    assert defaults_from_checkpoint(saved)["ffn_hidden_size"] == 4 * 768


def test_gelu_with_biases_is_megatrons_fused_bias_gelu_the_tanh_approximation():
    """From a review of the model against Megatron-Core: its GELU MLP with biases runs bias_gelu_impl (bias-GELU
    fusion is on unless --no-bias-gelu-fusion, and off without biases), x/2 (1 + tanh(0.79788456 x (1 + 0.044715
    x^2))); ours ran exact GELU (2.2e-4 off in the logits) and took --no-bias-gelu-fusion as a no-op. A checkpoint
    of the old default (exact GELU, biases) resumes as it was saved."""
    import torch

    from megatron_lite.models.mlp import activate

    assert parse_args(MOCK)[1].model.activation == "gelu_tanh"
    assert parse_args([*MOCK, "--no-bias-gelu-fusion"])[1].model.activation == "gelu"
    assert parse_args([*MOCK, "--disable-bias-linear"])[1].model.activation == "gelu"
    assert parse_args([*MOCK, "--openai-gelu", "--disable-bias-linear"])[1].model.activation == "gelu_tanh"
    assert "--no-bias-gelu-fusion" not in " ".join(accepted_no_ops(parse_args([*MOCK, "--no-bias-gelu-fusion"])[0]))
    x = torch.linspace(-6, 6, 101, dtype=torch.float64)
    megatron = x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
    assert torch.allclose(activate(x, parse_args(MOCK)[1].model.activation), megatron, rtol=0, atol=1e-8)
    _, job = parse_args([*MOCK, "--no-bias-gelu-fusion"])
    assert defaults_from_checkpoint(job.to_dict())["no_bias_gelu_fusion"] is True
    _, tanh = parse_args([*MOCK, "--openai-gelu"])
    assert defaults_from_checkpoint(tanh.to_dict())["no_bias_gelu_fusion"] is False
    # Megatron's MoE functional tests pass --disable-bias-linear --no-bias-gelu-fusion: resuming their own
    # checkpoint with the same flags was refused (the flag said to conflict with the saved False)
    from megatron_lite.arguments import build_parser
    from megatron_lite.checkpoint_flags import flags_from_checkpoint

    argv = [*MOCK, "--disable-bias-linear", "--no-bias-gelu-fusion"]
    saved = parse_args(argv)[1].to_dict()
    ns = flags_from_checkpoint(build_parser(), argv, build_parser().parse_args(argv), saved, "ckpt")
    assert ns.no_bias_gelu_fusion and ns.disable_bias_linear


def test_older_spellings_read_as_megatron_reads_them():
    ns, job = parse_args([*MOCK, "--use-rotary-position-embeddings", "--no-position-embedding",
                          "--recompute-activations", "--override-opt-param-scheduler", "--persistent-save-interval",
                          "5"])  # fmt: skip
    assert job.model.position_embedding_type == "rope" and job.model.recompute_granularity == "selective"
    assert ns.override_opt_param_scheduler and job.checkpoint.save_interval == 5
    assert parse_args([*MOCK, "--use-checkpoint-opt-param-scheduler"])[0].use_checkpoint_opt_param_scheduler
    # the older spelling is the flag: against a checkpoint of learned positions it conflicts as the flag does
    from megatron_lite.checkpoint_flags import flags_from_checkpoint
    from megatron_lite.flag_parser import build_parser

    saved = parse_args(MOCK)[1].to_dict()
    argv = [*MOCK, "--use-rotary-position-embeddings"]
    with pytest.raises(ConfigError, match="--position-embedding-type rope conflicts with the checkpoint"):
        flags_from_checkpoint(build_parser(), argv, build_parser().parse_args(argv), saved, "ckpt")


def test_validate_args_overrides_read_as_megatrons():
    """Three of Megatron's validate_args rules (a flag-defaults review): --use-rotary-position-embeddings is rope
    whatever --position-embedding-type says, in either order (the later flag won); --fp16 with a dynamic loss
    scale turns the NaN check off, a non-finite loss being the scaler's signal (a run Megatron continues halted
    here), and says so; --main-grads-dtype fp32, the default, needs no --use-precision-aware-optimizer."""
    for order in (["--use-rotary-position-embeddings", "--position-embedding-type", "learned_absolute"],
                  ["--position-embedding-type", "learned_absolute", "--use-rotary-position-embeddings"]):  # fmt: skip
        assert parse_args([*MOCK, *order])[1].model.position_embedding_type == "rope"
    ns, job = parse_args([*MOCK, "--fp16"])
    assert not job.optimizer.check_for_nan_in_loss_and_grad
    assert any("turns --check-for-nan-in-loss-and-grad off" in n for n in ns.schedule_notes)
    for kept in (["--loss-scale", "128"], ["--nan-policy", "skip"]):
        assert parse_args([*MOCK, "--fp16", *kept])[1].optimizer.check_for_nan_in_loss_and_grad, kept
    assert parse_args([*MOCK, "--bf16"])[1].optimizer.check_for_nan_in_loss_and_grad
    assert not parse_args([*MOCK, "--main-grads-dtype", "fp32"])[1].optimizer.grad_reduce_in_bf16


def test_validate_args_overrides_on_resume(monkeypatch):
    """On --load the rules act as on a fresh run: the fp16 rule's stored False did not read as the user's
    --no-check-for-nan-in-loss-and-grad (--nan-policy skip was refused, --loss-scale kept it off), and
    --use-checkpoint-args takes the checkpoint's positions over the rotary spelling."""
    import megatron_lite.checkpoint.checkpointing as checkpointing

    def resume(saved_argv, argv):
        config = parse_args(saved_argv)[1].to_dict()  # (what a save records)
        monkeypatch.setattr(checkpointing, "find_checkpoint", lambda *a, **k: "ckpt/iter_0000003")
        monkeypatch.setattr(checkpointing, "read_metadata", lambda path: {"config": config})
        return parse_args(["--load", "ckpt", *argv])[1]

    for kept in (["--nan-policy", "skip"], ["--loss-scale", "128"]):
        assert resume([*MOCK, "--fp16"], kept).optimizer.check_for_nan_in_loss_and_grad, kept
    assert not resume([*MOCK, "--fp16"], []).optimizer.check_for_nan_in_loss_and_grad
    # an fp16 checkpoint resumed with --bf16: the check is on, as a fresh --bf16 run's (the rule's False came over
    # as a flag, and a NaN step trained on into NaN weights: an exploratory run)
    assert resume([*MOCK, "--fp16"], ["--bf16"]).optimizer.check_for_nan_in_loss_and_grad
    assert not resume(
        [*MOCK, "--fp16"], ["--bf16", "--no-check-for-nan-in-loss-and-grad"]
    ).optimizer.check_for_nan_in_loss_and_grad
    taken = resume(MOCK, ["--use-checkpoint-args", "--use-rotary-position-embeddings"])
    assert taken.model.position_embedding_type == "learned_absolute"


def test_megatrons_store_false_spellings_and_encoder_seq_length_are_taken():
    """Megatron's --no-*/--disable-* spellings were 'no such flag' (a script stopped on each): those that change
    nothing here are accepted and said; --encoder-seq-length is --seq-length (both given: one line)."""
    flags = ["--no-align-grad-reduce", "--no-align-param-gather", "--disable-tp-comm-bulk-dgrad", "--no-initialization"]
    # (and the pipeline's performance switches, from a pipeline review)
    flags += ["--variable-seq-lengths", "--defer-embedding-wgrad-compute", "--overlap-p2p-communication-warmup-flush"]
    ns, job = parse_args([*BASE[:-4], "--train-iters", "4", "--mock-data", "--vocab-size", "100", *flags,
                          "--wgrad-deferral-limit", "2", "--encoder-seq-length", "48"])  # fmt: skip
    assert job.training.seq_length == 48
    said = accepted_no_ops(ns)
    assert all(any(line.startswith(f"{f} has no effect") for line in said) for f in [*flags, "--wgrad-deferral-limit"])
    with pytest.raises(ConfigError, match="--encoder-seq-length is Megatron's other name for --seq-length"):
        parse_args([*MOCK, "--encoder-seq-length", "32"])
    spikes = accepted_no_ops(parse_args([*MOCK, "--check-for-spiky-loss"])[0])  # (Megatron's name, another rule)
    assert any("6 standard deviations above the last --spiky-loss-window 50" in line for line in spikes), spikes
    with pytest.raises(ConfigError, match="--torch-fsdp2-no-reshard-after-forward acts on --use-torch-fsdp2"):
        parse_args([*MOCK, "--torch-fsdp2-no-reshard-after-forward"])


def test_megatrons_list_form_of_the_balancing_loss():
    """Megatron's --moe-router-load-balancing-type / --moe-aux-loss-coeff take lists (nargs='+'): one value reads
    as before; several are one line (two coefficients were 'unrecognized arguments: 1e-3')."""
    moe = [*MOCK, "--num-experts", "4", "--disable-bias-linear"]
    job = parse_args([*moe, "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2"])[1]
    assert (job.model.moe_router_load_balancing_type, job.model.moe_aux_loss_coeff) == ("seq_aux_loss", 1e-2)
    assert parse_args(moe)[1].model.moe_router_load_balancing_type == "aux_loss"
    for flags, fragment in (
        (["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"], "combining balancing losses"),
        (["--moe-aux-loss-coeff", "1e-2", "1e-3"], "one coefficient per balancing type"),
    ):
        with pytest.raises(ConfigError, match=fragment):
            parse_args([*moe, *flags])


def test_save_interval_zero_saves_only_at_the_end_as_in_megatron():
    """Megatron saves every --save-interval iterations only when it is non-zero; 0 was refused here."""
    assert parse_args([*MOCK, "--save", "ckpt", "--save-interval", "0"])[1].checkpoint.save_interval == 0
    with pytest.raises(ConfigError, match="--save-interval -1 must be >= 0"):
        parse_args([*MOCK, "--save", "ckpt", "--save-interval", "-1"])


def test_moe_flags_megatron_refuses_or_reads_its_own_way():
    """From an MoE review against Megatron-Core's TransformerConfig: a top-1 softmax router without
    --moe-router-pre-softmax weighs every token 1 (the router learned from the aux loss alone), and
    --overlap-moe-expert-parallel-comm without expert parallelism did nothing; Megatron refuses both. A negative
    --moe-expert-capacity-factor is dropless there (it was refused here)."""
    moe = [*MOCK, "--num-experts", "4", "--disable-bias-linear"]
    with pytest.raises(ConfigError, match="add --moe-router-pre-softmax"):
        parse_args([*moe, "--moe-router-topk", "1"])
    assert parse_args([*moe, "--moe-router-topk", "1", "--moe-router-pre-softmax"])[1].model.moe_router_topk == 1
    sigmoid = ["--moe-router-score-function", "sigmoid"]
    assert parse_args([*moe, "--moe-router-topk", "1", *sigmoid])[1].model.moe_router_topk == 1
    for flags, fragment in ((moe, "with --expert-model-parallel-size 1"), (MOCK, "with no --num-experts")):
        with pytest.raises(ConfigError, match=fragment):
            parse_args([*flags, "--overlap-moe-expert-parallel-comm"])
    assert parse_args([*moe, "--moe-expert-capacity-factor", "-1"])[1].model.moe_expert_capacity_factor is None
    assert parse_args([*moe, "--moe-expert-capacity-factor", "1.5"])[1].model.moe_expert_capacity_factor == 1.5


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--no-position-embedding"], "--no-position-embedding with --position-embedding-type learned_absolute"),
        (["--num-distributed-optimizer-instances", "2"], "--num-distributed-optimizer-instances 2 is not supported"),
        (["--rotary-seq-len-interpolation-factor", "4"], "--rotary-seq-len-interpolation-factor 4 is not supported"),
        # (a flag-compatibility review: these were "no such flag", which does not tell Megatron's from a typo)
        (["--use-legacy-models"], "--use-legacy-models is not supported: megatron_lite has one model"),
        # (implemented since; Megatron silently builds no gate without a shared expert)
        (
            ["--disable-bias-linear", "--num-experts", "4", "--moe-shared-expert-gate"],
            "--moe-shared-expert-gate gates the MoE layers' shared expert and this model has none: add",
        ),
        # (an attention review against Megatron-Core 0.16.1, whose TransformerConfig has these: "no such flag" told
        # a Megatron user to remove a flag that changes the model)
        # (Megatron's DeepSeek-V3 configs: argparse's "invalid choice" came first and hid the reason)
        (
            [
                "--disable-bias-linear",
                "--num-experts",
                "4",
                "--moe-token-dispatcher-type",
                "flex",
                "--moe-enable-deepep",
            ],
            "--moe-token-dispatcher-type flex (DeepEP / HybridEP) is not supported",
        ),
        # (a validation review: tracebacks, a zero-width shared expert, or the error naming another flag)
        (
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "0"],
            "--num-layers-per-virtual-pipeline-stage 0 must be a positive integer",
        ),
        (
            ["--pipeline-model-parallel-size", "0", "--num-layers-per-virtual-pipeline-stage", "1"],
            "--pipeline-model-parallel-size 0 must be a positive integer",
        ),
        (["--kv-channels", "0"], "--kv-channels 0 must be a positive integer"),
        (["--init-method-std", "-1"], "--init-method-std -1.0 must be >= 0"),
        # (an exploratory run's: both trained to a NaN loss at iteration 1)
        (["--norm-epsilon", "-1"], "--norm-epsilon -1 must be >= 0"),
        (["--position-embedding-type", "rope", "--rotary-base", "0"], "--rotary-base 0 must be positive"),
        (
            ["--disable-bias-linear", "--num-experts", "4", "--moe-ffn-hidden-size", "0"],
            "--moe-ffn-hidden-size 0 must be a positive integer",
        ),
        (
            ["--disable-bias-linear", "--num-experts", "4", "--moe-shared-expert-intermediate-size", "0"],
            "--moe-shared-expert-intermediate-size 0 must be a positive integer (drop it for no shared expert)",
        ),
        (["--lr", "-1"], "--lr -1.0 must be >= 0"),
        (["--decoupled-lr", "-1"], "--decoupled-lr -1.0 must be >= 0"),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-virtual-stages-per-pipeline-rank",
                "2",
                "--microbatch-group-size-per-virtual-pipeline-stage",
                "0",
            ],
            "--microbatch-group-size-per-virtual-pipeline-stage 0 must be a positive integer",
        ),
    ],
)
def test_what_megatron_refuses_or_we_lack_is_one_line(flags, fragment):
    with pytest.raises(ConfigError) as e:
        parse_args([*MOCK, *flags])
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_megatron_flag_values_the_no_ops_take_or_refuse():
    """(From a review of the accepted and refused Megatron flags.) --cuda-graph-impl none is Megatron's default
    and is taken silently (it was refused); a checkpoint-strictness that asks for an error on unexpected tensors
    is refused (they are ignored here); Megatron's 0-2 levels are checked; Megatron-FSDP's flags and the re-run
    engine's error injection are refused with the reason (they were "no such flag")."""
    ns, _ = parse_args([*MOCK, "--cuda-graph-impl", "none", "--dist-ckpt-strictness", "log_all"])
    parse_args([*MOCK, "--softmax-type", "vanilla"])  # (Megatron's default softmax, the one here)
    notes = accepted_no_ops(ns)
    assert not any("cuda-graph" in n for n in notes) and any(n.startswith("--dist-ckpt-strictness") for n in notes)
    for flags, fragment in (
        (["--cuda-graph-impl", "local"], "--cuda-graph-impl is not supported: CUDA graphs are not implemented"),
        (["--dist-ckpt-strictness", "raise_all"], "--dist-ckpt-strictness raise_all is not supported"),
        (["--timing-log-level", "7"], "--timing-log-level 7 must be 0, 1 or 2"),
        (["--use-megatron-fsdp"], "Megatron-FSDP is not implemented; --use-torch-fsdp2 shards parameters"),
        (["--error-injection-rate", "100"], "no re-run engine"),
    ):
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            parse_args([*MOCK, *flags])


def test_flags_of_megatrons_examples_that_change_nothing_here_are_reported():
    flags = ["--ckpt-fully-parallel-save", "--no-ckpt-fully-parallel-save", "--use-dist-ckpt", "--dist-ckpt-format",
             "torch_dist", "--use-persistent-ckpt-worker", "--ckpt-assume-constant-structure", "--timing-log-option",
             "minmax", "--no-persist-layer-norm", "--no-log-loss-scale-to-tensorboard",
             "--num-distributed-optimizer-instances", "1", "--rotary-seq-len-interpolation-factor", "1",
             "--enable-experimental", "--use-cpu-initialization", "--num-dataset-builder-threads", "4",
             "--te-rng-tracker", "--distributed-timeout-seconds-after-init", "60", "--straggler-minmax-count", "8",
             "--straggler-ctrlr-port", "65535"]  # fmt: skip
    notes = accepted_no_ops(parse_args([*MOCK, *flags])[0])
    for flag in (f for f in flags if f.startswith("--")):
        assert any(n.startswith(f"{flag} has no effect: ") for n in notes), flag


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--mock-data"], "--mock-data needs --vocab-size N"),
        (["--data-path", "corpus_text_document", "--vocab-file", "v.json"], "--data-path needs --tokenizer-type"),
    ],
)
def test_a_dry_run_refuses_the_vocabulary_the_run_would_refuse(flags, fragment, capsys, monkeypatch):
    """Megatron's GPT-3 175B example gives --vocab-file without --tokenizer-type: the dry run said "ok" with a
    made-up vocabulary of 4096 that the run would never have."""
    from megatron_lite.training.pretrain import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main([*BASE, *flags, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and fragment in err and "\n" not in err


def test_a_dry_run_counts_the_vocabulary_the_run_would_use(capsys, monkeypatch):
    """Mock data with a tokenizer takes the tokenizer's vocabulary, whatever --vocab-size says (resolve_data);
    the dry run took --vocab-size."""
    from megatron_lite.data.tokenizers import ByteLevelTokenizer
    from megatron_lite.training.pretrain import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    flags = ["--mock-data", "--tokenizer-type", "ByteLevelTokenizer", "--vocab-size", "1000", "--dry-run"]
    assert main([*BASE, *flags]) == 0
    assert f"vocabulary {ByteLevelTokenizer().vocab_size}," in capsys.readouterr().out


def test_cp_comm_type_takes_megatrons_value_per_layer_when_they_agree():
    """Megatron's --cp-comm-type takes one value or one per layer (nargs='+'); a script's `p2p p2p` was an
    argparse error here. Values that differ between layers are one line, as is a count other than the layers'."""
    assert parse_args(MOCK)[1].parallel.cp_comm_type == "p2p"
    assert parse_args([*MOCK, "--cp-comm-type", "a2a"])[1].parallel.cp_comm_type == "a2a"
    assert parse_args([*MOCK, "--cp-comm-type", "a2a", "a2a"])[1].parallel.cp_comm_type == "a2a"
    for values, fragment in ((["p2p", "a2a"], "a different type per layer is not supported"),
                             (["p2p"] * 3, "gives 3 values for --num-layers 2")):  # fmt: skip
        with pytest.raises(ConfigError, match=fragment):
            parse_args([*MOCK, "--cp-comm-type", *values])
    # a layout flag: a resume may change it, in either form
    from megatron_lite.checkpoint_flags import flags_from_checkpoint
    from megatron_lite.flag_parser import build_parser

    saved = parse_args([*MOCK, "--cp-comm-type", "a2a"])[1].to_dict()
    for argv in ([*MOCK, "--cp-comm-type", "p2p", "p2p"], MOCK):
        flags_from_checkpoint(build_parser(), argv, build_parser().parse_args(argv), saved, "ckpt")


def test_bf16_gradient_reduction_wins_over_the_fp32_flag_given_with_it():
    """Megatron's validate_args: --grad-reduce-in-bf16 turns --accumulate-allreduce-grads-in-fp32 off (scripts pass
    the latter by habit: they got fp32 gradients here, twice the memory and traffic), and asserts fp32 main
    gradients with the latter. Only a bf16 reduction restored from a checkpoint is turned back by the fp32 flag
    (tests/test_cli_resume.py)."""
    bf16 = [*MOCK, "--bf16", "--grad-reduce-in-bf16"]
    assert parse_args([*bf16, "--accumulate-allreduce-grads-in-fp32"])[1].optimizer.grad_reduce_in_bf16
    assert not parse_args([*MOCK, "--bf16", "--accumulate-allreduce-grads-in-fp32"])[1].optimizer.grad_reduce_in_bf16
    # (only under --bf16, as in Megatron: with --fp16 the fp32 flag stays, and the bf16 one is not refused)
    fp16 = parse_args([*MOCK, "--fp16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"])[1]
    assert not fp16.optimizer.grad_reduce_in_bf16
    with pytest.raises(ConfigError, match="--accumulate-allreduce-grads-in-fp32 needs fp32 main gradients"):
        parse_args([*MOCK, "--bf16", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16",
                    "--accumulate-allreduce-grads-in-fp32"])  # fmt: skip


def test_a_loss_mask_says_how_the_loss_is_averaged():
    """With --eod-mask-loss or --sft the micro-batches count different numbers of loss tokens, where Megatron's
    default (a mean of the micro-batches' means) and ours (the global batch's token mean, its
    --calculate-per-token-loss) differ: said at start-up; with the flag given, its own line says so instead."""
    sft = [a for a in MOCK if a != "--mock-data"] + ["--data-path", "r.jsonl", "--tokenizer-type", "NullTokenizer"]
    for flag, argv in (("--eod-mask-loss", MOCK), ("--sft", sft)):  # (--sft reads records, not mock data)
        lines = accepted_no_ops(parse_args([*argv, flag])[0])
        assert any(x.startswith(f"{flag}: micro-batches count") for x in lines), lines
    lines = accepted_no_ops(parse_args([*MOCK, "--eod-mask-loss", "--calculate-per-token-loss"])[0])
    assert not any("micro-batches count" in x for x in lines) and any("calculate-per-token" in x for x in lines)
    assert not any("micro-batches count" in x for x in accepted_no_ops(parse_args(MOCK)[0]))


def _from_checkpoint(pretrain: list[str], argv: list[str]):
    from megatron_lite.checkpoint_flags import flags_from_checkpoint
    from megatron_lite.flag_parser import build_parser

    saved = parse_args(pretrain)[1].to_dict()
    return flags_from_checkpoint(build_parser(), argv, build_parser().parse_args(argv), saved, "ckpt")


PRETRAINED = [
    *MOCK,
    *"--swiglu --disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2".split(),
    *"--lr 3e-3 --min-lr 3e-5".split(),
    *"--lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --seed 7 --hidden-dropout 0.0".split(),
    *"--eod-mask-loss --bf16 --grad-reduce-in-bf16 --no-check-for-nan-in-loss-and-grad --moe-layer-freq 0,1".split(),
]


def test_finetune_takes_the_model_from_the_checkpoint_and_the_rest_from_the_flags():
    """Megatron's --finetune reads no flag from the checkpoint; here the model's settings come over (it is the
    model that loads) and nothing else. The pretraining's schedule, seed, dropout, precision and data had come
    over too: a finetune that gave --lr 1e-5 alone was refused for the --min-lr 3e-5 it never gave, and one that
    gave both silently warmed up, decayed and decayed its weights as the pretraining did."""
    argv = "--load ckpt --finetune --seq-length 32 --train-iters 10 --lr 1e-5 --mock-data".split()
    ns = _from_checkpoint(PRETRAINED, argv)
    assert (ns.num_layers, ns.hidden_size, ns.swiglu, ns.num_experts, ns.moe_router_topk) == (2, 768, True, 4, 2)
    assert (ns.lr, ns.min_lr, ns.lr_decay_style, ns.lr_warmup_iters, ns.weight_decay) == (1e-5, 0.0, "linear", 0, 0.01)
    assert (ns.seed, ns.hidden_dropout, ns.eod_mask_loss, ns.bf16, ns.moe_aux_loss_coeff) == (
        1234,
        0.1,
        False,
        False,
        0,
    )
    assert any(n.startswith("--finetune: the model's settings") for n in ns.schedule_notes), ns.schedule_notes


def test_a_resume_says_which_flags_not_given_it_takes_from_the_checkpoint():
    """A resume rebuilds the run from `--load` alone; a switch left on there (--eod-mask-loss) stays on when its
    flag is left out (Megatron's would be off), so start-up names what came over."""
    ns = _from_checkpoint(PRETRAINED, "--load ckpt --train-iters 8".split())
    assert ns.eod_mask_loss and ns.seed == 7 and ns.min_lr == 3e-5
    note = next(n for n in ns.schedule_notes if n.startswith("flags not given take the checkpoint's values: "))
    for flag in ("--eod-mask-loss", "--seed 7", "--min-lr 3e-05", "--lr-decay-style cosine", "--bf16"):
        assert flag in note, (flag, note)
    assert "--num-layers" not in note and "--train-iters" not in note  # (the model's are the model; given ones)
    # each item is a flag as a user gives it (a diff review: "--check-for-nan-in-loss-and-grad off", a switch
    # that takes no value; "--moe-layer-freq 0 1"; and "--moe-layer-freq 1", the default, on every MoE run)
    from megatron_lite.flag_parser import build_parser

    items = note.split(": ", 1)[1].split(", ")
    assert "--no-check-for-nan-in-loss-and-grad" in items and "--moe-layer-freq 0,1" in items, items
    for item in items:
        build_parser().parse_args([*MOCK, *item.split()])


def test_a_precision_given_on_resume_replaces_the_checkpoints():
    """--fp16 on a --bf16 checkpoint was refused as both given ('--bf16 and --fp16 are exclusive'), and then for
    the checkpoint's --grad-reduce-in-bf16."""
    ns = _from_checkpoint(PRETRAINED, "--load ckpt --fp16".split())
    assert ns.fp16 and not ns.bf16 and not ns.grad_reduce_in_bf16


def test_rope_scaling_has_no_effect_on_mla_as_in_megatron():
    """Megatron's GPTModel builds its RotaryEmbedding (and --use-rope-scaling's Llama-3 scaling) only without
    MLA, which builds its own YaRN from --rotary-scaling-factor; here --use-rope-scaling had replaced MLA's YaRN
    (factor 40) with Llama-3 scaling (factor 8), silently."""
    mla = "--multi-latent-attention --disable-bias-linear --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 8"
    mla += " --v-head-dim 8"
    flags = [*MOCK, *mla.split(), "--position-embedding-type", "rope", "--rotary-scaling-factor", "40"]
    alone = parse_args(flags)
    ns, job = parse_args([*flags, "--use-rope-scaling"])
    assert job.model.rope_scaling == alone[1].model.rope_scaling and job.model.rope_scaling.rope_type == "yarn"
    assert job.model.rope_scaling.factor == 40
    assert any(
        n.startswith("--use-rope-scaling has no effect with --multi-latent-attention") for n in accepted_no_ops(ns)
    )
    assert not any("--use-rope-scaling" in n for n in accepted_no_ops(alone[0]))
    # the same launch line resumes (a diff review: refused as conflicting with the checkpoint's False), and a
    # checkpoint saved when --use-rope-scaling still applied to MLA keeps the Llama-3 scaling it was trained with
    from megatron_lite.arguments import job_config_from_args

    resumed = _from_checkpoint([*flags, "--use-rope-scaling"], ["--load", "ckpt", *flags, "--use-rope-scaling"])
    assert job_config_from_args(resumed).model.rope_scaling == job.model.rope_scaling
    from megatron_lite.checkpoint_flags import flags_from_checkpoint
    from megatron_lite.flag_parser import build_parser

    saved = job.to_dict()
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    saved["model"]["rope_scaling"] = {**llama3, "rope_type": "llama3"}
    older = flags_from_checkpoint(build_parser(), ["--load", "ckpt"], build_parser().parse_args(["--load", "ckpt"]),
                                  saved, "ckpt")  # fmt: skip
    scaling = job_config_from_args(older).model.rope_scaling
    assert scaling.rope_type == "llama3" and scaling.factor == 8.0 and scaling.original_max_position_embeddings == 8192


@pytest.mark.parametrize("data", [["--data-path", "corpus_text_document"], ["--mock-data"]])
def test_vocab_size_has_no_effect_with_a_tokenizer_as_in_megatron(data, capsys, monkeypatch):
    """Megatron reads --vocab-size for NullTokenizer alone (its Llama-3 example passes --vocab-size 128256 with
    HuggingFaceTokenizer): the vocabulary is the tokenizer's. With --data-path the flag had won here, building
    an embedding of another size than Megatron's (or than the tokenizer's ids), and the dry run said so too."""
    from megatron_lite.data.builder import resolve_data
    from megatron_lite.data.tokenizers import ByteLevelTokenizer
    from megatron_lite.training.pretrain import main

    flags = [*BASE, *data, "--tokenizer-type", "ByteLevelTokenizer", "--vocab-size", "1000"]
    lines: list[str] = []
    assert resolve_data(parse_args(flags)[1].data, log=lines.append).vocab_size == ByteLevelTokenizer().vocab_size
    assert any(n.startswith("--vocab-size 1000 has no effect with --tokenizer-type ByteLevelTokenizer") for n in lines)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main([*flags, "--dry-run"]) == 0
    assert f"vocabulary {ByteLevelTokenizer().vocab_size}," in capsys.readouterr().out
    lines.clear()  # (NullTokenizer's vocabulary is --vocab-size's: no note, with or without its name)
    for null in ([], ["--tokenizer-type", "NullTokenizer"]):
        assert resolve_data(parse_args([*BASE, "--mock-data", "--vocab-size", "100", *null])[1].data, lines.append)
    assert not lines, lines


def test_a_dry_run_with_load_counts_the_checkpoints_larger_vocabulary(tmp_path, capsys, monkeypatch):
    """The run takes the checkpoint's embedding where it is larger than the tokenizer's ids (a converted Qwen's
    151936 rows for 151665 tokens); the dry run said the tokenizer's (a diff review)."""
    from megatron_lite.data.tokenizers import ByteLevelTokenizer
    from megatron_lite.training.pretrain import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    small = "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1".split()
    ckpt = str(tmp_path / "ckpt")
    run = [*small, "--global-batch-size", "1", "--train-iters", "1", "--eval-iters", "0", "--lr", "1e-3"]
    assert main([*run, "--mock-data", "--vocab-size", "400", "--save", ckpt]) == 0  # (NullTokenizer: 401)
    capsys.readouterr()
    assert ByteLevelTokenizer().vocab_size < 401
    assert main(["--load", ckpt, "--tokenizer-type", "ByteLevelTokenizer", "--dry-run"]) == 0
    assert "vocabulary 401," in capsys.readouterr().out


def test_nccl_without_a_gpu_is_one_line(capsys, monkeypatch):
    """From the validation review: it failed inside torch's device setup (AttributeError _cuda_setDevice) after the
    process group existed, and was ignored at world size 1. Checked by the run, not with the flags: a dry run and
    the planner plan a GPU job on any machine (the diff review: the planner had stopped on it)."""
    import torch

    from megatron_lite.training.pretrain import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert main([*MOCK, "--distributed-backend", "nccl"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --distributed-backend nccl needs CUDA GPUs and this machine has none; use gloo"
    )
    assert parse_args([*MOCK, "--distributed-backend", "nccl"])[1].distributed_backend == "nccl"
    assert main([*MOCK, "--distributed-backend", "nccl", "--dry-run"]) == 0


def test_ddp_average_in_collective_is_accepted_as_a_no_op():
    """From a review of the overlap flags against Megatron-LM: --ddp-average-in-collective (Megatron's DDP averages
    in the collective instead of pre-scaling by 1/DP; scripts pass it beside --overlap-grad-reduce) was refused as
    "no such flag"; our gradients are already the global batch's per-token mean summed over DP, so it changes
    nothing and is accepted with a note."""
    ns, job = parse_args([*MOCK, "--overlap-grad-reduce", "--ddp-average-in-collective"])
    assert job.training.overlap_grad_reduce
    assert any(line.startswith("--ddp-average-in-collective has no effect") for line in accepted_no_ops(ns))


@pytest.mark.parametrize(
    "flag, typo, valid",
    [("--ckpt-format", "torch_dsit", "torch_dist"), ("--transformer-impl", "te", "transformer_engine"),
     ("--attention-backend", "flash_attn", "flash")],
)  # fmt: skip
def test_a_no_op_flags_value_outside_megatrons_choices_is_refused(flag, typo, valid, capsys):
    """(From a review porting Megatron's examples: --ckpt-format torch_dsit was taken with the flag's 'has no
    effect' note; Megatron's argparse refuses a value outside its choices.)"""
    with pytest.raises(SystemExit):
        parse_args([*MOCK, flag, typo])
    assert f"argument {flag}: invalid choice: '{typo}'" in capsys.readouterr().err
    assert any(n.startswith(f"{flag} has no effect") for n in accepted_no_ops(parse_args([*MOCK, flag, valid])[0]))


def test_logging_flags_of_megatrons_examples_are_reported_not_refused():
    """From a logging review: Megatron's example scripts pass --log-memory-interval and the one-logger / app-tag
    flags (beside --no-one-logger and --log-energy, which were taken); each stopped the script as "no such flag"."""
    flags = ["--log-memory-interval", "200", "--one-logger-project", "p", "--one-logger-run-name", "r",
             "--one-logger-async", "--app-tag-run-name", "a", "--app-tag-run-version", "1.0",
             "--check-weight-hash-across-dp-replicas-interval", "20000", "--record-memory-history",
             "--memory-snapshot-path", "s.pickle"]  # fmt: skip
    notes = accepted_no_ops(parse_args([*MOCK, *flags])[0])
    for flag in (f for f in flags if f.startswith("--")):
        assert any(n.startswith(f"{flag} has no effect: ") for n in notes), flag


def test_mla_with_biases_is_refused_for_what_it_is():
    """From the attention review against Megatron-Core: Megatron's MLA does carry a bias (its output projection);
    the refusal said MLA "has no biases". It now says ours has none, as DeepSeek's, and names the fix."""
    mla = ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8"]
    mla += ["--v-head-dim", "16", "--position-embedding-type", "rope"]
    with pytest.raises(ConfigError) as err:
        parse_args([*MOCK, *mla])
    msg = str(err.value)
    assert "MLA's projections have no biases, as DeepSeek-V2/V3's; add --disable-bias-linear" in msg, msg
    assert parse_args([*MOCK, *mla, "--disable-bias-linear"])[1].model.multi_latent_attention


def test_megatrons_deprecated_wd_spelling_and_a_float_loss_scale_window_are_taken():
    """From the optimizer review against Megatron-Core: Megatron's validate_args reads the deprecated
    --no-weight-decay-cond-type apply_wd_to_qk_layernorm as --apply-wd-to-qk-layernorm (it was "no such flag"),
    and --loss-scale-window is a float there ("1000.0" was "invalid int value")."""
    ns, job = parse_args([*MOCK, "--no-weight-decay-cond-type", "apply_wd_to_qk_layernorm"])
    assert job.optimizer.apply_wd_to_qk_layernorm
    assert any(n.startswith("--no-weight-decay-cond-type apply_wd_to_qk_layernorm is Megatron's deprecated spelling")
               for n in accepted_no_ops(ns))  # fmt: skip
    assert not parse_args(MOCK)[1].optimizer.apply_wd_to_qk_layernorm
    assert parse_args([*MOCK, "--fp16", "--loss-scale-window", "500.0"])[1].optimizer.loss_scale_window == 500
    with pytest.raises(ConfigError, match=r"^--loss-scale-window 2.5 must be a whole number of iterations$"):
        parse_args([*MOCK, "--fp16", "--loss-scale-window", "2.5"])


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("percent", ["1.0", "0.5"])
def test_rotary_interleaved_is_rotate_half_on_the_permuted_query_and_key_rows(kernels, percent):
    """Megatron's --rotary-interleaved (refused before) rotates each head's pairs (0, 1), (2, 3), ...: a model with
    it computes what the rotate-half model computes once each query and key head's rotated rows are reordered
    the way Hugging Face's Llama converter reorders Meta's interleaved weights (evens, then odds)."""
    import torch

    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16"]
    flags += ["--train-iters", "2", "--mock-data", "--vocab-size", "100", "--position-embedding-type", "rope"]
    flags += ["--group-query-attention", "--num-query-groups", "2", "--rotary-percent", percent]
    flags += ["--kernel-impl", kernels, "--hidden-dropout", "0", "--attention-dropout", "0"]
    _, inter = parse_args([*flags, "--rotary-interleaved"])
    _, half = parse_args(flags)
    ctx = ParallelContext.virtual(inter.parallel, 1)
    a, b = build_model(inter.model, ctx, seed=5), build_model(half.model, ctx, seed=5)
    d, r = 16, int(16 * float(percent))
    order = [*range(0, r, 2), *range(1, r, 2), *range(r, d)]  # (a head's rows: evens, odds, the unrotated rest)
    state = a[0].full_state_dict()
    for name, w in state.items():
        if name.endswith("linear_qkv.weight"):  # per group: 2 query heads, its key, its value, 16 rows each
            heads = w.view(2, 4, d, -1)
            heads = torch.cat([heads[:, :3, order], heads[:, 3:]], dim=1)  # (q and k reordered, v as it is)
            state[name] = heads.reshape(w.shape)
    b[0].load_full_state_dict(state)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        la, lb = a[0](tokens), b[0](tokens)
    assert torch.allclose(la, lb, rtol=1e-5, atol=1e-5), (la - lb).abs().max()
    with torch.no_grad():  # (and the same weights rotated by halves compute something else)
        assert (la - build_model(half.model, ctx, seed=5)[0](tokens)).abs().max() > 1e-3


def test_an_interleaved_rope_model_is_not_exported_to_a_rotate_half_class():
    from megatron_lite.models.hf import check_exportable

    flags = [*MOCK, "--position-embedding-type", "rope", "--disable-bias-linear", "--rotary-interleaved"]
    with pytest.raises(ConfigError, match=r"interleaved RoPE \(--rotary-interleaved; Hugging Face's classes rotate"):
        check_exportable(parse_args(flags)[1].model, "LlamaForCausalLM")


def test_expert_lora_below_expert_tensor_parallelism_is_accepted():
    """(It was refused after a review found the expert adapters' copied half summed over TP; that sum is over
    expert-TP now, and tests/test_lora.py -k below_tp holds the run to one process's.)"""
    moe = [*MOCK, "--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel",
           "--disable-bias-linear", "--lora-rank", "4"]  # fmt: skip
    job = parse_args([*moe, "--expert-tensor-parallel-size", "1", "--lora-target-modules", "experts"])[1]
    assert job.parallel.etp == 1 and "experts" in job.lora.target_modules


def test_no_bias_gelu_fusion_resumes_a_checkpoint_of_another_activation(tmp_path, capsys, monkeypatch):
    """(From a review: --swiglu with biases and --no-bias-gelu-fusion, which changes nothing there, as in Megatron,
    trained, then refused to resume its own checkpoint: '--no-bias-gelu-fusion True conflicts with the checkpoint'.)"""
    from test_pretrain_cli import _run

    ckpt = str(tmp_path / "ckpt")
    for act in ("--swiglu", "--squared-relu", "--openai-gelu"):
        argv = ["--mock-data", "--vocab-size", "100", act, "--no-bias-gelu-fusion", "--save", ckpt + act]
        rc, _, err = _run([*argv, "--train-iters", "1"], capsys, monkeypatch)
        assert rc == 0, err
        rc, out, err = _run([*argv, "--load", ckpt + act, "--train-iters", "2"], capsys, monkeypatch)
        assert rc == 0 and "iteration        2/" in out, (act, err)
