"""LoRA through the entry point: adapters in the checkpoints, resuming with --load alone, LoRA on MLA and on a
pretraining checkpoint. (Split from tests/test_pretrain_cli.py.)"""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from test_pretrain_cli import _one_line_error, _run


def _losses(out: str) -> dict[int, float]:
    return {
        int(m[1]): float(m[2]) for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*? \| lm loss: ([\d.E+-]+) \|", out)
    }


def test_a_lora_run_resumed_with_load_alone_keeps_its_adapters(tmp_path, capsys, monkeypatch):
    """--load DIR alone rebuilds the run that wrote it, LoRA included (its adapters were dropped without a word
    and the whole base trained on): iterations 3-4 equal a straight 4-iteration LoRA run. A model without
    adapters refuses a checkpoint that holds them, and an explicit other --lora-rank is a one-line error."""
    from megatron_lite.checkpoint.checkpointing import find_checkpoint, load_checkpoint, read_metadata
    from megatron_lite.checkpoint.hf_convert import model_config_from_dict
    from megatron_lite.config import ConfigError, ParallelConfig
    from megatron_lite.models.gpt_model import build_model
    from megatron_lite.parallel_context import ParallelContext

    data = ["--mock-data", "--vocab-size", "100", "--lr-decay-style", "constant"]
    base, lora, straight = (str(tmp_path / n) for n in ("base", "lora", "straight"))
    rc, _, err = _run([*data, "--train-iters", "1", "--save", base], capsys, monkeypatch)
    assert rc == 0, err
    adapt = [*data, "--load", base, "--finetune", "--lora-rank", "4"]
    rc, _, err = _run([*adapt, "--train-iters", "2", "--save", lora], capsys, monkeypatch)
    assert rc == 0, err
    rc, out, err = _run(["--load", lora, "--save", lora, "--train-iters", "4"], capsys, monkeypatch)
    assert rc == 0, err
    assert "LoRA rank 4" in out and "iteration 2" in out, out
    resumed = _losses(out)
    rc, out, err = _run([*adapt, "--train-iters", "4", "--save", straight], capsys, monkeypatch)
    assert rc == 0, err
    assert sorted(resumed) == [3, 4] and resumed == {k: v for k, v in _losses(out).items() if k > 2}, (resumed, out)

    rc, _, err = _run(["--load", lora, "--lora-rank", "8"], capsys, monkeypatch)
    _one_line_error(rc, err, "--lora-rank 8 conflicts with the rank-4 LoRA adapters")
    path = find_checkpoint(lora)
    ctx = ParallelContext.virtual(ParallelConfig(), device=torch.device("cpu"))
    plain = build_model(model_config_from_dict(read_metadata(path)["config"]["model"]), ctx)
    with pytest.raises(ConfigError, match="holds LoRA adapters .* and this model has none"):
        load_checkpoint(path, plain, None, None, ctx, load_rng=False)


def _tensor_files(root: str) -> dict[str, int]:
    """key -> bytes of a checkpoint's tensor files (its newest under `root`)."""
    from safetensors import safe_open

    from megatron_lite.checkpoint.checkpointing import find_checkpoint

    path = find_checkpoint(root)
    out = {}
    for f in sorted(os.listdir(path)):
        if f.startswith("tensors_") and f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as t:
                out.update({k: t.get_slice(k).get_shape() for k in t.keys()})
    return {k: int(np.prod(shape)) for k, shape in out.items()}


def test_lora_checkpoints_hold_the_adapters_and_name_their_base(tmp_path, capsys, monkeypatch):
    """A LoRA run's checkpoints hold the adapters alone and record their base, as Megatron-Bridge's PEFT
    checkpoints do (the whole frozen base was written at every save). A resume loads that base first (the test
    above equals a straight run through one); with the base gone it is one line naming it. A base inside the
    run's own --save, which it adds to and may delete from, gives whole checkpoints, and start-up says so."""
    from megatron_lite.checkpoint.checkpointing import find_checkpoint, read_metadata

    data = ["--mock-data", "--vocab-size", "100", "--lr-decay-style", "constant"]
    base, lora = str(tmp_path / "base"), str(tmp_path / "lora")
    rc, _, err = _run([*data, "--train-iters", "1", "--save", base], capsys, monkeypatch)
    assert rc == 0, err
    adapt = [*data, "--lora-rank", "4", "--train-iters", "2"]
    rc, out, err = _run([*adapt, "--load", base, "--finetune", "--save", lora], capsys, monkeypatch)
    assert rc == 0, err
    assert read_metadata(find_checkpoint(lora))["config"]["lora"]["base"] == find_checkpoint(base)
    adapters, whole = _tensor_files(lora), _tensor_files(base)
    assert adapters and all(".lora." in k for k in adapters), [k for k in adapters if ".lora." not in k][:3]

    os.rename(base, base + "_moved")
    rc, _, err = _run(["--load", lora, "--save", lora, "--train-iters", "3"], capsys, monkeypatch)
    _one_line_error(rc, err, f"holds LoRA adapters trained on the base checkpoint '{base}/iter_0000001'", "is gone")
    # the adapters alone (a PEFT export) read without their base; the whole model not
    from megatron_lite.checkpoint.hf_convert import read_model_tensors
    from megatron_lite.config import ConfigError

    assert all(".lora." in k for k in read_model_tensors(lora, base=False)[1])
    with pytest.raises(ConfigError, match="is gone"):
        read_model_tensors(lora)
    # a base trained again into the same directory (other weights, the same path) is not taken for the one the
    # adapters were trained on
    rc, _, err = _run([*data, "--train-iters", "1", "--save", base, "--seed", "7"], capsys, monkeypatch)
    assert rc == 0, err
    rc, _, err = _run(["--load", lora, "--save", lora, "--train-iters", "3"], capsys, monkeypatch)
    _one_line_error(rc, err, f"trained on the base checkpoint {base}/iter_0000001, which has been rewritten since")
    with pytest.raises(ConfigError, match="rewritten since"):
        read_model_tensors(lora)
    shutil.rmtree(base)
    os.rename(base + "_moved", base)

    rc, out, err = _run([*adapt, "--load", base, "--save", base], capsys, monkeypatch)
    assert rc == 0, err
    assert f"the base {base}/iter_0000001 lies in --save {base}" in out + err, out + err
    saved = _tensor_files(base)
    assert read_metadata(find_checkpoint(base))["config"]["lora"]["base"] is None
    assert {k for k in whole if k.startswith("model/")} < set(saved) and {k for k in saved if ".lora." in k} == set(
        adapters
    )  # (the same adapters)


def test_lora_on_multi_latent_attention_runs_and_mla_targets_elsewhere_are_refused(tmp_path, capsys, monkeypatch):
    """linear_qkv (the default target) means MLA's latent projections on an MLA model, also when a resume names
    it again (it was refused as differing from the checkpoint's expanded targets); naming those on a model
    without MLA is a one-line error."""
    mla = "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 8"
    argv = [*mla.split(), "--v-head-dim", "8", "--position-embedding-type", "rope", "--disable-bias-linear"]
    argv += ["--lora-rank", "4", "--lora-target-modules", "linear_qkv", "--mock-data", "--vocab-size", "64"]
    rc, out, err = _run([*argv, "--save", str(tmp_path / "c")], capsys, monkeypatch)
    assert rc == 0, err
    assert "iteration        3/       3 |" in out
    rc, out, err = _run([*argv, "--load", str(tmp_path / "c"), "--train-iters", "4"], capsys, monkeypatch)
    assert rc == 0, err
    assert "iteration        4/       4 |" in out
    # inspect_checkpoint names the latent attention and the adapters (its summary had the dense fields only)
    import importlib.util
    import pathlib

    tool = pathlib.Path(__file__).parents[1] / "tools" / "checkpoint" / "inspect_checkpoint.py"
    spec = importlib.util.spec_from_file_location("inspect_checkpoint", tool)
    inspect = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(inspect)
    assert inspect.main([str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "MLA: q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8" in out
    # the sizes a user gives, not the derived groups (dp_cp, mp, emp, tp_cp_dp, embedding); no expert sizes for a
    # dense model (a TP=2 one showed "expert-TP=2")
    assert "saved under  1 process(es): TP=1, PP=1, DP=1, CP=1\n" in out, out
    assert "LoRA: rank 4, alpha 16 on linear_q_down_proj linear_q_up_proj linear_kv_down_proj linear_kv_up_proj" in out
    rc, _, err = _run(["--lora-rank", "4", "--lora-target-modules", "q_b_proj"], capsys, monkeypatch)
    _one_line_error(rc, err, "--lora-target-modules linear_q_up_proj", "--multi-latent-attention")


def test_lora_targets_of_the_query_latent_follow_the_model(capsys, monkeypatch):
    mla = "--multi-latent-attention --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 8 --v-head-dim 8".split()
    argv = [*mla, "--position-embedding-type", "rope", "--disable-bias-linear", "--lora-rank", "4"]
    rc, _, err = _run([*argv, "--lora-target-modules", "q_a_proj"], capsys, monkeypatch)  # no --q-lora-rank
    _one_line_error(rc, err, "linear_q_down_proj", "no query latent")
    # PEFT's q_proj on an MLA model is its query projection(s) alone (it adapted the key/value latents too);
    # k_proj / v_proj name nothing there (v_proj adapted every projection)
    from megatron_lite.arguments import parse_args

    base = "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --train-iters 1 --mock-data"
    base = [*base.split(), "--vocab-size", "64", *argv]
    for extra, targets in (
        (["--q-lora-rank", "8"], ("linear_q_down_proj", "linear_q_up_proj")),
        ([], ("linear_q_proj",)),
    ):
        assert parse_args([*base, *extra, "--lora-target-modules", "q_proj"])[1].lora.target_modules == targets
    rc, _, err = _run([*argv, "--lora-target-modules", "v_proj"], capsys, monkeypatch)
    _one_line_error(rc, err, "a --multi-latent-attention model makes keys and values from one latent")


def test_lora_on_a_pretraining_checkpoint_resumes_exactly(tmp_path, capsys, monkeypatch):
    """LoRA adapters started on a base run's checkpoint (no --finetune: the iteration goes on) and the run resumed
    from its own save equals the uninterrupted run: the adapters' Adam step count starts at 0, not at the base
    run's (saved as adam_step, a resume's bias correction had jumped ahead of the moments)."""
    base = ["--mock-data", "--vocab-size", "100", "--lr", "1e-2"]
    lora = [*base, "--lora-rank", "4", "--train-iters", "12", "--load", str(tmp_path / "base")]
    rc, _, err = _run([*base, "--train-iters", "5", "--save", str(tmp_path / "base")], capsys, monkeypatch)
    assert rc == 0, err
    straight, resumed = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl"
    assert _run([*lora, "--log-jsonl", str(straight)], capsys, monkeypatch)[0] == 0
    own = ["--save", str(tmp_path / "lora"), "--save-interval", "7"]
    assert _run([*lora, *own, "--exit-interval", "7"], capsys, monkeypatch)[0] == 0
    meta = json.loads((tmp_path / "lora" / "iter_0000007" / "metadata.json").read_text())
    assert meta["adam_step"] == 2  # iterations 6 and 7: the adapters' own steps
    assert (
        _run([*lora, *own, "--load", str(tmp_path / "lora"), "--log-jsonl", str(resumed)], capsys, monkeypatch)[0] == 0
    )

    def losses(path):
        return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in map(json.loads, open(path)) if "lm_loss" in r}

    a, b = losses(straight), losses(resumed)
    assert sorted(b) == list(range(8, 13)) and all(a[it] == b[it] for it in b), (a, b)


def test_a_corrupted_base_is_named_as_the_lora_runs_base(tmp_path, capsys, monkeypatch):
    """A byte flipped in the base's tensors: "fails its sha256 check ... load an older checkpoint (... --ckpt-step
    N)", advice for the adapters' checkpoint, not its base, which it did not name as such."""
    data = ["--mock-data", "--vocab-size", "100"]
    base, lora = str(tmp_path / "base"), str(tmp_path / "lora")
    assert _run([*data, "--train-iters", "1", "--save", base], capsys, monkeypatch)[0] == 0
    adapt = [*data, "--lora-rank", "4", "--train-iters", "2", "--load", base, "--finetune", "--save", lora]
    assert _run(adapt, capsys, monkeypatch)[0] == 0
    tensors = next((tmp_path / "base").glob("iter_*/tensors_r00000.safetensors"))
    data_bytes = bytearray(tensors.read_bytes())
    data_bytes[-5] ^= 0xFF
    tensors.write_bytes(bytes(data_bytes))
    rc, _, err = _run(["--load", lora, "--train-iters", "3"], capsys, monkeypatch)
    _one_line_error(rc, err, f"the frozen base of the LoRA checkpoint {lora}/iter_0000002, {base}/iter_0000001, cannot")
    assert "--ckpt-step" not in err and "restore the base's files" in err, err
