"""--moe-use-upcycling (Megatron-Core's upcycling_utils): an MoE model made from a dense checkpoint. The oracle is
the dense model itself: where the routing weights of the chosen experts sum to 1 and every chosen group of experts
adds up to the dense MLP, the upcycled model computes the dense model's loss (see checkpoint/upcycling.py for when
that holds); the whole job under EP=2 starts from the same loss as one process."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.checkpoint.upcycling import upcycle_state_dict
from megatron_lite.config import ConfigError, ParallelConfig
from megatron_lite.models.gpt_model import GPTModel
from megatron_lite.parallel_context import ParallelContext

from models import gpt2_config, llama_config, rel

CTX = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
TOKENS = torch.randint(0, 250, (2, 17), generator=torch.Generator().manual_seed(0))


def _loss_and_grads(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(TOKENS[:, :-1], labels=TOKENS[:, 1:]).mean()
    loss.backward()
    return loss.detach(), {model.global_name(n): p.grad.clone() for n, p in model.named_parameters()}


def _dense_and_upcycled(dense_cfg, granularity: int, **moe):
    """(dense model, its upcycled MoE model): the dense weights random with norms and biases moved off 1 / 0; the MoE
    model's own router initialisation (seed 1), as Megatron keeps it."""
    dense = GPTModel(dense_cfg, CTX, seed=0)
    gen = torch.Generator().manual_seed(3)
    state = {
        k: v + 0.1 * torch.randn(v.shape, generator=gen) if v.ndim == 1 else v
        for k, v in dense.full_state_dict().items()
    }
    dense.load_full_state_dict(state)
    moe_cfg = dataclasses.replace(dense_cfg, ffn_hidden_size=dense_cfg.ffn_size // granularity, **moe)
    upcycled = GPTModel(moe_cfg, CTX, seed=1)
    new, kept = upcycle_state_dict(state, upcycled.full_state_dict(), moe_cfg, granularity)
    assert kept == []
    upcycled.load_full_state_dict(new)
    return dense, upcycled


def test_upcycled_model_computes_the_dense_model():
    """Granularity 1, top-k then softmax (Megatron's default): every expert is the dense MLP and each token's
    weights sum to 1, so the loss is the dense model's. The gradients: every weight outside the MLPs has the dense
    model's; the experts' gradients sum to the dense MLP's (each token's share of it goes to its experts in the
    proportion of their weights); the router's is zero (its weights' changes sum to 0 and every expert gives the
    same output). grad_norm is therefore not the dense one: it counts sum_e |g_e|^2 where the dense counts
    |sum_e g_e|^2."""
    cfg = llama_config(add_bias_linear=True, add_qkv_bias=True)  # (SwiGLU; fc1's and fc2's biases too)
    dense, moe = _dense_and_upcycled(cfg, 1, num_experts=4, moe_router_topk=2)
    loss_d, g_d = _loss_and_grads(dense)
    loss_m, g_m = _loss_and_grads(moe)
    assert abs(loss_m - loss_d) <= 1e-6 * loss_d, (loss_m, loss_d)
    for name, g in g_d.items():
        if ".mlp." not in name:
            assert rel(g_m[name], g) < 1e-5, name
            continue
        experts = [g_m[name.replace(".mlp.", f".mlp.experts.{e}.")] for e in range(4)]
        assert rel(sum(experts), g) < 1e-5, name
        assert all(rel(x, g) > 1e-2 for x in experts), name  # (each expert has its own share)
    for layer in range(cfg.num_layers):
        router = g_m[f"decoder.layers.{layer}.mlp.router.weight"]
        assert router.abs().max() < 1e-6 * g_d[f"decoder.layers.{layer}.mlp.linear_fc1.weight"].abs().max()


def test_granularity_keeps_the_dense_output_for_a_homogeneous_activation():
    """Granularity 2 (each group of 2 experts holds the dense MLP's two halves, weighted 1/2 each, the weights
    scaled by 2^(1/3) for squared ReLU, whose output is cubic in that scale): the dense loss exactly, with top-k 2
    taking a whole group. With SwiGLU (silu(s x) != s silu(x)) the same cut is close, not equal."""
    cfg = gpt2_config(activation="squared_relu", ffn_hidden_size=96)  # (biases on: fc1's is scaled, fc2's not)
    dense, moe = _dense_and_upcycled(cfg, 2, num_experts=4, moe_router_topk=2)
    loss_d, loss_m = _loss_and_grads(dense)[0], _loss_and_grads(moe)[0]
    assert abs(loss_m - loss_d) <= 1e-6 * loss_d, (loss_m, loss_d)
    dense, moe = _dense_and_upcycled(llama_config(), 2, num_experts=4, moe_router_topk=2)
    loss_d, loss_m = _loss_and_grads(dense)[0], _loss_and_grads(moe)[0]
    assert 1e-6 * loss_d < abs(loss_m - loss_d) < 1e-2 * loss_d, (loss_m, loss_d)
    # SwiGLU's cut by hand: expert 3 (the second of group 1) holds hidden units 48..95, gate rows and up rows alike,
    # scaled by 2^(1/3) (a gated unit's output is cubic in it); group 1's router rows are the same row
    d, m, s = dense.full_state_dict(), moe.full_state_dict(), 2 ** (1 / 3)
    fc1, fc2 = d["decoder.layers.0.mlp.linear_fc1.weight"], d["decoder.layers.0.mlp.linear_fc2.weight"]
    expert = "decoder.layers.0.mlp.experts.3."
    assert torch.allclose(m[expert + "linear_fc1.weight"], s * torch.cat([fc1[48:96], fc1[96 + 48 :]]), atol=1e-7)
    assert torch.allclose(m[expert + "linear_fc2.weight"], s * fc2[:, 48:], atol=1e-7)
    router = m["decoder.layers.0.mlp.router.weight"]
    assert (
        torch.equal(router[2], router[3])
        and torch.equal(router[0], router[1])
        and not torch.equal(router[1], router[2])
    )


ARGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 3e-3 --log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0 "
    "--normalization RMSNorm --squared-relu --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights --distributed-backend gloo --ffn-hidden-size 96 --train-iters 3"
).split()
# 3 groups of 2 experts, each holding half the dense MLP: under EP=2 a rank's first expert is expert 3, a second half
UPCYCLE = (
    "--load dense --moe-use-upcycling --num-experts 6 --moe-router-topk 2 --moe-upcycling-granularity 2 "
    "--moe-ffn-hidden-size 48"
).split()


def _records(path) -> list[dict]:
    return [r for r in map(json.loads, open(path)) if "lm_loss" in r]


@pytest.mark.slow
def test_upcycling_job_under_expert_parallelism(tmp_path, pretrain_job):
    """The whole job: a dense checkpoint (squared ReLU, 2 iterations) saved by one process, upcycled at granularity
    2 by one process and by EP=2 (each rank holding 3 of the 6 experts, cut from the full dense tensors it reads):
    both start training at iteration 2 (the upcycled checkpoint is iteration 1, as Megatron's) from the loss the
    dense run logs when it goes on (its weights on its next batch: Megatron's upcycled run takes the dense
    checkpoint's consumed samples); with --finetune from the loss of the dense checkpoint loaded with --finetune
    (the data from its start). A restart of the same command resumes from --save, where Megatron refuses."""
    pretrain_job(1, [*ARGS, "--save", "dense", "--train-iters", "2"])
    pretrain_job(1, [*ARGS, "--load", "dense", "--log-jsonl", "dense.jsonl"])  # (iteration 3 of 3)
    pretrain_job(1, [*ARGS, "--load", "dense", "--finetune", "--log-jsonl", "dense_ft.jsonl"])
    pretrain_job(1, [*ARGS, *UPCYCLE, "--save", "one", "--log-jsonl", "one.jsonl"])
    pretrain_job(1, [*ARGS, *UPCYCLE, "--finetune", "--save", "ft", "--log-jsonl", "ft.jsonl"])
    out = pretrain_job(2, [*ARGS, *UPCYCLE, "--save", "ep2", "--expert-model-parallel-size", "2",
                           "--log-jsonl", "ep2.jsonl"])  # fmt: skip
    assert "upcycled" in out and "ep2/iter_0000001" in out and "after the dense run's 8 samples" in out
    names = ("dense", "dense_ft", "one", "ft", "ep2")
    dense, dense_ft, one, ft, ep2 = (_records(tmp_path / f"{n}.jsonl") for n in names)
    assert [r["iteration"] for r in dense] == [3]
    assert [r["iteration"] for r in one] == [r["iteration"] for r in ep2] == [2, 3]
    assert abs(one[0]["lm_loss"] - dense[0]["lm_loss"]) <= 1e-6 * dense[0]["lm_loss"], (one[0], dense[0])
    assert abs(ft[0]["lm_loss"] - dense_ft[0]["lm_loss"]) <= 1e-6 * dense_ft[0]["lm_loss"], (ft[0], dense_ft[0])
    assert abs(one[0]["lm_loss"] - ft[0]["lm_loss"]) > 1e-3 * ft[0]["lm_loss"]  # (other batches: the test can see it)
    assert abs(ep2[0]["lm_loss"] - one[0]["lm_loss"]) <= 1e-5 * one[0]["lm_loss"], (ep2[0], one[0])
    assert abs(ep2[0]["grad_norm"] - one[0]["grad_norm"]) <= 1e-5 * one[0]["grad_norm"], (ep2[0], one[0])
    # a restart resumes the upcycled run from its own checkpoint (iteration 3 of 4: one more iteration)
    out = pretrain_job(1, [*ARGS, *UPCYCLE, "--save", "one", "--train-iters", "4", "--log-jsonl", "again.jsonl"])
    assert "not upcycled again" in out and [r["iteration"] for r in _records(tmp_path / "again.jsonl")] == [4]


@pytest.mark.parametrize(
    "flags, error",
    [
        ("--num-experts 4", "--moe-use-upcycling needs --load DIR"),
        ("--load {d}", "--moe-use-upcycling needs --num-experts N"),
        ("--load {d} --num-experts 4 --save {d}", "--moe-use-upcycling with --save the same directory as --load"),
        ("--load {d} --num-experts 4", "--moe-use-upcycling saves the upcycled model to --save"),
        ("--moe-upcycling-granularity 3 --load {d} --num-experts 4 --save {d}/up",
         "--moe-upcycling-granularity 3 must divide --num-experts 4"),
        ("--moe-upcycling-granularity 0", "--moe-upcycling-granularity 0 must be >= 1"),
        ("--load {d} --num-experts 4 --save {d}/up --lora-rank 4", "--moe-use-upcycling with --lora-rank"),
    ],
)  # fmt: skip
def test_flags_upcycling_needs(tmp_path, flags, error):
    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-iters 4 --mock-data"
    with pytest.raises(ConfigError) as e:
        parse_args([*base.split(), "--vocab-size", "100", "--moe-use-upcycling", *flags.format(d=tmp_path).split()])
    assert str(e.value).startswith(error) and "\n" not in str(e.value), str(e.value)


def test_dense_checkpoint_upcycling_refuses(tmp_path, capsys, monkeypatch):
    """What only the checkpoints tell, refused at start-up in one line (before any process group): an FFN size that
    is not the experts' times the granularity, gpt-oss's clamped quick-GEGLU cut finer than granularity 1, an MoE
    checkpoint, an empty --load, and --save holding a checkpoint
    already with --no-auto-resume (Megatron's assertion; with auto-resume a restart resumes from it)."""
    from megatron_lite.training.pretrain import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    d = str(tmp_path)
    base = [*ARGS, "--mock-data", "--vocab-size", "100", "--num-layers", "1", "--seq-length", "16"]

    def run(*flags: str) -> str:
        rc = main([*base, *" ".join(flags).format(d=d).split()])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
        return err

    assert main([*base, "--train-iters", "1", "--save", f"{d}/dense"]) == 0
    assert main([*base, "--train-iters", "1", *UPCYCLE, "--load", f"{d}/dense", "--save", f"{d}/up"]) == 0
    capsys.readouterr()
    up = f"--moe-use-upcycling --num-experts 4 --load {d}/dense --save {d}/new"
    assert "--moe-ffn-hidden-size 64 x --moe-upcycling-granularity 1 = 64 must be the dense checkpoint's FFN size " \
        "96" in run(up, "--moe-ffn-hidden-size 64")  # fmt: skip
    assert "set --ffn-hidden-size 48" in run(up, "--moe-upcycling-granularity 2")
    # gpt-oss's clamped quick-GEGLU (Megatron refuses quick-GEGLU; the scaled weights would move the clamp)
    qg = [a for a in base if a != "--squared-relu"] + "--quick-geglu --activation-func-clamp-value 7".split()
    assert main([*qg, "--train-iters", "1", "--save", f"{d}/qg"]) == 0
    capsys.readouterr()
    rc = main([*qg, *f"{up} --load {d}/qg --moe-upcycling-granularity 2 --moe-ffn-hidden-size 48".split()])
    err = capsys.readouterr().err.strip()
    want = "error: --moe-upcycling-granularity 2 with --glu-linear-offset 0.0 / --activation-func-clamp-value 7.0"
    assert rc == 2 and err.startswith(want) and len(err.splitlines()) == 1, err
    assert "holds an MoE model already (6 experts)" in run(up, f"--load {d}/up")
    assert f"--load {d}/new holds no checkpoint" in run(up, f"--load {d}/new --save {d}/new2")
    assert f"--save {d}/up, which holds a checkpoint already" in run(up, f"--save {d}/up --no-auto-resume")


def test_the_upcycled_run_takes_its_schedule_from_the_flags(tmp_path, capsys, monkeypatch):
    """As Megatron's upcycling branch loads no optimizer or scheduler from the dense checkpoint, the MoE run's LR
    schedule is its flags' (an exploratory run: --use-checkpoint-opt_param-scheduler brought the dense run's lr and
    decay back, said as kept, and any changed length was said to move on from the checkpoint's schedule)."""
    from test_pretrain_torchrun import records

    from megatron_lite.training.pretrain import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    base = [*ARGS, "--mock-data", "--vocab-size", "100", "--num-layers", "1", "--seq-length", "16"]
    dense = str(tmp_path / "dense")
    assert main([*base, "--train-iters", "2", "--lr", "1e-3", "--lr-decay-style", "linear", "--save", dense]) == 0
    capsys.readouterr()
    up = [a if a != "dense" else dense for a in UPCYCLE]
    for extra in ([], ["--use-checkpoint-opt_param-scheduler"]):
        log = tmp_path / f"up{len(extra)}.jsonl"
        flags = ["--train-iters", "4", "--lr", "5e-4", "--lr-decay-style", "constant", "--log-jsonl", str(log)]
        assert main([*base, *up, *flags, *extra, "--save", str(tmp_path / f"up{len(extra)}")]) == 0
        out = capsys.readouterr().out
        # (the upcycled model is iteration 1, as Megatron's training.py sets it)
        assert [(r["iteration"], r["lr"]) for r in records(log)] == [(2, 5e-4), (3, 5e-4), (4, 5e-4)], extra
        said = ("kept", "moves on from where the checkpoint left it", "differs from the checkpoint's")
        assert not [x for x in said if x in out], out
