#!/usr/bin/env python
"""Training-step time of megatron_lite (one process) beside a Hugging Face transformers LlamaForCausalLM
trained by torch.optim.AdamW, on the same weights and batches, in one run. Steps alternate between the two
so drift in the machine's speed hits both alike; the median of each is reported with their ratio.

    python tools/bench_train_step.py                      # small, CPU
    python tools/bench_train_step.py --device cuda --bf16 --hidden-size 2048 --num-layers 16 --seq-length 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from _world import check_device, check_heads, check_outputs, check_sizes  # tools/_world.py, beside this script

from megatron_lite.flag_parser import OneLineErrorParser


def main(argv: list[str] | None = None) -> dict:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--ffn-hidden-size", type=int)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--num-query-groups", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--kernel-impl",
        choices=["triton", "torch"],
        help="megatron_lite's kernels (default: as pretrain_gpt.py, Triton on a CUDA GPU, PyTorch on a CPU)",
    )
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    check_outputs(args)
    check_device(args.device)
    sizes = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "vocab_size", "seq_length")
    check_sizes(**{k: getattr(args, k) for k in (*sizes, "micro_batch_size", "iters")})
    check_sizes(0, warmup=args.warmup)
    if args.ffn_hidden_size is not None:
        check_sizes(ffn_hidden_size=args.ffn_hidden_size)
    check_heads(args.hidden_size, args.num_attention_heads, args.num_query_groups)

    import dataclasses

    import transformers

    from megatron_lite.arguments import resolve_kernel_impl
    from megatron_lite.config import ParallelConfig
    from megatron_lite.data.mock import MockGPTDataset, collate
    from megatron_lite.distributed.ddp import DistributedDataParallel
    from megatron_lite.models.gpt_model import GPTModel
    from megatron_lite.models.hf import config_from_hf
    from megatron_lite.models.hf_weights import state_dict_from_hf
    from megatron_lite.optimizer.config import OptimizerConfig
    from megatron_lite.optimizer.lr_scheduler import LRScheduler
    from megatron_lite.optimizer.optimizer import MixedPrecisionOptimizer
    from megatron_lite.parallel_context import ParallelContext
    from megatron_lite.training.step import train_step

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    hf_config = transformers.LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.ffn_hidden_size or int(8 * args.hidden_size / 3) // 64 * 64,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_query_groups,
        max_position_embeddings=args.seq_length,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config).to(device=device, dtype=dtype).train()
    # (what training runs with: config_from_hf leaves the PyTorch kernels)
    kernel_impl = "torch"
    if device.type == "cuda" or args.kernel_impl:  # (CPU tensors on a GPU machine: as gloo's, for the rules)
        backend = "gloo" if device.type == "cpu" else None
        kernel_impl = resolve_kernel_impl(args.kernel_impl, backend, half=args.bf16)
    config = dataclasses.replace(config_from_hf(hf_config), kernel_impl=kernel_impl)
    ctx = ParallelContext.virtual(ParallelConfig(), device=device)
    ctx.seed(0)
    ours = GPTModel(config, ctx, dtype=dtype)
    ours.load_full_state_dict(state_dict_from_hf(hf.state_dict(), config, "LlamaForCausalLM"))
    optim = OptimizerConfig(lr=1e-4, bf16=args.bf16, clip_grad=1.0)
    ddp = DistributedDataParallel(ours, ctx)
    opt = MixedPrecisionOptimizer(ours, ddp.main_grad, optim, ctx)
    sched = LRScheduler(optim, 10**9)
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, fused=device.type == "cuda")
    data = MockGPTDataset(args.vocab_size, args.seq_length, seed=0)
    batches = [
        collate([data[i * args.micro_batch_size + j] for j in range(args.micro_batch_size)], device)
        for i in range(args.warmup + args.iters)
    ]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    losses = {"megatron_lite": [], "transformers": []}

    def step_ours(batch):
        losses["megatron_lite"].append(train_step(ddp, opt, sched, [batch], ctx).lm_loss)

    def step_hf(batch):
        hf_opt.zero_grad(set_to_none=True)
        logits = hf(batch["tokens"]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab_size), batch["labels"].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        hf_opt.step()
        losses["transformers"].append(loss.item())

    times = {"megatron_lite": [], "transformers": []}
    for i, batch in enumerate(batches):
        for name, fn in (("megatron_lite", step_ours), ("transformers", step_hf)):
            sync()
            t0 = time.perf_counter()
            fn(batch)
            sync()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    # the same work: the first step's loss (same weights, same batch) agrees before any time is reported
    first = {k: v[0] for k, v in losses.items()}
    tol = 2e-2 if args.bf16 else 1e-4
    if abs(first["megatron_lite"] - first["transformers"]) > tol * abs(first["transformers"]):
        raise SystemExit(f"the first step's losses differ: {first}; the two sides do not run the same model")
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = args.micro_batch_size * args.seq_length
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "kernel_impl": kernel_impl,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "step_time_s": med,
        "first_step_loss": first,
        "tokens_per_s": {k: tokens / v for k, v in med.items()},
        "ratio_transformers_over_megatron_lite": med["transformers"] / med["megatron_lite"],
    }
    print(f"{'':16}{'step time (ms)':>16}{'tokens/s':>12}")
    for k in times:
        print(f"{k:16}{med[k] * 1e3:>16.1f}{tokens / med[k]:>12.0f}")
    print(
        f"speed-up of megatron_lite over transformers: {result['ratio_transformers_over_megatron_lite']:.2f}x "
        f"({result['device']}, {result['dtype']}, megatron_lite's {kernel_impl} kernels, {args.iters} timed steps "
        "each, medians)"
        + (
            "; transformers' AdamW steps its bf16 weights directly, ours fp32 main weights (Megatron's --bf16): "
            "more work on our side"
            if args.bf16
            else ""
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
