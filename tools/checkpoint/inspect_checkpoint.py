#!/usr/bin/env python
"""Print what a megatron_lite checkpoint holds: iteration, the layout that saved it, the model config,
every tensor (full shape, dtype, pieces) and the total size. Reads JSON only, never tensor data, unless
--verify is given (then every file's checksum is checked too).

    python tools/checkpoint/inspect_checkpoint.py ckpt            # the newest checkpoint under ckpt
    python tools/checkpoint/inspect_checkpoint.py ckpt/iter_0000100 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_lite.checkpoint.checkpointing import find_checkpoint, read_metadata
from megatron_lite.checkpoint.reader import Reader
from megatron_lite.checkpoint_flags import SHARDING
from megatron_lite.config import ConfigError
from megatron_lite.flag_parser import OneLineErrorParser


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def describe(path: str, verify: bool = False) -> dict:
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        found = find_checkpoint(path, flag="checkpoint")
        if found is None:
            raise ConfigError(f"{path} holds no megatron_lite checkpoint")
        path = found
    meta = read_metadata(path)
    reader = Reader(path, meta)  # checks every index file against metadata.json
    if verify:
        for fname in reader.files:
            reader.verify(fname)
    tensors = {}
    for name, rec in sorted(reader.index.items()):
        tensors[name] = {"shape": rec["shape"], "dtype": rec["dtype"], "pieces": len(rec["pieces"])}
        # (elements the pieces hold: fewer than the full shape's where this is a rank's part, as a local
        # non-persistent checkpoint is; it printed full shapes and parameters, as if whole)
        held = sum(_numel(pc["box"][1]) for pc in rec["pieces"])
        if held < _numel(rec["shape"]):
            tensors[name]["held"] = held
    model = meta["config"].get("model", {})
    training, optim, data = (meta["config"].get(k) or {} for k in ("training", "optimizer", "data"))
    return {
        "path": path,
        "iteration": meta["iteration"],
        "consumed_samples": meta["consumed_samples"],
        "layout": meta["layout"],
        "parallel": meta["config"].get("parallel", {}),
        "sharding": {k: v for k, v in meta["config"].get("optimizer", {}).items() if k in SHARDING},
        "model": model,
        "lora": meta["config"].get("lora"),
        "training": {k: training.get(k) for k in TRAINING_KEYS if training.get(k) is not None},
        "optimizer": {k: optim.get(k) for k in OPTIMIZER_KEYS if optim.get(k) not in (None, False)},
        "data": {k: data.get(k) for k in DATA_KEYS if data.get(k)},
        "converted_from": meta.get("converted_from"),
        "origin": meta["config"].get("origin"),  # (a checkpoint trained from a converted one: checkpoint/origin.py)
        "tensors": tensors,
        "kinds": sorted({n.split("/")[0] for n in tensors}),
        "parameters": sum(_numel(t["shape"]) for n, t in tensors.items() if n.startswith("model/")),
        # (format-1 checkpoints record no digests or sizes: their files are measured)
        "total_bytes": sum(f.get("bytes") or os.path.getsize(os.path.join(path, n)) for n, f in reader.files.items()),
        "files": len(reader.files),
        "verified": verify and reader.checksummed,  # (format 1 recorded none)
        "local": bool(meta.get("local")),  # (one rank's own files of a local non-persistent checkpoint)
        "partial": sorted(n for n, t in tensors.items() if "held" in t),
    }


# What a run was trained with, as Megatron users look for it (the whole config is in metadata.json)
TRAINING_KEYS = ("seq_length", "micro_batch_size", "global_batch_size", "train_iters", "train_samples", "seed")
OPTIMIZER_KEYS = ("optimizer", "lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "weight_decay", "clip_grad",
                  "bf16", "fp16")  # fmt: skip
DATA_KEYS = ("data_path", "train_data_path", "tokenizer_type", "tokenizer_model", "sft")
# The layout's sizes a user gives (the saved layout also holds the derived groups: dp_cp, mp, emp, ...)
LAYOUT_KEYS = {"tp": "TP", "pp": "PP", "dp": "DP", "cp": "CP", "ep": "EP", "etp": "expert-TP"}


def _flags(d: dict) -> str:
    """Settings as the flags that give them: --seq-length 4096, --bf16, --data-path a b."""
    out = []
    for k, v in d.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif isinstance(v, list | tuple):
            out.append(f"{flag} {' '.join(map(str, v))}")
        else:
            out.append(f"{flag} {v}")
    return " ".join(out)


def _features(m: dict, lora: dict | None) -> list[str]:
    """The architecture's parts beyond the dense basics, one line each (those the model has)."""
    out = []
    if m.get("multi_latent_attention"):
        q = f"q_lora_rank={m.get('q_lora_rank')}, " if m.get("q_lora_rank") else ""
        out.append(f"MLA: {q}kv_lora_rank={m.get('kv_lora_rank')}, qk_head_dim={m.get('qk_head_dim')}, "
                   f"qk_pos_emb_head_dim={m.get('qk_pos_emb_head_dim')}, v_head_dim={m.get('v_head_dim')}")  # fmt: skip
    if m.get("num_experts"):
        freq = m.get("moe_layer_freq", 1)
        shared = m.get("moe_shared_expert_intermediate_size")
        out.append(
            f"MoE: top-{m.get('moe_router_topk')} of {m['num_experts']}, moe_ffn_hidden_size="
            f"{m.get('moe_ffn_hidden_size') or m.get('ffn_hidden_size')}, moe_layer_freq "
            + (str(freq) if isinstance(freq, int) else f"[{','.join(map(str, freq))}]")
            + (f", shared expert {shared}" if shared else "")
            + f", {m.get('moe_router_score_function', 'softmax')} router"
            + (", expert bias" if m.get("moe_router_enable_expert_bias") else "")
        )
    if m.get("hybrid_override_pattern"):
        out.append(f"hybrid: layer pattern {m['hybrid_override_pattern']} (M Mamba-2, * attention, - MLP, E MoE)")
    if m.get("heterogeneous_layers_config_encoded_json"):
        out.append("heterogeneous layers: each layer's own sizes (its block_configs, in --json's model)")
    if m.get("fp8"):
        history = f", amax history {m.get('fp8_amax_history_len')}" if m.get("fp8_recipe") == "delayed" else ""
        out.append(f"fp8: {m['fp8']}, recipe {m.get('fp8_recipe')}{history}")
    if m.get("mtp_num_layers"):
        out.append(f"MTP: {m['mtp_num_layers']} layer(s), loss scale {m.get('mtp_loss_scaling_factor')}")
    if m.get("rope_scaling"):
        rs = m["rope_scaling"]
        out.append(f"RoPE scaling: {rs.get('rope_type', 'llama3')} x{rs.get('factor')}")
    if lora:
        kind = "QLoRA" if lora.get("qlora") else "LoRA"
        base = f"; adapters only, on the base {lora['base']}" if lora.get("base") else ""
        out.append(f"{kind}: rank {lora['rank']}, alpha {lora['alpha']:g} on {' '.join(lora['target_modules'])}{base}")
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def main(argv: list[str] | None = None) -> int:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a --save directory, or one iter_NNNNNNN directory in it")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.add_argument("--verify", action="store_true", help="also check every file's size and sha256")
    args = p.parse_args(argv)
    try:
        d = describe(args.path, args.verify)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(d, indent=1))
        return 0
    layout = d["layout"]
    # (the expert sizes only where there are experts: a dense model at TP=2 showed "expert-TP=2", the default
    # expert TP being TP; expert-TP also only where it differs from 1)
    experts = bool(d["model"].get("num_experts"))
    shown = {k: n for k, n in LAYOUT_KEYS.items() if experts or k not in ("ep", "etp")}
    sizes = [f"{name}={layout[k]}" for k, name in shown.items() if k in layout and (k != "etp" or layout[k] > 1)]
    lay = f"{layout.get('world_size', 1)} process(es)" + (": " + ", ".join(sizes) if sizes else "")
    vp, sh = d["parallel"].get("virtual_pipeline_model_parallel_size"), d["sharding"]
    lay += f", virtual stages={vp}" if vp else ""
    if sh.get("use_torch_fsdp2"):
        lay += ", FSDP2"
    elif sh.get("use_distributed_optimizer"):
        lay += f", distributed optimizer (ZeRO-{sh.get('zero_stage', 1)})"
    m = d["model"]
    print(f"checkpoint   {d['path']}")
    print(f"iteration    {d['iteration']} ({d['consumed_samples']} samples consumed)")
    print(f"saved under  {lay}")
    src = d["converted_from"]
    if src:
        print(f"converted    from {src.get('hf', '?')} at {src.get('path', '?')}" if isinstance(src, dict) else
              f"converted    from {src}")  # fmt: skip
    if (o := d["origin"]) and o.get("walk_from"):
        print(f"origin       not known yet (saved before the record; looked for again from {o['walk_from']})")
    elif o:
        kept = "the weights as converted" if o.get("converted_weights") else "weights trained since the conversion"
        print(f"origin       {o.get('converted_from')} (hf/ files {o.get('hf_dir')}; {kept})")
    # (a conversion trained nothing: its training and optimizer values are placeholders, shown as a run's settings)
    for label, key in (("training", "training"), ("optimizer", "optimizer"), ("data", "data")):
        if d[key] and not (src and key != "data"):
            print(f"{label:<13}{_flags(d[key])}")
    if src:
        print("training     none: converted weights (a run's flags set its training and optimizer)")
    arch = ", ".join(
        f"{k}={m[k]}"
        for k in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "ffn_hidden_size",
            "vocab_size",
            "normalization",
            "activation",
            "position_embedding_type",
            "num_experts",
            "sliding_window",
        )
        if m.get(k) is not None
    )
    print(f"model        {arch}")
    for line in _features(m, d["lora"]):
        print(f"             {line}")
    print(f"state        {', '.join(d['kinds'])}; {d['parameters'] / 1e6:.2f}M parameters")
    if d["partial"]:
        whose = (
            "one rank's part of a local non-persistent checkpoint, which only its own job's layout loads (each "
            "rank from its --non-persistent-local-ckpt-dir)"
            if d["local"]
            else "its pieces do not cover them: files are missing"
        )
        print(f"partial      {len(d['partial'])} of {len(d['tensors'])} tensors held in part: {whose}")
    verified = " (checksums verified)" if d["verified"] else ""
    if args.verify and not d["verified"]:
        verified = " (a format-1 checkpoint: it records no checksums to verify)"
    files = f"{d['files']} file" + ("s" if d["files"] != 1 else "")
    print(f"size         {_human(d['total_bytes'])} in {files}{verified}")
    print("tensors:")
    width = max((len(n) for n in d["tensors"]), default=0)
    for name, t in d["tensors"].items():
        part = f" ({t['held'] / _numel(t['shape']):.0%} held)" if "held" in t else ""
        print(f"  {name:<{width}}  {str(t['shape']):<16} {t['dtype']:<9} {t['pieces']} piece(s){part}")
    return 0


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # (`inspect_checkpoint.py CKPT | head`: the reader went away, nothing went wrong)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)
