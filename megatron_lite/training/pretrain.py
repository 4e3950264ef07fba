"""The pretraining job: validate everything, build the model, data, optimizer and loggers, resume if a
checkpoint exists, train, evaluate, save.

Start-up order matters: every check that can be made from the flags and the files (layout, schedule,
data files, the --load directory) runs before the process group is joined, so a bad input stops every
rank with one line instead of leaving some rank waiting in a collective.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from megatron_lite.arguments import parse_args
from megatron_lite.checkpoint import non_persistent
from megatron_lite.checkpoint.checkpointing import (
    AsyncSaver,
    TrainState,
    load_checkpoint,
    read_metadata,
    same_directory,
    save_checkpoint,
    saved_under_this_layout,
)
from megatron_lite.checkpoint_flags import with_origin
from megatron_lite.config import ConfigError
from megatron_lite.data.builder import check_data, resolve_data
from megatron_lite.layout_validation import validate_layout
from megatron_lite.lora.apply import apply_lora
from megatron_lite.lora.config import adapted_targets
from megatron_lite.megatron_flags import accepted_no_ops
from megatron_lite.moe import stats as moe_stats
from megatron_lite.optimizer.lr_scheduler import LRScheduler
from megatron_lite.parallel_context import ParallelContext, destroy_process_groups, initialize
from megatron_lite.resilience import inject
from megatron_lite.resilience.flight_recorder import FlightRecorder, leave
from megatron_lite.resilience.guards import ExitSignal, over_time, should_exit
from megatron_lite.resilience.supervisor import ROLLBACK, Supervisor, TrainingHalted, check_config_agreement
from megatron_lite.start_up_error import record_for_launcher, report_error
from megatron_lite.tensor_parallel.fp8 import describe_fp8
from megatron_lite.training import determinism, memory
from megatron_lite.training.batches import Batches
from megatron_lite.training.configs import JobConfig, check_output_paths, probe_output_dirs
from megatron_lite.training.datasets import run_datasets
from megatron_lite.training.evaluation import Evaluator
from megatron_lite.training.flops import flops_per_token, peak_flops
from megatron_lite.training.logger import MetricsLogger
from megatron_lite.training.profiling import ProfileWindow, validate_profile
from megatron_lite.training.resume import (
    SKIPS,
    check_qlora_base,
    mark_halted,
    record_skips,
    recorded_skips,
    rollback,
    start_from,
    start_load,
    starting_checkpoint,
)
from megatron_lite.training.saving import SaveFailed, finish_async_save, peer_lost, saving
from megatron_lite.training.skipping import skip_iteration
from megatron_lite.training.step import train_step
from megatron_lite.training.upcycling import check_upcycling, upcycle
from megatron_lite.training.wrap import build_training_model, wrap_for_training


def backend_timeout(backend: str | None, timeout_s: float, recorder_on: bool) -> float:
    """The process group's timeout. Under gloo a hung collective blocks the host, where the flight recorder
    sees it and reports at the timeout, so the backend's own error is pushed later. NCCL calls return once
    queued, so the recorder cannot see a hang there: NCCL's watchdog keeps the timeout asked for."""
    nccl = (backend or ("nccl" if torch.cuda.is_available() else "gloo")) == "nccl"
    return 2 * timeout_s + 60 if recorder_on and not nccl else timeout_s


def _new_window() -> dict:
    """What the loop sums between two log lines; "means": per-step values logged as their mean over the window
    (each MTP depth's loss, the MoE losses, as Megatron's)."""
    return {"loss": 0.0, "n": 0, "losses": 0, "time": 0.0, "data": 0.0, "skipped": 0, "step": 0.0, "comm": 0.0,
            "samples": 0, "nan": 0, "means": {}}  # fmt: skip


def _logging_rank(ctx: ParallelContext) -> bool:
    return ctx.is_last_stage and ctx.tp.rank == 0 and ctx.dp_cp.rank == 0


def run(job: JobConfig, notes: list[str]) -> int:
    job_start = time.time()  # --exit-duration-in-mins counts start-up too (Megatron's _TRAIN_START_TIME)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate_layout(job.model, job.parallel, world_size, job.training)
    check_output_paths(job)
    notes = [*notes, *determinism.enter_deterministic_mode(job, world_size)]  # (before CUDA; main restores)
    if job.training.train_samples is not None:  # sample-based: the iterations this data-parallel size makes
        job = dataclasses.replace(
            job, training=job.training.resolve_train_iters(job.parallel.data_parallel_size(world_size))
        )
        t, dp = job.training, job.parallel.data_parallel_size(world_size)
        ramp = t.rampup_iterations(dp)[0]
        batches = f"of {t.global_batch(dp)} samples"
        if ramp:
            batches = (
                f"({ramp} ramping up from {t.rampup_batch_size[0]} samples, then {t.train_iters - ramp} {batches})"
            )
        notes = [*notes, f"--train-samples {t.train_samples}: {t.train_iters} iterations {batches}"]
    job.optimizer.validate_schedule(job.training.train_iters, job.training.train_samples)
    validate_profile(job.logging, world_size, torch.cuda.is_available() and job.distributed_backend != "gloo")
    if job.distributed_backend == "nccl" and not torch.cuda.is_available():
        # (it failed inside torch's device setup once the group existed, or was ignored at world size 1; checked
        # here, not with the flags: a dry run or the planner plans a GPU job on any machine)
        raise ConfigError("--distributed-backend nccl needs CUDA GPUs and this machine has none; use gloo")
    rank = int(os.environ.get("RANK", "0"))
    say = print if rank == 0 else (lambda *a, **k: None)
    job, ckpt_path = starting_checkpoint(job, say)
    upcycling = check_upcycling(job, ckpt_path)  # (--moe-use-upcycling: the dense checkpoint in --load)

    # Whichever rank builds the embedded corpus (the others wait on its lock) reports the progress.
    def data_log(m: str) -> None:  # (any rank's: the one that builds a shared cache says so)
        print(f"[rank {rank}] {m}" if world_size > 1 else m, flush=True)

    source = resolve_data(job.data, log=data_log)
    check_data(source, job.data, data_log)
    job, base_path = start_from(job, ckpt_path, source.vocab_size, world_size, say)  # (vocabulary, LoRA base)

    timeout_s = job.distributed_timeout_minutes * 60
    recorder_on = job.resilience.flight_recorder and world_size > 1
    ctx = initialize(
        job.model,
        job.parallel,
        job.training,
        backend=job.distributed_backend,
        timeout_s=backend_timeout(job.distributed_backend, timeout_s, recorder_on),
        start_timeout_s=timeout_s,
    )
    # The recorder watches the configuration check too: a rank still starting up (a slow index build, a stuck
    # file) left the others in its all-gather until gloo's longer timeout, then a DistStoreError traceback
    recorder = FlightRecorder(timeout_s).install() if recorder_on else None
    if recorder is not None:  # (until the training loop names its iteration)
        recorder.where = "start-up"
    try:
        # The output directories are made and probed now: every rank has looked for --load (one that does not exist
        # is said so); a directory one node cannot write is said by every rank at the agreement, not a hang there
        probe_error = probe_output_dirs(job, rank, _logging_rank(ctx))
        if (agreed := non_persistent.agree(job, ckpt_path, ctx.rank, say)) != ckpt_path:  # (local ones: each its own)
            ckpt_path, upcycling = agreed, check_upcycling(job, agreed)  # (what was read from the other, again)
            job, base_path = start_from(job, ckpt_path, source.vocab_size, world_size, say)
        # with the flags, what each rank found on its own file system: a node whose copy of --load lagged (another
        # newest checkpoint) or of the data differed trained apart from the others without a word, then hung
        found = _found(ckpt_path, source, job, rank)
        check_config_agreement({**job.to_dict(), "found": found}, ctx.device, error=probe_error)
    except BaseException:
        if recorder is not None:  # (its watchdog would outlive the job in an in-process caller)
            recorder.uninstall()
        raise
    model_seed = determinism.seed_rngs(ctx, job)
    log = MetricsLogger(job, enabled=_logging_rank(ctx), world_size=ctx.world_size)
    exit_signal = ExitSignal.from_config(job.resilience)  # (before the checkpoint and data load, as Megatron)
    exit_code = 0  # W&B's run state: 1 on an exception, 3 (the process's) on a halt
    train_batches = None
    leave_together = False  # the run ended where every rank ends it (done, or halted): a final barrier
    try:  # the logger is closed however the run ends (a halt too: W&B's run finished)
        for line in notes:
            log.info(line)
        if job.model.kernel_impl == "triton" and job.model.attention_dropout > 0:
            log.info("--attention-dropout > 0: attention runs through PyTorch's SDPA (the flash kernel has no dropout)")
        if job.data.reset_attention_mask and source.prefixes and not job.data.sft:  # (else the line below)
            log.info(
                "--reset-attention-mask: the flash kernel keeps attention inside each document, skipping other "
                "documents' blocks"
                if job.model.kernel_impl == "triton" and job.model.attention_dropout == 0
                else "--reset-attention-mask: attention runs through SDPA with a [batch, 1, seq, seq] document mask"
            )
        if (job.data.reset_attention_mask or job.data.reset_position_ids) and (not source.prefixes or job.data.sft):
            log.info(
                "--reset-position-ids / --reset-attention-mask have no effect on mock or --sft data (mock data packs "
                "no documents; --sft keeps the conversations a line packs apart itself)"
            )
        log.info(f"kernels: {job.model.kernel_impl}")
        log.info(f"world {ctx.world_size} on {ctx.device}: {ctx.describe()}; data: {source.description}")

        dtype = torch.bfloat16 if job.optimizer.bf16 else torch.float16 if job.optimizer.fp16 else torch.float32
        fsdp2 = job.optimizer.use_torch_fsdp2
        model = build_training_model(job.model, ctx, model_seed, dtype, fsdp2)
        if job.model.fp8 is not None:
            log.info(describe_fp8(model, job.model, ctx, fsdp2))
        n_params = sum(p.numel() for p in model.parameters())
        grads = str(job.optimizer.grad_dtype).removeprefix("torch.")
        padded = job.model.padded_vocab_size(ctx.tp.size)  # (Megatron prints it: a flag-defaults review)
        pad = f", padded to {padded} (--make-vocab-size-divisible-by x TP)" if padded != job.model.vocab_size else ""
        log.info(f"model: {n_params / 1e6:.2f}M parameters on this rank ({dtype}, gradients reduced in {grads}), "
                 f"vocabulary {job.model.vocab_size}{pad}")  # fmt: skip
        if job.lora is not None:
            n = apply_lora(model, job.model, job.lora, ctx, seed=job.training.seed)
            on, absent = adapted_targets(job.lora, job.model)
            log.info(
                f"LoRA rank {job.lora.rank}, alpha {job.lora.alpha:g} on {' '.join(on)}: "
                f"{n / 1e6:.3f}M trainable parameters on this rank, the base frozen"
                + (f" ({' '.join(absent)}: no layer has a dense MLP, nothing adapted)" if absent else "")
            )
        determinism.broadcast_params(model, ctx, job)  # (--data-parallel-random-init: DP rank 0's weights)
        ddp, optimizer = wrap_for_training(
            model,
            ctx,
            job.optimizer,
            overlap_grad_reduce=job.training.overlap_grad_reduce,
            bucket_size=job.training.ddp_bucket_size,
            compute_dtype=dtype if dtype != torch.float32 else None,
        )
        scheduler = LRScheduler(
            job.optimizer,
            job.training.train_iters,
            job.training.train_samples,
            job.training.global_batch(ctx.dp.size),
            rampup=job.training.rampup_batch_size is not None,
            keep_saved_lengths=job.checkpoint.use_checkpoint_opt_param_scheduler,
        )
        state = TrainState()
        if upcycling:  # (and a rollback before this run's next save goes back to the upcycled checkpoint)
            state, ckpt_path = upcycle(ckpt_path, model, optimizer, scheduler, ctx, job, log)
        elif ckpt_path is not None:
            if base_path is not None:
                base_how = dict(finetune=True, fully_parallel_load=job.checkpoint.ckpt_fully_parallel_load)
                try:
                    load_checkpoint(base_path, model, None, None, ctx, **base_how)
                except ConfigError as e:  # (its advice, --ckpt-step, is the adapters' checkpoint's, not the base's)
                    why = str(e).split("; load an older checkpoint")[0]
                    raise ConfigError(
                        f"the frozen base of the LoRA checkpoint {ckpt_path}, {base_path}, cannot be loaded: {why}; "
                        "restore the base's files (the adapters were trained on its very weights)"
                    ) from None
                log.info(f"loaded the LoRA base {base_path}")
            how = start_load(job, base_path)
            state = load_checkpoint(ckpt_path, model, optimizer, scheduler, ctx, **how)
            log.info(f"loaded {ckpt_path}: iteration {state.iteration}, {state.consumed_samples} samples consumed")
            meta = read_metadata(ckpt_path)
            if meta.get("converted_from") and not how["finetune"]:
                # (a converted checkpoint holds weights alone: there is no optimizer or RNG state to restore)
                log.info(
                    "a converted checkpoint: weights only; the optimizer, LR schedule and random-number states "
                    "start as a new run's"
                )
            elif how["load_rng"] and not how["finetune"] and not saved_under_this_layout(meta, ctx):
                log.info(
                    "the checkpoint was saved under another layout: its random-number states are not restored "
                    "(dropout draws differ from an unbroken run's; weights, optimizer and data position are as saved)"
                )
        if job.lora is not None and job.lora.qlora:
            from megatron_lite.lora.qlora import nf4_bytes, quantize_base

            n, per_shard = quantize_base(model, ctx)
            if ctx.world_size > 1:  # (every stage's: the logging rank holds only the last one's layers)
                found = [None] * ctx.world_size
                dist.all_gather_object(found, [f"stage {ctx.pp.rank} {name}" for name in per_shard])
                per_shard = sorted({name for names in found for name in names})
            log.info(
                f"QLoRA: {n / 1e6:.2f}M base weights in NF4, {8 * nf4_bytes(model) / max(n, 1):.3f} bits per parameter"
            )
            if per_shard:
                log.info(
                    f"QLoRA: {len(per_shard)} weights ({per_shard[0]}, ...) quantised per tensor-parallel shard "
                    "(a shard's rows are not whole 64-value blocks): their NF4 rounding depends on the TP size"
                )

        t = job.training
        skips = recorded_skips(job.checkpoint.save)  # (a restart after a rollback, before or after a save)
        train_ds, valid_ds, test_ds, validates = run_datasets(source, job, ctx.dp.size, state, log, data_log, skips)
        rampup = t.rampup_batch_size is not None
        train_batches = Batches(train_ds, job, ctx, job.data.num_workers, rampup=rampup)
        flops_per_sample = flops_per_token(job.model, t.seq_length, frozen=job.lora is not None) * t.seq_length
        peak = peak_flops(ctx.device, job.optimizer.bf16 or job.optimizer.fp16)
        start_time = time.time()
        first_iteration = state.iteration  # (a rerun past its --train-iters trains nothing: nothing to save)
        if state.iteration >= t.train_iters:
            log.info(f"already at iteration {state.iteration} of --train-iters {t.train_iters}: nothing to train")
        window = _new_window()
        reported_memory = None  # (Megatron's report_memory line, after the first logged interval)
        metrics = None
        ck = job.checkpoint
        signalled = exiting = False
        guard = Supervisor(job.resilience, job.optimizer.check_for_nan_in_loss_and_grad, ctx, log, exit_signal, ddp)
        guard.load_state_dict(state.guards)
        if skips:
            guard.skip_samples.update(skips)
            log.info(f"earlier rollbacks of this job skip the batches at samples {skips} ({SKIPS} in --save)")
        saver = (
            AsyncSaver(ck.save, ctx, ck.ckpt_keep_last, ck.save_retain_interval) if ck.save and ck.async_save else None
        )
        parts = dict(save_optim=not ck.no_save_optim, save_rng=not ck.no_save_rng)
        saved: set[int] = set()  # iterations this job saved: the checkpoints a rollback may go back to
        np_saver = non_persistent.Saver(ck, ctx) if ck.save and ck.non_persistent_save_interval else None

        def save() -> None:
            with saving(ck.save):
                _save()

        def _save() -> None:
            saved.add(state.iteration)
            state.guards = guard.state_dict()
            if saver is not None:
                if previous := saver.save(state, model, optimizer, scheduler, job.checkpoint_dict(), **parts):
                    log.info(f"saved {previous} (async)")
                log.info(f"iteration {state.iteration}: async save started")
            else:
                path = save_checkpoint(
                    ck.save,
                    state,
                    model,
                    optimizer,
                    scheduler,
                    ctx,
                    job.checkpoint_dict(),
                    keep_last=ck.ckpt_keep_last,
                    retain_interval=ck.save_retain_interval,
                    **parts,
                )
                log.info(f"saved {path}")

        # (its time limit: every rank asks at the same point, as Megatron's evaluate())
        timed = bool(t.exit_duration_in_mins)  # (0 sets no limit, as Megatron's truth test)
        evaluator = Evaluator(job, ctx, model, ddp, optimizer, log, lambda: timed and over_time(t, job_start, ctx))

        def evaluate(dataset, kind: str, final: bool = False) -> bool:
            return evaluator(state, dataset, kind, final)

        profiler = ProfileWindow(job.logging, ctx.rank, ctx.device.type == "cuda", log=log.info)
        if t.skip_train:
            log.info(f"--skip-train: evaluating the model at iteration {state.iteration}, no training")
        batch_was = train_batches.gbs(state.consumed_samples)
        while state.iteration < t.train_iters and not t.skip_train:
            if saver is not None:
                with saving(ck.save):
                    if path := saver.poll():
                        log.info(f"saved {path} (async)")
            if np_saver is not None:  # (a non-persistent save in flight)
                np_saver.poll(log)
            if rampup and (batch := train_batches.gbs(state.consumed_samples)) != batch_was:  # (Megatron's train())
                batch_was = batch
                if ck.save and state.iteration and state.iteration not in saved:  # (not twice: a --save-interval's)
                    log.info(f"the global batch grows to {batch_was} (--rampup-batch-size): saving first")
                    save()
            while guard.skip_batch(state.consumed_samples):  # a rollback's offending batch
                log.info(f"skipping the batch at sample {state.consumed_samples} (rolled back past it)")
                state.consumed_samples += train_batches.gbs(state.consumed_samples)
            if skip_iteration(job.iterations_to_skip, state, train_batches.gbs(state.consumed_samples), log):
                continue
            start = time.time()
            if recorder is not None:  # (its step, then the logging, evaluation or save after it)
                recorder.where = f"iteration {state.iteration + 1}"
            profiler.before_step(state.iteration)
            guard.before_iteration(state.iteration + 1)
            tic = time.time()
            batches = train_batches.get(state.consumed_samples)
            data_time = time.time() - tic
            with guard.during_step(state.iteration + 1, model):
                metrics = train_step(
                    ddp,
                    optimizer,
                    scheduler,
                    batches,
                    ctx,
                    job.logging.log_memory_breakdown,
                    log_params_norm=job.logging.log_params_norm,
                    log_num_zeros_in_grad=job.logging.log_num_zeros_in_grad,
                )
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            try:
                action = guard.after_step(
                    state.iteration + 1, state.consumed_samples, metrics, ddp, time.time() - start
                )
            except TrainingHalted:  # (every rank halts at this point) a save in flight is published first
                finish_async_save(saver, log)
                raise
            if action == ROLLBACK:
                record_skips(ck.save, guard.skip_samples, ctx.rank)
                finish_async_save(saver, log)  # it may be the checkpoint to go back to
                state = rollback(
                    job, model, optimizer, scheduler, ctx, log, state, ckpt_path, base_path, saved, np_saver
                )
                batch_was = train_batches.gbs(state.consumed_samples)  # (the batch it went back to: no growth)
                guard.after_rollback(state.guards)
                continue
            step_gbs = train_batches.gbs(state.consumed_samples)
            state.iteration += 1
            state.consumed_samples += step_gbs
            profiler.after_step(state.iteration)
            window["samples"] += step_gbs
            # (a skipped iteration's loss, non-finite, is not averaged in: Megatron's training_log counts it apart;
            # nor is the NaN of a global batch without loss-bearing tokens)
            has_loss = metrics.updated and metrics.num_tokens > 0
            window["loss"] += metrics.lm_loss if has_loss else 0.0
            window["losses"] += 1 if has_loss else 0
            if metrics.num_tokens == 0:  # (MoE's auxiliary losses, which count no label, still train the router)
                m = job.model
                balancing = (m.moe_aux_loss_coeff or 0) > 0 and m.moe_router_load_balancing_type != "none"
                aux = m.num_experts and (balancing or (m.moe_z_loss_coeff or 0) > 0)
                rest = "only the MoE auxiliary losses' gradients" if aux else "zero gradients"
                log.info(f"iteration {state.iteration}: every label of the global batch is masked: no loss, {rest}")
            # Megatron's "mtp_1 loss", ... (over steps with tokens), its MoE losses
            losses = {f"mtp_{k + 1}_loss": v for k, v in enumerate(metrics.mtp_losses or []) if v is not None}
            losses = {**(losses if metrics.updated else {}), **moe_stats.log_losses(metrics.moe, job.model)}
            for k, v in losses.items():
                window["means"].setdefault(k, []).append(v)
            own = {  # (the step's own values, as the window's line shows its last step's)
                "lr": metrics.lr,
                **({"decoupled_lr": metrics.decoupled_lr} if metrics.decoupled_lr is not None else {}),
                "grad_norm": metrics.grad_norm,
                "loss_scale": metrics.loss_scale,
                "global_batch_size": step_gbs,
                "consumed_samples": state.consumed_samples,
                **({"skipped_samples": state.skipped_samples} if state.skipped_samples else {}),
                **({"params_norm": metrics.params_norm} if metrics.params_norm is not None else {}),
                **({"num_zeros_in_grad": metrics.num_zeros_in_grad} if metrics.num_zeros_in_grad is not None else {}),
                **({"max_attention_logit": mal} if (mal := metrics.max_attention_logit) is not None else {}),
            }
            # (a skipped step's own loss too, as Megatron's training_log writes its loss_dict every iteration: an
            # fp16 run's loss-scale warm-up is plotted from iteration 1; only the window's mean leaves it out)
            step_loss = {"lm_loss": metrics.lm_loss} if metrics.num_tokens > 0 else {}
            per_layer = moe_stats.step_layer_losses(metrics.moe, job.model) if job.logging.moe_per_layer_logging else {}
            log.step(state.iteration, {**step_loss, **losses, **own, **per_layer})
            # Megatron's "number of nan iterations" (with the NaN check on, its own count replaces this)
            window["nan"] += metrics.num_tokens > 0 and not math.isfinite(metrics.lm_loss)
            window["n"] += 1
            window["time"] += time.time() - tic
            window["data"] += data_time
            window["skipped"] += 0 if metrics.updated else 1
            window["step"] += metrics.step_seconds
            window["comm"] += metrics.comm_exposed_seconds
            if state.iteration % t.log_interval == 0:
                mem = memory.peak_and_rss(ctx.device)
                if job.logging.log_memory_breakdown:
                    mem.update(memory.breakdown(model, ddp, optimizer, metrics.activation_bytes))
                mem = memory.largest_over_ranks(mem, ctx)  # (a collective: every rank is here)
                if not reported_memory and ctx.dp.rank == 0:  # Megatron's, once, from each model-parallel rank
                    reported_memory = memory.report_memory(f"(after {state.iteration} iterations)", ctx.device)
                    if reported_memory:
                        print(f"[Rank {ctx.rank}] {reported_memory}", flush=True)
                it_time = window["time"] / window["n"]
                tflops = flops_per_sample * window["samples"] / window["time"] / ctx.world_size / 1e12
                log.log(
                    state.iteration,
                    {
                        # (none when every step was skipped, rather than Megatron's 0 or a NaN)
                        "lm_loss": window["loss"] / window["losses"] if window["losses"] else None,
                        **{k: sum(v) / len(v) for k, v in window["means"].items()},
                        **own,
                        "iteration_time": it_time,
                        "tokens_per_sec": window["samples"] * t.seq_length / window["time"],  # (the job's)
                        "tokens_per_sec_per_gpu": window["samples"] * t.seq_length / window["time"] / ctx.world_size,
                        "tflops_per_gpu": tflops,
                        "mfu": tflops * 1e12 / peak if peak else None,
                        "data_time_fraction": window["data"] / window["time"],
                        "comm_exposed_fraction": window["comm"] / window["step"] if window["step"] else 0.0,
                        "skipped_iterations": window["skipped"],
                        "nonfinite_iterations": window["nan"],
                        **moe_stats.log_metrics(metrics.moe, job.model, job.logging.moe_per_layer_logging),
                        **guard.log_metrics(),
                        **mem,
                    },
                )
                window = _new_window()
            if valid_ds is not None and validates and state.iteration % t.eval_interval == 0:
                evaluate(valid_ds, "validation")
            if ck.save and ck.save_interval and state.iteration % ck.save_interval == 0:
                save()
            elif np_saver is not None and non_persistent.save_due(ck, state.iteration):
                with saving(np_saver.root, np_saver.flag):
                    state.guards = guard.state_dict()
                    np_saver.save(state, model, optimizer, scheduler, job.checkpoint_dict(), log, **parts)
            if should_exit(t, state.iteration, job_start, ctx):
                # saved and gone, as Megatron's checkpoint_and_decide_exit: no final evaluation to outlast a time limit
                log.info(f"exiting at iteration {state.iteration} (--exit-interval / --exit-duration-in-mins)")
                exiting = True
                break
            if guard.should_exit():
                log.info(f"{job.resilience.exit_signal} received: saving at iteration {state.iteration} and exiting")
                if not ck.save:
                    log.info("no --save: exiting without a checkpoint")
                signalled = True
                break
        profiler.close()  # a window the run ended inside
        if recorder is not None:  # (what a rank that holds up the final barrier is said to be doing)
            recorder.where = "finishing (the final save and evaluation, then closing the logs)"
        # As Megatron's pretrain(): the final save, then the validation set and the test set
        if exiting and np_saver is not None and np_saver.covers_exit(state.iteration):
            log.info(f"iteration {state.iteration} was just saved non-persistently: no exit save (as Megatron)")
        elif ck.save and not t.skip_train and not (ck.save_interval and state.iteration % ck.save_interval == 0):
            # (Megatron saves iteration != 0 again, recording this run's shorter --train-iters, which a later --load
            # alone inherits: a run that trained nothing leaves --save's own checkpoint of it as it is; one loaded
            # from elsewhere, another --load or a non-persistent one, is saved into --save, as Megatron does)
            own = ckpt_path is not None and same_directory(os.path.dirname(ckpt_path), ck.save)
            if state.iteration != first_iteration or (state.iteration > 0 and not own):
                save()
            elif state.iteration > 0:
                log.info(f"--save {ck.save} already holds iteration {state.iteration}: nothing saved")
        finish_async_save(saver, log)
        if np_saver is not None:
            np_saver.poll(log, wait=True)
        if validates and not signalled and not exiting:
            # (also when just evaluated, as Megatron: its next batches; a time limit reached there ends both)
            in_time = valid_ds is None or evaluate(valid_ds, "validation", final=True)
            if test_ds is not None and in_time and t.eval_iters > 0:
                evaluate(test_ds, "test", final=True)
        log.info(f"done: iteration {state.iteration}, {time.time() - start_time:.1f} s")
        leave_together = True
    except BaseException as e:
        exit_code = 3 if isinstance(e, TrainingHalted) else 1
        leave_together = isinstance(e, TrainingHalted)  # (every rank halts at the same point)
        if isinstance(e, TrainingHalted) and job.checkpoint.save and ctx.rank == 0:
            mark_halted(job.checkpoint.save, str(e))
        raise
    finally:
        if train_batches is not None:  # (its data-loading processes: see Batches.close)
            train_batches.close()
        log.close(exit_code=exit_code)
        if exit_signal is not None:  # (the handler this run installed; an in-process caller gets its own back)
            exit_signal.restore()
        leave(recorder, together=leave_together)  # (the final barrier, then the recorder uninstalled)
    if signalled:  # every rank says so: the launcher reports the signal, not its workers' exit codes
        saved_it = "saved and exiting" if job.checkpoint.save else "exiting without a checkpoint (no --save)"
        print(f"[rank {ctx.rank}] {saved_it} with code 0 after {job.resilience.exit_signal}", flush=True)
    return 0


def _found(ckpt_path: str | None, source, job: JobConfig, rank: int) -> dict:
    """The checkpoint this rank starts from (a local non-persistent one named alike on every rank) and the sizes of
    the data files it reads."""
    found = non_persistent.agreed_name(job.checkpoint, ckpt_path, rank)
    files = {}
    for _, prefix in source.prefixes:
        for path in (prefix + ".idx", prefix + ".bin", prefix):
            if os.path.isfile(path):
                files[path] = os.path.getsize(path)
    return {"starting_checkpoint": found, "data_file_sizes": files}


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    finally:
        # however it ended, every group is destroyed and what held one (FSDP2's state, in cycles) collected now:
        # a gloo group left to the interpreter's shutdown can abort the finished process (destroy_process_groups)
        destroy_process_groups()
        gc.collect()
        determinism.leave_deterministic_mode()


def _main(argv: list[str] | None) -> int:
    ns = None
    try:
        ns, job = parse_args(argv)
        inject.parse(os.environ.get(inject.ENV))  # (a malformed fault to inject: one line, before any group)
        if job.dry_run:
            from megatron_lite.training.dry_run import dry_run

            ckpt = None
            try:  # (the run would refuse; a dry run on a machine without the --load base says so and goes on)
                ckpt = starting_checkpoint(job, lambda *_: None)[1]
                check_qlora_base(job, ckpt)
            except ConfigError as e:
                if not job.checkpoint.load:
                    raise
                print(f"note: on this machine the run would stop: {e}", flush=True)
            for line in accepted_no_ops(ns):  # (what the run would say of the flags, said before its plan)
                print(line, flush=True)
            return dry_run(job, ckpt)
        return run(job, accepted_no_ops(ns))
    except ConfigError as e:
        # (once per node: it was said by every rank, twice in two forms; a value it names that came from the
        # checkpoint is said to, as the layout's checks run past parse_args)
        if getattr(ns, "decrease_batch_size_if_needed", False) and "is not divisible by --micro-batch-size" in str(e):
            # (the flag given for exactly this case: said to be unsupported, not only once the run goes ahead)
            e = ConfigError(f"{e} (--decrease-batch-size-if-needed is not supported: the batch is never decreased)")
        report_error(with_origin(e, ns), dist.is_initialized())
        return 2
    except SaveFailed as e:  # (every rank failed at the same point: none waits in a collective)
        print(line := f"error (rank {os.environ.get('RANK', '0')}): {e}", file=sys.stderr, flush=True)
        record_for_launcher(line)  # (torchrun's "Root Cause" shows it)
        return 1
    except TrainingHalted as e:  # (every rank halted at the same point and left run's final barrier together)
        print(line := f"halted (rank {os.environ.get('RANK', '0')}): {e}", file=sys.stderr, flush=True)
        record_for_launcher(line)
        return 3
    except Exception as e:
        if not peer_lost(e):
            raise
        rank = os.environ.get("RANK", "0")
        print(
            f"error (rank {rank}): a peer rank left a collective ({peer_lost(e)}): another rank exited or its node "
            "failed; the first failing rank's log says why",
            file=sys.stderr,
            flush=True,
        )
        return 1
