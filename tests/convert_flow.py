"""The flow every Hugging Face converter test walks, written once: a transformers model with every weight random,
converted to our checkpoint (our logits equal transformers'), exported back (bit-exact, loading as the same class
with the same config fields and logits), and split over TP=2 (logits and greedy generation with our KV cache)."""

from __future__ import annotations

import torch
import transformers
from test_convert import PROMPT, V, _hf_greedy, _hf_logits, _load_ours, _rel, _tensors, convert, ours_at

from megatron_lite.config import ParallelConfig

IDS = [(7 * i + 3) % V for i in range(16)]


def randomised(model: torch.nn.Module, big: tuple[str, ...] = (), buffers: bool = False) -> torch.nn.Module:
    """`model` with every weight drawn again (transformers starts routers, biases and some gates at zeros, which
    would hide a weight mapped to the wrong place): norms 1 + 0.08 noise, names ending in `big` 0.5 noise (routers,
    so that routing differs between experts), the rest 0.08; `buffers` too (a router's score-correction bias)."""
    torch.manual_seed(0)
    named = [*model.named_parameters(), *(model.named_buffers() if buffers else ())]
    with torch.no_grad():
        for name, p in named:
            if "rotary_emb" in name:
                continue
            scale = 0.5 if name.endswith(big) else 0.08
            p.copy_(torch.randn_like(p) * scale + (1.0 if name.endswith("norm.weight") else 0.0))
    return model.eval()


def converts_both_ways(model, tmp_path, fields: tuple[str, ...] = (), ids: list[int] = IDS):
    """HF -> ours -> HF: our logits within 1e-5 of transformers', the export bit-exact with the same `fields` and
    the same logits. Returns (our config, the reloaded transformers model)."""
    hf_dir, ours, back = (str(tmp_path / k) for k in ("hf", "ours", "back"))
    model.save_pretrained(hf_dir)
    assert convert.main(["--loader", "hf", "--saver", "megatron_lite", "--load-dir", hf_dir, "--save-dir", ours]) == 0
    ref = _hf_logits(model, ids)
    ours_model, _, config = _load_ours(ours, ParallelConfig())
    with torch.no_grad():
        logits = ours_model(torch.tensor([ids]))[0].float()  # [batch, seq, vocab (padded)]
    assert _rel(logits[..., :V], ref) <= 1e-5, _rel(logits[..., :V], ref)

    assert convert.main(["--loader", "megatron_lite", "--saver", "hf", "--load-dir", ours, "--save-dir", back]) == 0
    a, b = _tensors(hf_dir), _tensors(back)
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:4]
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:4]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    assert type(reloaded) is type(model)
    for field in fields:
        assert getattr(reloaded.config, field) == getattr(model.config, field), field
    assert torch.equal(_hf_logits(reloaded, ids), ref)
    return config, reloaded


def tp2_equals_transformers(dist, model, tmp_path, ids: list[int] = IDS) -> None:
    """The converted model split over TP=2 (in the pool's two-process world): transformers' logits within 1e-5,
    and its greedy continuation of PROMPT through our KV cache."""
    hf_dir, ours = str(tmp_path / "hf"), str(tmp_path / "ours")
    model.save_pretrained(hf_dir)
    assert convert.main(["--loader", "hf", "--saver", "megatron_lite", "--load-dir", hf_dir, "--save-dir", ours]) == 0
    ref, greedy = _hf_logits(model, ids), _hf_greedy(model, PROMPT)
    results = dist(2, ours_at, ours, ParallelConfig(tensor_model_parallel_size=2), ids)
    for logits, generated in results:
        assert _rel(logits, ref) <= 1e-5, _rel(logits, ref)
        assert generated == greedy
    assert len(results) == 2
