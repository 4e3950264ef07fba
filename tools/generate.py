#!/usr/bin/env python
"""Generate text from a megatron_lite checkpoint (saved under any layout, or converted from Hugging Face),
on one process or under torchrun at any tensor / pipeline / expert parallel size, with a KV cache.

    python tools/generate.py --load ckpt --prompt "The capital of France is" --max-new-tokens 20 --greedy
    torchrun --nproc-per-node 4 tools/generate.py --load ckpt --prompt-ids 1,450,7483 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --output-json out.json

--output-json writes generated_ids, logprobs (of each generated token) and prompt_logprobs (of each prompt
token after the first), log-probabilities of the model's own distribution; with --top-n-logprobs N also
top_n_logprobs, at each generated token the N most likely ids and their log-probabilities. --max-new-tokens 0
scores the prompt (Megatron's tokens_to_generate=0): prompt_logprobs alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

from megatron_lite.arguments import resolve_kernel_impl
from megatron_lite.checkpoint.checkpointing import (
    find_checkpoint,
    load_checkpoint,
    read_metadata,
)
from megatron_lite.checkpoint.hf_convert import (
    generation_config,
    generation_eos_ids,
    model_config_from_dict,
    saved_lora_config,
)
from megatron_lite.checkpoint.lora_base import lora_base_checkpoint
from megatron_lite.checkpoint.origin import lost_hf_dir
from megatron_lite.checkpoint_flags import tokenizer_beside
from megatron_lite.config import ConfigError, ParallelConfig, TrainingConfig
from megatron_lite.data.config import TOKENIZER_FIELDS
from megatron_lite.data.embedded import trained_on_embedded_corpus
from megatron_lite.data.sft import chat_prompt_ids, prompt_ids
from megatron_lite.data.sft_messages import ChatTemplate
from megatron_lite.data.tokenizers import tokenizer_from_flags
from megatron_lite.flag_parser import OneLineErrorParser
from megatron_lite.inference.generation import SamplingConfig, generate_batch
from megatron_lite.layout_validation import validate_layout
from megatron_lite.lora.apply import apply_lora
from megatron_lite.lora.qlora import quantize_base
from megatron_lite.models.gpt_model import build_model
from megatron_lite.parallel_context import initialize
from megatron_lite.resilience.supervisor import check_config_agreement
from megatron_lite.start_up_error import report_error
from megatron_lite.training.configs import check_output_path, check_writable_dir


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # (Megatron's older generation flag: the tokens generated, which --max-new-tokens counts here)
    p.renamed = {"--out-seq-length": "--max-new-tokens (the tokens generated after the prompt)"}
    p.add_argument("--load", required=True, help="a megatron_lite checkpoint directory (its --save)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text, encoded with the checkpoint's tokenizer")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    src.add_argument(
        "--prompts",
        nargs="+",
        metavar="TEXT",
        help="several text prompts (Megatron's flag), generated as --prompts-file's and printed as JSONL "
        '({"prompt": its position from 1, "generated_ids": [...], "text": ...})',
    )
    src.add_argument(
        "--prompts-file",
        help='JSONL, one prompt a line ({"prompt": text}, {"prompt_ids": [ids]}, or {"messages": [...]}, a '
        "conversation the tokenizer's chat template renders with its generation prompt, as --sft reads them), "
        "generated in batches "
        '(--inference-max-requests) by the model loaded once; printed as JSONL ({"line": its line in the file, '
        '"generated_ids": [...], "text": ...}), and --output-json then writes a list',
    )
    p.add_argument(
        "--max-new-tokens",
        "--num-tokens-to-generate",  # (Megatron's name)
        dest="max_new_tokens",
        type=int,
        default=32,
        help="0: score the prompt (its log-probabilities, written to --output-json)",
    )
    p.add_argument(
        "--inference-max-requests",
        "--inference-max-batch-size",  # (Megatron's other name for it, the same dest there)
        "--max-batch-size",  # (its text generation server's older name)
        dest="inference_max_requests",
        type=int,
        default=8,
        help="prompts of --prompts-file generated together, as one batch (Megatron's flag); each gets what it "
        "would alone, up to rounding",
    )
    p.add_argument(
        "--greedy",
        action="store_true",
        help="always the most likely token (the default without --top-k or --top-p, as Megatron's inference and "
        "transformers' generate())",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling: softmax(logits / T); must be > 0 (--greedy for the most likely token)",
    )
    # (--top_p / --top_k: Megatron's generation scripts' spelling; its top_p 0 is no filter, as 1 here)
    p.add_argument("--top-p", "--top_p", dest="top_p", type=float, default=1.0, help="1 (or 0): no top-p filter")
    p.add_argument(
        "--top-k",
        "--top_k",
        dest="top_k",
        type=int,
        default=None,
        help="sample among the k most likely tokens (0: all); not given: 0 with --top-p, else the most likely token "
        "(greedy; Megatron's --top_k defaults to 1)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="sampling: the same seed draws the same tokens at any TP/PP layout; each prompt of --prompts-file "
        "draws from its own generator seeded with it (as it would alone)",
    )
    p.add_argument(
        "--stop-ids",
        default=None,
        help="comma-separated ids that end generation (default: the tokenizer's end-of-document id with --prompt, "
        "and a converted model's generation_config.json eos_token_id(s), as Megatron and transformers stop)",
    )
    p.add_argument(
        "--return-log-probs",
        action="store_true",
        help="Megatron's flag; no effect here: --output-json always holds the log-probabilities",
    )
    p.add_argument("--ignore-eos", action="store_true", help="generate --max-new-tokens whatever comes (no stop ids)")
    p.add_argument(
        "--tokenizer-model",
        help="the tokenizer (a tokenizer.json or its directory) in place of the one the checkpoint names (a path "
        "relative to where training ran, or another machine's): it encodes --prompt and decodes the output, also "
        "of token-id prompts",
    )
    p.add_argument(
        "--output-json",
        help="write prompt_ids, generated_ids, text (with a tokenizer), logprobs and prompt_logprobs (a list with "
        "--prompts-file or --prompts)",
    )
    p.add_argument(
        "--top-n-logprobs",
        type=int,
        default=0,
        help="with --output-json: at each generated token, the N most likely tokens and their log-probabilities "
        "(Megatron's top_n_logprobs)",
    )
    for what in ("tensor", "pipeline", "expert"):  # (any layout loads any checkpoint; under torchrun)
        p.add_argument(
            f"--{what}-model-parallel-size",
            type=int,
            default=1,
            help=f"{what} parallel size (under torchrun; any size loads a checkpoint saved at any)",
        )
    for end in ("first", "last"):  # (Megatron's uneven split: DeepSeek-V3's 61 layers split no other way)
        p.add_argument(
            f"--decoder-{end}-pipeline-num-layers",
            type=int,
            help=f"the {end} pipeline stage's layers, the rest split evenly over the other stages",
        )
    p.add_argument("--bf16", action="store_true", help="run in bf16 (default fp32)")
    p.add_argument(
        "--kernel-impl",
        choices=["torch", "triton"],
        help="default: triton on CUDA, torch on a CPU (as pretrain_gpt.py); triton where it cannot run is refused",
    )
    p.add_argument(
        "--distributed-backend", choices=["nccl", "gloo"], help="under torchrun (default: nccl on GPUs, else gloo)"
    )
    return p


# generation_config.json settings that choose other tokens in transformers' generate(), with its defaults
GENERATION_DEFAULTS = {
    "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None, "typical_p": 1.0,
    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0, "bad_words_ids": None, "sequence_bias": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None, "num_beams": 1,
    "num_beam_groups": 1, "diversity_penalty": 0.0, "length_penalty": 1.0, "penalty_alpha": None,
    "guidance_scale": None, "min_length": 0, "min_new_tokens": None,
}  # fmt: skip
SAMPLING_SETTINGS = {"temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff"}


def _one_process(model_cfg, parallel, training, sizes: int) -> None:
    """Parallel sizes given to one process (plain python): the launch they need, as a ConfigError (the fewest
    ranks the layout takes), or the model's own misfit where no number of ranks would do."""
    for n in range(2, sizes + 1):
        try:
            validate_layout(model_cfg, parallel, n, training)
        except ConfigError:
            continue
        flags = [f"--{w}-model-parallel-size {v}" for w, v in (("tensor", parallel.tensor_model_parallel_size),
                 ("pipeline", parallel.pipeline_model_parallel_size), ("expert", parallel.expert_model_parallel_size))
                 if v > 1]  # fmt: skip
        raise ConfigError(
            f"{' '.join(flags)} splits the model over {n} processes and this is one: launch with torchrun "
            f"--nproc-per-node {n} tools/generate.py ... (or drop the sizes to run in one process)"
        )
    try:
        validate_layout(model_cfg, parallel, sizes, training)
    except ConfigError as e:
        raise ConfigError(f"the checkpoint's model does not fit this layout: {e}") from None


def _note(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"note: {message}", file=sys.stderr, flush=True)


def _check_sampling(args: argparse.Namespace) -> None:
    """What --greedy leaves unused is said; a temperature too small to sample with (its logits overflow) is one
    line."""
    if args.top_p == 0:  # (Megatron's value for no top-p filter)
        args.top_p = 1.0
    if args.return_log_probs:
        _note(
            "--return-log-probs has no effect: the log-probabilities of the prompt and of each generated token are "
            "always written to --output-json" + ("" if args.output_json else " (give it to have them)")
        )
    # Megatron's rule, --top_k 1 unless --top_p is set: greedy without either, as transformers' generate() (it
    # sampled at temperature 1, so a Megatron script that sets neither got other tokens)
    greedy_by_default = args.top_k is None and args.top_p == 1.0 and not args.greedy
    if args.top_k is None:
        args.top_k = 0
    if greedy_by_default:
        args.greedy = True
        if args.temperature != 1.0:
            _note(
                f"--temperature {args.temperature:g} has no effect: without --top-k or --top-p the most likely token "
                "is taken (as Megatron's --top_k 1 default and transformers' generate()); --top-k 0 samples among all"
            )
    if not -(2**63) <= args.seed < 2**64:  # (torch's generator: 'Overflow when unpacking long long', no flag named)
        raise ConfigError(f"--seed {args.seed} is outside the range a generator takes, [-2**63, 2**64)")
    given = [f for f, v, default in (("--temperature", args.temperature, 1.0), ("--top-p", args.top_p, 1.0),
                                     ("--top-k", args.top_k, 0)) if v != default]  # fmt: skip
    if args.greedy and given and not greedy_by_default:
        _note(
            f"--greedy takes the most likely token: {' '.join(given)} {'has' if len(given) == 1 else 'have'} no effect"
        )
    elif not args.greedy and 0 < args.temperature < 1e-4:
        raise ConfigError(f"--temperature {args.temperature:g} is too small to sample with: use --greedy")


def _records(args: argparse.Namespace) -> list[dict]:
    """The prompts asked for: {"prompt": text} or {"prompt_ids": ids} each."""
    if args.prompt is not None:
        return [{"prompt": args.prompt}]
    if args.prompt_ids is not None:
        return [{"prompt_ids": _ids(args.prompt_ids, "--prompt-ids")}]
    if args.prompts is not None:
        return [{"prompt": text, "_line": n} for n, text in enumerate(args.prompts, 1)]
    try:
        with open(args.prompts_file, "rb") as f:
            raw = f.read().removeprefix(b"\xef\xbb\xbf")  # (a byte-order mark, as Windows editors write)
    except OSError as e:
        raise ConfigError(f"--prompts-file {args.prompts_file}: {e.strerror}") from None
    lines = []  # (each with its line number in the file: blank lines are skipped, not renumbered)
    for n, line in enumerate(raw.splitlines(), 1):
        try:  # (JSONL is UTF-8, whatever the locale: it was read in the locale's encoding, and undecodable bytes
            # were a line naming neither the file nor the line)
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"--prompts-file {args.prompts_file} line {n}: not UTF-8 text ({e.reason} at byte {e.start}); "
                "write the file in UTF-8"
            ) from None
        if text.strip():
            lines.append((n, text))
    records = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        ids = record.get("prompt_ids") if isinstance(record, dict) else None
        ids_ok = isinstance(ids, list) and all(type(t) is int for t in ids)  # (not JSON true/false: bool is int)
        chat = isinstance(record, dict) and "messages" in record  # (checked turn by turn once a tokenizer reads it)
        ok = isinstance(record, dict) and (isinstance(record.get("prompt"), str) or ids_ok or chat)
        if not ok:
            raise ConfigError(f'--prompts-file {args.prompts_file} line {n}: not {{"prompt": text}}, '
                              '{"prompt_ids": [ids]} or {"messages": [...]}')  # fmt: skip
        records.append({**record, "_line": n})
    if not records:
        raise ConfigError(f"--prompts-file {args.prompts_file} holds no prompt")
    return records


def _ids(text: str, flag: str) -> list[int]:
    """A comma-separated list of ids, each one there (an empty --stop-ids replaced the stop ids with none, as
    --ignore-eos, without a word; "1,,2" dropped a gap)."""
    parts = text.split(",")
    if not text.strip() or any(not x.strip() for x in parts):
        raise ConfigError(f"{flag} {text!r} is not a comma-separated list of token ids (one id between each comma)")
    try:
        return [int(x) for x in parts]
    except ValueError:
        raise ConfigError(f"{flag} {text!r} is not a comma-separated list of token ids") from None


def _tokenizer(args: argparse.Namespace, meta: dict, path: str, vocab_size: int):
    """The tokenizer --prompt is encoded with: --tokenizer-model, else the one the checkpoint's job named, else
    (a training job given no data flags, whose vocabulary is the embedded corpus's) the embedded corpus's, which it
    trained on."""
    data = meta["config"].get("data", {})
    flags = argparse.Namespace(**{k: data.get(k) for k in TOKENIZER_FIELDS})
    flags.tokenizer_model = tokenizer_beside(flags.tokenizer_model, path)
    if args.tokenizer_model:
        flags.tokenizer_model = args.tokenizer_model
        if flags.tokenizer_type in (None, "NullTokenizer", "GPT2BPETokenizer"):
            flags.tokenizer_type = "HuggingFaceTokenizer"
    elif trained_on_embedded_corpus(meta, vocab_size):
        from megatron_lite.data.embedded import build_embedded_corpus

        flags.tokenizer_type, flags.tokenizer_model = (
            "HuggingFaceTokenizer",
            build_embedded_corpus(log=lambda m: print(m, file=sys.stderr))[1],
        )
    if flags.tokenizer_type in (None, "NullTokenizer"):
        raise ConfigError(
            f'a text prompt (--prompt, or "prompt" in --prompts-file) needs a tokenizer, and the checkpoint in {path} '
            "names none; pass --tokenizer-model, or give token ids"
        )
    try:
        tokenizer = tokenizer_from_flags(flags)
    except ConfigError as e:
        if args.tokenizer_model:  # (its own message names it; 'pass --tokenizer-model' is no fix for it)
            raise
        raise ConfigError(f"the checkpoint's tokenizer cannot be read here ({e}); pass --tokenizer-model") from None
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's vocabulary of {vocab_size}: "
            "it is not the one the model was trained with"
        )
    return tokenizer


def run(args: argparse.Namespace) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.distributed_backend == "nccl" and not torch.cuda.is_available():
        # (as pretrain_gpt.py: under torchrun it was an AttributeError traceback from torch's device setup, and
        # ignored at world size 1)
        raise ConfigError("--distributed-backend nccl needs CUDA GPUs and this machine has none; use gloo")
    path = find_checkpoint(args.load)
    if path is None:
        raise ConfigError(f"--load {args.load} holds no checkpoint")
    meta = read_metadata(path)
    saved = meta["config"]
    # (pretrain_gpt.py's rule: Triton where it cannot run, a CPU without the interpreter or a gloo job's CPU
    # tensors, is one line, not the PyTorch path taken without a word)
    kernel_impl = resolve_kernel_impl(args.kernel_impl, args.distributed_backend, args.bf16)
    model_cfg = dataclasses.replace(
        model_config_from_dict(saved["model"]),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        recompute_granularity=None,
        recompute_method=None,
        recompute_num_layers=None,
        kernel_impl=kernel_impl,
    )
    records = _records(args)
    texts = any(isinstance(r.get("prompt"), str) or "messages" in r for r in records)
    # (token-id prompts with --tokenizer-model: it decodes the output; it was ignored, a missing path too)
    tokenizer = _tokenizer(args, meta, path, model_cfg.vocab_size) if texts or args.tokenizer_model else None
    many = "--prompts-file line" if args.prompts_file else "--prompts prompt" if args.prompts else None
    where = lambda i: f" ({many} {records[i]['_line']})" if many else ""  # noqa: E731
    template = None  # (the chat template beside the tokenizer, for {"messages": [...]} prompts: as --sft reads them)

    def ids_of(r: dict) -> list[int]:
        nonlocal template
        if isinstance(r.get("prompt"), str):  # (text is read as --sft reads a prompt: special tokens, one BOS)
            return prompt_ids(tokenizer, r["prompt"])
        if "messages" in r:
            at = f"--prompts-file {args.prompts_file} line {r['_line']}"
            template = template or ChatTemplate(tokenizer, at)
            return chat_prompt_ids(tokenizer, template, r["messages"], at)
        return r["prompt_ids"]

    prompts = [ids_of(r) for r in records]
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ConfigError(f"the prompt is empty{where(i)} (no ids; the tokenizer adds no BOS to an empty text)")
        if max(prompt) >= model_cfg.vocab_size or min(prompt) < 0:
            raise ConfigError(f"the prompt's ids must be in [0, {model_cfg.vocab_size}){where(i)}; got {prompt[:8]}")
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))  # (the longest sizes the checks below)
    prompt = prompts[longest]
    if args.top_n_logprobs < 0:
        raise ConfigError(f"--top-n-logprobs {args.top_n_logprobs} must be >= 0")
    if args.output_json:  # (before the model loads and generates, not after)
        check_output_path("--output-json", args.output_json)
        # (the permission bits passed /proc/x/y.json, which then failed after the generation, its output lost)
        check_writable_dir("--output-json", os.path.dirname(os.path.abspath(args.output_json)), args.output_json)
    if args.top_n_logprobs and not args.output_json:
        raise ConfigError("--top-n-logprobs is written to --output-json: add --output-json FILE")
    if args.max_new_tokens == 0 and not args.output_json:  # (it printed an empty line and dropped the scores)
        raise ConfigError(
            "--max-new-tokens 0 scores the prompt, and its log-probabilities are written to --output-json: add "
            "--output-json FILE, or generate with --max-new-tokens N > 0"
        )
    if args.inference_max_requests < 1:
        raise ConfigError(f"--inference-max-requests {args.inference_max_requests} must be >= 1")
    if args.max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} must be >= 0 (0 scores the prompt)")
    if args.ignore_eos and args.stop_ids is not None:  # (the stop ids were dropped without a word)
        raise ConfigError(
            f"--ignore-eos generates --max-new-tokens whatever comes, and --stop-ids {args.stop_ids} names tokens "
            "to stop at: give one of them"
        )
    _check_sampling(args)
    sampling = SamplingConfig(args.greedy, args.temperature, args.top_p, args.seed, args.top_k)
    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
    )
    # (the positions fed: the last token generated is never fed back, as transformers' generate counts them)
    training = TrainingConfig(micro_batch_size=1, seq_length=len(prompt) + max(args.max_new_tokens - 1, 0))
    # (in this tool's terms first: the layout check below names the training flags, which are not this tool's)
    positions, layers, pp = model_cfg.max_position_embeddings, model_cfg.num_layers, args.pipeline_model_parallel_size
    if model_cfg.position_embedding_type == "learned_absolute" and training.seq_length > positions:
        raise ConfigError(
            f"the prompt's {len(prompt)} tokens{where(longest)} and --max-new-tokens {args.max_new_tokens} exceed "
            f"the checkpoint's {positions} learned positions: shorten the prompt or lower --max-new-tokens"
        )
    uneven = args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None
    if pp > 0 and layers % pp and not uneven:
        fits = [d for d in range(1, layers + 1) if layers % d == 0]
        raise ConfigError(
            f"the checkpoint's {layers} layers do not split evenly over --pipeline-model-parallel-size {pp}: use one "
            f"of {', '.join(map(str, fits))}, or give the first/last stage its own count "
            "(--decoder-first/last-pipeline-num-layers)"
        )
    if model_cfg.position_embedding_type == "rope" and training.seq_length > positions:  # (Megatron refuses)
        scaled = f" ({model_cfg.rope_scaling.rope_type} RoPE scaling)" if model_cfg.rope_scaling is not None else ""
        _note(
            f"the prompt{where(longest)} and --max-new-tokens reach position {training.seq_length}, past the "
            f"checkpoint's max_position_embeddings {positions}{scaled}: the model was not trained that far"
        )
    sizes = args.tensor_model_parallel_size * pp * args.expert_model_parallel_size
    if world == 1 and sizes > 1:  # (plain python: it said "world size 1 is not divisible by ...")
        _one_process(model_cfg, parallel, training, sizes)
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    if model_cfg.num_experts and world > 1 and world % (tp * ep * pp):  # (an exploratory run: the layout check named
        # --expert-tensor-parallel-size, a training flag; generation splits each expert over all TP ranks, as
        # Megatron's default, since a smaller expert-TP needs sequence parallelism, which decoding has not)
        stages = f" x --pipeline-model-parallel-size {pp}" if pp > 1 else ""
        raise ConfigError(
            f"--tensor-model-parallel-size {tp} x --expert-model-parallel-size {ep}{stages}: generation splits each "
            f"expert over the {tp} tensor-parallel ranks, so the experts take {tp * ep * pp} ranks, which the {world} "
            "launched do not divide; launch a multiple of that, or lower one of the sizes"
        )
    try:
        validate_layout(model_cfg, parallel, world, training)
    except ConfigError as e:  # (its model flags are the checkpoint's, which the user did not give here)
        raise ConfigError(f"the checkpoint's model does not fit this layout: {e}") from None
    lora = saved_lora_config(saved)
    base = lora_base_checkpoint(lora.base, path, lora.base_fingerprint) if lora is not None and lora.base else None
    ctx = initialize(model_cfg, parallel, training, backend=args.distributed_backend)
    # every rank the same flags and checkpoint (from a failure review: a node whose copy of --load held another
    # newest iteration mixed its shards into the others' logits without a word)
    check_config_agreement({"flags": vars(args), "checkpoint": path, "lora_base": base}, ctx.device)
    model = build_model(model_cfg, ctx, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    if lora is None:
        load_checkpoint(path, model, None, None, ctx, load_rng=False)
    else:  # the fine-tuned model is the base it recorded plus its adapters (QLoRA: the base in NF4)
        apply_lora(model, model_cfg, lora, ctx, seed=0)
        if base is not None:
            load_checkpoint(base, model, None, None, ctx, load_rng=False, finetune=True)
        load_checkpoint(path, model, None, None, ctx, load_rng=False, skip_missing_frozen=base is not None)
        if lora.qlora:
            quantize_base(model, ctx)
    if args.ignore_eos:
        stop = ()
    elif args.stop_ids is not None:
        stop = tuple(_ids(args.stop_ids, "--stop-ids"))
        if bad := [i for i in stop if not 0 <= i < model_cfg.vocab_size]:
            raise ConfigError(f"--stop-ids {bad[0]} is outside the model's vocabulary [0, {model_cfg.vocab_size})")
    else:
        # the tokenizer's end, and those the Hugging Face model's generation config stops at (transformers',
        # also for --prompt-ids)
        ends = [tokenizer.eod if texts else None, *generation_eos_ids(path, saved)]
        stop = tuple(dict.fromkeys(i for i in ends if i is not None and 0 <= i < model_cfg.vocab_size))
    # (transformers' generate() applies the rest of the model's generation_config.json; from a review: a sampling
    # default or a repetition_penalty there gave other tokens without a word)
    gen = generation_config(path, saved) or {}
    if lost := lost_hf_dir(path, meta):  # (from a review: its end ids and settings were dropped without a word)
        _note(
            f"the Hugging Face files this checkpoint was converted with ({lost}) are gone: the model's "
            "generation_config.json (its end-of-sequence ids, its settings) is not read"
            + ("; --stop-ids gives the ids to stop at" if args.stop_ids is None and not args.ignore_eos else "")
        )
    unread = {k: gen[k] for k in GENERATION_DEFAULTS if k in gen and gen[k] != GENERATION_DEFAULTS[k]}
    if not gen.get("do_sample"):  # (transformers' greedy search reads no sampling setting)
        unread = {k: v for k, v in unread.items() if k not in SAMPLING_SETTINGS}
    if unread:
        _note(
            "the model's generation_config.json also sets "
            + ", ".join(f"{k}={v}" for k, v in sorted(unread.items()))
            + ", which transformers' generate() applies and this tool does not (only its eos ids): pass the "
            "sampling flags (--temperature, --top-k, --top-p, or --greedy) to choose"
        )
    cf = model_cfg.moe_expert_capacity_factor
    if cf is not None and ctx.rank == 0:
        print(
            f"note: the checkpoint's --moe-expert-capacity-factor {cf:g} drops tokens by each forward's count, as "
            "Megatron's inference does: the prompt's forward may drop some, a one-token step never does, so the "
            "log-probabilities differ from those of one forward over the whole sequence",
            file=sys.stderr,
            flush=True,
        )
    # (the prompt's log-probabilities take its whole logits: only where they are written)
    scored = args.output_json is not None or args.max_new_tokens == 0
    writer = ctx.is_last_stage and ctx.tp.rank == 0 and ctx.dp.rank == 0
    # batches of prompts of like lengths (a longer prompt's tail runs a token a step), printed in the file's order
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outs: dict[int, dict] = {}
    n = args.inference_max_requests if cf is None else 1  # (a batch's tokens would compete for the capacity)
    if cf is not None and args.inference_max_requests > 1 and len(prompts) > 1:
        _note(f"--moe-expert-capacity-factor {cf:g}: the prompts run one at a time (batched, their tokens would "
              "compete for the experts' capacity, and each prompt's drops depend on the others)")  # fmt: skip
    for batch in (order[a : a + n] for a in range(0, len(order), n)):
        got = generate_batch(
            model, ctx, [prompts[i] for i in batch], args.max_new_tokens, sampling, stop, scored, args.top_n_logprobs
        )
        outs.update(zip(batch, got))
    results = []
    for i, prompt in enumerate(prompts):
        result = {"prompt_ids": prompt, **outs[i], "checkpoint": path, "iteration": meta["iteration"]}
        if tokenizer is not None:
            result["text"] = tokenizer.decode(outs[i]["generated_ids"])
        if writer and many:  # one JSON line a prompt (a text holding newlines spread over several)
            shown = {k: result[k] for k in ("text", "generated_ids") if k in result}
            print(json.dumps({"line" if args.prompts_file else "prompt": records[i]["_line"], **shown}), flush=True)
        elif writer:
            print(result.get("text", " ".join(map(str, outs[i]["generated_ids"]))), flush=True)
        results.append(result)
    if writer and args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(results if many else results[0], f, indent=1)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ConfigError, ValueError) as e:
        report_error(e, dist.is_initialized())  # (once per node, as pretrain_gpt.py says it)
        if dist.is_initialized():  # (a group left to the interpreter's exit aborted at times: torchrun said SIGABRT)
            dist.destroy_process_group()
        return 2


if __name__ == "__main__":
    sys.exit(main())
