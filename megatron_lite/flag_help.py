"""--help text for the flags whose meaning is Megatron's and whose definition (flag_parser.py and the flag modules)
gives none: what each sets, its default where it has one, and where ours differs from Megatron's; and the
switches' off forms, kept out of it."""

from __future__ import annotations

import argparse

FLAG_HELP = {
    # model
    "--num-layers": "transformer layers of the decoder (required, unless --load gives a checkpoint's)",
    "--hidden-size": "the model's width (required, unless --load gives a checkpoint's)",
    "--num-attention-heads": "query heads of each attention layer (required, unless --load gives a checkpoint's)",
    "--max-position-embeddings": "rows of the learned position table (default: --seq-length); RoPE reads none",
    "--recompute-granularity": "recompute activations in the backward: full (whole layers, per --recompute-method) "
    "or selective (the --recompute-modules, by default the attention core)",
    "--recompute-method": "with --recompute-granularity full: uniform (every chunk of --recompute-num-layers "
    "layers) or block (the first --recompute-num-layers layers of each pipeline stage)",
    "--recompute-num-layers": "with --recompute-granularity full: layers per recomputed chunk (uniform) or layers "
    "recomputed per stage (block)",
    # mixture of experts
    "--num-experts": "routed experts in each MoE layer (default: a dense model); --moe-layer-freq picks the layers",
    "--moe-ffn-hidden-size": "each routed expert's FFN width (default: --ffn-hidden-size)",
    "--moe-z-loss-coeff": "weight of the router's z-loss (the squared log-sum-exp of its logits; default: none)",
    "--moe-shared-expert-intermediate-size": "width of the shared expert every token also goes through (default: none)",
    # distributed
    "--expert-tensor-parallel-size": "tensor parallelism inside each expert (default: --tensor-model-parallel-size)",
    "--num-layers-per-virtual-pipeline-stage": "interleaved 1F1B: layers per virtual stage (or give "
    "--num-virtual-stages-per-pipeline-rank)",
    "--num-virtual-stages-per-pipeline-rank": "interleaved 1F1B: model chunks per pipeline rank (or give "
    "--num-layers-per-virtual-pipeline-stage)",
    "--ddp-bucket-size": "elements per gradient bucket of the data-parallel reduction, with --overlap-grad-reduce "
    "or --zero-stage 2 (else one bucket; default, as Megatron's: max(40M, 1M x the data-parallel size))",
    # training
    "--global-batch-size": "sequences per optimizer step, over every data-parallel rank and micro-batch (default: "
    "--micro-batch-size x the data-parallel size)",
    "--seq-length": "tokens per sequence",
    "--train-iters": "optimizer steps to train (or give --train-samples)",
    "--exit-interval": "save (with --save) and exit after the iteration that is a multiple of this",
    "--exit-duration-in-mins": "save (with --save) and exit once the job has run this many minutes",
    # optimizer and learning rate
    "--lr-decay-iters": "iterations the learning rate decays over (default: --train-iters)",
    "--lr-warmup-fraction": "warmup as a fraction of --lr-decay-iters (or give --lr-warmup-iters)",
    "--lr-wsd-decay-iters": "--lr-decay-style WSD: the last iterations of the decay, after the stable phase",
    # data
    "--tokenizer-type": "the tokenizer --data-path's documents were encoded with (HuggingFaceTokenizer with "
    "--tokenizer-model, GPT2BPETokenizer with --vocab-file and --merge-file, ...)",
    "--vocab-file": "GPT2BPETokenizer's vocab.json",
    "--merge-file": "GPT2BPETokenizer's merges.txt",
    "--vocab-size": "the vocabulary without a tokenizer (--mock-data, NullTokenizer); a tokenizer's size wins, as "
    "in Megatron",
    "--data-cache-path": "where the datasets' sample indices are built and cached (default: a cache/ folder beside "
    "the data)",
    # checkpointing
    "--save": "directory checkpoints are saved to (safetensors + JSON, loadable under any layout); a relaunch "
    "resumes from its newest",
    "--load": "checkpoint directory to start from; flags not given take the checkpoint's values (Megatron takes "
    "its defaults unless --use-checkpoint-args)",
    "--save-interval": "save every this many iterations (0 or none: only at the end of training)",
    # fault tolerance
    "--no-check-for-nan-in-loss-and-grad": "do not check the loss and gradient norm for NaN/Inf (--nan-policy then "
    "has nothing to act on)",
    # logging
    "--wandb-project": "log to Weights & Biases under this project (offline when WANDB_MODE=offline or without "
    "an API key)",
    "--wandb-exp-name": "the W&B run's name",
    "--wandb-save-dir": "where W&B writes its run files (default: wandb/ under --save, else under the working "
    "directory)",
    "--tensorboard-dir": "write TensorBoard event files here (needs the tensorboard package)",
}


def add_missing_help(parser: argparse.ArgumentParser) -> None:
    """Each flag defined without help text takes its FLAG_HELP line."""
    for action in parser._actions:
        if action.option_strings and not action.help and action.option_strings[0] in FLAG_HELP:
            action.help = FLAG_HELP[action.option_strings[0]]


def off_switch(flag: str) -> str:
    """The flag that undoes switch `flag`: --no-X, or --A-B for --A-no-B."""
    return flag.replace("-no-", "-", 1) if "-no-" in flag else "--no-" + flag[2:]


def add_off_switches(parser: argparse.ArgumentParser) -> None:
    """Each switch without one gets the form that undoes it (--no-X; --muon-split-qkv for --muon-no-split-qkv), for
    each of its spellings, not in --help: `--load` alone takes the checkpoint's switches
    (--eod-mask-loss, --fp32-residual-connection, --qk-clip...), and one left on there could never be turned off
    (a checkpoint with an fp32 residual stream could not resume under FSDP2)."""
    names = parser._option_string_actions
    kinds = (argparse._StoreTrueAction, argparse._StoreFalseAction)
    have = {(a.dest, type(a)) for a in parser._actions if isinstance(a, kinds)}
    for action in list(parser._actions):
        # (not --X for a --no-X switch, an opt-out of a default: "--load-optim: no such flag, it is the default")
        if not isinstance(action, kinds) or max(action.option_strings, key=len).startswith("--no-"):
            continue
        undo = (
            argparse._StoreFalseAction if isinstance(action, argparse._StoreTrueAction) else argparse._StoreTrueAction
        )
        forms = [off_switch(f) for f in action.option_strings if f.startswith("--")]
        forms = [f for f in dict.fromkeys(forms) if f not in names]
        if (action.dest, undo) in have or not forms:
            continue
        kind = "store_false" if undo is argparse._StoreFalseAction else "store_true"
        parser.add_argument(*forms, dest=action.dest, action=kind, default=action.default, help=argparse.SUPPRESS)
