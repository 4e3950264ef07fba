#!/usr/bin/env python
"""Decoding speed and KV-cache size of megatron_lite beside Hugging Face transformers, on the same weights, in one
run: a prompt of --context tokens is run once, then --steps tokens are decoded one at a time (greedy) by each,
steps alternating between the two so drift in the machine's speed hits both alike; the median step is reported
with the ratio, and each side's cache in bytes. --model deepseek_v3: multi-latent attention, both caching the
latents (ours attends to them with the up-projections absorbed; transformers 5 expands every head's keys and values
from them at each step); llama: grouped-query attention.

    python tools/bench_decode.py                                   # DeepSeek-V3-shaped attention, CPU
    python tools/bench_decode.py --model llama --context 4096 --device cuda --bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import warnings

import torch
from _world import check_device, check_heads, check_outputs, check_sizes  # tools/_world.py, beside this script

from megatron_lite.flag_parser import OneLineErrorParser


def _hf_config(args):
    import transformers

    common = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads,
        max_position_embeddings=args.context + args.steps + 1,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    if args.model == "llama":
        return transformers.LlamaConfig(num_key_value_heads=args.num_query_groups, **common), "LlamaForCausalLM"
    mla = dict(
        q_lora_rank=args.kv_lora_rank * 3 // 4,
        kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    )  # fmt: skip  (DeepSeek-V3's head sizes)
    # every layer dense (first_k_dense_replace): the attention is what differs
    dense = dict(first_k_dense_replace=args.num_layers, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
                 topk_group=1, moe_intermediate_size=64)  # fmt: skip
    config = transformers.DeepseekV3Config(num_key_value_heads=args.num_attention_heads, **mla, **dense, **common)
    return config, "DeepseekV3ForCausalLM"


def main(argv: list[str] | None = None) -> dict:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["deepseek_v3", "llama"], default="deepseek_v3")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--num-query-groups", type=int, default=4, help="llama: key/value heads")
    p.add_argument("--kv-lora-rank", type=int, default=512, help="deepseek_v3: the cached latent's size")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--context", type=int, default=2048, help="prompt tokens in the cache before the timed steps")
    p.add_argument("--steps", type=int, default=10, help="timed decoding steps (after 2 untimed)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    check_outputs(args)
    check_device(args.device)
    sizes = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_lora_rank", "vocab_size")
    check_sizes(**{k: getattr(args, k) for k in (*sizes, "context", "steps")})
    if args.model == "llama":  # (DeepSeek-V3's heads have their own sizes)
        check_heads(args.hidden_size, args.num_attention_heads, args.num_query_groups)

    import transformers

    warnings.filterwarnings("ignore", message=".*past_key_values.*")  # (renamed `cache` in newer transformers)
    transformers.logging.set_verbosity_error()
    from megatron_lite.config import ParallelConfig
    from megatron_lite.inference.generation import _forward_batch
    from megatron_lite.inference.kv_cache import KVCache
    from megatron_lite.models.gpt_model import GPTModel
    from megatron_lite.models.hf import config_from_hf
    from megatron_lite.models.hf_weights import state_dict_from_hf
    from megatron_lite.parallel_context import ParallelContext

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    hf_config, arch = _hf_config(args)
    torch.manual_seed(0)
    hf = getattr(transformers, arch)(hf_config).to(device=device, dtype=dtype).eval()
    config = dataclasses.replace(config_from_hf(hf_config), kernel_impl="torch")  # (the decoding paths compared)
    ctx = ParallelContext.virtual(ParallelConfig(), device=device)
    ours = GPTModel(config, ctx, dtype=dtype).eval()
    ours.load_full_state_dict(state_dict_from_hf(hf.state_dict(), config, arch))
    prompt = torch.randint(0, args.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    warm, n = 2, args.steps + 2
    with torch.no_grad():
        cache = KVCache(args.context + n)
        ours_next = _forward_batch([ours], ctx, prompt, cache)[:, -1].argmax(-1, keepdim=True)
        out = hf(prompt, use_cache=True)
        past, hf_next = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        times = {"megatron_lite": [], "transformers": []}
        tokens = {"megatron_lite": [], "transformers": []}
        for i in range(n):
            sync()
            t0 = time.perf_counter()
            ours_next = _forward_batch([ours], ctx, ours_next, cache)[:, -1].argmax(-1, keepdim=True)
            sync()
            t1 = time.perf_counter()
            out = hf(hf_next, past_key_values=past, use_cache=True)
            past, hf_next = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            sync()
            t2 = time.perf_counter()
            if i >= warm:
                times["megatron_lite"].append(t1 - t0)
                times["transformers"].append(t2 - t1)
            tokens["megatron_lite"].append(int(ours_next))
            tokens["transformers"].append(int(hf_next))
    ours_bytes = sum(t.numel() * t.element_size() for kv in cache._store.values() for t in kv)
    # (transformers 4.56 on: the cache's layers; before, its key_cache and value_cache lists)
    pairs = (
        [(x.keys, x.values) for x in past.layers] if hasattr(past, "layers") else zip(past.key_cache, past.value_cache)
    )
    hf_bytes = sum(t.numel() * t.element_size() for pair in pairs for t in pair if t is not None)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "step_time_s": med,
        "kv_cache_bytes": {"megatron_lite": ours_bytes, "transformers": hf_bytes},
        "ratio_transformers_over_megatron_lite": med["transformers"] / med["megatron_lite"],
        "same_greedy_tokens": tokens["megatron_lite"] == tokens["transformers"],
    }
    print(f"{'':16}{'step (ms)':>12}{'KV cache (MiB)':>16}")
    for k in times:
        print(f"{k:16}{med[k] * 1e3:>12.2f}{result['kv_cache_bytes'][k] / 2**20:>16.2f}")
    print(
        f"speed-up of megatron_lite over transformers per decoding step: "
        f"{result['ratio_transformers_over_megatron_lite']:.2f}x at {args.context} cached tokens ({args.model}, "
        f"{result['device']}, {result['dtype']}, {args.steps} timed steps each, medians); same greedy tokens: "
        f"{result['same_greedy_tokens']}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
