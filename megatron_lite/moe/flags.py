"""The mixture-of-experts flags (Megatron's names and defaults), one group of flag_parser.py's parser."""

from __future__ import annotations

import argparse


def _num_experts(text: str) -> int | None:
    """Megatron's validate_args reads --num-experts 0 as a dense model (scripts pass ${NUM_EXPERTS}); it was
    refused here as below 1."""
    n = int(text)
    return None if n == 0 else n


_num_experts.__name__ = "int"  # (argparse names the type in its error: "invalid int value")


def add_moe_flags(parser: argparse.ArgumentParser) -> None:
    e = parser.add_argument_group("mixture of experts")
    e.add_argument("--num-experts", type=_num_experts)
    e.add_argument("--moe-router-topk", type=int, default=2)
    e.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default="softmax")
    e.add_argument("--moe-router-pre-softmax", action="store_true", help="softmax over all experts before top-k")
    e.add_argument(
        "--moe-router-num-groups",
        type=int,
        default=None,
        help="group-limited routing: experts in this many equal groups (DeepSeek-V3: one per node)",
    )
    e.add_argument(
        "--moe-router-group-topk", type=int, default=None, help="group-limited routing: groups a token may use"
    )
    e.add_argument(
        "--moe-router-group-score-topn",
        type=int,
        default=None,
        help="group-limited routing: a group's score is the sum of its top N expert scores (default: Megatron's "
        "top-k // group-topk; converted DeepSeek checkpoints carry their own: V3 2, V2 1)",
    )
    e.add_argument(
        "--moe-router-dtype",
        default="fp32",
        choices=["fp32", "fp64"],
        help="precision of the routing computation (logits, softmax or sigmoid, top-k, auxiliary losses); never "
        "below fp32 (Megatron's default routes in the model's dtype)",
    )
    e.add_argument(
        "--moe-router-topk-scaling-factor",
        type=float,
        default=None,
        help="multiply the selected experts' routing weights by this (DeepSeek-V3: 2.5)",
    )
    e.add_argument("--moe-ffn-hidden-size", type=int)
    e.add_argument(
        "--moe-router-load-balancing-type",
        choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"],
        nargs="+",
        default="aux_loss",
        help="one type (Megatron's list form is taken with one value)",
    )
    e.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0, help="the balancing type's coefficient")
    e.add_argument("--moe-z-loss-coeff", type=float)
    e.add_argument(
        "--moe-router-enable-expert-bias", action="store_true", help="aux-loss-free balancing (needs sigmoid scores)"
    )
    e.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    e.add_argument("--moe-expert-capacity-factor", type=float,
                   help="dropless when unset or negative; counted over the TP group's whole sequence")  # fmt: skip
    e.add_argument("--moe-token-drop-policy", choices=["probs", "position"], default="probs")
    e.add_argument(
        "--moe-pad-expert-input-to-capacity",
        action="store_true",
        help="pad each expert's input with zero rows to its capacity (needs --moe-expert-capacity-factor; the "
        "padding's outputs are dropped)",
    )
    e.add_argument(
        "--moe-input-jitter-eps",
        type=float,
        default=None,
        help="in training, multiply the router's input by noise uniform in [1 - eps, 1 + eps] (Switch Transformer)",
    )
    e.add_argument(
        "--moe-router-force-load-balancing",
        action="store_true",
        help="random normal router logits, for benchmarking balanced load (the gradient passes straight through)",
    )
    e.add_argument(
        "--moe-apply-probs-on-input",
        action="store_true",
        help="the routing weight multiplies the expert's input instead of its output (needs --moe-router-topk 1)",
    )
    e.add_argument("--moe-layer-freq", default="1", help="N (every Nth layer) or a 0/1 list, e.g. 0,1,1,1")
    e.add_argument("--moe-shared-expert-intermediate-size", type=int)
    e.add_argument(
        "--moe-shared-expert-gate",
        action="store_true",
        help="scale the shared expert's output by sigmoid(x . w), w a learned [1, hidden] weight (Qwen2-MoE)",
    )
    e.add_argument(
        "--moe-token-dispatcher-type",
        choices=["alltoall", "allgather", "flex"],
        default="alltoall",
        help="alltoall or allgather over EP (default alltoall; flex, DeepEP's, is refused)",
    )
    e.add_argument(
        "--moe-use-upcycling",
        action="store_true",
        help="start this MoE run from the dense checkpoint in --load: its MLPs copied into the experts, saved to "
        "--save as iteration 1 (Megatron's; later runs drop the flag and resume from --save)",
    )
    e.add_argument(
        "--moe-upcycling-granularity",
        type=int,
        default=1,
        help="with --moe-use-upcycling: each dense MLP is cut into this many experts' worth of hidden units (the "
        "dense --ffn-hidden-size is --moe-ffn-hidden-size times this)",
    )
