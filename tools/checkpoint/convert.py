#!/usr/bin/env python
"""Convert checkpoints between Hugging Face and megatron_lite, exactly, in either direction.

    python tools/checkpoint/convert.py --loader hf --saver megatron_lite --load-dir Llama-3-8B --save-dir ckpt
    python tools/checkpoint/convert.py --loader megatron_lite --saver hf --load-dir ckpt --save-dir out_hf
    python tools/checkpoint/convert.py --loader megatron_lite --saver hf-peft --load-dir lora_ckpt --save-dir adapter
    python tools/checkpoint/convert.py --loader megatron_lite --saver hf --merge-lora --load-dir lora_ckpt \\
        --save-dir merged

{architectures}
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from megatron_lite.checkpoint.hf_convert import hf_to_megatron_lite, megatron_lite_to_hf, megatron_lite_to_peft
from megatron_lite.config import ConfigError
from megatron_lite.flag_parser import OneLineErrorParser

# Megatron-LM's loader/saver names, and what to give here instead
_MEGATRON_FORMAT = (
    "Megatron-LM's checkpoint format; megatron_lite's is megatron_lite (it does not convert Megatron-LM's)"
)
_MEGATRON_SIDES = {
    "llama_mistral": "Megatron-LM's loader of Hugging Face Llama/Mistral weights; here: --loader hf",
    "mixtral_hf": "Megatron-LM's loader of Hugging Face Mixtral weights; here: --loader hf",
    **dict.fromkeys(("core", "mcore", "megatron", "legacy"), _MEGATRON_FORMAT),
}
# Megatron-LM's convert.py flags that do nothing here: (value type, why), said in --help and as a note when given
_ANY_LAYOUT = "a megatron_lite checkpoint loads under any layout; give the layout to pretrain_gpt.py"
_NO_EFFECT = {
    "--target-tensor-parallel-size": (int, _ANY_LAYOUT),
    "--target-pipeline-parallel-size": (int, _ANY_LAYOUT),
    "--target-expert-parallel-size": (int, _ANY_LAYOUT),
    "--max-queue-size": (int, "no loader/saver processes here"),
    "--no-checking": (bool, "every tensor is checked"),
    "--megatron-path": (str, "not needed"),
    "--model-size": (str, "the size comes from config.json"),
    "--tokenizer-model": (str, "the tokenizer files beside the weights are copied"),
}


def _side(choices: tuple[str, ...]):
    def parse(value: str) -> str:
        if value in choices:
            return value
        why = f" ({_MEGATRON_SIDES[value]})" if value in _MEGATRON_SIDES else ""
        raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(choices)}{why}")

    return parse


def main(argv: list[str] | None = None) -> int:
    from megatron_lite.models.hf import LLAMA_LIKE

    # (the converter's own list: it cannot drift from what converts)
    architectures = textwrap.fill(
        f"Supported Hugging Face architectures: {', '.join((*LLAMA_LIKE, 'DeciLMForCausalLM', 'GPT2LMHeadModel'))}. "
        "A megatron_lite checkpoint saved under any layout converts as is; one converted from Hugging Face loads "
        "under any layout (`pretrain_gpt.py --load ckpt`).",
        width=110,
    )
    p = OneLineErrorParser(
        description=__doc__.replace("{architectures}", architectures),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--loader", type=_side(("hf", "megatron_lite")), required=True, help="hf, megatron_lite")
    p.add_argument(
        "--saver",
        type=_side(("hf", "hf-peft", "megatron_lite")),
        required=True,
        help="hf, hf-peft, megatron_lite",
    )
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument(
        "--target-dtype",
        choices=["fp32", "bf16", "fp16"],
        help="dtype of the Hugging Face weights (or --saver hf-peft's adapter tensors) written (default: as stored)",
    )
    p.add_argument("--merge-lora", action="store_true", help="--saver hf: fold LoRA adapters into the weights")
    p.add_argument(
        "--base-model-name-or-path",
        help="--saver hf-peft: the adapter's base model for AutoPeftModelForCausalLM, e.g. a hub name (default: the "
        "Hugging Face directory the base checkpoint was converted from, when it still exists)",
    )
    # Megatron-LM's convert.py flags, so its command lines port: GPT is the one model type, and the others do
    # nothing here (said once each)
    m = p.add_argument_group("Megatron-LM's convert.py flags (accepted; see the notes they print)")
    m.add_argument("--model-type", choices=["GPT"], default="GPT", help="GPT (the one kind converted)")
    m.add_argument("--checkpoint-type", choices=["hf"], help="--loader hf reads Hugging Face checkpoints")
    for flag, (kind, why) in _NO_EFFECT.items():
        given = {"action": "store_true"} if kind is bool else {"type": kind}
        m.add_argument(flag, help=f"no effect: {why}", **given)
    args = p.parse_args(argv)
    for flag, (_, why) in _NO_EFFECT.items():
        if getattr(args, flag[2:].replace("-", "_")) not in (None, False):
            print(f"note: {flag} has no effect here: {why}")
    try:
        if args.base_model_name_or_path and args.saver != "hf-peft":
            raise ConfigError(
                f"--base-model-name-or-path names a PEFT adapter's base: --saver hf-peft, not {args.saver}"
            )
        if args.loader == args.saver:
            raise ConfigError(f"--loader and --saver are both {args.loader}; nothing to convert")
        if args.merge_lora and (args.loader, args.saver) != ("megatron_lite", "hf"):
            raise ConfigError(
                f"--merge-lora folds LoRA adapters into the weights --saver hf writes, not --loader {args.loader} "
                f"--saver {args.saver}"
                + ("; --saver hf-peft writes the adapter alone" if args.saver == "hf-peft" else "")
            )
        if args.loader == "hf":
            if args.saver != "megatron_lite":
                raise ConfigError(f"--loader hf converts to --saver megatron_lite, not {args.saver}")
            if args.target_dtype:
                raise ConfigError("--target-dtype applies to --saver hf; megatron_lite keeps the source dtype")
            hf_to_megatron_lite(args.load_dir, args.save_dir)
        elif args.saver == "hf-peft":
            megatron_lite_to_peft(
                args.load_dir, args.save_dir, base_model=args.base_model_name_or_path, dtype=args.target_dtype
            )
        else:
            megatron_lite_to_hf(args.load_dir, args.save_dir, args.target_dtype, merge_lora=args.merge_lora)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
