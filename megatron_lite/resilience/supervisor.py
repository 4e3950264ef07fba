"""What the training loop asks of the resilience features, in one place: before and around each step
(fault injection), after it (non-finite loss or gradient, loss spikes: what --nan-policy and
--spiky-loss-policy say to do), at each log interval (straggler report) and at each iteration boundary
(the exit signal). Every decision that changes what ranks do next is taken by all ranks together."""

from __future__ import annotations

import hashlib
import json
import math

import torch
import torch.distributed as dist

from megatron_lite.resilience.guards import ExitSignal, LargeValueDetector, SpikeDetector, non_finite
from megatron_lite.resilience.inject import Injector
from megatron_lite.resilience.straggler import describe, straggler_report
from megatron_lite.training.configs import ResilienceConfig

OK, SKIPPED, ROLLBACK = "ok", "skipped", "rollback"


class TrainingHalted(RuntimeError):
    """--nan-policy halt (or nothing to roll back to): the message says where and what."""


def check_config_agreement(config: dict, device: torch.device, error: str | None = None) -> None:
    """Every rank must run the same configuration; a rank launched with other flags would otherwise meet the
    others in mismatched collectives. One all-gather of a hash, before any training collective. `error`: this
    rank's one-line start-up failure (a directory its node cannot write), raised on every rank: alone, it left
    the other nodes waiting here until the timeout, then a hang report that did not say why."""
    from megatron_lite.config import ConfigError

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if error:
            raise ConfigError(error)
        return
    # where each node keeps its dataset indices is its own (a node-local --data-cache-path differs by node)
    if isinstance(config.get("data"), dict) and "data_cache_path" in config["data"]:
        config = {**config, "data": {k: v for k, v in config["data"].items() if k != "data_cache_path"}}
    # nor is where the weights came from (checkpoint/origin.py): an old checkpoint's is found on each node's files
    config = {k: v for k, v in config.items() if k != "origin"}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).digest()
    mine = torch.tensor([int.from_bytes(digest[:7], "big"), int(bool(error))], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    hashes = [int(t[0]) for t in every]
    if any(int(t[1]) for t in every):  # (every rank takes this branch)
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        failed = [r for r, e in enumerate(errors) if e]
        also = f"; ranks {failed} failed so" if len(failed) > 1 else ""
        raise ConfigError(f"{errors[failed[0]]} (rank {failed[0]}{also})")
    if len(set(hashes)) > 1:
        # (every rank takes this branch: the configurations themselves are gathered to name what differs; a
        # hash alone left "different configurations" to guess, where the flags were the same and one rank's
        # file system held another checkpoint)
        configs = [None] * dist.get_world_size()
        dist.all_gather_object(configs, _flat(config))
        keys = sorted({k for c in configs for k in c if len({repr(c.get(k)) for c in configs}) > 1})
        parts = []
        for k in keys[:3]:
            groups: dict[str, list[int]] = {}
            for r, c in enumerate(configs):
                groups.setdefault(repr(c.get(k))[:80], []).append(r)
            parts.append(f"{k}: " + "; ".join(f"ranks {rs}: {v}" for v, rs in groups.items()))
        more = f"; and {len(keys) - 3} more" if len(keys) > 3 else ""
        raise ConfigError(
            f"the ranks were launched with different configurations or see different files ({' | '.join(parts)}"
            f"{more}): launch every rank with the same flags, on the same data and checkpoints"
        )


def _flat(config: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}: the names a difference is reported by."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class Supervisor:
    def __init__(
        self, config: ResilienceConfig, check_nan: bool, ctx, log, exit_signal: ExitSignal | None = None, ddp=None
    ) -> None:
        """`ddp`: the data-parallel wrapper, told to note its local bucket norms under --check-for-large-grads."""
        self.config, self.check_nan, self.ctx, self.log = config, check_nan, ctx, log
        # (Megatron's report_stats mode only measures determinism: its validate_result checks nothing)
        checking = config.check_for_large_grads and config.rerun_mode != "report_stats"
        self.large = LargeValueDetector(threshold=10.0, num_samples=100) if checking else None
        if checking and hasattr(ddp, "check_large"):
            ddp.check_large()
        self.first_iteration_complete = False  # (validate_results checks none of this process's first iteration)
        self.injector = Injector(ctx.rank)
        self.spikes = (
            SpikeDetector(config.spiky_loss_window, config.spiky_loss_zscore) if config.check_for_spiky_loss else None
        )
        self.exit = exit_signal  # (installed by the job at start-up, and put back by it)
        self.skip_samples: set[int] = set()  # batches (by consumed-samples position) a rollback skips
        self.rollbacks_without_progress = 0  # rollbacks since training last got past the previous one
        self.rollback_point = -1
        self.window = {"step": 0.0, "compute": 0.0, "n": 0, "spikes": 0, "zscore": 0.0, "nonfinite": 0, "large": 0}

    # Around the step ---------------------------------------------------------------------------
    def before_iteration(self, iteration: int) -> None:
        self.injector.before_iteration(iteration)

    def during_step(self, iteration: int, model: torch.nn.Module):
        return self.injector.during_step(iteration, model)

    def skip_batch(self, consumed_samples: int) -> bool:
        """True when a rollback marked the batch starting at this position as one to skip."""
        return consumed_samples in self.skip_samples

    def after_step(self, iteration: int, consumed_before: int, metrics, ddp, seconds: float) -> str:
        """OK, SKIPPED (the update was not applied) or ROLLBACK; raises TrainingHalted under --nan-policy halt.
        `seconds`: this rank's whole iteration (data and host work included): less the time it spent blocked
        in communication, it is the rank's own work, which a straggler has more of."""
        self.window["step"] += seconds
        self.window["compute"] += seconds - metrics.comm_exposed_seconds
        self.window["n"] += 1
        # (a global batch without one loss-bearing token has no loss, NaN, and no token gradients: not a fault)
        loss = metrics.lm_loss if metrics.num_tokens > 0 else 0.0
        if self.large is not None:  # (before the reduction: whatever the reduced loss and norm turn out to be)
            self._large_grads(iteration, ddp)
        if self.check_nan and non_finite(loss, metrics.grad_norm):
            self.window["nonfinite"] += 1
            return self._non_finite(iteration, consumed_before, metrics, ddp)
        if self.spikes is not None and (z := self.spikes.observe(metrics.lm_loss)) is not None:
            self.window["spikes"] += 1
            self.window["zscore"] = max(self.window["zscore"], z)
            self.log.info(
                f"iteration {iteration}: loss spike: lm_loss {metrics.lm_loss:.4f} is {z:.1f} standard deviations "
                f"above the last {len(self.spikes.losses)} iterations' mean"
            )
            if self.config.spiky_loss_policy == "rollback":
                return self._rollback(iteration, consumed_before, f"a loss spike (z-score {z:.1f})")
        if self.spikes is not None and self.spikes.rebased:
            self.spikes.rebased = False
            self.log.info(
                f"iteration {iteration}: the loss stayed above the spike bound for {len(self.spikes.losses)} "
                "iterations: that level is the spike check's history now"
            )
        return OK

    def _large_grads(self, iteration: int, ddp) -> None:
        """--check-for-large-grads: Megatron's check_grads on this rank's local bucket norms (taken before each
        reduction), through is_unexpectedly_large (threshold 10, the largest of the first 100 norms). Megatron's
        check is not fatal: with --rerun-mode disabled it logs a warning and goes on; with validate_results (its
        default) it re-runs the iteration to tell a transient fault from a reproducible result and goes on in
        both cases. Without a re-run engine both come to a report (said by every rank that found one, through the
        logging rank) and the same training. validate_results checks nothing in this process's first iteration,
        and stops at an iteration's first rejected norm (the re-run is requested then)."""
        norms = ddp.take_local_norms() if hasattr(ddp, "take_local_norms") else []
        validate = self.config.rerun_mode == "validate_results"
        found = []
        if self.first_iteration_complete or not validate:
            for bucket, norm in norms:
                if validate and self.check_nan and not math.isfinite(norm):
                    break  # (the NaN check's rejection comes first and requests the re-run)
                was_sampled = self.large.sampled
                if self.large.is_unexpectedly_large(norm):
                    found.append(
                        f"iteration {iteration}: rank {self.ctx.rank}: found unexpected large grads in {bucket} before "
                        f"the data-parallel reduction: local norm {norm:.6g} >= 10 x {self.large.max_value:.6g}, the "
                        f"largest of the first {self.large.num_samples} bucket norms (--check-for-large-grads; "
                        "reported, training goes on)"
                    )
                    if validate:
                        break
                elif self.large.sampled and not was_sampled:
                    self.log.info(
                        f"--check-for-large-grads: rank {self.ctx.rank}'s max value for grads: "
                        f"{self.large.max_value:.6g} (its bound is 10 x that)"
                    )
        self.first_iteration_complete = True
        every = [found]
        if dist.is_initialized() and dist.get_world_size() > 1:  # (the logging rank says every rank's)
            count = torch.tensor([float(len(found))], device=self.ctx.device)
            dist.all_reduce(count)
            if count.item() > 0:
                every = [None] * dist.get_world_size()
                dist.all_gather_object(every, found)
        for lines in every:
            for line in lines:
                self.log.info(line)
            self.window["large"] += len(lines)

    MAX_ROLLBACKS = 3  # in a row without getting past the previous failure: the cause is not one batch

    def _rollback(self, iteration: int, consumed_before: int, what: str) -> str:
        if iteration > self.rollback_point:
            self.rollbacks_without_progress = 0
        self.rollbacks_without_progress += 1
        self.rollback_point = max(self.rollback_point, iteration)
        if self.rollbacks_without_progress > self.MAX_ROLLBACKS:
            raise TrainingHalted(
                f"iteration {iteration}: {what} again after {self.MAX_ROLLBACKS} rollbacks that skipped the offending "
                "batches: the cause is not a single batch; halting (inspect the last checkpoint)"
            )
        self.skip_samples.add(consumed_before)
        return ROLLBACK

    def _non_finite(self, iteration: int, consumed_before: int, metrics, ddp) -> str:
        # the values that are not finite, the others beside them ("non-finite lm_loss 5.59" read as a contradiction)
        values = {"lm_loss": metrics.lm_loss, "grad norm": metrics.grad_norm}
        bad = [k for k, v in values.items() if v is not None and not math.isfinite(v)]
        good = [f"{k} {v:.6g}" for k, v in values.items() if v is not None and k not in bad]
        what = " and ".join(f"{k} ({values[k]})" for k in bad) + (f" ({', '.join(good)})" if good else "")
        policy = self.config.nan_policy
        if policy == "skip":
            if getattr(metrics, "updated", False):  # (the optimizer skips on the gradients: finite ones were applied)
                self.log.info(
                    f"iteration {iteration}: non-finite {what}: the gradients were finite and the update was applied"
                )
                return OK
            self.log.info(f"iteration {iteration}: non-finite {what}: update skipped on every rank (--nan-policy skip)")
            return SKIPPED
        if policy == "rollback":
            action = self._rollback(iteration, consumed_before, f"non-finite {what}")  # (or the halt: said alone)
            self.log.info(
                f"iteration {iteration}: non-finite {what}: rolling back to the last checkpoint and skipping the "
                f"batch at sample {consumed_before} (--nan-policy rollback)"
            )
            return action
        raise TrainingHalted(self.halt_message(iteration, what, ddp))

    def halt_message(self, iteration: int, what: str, ddp) -> str:
        """Which ranks' own gradients were non-finite, and in which parameter first (gathered everywhere)."""
        mine = ddp.first_nonfinite_param() if hasattr(ddp, "first_nonfinite_param") else None
        every = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        bad = [(r, name) for r, name in enumerate(every) if name is not None]
        where = (
            "; ".join(f"rank {r}: first in {name}" for r, name in bad)
            if bad
            else "no rank's own gradient was non-finite (the loss itself, or an overflow in the reduction)"
        )
        return (
            f"iteration {iteration}: non-finite {what}; halting every rank (--nan-policy halt). "
            f"Non-finite local gradients: {where}"
        )

    # Log interval and iteration boundary -------------------------------------------------------
    def log_metrics(self) -> dict:
        """Metrics for this log interval's record (and the straggler line on the console)."""
        w, out = self.window, {}
        if self.spikes is not None:
            out.update(loss_spikes=w["spikes"], loss_spike_max_zscore=w["zscore"])
        if self.check_nan:
            out["nonfinite_iterations"] = w["nonfinite"]
        if self.large is not None:
            out["large_grads"] = w["large"]
        if self.config.log_straggler and w["n"]:
            report = straggler_report(w["step"] / w["n"], w["compute"] / w["n"], self.ctx.device, self.ctx.pp.rank)
            self.log.info(describe(report))
            out.update({k: v for k, v in report.items() if k != "straggler_peers"})
        self.window = {"step": 0.0, "compute": 0.0, "n": 0, "spikes": 0, "zscore": 0.0, "nonfinite": 0, "large": 0}
        return out

    def should_exit(self) -> bool:
        return self.exit is not None and self.exit.should_exit(self.ctx)

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the guards: the loss-spike check's history, so that a run restarted from it
        checks the next iterations as the run that saved it did (with an empty history it missed a spike the
        uninterrupted run rolled back from, and checked nothing for the window's first half)."""
        if self.spikes is None:
            return {}
        return {"spike_losses": list(self.spikes.losses), "spike_in_a_row": list(self.spikes.in_a_row)}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's guard state (state_dict); an older checkpoint's none: an empty history."""
        if self.spikes is not None:
            self.spikes.reset()
            self.spikes.losses.extend(float(x) for x in state.get("spike_losses", []))  # (the newest `window`)
            self.spikes.in_a_row = [float(x) for x in state.get("spike_in_a_row", [])]

    def after_rollback(self, state: dict) -> None:
        """Back at a checkpoint: its guard state, as a run restarted from it has (not the iterations rolled back)."""
        self.load_state_dict(state)
