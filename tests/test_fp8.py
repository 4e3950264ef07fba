"""--fp8-format with --fp8-recipe tensorwise: the transformer layers' GEMMs on fp8 operands, each scaled from the
whole tensor's own amax. The oracle is the quantization written out here (torch's fp8 casts and fp32 products);
under TP, SP, CP, PP and DP the job logs what one process logs, since a split tensor's amax is reduced."""

from __future__ import annotations

import pytest
import torch
from test_pretrain_torchrun import records

from megatron_lite.config import ConfigError
from megatron_lite.tensor_parallel.fp8 import Fp8Setting, Fp8State, fp8_linear, quantize, update_fp8_scales


def _q(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t quantized to `dtype` with the per-tensor scale fp8_max / amax, back in fp32 (dequantized)."""
    top = torch.finfo(dtype).max
    scale = top / t.abs().max().float() if t.abs().max() > 0 else torch.tensor(1.0)
    return (t.float() * scale).clamp(-top, top).to(dtype).float() / scale


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("wgrad", [True, False])
def test_an_fp8_linear_is_the_product_of_the_quantized_operands(fmt, wgrad):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 48, requires_grad=True)
    w = (torch.randn(40, 48) * 0.1).requires_grad_()
    g = torch.randn(3, 5, 40) * 1e-3
    y = fp8_linear(x, w, Fp8Setting(fmt, wgrad=wgrad))
    y.backward(g)
    grad_dtype = torch.float8_e5m2 if fmt == "hybrid" else torch.float8_e4m3fn
    qx, qw, qg = _q(x.detach(), torch.float8_e4m3fn), _q(w.detach(), torch.float8_e4m3fn), _q(g, grad_dtype)
    assert _rel(y.detach(), qx @ qw.t()) < 1e-6
    assert _rel(x.grad, qg @ qw) < 1e-6
    dw = qg.reshape(-1, 40).t() @ qx.reshape(-1, 48) if wgrad else g.reshape(-1, 40).t() @ x.detach().reshape(-1, 48)
    assert _rel(w.grad, dw) < 1e-6
    # and it is not the unquantized product: fp8 rounds by up to 2^-4 (e4m3) of each value
    assert 1e-3 < _rel(y.detach(), x.detach() @ w.detach().t()) < 0.1


@pytest.mark.parametrize("algo", ["most_recent", "max"])
def test_delayed_scaling_quantizes_with_the_scale_of_the_iterations_before(algo):
    """--fp8-recipe delayed: the first iteration's scale is 1 (a value past 448 saturates); each next one's is
    fp8_max over the newest amax (most_recent) or the largest of the last --fp8-amax-history-len (max), the
    amax being the largest over the iteration's micro-batches; a forward without gradients records none."""
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.fp8 = Fp8Setting("hybrid", recipe="delayed", history_len=2, algo=algo)
    holder.fp8_state = Fp8State(2, "cpu")
    w = torch.randn(8, 16)
    sizes = [1000.0, 3.0, 0.5, 0.25]  # (the inputs' amax, iteration by iteration)
    scales = [1.0]
    for i, size in enumerate(sizes):
        amaxes = []
        for micro in range(2):  # (the second micro-batch's input is half the first's: the first's amax counts)
            x = torch.randn(4, 16)
            x = x / x.abs().max() * size / (1 + micro)
            amaxes.append(x.abs().max())
            y = fp8_linear(x, w.requires_grad_(), holder.fp8, state=holder.fp8_state)
            y.sum().backward()
            top = 448.0
            qx = (x * scales[-1]).clamp(-top, top).to(torch.float8_e4m3fn).float() / scales[-1]
            ws = holder.fp8_state.scale[1]
            qw = (w.detach() * ws).clamp(-top, top).to(torch.float8_e4m3fn).float() / ws
            assert _rel(y.detach(), qx @ qw.t()) < 1e-6
            if i == 0:
                assert qx.abs().max() == 448.0  # (saturated)
        with torch.no_grad():  # (evaluation: not recorded)
            fp8_linear(torch.full((4, 16), 1e6), w, holder.fp8, state=holder.fp8_state)
        update_fp8_scales(holder, None)
        newest = max(amaxes)
        used = newest if algo == "most_recent" or i == 0 else max(newest, max(sizes[i - 1], sizes[i - 1] / 2))
        scales.append(448.0 / float(used))
        assert holder.fp8_state.scale[0].item() == pytest.approx(scales[-1], rel=1e-6), (i, algo)
    assert holder.fp8_state.scale[2].item() > 448.0  # (the gradients' column: e5m2's 57344 over their amax)


@pytest.mark.parametrize("shape", [(7, 40, 24), (32, 64, 352), (1, 1000, 3)])
def test_cpu_products_are_the_fp32_products_that_scaled_mm_also_gives(shape, monkeypatch):
    """On a CPU fp8_mm multiplies the fp8 values in fp32 and never calls torch._scaled_mm, whose CPU kernel is a
    plain loop (100-200x slower at these shapes; fp8 under every layout took a minute of the suite). The GPU's
    call, scaled_mm (b transposed, the inverse scales), is checked here where CPU builds run it: both give the
    product of the dequantized operands, to fp32's and bf16's rounding."""
    from megatron_lite.tensor_parallel import fp8

    m, k, n = shape
    torch.manual_seed(0)
    a, b = torch.randn(m, k) * 3, torch.randn(n, k) * 0.1
    for dtype in (fp8.E4M3, fp8.E5M2):
        aq, a_inv = quantize(a, dtype, a.abs().amax(), 0)
        bq, b_inv = quantize(b, fp8.E4M3, b.abs().amax(), 0)
        oracle = (aq.float() * a_inv) @ (bq.float() * b_inv).t()
        for out_dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 1e-2)):
            mine = fp8.fp8_mm(aq, a_inv, bq, b_inv, out_dtype)
            assert mine.dtype == out_dtype and _rel(mine.float(), oracle) < tol, (dtype, out_dtype)
            if fp8._scaled_mm_runs("cpu"):
                gpu_call = fp8.scaled_mm(aq, a_inv, bq, b_inv, out_dtype)
                assert gpu_call.dtype == out_dtype and _rel(gpu_call.float(), oracle) < tol, (dtype, out_dtype)
    monkeypatch.setattr(torch, "_scaled_mm", None)  # (a call would raise TypeError)
    x, w = torch.randn(2, 16, 32, requires_grad=True), torch.randn(48, 32, requires_grad=True)
    fp8_linear(x, w, Fp8Setting()).sum().backward()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (torch._scaled_mm on Hopper or newer)")
@pytest.mark.parametrize("shape", [(4, 32, 64, 48), (3, 7, 40, 24)], ids=["fits-scaled-mm", "odd-emulated"])
def test_gpu_fp8_linear_in_bf16_is_the_product_of_the_quantized_operands(shape):
    """On a GPU: torch._scaled_mm where the shapes are multiples of 16 (it must run there, on Hopper), the fp32
    product of the fp8 values where not; bf16 in and out, against the quantization of the same bf16 values."""
    from megatron_lite.tensor_parallel.fp8 import _scaled_mm_runs

    b, s, k, n = shape
    torch.manual_seed(0)
    x = torch.randn(b, s, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(n, k, device="cuda") * 0.1).to(torch.bfloat16).requires_grad_()
    g = (torch.randn(b, s, n, device="cuda") * 1e-3).to(torch.bfloat16)
    y = fp8_linear(x, w, Fp8Setting("hybrid"))
    y.backward(g)
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
    if torch.cuda.get_device_capability() >= (9, 0):
        assert _scaled_mm_runs("cuda")
    qx, qw = _q(x.detach().float(), torch.float8_e4m3fn), _q(w.detach().float(), torch.float8_e4m3fn)
    qg = _q(g.float(), torch.float8_e5m2).reshape(-1, n)
    assert _rel(y.float(), qx @ qw.t()) < 1e-2
    assert _rel(x.grad.float(), (qg @ qw).reshape(b, s, k)) < 1e-2
    assert _rel(w.grad.float(), qg.t() @ qx.reshape(-1, k)) < 1e-2


def test_a_zero_input_and_the_largest_value_quantize_as_transformer_engine_does():
    """amax 0 keeps the scale 1 (no NaN); the largest value lands on fp8's largest, 448 for e4m3."""
    w = torch.randn(16, 32)
    assert torch.equal(fp8_linear(torch.zeros(4, 32), w, Fp8Setting()), torch.zeros(4, 16))
    x = torch.zeros(1, 32)
    x[0, 3] = 7.0
    w = torch.zeros(1, 32)
    w[0, 3] = -0.5
    assert fp8_linear(x, w, Fp8Setting()).item() == pytest.approx(-3.5, rel=1e-6)  # (1/896 rounds in fp32)
    q, inv = quantize(x, torch.float8_e4m3fn, x.abs().amax(), 0)
    assert q.float()[0, 3].item() == 448.0 and inv.item() == 1 / 64
    q, _ = quantize(-w, torch.float8_e5m2, w.abs().amax(), 0)
    assert q.float()[0, 3].item() == 57344.0


@pytest.mark.parametrize("wgrad", [True, False])
def test_an_expert_sent_no_tokens_runs_in_fp8(wgrad):
    """An expert no token was routed to gets an empty input (LocalExperts splits by the counts): its output and
    input gradient are empty, its weight gradient zero, and under delayed scaling the empty input and gradient
    record amax 0 (the scale stays) while the weight records its own amax. (It stopped the job: the amax of an
    empty tensor raised, on any iteration where some expert of some rank got no token.)"""
    torch.manual_seed(0)
    w = torch.randn(8, 16, requires_grad=True)
    for recipe in ("tensorwise", "delayed"):
        state = Fp8State(1, "cpu", expert=True) if recipe == "delayed" else None
        x = torch.randn(0, 16, requires_grad=True)
        y = fp8_linear(x, w, Fp8Setting(recipe=recipe, wgrad=wgrad), state=state)
        y.sum().backward()
        assert y.shape == (0, 8) and x.grad.shape == (0, 16)
        assert torch.equal(w.grad, torch.zeros(8, 16))
        if state is not None:
            assert state.pending.tolist() == [0.0, w.detach().abs().max().item(), 0.0]


def test_delayed_scaling_quantizes_each_weight_once_an_iteration(monkeypatch):
    """Under delayed scaling the weight and its scale are the same for every micro-batch of an iteration, so its
    fp8 copy is made once and shared (Transformer Engine's first-micro-batch caching): three micro-batches, one
    quantization of the weight; the scales' update (before the optimizer step) drops it, and a weight changed in
    place is quantized again. Losses and gradients equal those of quantizing every time, over steps that change
    the weight (SGD), the update and a weight written without a version bump (as a collective writes it)."""
    import megatron_lite.tensor_parallel.fp8 as fp8

    calls = []
    real = fp8.quantize_scaled
    monkeypatch.setattr(fp8, "quantize_scaled", lambda t, *a: calls.append(t) or real(t, *a))

    def run(cache: bool):
        torch.manual_seed(0)
        w = torch.randn(8, 16, requires_grad=True)
        state, setting = Fp8State(2, "cpu"), Fp8Setting(recipe="delayed", cache_weights=cache)
        holder = torch.nn.Module()  # (update_fp8_scales' view of a linear: its fp8 setting and state)
        holder.fp8, holder.fp8_state = setting, state
        out, weight_quantizations = [], []
        for step in range(3):
            calls.clear()
            for _ in range(3):  # micro-batches
                x = torch.randn(4, 16)
                y = fp8_linear(x, w, setting, state=state)
                y.square().sum().backward()
                out.append(y.detach())
            weight_quantizations.append(sum(c is w for c in calls))
            out.append(w.grad.clone())
            update_fp8_scales(holder, None)
            with torch.no_grad():
                if step == 1:  # (through .data: no version bump, as a collective's write; the update dropped it)
                    w.data.mul_(1.5)
                else:
                    w -= 0.1 * w.grad  # (in place: the version moves)
            w.grad = None
        return out, weight_quantizations

    cached, n_cached = run(True)
    plain, n_plain = run(False)
    assert n_cached == [1, 1, 1] and n_plain == [3, 3, 3]
    assert all(torch.equal(a, b) for a, b in zip(cached, plain))


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (
            ["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"],
            "--fp8-recipe mxfp8 is not implemented; give --fp8-recipe delayed (Megatron's default",
        ),  # fmt: skip
        (["--fp8-format", "hybrid", "--fp8-amax-history-len", "0"], "--fp8-amax-history-len 0 must be >= 1"),
        (
            ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--num-experts", "4", "--disable-bias-linear"],
            "--fp8-recipe tensorwise with --num-experts 4: an expert's input scale would depend on which micro-batches",
        ),  # fmt: skip
        (
            ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--tp-comm-overlap"],
            "--fp8-format e4m3 with --tp-comm-overlap: not implemented together",
        ),  # fmt: skip
        (
            ["--fp8-format", "hybrid", "--fp8-param-gather"],
            "--fp8-param-gather is not supported: weights kept and all-gathered in fp8 are not implemented",
        ),  # fmt: skip
    ],
)
def test_what_fp8_does_not_run_with_is_one_line(flags, fragment):
    from megatron_lite.arguments import parse_args

    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --mock-data --vocab-size 100 "
    base += "--train-iters 2"
    with pytest.raises(ConfigError) as err:
        parse_args([*base.split(), *flags])
    assert fragment in str(err.value) and "\n" not in str(err.value)


ARGS = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--seq-length 32 --train-iters 6 --micro-batch-size 1 --global-batch-size 4 --lr 3e-3 --lr-warmup-iters 2 "
    "--log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0 --normalization RMSNorm --swiglu "
    "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
    "--distributed-backend gloo --fp8-format hybrid"
).split()
RECIPES = {
    "tensorwise": ["--fp8-recipe", "tensorwise"],
    "delayed": ["--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"],  # (Megatron's default recipe)
}
LAYOUTS = {  # (the micro-batch stays 1: a tensor's amax is its micro-batch's)
    "tp2-sp": (2, "--tensor-model-parallel-size 2 --sequence-parallel"),
    "cp2": (2, "--context-parallel-size 2"),
    "pp2-dp2": (4, "--pipeline-model-parallel-size 2"),
    "fsdp2-tp2": (4, "--use-torch-fsdp2 --tensor-model-parallel-size 2"),  # (the gathered weight's amax)
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fp8_under_every_layout_equals_one_process(tmp_path, pretrain_job, recipe):
    """Per-iteration lm_loss and grad_norm of one process, with fp8 on, against TP2 + SP, CP2, PP2 x DP2 and
    FSDP2 x TP2.

    The first two iterations agree to 1e-6 (tensorwise: a TP rank quantizing its piece of a weight with its own
    amax was 3e-4 off in the first grad norm; delayed: the second iteration's scales come from the first's amax,
    the largest over the micro-batches of every replica). After that, weights one rounding apart in fp32 (TP
    sums in another order) can land on neighbouring fp8 values, one step of up to 2^-3 of the value, and the runs
    part slowly (1e-2 of the grad norm by iteration 6 at TP2; without fp8 they stay within 1e-7): bounded there,
    not equal. The first and last layers in bf16 (--first-last-layers-bf16) change the loss, and so does fp8
    against no fp8, by little."""

    def run(name: str, world: int, argv: list[str]) -> tuple[list[dict], str]:
        out = pretrain_job(world, [*argv, "--log-jsonl", str(tmp_path / f"{name}.jsonl")])
        return records(tmp_path / f"{name}.jsonl"), out

    args = [*ARGS, *RECIPES[recipe]]
    one, out = run("one", 1, args)
    assert f"fp8 (hybrid, {recipe}): the linears of layers 0-3, 16 on this rank" in out
    for name, (world, extra) in LAYOUTS.items():
        other = run(name, world, [*args, *extra.split()])[0]
        assert len(one) == len(other) == 6, name
        for i, (a, b) in enumerate(zip(one, other)):
            close = (1e-6, 1e-6) if i < 2 else (1e-3, 5e-2)
            assert abs(a["lm_loss"] - b["lm_loss"]) <= close[0] * a["lm_loss"], (name, a, b)
            assert abs(a["grad_norm"] - b["grad_norm"]) <= close[1] * a["grad_norm"], (name, a, b)
    if recipe == "delayed":  # (the bf16 layers and the run without fp8 do not depend on the recipe: once)
        return
    ends, out = run("ends", 1, [*args, "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "2"])
    assert "the linears of layers 1-1, 4 on this rank" in out
    plain, _ = run("plain", 1, ARGS[: ARGS.index("--fp8-format")])
    for fp8, other in ((one, plain), (ends, plain), (one, ends)):
        moved = [abs(a["lm_loss"] - b["lm_loss"]) / b["lm_loss"] for a, b in zip(fp8, other)]
        assert 1e-5 < max(moved) < 2e-2, moved


def test_the_recipe_flag_says_which_recipes_run():
    """--fp8-recipe's help named delayed, which runs (and is the default), as refused."""
    from megatron_lite.flag_parser import build_parser

    (action,) = [a for a in build_parser()._actions if "--fp8-recipe" in a.option_strings]
    assert action.default == "delayed" and "refused" not in action.help.split("mxfp8")[0], action.help
    assert "mxfp8, blockwise refused" in action.help


def test_fp8_flags_that_change_nothing_are_said_to():
    """Megatron reads --fp8-margin and the amax history only for delayed scaling, and --fp8-interval not at all;
    without --fp8-format no fp8 flag does anything."""
    from megatron_lite.arguments import parse_args
    from megatron_lite.megatron_flags import accepted_no_ops

    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --mock-data --vocab-size 100 "
    base += "--train-iters 2 --fp8-recipe tensorwise --fp8-margin 1 --fp8-amax-history-len 1024 --fp8-interval 2"
    notes = accepted_no_ops(parse_args([*base.split(), "--fp8-format", "hybrid"])[0])
    assert "--fp8-margin 1 has no effect with --fp8-recipe tensorwise (Megatron reads it for delayed scaling)" in notes
    assert any(n.startswith("--fp8-amax-history-len 1024 has no effect with --fp8-recipe tensorwise") for n in notes)
    assert "--fp8-interval 2 has no effect (deprecated in Megatron)" in notes
    notes = accepted_no_ops(parse_args(base.split())[0])
    for flag in ("--fp8-recipe", "--fp8-margin", "--fp8-amax-history-len", "--fp8-interval"):
        assert f"{flag} has no effect without --fp8-format" in notes, (flag, notes)


@pytest.mark.slow
def test_fp8_runs_the_multi_token_prediction_layers_under_pipeline_parallelism(tmp_path, pretrain_job):
    """Megatron's MTP runs under its global fp8 context, whatever --first-last-layers-bf16 says: the MTP depth's
    projection and transformer layer are fp8 linears too (their delayed-scaling state reduced and checkpointed
    with the decoder's), and at PP2 (the depth on the last stage) the first iterations equal one process."""
    args = [*ARGS, *RECIPES["delayed"], "--mtp-num-layers", "1", "--first-last-layers-bf16"]
    args += ["--num-layers-at-end-in-bf16", "1"]
    logs = {}
    for name, world, extra in (("one", 1, []), ("pp2", 2, ["--pipeline-model-parallel-size", "2"])):
        out = pretrain_job(world, [*args, *extra, "--log-jsonl", str(tmp_path / f"{name}.jsonl")])
        logs[name] = records(tmp_path / f"{name}.jsonl")
        if name == "one":  # (layers 1-2's 4 linears each, the depth's eh_proj and its layer's 4)
            assert "the linears of layers 1-2 and of the multi-token prediction layers, 13 on this rank" in out, out
    for a, b in list(zip(logs["one"], logs["pp2"]))[:2]:
        for key in ("lm_loss", "grad_norm", "mtp_1_loss"):
            assert abs(a[key] - b[key]) <= 1e-6 * a[key], (key, a, b)


@pytest.mark.slow
def test_fp8_delayed_moe_under_expert_parallelism_equals_one_process(tmp_path, pretrain_job):
    """MoE in fp8 (delayed scaling): each expert's GEMMs with its own scales, its amax the iteration's largest over
    the tokens every replica sent it, so EP2 (over DP2) and EP2 x TP2 + SP log what one process logs (first two
    iterations to 1e-6, then bounded as in the dense test). Tensorwise scaling is refused with MoE: an expert's
    input scale would depend on which micro-batches a layout sends it together."""
    moe = [*ARGS, *RECIPES["delayed"], "--num-experts", "4", "--moe-router-topk", "2"]
    moe += ["--moe-shared-expert-intermediate-size", "64", "--moe-aux-loss-coeff", "1e-2"]

    def run(name: str, world: int, argv: list[str]) -> list[dict]:
        out = pretrain_job(world, [*argv, "--log-jsonl", str(tmp_path / f"{name}.jsonl")])
        assert "fp8 (hybrid, delayed)" in out
        return records(tmp_path / f"{name}.jsonl")

    one = run("one", 1, moe)
    for name, world, extra in (
        ("ep2", 2, "--expert-model-parallel-size 2"),
        ("ep2-tp2-sp", 4, "--expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel"),
    ):
        other = run(name, world, [*moe, *extra.split()])
        assert len(one) == len(other) == 6, name
        for i, (a, b) in enumerate(zip(one, other)):
            close = (1e-6, 1e-6) if i < 2 else (1e-3, 5e-2)
            assert abs(a["lm_loss"] - b["lm_loss"]) <= close[0] * a["lm_loss"], (name, a, b)
            assert abs(a["grad_norm"] - b["grad_norm"]) <= close[1] * a["grad_norm"], (name, a, b)


def test_a_resume_with_another_amax_history_length_keeps_the_newest(tmp_path, capsys, monkeypatch):
    """From the fp8 review: a checkpoint saved with --fp8-amax-history-len 4, resumed (or fine-tuned) with another
    length, was refused; Transformer Engine keeps the checkpoint's history. The run now keeps as many of its newest
    iterations as its own length: at the next save, the second row is the checkpoint's first."""
    import glob

    from safetensors.torch import load_file

    from megatron_lite.training.pretrain import main

    def history(iteration: int) -> dict:
        out = {}
        for f in glob.glob(str(tmp_path / "ck" / f"iter_{iteration:07d}" / "tensors_r*.safetensors")):
            out.update({k: v for k, v in load_file(f).items() if k.startswith("fp8/") and "fp8_history" in k})
        return out

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    run = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
    run += "--global-batch-size 4 --lr 1e-3 --log-interval 1 --eval-iters 0 --mock-data --vocab-size 100 "
    run += f"--fp8-format hybrid --save {tmp_path / 'ck'} --save-interval 1"
    assert main([*run.split(), "--train-iters", "2", "--fp8-amax-history-len", "4"]) == 0
    # (another length given: without the flag the checkpoint's own comes back with the run)
    assert (
        main([*run.split(), "--train-iters", "3", "--load", str(tmp_path / "ck"), "--fp8-amax-history-len", "1"]) == 0
    )
    before, after = history(2), history(3)
    assert len(before) == len(after) == 8  # (2 layers x 4 linears)
    for key, old in before.items():
        assert old.shape == (4, 3) and after[key].shape == (1, 3)
    # (length 1: the newest only, iteration 3's own; so resume once more at length 2 to see the carried row)
    assert (
        main([*run.split(), "--train-iters", "4", "--load", str(tmp_path / "ck"), "--fp8-amax-history-len", "2"]) == 0
    )
    for key, row in history(3).items():
        assert torch.equal(history(4)[key][1], row[0]), key
    capsys.readouterr()
