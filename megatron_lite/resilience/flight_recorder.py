"""A flight recorder of collectives: every rank remembers its recent collectives (operation, group,
shapes, call site) and counts them per group; a watchdog thread turns a collective that has not completed
within the timeout into a report naming which ranks wait in which collective and which rank is missing
(has not reached it) or ahead (went past it), then ends the process so the launcher tears the job down.

Each rank publishes its state to the job's key-value store (the one init_process_group rendezvoused
through) once a second from the watchdog thread, so the report can be built while the main thread is
blocked in C++. Collectives are recorded by wrapping torch.distributed's functions, which every
collective in megatron_lite goes through; asynchronous ones are recorded when started and their waits
when waited on."""

from __future__ import annotations

import collections
import contextlib
import inspect
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from megatron_lite.parallel_context import attempt_id

WRAPPED = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather_single",  # torch >= 2.13's names for the two above (absent before: skipped)
    "reduce_scatter_single",
    "all_to_all_single",
    "all_gather",
    "all_gather_object",  # (the QLoRA start-up log and the NaN-halt message gather this way; its inner all_gathers
    # go through torch's module-level functions, not these attributes, so it is recorded once)
    "broadcast",
    "barrier",
    "batch_isend_irecv",
    "send",
    "recv",
)
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))  # shown paths are relative to the checkout
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


P2P = ("batch_isend_irecv", "send", "recv")
# collectives whose tensors have the same shapes on every rank (an all-to-all's splits, an object gather's
# sizes may differ): different shapes in one of these are a mismatch
SAME_SHAPES = (
    "all_reduce", "broadcast", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter_single",
)  # fmt: skip


def _counter(op: str, group: str) -> str:
    """What a rank counts an entry under: its group's ranks, point-to-point exchanges apart. A pipeline stage
    makes more exchanges than its peers (a middle stage both receives and sends), and a set of peers can be a
    group's ranks too (three stages and the world, two and the tied-embedding group): counted together, the
    collective counts compared across ranks drifted, and a rank waiting in the right collective read as gone
    past it."""
    return f"p2p:{group}" if op in P2P else group


@dataclass
class Entry:
    group: str  # the group's global ranks, e.g. "0,1"
    seq: int  # this rank's count of collectives on that group, this one included
    op: str
    shapes: list
    site: str
    start: float
    end: float | None = None

    def describe(self) -> str:
        return f"#{self.seq} {self.op} on ranks [{self.group}] {self.shapes} at {self.site}"


def _site(depth: int = 2) -> str:
    """Where the collective was asked for: the first `depth` callers outside torch and this module (the
    communication helper, then the code that called it)."""
    frame, found = sys._getframe(2), []
    while frame is not None and len(found) < depth:
        path = frame.f_code.co_filename
        if not (path.startswith(_TORCH) or path.startswith(_HERE)):
            shown = os.path.relpath(path, _ROOT) if path.startswith(_ROOT) else path
            found.append(f"{shown}:{frame.f_lineno} ({frame.f_code.co_name})")
        frame = frame.f_back
    return " <- ".join(found) or "?"


def _shapes(args) -> list:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(list(a.shape))
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], dist.P2POp):
            out.append([f"{op.op.__name__}->{op.peer}:{list(op.tensor.shape)}" for op in a])
    return out


class _Work:
    """An asynchronous collective's handle: its wait is timed like a blocking collective."""

    def __init__(self, work, recorder: FlightRecorder, entry: Entry) -> None:
        self._work, self._recorder, self._entry = work, recorder, entry

    def wait(self, *args, **kwargs):
        with self._recorder._inside(self._entry, waiting=True):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


@dataclass
class _State:
    counts: dict = field(default_factory=dict)  # group -> seq of the last collective entered there
    last: dict = field(default_factory=dict)  # group -> the last collective entered there


def _own_store():
    """A store client of our own: a TCPStore client is not safe to share between threads, and the main
    thread's one is what gloo exchanges addresses through (sharing it broke torchrun restarts). Falls
    back to the default store where the job has no TCP store to connect to."""
    from datetime import timedelta

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (host and port):
        return dist.distributed_c10d._get_default_store()
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False)
    return dist.PrefixStore(
        f"megatron_lite/flight_recorder/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{attempt_id()}", client
    )


_INSTALLED: list[FlightRecorder] = []


def installed() -> FlightRecorder | None:
    return _INSTALLED[-1] if _INSTALLED else None


class FlightRecorder:
    def __init__(self, timeout_s: float, history: int = 64, store=None, exit_on_hang: bool = True) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout_s = timeout_s
        self.history: collections.deque[Entry] = collections.deque(maxlen=history)
        self.store = store if store is not None else _own_store()
        self.exit_on_hang = exit_on_hang
        self.state = _State()
        self._lock = threading.Lock()
        # the collective being waited in (entry, since when, whether in an async wait), None while computing
        self._current: tuple[Entry, float, bool] | None = None
        self._originals: dict = {}
        self._group_at: dict = {}  # op -> the position of its group argument
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.report: str | None = None
        self.where: str | None = None  # what the job is doing (the training loop's iteration), as reports say it

    # Recording ---------------------------------------------------------------------------------
    def _group_key(self, group) -> str:
        if group is None or group is dist.group.WORLD:
            return ",".join(map(str, range(self.world)))
        return ",".join(map(str, dist.get_process_group_ranks(group)))

    def _enter(self, op: str, args, kwargs) -> Entry:
        at = self._group_at.get(op)  # a group passed by position counts as one passed by name
        group = kwargs.get("group", args[at] if at is not None and len(args) > at else None)
        if op == "batch_isend_irecv":
            ops = args[0] if args else kwargs.get("p2p_op_list", [])
            group = ops[0].group if ops else None
            key = ",".join(sorted({str(self.rank)} | {str(o.peer) for o in ops}, key=int))
        else:
            key = self._group_key(group)
        counter = _counter(op, key)
        with self._lock:
            seq = self.state.counts.get(counter, 0) + 1
            entry = Entry(key, seq, op, _shapes(args), _site(), time.time())
            self.state.counts[counter] = seq
            self.state.last[counter] = entry  # described when published, not on every collective
            self.history.append(entry)
        return entry

    @contextlib.contextmanager
    def _inside(self, entry: Entry, waiting: bool = False):
        with self._lock:
            self._current = (entry, time.time(), waiting)
        try:
            yield
        finally:
            with self._lock:
                entry.end = time.time()
                self._current = None

    def _wrap(self, name: str, fn):
        recorder = self

        def wrapper(*args, **kwargs):
            fn = recorder._originals[name]  # looked up per call: the fault injector may swap it
            entry = recorder._enter(name, args, kwargs)
            if kwargs.get("async_op") or name == "batch_isend_irecv":
                with recorder._inside(entry):  # starting one can block too
                    works = fn(*args, **kwargs)
                if works is None:
                    return None
                if isinstance(works, list):
                    return [_Work(w, recorder, entry) for w in works]
                return _Work(works, recorder, entry)
            with recorder._inside(entry):
                return fn(*args, **kwargs)

        wrapper.__wrapped__ = fn
        return wrapper

    def install(self) -> FlightRecorder:
        for name in WRAPPED:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._originals[name] = fn
            try:
                params = list(inspect.signature(fn).parameters)
            except (TypeError, ValueError):  # (no signature to read: the group is taken by name only)
                params = []
            self._group_at[name] = params.index("group") if "group" in params else None
            setattr(dist, name, self._wrap(name, fn))
        self._thread = threading.Thread(target=self._watch, name="megatron_lite-flight-recorder", daemon=True)
        self._thread.start()
        _INSTALLED.append(self)
        return self

    def uninstall(self) -> None:
        self._stop.set()
        if self in _INSTALLED:
            _INSTALLED.remove(self)
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # Publishing and watching -------------------------------------------------------------------
    def _snapshot(self) -> dict:
        with self._lock:
            cur = self._current
            return {
                "rank": self.rank,
                "time": time.time(),
                "counts": dict(self.state.counts),
                "last": {k: e.describe() for k, e in self.state.last.items()},
                "current": None if cur is None else {**asdict(cur[0]), "since": cur[1], "waiting": cur[2]},
                "where": self.where,
            }

    def _publish(self) -> None:
        now = time.monotonic()
        if now < getattr(self, "_publish_after", 0.0):
            return
        try:
            self.store.set(f"megatron_lite/flight_recorder/{self.rank}", json.dumps(self._snapshot()))
            self._publish_wait = 0.5
        except Exception:  # the store gone (at shutdown, or with the first node's agent): tried again less and
            # less often, each failed try being torch's C++ stack trace in the log (one a second, a whole run)
            self._publish_wait = min(2 * getattr(self, "_publish_wait", 0.5), 60.0)
            self._publish_after = now + self._publish_wait

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            self._publish()
            with self._lock:
                cur = self._current
            if cur is not None and time.time() - cur[1] > self.timeout_s:
                self.report = self.build_report(cur[0], time.time() - cur[1])
                print(self.report, file=sys.stderr, flush=True)
                if self.exit_on_hang:
                    os._exit(1)
                return

    def _peers(self) -> dict[int, dict] | None:
        """Every rank's published state; None where the store failed or did not answer within STORE_WAIT_S (an
        exploratory run: with the store's host frozen, a read held the watchdog, and the job, forever; with it
        gone, every rank, this one too, was reported as having published nothing)."""
        out: dict[int, dict] = {}
        failed: list[BaseException] = []

        def read() -> None:
            for r in range(self.world):
                try:
                    if self.store.check([f"megatron_lite/flight_recorder/{r}"]):
                        out[r] = json.loads(self.store.get(f"megatron_lite/flight_recorder/{r}"))
                except Exception as e:  # (the store, not a rank: every later read would fail the same way)
                    failed.append(e)
                    return

        reader = threading.Thread(target=read, name="megatron_lite-flight-recorder-read", daemon=True)
        reader.start()
        reader.join(STORE_WAIT_S)
        return None if reader.is_alive() or failed else out

    def build_report(self, entry: Entry, waited: float) -> str:
        """Who waits in `entry`, who has not reached it and who went past it, from every rank's state. The peers'
        states are read twice, LIVENESS_S apart: one that did not change comes from a rank that stopped publishing
        (hosts' clocks are never compared). This rank's own is the one it had when the hang was found (read back
        later, after a peer's exit aborted its collective, it contradicted the report's first line)."""
        mine = self._snapshot()
        self._publish()
        first = self._peers()
        peers = None
        if first is not None:
            time.sleep(LIVENESS_S)
            self._publish()
            peers = self._peers()
        recent = "; ".join(e.describe() for e in list(self.history)[-5:])
        if peers is None:
            return store_lost_report(self.rank, self.timeout_s, entry, waited, mine) + (
                f"\nrank {self.rank}'s last collectives: {recent}"
            )
        peers[self.rank] = mine
        frozen = {r for r, p in peers.items() if r != self.rank and first.get(r, {}).get("time") == p["time"]}
        return hang_report(self.rank, self.timeout_s, entry, waited, peers, frozen) + (
            f"\nrank {self.rank}'s last collectives: {recent}"
        )


def leave(recorder: FlightRecorder | None, together: bool) -> None:
    """The end of a job. With `together` (every rank ends the run at this point: done, or halted), a barrier of the
    world still watched by `recorder`, so a rank that died or is stuck at its end is reported at the timeout: this
    barrier came after the recorder was uninstalled and waited, unexplained, for gloo's longer timeout. Then the
    recorder is uninstalled, whatever happened (its watchdog would otherwise outlive the run, in an in-process
    caller's next)."""
    try:
        if together and dist.is_initialized():
            if recorder is not None:
                recorder.where = "the job's final barrier (every rank leaves together)"
            dist.barrier()
    finally:
        if recorder is not None:
            recorder.uninstall()


# A live rank's watchdog publishes every second: a state unchanged over this long is a frozen or lost rank's
LIVENESS_S = 3.0
# A store read that takes longer is a store whose host is frozen or lost
STORE_WAIT_S = 10.0


def store_lost_report(rank: int, timeout_s: float, entry: Entry, waited: float, mine: dict) -> str:
    """The report of a rank stuck in `entry` that cannot read the other ranks' states: the job's store failed or
    did not answer, so its host is frozen, lost or gone (under torchrun the first node's agent hosts it, and
    exits when a rank there fails)."""
    where = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    at = f" at {where[0]}:{where[1]}" if all(where) else ""
    during = mine.get("where")
    return (
        f"hang: rank {rank} has waited {waited:.0f} s (--distributed-timeout-minutes {timeout_s / 60:g}) in "
        f"collective {entry.describe()}" + (f", in {during}" if during else "") + "\n"
        f"  the job's store{at} did not answer within {STORE_WAIT_S:g} s or failed: its host is frozen, lost or "
        "gone (under torchrun, the first node's agent hosts it and exits when a rank there fails: that node's log "
        "says why); the other ranks' states cannot be read\n"
        f"summary: rank {rank} waits in {entry.op} #{entry.seq} on ranks [{entry.group}]; whoever has not reached "
        "it is on a node whose store or ranks stopped"
    )


def _root(
    entry: Entry, waited: float, peers: dict[int, dict], frozen: frozenset | set = frozenset()
) -> tuple[Entry, float, int | None]:
    """The collective the hang began in. A rank that skipped one goes on to wait in the next collective of
    the group, possibly before the others reach the one it skipped, so its watchdog may fire first: when a
    member waits in an earlier collective of the same group, the report is about that one, whichever
    rank's watchdog writes it. Returns the entry, how long it has been waited in, and who waits in it
    (None: this rank). A frozen rank's old state is not where the hang began: it stopped there."""
    best: tuple[Entry, float, int | None] = (entry, waited, None)
    for r in (int(m) for m in entry.group.split(",")):
        if r in frozen:
            continue
        cur = (peers.get(r) or {}).get("current")
        comparable = cur and entry.op not in P2P and cur["op"] not in P2P  # (exchanges' counts never compare)
        if comparable and cur["group"] == entry.group and cur["seq"] < best[0].seq:
            fields = {k: cur[k] for k in Entry.__dataclass_fields__ if k in cur}
            best = (Entry(**fields), peers[r]["time"] - cur["since"], r)
    return best


def hang_report(
    rank: int,
    timeout_s: float,
    entry: Entry,
    waited: float,
    peers: dict[int, dict],
    frozen: frozenset | set = frozenset(),
) -> str:
    """The report of rank `rank`, stuck `waited` seconds in `entry`, from every rank's published state. The
    ranks in `frozen` stopped publishing (a live one republishes every second): frozen (SIGSTOP, a call holding
    the interpreter) or their host lost, their last state only where they stopped."""
    root, root_waited, waiter = _root(entry, waited, peers, frozen)
    who = rank if waiter is None else waiter
    during = (peers.get(who) or {}).get("where")
    lines = [
        f"hang: rank {who} has waited {root_waited:.0f} s (--distributed-timeout-minutes "
        f"{timeout_s / 60:g}) in collective {root.describe()}" + (f", in {during}" if during else "")
        + ("" if waiter is None else f" (reported by rank {rank}, which waits {waited:.0f} s in the later "
           f"#{entry.seq} {entry.op} of that group)")
    ]  # fmt: skip
    entry = root  # the rest describes every member against the collective the hang began in
    members = [int(r) for r in entry.group.split(",")]
    missing, ahead, waiting, elsewhere, unresponsive, mismatched = [], [], [], [], [], []
    for r in members:
        p = peers.get(r)
        if p is None:
            lines.append(f"  rank {r}: no state published (still starting up, or gone)")
            missing.append(r)
            continue
        if r in frozen:
            unresponsive.append(r)
            lines.append(
                f"  rank {r}: UNRESPONSIVE: published nothing in {LIVENESS_S:g} s (frozen, or its host lost); "
                f"last seen {_where(p)}"
            )
            continue
        n = p["counts"].get(_counter(entry.op, entry.group), 0)
        cur = p["current"]
        where = _where(p)
        if entry.op in P2P and r != who:
            # A point-to-point exchange is keyed by each rank's own peers, so counts do not line up across ranks:
            # a peer is either in an exchange of its own now or elsewhere.
            (waiting if cur and cur["op"] in P2P else missing).append(r)
            lines.append(f"  rank {r}: now {where}")
        elif cur and _counter(cur["op"], cur["group"]) == _counter(entry.op, entry.group) and cur["seq"] == entry.seq:
            # waiting in it, whatever came after: an asynchronous launch of the next one (overlapped gradient
            # buckets) raises the count first
            same_shapes = entry.op not in SAME_SHAPES or cur["shapes"] == entry.shapes
            if entry.op not in P2P and (cur["op"] != entry.op or not same_shapes):
                mismatched.append(r)
                lines.append(
                    f"  rank {r}: MISMATCH: called {cur['op']} {cur['shapes']} as #{entry.seq} on this group, "
                    f"where rank {who} called {entry.op} {entry.shapes}: {where}"
                )
            else:
                waiting.append(r)
                lines.append(f"  rank {r}: {where}")
        elif n < entry.seq:
            missing.append(r)
            last = p["last"].get(_counter(entry.op, entry.group), "none")
            lines.append(f"  rank {r}: MISSING: has not entered #{entry.seq} on this group (last: {last}); now {where}")
        elif n > entry.seq:
            ahead.append(r)
            lines.append(f"  rank {r}: AHEAD: went past #{entry.seq} on this group to #{n}; now {where}")
        elif r != who and not (cur and _counter(cur["op"], cur["group"]) == _counter(entry.op, entry.group)):
            # entered it and is now outside it: a blocking collective left without the others, or an asynchronous
            # one started and not yet waited for
            elsewhere.append(r)
            lines.append(f"  rank {r}: ENTERED #{entry.seq} on this group and is now outside it: {where}")
        else:
            waiting.append(r)
            lines.append(f"  rank {r}: {where}")
    if entry.op in P2P:
        lines.append(
            f"summary: rank {who} waits in {entry.op} #{entry.seq} with ranks [{entry.group}]"
            + (
                f"; rank(s) {[r for r in waiting if r != who]} wait in exchanges of their own"
                if len(waiting) > 1
                else ""
            )
            + (f"; rank(s) {missing} are in no point-to-point exchange" if missing else "")
        )
    else:
        lines.append(
            f"summary: ranks {waiting} wait in {entry.op} #{entry.seq} on ranks [{entry.group}]"
            + (f"; rank(s) {mismatched} called a different collective there (MISMATCH)" if mismatched else "")
            + (f"; rank(s) {missing} never reached it" if missing else "")
            + (f"; rank(s) {ahead} skipped it and went ahead" if ahead else "")
            + (
                f"; rank(s) {elsewhere} entered it and are now outside it (left it without the others, or started "
                "it asynchronously and wait elsewhere)"
                if elsewhere
                else ""
            )  # fmt: skip
        )
    if unresponsive:
        # (republished once a second: a rank still computing may have gone on for up to a second after it)
        lines[-1] += (
            f"; rank(s) {unresponsive} stopped responding (their last state was published up to a second before "
            "they stopped)"
        )
    # (a peer in a point-to-point exchange of its own may itself wait on a third rank: followed too)
    follow = missing + elsewhere + ([r for r in waiting if r != who] if entry.op in P2P else [])
    return "\n".join(lines + _chain(entry, follow, peers, frozen))


def _where(p: dict) -> str:
    cur, during = p["current"], f" ({p['where']})" if p.get("where") else ""
    if not cur:
        return f"computing (in no collective){during}"
    waited = p["time"] - cur["since"]
    return f"waiting for {waited:.0f} s in #{cur['seq']} {cur['op']} on ranks [{cur['group']}] at {cur['site']}{during}"


def _chain(
    entry: Entry, missing: list[int], peers: dict[int, dict], frozen: frozenset | set = frozenset()
) -> list[str]:
    """Where the missing ranks are held up: a rank that never reached the collective may itself wait in one of
    another group (a pipeline send, an expert all-to-all) that some other rank has not entered. Follows those
    waits from group to group, so the report ends at the rank that holds everything up. In a point-to-point
    exchange (keyed by each rank's own peers, so counts do not compare) every peer not in an exchange of its
    own is named."""
    # each wait once (a rank followed again finds its own wait seen): cycles end
    lines, seen, todo = [], {(_counter(entry.op, entry.group), entry.seq)}, list(missing)
    while todo:
        r = todo.pop(0)
        cur = (peers.get(r) or {}).get("current")
        if not cur or (_counter(cur["op"], cur["group"]), cur["seq"]) in seen:
            continue
        seen.add((_counter(cur["op"], cur["group"]), cur["seq"]))
        held = []
        for m in (int(x) for x in cur["group"].split(",")):
            if m == r:
                continue
            p = peers.get(m)
            if p is None:
                held.append(f"rank {m}, which published no state (still starting up, or gone)")
                continue
            if m in frozen:
                held.append(f"rank {m}, which stopped responding (frozen, or its host lost)")
                continue
            nxt = p["current"]
            if cur["op"] in P2P:
                stuck = not nxt or nxt["op"] not in P2P
            else:
                stuck = p["counts"].get(cur["group"], 0) < cur["seq"]
            if stuck:
                held.append(
                    f"rank {m}, which "
                    + (f"waits in #{nxt['seq']} {nxt['op']} on ranks [{nxt['group']}]" if nxt else "is computing")
                )
                todo.append(m)
        if held:
            lines.append(
                f"  held up by: rank {r} waits in #{cur['seq']} {cur['op']} on ranks [{cur['group']}] at "
                f"{cur['site']}, not yet entered by {'; '.join(held)}"
            )
    return lines
