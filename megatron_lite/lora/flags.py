"""The LoRA fine-tuning flags; flag_parser.build_parser adds the group where it stands in `--help`."""

from __future__ import annotations

import argparse

from megatron_lite.flag_parser import _bool


def add_lora_group(parser: argparse.ArgumentParser) -> None:
    lo = parser.add_argument_group("LoRA fine-tuning")
    lo.add_argument("--lora-rank", type=int, default=0, help="train rank-r adapters on a frozen base (0: off)")
    lo.add_argument("--lora-alpha", type=float, default=16.0, help="adapters scaled by alpha / rank")
    lo.add_argument("--lora-dropout", type=float, default=0.0)
    lo.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        help="our layer names or PEFT's (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj), each projection "
        "adapted alone (q_proj v_proj: not k); add experts for every routed expert's fc1 and fc2 (PEFT's "
        "experts.gate_up_proj and experts.down_proj), experts_fc1 (PEFT's gate_up_proj) or experts_fc2 for one",
    )
    _bool(lo, "--qlora", "store the adapted layers' frozen weights in NF4 (4.127 bits per parameter)")
