"""Which checkpoint a job starts from (its --load, or its own --save directory when a restart finds one there)
and which it goes back to in a rollback (its own newest, or that start, read as it was then)."""

from __future__ import annotations

import dataclasses
import json
import os

from megatron_lite.checkpoint import non_persistent
from megatron_lite.checkpoint.atomic import atomic_write_json
from megatron_lite.checkpoint.checkpointing import (
    TrainState,
    find_checkpoint,
    load_checkpoint,
    same_directory,
)
from megatron_lite.checkpoint.format import complete_iterations, iteration_dir, iteration_of, unfinished_saves
from megatron_lite.checkpoint.lookup import read_metadata
from megatron_lite.checkpoint.lora_base import checkpoint_fingerprint, lora_base_checkpoint
from megatron_lite.checkpoint.origin import run_origin
from megatron_lite.config import ConfigError, ModelConfig
from megatron_lite.data.config import DataConfig
from megatron_lite.layout_validation import validate_layout
from megatron_lite.parallel_context import ParallelContext
from megatron_lite.resilience.supervisor import TrainingHalted
from megatron_lite.training.configs import JobConfig

HALTED = "HALTED"  # in --save: the run stopped on a fault a restart would only replay (--nan-policy halt)


def mark_halted(save: str, reason: str) -> None:
    """Written by rank 0 when the run halts, so a launcher's automatic restart (torchrun --max-restarts, a
    requeued Slurm job) stops at start-up instead of replaying the save interval up to the same fault."""
    os.makedirs(save, exist_ok=True)
    tmp = os.path.join(save, f".{HALTED}.tmp")
    with open(tmp, "w") as f:
        f.write(reason.strip() + "\n")
    os.replace(tmp, os.path.join(save, HALTED))


def starting_checkpoint(job: JobConfig, say) -> tuple[JobConfig, str | None]:
    """(the job, with --load pointed at its own checkpoints when it resumes them; the checkpoint it loads, or
    None to start from scratch). Read before any process group exists: every rank finds the same."""
    ckpt_path = None
    ck = job.checkpoint
    non_persistent.check_local_layout(job)
    if ck.save and os.path.isfile(marker := os.path.join(ck.save, HALTED)):
        with open(marker) as f:
            reason = " ".join(f.read().split())[:300]
        raise ConfigError(
            f"--save {ck.save}: this run halted ({reason}); a restart would replay it. Remove {marker} to resume "
            "from its last checkpoint (after changing what halted it: --nan-policy, the data, the learning rate)"
        )
    if (
        ck.save
        and not same_directory(ck.load, ck.save)
        and job.resilience.auto_resume
        and (find_checkpoint(ck.save, own=True, flag="--save") or _non_persistent(job, ck.save, lambda *_: None))
    ):
        # A restarted job (torchrun --max-restarts, a requeued Slurm job) picks up where it stopped, also when
        # it was started from another checkpoint (--load BASE --finetune): that was only its starting point.
        start = f" instead of --load {ck.load}" if ck.load else ""
        again = " (--moe-use-upcycling is for the first run: not upcycled again)" if ck.moe_use_upcycling else ""
        if ck.ckpt_step is not None:  # (dropped without a word: a review, following the --ckpt-step hint)
            again += f" (--ckpt-step {ck.ckpt_step} was for --load: --no-auto-resume keeps it)"
        say(f"--save {ck.save} holds a checkpoint: resuming from it{start} (--no-auto-resume starts over){again}")
        # --no-load-optim / --no-load-rng were for the starting checkpoint: its own holds what it saved
        parts = dict(no_load_optim=ck.no_save_optim, no_load_rng=ck.no_save_rng, moe_use_upcycling=False)
        job = dataclasses.replace(
            job, checkpoint=dataclasses.replace(ck, load=ck.save, finetune=False, ckpt_step=None, **parts)
        )
        if ck.no_save_optim:  # its own checkpoints hold no optimizer state
            say("--no-save-optim: resuming from the weights with fresh optimizer state and LR schedule")
    if job.checkpoint.load and os.path.isfile(job.checkpoint.load):  # (it said "does not exist" and trained anew)
        raise ConfigError(
            f"--load {job.checkpoint.load} is a file; give the directory of checkpoints that holds it (the one with "
            "latest_checkpointed_iteration.txt)"
        )
    if job.checkpoint.load:
        own = same_directory(job.checkpoint.load, ck.save)  # (Megatron's --load X --save X: logs may lie in X)
        step = job.checkpoint.ckpt_step  # (it names a persistent checkpoint)
        # the non-persistent one first: a --load holding it beside other files (a log) and no tracker is not
        # refused, as Megatron reads a missing tracker as iteration -1 and loads the non-persistent one
        latest = _non_persistent(job, job.checkpoint.load, say) if step is None else None
        ckpt_path = find_checkpoint(job.checkpoint.load, step, own=own or latest is not None)
        if step is None:  # (a local one is this rank's own: non_persistent.agree says which all ranks load)
            local = ck.non_persistent_ckpt_type == "local"
            ckpt_path = non_persistent.pick(ckpt_path, latest, (lambda *_: None) if local else say)
        if ckpt_path is None:
            if job.checkpoint.exit_on_missing_checkpoint:
                holds = "does not exist" if not os.path.isdir(job.checkpoint.load) else "holds no checkpoint"
                raise ConfigError(f"--load {job.checkpoint.load} {holds} and --exit-on-missing-checkpoint is set")
            if os.path.isdir(job.checkpoint.load):
                say(f"no checkpoint in --load {job.checkpoint.load}: starting from scratch")
            else:  # (Megatron's too; a mistyped path trained from scratch behind a line that did not say why)
                say(
                    f"no checkpoint in --load {job.checkpoint.load}: the directory does not exist; starting from "
                    "scratch (--exit-on-missing-checkpoint makes that an error)"
                )
        elif job.checkpoint.ckpt_step is not None:
            say(
                f"--ckpt-step {job.checkpoint.ckpt_step}: loading {ckpt_path} (a restart with these flags loads it "
                "again; drop --ckpt-step to resume from the newest)"
            )
        if ckpt_path is not None and own and job.checkpoint.finetune:
            # (a fine-tune counts its iterations from 0: its checkpoints would replace the base's of the same
            # numbers, and a restart would find the base newest and fine-tune from it again; Megatron overwrites)
            raise ConfigError(
                f"--finetune with --save the same directory as --load ({ck.save}): the fine-tune's iterations start "
                "at 0, so its checkpoints would overwrite the base's and a restart would fine-tune from the base "
                "again; give --save another directory (a restart then resumes the fine-tune from it)"
            )
        starts = [f for f, on in (("--no-load-optim", job.checkpoint.no_load_optim),
                                  ("--no-load-rng", job.checkpoint.no_load_rng)) if on]  # fmt: skip
        if ckpt_path is not None and own and starts and ck.save:
            say(
                f"{' and '.join(starts)} with --save the same directory as --load: a restart of this command (torchrun "
                f"--max-restarts, a requeue) applies {'them' if len(starts) > 1 else 'it'} again to its own newest "
                "checkpoint; drop it for the restart, or give --save another directory (whose checkpoints a restart "
                "resumes whole)"
            )
    _say_unfinished_saves(job, ckpt_path, say)
    return job, ckpt_path


def _say_unfinished_saves(job: JobConfig, ckpt_path: str | None, say) -> None:
    """Name the saves a killed run left unpublished past the checkpoint this run starts from (an exploratory
    run's finding: a restart went back to iteration 50 with iter_0000060.tmp beside it, unsaid)."""
    loaded = -1 if ckpt_path is None else iteration_of(ckpt_path)
    if loaded is None:  # (a non-persistent checkpoint: numbered apart from --save's)
        return
    roots = dict.fromkeys(r for r in (job.checkpoint.load, job.checkpoint.save) if r)
    for root in roots:
        after = loaded if ckpt_path is not None and same_directory(root, os.path.dirname(ckpt_path)) else -1
        if names := unfinished_saves(root, after):
            start = f"starting from {ckpt_path}, the newest complete checkpoint" if after >= 0 else "not loaded"
            say(
                f"{root}: {', '.join(names)} {'is a save' if len(names) == 1 else 'are saves'} that did not finish "
                f"(stopped before publication; {start}); publishing that iteration or a later one removes "
                f"{'it' if len(names) == 1 else 'them'}"
            )


def _non_persistent(job: JobConfig, root: str | None, say) -> str | None:
    """The newest non-persistent checkpoint of a job loading `root` (this rank's own, for local ones)."""
    return non_persistent.newest(job, root, int(os.environ.get("RANK", "0")), say)


def start_from(job: JobConfig, ckpt_path: str | None, vocab_size: int, world_size: int, say) -> tuple:
    """(the job, its model's vocabulary and LoRA base settled against the checkpoint it starts from; the LoRA
    base to load first, or None): the data's vocabulary (`vocab_size`) checked against the checkpoint's. Run
    again when the ranks settle on another checkpoint than the one each found alone (non_persistent.agree)."""
    model_cfg = dataclasses.replace(job.model, vocab_size=vocab_size)
    saved = read_metadata(ckpt_path)["config"] if ckpt_path is not None else {}
    if ckpt_path is not None:
        saved_vocab = saved["model"]["vocab_size"]
        if vocab_size < saved_vocab:  # e.g. Qwen2: the embedding has rows the tokenizer never emits
            say(f"the data's vocabulary ({vocab_size}) is smaller than the checkpoint's: using {saved_vocab}")
            model_cfg = dataclasses.replace(model_cfg, vocab_size=saved_vocab)
        _check_against_checkpoint(saved, model_cfg, ckpt_path, job.data)
    # (the loaded checkpoint's origin, recorded in this run's checkpoints: an upcycling changes the weights)
    origin = run_origin(ckpt_path, job.lora is not None, job.checkpoint.moe_use_upcycling, job.checkpoint.save)
    job = dataclasses.replace(job, model=model_cfg, origin=origin)
    validate_layout(job.model, job.parallel, world_size, job.training)
    return lora_base(job, ckpt_path, saved, say)


def _check_against_checkpoint(saved: dict, current: ModelConfig, path: str, data: DataConfig) -> None:
    """The flags were already reconciled with the checkpoint (arguments.parse_args); what can still differ
    is what the data source decides, the vocabulary (a tokenizer with more ids than the checkpoint's
    embedding is an error; fewer is fine). Said as what gave it and what works (a converted checkpoint of 256
    with --mock-data --vocab-size 256 was told "a vocabulary of 257", the fix being --vocab-size 255)."""
    ours, theirs = current.vocab_size, saved["model"]["vocab_size"]
    if theirs == ours:
        return
    if data.tokenizer_type == "NullTokenizer" or (data.mock_data and data.tokenizer_type is None):
        given = (
            f"--vocab-size {data.vocab_size} gives a vocabulary of {ours} (Megatron's NullTokenizer adds an "
            "end-of-document id)"
        )
        fix = f"give --vocab-size {theirs - 1}"
    elif data.mock_data or data.sft or data.data_path or data.train_data_path:
        given = f"--tokenizer-type {data.tokenizer_type} gives a vocabulary of {ours}"
        fix = "use the tokenizer the checkpoint was trained with"
    else:
        given = f"with no data flags the built-in corpus's tokenizer gives a vocabulary of {ours}"
        fix = (
            f"give the data and tokenizer it was trained with (--data-path, --tokenizer-type), or --mock-data "
            f"--vocab-size {theirs - 1} for random tokens"
        )
    raise ConfigError(f"{given} but the checkpoint in {path} has {theirs}; {fix}")


def check_qlora_base(job: JobConfig, ckpt_path: str | None) -> None:
    """QLoRA's checkpoints hold the adapters and name the base they were trained on: with no checkpoint loaded
    the base is random, and the checkpoints it would save could never be loaded again."""
    if job.lora is not None and job.lora.qlora and ckpt_path is None and job.checkpoint.save:
        load = job.checkpoint.load
        why = "not given" if not load else "no such directory" if not os.path.isdir(load) else "no checkpoint in it"
        raise ConfigError(
            f"--qlora with no base checkpoint loaded (--load {load}: {why}): the checkpoints in "
            f"--save {job.checkpoint.save} would hold adapters for a random base that cannot be rebuilt; "
            "add --load BASE --finetune, or drop --save to try QLoRA on a random base"
        )


def lora_base(job: JobConfig, ckpt_path: str | None, saved: dict, say) -> tuple[JobConfig, str | None]:
    """LoRA checkpoints hold the adapters alone and record the base checkpoint they were trained on, as
    Megatron-Bridge's PEFT checkpoints do: a 70B base is not written again at every save (QLoRA's NF4 base
    cannot be). Returns (the job, its LoRA config recording that base, or none when it saves whole checkpoints;
    the base to load before `ckpt_path`, or None when `ckpt_path` holds the whole model). `saved`: the
    checkpoint's config."""
    if job.lora is None:
        return job, None
    saved_lora = (saved.get("lora") or {}) if ckpt_path is not None else {}
    base_path = fingerprint = None
    if saved_lora.get("base"):  # adapters only: the base loads first, from the checkpoint they recorded
        base_dir, fingerprint = saved_lora["base"], saved_lora.get("base_fingerprint")
        base_path = lora_base_checkpoint(base_dir, ckpt_path, fingerprint)
    elif saved_lora and not job.lora.qlora:
        base_dir = None  # a whole LoRA checkpoint (its base lay in --save, or saved before adapters-only ones)
    else:  # the base iteration loaded (with --ckpt-step, or newer ones saved there later: not the newest)
        whole = ckpt_path is not None and not ckpt_path.endswith(".old")
        base_dir = ckpt_path if whole else job.checkpoint.load
        if non_persistent.is_non_persistent(job.checkpoint, ckpt_path):  # (a later save of its run deletes it)
            base_dir = _persistent_twin(job, ckpt_path)
        if job.lora.qlora:
            check_qlora_base(job, ckpt_path)
            if ckpt_path is None:
                say("--qlora with no base checkpoint loaded: the adapters train on a randomly initialised base")
        elif ckpt_path is None:
            base_dir = None  # a random base is saved with its adapters
        elif base_dir is None:  # (as a base inside --save: its run may delete it)
            say(
                f"LoRA: the base {ckpt_path} is a non-persistent checkpoint, which a later save of its run deletes: "
                "this run's checkpoints hold the whole model (a persistent base, --ckpt-step N, gives adapters only)"
            )
        elif _inside(base_dir, job.checkpoint.save):
            say(
                f"LoRA: the base {ckpt_path} lies in --save {job.checkpoint.save}, whose checkpoints this run adds "
                "to and may delete: its checkpoints hold the whole model (another --save holds adapters only)"
            )
            base_dir = None
    base_dir = os.path.abspath(base_dir) if base_dir else None  # (read again from another directory)
    if base_dir and base_path is None and ckpt_path is not None and (found := find_checkpoint(base_dir)):
        fingerprint = checkpoint_fingerprint(found)  # (what the adapters are trained on, checked where they load)
    lora = dataclasses.replace(job.lora, base=base_dir, base_fingerprint=fingerprint if base_dir else None)
    return dataclasses.replace(job, lora=lora), base_path


def _persistent_twin(job: JobConfig, ckpt_path: str) -> str | None:
    """The persistent checkpoint of the same iteration as the non-persistent `ckpt_path` in --load (the same
    weights, kept), recorded as a LoRA base in its place; None when there is none. QLoRA, whose checkpoints
    cannot hold the whole model, is refused then."""
    load, iteration = job.checkpoint.load, read_metadata(ckpt_path)["iteration"]
    twin = iteration_dir(load, iteration) if load else None
    if twin and os.path.isfile(os.path.join(twin, "metadata.json")):
        return twin
    if job.lora.qlora:
        raise ConfigError(
            f"--qlora: the base checkpoint {ckpt_path} is a non-persistent one (a later save of its run deletes "
            f"it) and --load {load} holds no persistent checkpoint of iteration {iteration}; QLoRA's checkpoints "
            "name their base and cannot hold the whole model: load a persistent one (--ckpt-step N)"
        )
    return None


def _inside(path: str, root: str | None) -> bool:
    if not root:
        return False
    path, root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([path, root]) == root


def start_load(job: JobConfig, base_path: str | None) -> dict:
    """How the checkpoint a job starts from is loaded: --no-load-optim, --no-load-rng, --finetune; a LoRA
    checkpoint of adapters has its base's weights from `base_path`, loaded before it."""
    ck = job.checkpoint
    return dict(
        load_optim=not ck.no_load_optim,
        load_rng=not ck.no_load_rng,
        load_main_params=ck.load_main_params_from_ckpt,
        finetune=ck.finetune,
        skip_missing_frozen=base_path is not None,
        fully_parallel_load=ck.ckpt_fully_parallel_load,
    )


SKIPS = "rollback_skips.json"  # in --save: the batches rollbacks skipped


def record_skips(save: str | None, skips: set[int], rank: int) -> None:
    """The batches the rollbacks skipped (by consumed-samples position), written beside the checkpoints when one
    is decided: a restart before the next save (a preemption, a crash) went back to the checkpoint and trained
    the skipped batch after all, without a word."""
    if save and rank == 0:
        atomic_write_json(os.path.join(save, SKIPS), {"skip_samples": sorted(skips)})


def recorded_skips(save: str | None) -> list[int]:
    """The batches earlier rollbacks of the job in --save skipped (record_skips); none without the file."""
    path = os.path.join(save, SKIPS) if save else None
    if path is None or not os.path.isfile(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            return [int(x) for x in json.load(f)["skip_samples"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{path} is not the list of skipped batches a rollback writes ({type(e).__name__}: {e}); remove it "
            "(the batches earlier rollbacks skipped are then trained)"
        ) from None


def rollback(
    job: JobConfig,
    model,
    optimizer,
    scheduler,
    ctx: ParallelContext,
    log,
    state: TrainState,
    start: str | None,
    base_path: str | None,
    saved: set[int],
    np_saver=None,
) -> TrainState:
    """Every rank reloads the newest complete checkpoint of this job's (`saved`) not past this iteration (the
    Supervisor has noted the batch to skip); before its first, the checkpoint it started from (`start`), read as
    it was then. A job started from an older checkpoint (--ckpt-step, --finetune) may share its directory with
    the newer ones of the run it went back from: never those. This job's own non-persistent saves (`np_saver`)
    count too: the newest still on disk (a later one deletes it), the start only while it exists (a
    non-persistent one a later save deleted)."""
    ck = job.checkpoint
    root = ck.save or ck.load
    done = [(i, 1, find_checkpoint(root, i)) for i in complete_iterations(root) if i <= state.iteration and i in saved]
    if np_saver is not None:
        np_saver.poll(log, wait=True)  # (one in flight may be the one to go back to)
        if (mine := np_saver.newest_saved(state.iteration)) is not None:
            done.append((mine[0], 0, mine[1]))  # (a persistent one of the same iteration first)
    path = max(done)[2] if done else start
    if path is not None and not os.path.isfile(os.path.join(path, "metadata.json")):
        raise TrainingHalted(
            f"iteration {state.iteration + 1}: a rollback was asked for but the checkpoint this run started from, "
            f"{path}, is gone (a later non-persistent save deleted it) and the run saved none since; save more "
            "often (--save-interval) or use --nan-policy skip"
        )
    if path is None:
        raise TrainingHalted(
            f"iteration {state.iteration + 1}: a rollback was asked for but {root} holds no checkpoint yet; "
            "save more often (--save-interval) or use --nan-policy skip"
        )
    if hasattr(optimizer, "finish_param_sync"):
        optimizer.finish_param_sync()
    # the starting checkpoint with the flags it was loaded with; one of this job's own with everything (its
    # optimizer state included: --no-save-optim with a rollback is refused)
    # (this job's own hold the adapters alone when it records a base: the frozen base in memory is that one)
    own = dict(
        skip_missing_frozen=job.lora is not None and job.lora.base is not None,
        fully_parallel_load=job.checkpoint.ckpt_fully_parallel_load,
    )
    how = start_load(job, base_path) if path == start else own
    restored = load_checkpoint(path, model, optimizer, scheduler, ctx, **how)
    log.info(f"rolled back to {path}: iteration {restored.iteration}, sample {restored.consumed_samples}")
    return restored
