"""Pipeline schedules as data: actions, per-rank lists, and their validator.

When the layout puts the stacked ``layer`` dim on a ``stage`` mesh axis, each
rank of that axis runs a slice of the layers and the batch is cut into
micro-batches.  A :class:`Schedule` lists, per rank, the forward (``F``) and
backward (``B``) actions it runs and the transfers between ranks, in order.  It
is plain data and this module knows nothing about torch: the executor walks a
schedule, the CLI prints it, and the layout search prices it with
:func:`meshdsl.lowering.timeline.simulate`.  Generators live in
:mod:`.schedule_gen`; :func:`with_transfers` derives their sends and receives.

Stages are logical (the model's pieces, in pipeline order).  With virtual
stages (``num_chunks`` v > 1) rank r runs stages r, r + p, r + 2p, ...

    >>> [str(a) for a in Schedule.from_rows("demo", ["F0 sF0>1 rB0<1 B0", "rF0<0 F0 B0 sB0>0"], 1).actions[1]]
    ['rF0@1<0', 'F0@1', 'B0@1', 'sB0@1>0']
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Sequence, Union

from ..errors import MeshDSLError, Span, message

Number = Union[int, float, Fraction]


class ScheduleError(MeshDSLError):
    """A pipeline schedule is unknown, malformed, mismatched, or deadlocks."""


COMPUTE = ("F", "B")
# What a recorded timeline counts as busy: the schedule's computes, and "W", the
# weight-gradient part of a B that the runtime runs after the B's send (runtime/pipeline).
BUSY = COMPUTE + ("W",)
# The transfer each compute kind sends and receives, and which way its data flows:
# an F sends activations downstream, a B sends gradients upstream.  A split backward
# (zero bubble: "I" sends the input gradient, "W" only computes weight gradients) adds
# its kinds to these tables and its dependencies to _needs.
SEND_OF = {"F": "send_act", "B": "send_grad"}
RECV_OF = {"F": "recv_act", "B": "recv_grad"}
DIRECTION = {"F": +1, "B": -1}
CARRIES = {t: k for table in (SEND_OF, RECV_OF) for k, t in table.items()}
KINDS = BUSY + tuple(SEND_OF.values()) + tuple(RECV_OF.values())

_LABEL = re.compile(r"(?P<dir>[sr]?)(?P<kind>[FBW])(?P<mb>\d+)(?:@(?P<stage>\d+))?(?:(?P<arrow>[<>])(?P<peer>\d+))?")
_ARROW = {"": None, "s": ">", "r": "<"}


@dataclass(frozen=True)
class Action:
    """One entry of a rank's list.

    Attributes:
      kind: ``F``, ``B``, ``send_act``, ``recv_act``, ``send_grad`` or ``recv_grad`` (and ``W``
        in a recorded timeline: a B's weight gradients, run after its send).
      microbatch: the micro-batch index.
      stage: the logical stage whose data it computes, sends or receives.
      peer: for a transfer, the logical stage at the other end; None otherwise.
    """

    kind: str
    microbatch: int
    stage: int
    peer: int | None = None

    @property
    def is_send(self) -> bool:
        return self.kind in SEND_OF.values()

    @property
    def is_recv(self) -> bool:
        return self.kind in RECV_OF.values()

    def message_key(self) -> tuple[str, int, int, int]:
        """What a transfer carries: (compute kind, micro-batch, source stage, destination stage)."""
        src, dst = (self.stage, self.peer) if self.is_send else (self.peer, self.stage)
        return (CARRIES[self.kind], self.microbatch, src, dst)

    def label(self, with_stage: bool = True) -> str:
        """Compact form: ``F3@1`` (F of micro-batch 3 on stage 1), ``sF3@1>2``, ``rB3@1<2``."""
        at = f"@{self.stage}" if with_stage else ""
        if self.kind in BUSY:
            return f"{self.kind}{self.microbatch}{at}"
        return f"{self.kind[0]}{CARRIES[self.kind]}{self.microbatch}{at}{'>' if self.is_send else '<'}{self.peer}"

    __str__ = label


def parse_action(text: str, stage: int | None = None) -> Action:
    """Parse :meth:`Action.label`'s form; ``stage`` fills in a label written without ``@stage``.

    Example:
        >>> parse_action("sF3>2", stage=1)
        Action(kind='send_act', microbatch=3, stage=1, peer=2)
    """
    m = _LABEL.fullmatch(text)
    if (m is None or _ARROW[m["dir"]] != m["arrow"] or (m["stage"] is None and stage is None)
            or (m["kind"] == "W" and m["dir"])):
        raise ScheduleError(message(
            f"parse_action({text!r}): not a schedule action.", source=text, span=Span(0, max(1, len(text))),
            rule="F<mb>, B<mb> or W<mb> for compute; s/r + F/B + <mb> + >/< + <peer stage> for transfers, "
                 "each optionally with @<stage> after the micro-batch",
            fix="write e.g. 'F3', 'B3@1', 'sF3>2' (send activations of micro-batch 3 to stage 2), 'rB3<2'"))
    kind = m["kind"] if not m["dir"] else (SEND_OF if m["dir"] == "s" else RECV_OF)[m["kind"]]
    return Action(kind, int(m["mb"]), stage if m["stage"] is None else int(m["stage"]),
                  None if m["peer"] is None else int(m["peer"]))


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: one tuple of actions per rank of the ``stage`` axis.

    Attributes:
      name: the generator's name, e.g. ``"1f1b"``.
      num_ranks: ranks on the ``stage`` axis (p).
      num_microbatches: micro-batches per step (m).
      actions: ``actions[rank]`` is the order that rank runs.
      num_chunks: stages per rank (v); stage ``s`` runs on rank ``s % num_ranks``.
    """

    name: str
    num_ranks: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    num_chunks: int = 1

    @property
    def num_stages(self) -> int:
        """Logical stages, ``num_ranks * num_chunks``."""
        return self.num_ranks * self.num_chunks

    def rank_of(self, stage: int) -> int:
        return stage % self.num_ranks

    @classmethod
    def from_rows(cls, name: str, rows: Sequence[str], num_microbatches: int, num_chunks: int = 1) -> "Schedule":
        """A schedule from one string of labels per rank, e.g. ``["F0 sF0>1 rB0<1 B0", ...]``; a label
        without ``@stage`` is on the rank's own stage (only when ``num_chunks == 1``)."""
        default = lambda rank: rank if num_chunks == 1 else None  # noqa: E731
        actions = tuple(tuple(parse_action(t, default(r)) for t in row.split()) for r, row in enumerate(rows))
        return cls(name, len(rows), num_microbatches, actions, num_chunks)


def with_transfers(orders: Sequence[Sequence[tuple[str, int, int]]], num_stages: int) -> tuple[tuple[Action, ...], ...]:
    """Turn per-rank compute orders ``(kind, microbatch, stage)`` into full action lists.

    ``kind`` is ``F``, ``B`` or ``W`` (a B's weight gradients, split off to run later).
    A compute action comes after the receive of its input from the neighbouring stage (for F
    the stage before, for B the one after) and before the send of its output the other way.
    """
    rows = []
    for order in orders:
        row: list[Action] = []
        for kind, mb, stage in order:
            if kind == "W":   # a split-off weight gradient: no transfer
                row.append(Action(kind, mb, stage))
                continue
            src, dst = stage - DIRECTION[kind], stage + DIRECTION[kind]
            if 0 <= src < num_stages:
                row.append(Action(RECV_OF[kind], mb, stage, src))
            row.append(Action(kind, mb, stage))
            if 0 <= dst < num_stages:
                row.append(Action(SEND_OF[kind], mb, stage, dst))
        rows.append(tuple(row))
    return tuple(rows)


# ----------------------------------------------------------------------------- validation

def unit_cost(a: Action) -> int:
    """F = B = 1, transfers (and a split-off W) free: the cost under which the bubble theory is exact."""
    return 1 if a.kind in COMPUTE else 0


def has_placed_w(s: Schedule) -> bool:
    """Whether the generator itself placed W actions (a zero-bubble schedule)."""
    return any(a.kind == "W" for row in s.actions for a in row)


def theory_cost(s: Schedule) -> Callable[[Action], int]:
    """The costs the bubble theory assumes: F = 1 and a whole backward = 2, where a W that the
    schedule places takes half of it (B = W = 1); transfers free.

    Under them GPipe and 1F1B idle (p-1)/(m+p-1) of the makespan, virtual stages
    (p-1)/(vm+p-1), and a zero-bubble schedule shows what moving its Ws buys.
    """
    if has_placed_w(s):
        return lambda a: 1 if a.kind in BUSY else 0
    return lambda a: {"F": 1, "B": 2}.get(a.kind, 0)


def split_backward(s: Schedule) -> Schedule:
    """``s`` as the runtime runs it: a B that sends its input gradient upstream leaves its
    weight gradients to a ``W`` action right after that send.

    The stage upstream then gets the gradient it waits for a W sooner.  A B that sends
    nothing (the first stage's) keeps its weight gradients, and a B whose W the schedule
    already places (a zero-bubble generator's) keeps that W where it is.

    Example:
        >>> from meshdsl.lowering.schedule_gen import make_schedule
        >>> [str(a) for a in split_backward(make_schedule("1f1b", 2, 1)).actions[1]]
        ['rF0@1<0', 'F0@1', 'B0@1', 'sB0@1>0', 'W0@1']
    """
    def split(row):
        placed = {(a.microbatch, a.stage) for a in row if a.kind == "W"}
        for a in row:
            yield a
            if a.kind == "send_grad" and (a.microbatch, a.stage) not in placed:
                yield Action("W", a.microbatch, a.stage)
    rows = tuple(tuple(split(row)) for row in s.actions)
    return Schedule(s.name, s.num_ranks, s.num_microbatches, rows, s.num_chunks)


def _needs(a: Action, num_stages: int) -> list[Action]:
    """Actions that must come earlier on the same rank: a compute's received input, B's own F, W's own B,
    a send's compute."""
    if a.kind == "W":
        return [Action("B", a.microbatch, a.stage)]
    if a.kind in COMPUTE:
        src = a.stage - DIRECTION[a.kind]
        needs = [Action(RECV_OF[a.kind], a.microbatch, a.stage, src)] if 0 <= src < num_stages else []
        return needs + ([Action("F", a.microbatch, a.stage)] if a.kind == "B" else [])
    if a.is_send:
        return [Action(CARRIES[a.kind], a.microbatch, a.stage)]
    return []


def _fail(s: Schedule, what: str, bullets: list[str], rule: str, fix: str | None = None):
    raise ScheduleError(message(
        f"validate(schedule {s.name!r}): {what}", bullets=bullets, rule=rule, fix=fix,
        inputs=[f"ranks = {s.num_ranks}, micro-batches = {s.num_microbatches}, chunks per rank = {s.num_chunks}"]))


def _match(s: Schedule, where: dict[Action, tuple[int, int]]) -> dict[Action, Action]:
    """Pair every receive with its send; transfers between two ranks must pair up in order (one channel each)."""
    pairs: dict[Action, Action] = {}
    for src in range(s.num_ranks):
        for dst in range(s.num_ranks):
            sends = [a for a in s.actions[src] if a.is_send and s.rank_of(a.peer) == dst]
            recvs = [a for a in s.actions[dst] if a.is_recv and s.rank_of(a.peer) == src]
            for i in range(max(len(sends), len(recvs))):
                snd, rcv = sends[i] if i < len(sends) else None, recvs[i] if i < len(recvs) else None
                if snd is None or rcv is None or snd.message_key() != rcv.message_key():
                    at = lambda a: f"rank {where[a][0]} position {where[a][1]}: {a}" if a else "nothing"  # noqa: E731
                    _fail(s, f"transfer {i} from rank {src} to rank {dst} does not match.",
                          [f"send:    {at(snd)}", f"receive: {at(rcv)}"],
                          "the k-th send from one rank to another is the k-th receive there from that rank, "
                          "for the same micro-batch and stages",
                          "receive in the order the peer sends, and send each transfer that is received")
                pairs[rcv] = snd
    return pairs


def validate(s: Schedule) -> None:
    """Check a schedule before it runs, as the executor will run it.

    Every action is on its stage's rank, with the right peer, once; every stage
    runs F and B of every micro-batch (and at most one W, a B's weight gradients
    placed by the generator); on each rank an action comes after what it
    needs (B after its F, W after its B, a compute after the receive of its input, a send after
    its compute); sends pair with receives in order; and walking the lists (sends
    never block, a receive waits for its send) ends with every rank done.

    Raises:
      ScheduleError: naming the rank, the position and the action at fault.

    Example:
        >>> try:
        ...     validate(Schedule.from_rows("hand", ["B0 F0"], num_microbatches=1))
        ... except ScheduleError as e:
        ...     print(str(e).splitlines()[2])
          * rank 0 position 0: B0@0 needs F0@0 earlier on rank 0 (at position 1)
    """
    if len(s.actions) != s.num_ranks:
        _fail(s, f"{len(s.actions)} action lists for {s.num_ranks} ranks.", [], "one list per rank")
    where: dict[Action, tuple[int, int]] = {}
    for rank, row in enumerate(s.actions):
        for pos, a in enumerate(row):
            spot = f"rank {rank} position {pos}: {a}"
            if a.kind not in KINDS or not 0 <= a.stage < s.num_stages or not 0 <= a.microbatch < s.num_microbatches:
                _fail(s, "action out of range.", [spot], f"kinds {', '.join(KINDS)}; stages 0..{s.num_stages - 1}; "
                      f"micro-batches 0..{s.num_microbatches - 1}")
            peer = None if a.kind in BUSY else a.stage + DIRECTION[CARRIES[a.kind]] * (1 if a.is_send else -1)
            for ok, what, bullet, rule in [
                    (s.rank_of(a.stage) == rank, "action on the wrong rank.",
                     f"{spot} belongs to rank {s.rank_of(a.stage)}", "stage s runs on rank s % num_ranks"),
                    (peer is None or 0 <= peer < s.num_stages, "transfer past an end of the pipeline.",
                     f"{spot}: there is no stage {peer}", "none leave the last stage or reach the first"),
                    (a.peer == peer, "transfer with the wrong peer.", f"{spot}: peer should be stage {peer}",
                     "activations go from stage s to s+1, gradients from s+1 to s; compute has no peer"),
                    (a not in where, "duplicated action.", f"{spot}, first at position {where.get(a, (0, 0))[1]}",
                     "each action appears once")]:
                if not ok:
                    _fail(s, what, [bullet], rule)
            where[a] = (rank, pos)
    for stage in range(s.num_stages):
        for mb in range(s.num_microbatches):
            for kind in COMPUTE:
                if Action(kind, mb, stage) not in where:
                    _fail(s, "missing action.", [f"rank {s.rank_of(stage)} has no {Action(kind, mb, stage)}"],
                          "every stage runs F and B of every micro-batch once")
    for a, (rank, pos) in where.items():
        for need in _needs(a, s.num_stages):
            if need not in where or where[need][1] > pos:
                state = "missing" if need not in where else f"at position {where[need][1]}"
                _fail(s, f"{a} comes before what it needs.",
                      [f"rank {rank} position {pos}: {a} needs {need} earlier on rank {rank} ({state})"],
                      "a B comes after its F; a compute after the receive of its input; a send after its compute")
    waiting = _walk(s, _match(s, where), unit_cost, 0)[1]
    if waiting:
        _fail(s, "deadlock: no rank can go on.",
              [f"rank {r} position {pos}: {a} waits for {snd} on rank {where[snd][0]} (position {where[snd][1]})"
               for r, pos, a, snd in waiting],
              "sends never block, a receive waits for its send; each rank runs its list in order",
              "reorder so that each rank sends what its peers wait for before it waits itself")


def _walk(s: Schedule, pairs: dict[Action, Action], cost: Callable[[Action], Number], latency: Number):
    """Run every rank's list in order with times; return (timeline, blocked receives)."""
    done: dict[Action, Number] = {}
    clock: list[Number] = [0] * s.num_ranks
    timeline: list[list[tuple[Action, Number, Number]]] = [[] for _ in s.actions]
    moved = True
    while moved:
        moved = False
        for rank, row in enumerate(s.actions):
            while len(timeline[rank]) < len(row):
                a = row[len(timeline[rank])]
                start = clock[rank]
                end = start + cost(a)
                if a.is_recv:
                    if pairs[a] not in done:
                        break
                    end = max(end, done[pairs[a]] + latency)
                done[a], clock[rank] = end, end
                timeline[rank].append((a, start, end))
                moved = True
    blocked = [(r, len(t), row[len(t)], pairs[row[len(t)]]) for r, (row, t) in enumerate(zip(s.actions, timeline))
               if len(t) < len(row)]
    return timeline, blocked
