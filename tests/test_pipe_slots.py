"""Which pipeline receives may compute from their shared-memory slot (runtime/pipeline_store.py
``slot_holds``): whatever the schedule, holding them never stalls a rank for good.

A rank that reads a message where its sender wrote it holds that slot until the micro-batch
finishes on its stage; the ring's sender writes piece n only once every piece before
n - slots + 1 is released.  The test runs every rank's action list against rings of a few
sizes, each rank going as far as the messages in its rings let it (sends never block, a
receive reads its channel in order and keeps other tags' messages aside, as
``comm/shm_pipe.py`` does), holding exactly the receives ``slot_holds`` names (with no
margin for the sender: the stall bound alone): every list must run to its end.  The same
walk with every carry receive held stalls (GPipe with more micro-batches than slots), so
the walk can tell.  A micro-batch sum that starts from a held
message starts from its copy (the slot is released while the sum lives on).  On 2 gloo
processes, over rings small enough that senders lap them and find them full behind held
slots, held receives give bitwise what copied ones give.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

import meshdsl as md
from meshdsl.runtime.pipeline_store import Accumulator, slot_holds
from meshdsl.train.step import training_outputs
from models.transformer import Config, build

_PROGRAMS: dict = {}


def _program(p: int, m: int, schedule: str):
    layers = 2 * p if schedule.startswith("interleaved") else p
    key = (p, m, schedule)
    if key not in _PROGRAMS:
        model = build(dataclasses.replace(Config.tiny(), layers=layers, batch=m))
        outs = training_outputs(model.loss, model.params, 0.1, with_grads=True)
        plan = md.compile(outs, f"stage:{p}", "layer:stage", microbatches=m, schedule=schedule)
        _PROGRAMS[key] = next(s for s in plan.steps if s.kind == "pipeline").args["program"]
    return _PROGRAMS[key]


def _steps(prog, sa):
    """``(kind, offset, (tag, micro-batch), carry)`` of the transfers an action runs, in order."""
    if sa.segment is None:
        return []
    steps = prog.segments[sa.segment].steps
    return [(s.kind, s.args["offset"], (s.args["tag"], sa.action.microbatch), prog.is_carry(s))
            for s in (steps[j] for j in sa.steps) if s.kind in ("send", "recv")]


class _Ring:
    """One channel: what its sender sent (in order), what its receiver took, held and kept aside."""

    def __init__(self, slots: int):
        self.slots, self.sent, self.taken, self.held, self.aside = slots, [], 0, set(), Counter()

    def readable(self) -> bool:
        """The next piece is sent and in the ring: its sender could write it."""
        tail = min(self.held) if self.held else self.taken
        return self.taken < len(self.sent) and self.taken < tail + self.slots


def _walk(prog, slots: int, holds: list[dict[int, int]]) -> list[int]:
    """Every rank's list run against rings of ``slots``, rank r holding the receives of
    ``holds[r]`` (those it reads straight from the ring) until the action that entry names;
    returns how far each rank got."""
    rows, p = prog.actions(True), prog.num_ranks
    rings = {(a, b): _Ring(slots) for a in range(p) for b in range(p) if a != b}
    at = [(0, 0)] * p                          # per rank: (action, transfer within it)
    releases = [{} for _ in range(p)]          # per rank: action -> [(ring, piece)] it releases
    moved = True
    while moved:
        moved = False
        for r in range(p):
            i, t = at[r]
            while i < len(rows[r]):
                transfers = _steps(prog, rows[r][i])
                if t < len(transfers):
                    kind, offset, key, carry = transfers[t]
                    if kind == "send":
                        rings[(r, r + offset)].sent.append(key)
                    else:
                        ring = rings[(r - offset, r)]
                        n = _receive(ring, key)
                        if n is False:
                            break
                        if n is not None and carry and rows[r][i].action.is_recv and i in holds[r]:
                            ring.held.add(n)
                            releases[r].setdefault(holds[r][i], []).append((ring, n))
                    t, moved = t + 1, True
                    continue
                for ring, n in releases[r].pop(i, ()):   # the action is done: its releases
                    ring.held.discard(n)
                i, t, moved = i + 1, 0, True
            at[r] = (i, t)
    return [i for i, _ in at]


def _receive(ring: _Ring, key):
    """Take ``key``'s message from ``ring``, reading ahead as far as it must: its piece where
    it came straight from the ring, None where it was kept aside, False if stuck."""
    if ring.aside[key]:
        ring.aside[key] -= 1
        return None
    while ring.readable():
        n, got = ring.taken, ring.sent[ring.taken]
        ring.taken += 1
        if got == key:
            return n
        ring.aside[got] += 1
    return False


def _all_carry_receives(prog, r: int) -> dict[int, int]:
    """Every carry receive of rank ``r`` held to its micro-batch's end: no look at the rings."""
    row = prog.actions(True)[r]
    last = {(sa.action.stage, sa.action.microbatch): i for i, sa in enumerate(row) if sa.finishes is not None}
    return {i: last[(sa.action.stage, sa.action.microbatch)] for i, sa in enumerate(row) if sa.action.is_recv}


SCHEDULES = [("gpipe", 2, 8), ("gpipe", 2, 16), ("gpipe", 4, 8), ("1f1b", 2, 8), ("1f1b", 4, 8),
             ("zbh1", 4, 8), ("interleaved:2", 2, 8), ("interleaved:2", 4, 8), ("interleaved-zb:2", 2, 8),
             ("interleaved-zb:2", 4, 8)]


@pytest.mark.parametrize("schedule,p,m", SCHEDULES)
@pytest.mark.parametrize("slots", [2, 4, 8])
def test_held_receives_never_stall_a_rank(schedule, p, m, slots):
    prog = _program(p, m, schedule)
    # No margin: the most holds the stall bound alone allows (a margin only takes some away).
    holds = [slot_holds(prog, True, r, slots, margin=-10 ** 9) for r in range(p)]
    assert _walk(prog, slots, holds) == [len(row) for row in prog.actions(True)]


def test_holding_every_receive_can_stall_and_slot_holds_holds_fewer():
    """GPipe with 16 micro-batches over rings of 8: the last stage holding every activation
    until its backward could not read the 9th (the walk can tell a stall)."""
    prog = _program(2, 16, "gpipe")
    greedy = [_all_carry_receives(prog, r) for r in range(2)]
    assert _walk(prog, 8, greedy) != [len(row) for row in prog.actions(True)]
    held = slot_holds(prog, True, 1, 8, margin=-10 ** 9)
    assert 0 < len(held) < len(greedy[1])


def test_a_sum_started_from_a_received_message_starts_from_a_copy_of_it():
    """A micro-batch sum may be a received tensor itself (a parameter's gradient that is the
    carry's gradient): held in its slot, it is copied before it becomes the running sum, so
    adding later micro-batches in place never writes the slot, and the slot may be released."""
    segment = torch.zeros(64)                     # stands for a ring's shared memory
    received = segment[8:12]
    received.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    store = {7: {0: received}}
    acc = Accumulator(store, {0: 0, 1: 0}, "mb", {7: "sum"})
    acc.borrowed = lambda x: x.untyped_storage().data_ptr() == segment.untyped_storage().data_ptr()
    acc.add(acc.keyed((0,), (7,)))
    store[7] = {1: torch.ones(4)}
    acc.add(acc.keyed((1,), (7,)))
    sum_ = acc.sums[(7, 0)]
    assert not acc.borrowed(sum_)
    torch.testing.assert_close(sum_, torch.tensor([2.0, 3.0, 4.0, 5.0]), rtol=0, atol=0)   # exact: small integers
    assert torch.equal(received, torch.tensor([1.0, 2.0, 3.0, 4.0]))


def _held_and_copied(rank, schedule, m, num_steps, slots):
    """Rank ``rank``'s outputs of ``num_steps`` runs with the receives holding their slots where
    ``slot_holds`` lets them without a stall (not minding whether the sender finds its ring
    full: then its pieces take the helper thread), then with every receive copied (the path
    before holds), how many receives held and how many sends found the ring full; the rings
    have ``slots`` slots."""
    import meshdsl.runtime.pipeline as runner
    from meshdsl.comm import shm_pipe
    from meshdsl.comm.distributed import TorchComm
    from meshdsl.comm.microbatch import for_plan
    torch.set_num_threads(1)
    shm_pipe.NUM_SLOTS = shm_pipe.PipeLink.slots = slots
    shm_pipe._CHANNEL = shm_pipe._COUNTERS + slots * shm_pipe._SLOT
    held, full = [], []
    recv, general = shm_pipe.PipeLink.recv, shm_pipe.ShmPipe.send
    shm_pipe.ShmPipe.send = lambda pipe, *args: full.append(1) or general(pipe, *args)

    def counted(link, hold=False):
        x = recv(link, hold)
        held.append(link.borrows(x))
        return x
    shm_pipe.PipeLink.recv = counted
    comm = TorchComm("stage:2")
    model = build(dataclasses.replace(Config.tiny(), layers=4, batch=8))
    outs = training_outputs(model.loss, model.params, 0.1, with_grads=True)
    results = []
    stalls_only = runner.slot_holds
    for holds in (lambda *args: stalls_only(*args, margin=-10 ** 9), lambda *args: {}):   # (no margin)
        runner.slot_holds = holds
        plan = md.compile(outs, "stage:2", "layer:stage", microbatches=m, schedule=schedule)
        ex = md.Executor(plan, for_plan(comm, plan))
        results.append([ex.run(model.feeds(i)) for i in range(num_steps)])
        if len(results) == 1:
            num_full = len(full)
    comm.drain()
    return results, sum(held), num_full


@pytest.mark.timeout(120)
def test_held_receives_give_bitwise_what_copied_ones_give_on_two_processes():
    """interleaved-zb:2 (its Ws read received gradients; each channel carries both virtual
    stages' carries) on 2 gloo processes, two steps, over rings of 3 slots (a sender laps its
    ring several times a step, and finds it full behind held slots): the same bits as with
    every receive copied."""
    from meshdsl.processes import launcher as launch
    results = launch.spawn(_held_and_copied, 2, args=("interleaved-zb:2", 4, 2, 3), timeout=100)
    assert sum(num_full for *_, num_full in results) > 0
    for rank, ((with_holds, copied), num_held, _) in enumerate(results):
        assert 0 < num_held < 2 * 12, rank    # of 12 carry receives a step per rank, those slot_holds lets hold
        for step, (a, b) in enumerate(zip(with_holds, copied)):
            assert a.keys() == b.keys()
            for k in a:
                for x, y in zip(a[k], b[k]):
                    assert (x is None and y is None) or torch.equal(x, y), (rank, step, k)
