"""The planner's command line (tools/plan_parallelism.py) and its search: a shipped script, a Hugging Face config
and pretrain flags are planned as the job they describe, bad input is one line, and the search refuses what our
start-up validation refuses."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import subprocess
import sys

import head_start
import pytest
from test_planner import GBS, LLAMA3_8B_TOP1, ROOT, SEQ, _tool, moe_llama

from megatron_lite.planner.layout import Layout

from models import llama_config


def test_plan_for_a_shipped_script(tmp_path, capsys):
    """Llama-3-8B's script on one node of H100s: layouts that fit, fastest first, each passing our own
    start-up validation; the script's own layout placed among them; refusals explained."""
    from megatron_lite.planner.hardware import ACCELERATORS
    from megatron_lite.planner.search import RESERVED_BYTES, USABLE_FRACTION

    out = tmp_path / "plan.json"
    result = _tool().main(["--script", str(ROOT / "pretrain" / "llama3_8b.sh"), "--top", "5", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    text = capsys.readouterr().out
    usable = ACCELERATORS["H100"].memory_bytes * USABLE_FRACTION - RESERVED_BYTES
    times = [f["step_seconds"] for f in result["fits"]]
    assert len(times) == 5 and times == sorted(times)
    assert all(f["memory"]["total"] <= usable and f["reason"] is None for f in result["fits"])
    assert all(
        f["layout"]["tp"] * f["layout"]["pp"] * f["layout"]["dp"] * f["layout"]["cp"] == 8 for f in result["fits"]
    )
    assert result["yours"]["describe"].startswith("TP4+SP PP1 DP2")  # the script: TP=4, SP, 8 GPUs
    assert result["yours"]["reason"] is None  # it fits
    assert "more than the" in text and "GiB usable" in text


def test_plan_outputs_and_nodes_are_checked_first(tmp_path, capsys, monkeypatch):
    """(From a review) --json is checked before the plan (a directory was a traceback after it: --published
    takes minutes), and --gpus-per-node that does not divide the script's GPUs is refused: it planned 2 x 3."""
    for argv, fragment in (
        (["--json", str(tmp_path)], f"--json {tmp_path} is a directory; give a file path"),
        (["--json", "/proc/x/y.json"], "--json /proc/x/y.json: its directory cannot be made"),  # (a traceback after)
        (["--gpus-per-node", "3"], "--gpus-per-node 3 does not divide the script's 8 GPUs into nodes: give --nodes"),
        (["--gpus-per-node", "16"], "--gpus-per-node 16 does not divide the script's 8 GPUs into nodes"),  # (1 x 16)
    ):
        with pytest.raises(SystemExit) as e:
            _tool().main(["--script", str(ROOT / "pretrain" / "llama3_8b.sh"), "--top", "1", *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and fragment in err[0], err
    _tool().main(["--script", str(ROOT / "pretrain" / "llama3_8b.sh"), "--top", "1", "--gpus-per-node", "4"])
    assert "cluster: 2 x 4 H100" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # (a planner review: the flags were ignored without a word)
        _tool().main(["--hf-config", str(tmp_path / "config.json"), "--", "--num-layers", "2"])
    assert "the pretrain flags after -- (--num-layers ...) would be ignored" in capsys.readouterr().err
    # run as a script, every error exits 2 (argparse's did, one raised as its message 1)
    for argv in (["--script", str(tmp_path / "nope.sh")], ["--hf-config", str(tmp_path / "nope")]):
        run = subprocess.run([sys.executable, str(ROOT / "tools" / "plan_parallelism.py"), *argv], capture_output=True)
        assert run.returncode == 2 and len(run.stderr.decode().strip().splitlines()) == 1, run
    # the script's own GPUS_PER_NODE x NNODES (it was taken as 8 a node: 12 GPUs were refused, 16 planned 2 x 8)
    monkeypatch.setenv("GPUS_PER_NODE", "4")
    monkeypatch.setenv("NNODES", "3")
    _tool().main(["--script", str(ROOT / "pretrain" / "llama3_8b.sh"), "--top", "1"])
    assert "cluster: 3 x 4 H100" in capsys.readouterr().out


def test_plan_from_a_hugging_face_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
    )  # fmt: skip
    cfg.save_pretrained(tmp_path)
    result = _tool().main(
        ["--hf-config", str(tmp_path / "config.json"), "--seq-length", "4096", "--global-batch-size", "64",
         "--gpu", "A100", "--nodes", "2", "--top", "3"]
    )  # fmt: skip
    best = result["fits"][0]
    assert best["layout"]["tp"] * best["layout"]["pp"] * best["layout"]["dp"] * best["layout"]["cp"] == 16
    assert 0 < best["mfu"] < 1


def test_plan_from_pretrain_flags_takes_the_planners_sizes_and_the_vocabulary(capsys):
    """docs/planner.md's `plan_parallelism.py --seq-length 4096 --global-batch-size 256 -- <model flags>`: the
    planner's sizes stand in for the job's and no --train-iters is needed (it raised "missing required flag"),
    and --vocab-size is the model's vocabulary (it planned for the embedded corpus's 4096). Bad paths are one
    line."""
    model = (
        "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
        "--num-query-groups 8 --swiglu --normalization RMSNorm --position-embedding-type rope "
        "--untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 128256"
    )
    sizes = ["--seq-length", "4096", "--global-batch-size", "256"]
    result = _tool().main(["--gpu", "A100", "--nodes", "2", *sizes, "--top", "1", "--", *model.split()])
    assert "vocabulary 128256; global batch 256 x 4096 tokens" in capsys.readouterr().out
    assert result["fits"]
    ramp = ["--rampup-batch-size", "16", "16", "1000"]  # (sample-based, as Megatron requires of a ramp)
    assert _tool().main(["--gpu", "A100", "--nodes", "2", *sizes, "--top", "1", "--", *model.split(), *ramp])["fits"]
    for flags, message in (
        (["--script", "nope.sh"], "error: --script nope.sh: no such file"),
        (["--hf-config", "nope/config.json"], "error: --hf-config nope/config.json: no such file"),
        ([*sizes, "--", "--num-layers", "2"], "error: missing required flag"),
    ):
        with pytest.raises(SystemExit, match=message):
            _tool().main(flags)


_MODEL = (
    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups 8 --swiglu --normalization RMSNorm --position-embedding-type rope --vocab-size 128256 "
    "--untie-embeddings-and-output-weights --disable-bias-linear --use-distributed-optimizer "
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --bf16 "
    "--overlap-grad-reduce --overlap-param-gather"
).split()
_BATCH = ["--seq-length", "8192", "--global-batch-size", "128", "--top", "1", "--"]
_NO_OVERLAP = [x for x in _MODEL if not x.startswith("--overlap")]
_SMALL = "--num-layers 4 --hidden-size 512 --num-attention-heads 8 --global-batch-size 16 --vocab-size 32000".split()
_SMALL += ["--position-embedding-type", "rope", "--attention-dropout", "0"]
_WINDOW = [*_SMALL, "--seq-length", "1024", "--window-size", "255,0", "--context-parallel-size", "2"]
_PIPE = [*_SMALL[2:], "--num-layers", "8", "--seq-length", "1024", "--pipeline-model-parallel-size", "4",
         "--global-batch-size", "8", "--num-virtual-stages-per-pipeline-rank", "2",
         "--micro-batch-size", "1"]  # fmt: skip
_FOUR = ["--nodes", "1", "--gpus-per-node", "4", "--top", "1", "--"]
_HIERARCHICAL = ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "1"]
# the plans test_the_plan_is_of_the_job_the_flags_describe reads (15 s: started ahead, tests/head_start.py)
_JOB_PLANS = {
    "torch": [*LLAMA3_8B_TOP1, "--", "--kernel-impl", "torch"],
    "triton": LLAMA3_8B_TOP1,
    "uniform": [*_BATCH, *_MODEL],
    # (a script's --recompute-method block N)
    "block": [*_BATCH, *[x if x != "uniform" else "block" for x in _MODEL]],
    "plain": [*_BATCH, *_NO_OVERLAP],
    "fsdp2": [
        *_BATCH,
        *[x for x in _NO_OVERLAP if x != "--use-distributed-optimizer"],
        "--use-torch-fsdp2",
        "--overlap-grad-reduce",
    ],
    "encoder": ["--top", "1", "--", *_SMALL, "--encoder-seq-length", "1024", "--kernel-impl=torch", "--bf16"],
    "windowed": ["--top", "1", "--", *_WINDOW, "--cp-comm-type", "a2a"],
    "grouped": [*_FOUR, *_PIPE, "--microbatch-group-size-per-virtual-pipeline-stage", "8"],
    "pipe": [*_FOUR, *_PIPE],
    "hierarchical": ["--top", "1", "--", *[f for f in _WINDOW if f not in ("--window-size", "255,0")], *_HIERARCHICAL],
    "lora": ["--script", str(ROOT / "pretrain" / "finetune_llama3_8b_lora.sh")],
    **{
        f"bad{i}": [*LLAMA3_8B_TOP1, *flags]
        for i, flags in enumerate(
            (["--nodes", "0"], ["--top", "0"], ["--network-bandwidth", "0"], ["--global-batch-size", "-64"])
        )
    },
    "seventy": ["--script", str(ROOT / "pretrain" / "llama3_70b_multinode.sh"), "--nodes", "1"],
}
head_start.register_call("plans_of_the_job", "test_planner", "plans", *_JOB_PLANS.values())


@pytest.mark.head_start("plans_of_the_job")
def test_the_plan_is_of_the_job_the_flags_describe(tmp_path, capsys):
    """From a review of the tool as a user runs it: a script's --kernel-impl torch was planned as triton (17 GiB
    fewer activations); a LoRA script was planned as full training (137 GiB against its 16); a TP=1 script's own
    layout was never ranked (its SP flag differed from the search's); a DeepSeek-V3 config.json's MTP depth was
    dropped; bad sizes were accepted (--nodes 0 read as 1) or crashed; "no layout fits" said to shorten the
    sequence when the weights and optimizer state alone overflow; the assumptions and parameter count were
    not said."""
    plan = dict(zip(_JOB_PLANS, head_start.call_result("plans_of_the_job")))
    value = {k: p["value"] for k, p in plan.items()}
    out = plan["torch"]["out"]
    assert "--kernel-impl torch" in out and "model: 8.03B parameters" in out and "assumed: Adam" in out
    assert "--kernel-impl triton" in plan["triton"]["out"]
    assert value["torch"]["yours"]["memory"]["activations"] > 1.2 * value["triton"]["yours"]["memory"]["activations"]
    # (TP 1 without --sequence-parallel: it was "rank -")
    assert re.search(r"your layout, rank \d+ of", plan["uniform"]["out"]), plan["uniform"]["out"][-600:]
    # a script's --recompute-method block N is planned as written (it was taken as uniform 1): N layers
    # recomputed, the rest keep their activations
    assert "recompute=full(block 1)" in plan["block"]["out"]
    # without Megatron's --overlap-grad-reduce / --overlap-param-gather (both off by default): priced as it runs,
    # and said to be outside the search; FSDP2 with --overlap-grad-reduce (which has no effect there, as in
    # Megatron) planned as FSDP2 is searched
    assert "zero1(no overlap: reduce, gather)" in value["plain"]["yours"]["describe"]
    out = plan["plain"]["out"]
    assert "(the search overlaps the gradient reduction and the weights' gather (--overlap-grad-reduce, " in out
    assert "--overlap-param-gather) wherever the sharding takes them):" in out
    assert value["plain"]["yours"]["time"]["dp_comm"] > 2 * value["uniform"]["yours"]["time"]["dp_comm"]
    taken = value["fsdp2"]["yours"]
    assert taken["reason"] is None and " fsdp2 " in taken["describe"], taken
    assert value["block"]["yours"]["memory"]["activations"] > 10 * value["uniform"]["yours"]["memory"]["activations"]
    # (the = form of --kernel-impl was not read)
    assert "16 x 1024 tokens, bf16, --kernel-impl torch" in plan["encoder"]["out"]
    windowed = value["windowed"]["yours"]
    assert windowed["reason"] is None and "CP2(a2a)" in windowed["describe"]
    # a script's --microbatch-group-size-per-virtual-pipeline-stage is planned (it was refused as pretrain's
    # default rule, and a group above PP keeps more activations alive: priced at PP's)
    grouped = value["grouped"]["yours"]
    assert grouped["reason"] is None and "VP2(G8)" in grouped["describe"]
    assert grouped["memory"]["activations"] > value["pipe"]["yours"]["memory"]["activations"]
    assert "not a2a+p2p" in value["hierarchical"]["yours"]["reason"]
    assert re.search(r"LoRA fine-tuning \(--lora-rank 16\) is not modelled here", str(plan["lora"]["exit"]))
    for bad in (f"bad{i}" for i in range(4)):
        assert plan[bad]["exit"] is not None and "must be positive" in plan[bad]["err"], _JOB_PLANS[bad]
    assert not value["seventy"]["fits"] and "GPUs are needed to hold them" in plan["seventy"]["out"]
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV3Config(
        vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=1024,
    )  # fmt: skip
    cfg.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
    args = ["--hf-config", str(tmp_path), "--seq-length", "512", "--global-batch-size", "8", "--top", "1"]
    with_mtp = _tool().main(args)
    assert "(counts include its 1 MTP depth)" in capsys.readouterr().out
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 0}))
    without = _tool().main(args)
    assert with_mtp["fits"][0]["memory"]["params"] > without["fits"][0]["memory"]["params"]


def test_the_plan_is_in_the_jobs_precision(capsys):
    """From the planner review: every job was planned in bf16, so flags without --bf16 (which pretrain trains in
    fp32, twice the bytes) were planned at half their weights, and --fp16 jobs were offered FSDP2, which refuses
    --fp16."""
    small = "--num-layers 4 --hidden-size 512 --num-attention-heads 8 --global-batch-size 16 --vocab-size 32000"
    small = [
        *small.split(),
        "--seq-length",
        "1024",
        "--position-embedding-type",
        "rope",
        "--tensor-model-parallel-size",
        "2",
    ]
    plans = {}
    for precision, flags in (("fp32", []), ("bf16", ["--bf16"]), ("fp16", ["--fp16"])):
        plans[precision] = _tool().main(["--top", "1000", "--gpus-per-node", "4", "--", *small, *flags])
        assert f"16 x 1024 tokens, {precision}," in capsys.readouterr().out
        assert plans[precision]["yours"]["reason"] is None
    weights = {k: p["yours"]["memory"]["params"] for k, p in plans.items()}
    assert weights["fp32"] == pytest.approx(2 * weights["bf16"]) and weights["fp16"] == weights["bf16"]
    described = {k: [c["describe"] for c in p["fits"]] for k, p in plans.items()}
    assert any("fsdp2" in d for d in described["bf16"]) and not any("fsdp2" in d for d in described["fp16"])
    assert any("fp16" in r for r in plans["fp16"]["rejected_reasons"]), plans["fp16"]["rejected_reasons"]
    # --fp32 plans fp32 whatever the flags say
    _tool().main(["--top", "1", "--fp32", "--gpus-per-node", "4", "--", *small, "--bf16"])
    assert "16 x 1024 tokens, fp32," in capsys.readouterr().out


def test_data_parallel_sizes_the_batch_cannot_split_are_said(capsys):
    """From the planner review: a DP size that does not divide the global batch was skipped without a word, so a
    user with 12 GPUs and a batch of 16 never learned why DP 3, 6 and 12 were missing. Each is now refused with
    pretrain's message; a micro-batch size that does not divide a rank's share is still just not tried."""
    small = "--num-layers 12 --hidden-size 512 --num-attention-heads 8 --global-batch-size 16 --vocab-size 32000"
    flags = [*small.split(), "--seq-length", "1024", "--position-embedding-type", "rope", "--bf16"]
    result = _tool().main(["--top", "1000", "--gpus-per-node", "4", "--nodes", "3", "--", *flags])
    out = capsys.readouterr().out
    batch = "--global-batch-size N is not divisible by --micro-batch-size N x data-parallel size N = N"
    assert any(r.startswith(batch) for r in result["rejected_reasons"]), result["rejected_reasons"]
    # once per TP x CP x PP that leaves such a DP size (it was counted once per sharding, recompute, ... too)
    counted = sum(n for r, n in result["rejected_reasons"].items() if r.startswith(batch))
    # (without CP, which attention dropout refuses first: DP 12, 6 and 3 at TP 1, 6 and 3 at TP 2, 3 at TP 4)
    assert counted == 6, result["rejected_reasons"]
    assert "--global-batch-size 16 is not divisible by --micro-batch-size 1 x data-parallel size" in out, out[-800:]
    assert not any(re.search(r"DP(3|6|12) ", c["describe"]) for c in result["fits"])
    assert any(re.search(r"PP3 DP4 ", c["describe"]) for c in result["fits"])


def test_planner_refuses_what_pretrain_refuses():
    """The search filters with the checks pretrain runs at start-up: same message."""
    from megatron_lite.config import ConfigError
    from megatron_lite.layout_validation import validate_layout
    from megatron_lite.planner.search import check

    config = llama_config(num_layers=4)
    bad = Layout(pp=3, dp=1)
    reason = check(config, bad, SEQ, GBS, "bf16")
    with pytest.raises(ConfigError) as e:
        validate_layout(config, bad.parallel_config(), bad.world, bad.training_config(GBS, SEQ))
    assert reason == str(e.value) and "not divisible" in reason
    assert check(config, Layout(dp=2, sharding="fsdp2"), SEQ, GBS, "bf16") is None
    assert check(config, Layout(tp=2, pp=2, dp=2), SEQ, GBS, "bf16") is None
    # FSDP2 with pipeline, context and expert parallelism: each runs
    assert check(config, Layout(pp=2, dp=2, sharding="fsdp2"), SEQ, GBS, "bf16") is None
    assert check(config, Layout(cp=2, dp=2, sharding="fsdp2"), SEQ, GBS, "bf16") is None
    assert check(moe_llama(num_layers=4), Layout(ep=2, dp=2, sharding="fsdp2"), SEQ, GBS, "bf16") is None


# (a 1024-GPU search: half a minute on one core, started ahead: tests/head_start.py)
head_start.register_tool(
    "plan_deepseek_v3", "plan_parallelism.py", ["--script", str(ROOT / "pretrain" / "deepseek_v3.sh"), "--top", "1"]
)


@pytest.mark.head_start("plan_deepseek_v3")
def test_a_scripts_uneven_pipeline_split_is_planned_as_written():
    """deepseek_v3.sh splits 61 layers 3 + 14 x 4 + 2 over PP=16 (--pipeline-model-parallel-layout): the planner
    evaluates that layout, stage by stage, where it refused it as an uneven split before. (From the planner
    review) the plan says why that layout is unranked and that --uneven-pipeline tries such splits: it said
    "rank -" and listed 200k refusals of 61 layers over even stages without a word of it."""
    out, out_dir = head_start.tool_result("plan_deepseek_v3")
    result = json.loads((out_dir / "r.json").read_text())
    assert "rank - of" in out and "(an uneven pipeline split: --uneven-pipeline searches them)" in out
    assert "--uneven-pipeline also tries the pipeline sizes 61 layers do not divide" in out
    yours = result["yours"]
    assert yours["reason"] is None and tuple(yours["layout"]["stages"]) == (3,) + (4,) * 14 + (2,)
    assert "PP16(3/4/4/4/4/4/4/4/4/4/4/4/4/4/4/2)" in yours["describe"]
    assert yours["memory"]["total"] > 0 and yours["mfu"] > 0


def test_the_search_tries_uneven_pipeline_splits_when_asked():
    """--uneven-pipeline: a pipeline size whose stages do not divide the layers is tried with lighter end stages
    (61 layers on 16 stages: 3, 3, 4 x 13, 3), which the even split refuses."""
    from megatron_lite.planner.hardware import cluster
    from megatron_lite.planner.search import evaluate, layouts, uneven_stages

    assert uneven_stages(61, 16) == (3, 3) + (4,) * 13 + (3,)
    assert uneven_stages(5, 4) == (1, 1, 2, 1) and uneven_stages(64, 16) is None
    model = llama_config(num_layers=61)
    even, uneven = layouts(model, 16, 8, 64), layouts(model, 16, 8, 64, uneven=True)
    assert len(even) == len(uneven)
    staged = [x for x in uneven if x.stages is not None]
    assert staged and all(sum(x.stages) == 61 and len(x.stages) == x.pp * x.vp for x in staged)
    cl = cluster("H100", 8, 2, None, None)
    layout = next(x for x in staged if x.pp == 2 and x.vp == 1 and x.sharding == "none")
    assert evaluate(model, layout, 32, 64, cl).reason is None
    assert "not divisible" in evaluate(model, dataclasses.replace(layout, stages=None), 32, 64, cl).reason


def test_a_scripts_relative_paths_are_the_repositorys_wherever_the_planner_runs(tmp_path, monkeypatch):
    """From the README review: a launch script `cd`s to the repository first, so its TOKENIZER=tokenizer.json is the
    repository's; the planner expanded it against its own working directory, and a tokenizer.json there priced
    another vocabulary. Its paths are now the repository's (a blend's weights left as numbers)."""
    tool = _tool()
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    argv, world, _ = tool.script_args(str(ROOT / "pretrain" / "llama3_8b.sh"))
    at = argv.index("--tokenizer-model")
    assert argv[at + 1] == str(ROOT / "tokenizer.json") and world == 8
    assert argv[argv.index("--data-path") + 1] == str(ROOT / "data" / "llama3_text_document")


def test_the_search_recomputes_the_fewest_layers_that_fit(capsys):
    """Where a layout fits with full recomputation and not without, the search also tries Megatron's
    --recompute-method block with the fewest layers of each chunk that fit: fewer forwards run twice, so it is
    faster than uniform 1 (the search offered full recomputation of every layer or none before)."""
    from megatron_lite.planner.hardware import cluster
    from megatron_lite.planner.published import L8_FUSED
    from megatron_lite.planner.search import evaluate, fewest_block_layers

    cl = cluster("H100", 8, 1, None, None)
    full = Layout(tp=2, dp=4, sharding="dist-opt", recompute="full", micro_batch_size=2)
    job = (8192, 128, cl)

    def block(k):
        return dataclasses.replace(full, recompute_method="block", recompute_num_layers=k)

    assert evaluate(L8_FUSED, dataclasses.replace(full, recompute="none"), *job).reason  # the case this is about
    uniform = evaluate(L8_FUSED, full, *job)
    n = fewest_block_layers(L8_FUSED, full, *job)
    assert uniform.reason is None and n is not None and 1 < n < 32
    fewest = evaluate(L8_FUSED, block(n), *job)
    assert fewest.reason is None and evaluate(L8_FUSED, block(n - 1), *job).reason  # the fewest: one less does not fit
    assert fewest.time.total < uniform.time.total and fewest.memory.total > uniform.memory.total
    # where the layout fits without recomputing, or only by recomputing every layer, there is nothing to add
    assert (
        fewest_block_layers(L8_FUSED, dataclasses.replace(full, dp=4, micro_batch_size=1), *job, none_fits=True) is None
    )
    # the plan ranks them; a script's own block N other than the search's says so
    script = str(ROOT / "pretrain" / "llama3_8b.sh")
    result = _tool().main(["--script", script, "--top", "80"])
    assert any(f["layout"]["recompute_method"] == "block" for f in result["fits"])
    flags = "--recompute-granularity full --recompute-method block --recompute-num-layers 30".split()
    _tool().main(["--script", script, "--top", "1", "--", *flags])
    assert "block with the fewest layers of each chunk that fit" in capsys.readouterr().out


def test_a_muon_job_is_planned_without_the_sharded_optimizers(capsys):
    """--optimizer muon runs with plain data parallelism only (pretrain refuses the distributed optimizer and
    FSDP2 with it, as Megatron does): the plan offers no sharded layout, says why they are out, and names what it
    counts for the optimizer state and that it prices the Newton-Schulz GEMMs: at TP2 DP4 each rank's half of
    Llama-3-8B's matrices, about 0.3 PFLOP (tests/test_planner_muon.py), over half a second on an H100, which the
    step left out (it priced the state's traffic alone)."""
    script = str(ROOT / "pretrain" / "llama3_8b.sh")
    adam = _tool().main(["--script", script, "--top", "1000"])
    assert {f["layout"]["sharding"] for f in adam["fits"]} > {"none"}  # (the case this test is about)
    muon = _tool().main(["--script", script, "--top", "1000", "--", "--optimizer", "muon"])
    out = capsys.readouterr().out
    assert muon["fits"] and {f["layout"]["sharding"] for f in muon["fits"]} == {"none"}
    assert "Muon's momentum (4 bytes) on the hidden layers' matrices" in out
    assert "--optimizer muon runs without --use-distributed-optimizer" in out
    assert (
        "Muon's Newton-Schulz (5 iterations of bf16 GEMMs, --muon-tp-mode blockwise, the fused QKV part by part)" in out
    )
    ddp = "TP2+SP PP1 DP4 ddp recompute=full mbs=1"  # (its state's traffic alone: about 0.04 s)
    assert next(f["time"]["optimizer"] for f in muon["fits"] if f["describe"] == ddp) > 0.5


def test_a_dist_muon_job_is_planned_with_its_state_split_over_data_parallelism(capsys):
    """--optimizer dist_muon: every layout splits the state layer-wise over data parallelism (none of the sharded
    optimizers, which pretrain refuses with it), the script's own layout too; at TP2 DP4 each rank holds about a
    quarter of what muon holds on every rank (Llama-3-8B's vocabulary tensors are smaller than a quarter of a TP
    rank's state, so the greedy split is close to even). It was priced as muon's whole state."""
    script = str(ROOT / "pretrain" / "llama3_8b.sh")
    plans = {o: _tool().main(["--script", script, "--top", "1000", "--", "--optimizer", o]) for o in MUON_KINDS}
    out = capsys.readouterr().out
    assert {f["layout"]["sharding"] for f in plans["dist_muon"]["fits"]} == {"layer-wise"}
    assert plans["dist_muon"]["yours"]["layout"]["sharding"] == "layer-wise"
    assert "--optimizer dist_muon runs without --use-distributed-optimizer" in out
    tp2_dp4 = [
        next(f["memory"]["optimizer"] for f in plans[o]["fits"] if f["describe"].startswith("TP2+SP PP1 DP4 "))
        for o in MUON_KINDS
    ]
    assert 1 / 4 <= tp2_dp4[1] / tp2_dp4[0] < 1.05 / 4, tp2_dp4


MUON_KINDS = ("muon", "dist_muon")


def test_plan_of_heterogeneous_layers_from_a_decilm_config(tmp_path, capsys):
    """A Llama-Nemotron (DeciLM) config.json is planned, each layer at its own parts and sizes: the parameter
    count printed is the built model's, and the layouts are those its layers' query groups allow (TP 2 divides the
    normal layers' 4 and 2 groups, TP 4 not). It was refused."""
    from megatron_lite.checkpoint.hf_convert import load_hf_config
    from megatron_lite.config import ParallelConfig
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.models.hf import config_from_hf
    from megatron_lite.parallel_context import ParallelContext

    from models import HETERO_BLOCKS

    hf = {"architectures": ["DeciLMForCausalLM"], "model_type": "nemotron-nas", "hidden_size": 512,
          "num_attention_heads": 8, "num_hidden_layers": 8, "vocab_size": 32000, "max_position_embeddings": 4096,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
          "block_configs": [*HETERO_BLOCKS] * 2}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(hf))
    argv = ["--seq-length", "1024", "--global-batch-size", "16", "--gpu", "H100", "--top", "1000"]
    result = _tool().main(["--hf-config", str(tmp_path / "config.json"), *argv])
    out = capsys.readouterr().out
    model = config_from_hf(load_hf_config(str(tmp_path))[0])
    net = build_model(model, ParallelContext.virtual(ParallelConfig(), 1, 0), device="meta")
    built = sum(p.numel() for p in net.parameters())
    assert f"model: {built / 1e6:.1f}M parameters;" in out, (built, out.splitlines()[0])
    assert "heterogeneous layers (attention: 4 normal, 2 linear, 2 no-op; MLP: 4 normal, 2 linear, 2 no-op)" in out
    assert result["fits"] and {f["layout"]["tp"] for f in result["fits"]} == {1, 2}


def test_a_jobs_expert_tensor_parallel_size_is_priced_and_searched(capsys):
    """(Noticed in session 31: the planner priced experts split as the dense layers, so a job's
    --expert-tensor-parallel-size 1 under TP 2 was planned as ETP 2.) The job's layout is priced with whole experts
    (twice the expert weights a rank, the same optimizer state: sharded over twice the ranks), and the search tries
    expert TP 1 too."""
    flags = "--num-layers 2 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 512 --num-experts 8 --bf16 "
    flags += "--seq-length 512 --global-batch-size 16 --vocab-size 1000 --tensor-model-parallel-size 2 "
    flags += "--sequence-parallel --expert-model-parallel-size 2 --use-distributed-optimizer"
    jobs = {}
    for etp in ("2", "1"):
        argv = ["--top", "1", "--gpus-per-node", "4", "--", *flags.split(), "--expert-tensor-parallel-size", etp]
        jobs[etp] = _tool().main(argv)["yours"]
        capsys.readouterr()
    assert "ETP" not in jobs["2"]["describe"] and "EP2 ETP1" in jobs["1"]["describe"], jobs
    mem = {etp: job["memory"] for etp, job in jobs.items()}
    assert mem["1"]["params"] > 1.5 * mem["2"]["params"], mem
    assert mem["1"]["optimizer"] == pytest.approx(mem["2"]["optimizer"], rel=0.01), mem
    from megatron_lite.planner.search import layouts

    from models import llama_config

    # a dense model's flag (Megatron ignores it; scripts set it for every model) leaves the job in the search
    dense = flags.replace("--num-experts 8 ", "").replace("--expert-model-parallel-size 2 ", "")
    argv = ["--top", "1", "--gpus-per-node", "4", "--", *dense.split(), "--expert-tensor-parallel-size", "1"]
    job = _tool().main(argv)["yours"]
    capsys.readouterr()
    assert "ETP" not in job["describe"] and job["layout"]["etp"] is None, job
    moe = llama_config(num_layers=2, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)
    assert any(lay.etp == 1 and lay.tp == 2 for lay in layouts(moe, 8, 8, 16)), "the search tries expert TP 1"
    assert not any(lay.etp for lay in layouts(llama_config(num_layers=2), 8, 8, 16))


def test_a_long_search_says_what_was_asked_first_and_then_how_far_it_has_got(capsys, monkeypatch):
    """A large MoE cluster's search costs some 80,000 layouts, a minute here, and said nothing until it ended: the
    model and cluster lines now come before the search, and a search running past `every` seconds (10 by default)
    puts a line on stderr now and then (here every 256 layouts, at every=0)."""
    tool = _tool()
    progress = tool.SearchProgress
    monkeypatch.setattr(tool, "SearchProgress", lambda: progress(every=0.0))
    before_search = []

    def plan(*args, **kwargs):  # (what stdout held when the search began)
        before_search.append(capsys.readouterr().out)
        return search_plan(*args, **kwargs)

    search_plan = tool.plan
    monkeypatch.setattr(tool, "plan", plan)
    result = tool.main(["--script", str(ROOT / "pretrain" / "llama3_8b.sh"), "--top", "1"])
    assert len(before_search) == 1 and before_search[0].startswith("model: 8.03B parameters"), before_search
    assert "cluster: 1 x 8 H100" in before_search[0] and "memory per GPU" not in before_search[0]
    lines = capsys.readouterr().err.splitlines()
    counts = [re.fullmatch(r"searching: (\d+) layouts costed, (\d+) fit so far \(\d+ s\)", line) for line in lines]
    assert len(lines) >= 2 and all(counts), lines
    counts = [(int(m[1]), int(m[2])) for m in counts]
    costed = result["fitting"] + result["rejected"]
    assert [c for c, _ in counts] == list(range(0, costed, 256))[: len(counts)] and counts[-1][0] < costed
    assert all(fit <= c for c, fit in counts) and counts[-1][1] <= result["fitting"]
    # at the default interval a search of a few seconds prints nothing there
    monkeypatch.undo()
    _tool().main(["--script", str(ROOT / "pretrain" / "llama3_8b.sh"), "--top", "1"])
    assert capsys.readouterr().err == ""


def test_a_model_config_hashes_itself_again_in_another_process(tmp_path):
    """ModelConfig keeps its hash after the first (the planner's caches hash it hundreds of thousands of times a
    search), but a string's hash differs between processes: a copy unpickled in another carries no stale one and
    finds itself as a key there."""
    config = llama_config()
    assert hash(config) == hash(dataclasses.replace(config)) != hash(dataclasses.replace(config, num_layers=3))
    (tmp_path / "config.pkl").write_bytes(pickle.dumps(config))
    probe = (
        "import dataclasses, pickle, sys; c = pickle.loads(open(sys.argv[1], 'rb').read()); "
        "fresh = dataclasses.replace(c); print(hash(c) == hash(fresh), {fresh: 1}.get(c))"
    )
    for seed in ("1", "2"):
        run = subprocess.run(
            [sys.executable, "-c", probe, str(tmp_path / "config.pkl")],
            capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": seed},
        )  # fmt: skip
        assert run.returncode == 0 and run.stdout.split() == ["True", "1"], run


def test_the_cluster_line_names_the_peak_mfu_is_taken_against(capsys):
    """An fp32 plan's MFU is against the plain fp32 rate: the cluster line said the bf16 peak (312 TFLOP/s on an
    A100 for an MFU taken against 19.5), from a walk through the docs."""
    from megatron_lite.planner.hardware import ACCELERATORS as GPUS

    model = "--num-layers 2 --hidden-size 1024 --num-attention-heads 16 --vocab-size 32000".split()
    for precision, peak in (([], GPUS["A100"].fp32_rate), (["--bf16"], GPUS["A100"].peak_flops)):
        _tool().main(["--gpu", "A100", "--seq-length", "1024", "--global-batch-size", "8", "--top", "1", "--",
                      *model, *precision])  # fmt: skip
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("cluster:"))
        assert f"({80} GiB, {peak / 1e12:.4g} TFLOP/s {'bf16' if precision else 'fp32'} peak)" in line, line
    assert GPUS["A100"].fp32_rate < GPUS["A100"].peak_flops / 10
