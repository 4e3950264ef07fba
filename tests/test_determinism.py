"""Megatron's --deterministic-mode and --data-parallel-random-init (megatron_lite/training/determinism.py)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch
from test_pretrain_torchrun import records

from megatron_lite.training import pretrain

GPU = torch.cuda.is_available()
ROOT = pathlib.Path(__file__).resolve().parents[1]

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 1e-3 --log-interval 1 --eval-iters 0 --mock-data --vocab-size 64 "
    "--distributed-backend gloo"
).split()
# experts (their token combine is index_add_, the routing counts scatter_add_), dropout, bucketed overlapped
# gradient all-reduces: the paths --deterministic-mode pins on a GPU
MOE_DROPOUT = (
    "--num-experts 4 --moe-router-topk 2 --disable-bias-linear --hidden-dropout 0.1 --attention-dropout 0.1 "
    "--overlap-grad-reduce --ddp-bucket-size 2000"
).split()


def _state() -> tuple:
    return torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")


def test_the_flag_sets_torchs_deterministic_algorithms_for_the_run_and_restores_the_callers(monkeypatch, capsys):
    """With --deterministic-mode every training step runs under torch.use_deterministic_algorithms(True) and
    CUBLAS_WORKSPACE_CONFIG=:4096:8 (torch's requirement for cuBLAS); without it, under neither, even when the
    caller had turned them on; after the run the caller's settings are back."""
    seen = []
    real = pretrain.train_step

    def spy(*args, **kwargs):
        seen.append(_state())
        return real(*args, **kwargs)

    monkeypatch.setattr(pretrain, "train_step", spy)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    argv = [*TINY, "--train-iters", "2"]
    assert pretrain.main([*argv, "--deterministic-mode"]) == 0
    assert seen == [(True, ":4096:8")] * 2 and _state() == (False, None)
    assert "--deterministic-mode: torch.use_deterministic_algorithms(True)" in capsys.readouterr().out
    seen.clear()
    torch.use_deterministic_algorithms(True)
    try:
        assert pretrain.main(argv) == 0
        assert seen == [(False, None)] * 2 and _state() == (True, None)
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize(
    "env, fragment",
    [
        (
            {},
            "--deterministic-mode with NCCL needs NCCL_ALGO set to one of Tree, Ring, CollnetDirect, CollnetChain, "
            "^NVLS (as Megatron requires",
        ),  # fmt: skip
        ({"NCCL_ALGO": "NVLS"}, "not 'NVLS': export NCCL_ALGO=Ring, say"),
        # (accepted: the next check, that this machine has no GPU for NCCL, is what stops it)
        ({"NCCL_ALGO": "Ring"}, "--distributed-backend nccl needs CUDA GPUs"),
        ({"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":0:0"}, "CUBLAS_WORKSPACE_CONFIG=:0:0: cuBLAS is"),
    ],
)
def test_what_deterministic_mode_refuses_is_one_line_at_start_up(env, fragment, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("the NCCL case stops at the missing GPU only on a machine without one")
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    for k, v in {"WORLD_SIZE": "2", **env}.items():
        monkeypatch.setenv(k, v)
    argv = [*TINY, "--train-iters", "2", "--deterministic-mode"]
    argv[argv.index("gloo")] = "nccl"
    assert pretrain.main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines
    assert _state() == (False, env.get("CUBLAS_WORKSPACE_CONFIG"))  # (nothing left switched on)


def test_flash_attention_runs_on_fixed_tiles_under_deterministic_algorithms(monkeypatch):
    """On a GPU the autotuner picks bf16 tiles by timing (two runs could add in two orders): under torch's
    deterministic algorithms each kernel takes its fixed tile instead (the launch the GPU check runs twice)."""
    import importlib

    fa = importlib.import_module("megatron_lite.kernels.flash_attention")  # (the package's name is the function)
    if not fa.HAVE_TRITON:
        pytest.skip("no Triton")
    monkeypatch.setattr(fa, "interpreting", lambda: False)  # (as on a GPU: the choice itself launches nothing)
    assert fa._kernel(fa._fwd, fa._fwd_tuned, torch.bfloat16) == (fa._fwd_tuned, {})
    torch.use_deterministic_algorithms(True)
    try:
        for plain, tuned in (
            (fa._fwd, fa._fwd_tuned),
            (fa._bwd_dkdv, fa._bwd_dkdv_tuned),
            (fa._bwd_dq, fa._bwd_dq_tuned),
        ):
            kernel, cfg = fa._kernel(plain, tuned, torch.bfloat16)
            m, n, warps, stages = fa.DETERMINISTIC_TILES[plain]
            assert kernel is plain and cfg == {"BLOCK_M": m, "BLOCK_N": n, "num_warps": warps, "num_stages": stages}
        # each fixed tile is one the autotuner may pick (those were checked for races on a GPU)
        assert fa.DETERMINISTIC_TILES[fa._fwd] in fa._FWD_TILES
        assert fa.DETERMINISTIC_TILES[fa._bwd_dkdv] in fa._DKDV_TILES
        assert fa.DETERMINISTIC_TILES[fa._bwd_dq] in fa._DQ_TILES
    finally:
        torch.use_deterministic_algorithms(False)


def test_the_embedding_under_deterministic_algorithms_is_torchs_embedding(monkeypatch):
    """Under the flag the embedding indexes its table (Megatron-Core's deterministic_mode: the backward is
    index_put_ with accumulation, summed in a fixed order), not F.embedding: the same output and gradient."""
    from megatron_lite.config import ParallelConfig
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.tensor_parallel.layers import VocabParallelEmbedding

    ctx = ParallelContext.virtual(ParallelConfig(), 1)
    emb = VocabParallelEmbedding(50, 50, 8, ctx.tp)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(50, 8, generator=torch.Generator().manual_seed(0)))
    ids = torch.tensor([[3, 7, 3, 3], [7, 0, 49, 3]])  # (repeats: their gradients add up)
    weight = emb.weight.detach().clone().requires_grad_(True)
    want = torch.nn.functional.embedding(ids.t(), weight)
    want.backward(torch.arange(want.numel(), dtype=torch.float32).view_as(want))
    monkeypatch.setattr(torch.nn.functional, "embedding", None)  # (not called under the flag)
    torch.use_deterministic_algorithms(True)
    try:
        out = emb(ids)
        out.backward(torch.arange(out.numel(), dtype=torch.float32).view_as(out))
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(out, want) and torch.equal(emb.weight.grad, weight.grad)


@pytest.mark.slow
def test_deterministic_runs_repeat_bitwise(tmp_path, pretrain_job):
    """Two runs of the same job, at DP=2 (gloo) and in one process, each with experts, dropout and overlapped
    bucketed all-reduces under --deterministic-mode (torch's NaN-filled fresh tensors included), log bit-equal
    per-iteration losses and gradient norms."""
    argv = [*TINY, "--train-iters", "3", *MOE_DROPOUT, "--deterministic-mode"]
    for n in (2, 1):
        runs = []
        for i in range(2):
            pretrain_job(n, [*argv, "--log-jsonl", str(tmp_path / f"{n}_{i}.jsonl")])
            runs.append([(r["lm_loss"], r["grad_norm"]) for r in records(tmp_path / f"{n}_{i}.jsonl")])
        assert len(runs[0]) == 3 and all(map(torch.isfinite, torch.tensor(runs[0]).flatten())), runs[0]
        assert runs[0] == runs[1], (n, runs)


def _draws_on_rank(random_init: bool) -> dict:
    """One DP=2 rank: its weights as drawn and after broadcast_params, and what its default and model-parallel
    generators draw next (dropout's)."""
    import types

    from megatron_lite.config import ParallelConfig, TrainingConfig
    from megatron_lite.models.gpt_model import GPTModel
    from megatron_lite.training import determinism

    from dist_pool import get_context
    from models import CONFIGS

    job = types.SimpleNamespace(training=TrainingConfig(seed=1234), data_parallel_random_init=random_init)
    ctx = get_context(ParallelConfig())
    seed = determinism.seed_rngs(ctx, job)
    model = GPTModel(CONFIGS["deepseek"](), ctx, seed=seed)  # (experts: broadcast over expert-data-parallel)
    drawn = {k: v.clone() for k, v in model.state_dict().items()}
    determinism.broadcast_params(model, ctx, job)
    with ctx.rng.fork():
        tracked = torch.rand(4)
    return dict(seed=seed, drawn=drawn, after=model.state_dict(), default=torch.rand(4), tracked=tracked)


@pytest.mark.parametrize("random_init", [True, False])
def test_data_parallel_random_init_seeds_each_replica_and_broadcasts_rank_0s_weights(random_init, dist):
    """Megatron's _set_random_seed: with the flag DP rank r seeds with --seed + 10 r, so the replicas draw
    different weights and dropout masks; its get_model then broadcasts DP rank 0's weights, which are those of a
    run without the flag (one process's). Without the flag the replicas draw the same everything."""
    from megatron_lite.config import ParallelConfig
    from megatron_lite.models.gpt_model import GPTModel
    from megatron_lite.parallel_context import ParallelContext

    from models import CONFIGS

    r0, r1 = dist(2, _draws_on_rank, random_init)
    one = GPTModel(CONFIGS["deepseek"](), ParallelContext.virtual(ParallelConfig(), 1), seed=1234).state_dict()
    assert (r0["seed"], r1["seed"]) == ((1234, 1244) if random_init else (1234, 1234))
    for k, w in one.items():
        assert torch.equal(r0["drawn"][k], w) and torch.equal(r0["after"][k], w) and torch.equal(r1["after"][k], w)
    differ = [k for k in one if not torch.equal(r1["drawn"][k], one[k])]
    # (every drawn weight differs with the flag, the norms' ones and the zero-initialised ones aside)
    assert len(differ) > len(one) // 2 if random_init else not differ, differ
    assert torch.equal(r0["default"], r1["default"]) != random_init
    assert torch.equal(r0["tracked"], r1["tracked"]) != random_init
    # the default generator as seeded by hand: Megatron's seed + 100 x pipeline rank + 10 x data-parallel rank
    want = torch.rand(4, generator=torch.Generator().manual_seed(1244 if random_init else 1234))
    assert torch.equal(r1["default"], want)


@pytest.mark.slow
def test_data_parallel_random_init_without_dropout_is_the_one_process_run_and_its_checkpoint_loads(
    tmp_path, pretrain_job
):
    """Without dropout the flag changes nothing but the draws DP rank 0's broadcast replaces: a DP=2 job with it
    logs the one-process job's losses and gradient norms, and its checkpoint resumes in one process."""
    argv = [*TINY, "--hidden-dropout", "0", "--attention-dropout", "0"]
    pretrain_job(1, [*argv, "--train-iters", "4", "--log-jsonl", str(tmp_path / "one.jsonl")])
    ckpt = str(tmp_path / "ckpt")
    two = [*argv, "--train-iters", "4", "--data-parallel-random-init", "--save", ckpt]
    pretrain_job(2, [*two, "--log-jsonl", str(tmp_path / "two.jsonl")])
    one, dp2 = records(tmp_path / "one.jsonl"), records(tmp_path / "two.jsonl")
    assert len(one) == len(dp2) == 4
    for a, b in zip(one, dp2):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-5 * a["lm_loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (a, b)
    out = pretrain_job(1, [*argv, "--train-iters", "6", "--load", ckpt, "--log-jsonl", str(tmp_path / "more.jsonl")])
    assert "loaded" in out and "iteration 4" in out
    assert [r["iteration"] for r in records(tmp_path / "more.jsonl")] == [5, 6]


@pytest.mark.skipif(not GPU, reason="a GPU check (tools/device_checks.sh runs it)")
@pytest.mark.parametrize("d, dv", [(64, 64), (128, 128), (192, 128)])  # (192 / 128: MLA's query-key / value dims)
def test_gpu_flash_attention_on_its_deterministic_tiles_repeats_and_is_right(d, dv):
    """bf16 on a GPU, under torch's deterministic algorithms: the fixed tiles build at these head sizes, give the
    same bits twice and attention within bf16's tolerance of the fp32 reference."""
    import megatron_lite.kernels as K

    from models import rel

    b, sq, h, hkv = 2, 1000, 8, 2  # (grouped-query; a length no tile divides)
    gen = torch.Generator().manual_seed(0)
    q, k, v, up = (torch.randn(b, sq, n, w, generator=gen).cuda() for n, w in ((h, d), (hkv, d), (hkv, dv), (h, dv)))

    def run(fn, dt):
        leaves = [t.to(dt, copy=True).requires_grad_() for t in (q, k, v)]
        o = fn(*leaves, causal=True)
        o.backward(up.to(dt))
        return [o.detach()] + [t.grad for t in leaves]

    torch.use_deterministic_algorithms(True)
    try:
        ours, again = run(K.flash_attention, torch.bfloat16), run(K.flash_attention, torch.bfloat16)
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(ours, again)), "two runs differ"
    ref = run(K.flash_attention_reference, torch.float32)
    errs = {name: rel(a.float(), r) for name, a, r in zip(("o", "dq", "dk", "dv"), ours, ref)}
    assert all(e < 2e-2 for e in errs.values()), errs  # (bf16's tolerance, as test_kernels_bf16.py argues)


@pytest.mark.skipif(not GPU, reason="a GPU check (tools/device_checks.sh runs it)")
def test_gpu_bf16_jobs_under_deterministic_mode_repeat_bitwise(tmp_path):
    """Two bf16 jobs on a GPU, each in a fresh process (its own cuBLAS handle and Triton autotuner), with the Triton
    kernels (flash attention, grouped expert GEMMs, the fused loss) and --deterministic-mode: bit-equal losses and
    gradient norms at every iteration."""
    flags = (
        "--num-layers 2 --hidden-size 1024 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
        "--seq-length 1024 --normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear "
        "--untie-embeddings-and-output-weights --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 "
        "--hidden-dropout 0.1 --attention-dropout 0 --micro-batch-size 2 --global-batch-size 8 --train-iters 4 "
        "--lr 3e-4 --bf16 --mock-data --vocab-size 32000 --log-interval 1 --eval-iters 0 --deterministic-mode"
    ).split()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "CUBLAS_WORKSPACE_CONFIG")}
    runs = []
    for i in range(2):
        log = tmp_path / f"{i}.jsonl"
        out = subprocess.run(
            [sys.executable, str(ROOT / "pretrain" / "pretrain_gpt.py"), *flags, "--log-jsonl", str(log)],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        assert "--deterministic-mode: torch.use_deterministic_algorithms(True)" in out.stdout
        runs.append([(r["lm_loss"], r["grad_norm"]) for r in records(log)])
    assert len(runs[0]) == 4 and runs[0] == runs[1], runs
