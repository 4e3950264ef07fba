"""Megatron's non-persistent checkpoints (--non-persistent-save-interval, --non-persistent-ckpt-type): frequent
checkpoints of which only the newest is kept, for restarts after a failure, beside the persistent ones of --save.

They are checkpoints of ours (safetensors + JSON, checksums, atomic publish) in another directory:

- global: one job's checkpoint in --non-persistent-global-ckpt-dir (default <save>/non_persistent, read back from
  <load>/non_persistent), as Megatron's, each save deleting the one before it once it is published.
- local: each rank's files in its own node-local directory, <--non-persistent-local-ckpt-dir>/<rank>/iter_N, as
  nvidia-resiliency-ext's LocalCheckpointManager lays them out. Each rank writes everything it loads back (the
  pieces its data-parallel replicas share the writing of otherwise, the tensors its tensor-parallel peers hold
  alike), so a restart reads its own directory only: Megatron's 'atomic' algorithm. Its 'fully_parallel' (the
  replicas' pieces written once, exchanged at load) is accepted and stored the same way. They are only valid for
  the layout that wrote them (LAYOUT, and a sharded optimizer's parts: _optimizer_share): under another, the run
  starts from the persistent checkpoint, saying so, as Megatron's find_latest finds no local checkpoint every
  rank holds. The ranks take the newest iteration all of them hold (agree).

At start-up the newer of the persistent checkpoint and the non-persistent one is loaded (the non-persistent one
at the same iteration, as Megatron's `non_persistent_iteration >= iteration`).
"""

from __future__ import annotations

import dataclasses
import os

from megatron_lite.checkpoint import checkpointing as ckpt
from megatron_lite.checkpoint.atomic import atomic_write_json, atomic_write_text, replace_dir
from megatron_lite.checkpoint.format import (
    NON_PERSISTENT_SUBDIR,
    TRACKER,
    _delete,
    _sweep_leftovers,
    complete_iterations,
    file_digest,
    iteration_dir,
)
from megatron_lite.checkpoint.lookup import _whole, find_checkpoint, read_metadata
from megatron_lite.config import ConfigError

SUBDIR = NON_PERSISTENT_SUBDIR
# what makes each rank's share of a local checkpoint its own: another value of any changes what a rank holds
LAYOUT = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "pipeline_layout",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


def validate(ck) -> None:
    """The start-up checks of a CheckpointConfig's non-persistent flags (one line each)."""
    interval, kind = ck.non_persistent_save_interval, ck.non_persistent_ckpt_type
    if interval is not None and interval < 0:
        raise ConfigError(f"--non-persistent-save-interval {interval} must be >= 0 (0: no non-persistent saves)")
    if kind == "in_memory":  # (Megatron's save raises NotImplementedError for it at the first non-persistent save)
        raise ConfigError(
            "--non-persistent-ckpt-type in_memory is not supported (Megatron refuses it too at its first "
            "non-persistent save); use global or local"
        )
    if interval and kind is None:  # (Megatron's first non-persistent save stops the run)
        raise ConfigError(
            f"--non-persistent-save-interval {interval} needs --non-persistent-ckpt-type global (a directory, "
            "default <save>/non_persistent) or local (with --non-persistent-local-ckpt-dir)"
        )
    if interval and not ck.save:  # (Megatron's checkpoint_and_decide_exit saves none without --save: said here)
        raise ConfigError(
            f"--non-persistent-save-interval {interval} needs --save DIR: Megatron saves non-persistent "
            "checkpoints only with --save (the global ones default to <save>/non_persistent)"
        )
    if kind == "local" and not ck.non_persistent_local_ckpt_dir:
        raise ConfigError(
            "--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir DIR (a node-local directory: "
            "each rank writes DIR/<rank>)"
        )


def check_local_layout(job) -> None:
    """A rank's local files hold all it loads, except the last pipeline stage's copy of the word embeddings (tied
    ones, or multi-token prediction's), which only the first stage stores: refused at start-up."""
    m, pp = job.model, job.parallel.pipeline_model_parallel_size
    if job.checkpoint.non_persistent_ckpt_type == "local" and pp > 1 and (m.tied_embeddings or m.mtp_num_layers):
        why = "tied embeddings" if m.tied_embeddings else f"--mtp-num-layers {m.mtp_num_layers}"
        raise ConfigError(
            f"--non-persistent-ckpt-type local with --pipeline-model-parallel-size {pp} and {why}: the last stage's "
            "copy of the word embeddings is stored by the first stage only, so the last stage's own files could "
            "not restore it; use --non-persistent-ckpt-type global"
            + (", or --untie-embeddings-and-output-weights" if m.tied_embeddings and not m.mtp_num_layers else "")
        )


def global_dir(ck, root: str | None) -> str | None:
    """Where global non-persistent checkpoints lie for a job saving to (or loading from) `root`."""
    if ck.non_persistent_global_ckpt_dir:
        return ck.non_persistent_global_ckpt_dir
    return os.path.join(root, SUBDIR) if root else None


def local_dir(ck, rank: int) -> str:
    return os.path.join(ck.non_persistent_local_ckpt_dir, str(rank))


def save_due(ck, iteration: int) -> bool:
    """Megatron's checkpoint_and_decide_exit: a non-persistent save at a multiple of its interval where no
    persistent one is made."""
    every = ck.non_persistent_save_interval
    persistent = ck.save_interval and iteration % ck.save_interval == 0
    return bool(ck.save and ck.non_persistent_ckpt_type and every and iteration % every == 0 and not persistent)


def _layout(config: dict, world_size: int) -> dict:
    """What decides a rank's share of a local checkpoint, from a job's config (as a checkpoint records it)."""
    parallel = config.get("parallel", {})
    out = {k: parallel.get(k) for k in LAYOUT}
    if out["expert_tensor_parallel_size"] is None:  # (its default: TP)
        out["expert_tensor_parallel_size"] = out["tensor_model_parallel_size"]
    out = {"world_size": world_size, **{k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}}
    return {**out, **_optimizer_share(config.get("optimizer", {}), config.get("training", {}))}


def _optimizer_share(optim: dict, training: dict) -> dict:
    """What decides which part of the optimizer state (and, under FSDP2, of the weights) a rank holds under a
    sharded optimizer (commit 46d9e64: each rank writes only its own): the distributed optimizer's part of every
    gradient bucket (the buckets' bounds: --ddp-bucket-size where buckets are cut, with --overlap-grad-reduce or
    ZeRO-2; else one per buffer: distributed/ddp.py), FSDP2's shard of every parameter, dist_muon's parameters
    (a split by bytes of state, which the weights' dtype changes). The data-parallel size is the world size's."""
    out = {"use_distributed_optimizer": bool(optim.get("use_distributed_optimizer")),
           "use_torch_fsdp2": bool(optim.get("use_torch_fsdp2")),
           "optimizer": "dist_muon" if optim.get("optimizer") == "dist_muon" else "not dist_muon",
           "ddp_bucket_size": None, "params_dtype": None}  # fmt: skip
    if out["use_distributed_optimizer"]:
        bucketed = training.get("overlap_grad_reduce") or (optim.get("zero_stage") or 1) >= 2
        size = training.get("ddp_bucket_size")
        out["ddp_bucket_size"] = (size or "the default") if bucketed else "one bucket (no --overlap-grad-reduce)"
    if out["optimizer"] == "dist_muon":
        out["params_dtype"] = "bf16" if optim.get("bf16") else "fp16" if optim.get("fp16") else "fp32"
    return out


def _layout_diff(meta: dict, job) -> str:
    """How the layout `meta`'s checkpoint was saved under differs from this job's ('' when it is the same)."""
    saved = _layout(meta["config"], meta["layout"].get("world_size"))
    now = _layout(dataclasses.asdict(job), int(os.environ.get("WORLD_SIZE", "1")))
    moot = ("ddp_bucket_size", "params_dtype")  # (None: no part of what decides the shares, as without a sharding)
    differ = [k for k in now if saved.get(k) != now[k] and not (k in moot and None in (saved.get(k), now[k]))]
    return ", ".join(f"{k} {saved.get(k)} then, {now[k]} now" for k in differ)


def local_iterations(ck, job, rank: int, say) -> list[int]:
    """This rank's complete local checkpoints saved under this job's layout (oldest first). Those of another
    layout are passed over with a note naming the difference (the newest only)."""
    root = local_dir(ck, rank)
    # (its complete ones, as nvidia-resiliency-ext scans them; the tracker is not read: one naming an iteration
    # the others never published, or one rank's unreadable file, stops no rank alone before the others connect)
    found, other = [], None
    for it in reversed(complete_iterations(root) if os.path.isdir(root) else []):
        diff = _layout_diff(read_metadata(_whole(iteration_dir(root, it))), job)
        if not diff:
            found.append(it)
        elif other is None:
            other = (it, diff)
    if other and not found:
        say(
            f"the local non-persistent checkpoint {iteration_dir(root, other[0])} (iteration {other[0]}) was saved "
            f"under another layout ({other[1]}): local checkpoints load only under theirs; starting from the "
            "persistent checkpoint"
        )
    return sorted(found)


def newest(job, root: str | None, rank: int, say) -> str | None:
    """The newest non-persistent checkpoint this rank could start from (a job loading `root`), or None. A local
    one is this rank's own: agree() settles on one every rank holds once they are connected."""
    ck = job.checkpoint
    kind = ck.non_persistent_ckpt_type
    if kind == "global":
        where = global_dir(ck, root)
        return find_checkpoint(where, own=True, flag="--non-persistent-global-ckpt-dir") if where else None
    if kind != "local":
        return None
    mine = local_iterations(ck, job, rank, say)
    return _whole(iteration_dir(local_dir(ck, rank), mine[-1])) if mine else None


def is_non_persistent(ck, path: str | None) -> bool:
    """Whether `path` is a non-persistent checkpoint of this job's (a later save of the run deletes it)."""
    if not path or not ck.non_persistent_ckpt_type:
        return False
    parent = os.path.realpath(os.path.dirname(path))
    global_roots = {os.path.realpath(r) for r in (global_dir(ck, ck.load), global_dir(ck, ck.save)) if r}
    local = ck.non_persistent_local_ckpt_dir
    return parent in global_roots or bool(local and os.path.dirname(parent) == os.path.realpath(local))


def pick(persistent: str | None, non_persistent: str | None, say) -> str | None:
    """The newer of the two (the non-persistent one at the same iteration, as Megatron)."""
    if non_persistent is None:
        return persistent
    mine = read_metadata(non_persistent)["iteration"]
    if persistent is not None and read_metadata(persistent)["iteration"] > mine:
        say(f"the non-persistent checkpoint {non_persistent} (iteration {mine}) is older than {persistent}: not used")
        return persistent
    say(f"resuming from the non-persistent checkpoint {non_persistent} (iteration {mine})")
    return non_persistent


def agreed_name(ck, path: str | None, rank: int) -> str | None:
    """`path` as every rank names it (a local checkpoint lies in each rank's own directory)."""
    if path and ck.non_persistent_ckpt_type == "local" and os.path.dirname(path) == local_dir(ck, rank):
        return os.path.join(ck.non_persistent_local_ckpt_dir, "<rank>", os.path.basename(path))
    return path


def agree(job, ckpt_path: str | None, rank: int, say) -> str | None:
    """Once the ranks are connected, the local checkpoint every rank holds, as Megatron's find_latest: the newest
    iteration each rank has complete (a rank killed before publishing N still holds N - interval, as does every
    other: that one), then the newer of it and the persistent checkpoint; that one alone when they have none in
    common (a node's disk replaced). Said once, here: what each rank found alone was only its own."""
    ck = job.checkpoint
    if ck.non_persistent_ckpt_type != "local" or ck.ckpt_step is not None:
        return ckpt_path
    import torch.distributed as dist

    mine = local_iterations(ck, job, rank, lambda *_: None)  # (the notes were said at start-up)
    found = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
    common = set.intersection(*(set(f) for f in found))
    persistent = find_checkpoint(ck.load, own=True) if ck.load else None
    if common:
        return pick(persistent, _whole(iteration_dir(local_dir(ck, rank), max(common))), say)
    if any(found):
        groups: dict[tuple, list[int]] = {}  # (the ranks alike, once: thousands of ranks hold the same)
        for r, f in enumerate(found):
            groups.setdefault(tuple(f), []).append(r)
        have = "; ".join(f"{_ranks(rs)}: {list(f) or 'none'}" for f, rs in groups.items())
        say(
            f"the ranks hold no local non-persistent checkpoint of the same iteration ({have}): starting from the "
            f"persistent checkpoint {persistent or '(none: from scratch)'}"
        )
    return persistent


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"{len(ranks)} ranks ({ranks[0]}, {ranks[1]}, ...)"


class _OwnShare:
    """A rank's view of the layout for writing a local checkpoint: no data-parallel replica shares the writing
    and every tensor-parallel rank writes the tensors they hold alike, so its files hold all it loads back."""

    class _Alone:
        rank, size = 0, 1

    def __init__(self, ctx) -> None:
        self._ctx = ctx
        self.tp = self.etp = self.dp_cp = self.edp = self._Alone()

    def __getattr__(self, name):
        return getattr(self._ctx, name)


class LocalSaver(ckpt.AsyncSaver):
    """Local non-persistent checkpoints: every rank writes and publishes its own iteration directory (after all
    have written theirs), then deletes its older ones. Synchronous saves are `save` then `finish`."""

    def __init__(self, root: str, ctx) -> None:
        super().__init__(root, ctx)
        self.share_ctx = _OwnShare(ctx)

    def _prepare(self, iteration: int) -> str:
        return ckpt._prepare_tmp(self.root, iteration, self.ctx, own_root=True)

    def _publish(self, tmp: str, meta: dict) -> str:
        index = f"index_r{self.ctx.rank:05d}.json"
        # ("local": each rank reads its own files alone, so it checks all of them, not a share of the world's)
        meta = {**meta, "local": True, "files": {index: file_digest(os.path.join(tmp, index))["sha256"]}}
        atomic_write_json(os.path.join(tmp, "metadata.json"), meta)
        final = iteration_dir(self.root, meta["iteration"])
        replace_dir(tmp, final)
        atomic_write_text(os.path.join(self.root, TRACKER), str(meta["iteration"]))
        return final

    def _published(self, final: str) -> None:
        """Every rank has published: the older ones go (nvidia-resiliency-ext's cleanup after find_latest), and
        what saves killed part-way left (a rank's iter_N.tmp, GBs on a real run, found by no later save)."""
        done = int(os.path.basename(final).removeprefix("iter_"))
        _sweep_leftovers(self.root, done)
        for old in complete_iterations(self.root):
            if old != done:
                _delete(iteration_dir(self.root, old))


class Saver:
    """This job's non-persistent saves (every rank calls each method at the same points)."""

    def __init__(self, ck, ctx) -> None:
        self.ck, self.ctx = ck, ctx
        self.saved: set[int] = set()  # the iterations this job saved (a rollback may go back to those)
        # (the flag a failed save names)
        self.flag = (
            "--non-persistent-local-ckpt-dir"
            if ck.non_persistent_ckpt_type == "local"
            else ("--non-persistent-global-ckpt-dir" if ck.non_persistent_global_ckpt_dir else "--save")
        )
        if ck.non_persistent_ckpt_type == "local":
            self.root = local_dir(ck, ctx.rank)
            self.saver = LocalSaver(self.root, ctx)
        else:
            self.root = global_dir(ck, ck.save)
            self.saver = ckpt.AsyncSaver(self.root, ctx, keep_last=1) if ck.async_save else None

    def save(self, state, model, optimizer, scheduler, job_dict: dict, log, **parts) -> None:
        self.saved.add(state.iteration)
        if self.saver is None:  # global, synchronous
            path = ckpt.save_checkpoint(
                self.root, state, model, optimizer, scheduler, self.ctx, job_dict, keep_last=1, **parts
            )
            log.info(f"saved {path} (non-persistent)")
            return
        if previous := self.saver.save(state, model, optimizer, scheduler, job_dict, **parts):
            log.info(f"saved {previous} (non-persistent, async)")
        if self.ck.async_save:
            log.info(f"iteration {state.iteration}: async non-persistent save started")
        elif path := self.saver.finish():
            log.info(f"saved {path} (non-persistent)")

    def covers_exit(self, iteration: int) -> bool:
        """Megatron's checkpoint_and_decide_exit makes no exit save (--exit-interval, --exit-duration-in-mins)
        right after a non-persistent save of that iteration: a restart loads that one. So for global ones (the
        shared file system); a local one lies on the node's own disk, where a requeued job may not land: saved
        persistently too (docs/fault_tolerance.md)."""
        return self.ck.non_persistent_ckpt_type == "global" and iteration in self.saved

    def newest_saved(self, upto: int) -> tuple[int, str] | None:
        """(iteration, path) of the newest of this job's non-persistent saves still on disk at or below `upto`
        (each save deletes the one before it)."""
        have = [i for i in complete_iterations(self.root) if i <= upto and i in self.saved]
        return (have[-1], _whole(iteration_dir(self.root, have[-1]))) if have else None

    def poll(self, log, wait: bool = False) -> None:
        from megatron_lite.training.saving import saving

        with saving(self.root, self.flag):  # (a failed write: one line naming the directory)
            if self.saver is not None and (path := self.saver.poll(wait)):
                log.info(f"saved {path} (non-persistent, async)")
