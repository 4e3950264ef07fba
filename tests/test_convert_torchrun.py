"""A converted Hugging Face checkpoint in multi-rank jobs: tools/generate.py under torchrun at TP=2 x PP=2 (and its
start-up error said once per node), pretraining at TP=2 like one process. (Moved from tests/test_convert.py, over
600 lines; its `converted` fixture is shared from there.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_convert import NEW, PROMPT, ROOT, _hf_greedy
from test_convert import converted as converted  # noqa: F401  (the fixture, by its name)


def _torchrun(nproc: int, script: str, args: list[str], cwd) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    out = subprocess.run([*cmd, str(ROOT / script), *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_generate_under_torchrun_tp2_pp2(converted, tmp_path):
    model, _, ours, _ = converted["llama"]
    out = tmp_path / "gen.json"
    args = ["--load", ours, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(NEW), "--greedy"]
    args += ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--output-json", str(out)]
    _torchrun(4, "tools/generate.py", [*args, "--distributed-backend", "gloo"], tmp_path)
    # a start-up error is said once per node (it was said by every rank), as pretrain_gpt.py says it
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    bad = [str(ROOT / "tools/generate.py"), "--load", ours, "--prompt-ids", "1,2", "--max-new-tokens", "-1"]
    res = subprocess.run([*cmd, *bad], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    # (the workers' lines; torchrun's summary shows it once more, as its root cause)
    said = [x for x in (res.stdout + res.stderr).splitlines() if x.startswith("error") and "--max-new-tokens -1" in x]
    assert res.returncode != 0 and said == ["error: --max-new-tokens -1 must be >= 0 (0 scores the prompt)"], (
        res.stderr[-2000:]
    )
    assert json.loads(out.read_text())["generated_ids"] == _hf_greedy(model, PROMPT)


@pytest.mark.slow
def test_converted_checkpoint_trains_at_tp2_like_one_process(converted, tmp_path, pretrain_job):
    """pretrain_gpt.py --load <converted> at TP=2 with sequence parallelism: the same per-iteration lm_loss
    and grad_norm as on one process."""
    _, _, ours, _ = converted["llama"]
    base = ["--load", ours, "--mock-data", "--vocab-size", "100", "--train-iters", "3", "--seq-length", "16"]
    base += ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--log-interval", "1"]
    base += ["--eval-iters", "0", "--distributed-backend", "gloo"]
    curves = {}
    for name, n, extra in (("one", 1, []), ("tp2", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])):
        jsonl = tmp_path / f"{name}.jsonl"
        pretrain_job(n, [*base, *extra, "--log-jsonl", str(jsonl)])
        recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
        curves[name] = [(r["lm_loss"], r["grad_norm"]) for r in recs if "grad_norm" in r]
    assert len(curves["one"]) == 3
    for (loss, norm), (rloss, rnorm) in zip(curves["tp2"], curves["one"]):
        assert abs(loss - rloss) <= 1e-5 * abs(rloss) and abs(norm - rnorm) <= 1e-5 * abs(rnorm)
