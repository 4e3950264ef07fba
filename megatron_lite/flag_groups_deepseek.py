"""DeepSeek's flag groups (multi-latent attention, multi-token prediction), Megatron-LM's names and defaults;
flag_parser.build_parser adds them where they stand in `--help`."""

from __future__ import annotations

import argparse

from megatron_lite.flag_parser import _bool


def add_deepseek_groups(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument_group("multi-latent attention (DeepSeek-V2/V3)")
    _bool(a, "--multi-latent-attention", "queries, keys and values from low-rank latents, RoPE on separate dims")
    a.add_argument("--q-lora-rank", type=int, help="rank of the query latent (default: no query latent)")
    a.add_argument("--kv-lora-rank", type=int, default=32, help="rank of the key/value latent")
    a.add_argument("--qk-head-dim", type=int, default=128, help="query/key dims per head without RoPE")
    a.add_argument("--qk-pos-emb-head-dim", type=int, default=64, help="query/key dims per head with RoPE")
    a.add_argument("--v-head-dim", type=int, default=128, help="value dims per head")
    a.add_argument(
        "--rope-type",
        choices=["rope", "yarn"],
        help="RoPE kind; as in Megatron, multi-latent attention takes yarn by default (plain RoPE while "
        "--rotary-scaling-factor is 1), other attention rope",
    )
    a.add_argument("--rotary-scaling-factor", type=float, default=1.0, help="YaRN's factor (multi-latent attention)")
    a.add_argument("--mscale", type=float, default=1.0, help="YaRN's mscale of cos / sin (multi-latent attention)")
    a.add_argument(
        "--mscale-all-dim",
        type=float,
        default=0.0,
        help="YaRN's mscale_all_dim: cos / sin divided by, and the softmax scale times the square of, its mscale",
    )
    t = parser.add_argument_group("multi-token prediction (DeepSeek-V3)")
    t.add_argument(
        "--mtp-num-layers",
        type=int,
        help="prediction depths after the last layer, each one transformer layer predicting one token further",
    )
    t.add_argument(
        "--mtp-loss-scaling-factor",
        type=float,
        default=0.1,
        help="weight of the MTP loss (averaged over depths) in the training loss",
    )
