"""MoE and multi-latent attention through the entry point: the MoE losses logged, --moe-layer-freq expressions, MLA and
its YaRN flags, multi-token prediction, and what comes back from a checkpoint. (Split from
tests/test_pretrain_cli.py.)"""

from __future__ import annotations

import json
import os

import pytest
from test_pretrain_cli import TINY, _one_line_error, _run

from megatron_lite.training.pretrain import main


def test_moe_losses_are_the_windows_mean(tmp_path, capsys, monkeypatch):
    """load_balancing_loss and z_loss over a log window are its steps' mean, as lm loss and as Megatron's (they
    were the window's last step)."""
    moe = ["--mock-data", "--vocab-size", "100", "--num-experts", "4", "--moe-aux-loss-coeff", "1e-2"]
    moe += ["--moe-z-loss-coeff", "1e-3", "--disable-bias-linear"]
    logged = {}
    for interval in (1, 3):
        log = tmp_path / f"m{interval}.jsonl"
        rc, out, err = _run([*moe, "--log-interval", str(interval), "--log-jsonl", str(log)], capsys, monkeypatch)
        assert rc == 0, err
        logged[interval] = [json.loads(line) for line in log.read_text().splitlines() if "lm_loss" in line]
    assert "load_balancing_loss: " in out and "z_loss: " in out
    for k in ("moe_aux_loss", "moe_z_loss"):
        each = [r[k] for r in logged[1]]
        assert len(set(each)) == 3 and logged[3][-1][k] == pytest.approx(sum(each) / 3, rel=1e-12), (k, each)


def test_moe_per_layer_losses_and_an_aux_loss_free_run(tmp_path, capsys, monkeypatch):
    """From an MoE review: --moe-per-layer-logging was a no-op (JSONL now holds each layer's losses, whose mean
    is the logged one), and an aux-loss-free run (--moe-aux-loss-coeff 0, the expert bias balancing) logged a
    load_balancing_loss of 0, which Megatron does not track."""
    moe = ["--mock-data", "--vocab-size", "100", "--num-experts", "4", "--disable-bias-linear", "--log-interval", "1"]
    log = tmp_path / "m.jsonl"
    rc, out, err = _run([*moe, "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--log-jsonl", str(log),
                         "--moe-per-layer-logging"], capsys, monkeypatch)  # fmt: skip
    assert rc == 0, err
    rec = [json.loads(line) for line in log.read_text().splitlines() if "lm_loss" in line][-1]
    layers = rec["moe_layer_losses"]
    assert sorted(layers) == ["0", "1"] and all(v["aux_loss"] > 0 and v["z_loss"] > 0 for v in layers.values())
    for k in ("aux_loss", "z_loss"):
        assert rec[f"moe_{k}"] == pytest.approx(sum(v[k] for v in layers.values()) / 2, rel=1e-12)
        assert [rec[f"moe_layer{i}_{k}"] for i in (0, 1)] == [layers[str(i)][k] for i in (0, 1)]  # (W&B's scalars)
    free = ["--moe-aux-loss-coeff", "0", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
    free_log = tmp_path / "free.jsonl"
    rc, out, err = _run([*moe, *free, "--moe-per-layer-logging", "--log-jsonl", str(free_log)], capsys, monkeypatch)
    assert rc == 0, err
    lines = [line for line in out.splitlines() if "] iteration " in line]
    assert len(lines) == 3 and not any("load_balancing_loss" in line for line in lines), lines
    rec = [json.loads(line) for line in free_log.read_text().splitlines() if "lm_loss" in line][-1]
    assert not any(k.endswith(("_aux_loss", "_z_loss")) for k in rec) and rec["moe_layer_losses"]["0"] == {}, rec


def test_moe_losses_go_under_the_names_megatron_tracks(capsys, monkeypatch):
    """seq_aux_loss is Megatron's seq_load_balancing_loss (it was logged as load_balancing_loss); the z loss is
    tracked only with --moe-z-loss-coeff; Megatron's number of nan iterations is there with the NaN check off."""
    moe = ["--mock-data", "--vocab-size", "100", "--num-experts", "4", "--moe-aux-loss-coeff", "1e-2"]
    moe += ["--disable-bias-linear", "--moe-router-load-balancing-type", "seq_aux_loss"]
    rc, out, err = _run([*moe, "--no-check-for-nan-in-loss-and-grad"], capsys, monkeypatch)
    assert rc == 0, err
    lines = [line for line in out.splitlines() if "] iteration " in line]
    assert len(lines) == 3 and all("| seq_load_balancing_loss: " in line for line in lines), lines
    assert not any("| load_balancing_loss" in line or "z_loss" in line for line in lines), lines
    assert all("| number of nan iterations:   0 |" in line for line in lines), lines


@pytest.mark.parametrize(
    "text,expected",
    [
        ("([0]*3+[1]*5)", (0, 0, 0, 1, 1, 1, 1, 1)),
        ("[1,0]*2", (1, 0, 1, 0)),
        ("2*[1,0]", (1, 0, 1, 0)),  # (Python's eval, which Megatron runs, takes the count on either side)
        ("[0]+2*[1]*2", (0, 1, 1, 1, 1)),
        ("([0]+[1]*3)*2", (0, 1, 1, 1, 0, 1, 1, 1)),
        ("0,1,1", (0, 1, 1)),
        ("2", 2),
        ("[1]", (1,)),  # a one-layer pattern stays a pattern (as an int, [0] read as "every 0th layer")
    ],
)
def test_moe_layer_freq_takes_megatrons_list_expressions(text, expected):
    """Megatron scripts write per-layer patterns as list expressions (DeepSeek-V3: "([0]*3+[1]*58)"); they are
    parsed (never eval'd) into the same pattern."""
    from megatron_lite.flag_values import layer_freq as _layer_freq

    assert _layer_freq(text) == expected


@pytest.mark.parametrize(
    "text",
    ["[0]*", "([0]*3", "__import__('os')", "[0]*x", "[1]*9999999999", "(" * 40 + "[1]*2" + ")" * 40, "2*", "2*3"],
)
def test_bad_moe_layer_freq_is_one_line(text, capsys, monkeypatch):
    rc, _, err = _run(["--num-experts", "4", "--moe-layer-freq", text, "--disable-bias-linear"], capsys, monkeypatch)
    _one_line_error(rc, err, "--moe-layer-freq", "list expression")


@pytest.mark.parametrize(
    "text,fragment", [("0", "--moe-layer-freq 0 must be >= 1"), ("2,1", "may hold only 0 (dense) and 1 (MoE)")]
)
def test_a_moe_layer_freq_out_of_range_is_one_line(text, fragment, capsys, monkeypatch):
    """(--moe-layer-freq 0 divided by zero; a pattern entry of 2 counted as MoE)"""
    argv = ["--num-layers", "2", "--num-experts", "4", "--moe-layer-freq", text, "--disable-bias-linear"]
    rc, _, err = _run(argv, capsys, monkeypatch)
    _one_line_error(rc, err, fragment)


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--group-query-attention", "--num-query-groups", "2"], "--num-query-groups 2"),
        (["--qk-pos-emb-head-dim", "7"], "--qk-pos-emb-head-dim 7"),
        (["--tensor-model-parallel-size", "2", "--kv-lora-rank", "7"], "--kv-lora-rank + --qk-pos-emb-head-dim"),
    ],
)
def test_bad_multi_latent_attention_flags_are_one_line(argv, fragment, capsys, monkeypatch):
    mla = "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 8"
    base = [*mla.split(), "--v-head-dim", "8", "--position-embedding-type", "rope", "--disable-bias-linear"]
    rc, _, err = _run([*base, *argv], capsys, monkeypatch, world=2 if "--tensor-model-parallel-size" in argv else 1)
    _one_line_error(rc, err, fragment)


def test_multi_latent_attention_without_disable_bias_linear_says_so(capsys, monkeypatch):
    mla = "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 8"
    rc, _, err = _run([*mla.split(), "--v-head-dim", "8", "--position-embedding-type", "rope"], capsys, monkeypatch)
    _one_line_error(rc, err, "--disable-bias-linear")


MLA_FLAGS = (
    "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 8 "
    "--v-head-dim 8 --qk-layernorm --position-embedding-type rope --normalization RMSNorm --swiglu "
    "--disable-bias-linear --vocab-size 64"
).split()


def test_mla_yarn_flags_build_what_deepseeks_config_json_does():
    """Megatron's --rotary-scaling-factor / --mscale / --mscale-all-dim (YaRN, MLA's default RoPE) give the RoPE
    scaling and softmax scale that a DeepSeek config.json with the same YaRN converts to, which the
    transformers reference tests check against transformers itself."""
    import transformers

    from megatron_lite.arguments import parse_args
    from megatron_lite.models.hf import config_from_hf

    yarn = "--rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707".split()
    _, job = parse_args([*TINY, *MLA_FLAGS, *yarn])
    hf = transformers.DeepseekV3Config(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=8,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, first_k_dense_replace=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 0.707, "mscale_all_dim": 0.707},
    )  # fmt: skip
    ref = config_from_hf(hf)
    assert job.model.rope_scaling == ref.rope_scaling
    assert job.model.softmax_scale == pytest.approx(ref.softmax_scale, rel=1e-15)
    assert job.model.softmax_scale > (8 + 8) ** -0.5  # mscale_all_dim really scales it
    _, plain = parse_args([*TINY, *MLA_FLAGS])  # Megatron's default: YaRN with factor 1 is plain RoPE
    assert plain.model.rope_scaling is None and plain.model.softmax_scale == (8 + 8) ** -0.5


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--rope-type", "rope", "--rotary-scaling-factor", "4"], "--rotary-scaling-factor 4.0 with --rope-type rope"),
        (["--rotary-scaling-factor", "0"], "--rotary-scaling-factor 0.0 must be > 0"),
    ],
)
def test_bad_mla_rope_flags_are_one_line(argv, fragment, capsys, monkeypatch):
    rc, _, err = _run([*MLA_FLAGS, *argv], capsys, monkeypatch)
    _one_line_error(rc, err, fragment)


def test_rotary_scaling_factor_without_mla_is_reported_and_yarn_refused(capsys, monkeypatch):
    """Megatron scripts for Llama pass --rotary-scaling-factor, which Megatron reads for MLA only."""
    llama = "--position-embedding-type rope --normalization RMSNorm --swiglu --mock-data --vocab-size 64".split()
    rc, out, err = _run([*llama, "--rotary-scaling-factor", "8"], capsys, monkeypatch)
    assert rc == 0, err
    assert "--rotary-scaling-factor 8.0 has no effect without --multi-latent-attention" in out + err
    rc, _, err = _run([*llama, "--rope-type", "yarn"], capsys, monkeypatch)
    _one_line_error(rc, err, "--rope-type yarn is supported with --multi-latent-attention only")


def test_load_alone_rebuilds_a_multi_latent_attention_run_with_yarn(tmp_path, capsys, monkeypatch):
    """The MLA flags and the YaRN built from --rotary-scaling-factor / --mscale-all-dim come back from the
    checkpoint (the model-shape check would stop the job otherwise); a conflicting explicit factor is refused."""
    ckpt = str(tmp_path / "ckpt")
    yarn = "--rotary-scaling-factor 8 --mscale 0.707 --mscale-all-dim 0.707".split()
    rc, _, err = _run([*MLA_FLAGS, *yarn, "--mock-data", "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    from megatron_lite.arguments import parse_args

    _, saved_job = parse_args([*TINY, *MLA_FLAGS, *yarn])
    rc = main(["--load", ckpt, "--train-iters", "5"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "loaded" in out.out and "iteration        5/       5 |" in out.out
    ns, job = parse_args(["--load", ckpt, "--train-iters", "5"])
    assert job.model.rope_scaling == saved_job.model.rope_scaling and job.model.multi_latent_attention
    assert job.model.softmax_scale == saved_job.model.softmax_scale
    rc = main(["--load", ckpt, "--train-iters", "5", "--rotary-scaling-factor", "4"])
    _one_line_error(rc, capsys.readouterr().err, "--rotary-scaling-factor")


def test_the_group_score_rule_comes_back_from_the_checkpoint(tmp_path, capsys, monkeypatch):
    """A converted DeepSeek-V2 ranks expert groups by their best score (--moe-router-group-score-topn 1), not
    Megatron's top-k // group-topk: resuming with --load alone must keep routing that way."""
    from megatron_lite.arguments import parse_args

    ckpt = str(tmp_path / "ckpt")
    moe = "--num-experts 4 --moe-router-topk 2 --moe-router-num-groups 2 --moe-router-group-topk 1".split()
    argv = [*moe, "--moe-router-group-score-topn", "1", "--disable-bias-linear", "--mock-data", "--vocab-size", "64"]
    rc, _, err = _run([*argv, "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    _, job = parse_args(["--load", ckpt, "--train-iters", "5"])
    assert job.model.moe_router_group_score_topn == 1


def test_explicit_yarn_flags_that_disagree_with_an_mla_checkpoint_are_refused(tmp_path, capsys, monkeypatch):
    """The checkpoint keeps YaRN's resolved factor, not --mscale: a different --mscale (or --rope-type rope) on
    resume would otherwise be ignored; the same --mscale is fine."""
    ckpt = str(tmp_path / "ckpt")
    yarn = "--rotary-scaling-factor 8 --mscale 0.707 --mscale-all-dim 0.707".split()
    rc, _, err = _run([*MLA_FLAGS, *yarn, "--mock-data", "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    from megatron_lite.arguments import parse_args

    parse_args(["--load", ckpt, "--train-iters", "5", "--mscale", "0.707"])  # the same: accepted
    rc = main(["--load", ckpt, "--train-iters", "5", "--mscale", "1.0"])
    _one_line_error(rc, capsys.readouterr().err, "--mscale 1.0 conflicts")
    rc = main(["--load", ckpt, "--train-iters", "5", "--rope-type", "rope"])
    _one_line_error(rc, capsys.readouterr().err, "--rope-type rope conflicts")


def test_load_alone_rebuilds_a_multi_token_prediction_run(tmp_path, capsys, monkeypatch):
    """--mtp-num-layers and --mtp-loss-scaling-factor come back from the checkpoint (its MTP weights need the
    depths); an explicit other depth count is refused, and a negative one is a one-line error."""
    ckpt = str(tmp_path / "ckpt")
    mtp = "--mtp-num-layers 2 --mtp-loss-scaling-factor 0.3".split()
    rc, out, err = _run([*MLA_FLAGS, *mtp, "--mock-data", "--save", ckpt], capsys, monkeypatch)
    assert rc == 0, err
    assert "mtp_2 loss: " in out
    from megatron_lite.arguments import parse_args

    _, job = parse_args(["--load", ckpt, "--train-iters", "5"])
    assert (job.model.mtp_num_layers, job.model.mtp_loss_scaling_factor) == (2, 0.3)
    rc = main(["--load", ckpt, "--train-iters", "5"])
    out = capsys.readouterr()
    assert rc == 0 and "loaded" in out.out and "mtp_1 loss: " in out.out, out.err
    rc = main(["--load", ckpt, "--train-iters", "5", "--mtp-num-layers", "1"])
    _one_line_error(rc, capsys.readouterr().err, "--mtp-num-layers")
    rc, _, err = _run([*MLA_FLAGS, "--mock-data", "--mtp-num-layers", "-1"], capsys, monkeypatch)
    _one_line_error(rc, err, "--mtp-num-layers -1 must be >= 0")
    # a checkpoint without MTP: an explicit --mtp-num-layers 0 agrees with it
    plain = str(tmp_path / "plain")
    rc, _, err = _run([*MLA_FLAGS, "--mock-data", "--save", plain], capsys, monkeypatch)
    assert rc == 0, err
    _, job = parse_args(["--load", plain, "--train-iters", "5", "--mtp-num-layers", "0"])
    assert job.model.mtp_num_layers == 0


def test_generate_runs_a_capacity_factor_moe_one_prompt_at_a_time(tmp_path, capsys, monkeypatch):
    """From a review: batched prompts' tokens compete for the experts' capacity, so under a capacity factor each
    prompt's output depended on the others in its batch; such a model's prompts run one at a time, and start-up
    says so."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("generate_tool", os.path.join(root, "tools", "generate.py"))
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    ckpt = tmp_path / "ckpt"
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-expert-capacity-factor", "1.0", "--mock-data",
           "--disable-bias-linear", "--vocab-size", "100", "--train-iters", "1", "--save", str(ckpt)]  # fmt: skip
    rc, _, err = _run(moe, capsys, monkeypatch)
    assert rc == 0, err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [3 + i, 7, 11 + 2 * i, 5][: 2 + i]}) + "\n" for i in range(3)))
    argv = ["--load", str(ckpt), "--prompts-file", str(prompts), "--max-new-tokens", "3", "--greedy", "--ignore-eos"]
    outs = {}
    for n in (8, 1):
        capsys.readouterr()
        assert (
            generate.main([*argv, "--inference-max-requests", str(n), "--output-json", str(tmp_path / "o.json")]) == 0
        )
        said = capsys.readouterr().err
        assert ("the prompts run one at a time" in said) == (n > 1), said
        outs[n] = json.loads((tmp_path / "o.json").read_text())
    assert [r["generated_ids"] for r in outs[8]] == [r["generated_ids"] for r in outs[1]]
