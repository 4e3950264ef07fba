"""Megatron's own example scripts and flags through the entry point: refused flags with their reasons, flags taken as
no-ops with the reason said, and Megatron's Llama-3 and DeepSeek-V3 recipes running as given. (Split from
tests/test_pretrain_cli.py.)"""

from __future__ import annotations

import pytest
from test_pretrain_cli import _one_line_error, _run

from megatron_lite.training.pretrain import main


@pytest.mark.parametrize(
    "argv,fragments",
    [
        (["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"], ["--fp8-recipe blockwise is not implemented"]),
        # every refused flag in one line (a script with four refused flags was refused four times over)
        (
            ["--fp8-format", "hybrid", "--fp8-param-gather", "--enable-cuda-graph"],
            ["--fp8-param-gather --enable-cuda-graph are not supported", "CUDA graphs are not implemented"],
        ),
        (["--grad-reduce-in-bf16", "--fp16"], ["--grad-reduce-in-bf16", "--fp16", "use --bf16"]),
        (["--hierarchical-context-parallel-sizes", "2", "2"], ["--hierarchical-context-parallel-sizes", "a2a+p2p"]),
        (["--bf16", "--fp16"], ["--bf16", "--fp16"]),
        (["--dataloader-type", "external"], ["--dataloader-type external", "single or cyclic"]),
        (["--optimizer", "sgd", "--sgd-momentum", "1.5"], ["--sgd-momentum 1.5", "[0, 1)"]),
        (
            ["--mock-data", "--vocab-size", "100", "--no-save-optim", "--nan-policy", "rollback", "--save", "x"],
            ["--nan-policy rollback", "--no-save-optim"],
        ),
        (["--mock-data"], ["--mock-data needs --vocab-size"]),
        # adapters-only checkpoints whose base was random could never be loaded again
        (
            ["--mock-data", "--vocab-size", "100", "--lora-rank", "4", "--qlora", "--save", "x"],
            ["--qlora with no base checkpoint loaded", "--save x", "add --load BASE --finetune"],
        ),
        (
            ["--mock-data", "--vocab-size", "100", "--lora-rank", "4", "--qlora", "--save", "x", "--dry-run"],
            ["--qlora with no base checkpoint loaded (--load None: not given)", "--save x", "add --load BASE"],
        ),
        # with no data the embedded corpus's own tokenizer was used and these dropped silently
        (["--vocab-size", "32000"], ["--vocab-size 32000 without data", "add --mock-data"]),
        (["--tokenizer-type", "GPT2BPETokenizer"], ["--tokenizer-type GPT2BPETokenizer without data"]),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--num-virtual-stages-per-pipeline-rank",
                "2",
            ],
            ["--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank"],
        ),  # fmt: skip
        (["--lr-warmup-iters", "10", "--lr-warmup-fraction", "0.3"], ["--lr-warmup-fraction and --lr-warmup-iters"]),
        (["--mock-data", "--vocab-size", "100", "--swiglu", "--squared-relu"], ["--swiglu and --squared-relu"]),
        (
            ["--mock-data", "--vocab-size", "100", "--position-embedding-type", "rope", "--rotary-percent", "1.5"],
            ["--rotary-percent 1.5 must be in (0, 1]"],
        ),
    ],
)
def test_refused_flags(argv, fragments, capsys, monkeypatch):
    rc, _, err = _run(argv, capsys, monkeypatch)
    _one_line_error(rc, err, *fragments)


def test_megatron_moe_and_fusion_flags_are_taken_and_explained():
    """Flags every Megatron MoE script passes (--moe-grouped-gemm was refused while a Triton grouped GEMM
    already ran the experts): accepted, each with the line start-up prints."""
    from megatron_lite.arguments import build_parser
    from megatron_lite.megatron_flags import accepted_no_ops

    flags = ["--moe-grouped-gemm", "--use-flash-attn", "--no-rope-fusion", "--cross-entropy-loss-fusion"]
    lines = accepted_no_ops(build_parser().parse_args(["--num-layers", "2", *flags]))
    assert sorted(line.split()[0] for line in lines) == sorted(flags) and all("--kernel-impl" in line for line in lines)
    # Megatron's Mixtral example passes --sequence-parallel at TP=1: said, not silently kept
    sp = accepted_no_ops(build_parser().parse_args(["--sequence-parallel"]))
    assert sp == ["--sequence-parallel has no effect at --tensor-model-parallel-size 1 (Megatron turns it off)"]
    # --grad-reduce-in-bf16 in an fp32 run: said, not silently kept; with --bf16 it acts (no line)
    fp32 = accepted_no_ops(build_parser().parse_args(["--grad-reduce-in-bf16"]))
    assert fp32 == ["--grad-reduce-in-bf16 has no effect without --bf16: fp32 gradients are reduced in fp32"]
    assert accepted_no_ops(build_parser().parse_args(["--grad-reduce-in-bf16", "--bf16"])) == []


def _edit(flags: list[str], **values) -> list[str]:
    """A script's flags with some flags' values replaced (the sizes, so that it runs on a CPU), by their names with
    underscores; None drops the flag with its values."""
    out, i = [], 0
    while i < len(flags):
        j = i + 1
        while j < len(flags) and not flags[j].startswith("--"):
            j += 1
        name = flags[i][2:].replace("-", "_")
        if name not in values:
            out += flags[i:j]
        elif values[name] is not None:
            out += [flags[i], *str(values[name]).split()]
        i = j
    return out


# Megatron-LM's examples/llama/train_llama3_8b_h200_bf16.sh, mock-data branch, its flags unchanged (the
# `--split '99,1,0'` quotes included, as the script's unquoted array hands them over) except the model and run
# sizes; CKPT stands for its checkpoint directory.
MEGATRON_LLAMA3_8B_H200_BF16 = """--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 224
    --num-attention-heads 4 --group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 32
    --max-position-embeddings 32 --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0
    --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused
    --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1
    --global-batch-size 4 --train-samples 24 --lr-decay-samples 20 --lr-warmup-samples 4 --lr 0.00015
    --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion
    --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1 --exit-duration-in-mins 235
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --tensor-model-parallel-size 1
    --context-parallel-size 1 --sequence-parallel --mock-data --tokenizer-type NullTokenizer --vocab-size 1000
    --data-cache-path CKPT/cache --tiktoken-pattern v2 --split '99,1,0' --no-create-attention-mask-in-dataloader
    --no-mmap-bin-files --num-workers 1 --log-interval 1 --save-interval 1000 --log-throughput --profile
    --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
    --save CKPT --load CKPT --tensorboard-dir CKPT/tb --wandb-project megatron-lm-training
    --wandb-exp-name llama3x-8b-bf16-tp1 --wandb-save-dir CKPT/wandb --log-params-norm --log-num-zeros-in-grad
    --log-timers-to-tensorboard"""


def test_megatron_llama3_h200_bf16_example_runs(tmp_path, capsys, monkeypatch):
    """Megatron's Llama-3 8B H200 bf16 script ports by changing its entry point: every flag is taken, and it
    trains with gradients reduced in bf16 through the distributed optimizer. Three of its flags need what a
    CPU test machine lacks: --profile (Nsight Systems, refused without CUDA), --tensorboard-dir (the tensorboard
    package, refused at start-up when absent) and the W&B flags (W&B runs in tests/test_pretrain_torchrun.py)."""
    import importlib.util

    from megatron_lite.arguments import parse_args

    flags = MEGATRON_LLAMA3_8B_H200_BF16.replace("CKPT", str(tmp_path / "ckpt")).split()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    if importlib.util.find_spec("tensorboard") is None:
        assert main(flags) == 2
        _one_line_error(2, capsys.readouterr().err, "--tensorboard-dir", "pip install tensorboard")
    else:
        _, job = parse_args(flags)
        assert job.logging.tensorboard_dir
    kept = _edit(flags, profile=None, profile_step_start=None, profile_step_end=None, tensorboard_dir=None)
    kept = _edit(kept, wandb_project=None, wandb_exp_name=None, wandb_save_dir=None)
    _, job = parse_args(kept)
    assert job.optimizer.grad_reduce_in_bf16 and job.optimizer.use_distributed_optimizer
    assert job.data.split_weights == (0.99, 0.01, 0.0)
    assert main(kept) == 0
    out = capsys.readouterr().out
    assert "gradients reduced in bfloat16" in out
    assert "--tiktoken-pattern has no effect without --tokenizer-type TikTokenizer" in out
    assert "iteration        6/       6 |" in out and "saved" in out


# Megatron-LM's examples/llama/train_llama3.sh (AMD's), its flags unchanged (the `--eval-iters '-1'` of its
# default written without quotes) except the model and run sizes and data: NullTokenizer on mock data in place
# of a Hugging Face tokenizer download.
MEGATRON_LLAMA3_AMD = """--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 4 --seq-length 32
    --max-position-embeddings 131072 --untie-embeddings-and-output-weights --position-embedding-type rope
    --no-position-embedding --swiglu --disable-bias-linear --init-method-std 0.02 --attention-dropout 0.0
    --hidden-dropout 0.0 --normalization RMSNorm --micro-batch-size 1 --global-batch-size 8 --train-iters 3
    --no-async-tensor-model-parallel-allreduce --bf16 --no-masked-softmax-fusion --tokenizer-type NullTokenizer
    --vocab-size 1000 --dataloader-type cyclic --save-interval 200000 --log-interval 1 --eval-interval 320000
    --eval-iters 10 --num-workers 0 --mock-data --log-interval 1 --log-throughput --no-save-optim --no-save-rng
    --eval-iters -1 --group-query-attention --num-query-groups 2 --no-gradient-accumulation-fusion
    --distributed-backend gloo --distributed-timeout-minutes 120 --overlap-grad-reduce --rerun-mode disabled
    --use-distributed-optimizer --overlap-param-gather --use-flash-attn --sequence-parallel --use-mcore-models
    --lr 1e-4 --min-lr 1e-5 --lr-decay-iters 320000 --lr-decay-style cosine --weight-decay 1.0e-1 --clip-grad 1.0
    --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95"""


def test_megatron_llama3_amd_example_runs(tmp_path, capsys, monkeypatch):
    """The flags Megatron's Llama-3 example passes that nothing else here did: --dataloader-type cyclic,
    --no-save-optim, --no-save-rng, --rerun-mode, --no-async-tensor-model-parallel-allreduce, and --save-interval
    without --save (ignored by Megatron, said here). NCCL is its backend; gloo on this CPU."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert main(MEGATRON_LLAMA3_AMD.split()) == 0
    out = capsys.readouterr().out
    for line in (
        "--dataloader-type cyclic has no effect",
        "--rerun-mode has no effect",
        "--no-async-tensor-model-parallel-allreduce has no effect",
        "--save-interval 200000 has no effect without --save",
    ):
        assert line in out, line
    assert "iteration        3/       3 |" in out


# Megatron's DeepSeek-V3 recipe flags (model sizes and data scaled down to a CPU): MLA, sigmoid-routed MoE with the
# expert bias and groups, one MTP depth, selective recompute of MLA's up-projections, the experts' activation and the
# norms, the embedding and loss counted in the pipeline split, and fusion / logging switches that change nothing here.
MEGATRON_DEEPSEEK_V3 = """--num-layers 3 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 --kv-channels 16
    --multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 12 --qk-pos-emb-head-dim 8
    --v-head-dim 10 --qk-layernorm --seq-length 32 --max-position-embeddings 32 --normalization RMSNorm
    --norm-epsilon 1e-6 --swiglu --position-embedding-type rope --untie-embeddings-and-output-weights
    --disable-bias-linear --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 24
    --moe-shared-expert-intermediate-size 24 --moe-layer-freq ([0]*1+[1]*2) --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias --moe-router-num-groups 4 --moe-router-group-topk 2
    --moe-router-topk-scaling-factor 2.5 --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-permute-fusion --moe-router-fusion
    --moe-shared-expert-overlap --moe-per-layer-logging --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
    --recompute-granularity selective --recompute-modules mla_up_proj moe_act layernorm
    --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split
    --cross-entropy-loss-fusion --cross-entropy-fusion-impl te --manual-gc --manual-gc-interval 10
    --micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 1e-4 --log-interval 1 --eval-iters 0
    --mock-data --vocab-size 256 --tokenizer-type NullTokenizer --distributed-backend gloo"""


def test_megatron_deepseek_v3_recipe_flags_run(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert main(MEGATRON_DEEPSEEK_V3.split()) == 0
    out = capsys.readouterr().out
    for line in (
        "--moe-router-fusion has no effect",
        "--moe-shared-expert-overlap has no effect",
        "--cross-entropy-fusion-impl has no effect",
        "--manual-gc-interval has no effect",
    ):
        assert line in out, line
    assert "iteration        3/       3 |" in out and "mtp_1 loss: " in out


@pytest.mark.parametrize(
    "flag,fragment",
    [
        (["--enable-cuda-graph"], "CUDA graphs are not implemented"),
        (["--optimizer-cpu-offload"], "no CPU offload"),
        (["--moe-layer-recompute"], "--recompute-modules moe"),
    ],
)
def test_megatron_flags_we_lack_are_refused_with_the_reason(flag, fragment, capsys, monkeypatch):
    rc, _, err = _run(["--mock-data", "--vocab-size", "64", *flag], capsys, monkeypatch)
    _one_line_error(rc, err, fragment)


def _gpt2_files(tmp_path) -> dict[str, str]:
    """A GPT-2 vocab.json / merges.txt pair (27 tokens) and an indexed dataset of ids below 27."""
    import json

    from test_pretrain_cli import _dataset

    (tmp_path / "vocab.json").write_text(json.dumps({"<|endoftext|>": 0, **{chr(97 + i): i + 1 for i in range(26)}}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    data = _dataset(tmp_path, max_id=26, docs=200)
    return dict(vocab_file=tmp_path / "vocab.json", merge_file=tmp_path / "merges.txt", data_path=data)


def _dry_run(flags: list[str], world: int, capsys, monkeypatch) -> str:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    rc = main([*flags, "--dry-run"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


def _train(flags: list[str], capsys, monkeypatch) -> str:
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    rc = main(flags)
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh (as stored at commit 157006d6d9bf), its flags
# unchanged; DATA, VOCAB, MERGES, CKPT and TB stand for its five arguments.
MEGATRON_GPT3_175B = """--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
    --max-position-embeddings 2048 --attention-backend auto --micro-batch-size 1 --global-batch-size 1536
    --rampup-batch-size 16 16 5859375 --train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
    --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6
    --lr-warmup-fraction .001 --lr-decay-iters 430000 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
    --data-path DATA --vocab-file VOCAB --merge-file MERGES --split 949,50,1 --log-interval 100 --save-interval 10000
    --eval-interval 1000 --save CKPT --load CKPT --eval-iters 10 --tensorboard-dir TB"""


def test_megatron_gpt3_175b_example(tmp_path, capsys, monkeypatch):
    """As given, the script is refused as Megatron refuses it (its validate_args asserts no batch-size ramp-up in an
    iteration-based run). Without the ramp-up it plans at its own 128 ranks (TP=8, PP=16) and, shrunk, trains in
    fp16 from GPT-2 files with no --tokenizer-type: Megatron's initial loss scale 2^32 skips the first steps."""
    files = _gpt2_files(tmp_path)
    flags = MEGATRON_GPT3_175B.split()
    flags = _edit(flags, **files, save=tmp_path / "ckpt", load=tmp_path / "ckpt", tensorboard_dir=None)
    rc, _, err = _run_at(flags, 128, capsys, monkeypatch)
    _one_line_error(rc, err, "--rampup-batch-size 16 16 5859375 needs a sample-based run", "--train-samples")
    flags = _edit(flags, rampup_batch_size=None)
    out = _dry_run(flags, 128, capsys, monkeypatch)
    assert "dry run ok: 96 layers" in out and "173.99B parameters" in out
    tiny = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, max_position_embeddings=32)
    tiny |= dict(global_batch_size=2, train_iters=2, tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    out = _train(_edit(flags, **tiny, log_interval=1, eval_iters=1), capsys, monkeypatch)
    assert "GPT2BPETokenizer reads them" in out and "loss scale: 4294967296.0" in out
    assert "iteration        2/       2 |" in out and "saved" in out


def _run_at(flags, world, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    rc = main(flags)
    out = capsys.readouterr()
    return rc, out.out, out.err


# Megatron-LM's examples/mamba/train.sh, MODEL_SCALE 800M (as stored at commit 157006d6d9bf), its flags unchanged;
# DATA and TOKENIZER stand for its arguments, the ./checkpoints, ./data-cache and ./tensorboard folders for CKPT,
# CACHE and TB. Every Megatron Mamba script passes this --spec: its mamba_builder raises without one.
MEGATRON_MAMBA_800M = """--tensor-model-parallel-size 1 --sequence-parallel --pipeline-model-parallel-size 1
    --use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce --untie-embeddings-and-output-weights
    --init-method-std 0.02 --position-embedding-type none --num-layers 48 --hidden-size 1024 --num-attention-heads 16
    --group-query-attention --num-query-groups 8 --hybrid-attention-ratio 0.08 --hybrid-mlp-ratio 0.5
    --seq-length 4096 --max-position-embeddings 4096 --train-samples 73242188 --lr-warmup-samples 50000
    --lr-decay-samples 73192188 --save CKPT --load CKPT --data-path DATA --data-cache-path CACHE --split 99,1,0
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model TOKENIZER --distributed-backend nccl
    --micro-batch-size 4 --global-batch-size 32 --lr 2.5e-4 --min-lr 2.5e-5 --lr-decay-style cosine
    --weight-decay 0.1 --clip-grad 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 --disable-bias-linear
    --normalization RMSNorm --adam-beta1 0.9 --adam-beta2 0.95 --log-interval 10 --save-interval 2000
    --eval-interval 2000 --eval-iters 32 --bf16 --use-mcore-models
    --spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec --no-create-attention-mask-in-dataloader
    --tensorboard-dir TB"""


def test_megatron_mamba_example(tmp_path, capsys, monkeypatch):
    """--spec ... mamba_stack_spec was refused as a custom layer spec: it is Megatron's MambaStack, the hybrid model
    here, its layers allocated by the ratios as Megatron's allocate_layers does (M-M-M--M-*... for 48 layers). NCCL
    is its backend; gloo on this CPU."""
    from test_preprocess import _sentencepiece_folder
    from test_pretrain_cli import _dataset

    from megatron_lite.arguments import parse_args

    model = _sentencepiece_folder(tmp_path / "tokenizer")
    flags = _edit(MEGATRON_MAMBA_800M.split(), data_path=_dataset(tmp_path, max_id=42, docs=200), tokenizer_model=model)
    flags = _edit(flags, save=tmp_path / "ckpt", load=tmp_path / "ckpt", data_cache_path=tmp_path / "cache")
    flags = _edit(flags, tensorboard_dir=None)
    _, job = parse_args(flags)
    assert "".join(job.model.layer_types) == "M-M-M--M-*M-M-M-M--*M-M-M-M-*M--M-M-M-*M-M--M-M-"
    assert "dry run ok: 48 layers" in _dry_run(flags, 8, capsys, monkeypatch)
    tiny = dict(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2, seq_length=32)
    tiny |= dict(max_position_embeddings=32, train_samples=8, lr_warmup_samples=4, lr_decay_samples=8)
    tiny |= dict(micro_batch_size=2, global_batch_size=4, log_interval=1, eval_iters=1, distributed_backend="gloo")
    _, job = parse_args(_edit(flags, **tiny))
    assert job.model.layer_types == ("M", "-")
    assert "iteration        2/       2 |" in _train(_edit(flags, **tiny), capsys, monkeypatch)


# Megatron-LM's tests/functional_tests/test_cases/gpt/gpt3_345m_nightly_dgx_a100_1N8G_mcore_tp2_pp2_ep2_te_4experts2
# parallel/model_config.yaml (as stored at commit 24e0126516f8), its MODEL_ARGS unchanged (`true` for a switch);
# DATA, VOCAB, MERGES, CKPT, CACHE and TB stand for its paths. Sinkhorn routing, top-1.
MEGATRON_FUNCTIONAL_MOE_SINKHORN = """--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm
    --log-num-zeros-in-grad --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir TB
    --micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters 50
    --timing-log-level 2 --lr-decay-iters 320000 --save CKPT --load CKPT --data-path DATA --vocab-file VOCAB
    --merge-file MERGES --split 949,50,1 --distributed-backend nccl --lr 0.00015 --lr-decay-style cosine
    --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 --log-interval 1
    --save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl local
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --expert-model-parallel-size 2
    --sequence-parallel --num-experts 4 --moe-router-load-balancing-type sinkhorn --moe-router-topk 1
    --deterministic-mode --no-gradient-accumulation-fusion --use-mcore-models --ckpt-format torch_dist
    --data-cache-path CACHE --bf16 --attention-backend unfused --log-memory-to-tensorboard"""


def test_megatron_functional_moe_sinkhorn_config(tmp_path, capsys, monkeypatch):
    """--moe-router-load-balancing-type sinkhorn was not a choice (and top-1 without --moe-router-pre-softmax was
    refused, which Megatron allows with Sinkhorn): the config plans at its 8 ranks and trains shrunk, the tokens
    spread over the experts by Sinkhorn (tests/test_moe_router_flags.py -k sinkhorn checks the routing)."""
    flags = _edit(MEGATRON_FUNCTIONAL_MOE_SINKHORN.split(), **_gpt2_files(tmp_path), tensorboard_dir=None)
    flags = _edit(flags, save=tmp_path / "ckpt", load=tmp_path / "ckpt", data_cache_path=tmp_path / "cache")
    assert "dry run ok: 12 layers" in _dry_run(flags, 8, capsys, monkeypatch)
    tiny = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, max_position_embeddings=32)
    tiny |= dict(micro_batch_size=2, global_batch_size=2, train_iters=2, eval_iters=1, distributed_backend="gloo")
    tiny |= dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1)
    out = _train(_edit(flags, **tiny), capsys, monkeypatch)
    assert "iteration        2/       2 |" in out and "moe_max_imbalance" in out


# Megatron-LM's tests/functional_tests/test_cases/gpt/gpt3_15b_8t_release_sm/model_config.yaml (as stored at commit
# 00ee96672c1b), its MODEL_ARGS unchanged (the quoted "[384 384 97656250]" handed over as three values); DATA,
# TOKENIZER, CKPT, CACHE and TB stand for its paths; W&B flags left out (W&B runs in tests/test_pretrain_torchrun.py).
MEGATRON_FUNCTIONAL_15B_8T = """--distributed-timeout-minutes 60 --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --use-mcore-models --sequence-parallel --disable-bias-linear --micro-batch-size 4
    --rampup-batch-size 384 384 97656250 --global-batch-size 1152 --train-samples 19531250 --manual-gc
    --transformer-impl transformer_engine --data-cache-path CACHE --tokenizer-type GPTSentencePieceTokenizer
    --tokenizer-model TOKENIZER --data-path DATA --split 99,1,0 --no-mmap-bin-files --num-workers 6
    --apply-layernorm-1p --untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion
    --rotary-percent 0.5 --squared-relu --num-layers 32 --hidden-size 6144 --num-attention-heads 48
    --group-query-attention --num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096
    --attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --lr-decay-samples 1949218748
    --lr-warmup-samples 3906252 --lr 4.5e-4 --min-lr 4.5e-5 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
    --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --eval-iters 32 --eval-interval 2000 --save CKPT
    --load CKPT --save-interval 5000 --save-retain-interval 10000 --init-method-std 0.0134
    --log-timers-to-tensorboard --log-memory-to-tensorboard --log-num-zeros-in-grad --log-params-norm
    --log-validation-ppl-to-tensorboard --log-throughput --log-interval 100 --tensorboard-dir TB --bf16
    --exit-interval 10200"""


def test_megatron_functional_15b_release_config_runs_as_given(tmp_path, capsys, monkeypatch):
    """Every flag taken as given: it plans at TP=8 over 64 ranks, and shrunk trains through the batch-size ramp-up
    (2, then 4 from the 8th sample), with the decoupled learning rate, keeping the checkpoints of every 4th
    iteration and the last (--save-retain-interval)."""
    from test_preprocess import _sentencepiece_folder
    from test_pretrain_cli import _dataset

    model = _sentencepiece_folder(tmp_path / "tokenizer")
    flags = _edit(MEGATRON_FUNCTIONAL_15B_8T.split(), data_path=_dataset(tmp_path, 42, 200), tokenizer_model=model)
    flags = _edit(flags, save=tmp_path / "ckpt", load=tmp_path / "ckpt", data_cache_path=tmp_path / "cache")
    flags = _edit(flags, tensorboard_dir=None)
    assert "dry run ok: 32 layers" in _dry_run(flags, 64, capsys, monkeypatch)
    tiny = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=32)
    tiny |= dict(max_position_embeddings=32, tensor_model_parallel_size=1, micro_batch_size=1, global_batch_size=4)
    tiny |= dict(rampup_batch_size="2 2 8", train_samples=16, lr_warmup_samples=4, lr_decay_samples=16)
    tiny |= dict(eval_iters=1, eval_interval=1000, save_interval=2, save_retain_interval=4, log_interval=1)
    tiny |= dict(num_workers=0)  # (six loader processes on a two-core machine)
    out = _train(_edit(flags, **tiny), capsys, monkeypatch)
    assert "global batch size:     2 |" in out and "global batch size:     4 |" in out
    assert "decoupled learning rate: 5.000000E-04" in out and "iteration        6/       6 |" in out
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("iter_*")) == ["iter_0000004", "iter_0000006"]


# Megatron-LM's tests/functional_tests/test_cases/moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon/
# model_config.yaml (as stored at commit 04154c8e3be8), its MODEL_ARGS unchanged; DATA, VOCAB, MERGES, CKPT, CACHE
# and TB stand for its paths. A ckpt-resume test: the run resumed from its checkpoint must match one run straight.
MEGATRON_FUNCTIONAL_MOE_DIST_MUON = """--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm
    --log-num-zeros-in-grad --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir TB
    --micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024
    --disable-bias-linear --train-iters 100 --timing-log-level 0 --lr-decay-iters 320000 --save CKPT --load CKPT
    --data-path DATA --vocab-file VOCAB --merge-file MERGES --split 949,50,1 --distributed-backend nccl --lr 0.00015
    --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01
    --log-interval 1 --save-interval 50 --eval-interval 1000 --eval-iters 10 --transformer-impl transformer_engine
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 8 --num-experts 8
    --moe-token-dispatcher-type allgather --moe-router-load-balancing-type aux_loss --moe-router-topk 2
    --moe-router-dtype fp32 --moe-ffn-hidden-size 1024 --moe-grouped-gemm --ckpt-fully-parallel-load
    --deterministic-mode --no-gradient-accumulation-fusion --attention-softmax-in-fp32
    --use-checkpoint-opt_param-scheduler --use-mcore-models --ckpt-format torch_dist --ckpt-assume-constant-structure
    --data-cache-path CACHE --bf16 --no-bias-gelu-fusion --log-memory-to-tensorboard --optimizer dist_muon
    --muon-momentum 0.9 --muon-extra-scale-factor 0.2 --muon-scale-mode spectral"""


def test_megatron_functional_moe_dist_muon_config_resumes(tmp_path, capsys, monkeypatch):
    """It plans at its 8 ranks (EP=8) and, shrunk, resumes from its own checkpoint (with --no-bias-gelu-fusion, which
    was said to conflict with the checkpoint) into the iteration a straight run takes."""
    import re

    flags = _edit(MEGATRON_FUNCTIONAL_MOE_DIST_MUON.split(), **_gpt2_files(tmp_path), tensorboard_dir=None)
    flags = _edit(flags, data_cache_path=tmp_path / "cache")
    assert "dry run ok: 12 layers" in _dry_run(flags, 8, capsys, monkeypatch)
    tiny = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, max_position_embeddings=32)
    tiny |= dict(micro_batch_size=2, global_batch_size=4, moe_ffn_hidden_size=32, expert_model_parallel_size=1)
    tiny |= dict(eval_iters=1, save_interval=2, distributed_backend="gloo")
    lines = {}
    for name, runs in (("resumed", (2, 3)), ("straight", (3,))):
        ckpt = tmp_path / name
        for iters in runs:
            out = _train(_edit(flags, **tiny, train_iters=iters, save=ckpt, load=ckpt), capsys, monkeypatch)
        lines[name] = re.search(r"iteration +3/ +3 \|.*?\| (lm loss: .*?\| loss scale: .*?\| grad norm: .*?) \|", out)
    assert lines["resumed"] and lines["straight"] and lines["resumed"][1] == lines["straight"][1]


# Megatron-LM's tests/functional_tests/test_cases/moe/gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed/model_config.yaml
# (as stored at commit 2afeef845dab), its MODEL_ARGS unchanged; DATA, VOCAB, MERGES, CKPT, CACHE and TB stand for its
# paths. A DeepSeek-V3 proxy: MLA, MTP, sigmoid routing with groups and the expert bias, experts whole (ETP=1) at TP=2.
MEGATRON_FUNCTIONAL_DEEPSEEK_PROXY = """--distributed-timeout-minutes 60 --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 4 --expert-model-parallel-size 4
    --context-parallel-size 1 --expert-tensor-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce
    --overlap-param-gather --attention-backend unfused --use-mcore-models --sequence-parallel --disable-bias-linear
    --micro-batch-size 4 --global-batch-size 32 --train-iters 50 --exit-duration-in-mins 230
    --no-check-for-nan-in-loss-and-grad --no-rope-fusion --cross-entropy-loss-fusion --cross-entropy-fusion-impl native
    --manual-gc --manual-gc-interval 100 --transformer-impl transformer_engine --seq-length 4096
    --data-cache-path CACHE --data-path DATA --vocab-file VOCAB --merge-file MERGES --split 949,50,1 --num-layers 16
    --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 32 --kv-channels 128 --max-position-embeddings 4096
    --position-embedding-type rope --rotary-base 10000 --make-vocab-size-divisible-by 3232 --normalization RMSNorm
    --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights --multi-latent-attention --mtp-num-layers 1
    --mtp-loss-scaling-factor 0.1 --attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1
    --qk-layernorm --lr-warmup-fraction .01 --lr 0.00015 --min-lr 1.0e-5 --lr-decay-style cosine --adam-beta1 0.9
    --adam-beta2 0.95 --num-experts 32 --moe-layer-freq ([0]*1+[1]*15) --moe-ffn-hidden-size 1024
    --moe-shared-expert-intermediate-size 1024 --moe-router-load-balancing-type seq_aux_loss --moe-router-topk 4
    --moe-token-dispatcher-type alltoall --moe-router-pre-softmax --moe-grouped-gemm --moe-aux-loss-coeff 1e-4
    --moe-router-group-topk 2 --moe-router-num-groups 4 --moe-router-topk-scaling-factor 2.0
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
    --moe-router-dtype fp32 --moe-permute-fusion --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128
    --qk-pos-emb-head-dim 64 --v-head-dim 128 --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
    --eval-iters 32 --eval-interval 200 --save CKPT --load CKPT --save-interval 25 --init-method-std 0.02
    --log-timers-to-tensorboard --log-memory-to-tensorboard --log-num-zeros-in-grad --log-params-norm
    --log-validation-ppl-to-tensorboard --log-throughput --log-interval 1 --logging-level 40 --tensorboard-dir TB
    --bf16 --exit-interval 50"""


def test_megatron_functional_deepseek_proxy_config(tmp_path, capsys, monkeypatch):
    """--expert-tensor-parallel-size 1 at TP=2 was refused ('not supported yet'): the config now plans at its 8 ranks
    (TP=2, PP=2 with 4 virtual stages, EP=4, whole experts) and trains shrunk with MTP (tests/test_moe.py -k
    expert_tp_below checks ETP below TP against one process)."""
    flags = _edit(MEGATRON_FUNCTIONAL_DEEPSEEK_PROXY.split(), **_gpt2_files(tmp_path), tensorboard_dir=None)
    flags = _edit(flags, save=tmp_path / "ckpt", load=tmp_path / "ckpt", data_cache_path=tmp_path / "cache")
    assert "dry run ok: 16 layers" in _dry_run(flags, 8, capsys, monkeypatch)
    tiny = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, kv_channels=16)
    tiny |= dict(seq_length=32, max_position_embeddings=32, moe_layer_freq="([0]*1+[1]*1)", num_experts=8)
    tiny |= dict(moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16)
    tiny |= dict(qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, micro_batch_size=2, global_batch_size=4)
    tiny |= dict(train_iters=2, eval_iters=1, tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    tiny |= dict(num_virtual_stages_per_pipeline_rank=None, expert_model_parallel_size=1)
    out = _train(_edit(flags, **tiny), capsys, monkeypatch)
    assert "iteration        2/       2 |" in out and "mtp_1 loss: " in out
