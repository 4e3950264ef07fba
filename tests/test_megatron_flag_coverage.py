"""Every flag of Megatron-LM's megatron/training/arguments.py (tests/data/megatron_lm_flags.txt) is known to
pretrain_gpt.py: implemented, accepted with a start-up note that it changes nothing here, or refused with one line
saying why. A flag-coverage review found 252 of its 591 flags "no such flag in pretrain_gpt.py (... remove it)",
which told a Megatron user to drop flags that change the model (--quick-geglu, --glu-linear-offset), the data
(--padded-vocab-size, --allow-ambiguous-pad-tokens), the optimization (the Muon flags) or the run (Retro, RL)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_lite.arguments import parse_args
from megatron_lite.config import ConfigError
from megatron_lite.flag_parser import build_parser
from megatron_lite.megatron_flags import accepted_no_ops

BASE = "--hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-iters 4 --mock-data --vocab-size 100".split()
MOCK = ["--num-layers", "2", *BASE]
MEGATRON_FLAGS = Path(__file__).parent / "data" / "megatron_lm_flags.txt"


def test_every_flag_of_megatron_lm_is_known_here():
    """A flag Megatron adds later shows up here: implement it, or add it to megatron_flag_tables.py."""
    flags = [line.strip() for line in MEGATRON_FLAGS.read_text().splitlines() if line.strip()[:1] not in ("", "#")]
    assert len(flags) == len(set(flags)) == 591 and all(f.startswith("--") for f in flags)
    ours = {s for a in build_parser()._actions for s in a.option_strings}
    assert not [f for f in flags if f not in ours]


REFUSED_HERE = {  # (the start of each reason: the flags)
    "Retro (retrieval-augmented GPT) is not": (
        "--retro-project-dir --retro-add-retriever --retro-cyclic-train-iters --retro-encoder-layers "
        "--retro-encoder-hidden-dropout --retro-encoder-attention-dropout --retro-num-neighbors "
        "--retro-num-retrieved-chunks --retro-attention-gate --retro-no-verify-neighbor-count"
    ),
    "RL (GRPO) training is not implemented": (
        "--perform-rl-step --rl-prompts-per-eval --grpo-prompts-per-step --grpo-group-size --grpo-iterations "
        "--grpo-clamp-eps-lower --grpo-clamp-eps-upper --grpo-kl-beta --grpo-entropy-term-weight "
        "--grpo-filter-groups-with-same-reward --grpo-default-temperature --grpo-default-top-p "
        "--langrl-inference-server-type --langrl-inference-server-conversation-template --langrl-external-server "
        "--no-langrl-external-server --langrl-env-config --rl-offload-optimizer-during-inference "
        "--rl-offload-kv-cache-during-training --no-rl-offload-kv-cache-during-training "
        "--rl-remove-kv-cache-during-training --no-rl-remove-kv-cache-during-training --rl-reset-cuda-graphs "
        "--no-rl-reset-cuda-graphs --rl-partial-rollouts --no-rl-partial-rollouts "
        "--rl-inference-logprobs-is-correction --no-rl-inference-logprobs-is-correction "
        "--rl-importance-sampling-truncation-coef --rl-calculate-intra-group-similarity "
        "--no-rl-calculate-intra-group-similarity --rl-use-sequence-packing --rl-sequence-packing-bin-size "
        "--rl-sequence-packing-algo"
    ),
    "Kitchen quantization is not implemented": "--kitchen-config-file --kitchen-recipe-number",
    "checkpoints are not converted in a run: ours": (
        "--ckpt-convert-format --ckpt-convert-save --ckpt-convert-update-legacy-dist-opt-format"
    ),
    "FP4 (NVFP4) training is not implemented": "--fp4-format",
    "weights kept and all-gathered in FP4 are not": "--fp4-param-gather",
    "CUDA graphs are not": "--external-cuda-graph",
    "in-process restart is not implemented: a": "--inprocess-restart",
    "the NVIDIA fault-tolerance package is not": "--enable-ft-package",
    "Megatron's old batch-size flag, which it": "--batch-size",
    "Megatron's old warmup flag, which it refuses": "--warmup",
    "Megatron's old name, which it refuses too": "--model-parallel-size --checkpoint-activations",
    "activations are not offloaded to the CPU (0": "--cpu-offloading-num-layers",
    "parameter-group maps are not read or": "--dump-param-to-param-group-map",
    "use --load DIR --finetune (its weights, with": "--pretrained-checkpoint",
    "the loss is computed in fp32 from the": "--fp16-lm-cross-entropy",
    "PyTorch's bf16 GEMMs are left as PyTorch": "--disable-bf16-reduced-precision-matmul",
    "the vocabulary is padded to a multiple of": "--padded-vocab-size",
    "extra (T5 sentinel) vocabulary ids are not": "--vocab-extra-ids",
    "tokenizer metadata files are not read": "--tokenizer-metadata",
    "a pad id shared with another token is not": "--allow-ambiguous-pad-tokens",
    "deprecated in Megatron; use": "--moe-extended-tp",
    "custom layer specs are not implemented: the": "--spec",
    "YAML configs are not read: give the": "--yaml-cfg",
    "--sft reads prompt/response records as written": "--sft-tokenizer-prompt-format",
}
NO_EFFECT_HERE = (  # (with a value where the flag takes one)
    "--inference-batch-times-seqlen-threshold 1 --max-tokens-to-oom 1 --inference-max-requests 1 "
    "--inference-max-seq-length 1 --inference-max-batch-size 1 --inference-dynamic-batching-buffer-size-gb 1 "
    "--inference-dynamic-batching-block-size 1 --inference-dynamic-batching-buffer-guaranteed-fraction 1 "
    "--inference-dynamic-batching-buffer-overflow-factor 1 --inference-dynamic-batching-max-requests-override "
    "1 --inference-dynamic-batching-max-tokens-override 1 --inference-dynamic-batching-num-cuda-graphs 1 "
    "--inference-dynamic-batching-unified-memory-level 1 --mlp-chunks-for-prefill 1 --symmetric-ar-type 1 "
    "--inference-wandb-logging-step-interval 1 --flash-decode --use-legacy-static-engine "
    "--inference-dynamic-batching --inference-dynamic-batching-track-paused-request-events "
    "--decode-only-cuda-graphs --nccl-all-reduce-for-prefill --disable-chunked-prefill "
    "--inference-rng-tracker --moe-pad-experts-for-cuda-graph-inference --cache-mla-latents "
    "--cuda-graph-warmup-steps 1 --cuda-graph-scope 1 --bert-embedder-type 1 --bert-load 1 "
    "--decoder-num-layers 1 --decoder-seq-length 1 --relative-attention-num-buckets 1 "
    "--relative-attention-max-distance 1 --sample-rate 1 --mask-prob 1 --short-seq-prob 1 "
    "--output-bert-embeddings --bert-no-binary-head --ict-head-size 1 --biencoder-projection-dim 1 --ict-load "
    "1 --titles-data-path 1 --query-in-block-prob 1 --evidence-data-path 1 --block-data-path 1 "
    "--embedding-path 1 --indexer-batch-size 1 --indexer-log-interval 1 --retriever-seq-length 1 "
    "--retriever-report-topk-accuracies 1 2 --biencoder-shared-query-context-model --use-one-sent-docs "
    "--retriever-score-scaling --num-classes 1 --img-h 1 --img-w 1 --num-channels 1 --patch-dim 1 "
    "--classes-fraction 1 --data-per-class-fraction 1 --head-lr-mult 1 --vision-pretraining-type 1 "
    "--vision-backbone-type 1 --swin-backbone-type 1 --mask-type 1 --mask-factor 1 --iter-per-epoch 1 "
    "--dino-local-img-size 1 --dino-local-crops-number 1 --dino-head-hidden-size 1 --dino-bottleneck-size 1 "
    "--dino-freeze-last-layer 1 --dino-warmup-teacher-temp 1 --dino-teacher-temp 1 "
    "--dino-warmup-teacher-temp-epochs 1 --no-data-sharding --vision-pretraining --dino-norm-last-layer "
    "--inprocess-max-iterations 1 --inprocess-monitor-thread-interval 1 --inprocess-monitor-process-interval "
    "1 --inprocess-progress-watchdog-interval 1 --inprocess-heartbeat-interval 1 --inprocess-soft-timeout 1 "
    "--inprocess-hard-timeout 1 --inprocess-heartbeat-timeout 1 --inprocess-barrier-timeout 1 "
    "--inprocess-completion-timeout 1 --inprocess-last-call-wait 1 --inprocess-termination-grace-time 1 "
    "--inprocess-granularity 1 --inprocess-active-world-size 1 --inprocess-empty-cuda-cache "
    "--optimizer-offload-fraction 1 --use-torch-optimizer-for-cpu-offload --overlap-cpu-optimizer-d2h-h2d "
    "--suggested-communication-unit-size 1 --fsdp-double-buffer --keep-fp8-transpose-cache "
    "--enable-full-sharding-in-hsdp --sharp-enabled-group 1 --nccl-communicator-config-path 1 --use-nccl-ub "
    "--disable-symmetric-registration --use-sharp --no-strict-fsdp-dtensor-load "
    "--dist-ckpt-save-pre-mcore-014 --dist-ckpt-optim-fully-reshardable "
    "--distrib-optim-fully-reshardable-mem-efficient --replication-jump 1 --replication-factor 1 "
    "--replication --fp4-recipe 1 --fp4-quantizer-factory 1 --fp8-quantizer-factory 1 --mrope-section 1 2 "
    "--onnx-safe 1 --run-workload-inspector-server --calc-ft-timeouts --config-logger-dir 1 "
    "--decrease-batch-size-if-needed --distribute-saved-activations --result-rejected-tracker-filename 1 "
    "--train-sync-interval 1 --use-fused-weighted-squared-relu --pipeline-model-parallel-comm-backend 1 "
    "--high-priority-stream-groups 1 2 --use-te-activation-func --use-mp-args-from-checkpoint-args "
    "--no-use-tokenizer-model-from-checkpoint-args --reuse-grad-buf-for-mxfp8-param-ag --ddp-num-buckets 1 "
    "--ddp-pad-buckets-for-high-nccl-busbw --use-ring-exchange-p2p --lazy-mpu-init 1 "
    "--init-model-with-meta-device --use-tp-pp-dp-mapping --test-mode --trust-remote-code "
    "--object-storage-cache-path 1 --adlr-autoresume --adlr-autoresume-interval 1 "
    "--moe-router-padding-for-fp8 --moe-deepep-num-sms 1 --delay-wgrad-compute"
)


def _split(flags: str) -> list[list[str]]:
    """'--a 1 --b' -> [['--a', '1'], ['--b']]."""
    out: list[list[str]] = []
    for tok in flags.split():
        out.append([tok]) if tok.startswith("--") else out[-1].append(tok)
    return out


@pytest.mark.parametrize(
    "flag, why",
    [(flag, why) for why, flags in REFUSED_HERE.items() for [flag] in _split(flags)],
)
def test_megatrons_flags_we_lack_are_refused_in_one_line(flag, why):
    with pytest.raises(ConfigError) as e:
        parse_args([*MOCK, flag])
    assert str(e.value).startswith(f"{flag} is not supported: {why}") and "\n" not in str(e.value), str(e.value)
    # (or the reason's own advice: what to give instead; tests/test_flag_notes.py: one piece of advice a line)
    assert str(e.value).endswith("; remove the flag") or re.search(r"[:;] (use|give) ", str(e.value)), str(e.value)


@pytest.mark.parametrize("flag", _split(NO_EFFECT_HERE), ids=lambda f: f[0])
def test_megatrons_flags_that_change_nothing_here_are_reported(flag):
    notes = accepted_no_ops(parse_args([*MOCK, *flag])[0])
    assert any(n.startswith(f"{flag[0]} has no effect: ") for n in notes), notes


def test_encoder_num_layers_is_num_layers_as_in_megatron():
    """Megatron's validate_args: --encoder-num-layers sets --num-layers; both given is an error."""
    assert parse_args(["--encoder-num-layers", "3", *BASE])[1].model.num_layers == 3
    assert parse_args(["--encoder-num-layers=3", *BASE])[1].model.num_layers == 3
    with pytest.raises(ConfigError, match="^--encoder-num-layers is Megatron's other name for --num-layers: give one"):
        parse_args(["--encoder-num-layers", "3", *MOCK])


def test_megatrons_defaults_of_refused_flags_are_taken_silently():
    """A refused flag given as Megatron's default changes nothing: taken, and not said."""
    flags = ["--cpu-offloading-num-layers", "0", "--vocab-extra-ids", "0", "--glu-linear-offset", "0.0",
             "--moe-upcycling-granularity", "1", "--spec", "local", "--data-parallel-sharding-strategy", "no_shard",
             "--error-injection-rate", "0", "--error-injection-type", "transient_error",
             "--sft-tokenizer-prompt-format", "nemotron-h-aligned"]  # fmt: skip
    ns, _ = parse_args([*MOCK, *flags])
    said = r"offloading|extra-ids|glu|upcycling|--spec|sharding|injection|prompt-format"
    assert not [n for n in accepted_no_ops(ns) if re.search(said, n)]
    for flag, value in (("--spec", "my.module"), ("--vocab-extra-ids", "100"), ("--error-injection-rate", "5"),
                        ("--data-parallel-sharding-strategy", "optim_grads_params")):  # fmt: skip
        with pytest.raises(ConfigError, match=f"^{flag} is not supported"):
            parse_args([*MOCK, flag, value])


def test_megatrons_list_flags_take_their_lists():
    """Megatron's nargs='+' / '*' flags take several values (one-value no-ops stopped on the second)."""
    flags = ["--retriever-report-topk-accuracies", "1", "5", "20", "--mrope-section", "16", "24", "24",
             "--high-priority-stream-groups", "dp", "tp"]  # fmt: skip
    notes = accepted_no_ops(parse_args([*MOCK, *flags])[0])
    assert all(any(n.startswith(f"{f} has no effect") for n in notes) for f in flags if f.startswith("--"))


def test_zero_experts_is_a_dense_model_as_in_megatron():
    """Megatron's validate_args reads --num-experts 0 as None (a dense model; scripts pass ${NUM_EXPERTS}): it was
    refused here as below 1. A negative count is still refused."""
    _, job = parse_args([*MOCK, "--num-experts", "0"])
    assert job.model.num_experts is None
    with pytest.raises(ConfigError, match=r"--num-experts -2 must be >= 1"):
        parse_args([*MOCK, "--num-experts", "-2"])


def test_megatrons_newer_hybrid_layer_pattern_reads_as_the_override_pattern():
    """Megatron-LM's HybridModel scripts give --hybrid-layer-pattern (its newer name for --hybrid-override-pattern)
    with its newer stack spec and no --num-layers, the pattern's length (an exploratory port: "no such flag")."""
    flags = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16", "--train-iters", "1",
             "--mock-data", "--vocab-size", "100", "--mamba-num-groups", "1", "--hybrid-layer-pattern", "M*-M",
             "--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"]  # fmt: skip
    _, job = parse_args(flags)
    assert (job.model.num_layers, job.model.hybrid_override_pattern) == (4, "M*-M")
    assert job.model.layer_types == parse_args([*flags[:-3], "--num-layers", "4"])[1].model.layer_types
    with pytest.raises(ConfigError, match="--hybrid-layer-pattern is Megatron's other name for"):
        parse_args([*flags, "--hybrid-override-pattern", "M*-M"])
