"""Pipeline schedules as data.

`build_schedule(pp, vp, num_microbatches, rank)` returns the ordered list of actions one rank performs in
one training step: forwards and backwards of micro-batch m on model chunk c, and the sends and receives
that connect them. A small executor (executor.py) runs the list; here everything is pure, so schedules
can be printed (`python -m megatron_lite.pipeline_parallel.schedules 4 2 8`) and checked without processes.

Stages: chunk c on pipeline rank r is virtual stage s = c * pp + r (Megatron's interleaved placement).
Stage s receives activations from stage s - 1 and gradients from stage s + 1.

Communication order: between two ranks, messages are received in exactly the order they were sent (NCCL
matches point-to-point messages by order, not by tag), so before a compute step needs message X from a
peer, the receiver takes every earlier message of that peer first and keeps it until it is needed. The
executor posts the communication between two computes (or up to a FLUSH) as one batch_isend_irecv, and
under NCCL a batch completes only when every operation in it meets its partner in the partner's batch then
running (a send may block until its receive is posted; a rank's batches run one after another). 1F1B's
receives, placed just before the compute that needs them, meet that. The interleaved schedule's would not
(a rank's send to the previous stage waits in a batch that its neighbour's own send queues behind), so
there the communication goes in rounds, as Megatron pairs its batches: every rank runs its next compute if
its input is there, then each message computed goes out in the round that follows and its receiver posts
the receive in that same round (FLUSH ends a rank's batch of a round). `check_schedules` proves for a whole
pipeline that every send meets its receive in order, that nobody waits forever with buffered sends (gloo),
and that the batches complete under NCCL's rule.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass

FORWARD, BACKWARD = "F", "B"
SEND_FORWARD, RECV_FORWARD, SEND_BACKWARD, RECV_BACKWARD = "SF", "RF", "SB", "RB"
FLUSH = "X"  # the communication listed since the last compute or FLUSH goes out as one batch
COMM = (SEND_FORWARD, RECV_FORWARD, SEND_BACKWARD, RECV_BACKWARD)


@dataclass(frozen=True)
class Action:
    kind: str  # F, B, SF (send activation), RF (receive activation), SB (send gradient), RB (receive gradient)
    microbatch: int
    chunk: int  # the model chunk on this rank the data belongs to
    peer: int = -1  # pipeline rank of the other side, for communication

    def __str__(self) -> str:
        if self.kind == FLUSH:
            return "|"  # (the end of a batch of messages)
        peer = f"@{self.peer}" if self.peer >= 0 else ""
        return f"{self.kind}{self.microbatch}.{self.chunk}{peer}"


class ScheduleError(ValueError):
    pass


def validate(pp: int, vp: int, num_microbatches: int, group: int | None = None) -> None:
    """`group`: --microbatch-group-size-per-virtual-pipeline-stage (default PP): the interleaved schedule runs
    micro-batches through each chunk in groups of that many; Megatron's rule: PP <= group <= micro-batches, and a
    last partial group (the remainder) of PP or more."""
    if pp < 1 or vp < 1 or num_microbatches < 1:
        raise ScheduleError(
            f"pipeline size {pp}, virtual stages {vp} and micro-batches {num_microbatches} must be >= 1"
        )
    g = group or pp
    if vp > 1 and (not pp <= g <= num_microbatches or 0 < num_microbatches % g < pp):
        if group is None:
            raise ScheduleError(
                f"the interleaved schedule needs the number of micro-batches ({num_microbatches}) to be a multiple "
                f"of --pipeline-model-parallel-size {pp}; use --global-batch-size so that global / (micro x "
                f"data-parallel) is a multiple of {pp}"
            )
        raise ScheduleError(
            f"--microbatch-group-size-per-virtual-pipeline-stage {g} with {num_microbatches} micro-batches: it must "
            f"lie in [--pipeline-model-parallel-size {pp}, {num_microbatches}] and leave a last group of 0 or at "
            f"least {pp} micro-batches ({num_microbatches} % {g} = {num_microbatches % g})"
        )


def compute_order(
    pp: int, vp: int, num_microbatches: int, rank: int, forward_only: bool = False, group: int | None = None
) -> list[tuple]:
    """The forwards and backwards of one rank, in order: (kind, microbatch, chunk). `group`: see validate."""
    validate(pp, vp, num_microbatches, group)
    m = num_microbatches
    if forward_only:
        return [(FORWARD, mb, c) for mb, c in _forward_sequence(pp, vp, m, group)]
    if pp == 1 and vp == 1:  # no pipelining: plain gradient accumulation
        return [step for mb in range(m) for step in ((FORWARD, mb, 0), (BACKWARD, mb, 0))]
    fwd = _forward_sequence(pp, vp, m, group)
    bwd = [(mb, vp - 1 - c) for mb, c in fwd]
    total = len(fwd)
    if vp == 1:
        warmup = min(pp - rank - 1, total)  # 1F1B: p - r - 1 forwards before the first backward
    else:
        warmup = min((pp - rank - 1) * 2 + (vp - 1) * (group or pp), total)  # Megatron's interleaved warm-up
    order = [(FORWARD, *fwd[k]) for k in range(warmup)]
    for k in range(total - warmup):
        order.append((FORWARD, *fwd[warmup + k]))
        order.append((BACKWARD, *bwd[k]))
    order += [(BACKWARD, *bwd[k]) for k in range(total - warmup, total)]
    return order


def _forward_sequence(pp: int, vp: int, m: int, group: int | None = None) -> list[tuple[int, int]]:
    """(microbatch, chunk) of the forwards: groups of `group` (default pp) micro-batches go through chunk 0, then
    chunk 1, ...; the last group holds the rest (Megatron's get_schedule_table)."""
    if vp == 1:
        return [(mb, 0) for mb in range(m)]
    g = group or pp
    return [(mb, c) for lo in range(0, m, g) for c in range(vp) for mb in range(lo, min(lo + g, m))]


def _neighbours(pp: int, vp: int, rank: int, chunk: int) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(rank, chunk) of the previous and next virtual stage, None at the ends of the pipeline."""
    stage = chunk * pp + rank
    prev = None if stage == 0 else ((stage - 1) % pp, (stage - 1) // pp)
    nxt = None if stage == pp * vp - 1 else ((stage + 1) % pp, (stage + 1) // pp)
    return prev, nxt


def _sends(pp: int, vp: int, rank: int, order: list[tuple]) -> dict[int, list[tuple]]:
    """Per destination rank, the messages this rank sends, in order: (kind, microbatch, destination chunk)."""
    out: dict[int, list[tuple]] = defaultdict(list)
    for kind, mb, c in order:
        prev, nxt = _neighbours(pp, vp, rank, c)
        if kind == FORWARD and nxt is not None:
            out[nxt[0]].append((RECV_FORWARD, mb, nxt[1]))
        if kind == BACKWARD and prev is not None:
            out[prev[0]].append((RECV_BACKWARD, mb, prev[1]))
    return out


def _rounds(pp: int, vp: int, orders: list[list[tuple]], forward_only: bool) -> list[list[Action]]:
    """Every rank's actions with the communication in global rounds: each rank runs its next compute if its
    input has arrived, then every message computed goes out, sent and received in the same round (a FLUSH
    ends each rank's part of a round). A rank's batch in round t meets only partners' batches of round t, so under
    NCCL's rule every round completes once the earlier ones have."""
    pos, out = [0] * pp, [[] for _ in range(pp)]
    arrived: list[set] = [set() for _ in range(pp)]
    outbox: list[list[tuple]] = [[] for _ in range(pp)]  # (send action, destination rank, receive action)
    while any(p < len(o) for p, o in zip(pos, orders)):
        progressed = False
        for r in range(pp):
            if pos[r] < len(orders[r]):  # one compute a round: its output goes out in the round that follows it
                kind, mb, c = orders[r][pos[r]]
                prev, nxt = _neighbours(pp, vp, r, c)
                need = (RECV_FORWARD, mb, c) if kind == FORWARD and prev else None
                need = (RECV_BACKWARD, mb, c) if kind == BACKWARD and nxt and not forward_only else need
                if need is not None and need not in arrived[r]:
                    continue
                out[r].append(Action(kind, mb, c))
                if kind == FORWARD and nxt is not None:
                    outbox[r].append((Action(SEND_FORWARD, mb, c, nxt[0]), nxt[0], (RECV_FORWARD, mb, nxt[1])))
                if kind == BACKWARD and prev is not None:
                    outbox[r].append((Action(SEND_BACKWARD, mb, c, prev[0]), prev[0], (RECV_BACKWARD, mb, prev[1])))
                pos[r] += 1
                progressed = True
        busy = set()
        for r in range(pp):  # (in each pair's order: a rank's sends to a peer go out in the order computed)
            for send, dest, (kind, mb, c) in outbox[r]:
                out[r].append(send)
                out[dest].append(Action(kind, mb, c, r))
                arrived[dest].add((kind, mb, c))
                busy |= {r, dest}
                progressed = True
            outbox[r].clear()
        for r in busy:
            out[r].append(Action(FLUSH, -1, -1))
        if not progressed:
            raise ScheduleError(f"no round makes progress: ranks wait at {[o[p : p + 1] for o, p in zip(orders, pos)]}")
    return out


def build_schedule(
    pp: int, vp: int, num_microbatches: int, rank: int, forward_only: bool = False, group: int | None = None
) -> list[Action]:
    orders = [compute_order(pp, vp, num_microbatches, r, forward_only, group) for r in range(pp)]
    if vp > 1 and pp > 1:
        return _rounds(pp, vp, orders, forward_only)[rank]
    incoming = {src: _sends(pp, vp, src, orders[src]).get(rank, []) for src in range(pp) if src != rank}
    if pp == 1:
        incoming = {0: _sends(pp, vp, 0, orders[0]).get(0, [])} if vp > 1 else {}
    taken = defaultdict(int)  # per source: how many of its messages have been received
    received = set()
    actions: list[Action] = []

    def receive(src: int, message: tuple) -> None:
        queue = incoming[src]
        while message not in received:
            kind, mb, c = queue[taken[src]]
            taken[src] += 1
            received.add((kind, mb, c))
            actions.append(Action(kind, mb, c, src))

    for kind, mb, c in orders[rank]:
        prev, nxt = _neighbours(pp, vp, rank, c)
        if kind == FORWARD and prev is not None:
            receive(prev[0], (RECV_FORWARD, mb, c))
        if kind == BACKWARD and nxt is not None and not forward_only:
            receive(nxt[0], (RECV_BACKWARD, mb, c))
        actions.append(Action(kind, mb, c))
        if kind == FORWARD and nxt is not None:
            actions.append(Action(SEND_FORWARD, mb, c, nxt[0]))
        if kind == BACKWARD and prev is not None:
            actions.append(Action(SEND_BACKWARD, mb, c, prev[0]))
    return actions


def send_releases(
    pp: int, vp: int, num_microbatches: int, rank: int, forward_only: bool = False, group: int | None = None
) -> dict[int, int]:
    """{index of a send in this rank's schedule: index of the receive after which that send has surely completed}.
    The peer consumes the message in a compute, and whatever it sends back afterwards was sent after its
    receive completed; once this rank has that reply, the send's buffer can go (gloo's sends report
    completion only when waited, so without this every sent tensor would live to the end of the step).
    Sends with no later reply (the step's last ones, a forward-only pipeline's) are absent."""
    scheds = [build_schedule(pp, vp, num_microbatches, r, forward_only, group) for r in range(pp)]

    def nth(acts: list[Action], kinds: tuple, peer: int) -> list[int]:
        return [i for i, a in enumerate(acts) if a.kind in kinds and a.peer == peer]

    out = {}
    mine = scheds[rank]
    for p in {a.peer for a in mine if a.kind in COMM}:
        theirs = scheds[p]
        sent, got = nth(mine, (SEND_FORWARD, SEND_BACKWARD), p), nth(theirs, (RECV_FORWARD, RECV_BACKWARD), rank)
        replies, replies_got = (
            nth(theirs, (SEND_FORWARD, SEND_BACKWARD), rank),
            nth(mine, (RECV_FORWARD, RECV_BACKWARD), p),
        )
        for send, recv in zip(sent, got):
            r = theirs[recv]
            compute = FORWARD if r.kind == RECV_FORWARD else BACKWARD
            used = next(
                j
                for j in range(recv, len(theirs))
                if theirs[j].kind == compute and (theirs[j].microbatch, theirs[j].chunk) == (r.microbatch, r.chunk)
            )
            k = next((n for n, j in enumerate(replies) if j > used), None)
            if k is not None:
                out[send] = replies_got[k]
    return out


def max_in_flight(actions: list[Action]) -> int:
    """The most micro-batch forwards whose backward has not run yet (activations kept alive)."""
    live = peak = 0
    for a in actions:
        if a.kind == FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.kind == BACKWARD:
            live -= 1
    return peak


def check_schedules(
    pp: int, vp: int, num_microbatches: int, forward_only: bool = False, group: int | None = None
) -> None:
    """Every forward precedes its backward; every send meets its receive on the peer, in the same order;
    the whole pipeline runs to the end with blocking receives and asynchronous sends (no deadlock)."""
    scheds = [build_schedule(pp, vp, num_microbatches, r, forward_only, group) for r in range(pp)]
    for r, acts in enumerate(scheds):
        seen = set()
        for a in acts:
            if a.kind == FORWARD:
                seen.add((a.microbatch, a.chunk))
            if a.kind == BACKWARD and (a.microbatch, a.chunk) not in seen:
                raise ScheduleError(f"rank {r}: backward of {a.microbatch}.{a.chunk} before its forward")
        expected = vp * num_microbatches
        for kind in (FORWARD,) + (() if forward_only else (BACKWARD,)):
            n = sum(a.kind == kind for a in acts)
            if n != expected:
                raise ScheduleError(f"rank {r}: {n} {kind} steps, expected {expected}")
    pairs: dict[tuple[int, int], list] = defaultdict(list)
    recvs: dict[tuple[int, int], list] = defaultdict(list)
    for r, acts in enumerate(scheds):
        for a in acts:
            if a.kind in (SEND_FORWARD, SEND_BACKWARD):
                _, nxt = _neighbours(pp, vp, r, a.chunk)
                prev, _ = _neighbours(pp, vp, r, a.chunk)
                dest_chunk = nxt[1] if a.kind == SEND_FORWARD else prev[1]
                msg = (RECV_FORWARD if a.kind == SEND_FORWARD else RECV_BACKWARD, a.microbatch, dest_chunk)
                pairs[(r, a.peer)].append(msg)
            if a.kind in (RECV_FORWARD, RECV_BACKWARD):
                recvs[(a.peer, r)].append((a.kind, a.microbatch, a.chunk))
    if set(pairs) != set(recvs):
        raise ScheduleError(f"pairs with sends {sorted(pairs)} differ from pairs with receives {sorted(recvs)}")
    for pair, sent in pairs.items():
        if sent != recvs[pair]:
            raise ScheduleError(f"rank {pair[0]} -> {pair[1]}: sends {sent} but receives {recvs[pair]}")
    _simulate(scheds)
    _simulate_batches(scheds)


def _batches(actions: list[Action]) -> list[list[Action]]:
    """A rank's communication as the executor posts it: what lies between two computes or FLUSHes."""
    out, current = [], []
    for a in actions:
        if a.kind in COMM:
            current.append(a)
        elif current:
            out.append(current)
            current = []
    return out + ([current] if current else [])


def _simulate_batches(scheds: list[list[Action]]) -> None:
    """NCCL's rule: a rank's batches run one after another, and an operation completes only when its partner
    is in the batch the peer is running; fail when no batch can complete."""
    batches, labelled = [_batches(s) for s in scheds], []
    for r, rank_batches in enumerate(batches):
        count: dict[tuple[int, int], int] = defaultdict(int)
        labelled.append([])
        for batch in rank_batches:
            ops = set()
            for a in batch:
                pair = (r, a.peer) if a.kind in (SEND_FORWARD, SEND_BACKWARD) else (a.peer, r)
                ops.add((pair, count[pair]))  # the pair's n-th message
                count[pair] += 1
            labelled[-1].append(ops)
    head, matched = [0] * len(scheds), set()
    while any(h < len(b) for h, b in zip(head, batches)):
        running = {r: labelled[r][h] for r, h in enumerate(head) if h < len(labelled[r])}
        # an operation completes once both sides' batches holding it run (the peer's: sum(pair) - r)
        new = {op for r, ops in running.items() for op in ops if op in running.get(sum(op[0]) - r, ())} - matched
        matched |= new
        done = [r for r, ops in running.items() if ops <= matched]
        if not done and not new:
            stuck = {r: [str(a) for a in batches[r][head[r]]] for r in running}
            raise ScheduleError(f"deadlock under grouped point-to-point (NCCL): ranks wait in {stuck}")
        for r in done:
            head[r] += 1


def _simulate(scheds: list[list[Action]]) -> None:
    """Run every rank's list with asynchronous sends and blocking receives; fail on a deadlock."""
    pos = [0] * len(scheds)
    sent: dict[tuple[int, int], int] = defaultdict(int)
    got: dict[tuple[int, int], int] = defaultdict(int)
    while any(p < len(s) for p, s in zip(pos, scheds)):
        progressed = False
        for r, acts in enumerate(scheds):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if a.kind in (RECV_FORWARD, RECV_BACKWARD):
                    if got[(a.peer, r)] >= sent[(a.peer, r)]:
                        break  # blocked until the peer sends
                    got[(a.peer, r)] += 1
                elif a.kind in (SEND_FORWARD, SEND_BACKWARD):
                    sent[(r, a.peer)] += 1
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(scheds[r][pos[r]]) for r in range(len(scheds)) if pos[r] < len(scheds[r])}
            raise ScheduleError(f"deadlock: ranks wait at {stuck}")


USAGE = """usage: python -m megatron_lite.pipeline_parallel.schedules PP VP MICROBATCHES

Each pipeline rank's actions, checked for deadlock: F3.1 is the forward of micro-batch 3 in model chunk 1,
B the backward; SF/RF send and receive an activation, SB/RB a gradient (@ the peer's pipeline rank); | ends a
batch of messages posted together (one batch_isend_irecv)."""

if __name__ == "__main__":
    try:
        if len(sys.argv) != 4 or "-h" in sys.argv or "--help" in sys.argv:
            raise ValueError
        pp_, vp_, m_ = (int(x) for x in sys.argv[1:4])
    except ValueError:
        sys.exit(USAGE)
    try:
        check_schedules(pp_, vp_, m_)
    except ScheduleError as e:
        sys.exit(f"error: {e}")
    for r_ in range(pp_):
        print(f"rank {r_}: " + " ".join(str(a) for a in build_schedule(pp_, vp_, m_, r_)))
