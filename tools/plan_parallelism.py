#!/usr/bin/env python
"""Which parallel layouts of a model fit a cluster, how much memory each needs per GPU, and how fast each
should run, best first (megatron_lite/planner has the memory and cost models).

    python tools/plan_parallelism.py --script pretrain/llama3_8b.sh --gpu H100 --gpus-per-node 8 --nodes 1
    python tools/plan_parallelism.py --hf-config path/to/config.json --seq-length 4096 --global-batch-size 512 \\
        --gpu H200 --nodes 4
    python tools/plan_parallelism.py --gpu H100 --nodes 2 -- --num-layers 32 --hidden-size 4096 ...  (our flags)
    python tools/plan_parallelism.py --published     # the cost model beside published throughput
    python tools/plan_parallelism.py --check-cpu     # the cost model beside layouts measured on this CPU
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import os
import re
import shlex
import subprocess
import sys
import time

from megatron_lite.config import ModelConfig
from megatron_lite.data.config import _number  # (a blend's weights, as --data-path reads them)
from megatron_lite.flag_parser import OneLineErrorParser
from megatron_lite.optimizer.optimizer import state_bytes_per_param
from megatron_lite.planner.hardware import ACCELERATORS, GIB, cluster
from megatron_lite.planner.layout import SHARDINGS, Layout
from megatron_lite.planner.memory import MuonStateBytes
from megatron_lite.planner.muon_cost import MuonSettings
from megatron_lite.planner.search import RESERVED_BYTES, USABLE_FRACTION, Candidate, evaluate, job_layout, plan
from megatron_lite.planner.unmodelled import unmodelled_settings


def script_args(path: str) -> tuple[list[str], int, int | None]:
    """The pretrain flags of a shipped launch script (its ARGS=( ... ) array, expanded by bash with the
    script's own defaults), the world size it launches (GPUS_PER_NODE x NNODES) and its GPUS_PER_NODE (None for
    the CPU demos, which launch NPROC ranks)."""
    if not os.path.isfile(path):
        raise SystemExit(f"error: --script {path}: no such file")
    text = open(path).read()
    block = re.search(r"^ARGS=\($.*?^\)$", text, re.S | re.M)
    if block is None:
        raise SystemExit(f"error: --script {path}: no ARGS=( ... ) array found; pass the model flags after --")
    # The script's top-level assignments (an exploratory run: only VAR=${VAR:-...} and numbers were read, so
    # PRECISION="--bf16" in ARGS planned fp32 unsaid), not those running a command, nor arrays; an ARGS entry
    # naming a variable left unread is one line (set -u)
    assign = re.findall(r"^(?:export\s+)?([A-Za-z_]\w*=(?!\()[^\n]*)$", text, re.M)
    defaults = "\n".join(a for a in assign if "$(" not in a and "`" not in a and _only_assignments(a))
    # (the CPU demos launch NPROC ranks)
    world = 'echo -n "${NPROC:-$((${GPUS_PER_NODE:-8} * ${NNODES:-1}))} ${GPUS_PER_NODE:-8} ${NPROC:+nproc}"'
    program = f"set -u\n{defaults}\n{block.group(0)}\nprintf '%s\\0' \"${{ARGS[@]}}\"\n{world}"
    run = subprocess.run(["bash", "-c", program], capture_output=True, text=True)
    if run.returncode:
        unread = re.search(r"(\w+): unbound variable", run.stderr)
        if unread:
            sets = re.search(rf"^(?:export\s+)?{unread[1]}=", text, re.M)
            why = f"its ARGS use ${unread[1]}, which it {'sets by running a command' if sets else 'does not set'}"
        else:
            why = run.stderr.strip()[-200:]
        raise SystemExit(f"error: --script {path}: {why}; set it in the environment, or pass the flags after --")
    out = run.stdout
    *argv, sizes = out.split("\0")
    world, gpn, *nproc = sizes.split()
    # The shipped scripts `cd "$(dirname "$0")/.."` first: their relative paths (TOKENIZER=tokenizer.json) are the
    # repository's, not wherever the planner runs (a tokenizer.json there priced its vocabulary instead)
    if re.search(r'^cd "\$\(dirname "\$0"\)/\.\."', text, re.M):
        root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        flag = None
        for i, tok in enumerate(argv):
            if tok.startswith("--"):
                flag = tok
            elif flag in SCRIPT_PATH_FLAGS and not os.path.isabs(tok) and _number(tok) is None:
                argv[i] = os.path.join(root, tok)
    return argv, int(world), None if nproc else int(gpn)


def _only_assignments(line: str) -> bool:
    """Whether a script's line does nothing but assign (`A=1 B="x y"`): not `VAR=1 torchrun ...`, which runs its
    command with VAR set (the planner ran the training job), nor `X=1; cmd`, `X=1 && cmd`, `X=1 > file`."""
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)
    except ValueError:  # (an unclosed quote: a line continued, not read)
        return False
    return all(re.match(r"[A-Za-z_]\w*=", w) for w in words)


# flags of a launch script whose values are paths (a blend's weights among them stay numbers)
SCRIPT_PATH_FLAGS = {"--tokenizer-model", "--vocab-file", "--merge-file", "--data-path", "--train-data-path",
                     "--valid-data-path", "--test-data-path", "--data-cache-path", "--load", "--save"}  # fmt: skip


def model_from_flags(argv: list[str], seq: int | None = None, gbs: int | None = None) -> tuple[ModelConfig, object]:
    """The model and job of pretrain flags. The planner's --seq-length and --global-batch-size stand in for
    the job's when these leave them out, and a plan trains nothing (--train-iters is not needed); with no
    data flags, --vocab-size is the model's vocabulary."""
    from megatron_lite.arguments import parse_args
    from megatron_lite.config import ConfigError
    from megatron_lite.training.dry_run import _vocab

    kernel = None  # (planned, not run: taken out so a CPU machine plans --kernel-impl triton too)
    for i, tok in enumerate(argv):
        if tok.startswith("--kernel-impl="):
            kernel, argv = tok.split("=", 1)[1], argv[:i] + argv[i + 1 :]
            break
        if tok == "--kernel-impl" and i + 1 < len(argv):
            kernel, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
            break
    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    given |= {"--seq-length"} if "--encoder-seq-length" in given else set()  # (Megatron's other name for it)
    extra = []
    for flag, value in (("--seq-length", seq), ("--global-batch-size", gbs)):
        if value and flag not in given:
            extra += [flag, str(value)]
    if not given & {"--train-iters", "--train-samples"}:  # (a batch ramp is sample-based: Megatron's rule)
        extra += ["--train-samples", "1000000000"] if "--rampup-batch-size" in given else ["--train-iters", "1"]
    try:
        _, job = parse_args(argv + extra)
        d = job.data
        data = d.mock_data or d.sft or d.data_path or d.train_data_path
        vocab = d.vocab_size if not data and d.vocab_size else _vocab(job)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    if job.lora is not None:
        raise SystemExit(
            f"error: {'QLoRA' if job.lora.qlora else 'LoRA'} fine-tuning (--lora-rank {job.lora.rank}) is not modelled "
            "here: the planner prices training every weight, far above a frozen base's memory; pretrain_gpt.py with "
            "the same flags and --dry-run counts a LoRA job's memory per rank"
        )
    model = dataclasses.replace(job.model, vocab_size=vocab)
    return dataclasses.replace(model, kernel_impl=kernel or "triton"), job  # (triton: a GPU's default)


def model_from_hf(path: str) -> ModelConfig:
    from megatron_lite.checkpoint.hf_convert import load_hf_config
    from megatron_lite.config import ConfigError
    from megatron_lite.models.hf import _arch, config_from_hf

    directory = path if os.path.isdir(path) else os.path.dirname(path) or "."
    if not os.path.isdir(path) and os.path.basename(path) != "config.json":
        raise SystemExit(f"error: --hf-config {path}: give a Hugging Face model directory or its config.json")
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise SystemExit(f"error: --hf-config {path}: no such file ({os.path.join(directory, 'config.json')})")
    try:
        hf, raw = load_hf_config(directory)
        model = config_from_hf(hf)
    except ConfigError as e:
        raise SystemExit(f"error: --hf-config {path}: {e}") from None
    except ValueError as e:  # (a config.json that is not JSON)
        raise SystemExit(f"error: --hf-config {path}: {e}") from None
    # DeepSeek-V3's multi-token-prediction depths train beside the model (the converter keeps those present)
    mtp = int(raw.get("num_nextn_predict_layers") or 0) if _arch(hf) == "DeepseekV3ForCausalLM" else 0
    return dataclasses.replace(model, mtp_num_layers=mtp, kernel_impl="triton")  # (triton: a GPU's default)


def _blocks(model: ModelConfig) -> str:
    """A heterogeneous model's layers in a few words: how many of each kind of attention and MLP."""
    kinds = {"normal": "normal", "linear": "linear", "no_op": "no-op"}
    parts = []
    for what, of in (("attention", lambda b: b.attention), ("MLP", lambda b: b.mlp)):
        counts = collections.Counter(of(b) for b in model.heterogeneous_blocks)
        parts.append(f"{what}: " + ", ".join(f"{counts[k]} {name}" for k, name in kinds.items() if counts[k]))
    return "; ".join(parts)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _gib(x: float) -> str:
    return f"{x / GIB:6.1f}"


def row(i: int | str, c: Candidate, width: int = 52) -> str:
    m, t = c.memory, c.time
    return (
        f"{i!s:>4}  {c.layout.describe():<{width}} {_gib(m.params)} {_gib(m.grads)} {_gib(m.optimizer)} "
        f"{_gib(m.activations + m.transient)} {_gib(m.total)}  {t.total:8.3f} {c.tokens_per_second:10.0f} "
        f"{c.tflops:8.1f} {c.mfu:6.1%}"
    )


def header(width: int = 52) -> str:
    return (
        f"{'#':>4}  {'layout':<{width}} {'params':>6} {'grads':>6} {'optim':>6} {'activ':>6} {'total':>6}  "
        f"{'step s':>8} {'tok/s/GPU':>10} {'TFLOP/s':>8} {'MFU':>6}"
    )


@functools.lru_cache(maxsize=4096)
def reason_group(reason: str) -> str:
    # (numbers, not the digits of a name: "--fp16" and "fsdp2" stay as they are)
    return "does not fit in memory" if reason.startswith("needs ") else re.sub(r"(?<![\w.])-?\d+(\.\d+)?", "N", reason)


MUON = ("muon", "dist_muon")
MUON_SHARDING = (
    "--optimizer {} runs without --use-distributed-optimizer and --use-torch-fsdp2 (Megatron refuses them too)"
)


class SearchProgress:
    """A line on stderr every `every` seconds of a long search (layouts costed, how many fit so far); none for a
    search that ends sooner."""

    def __init__(self, every: float = 10.0) -> None:
        self.every, self.start = every, time.monotonic()
        self.next = self.start + every

    def __call__(self, searched: int, fitting: int) -> None:
        now = time.monotonic()
        if now >= self.next:
            self.next = now + self.every
            print(
                f"searching: {searched} layouts costed, {fitting} fit so far ({now - self.start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )


def print_plan(
    model, cl, seq, gbs, precision, tp_comm_overlap, top, yours: Layout | None, grads_bf16=False, state_bytes=8,
    uneven=False, optimizer: str = "adam", muon: MuonSettings | None = None,
) -> dict:  # fmt: skip
    from megatron_lite.planner.params import stage_params

    # (dist_muon's layer-wise split of the state over data parallelism in place of DDP's whole state a rank)
    shardings = ("layer-wise", *SHARDINGS[1:]) if optimizer == "dist_muon" else SHARDINGS
    g = cl.gpu
    whole = stage_params(model, Layout(), 0)  # (one rank holding everything: the model's parameter count)
    k, e = model.moe_router_topk, model.num_experts or 1
    active = f", {_count(whole.dense + whole.expert * k // e)} active" if model.num_experts else ""
    # (the counts include the MTP depths, as Hugging Face counts a checkpoint holding them)
    mtp = f" (counts include its {model.mtp_num_layers} MTP depth{'s' if model.mtp_num_layers > 1 else ''})"
    print(
        f"model: {_count(whole.total)} parameters{active}"
        + (mtp if model.mtp_num_layers else "")
        + f"; {model.num_layers} layers, hidden {model.hidden_size}, heads {model.num_attention_heads}"
        + (
            f" ({model.query_groups} groups), FFN {model.ffn_size}"
            if model.heterogeneous_blocks is None
            else f", heterogeneous layers ({_blocks(model)})"
        )
        + (
            f", hybrid layers {''.join(model.layer_types)} (Mamba: {model.mamba_heads} heads of "
            f"{model.mamba_head_dim}, {model.mamba_num_groups} groups, state {model.mamba_state_dim})"
            if model.hybrid
            else ""
        )
        + f", vocabulary {model.vocab_size}"
        + (f", {model.num_experts} experts top-{model.moe_router_topk}" if model.num_experts else "")
        + f"; global batch {gbs} x {seq} tokens, {precision}"
        + (" (gradients reduced in bf16)" if precision != "fp32" and grads_bf16 else "")
        + (f", fp8 GEMMs ({model.fp8}, {model.fp8_recipe})" if model.fp8 else "")
        + (", fp32 residual stream" if model.fp32_residual_connection else "")
        + ("" if state_bytes == 8 else f", optimizer state {state_bytes:.3g} bytes per parameter")
        + f", --kernel-impl {model.kernel_impl}"
    )
    peak = g.fp32_rate if precision == "fp32" else g.peak_flops  # (the one MFU is taken against)
    print(
        f"cluster: {cl.nodes} x {cl.gpus_per_node} {g.name} ({g.memory_bytes / GIB:.0f} GiB, "
        f"{peak / 1e12:.4g} TFLOP/s {precision} peak), NVLink {cl.nvlink_bandwidth / 1e9:.0f} GB/s, "
        f"network {cl.network_bandwidth / 1e9:.0f} GB/s per GPU"
    )
    usable = g.memory_bytes * USABLE_FRACTION - RESERVED_BYTES
    print(
        "assumed: "
        + (
            "Muon's momentum (4 bytes) on the hidden layers' matrices and Adam's moments (8) on the embeddings and "
            "output layer, per pipeline stage"
            + (
                ", each data-parallel rank the state and main weights of the whole tensors dist_muon gives it (the "
                "busiest rank's), the updated weights all-gathered after the step"
                if optimizer == "dist_muon"
                else ""
            )
            + ", and fp32 main weights"
            + (_newton_schulz(muon, optimizer) if muon is not None else "")
            if optimizer in MUON
            else "Adam with fp32 main weights and moments"
            if state_bytes == 8
            else "fp32 main weights"
        )
        + f", balanced MoE routing, {usable / GIB:.1f} GiB usable per GPU ({USABLE_FRACTION:.0%} of "
        f"{g.memory_bytes / GIB:.0f} GiB less {RESERVED_BYTES / GIB:.0f} GiB for CUDA and NCCL); 'activ' includes "
        "recomputation's and FSDP2's transient buffers"
    )
    # settings the flags or config give that the memory model leaves out: said, not silently dropped
    unpriced = unmodelled_settings(model)
    if model.fp8 and not g.fp8_flops:  # (pretrain runs them through an fp32 product of the fp8 values there)
        print(f"warning: the {g.name} has no fp8 tensor cores: the fp8 GEMMs are priced at its bf16 rate")
    if unpriced:
        print("warning: the memory estimate leaves out " + "; ".join(unpriced) + ": activations may be higher")
    # (what was asked is printed before the search, which takes a minute on a large MoE cluster)
    sys.stdout.flush()
    fits, rejected = plan(
        model, cl, seq, gbs, precision, tp_comm_overlap, grads_bf16, state_bytes, uneven, shardings, muon,
        progress=SearchProgress(),
    )  # fmt: skip
    if optimizer in MUON:  # (pretrain refuses the sharded optimizers with Muon, as Megatron does)
        sharded = [c for c in fits if c.layout.sharding not in ("none", "layer-wise")]
        rejected += [dataclasses.replace(c, reason=MUON_SHARDING.format(optimizer)) for c in sharded]
        fits = [c for c in fits if c.layout.sharding in ("none", "layer-wise")]
    # (the layout column as wide as the longest shown: CP's kind, an uneven split or a block recomputation)
    shown = [c.layout for c in fits[:top]] + ([yours] if yours is not None else [])
    width = max([52] + [len(layout.describe()) for layout in shown])
    print(f"memory per GPU in GiB (the busiest pipeline stage); step time and MFU from the cost model\n{header(width)}")
    for i, c in enumerate(fits[:top], 1):
        print(row(i, c, width))
    if len(fits) > top:
        print(f"  ... and {len(fits) - top} more layouts that fit, slower (--top N shows more)")
    if not fits:
        print(f"  no layout fits: {_why_none(rejected, usable, cl.world)}")
    result = {"fits": [_as_dict(c) for c in fits[:top]], "fitting": len(fits), "rejected": len(rejected)}
    result["unmodelled"] = unpriced
    groups = collections.Counter(reason_group(c.reason) for c in rejected)
    result["rejected_reasons"] = dict(groups)
    if yours is not None:
        c = evaluate(model, yours, seq, gbs, cl, precision, tp_comm_overlap, grads_bf16, state_bytes, muon)
        if c.reason:
            print(f"your layout {yours.describe()}: {c.reason}")
        else:
            rank = next((i for i, f in enumerate(fits, 1) if f.layout == yours), "-")
            outside = f" ({_outside_search(yours, uneven, fits)})" if rank == "-" else ""
            print(f"your layout, rank {rank} of {len(fits)}{outside}:\n{row(rank, c, width)}")
        result["yours"] = _as_dict(c)
    print(f"{len(rejected)} layouts cannot run:")
    for reason, count in groups.most_common():
        members = [c for c in rejected if reason_group(c.reason) == reason]
        # too big: show the one that comes closest to fitting
        example = min(members, key=lambda c: c.memory.total) if members[0].memory else members[0]
        if reason == "does not fit in memory":  # (the example is the closest, not what every one of them needs)
            print(f"  {count:5d}  do not fit in memory; the closest, {example.layout.describe()}, {example.reason}")
        else:
            print(f"  {count:5d}  {example.reason}  (e.g. {example.layout.describe()})")
    if not uneven and any(UNEVEN_HINT.match(reason) for reason in groups):
        print(
            f"  (--uneven-pipeline also tries the pipeline sizes {model.num_layers} layers do not divide, with lighter "
            "end stages)"
        )
    return result


def _newton_schulz(muon: MuonSettings, optimizer: str) -> str:
    """What the step time assumes of Muon's Newton-Schulz (planner/muon_cost.py)."""
    gemms = {"medium": "bf16", "high": "TF32", "low": "fp32"}[muon.fp32_matmul_prec]
    return (
        f"; Muon's Newton-Schulz ({muon.num_ns_steps} iterations of {gemms} GEMMs, --muon-tp-mode {muon.tp_mode}"
        + (", the fused QKV part by part" if muon.split_qkv else "")
        + ") priced in the optimizer step, on "
        + ("the busiest rank's owned matrices" if optimizer == "dist_muon" else "every rank's matrices")
    )


SEARCHED = (
    "the search tries TP inside a node, CP in powers of two, EP dividing the experts (with expert TP = TP, and 1 "
    "under EP > 1), 2 or 4 virtual stages, "
    "micro-batches of 1, 2, 4 and 8, SP at every TP and the default micro-batch grouping"
)
UNEVEN_HINT = re.compile(r"--num-layers N is not divisible by --pipeline-model-parallel-size")


def _outside_search(layout: Layout, uneven: bool, fits: list[Candidate]) -> str:
    """Why a script's layout is not among the searched ones (it is costed all the same)."""
    if layout.stages is not None:
        if not uneven:
            return "an uneven pipeline split: --uneven-pipeline searches them"
        return "its own pipeline split: --uneven-pipeline searches lighter end stages only"
    if not layout.recompute_as_searched:
        searched = "the search recomputes uniform 1, or block with the fewest layers of each chunk that fit"
        same = [
            f.layout
            for f in fits
            if f.layout == dataclasses.replace(layout, recompute_num_layers=f.layout.recompute_num_layers)
        ]
        return searched + (f": block {same[0].recompute_num_layers} here" if same else "")
    if layout.overlap_grad_reduce is not None or layout.overlap_param_gather is not None:
        return (
            "the search overlaps the gradient reduction and the weights' gather (--overlap-grad-reduce, "
            "--overlap-param-gather) wherever the sharding takes them"
        )
    return "outside the search: " + SEARCHED


def _why_none(rejected: list[Candidate], usable: float, world: int) -> str:
    """What to change when nothing fits: more GPUs when the weights, gradients and optimizer state alone
    overflow every layout (a shorter sequence frees activations only), else the activations' levers."""
    big = [c for c in rejected if c.memory is not None]
    if not big:
        return "every layout is refused (the reasons follow)"
    state = min(big, key=lambda c: c.memory.params + c.memory.grads + c.memory.optimizer)
    held = state.memory.params + state.memory.grads + state.memory.optimizer
    if held > usable:
        need = -(-int(held * world) // int(usable))
        return (
            f"the weights, gradients and optimizer state alone need {held / GIB:.1f} GiB per GPU at best "
            f"({state.layout.describe()}), more than the {usable / GIB:.1f} GiB usable: about {need} GPUs are needed "
            "to hold them, before activations"
        )
    return "shorten the sequence or the micro-batch, recompute, or add GPUs (the closest layouts follow)"


def _as_dict(c: Candidate) -> dict:
    d = {"layout": dataclasses.asdict(c.layout), "describe": c.layout.describe(), "reason": c.reason}
    if c.memory is not None:
        d["memory"] = dataclasses.asdict(c.memory) | {"total": c.memory.total}
    if c.time is not None:
        d["step_seconds"] = c.time.total
        d["time"] = dataclasses.asdict(c.time)
        d.update(tokens_per_second_per_gpu=c.tokens_per_second, tflops_per_gpu=c.tflops, mfu=c.mfu)
    return d


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--script", help="a launch script whose ARGS=( ... ) holds pretrain flags (pretrain/*.sh)")
    src.add_argument("--hf-config", help="a Hugging Face config.json (or its directory)")
    src.add_argument("--published", action="store_true", help="compare the cost model with published runs")
    src.add_argument("--check-cpu", action="store_true", help="compare the cost model with layouts run on this CPU")
    p.add_argument("--global-batch-size", type=int, help="sequences per step (default: the script's)")
    p.add_argument("--seq-length", type=int, help="tokens per sequence (default: the script's)")
    p.add_argument("--gpu", default="H100", choices=sorted(ACCELERATORS))
    p.add_argument("--gpus-per-node", type=int, help="default: the script's GPUS_PER_NODE, else 8")
    p.add_argument(
        "--nodes", type=int, help="default: the script's GPUs (GPUS_PER_NODE x NNODES) over --gpus-per-node, else 1"
    )
    p.add_argument(
        "--nvlink-bandwidth", type=float, help="GB/s per GPU inside a node (default 450; A100 300, B200 900)"
    )
    p.add_argument("--network-bandwidth", type=float, help="GB/s per GPU between nodes (default 50)")
    p.add_argument(
        "--fp32",
        action="store_true",
        help="plan fp32 training (default: the script's or flags' precision, --bf16, --fp16 or fp32 without "
        "either, as pretrain runs them; bf16 for --hf-config)",
    )
    p.add_argument(
        "--grad-reduce-in-bf16",
        action="store_true",
        help="gradients accumulated and reduced in bf16 (default: the script's flag, else fp32)",
    )
    p.add_argument(
        "--kernel-impl", choices=["triton", "torch"], help="default: the flags' --kernel-impl, else triton (a GPU's)"
    )
    p.add_argument("--tp-comm-overlap", action="store_true", help="price TP communication as overlapped")
    p.add_argument(
        "--uneven-pipeline",
        action="store_true",
        help="also try pipeline sizes whose stages the layers do not divide, with lighter end stages (as a "
        "--pipeline-model-parallel-layout would run them)",
    )
    p.add_argument("--top", type=int, default=10, help="layouts shown and written to --json (default 10)")
    p.add_argument("--iters", type=int, default=5, help="--check-cpu: timed steps per layout (after one warm-up)")
    p.add_argument("--layouts", type=int, default=None, help="--check-cpu: only the first N layouts (default: all)")
    p.add_argument(
        "--json",
        help="also write the result here: the --top layouts that fit (--top 1000000 for all), the count of each "
        "refusal, your layout",
    )
    args = p.parse_args(argv)
    for flag, value in (
        ("--global-batch-size", args.global_batch_size),
        ("--seq-length", args.seq_length),
        ("--gpus-per-node", args.gpus_per_node),
        ("--nodes", args.nodes),
        ("--nvlink-bandwidth", args.nvlink_bandwidth),
        ("--network-bandwidth", args.network_bandwidth),
        ("--top", args.top),
    ):
        if value is not None and not value > 0:
            p.error(f"{flag} {value:g} must be positive")
    if args.json:  # (checked before the plan: --published takes minutes)
        from megatron_lite.config import ConfigError
        from megatron_lite.training.configs import check_output_path

        try:
            check_output_path("--json", args.json)
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)  # (under /proc: a traceback
        except ConfigError as e:  # after the plan, an exploratory run found)
            p.error(str(e))
        except OSError as e:
            p.error(f"--json {args.json}: its directory cannot be made ({e.strerror})")

    if args.published:
        from megatron_lite.planner.published import compare

        result = compare(print)
    elif args.check_cpu:
        from _check_cpu import check_cpu  # tools/_check_cpu.py, beside this script

        result = check_cpu(print, iters=args.iters, layouts=args.layouts)
    else:
        job, world, script_gpn = None, None, None
        if args.script:
            script_flags, world, script_gpn = script_args(args.script)
            model, job = model_from_flags(script_flags + flags, args.seq_length, args.global_batch_size)
        elif args.hf_config:
            if flags:  # (they were ignored without a word)
                p.error(
                    f"--hf-config gives the model: the pretrain flags after -- ({flags[0]} ...) would be ignored; "
                    "drop them"
                )
            model = model_from_hf(args.hf_config)
        elif flags:
            model, job = model_from_flags(flags, args.seq_length, args.global_batch_size)
        else:
            p.error("give a model: --script FILE, --hf-config FILE, or pretrain flags after --")
        if args.kernel_impl:
            model = dataclasses.replace(model, kernel_impl=args.kernel_impl)
        seq = args.seq_length or (job.training.seq_length if job else None)
        gbs = args.global_batch_size or (job.training.global_batch_size if job else None)
        if not seq or not gbs:
            p.error("--seq-length and --global-batch-size are needed (the model source does not give them)")
        gpn = args.gpus_per_node or script_gpn or (min(world, 8) if world else 8)
        if world and not args.nodes and (world % gpn if world > gpn else world < gpn):  # (the script's own divide)
            p.error(f"--gpus-per-node {gpn} does not divide the script's {world} GPUs into nodes: give --nodes too")
        nodes = args.nodes or (max(world // gpn, 1) if world else 1)
        cl = cluster(args.gpu, gpn, nodes, args.nvlink_bandwidth, args.network_bandwidth)
        yours = (
            job_layout(job, cl.world)
            if job is not None and cl.world % (job.parallel.tp * job.parallel.pp * job.parallel.cp) == 0
            else None
        )
        if job is not None and yours is None:  # (it was left out of the plan without a word)
            par = job.parallel
            print(
                f"your layout (TP{par.tp} PP{par.pp} CP{par.cp}) needs a multiple of {par.tp * par.pp * par.cp} "
                f"GPUs; the cluster's {cl.world} is not one"
            )
        grads_bf16 = args.grad_reduce_in_bf16 or bool(job and job.optimizer.grad_reduce_in_bf16)
        # the optimizer's state per parameter: the script's (--optimizer sgd keeps one momentum buffer), else Adam's
        state_bytes = state_bytes_per_param(job.optimizer) if job is not None else 8
        if job is not None and job.optimizer.is_muon:  # (Muon's 4 bytes on the matrices, Adam's 8 on the vocabulary)
            state_bytes = MuonStateBytes(model)
        # the job's own precision (pretrain trains fp32 without --bf16 or --fp16, and FSDP2 refuses --fp16)
        precision = "fp32" if args.fp32 else "bf16"
        if job is not None and not args.fp32:
            precision = "bf16" if job.optimizer.bf16 else "fp16" if job.optimizer.fp16 else "fp32"
        if args.grad_reduce_in_bf16 and precision != "bf16":  # (pretrain refuses the pair with --fp16)
            p.error(f"--grad-reduce-in-bf16 plans a --bf16 job; this one is {precision}: drop it")
        result = print_plan(
            model, cl, seq, gbs, precision, args.tp_comm_overlap, args.top, yours, grads_bf16, state_bytes,
            args.uneven_pipeline, job.optimizer.optimizer if job is not None else "adam",
            MuonSettings.of(job.optimizer) if job is not None and job.optimizer.is_muon else None,
        )  # fmt: skip
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:  # (an error raised as its message exits 1; argparse's, and pretrain's, exit 2)
        if not isinstance(e.code, str):
            raise
        print(e.code, file=sys.stderr)
        sys.exit(2)
