"""The order of a backward block's steps: cotangents and recomputed activations freed early.

A repeat's backward block (:mod:`.repeat`) is lowered in two passes, the carry's gradient
first and the params' gradients after it, and its recompute steps (remat, and values of
the params only) come in the forward's order, before every backward step.  Run in that
order, a layer's backward holds each cotangent a weight gradient reads until the block's
end, and each recomputed activation from its start.  llama's layer (d_ff = 3 d_model)
then needs 13 [batch, seq, d_model]-sized buffers at its peak where 9.2 do, 22 where 9.4
do under ``selective`` remat, which recomputes its norms and SwiGLU products, and 27
where 23 do under ``full``.

:func:`order_block` lists the steps again, turn by turn: a backward step whose inputs
are made runs with the recompute steps it needs that have not run (so a recompute step
runs just before its first reader), the turn that adds the least memory first (a weight
gradient frees the cotangent and the activation it reads), or the one that frees the
most: each rule gives an order, and the one with the lowest peak
(:func:`.memory.activation_peak`) is kept, if it is lower than the block's own.  Each
step runs the same kernel on the same values, so every number stays the same; every
rank lists the same order, so collectives stay matched.
"""
from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import replace
from typing import Callable

from .memory import activation_peak
from .plan import Plan, Step


#: How a turn is picked, as a key of (bytes made, bytes freed): the least added, or the most
#: freed (which looks one turn further: it runs a weight gradient that recomputes what it
#: reads before the cotangent that would wait beside it).  Each gives an order; the lowest
#: peak wins.
KEYS = (lambda made, freed: (made - freed,), lambda made, freed: (-freed, made))


def order_block(plan: Plan, recomputes: Callable[[Step], bool]) -> Plan:
    """``plan`` with its steps in the order that holds the least, if that lowers its peak.

    Args:
      plan: a backward block's sub-plan.
      recomputes: whether a step recomputes the forward (it then runs as late as it can).
    """
    best, low = plan, activation_peak(plan)
    for key in KEYS:
        order = _greedy(plan, recomputes, key)
        again = replace(plan, steps=[plan.steps[i] for i in order])
        peak = activation_peak(again)
        if peak < low:
            best, low = again, peak
    return best


class _State:
    """What the greedy pass knows as it lists steps: which ran, and each value's readers to come.

    A step's turn and its (made, freed) are kept until a step they depend on runs: the turn
    reads whether the steps its search met have run, the bytes freed how many readers of the
    values it reads are left.  Asking every waiting step again each turn took ~n^2 asks for a
    block of n steps (a quarter of a search's compile time); one turn changes few answers, and
    only those (:attr:`stale`) are asked again.  The bytes freed compare a value's readers left
    with the readers in the turn, so a reader running changes them only where that count is the
    one before or after it (a value many taps read, a depthwise conv's input, re-priced every
    reader at each of their turns)."""

    def __init__(self, plan: Plan, recomputes):
        steps, mesh = plan.steps, plan.mesh
        producer = {v: i for i, s in enumerate(steps) for v in s.outs}
        self.steps = steps
        self.deps = [sorted({producer[v] for v in s.ins if v in producer}) for s in steps]
        self.late = [recomputes(s) and s.kind != "input" for s in steps]
        self.done = [False] * len(steps)
        self.left = Counter(v for s in steps for v in set(s.ins))   # readers not run yet
        # never freed inside the block: its inputs and outputs
        self.held = {v for s in steps if s.kind == "input" for v in s.outs} | set(plan.outputs.values())
        self.size = {v: x.local_bytes(mesh) for v, x in plan.values.items()}
        self.reads = [set(s.ins) for s in steps]
        self.made = [sum(self.size[v] for v in s.outs) for s in steps]
        self._turns: dict[int, list[int] | None] = {}      # step -> its turn, while it holds
        self._priced: dict[int, tuple[int, int]] = {}      # step -> made_freed of its turn, while it holds
        self._by_step: dict[int, set[int]] = {}            # step j -> steps whose turn read j's done
        # value v -> n -> steps whose price asked whether left[v] == n (n: their turn's readers of v)
        self._by_value: dict[int, dict[int, set[int]]] = {}
        self.stale: set[int] = set()                       # steps whose turn or price was forgotten

    def turn(self, i: int) -> list[int] | None:
        """Step ``i`` with the recompute steps it needs that have not run, in plan order;
        None if it also needs a backward step that has not run."""
        if i in self._turns:
            return self._turns[i]
        unit, todo, met, out = {i}, list(self.deps[i]), [], None
        while todo:
            j = todo.pop()
            if self.done[j] or j in unit:
                continue
            met.append(j)
            if not self.late[j]:
                break
            unit.add(j)
            todo.extend(self.deps[j])
        else:
            out = sorted(unit)
        for j in met:   # the answer holds until one of these runs (a step that ran stays run)
            self._by_step.setdefault(j, set()).add(i)
        self._turns[i] = out
        return out

    def price(self, i: int) -> tuple[int, int]:
        """:meth:`_made_freed` of step ``i``'s turn (not None), kept while it holds."""
        hit = self._priced.get(i)
        if hit is None:
            unit = self._turns[i]
            reads = self._reads(unit)
            hit = self._priced[i] = self._made_freed(unit, reads)
            for v, n in reads.items():
                if v not in self.held:
                    self._by_value.setdefault(v, {}).setdefault(n, set()).add(i)
        return hit

    def _reads(self, unit: list[int]) -> dict[int, int]:
        """Each value the steps of ``unit`` read, with how many of them read it."""
        if len(unit) == 1:
            return dict.fromkeys(self.reads[unit[0]], 1)
        return Counter(v for j in unit for v in self.reads[j])

    def _made_freed(self, unit: list[int], reads: dict[int, int]) -> tuple[int, int]:
        """Bytes the steps of ``unit`` make, and those they free (values whose last readers they are)."""
        made = sum(self.made[j] for j in unit)
        left, held, size = self.left, self.held, self.size
        freed = sum(size[v] for v, n in reads.items() if left[v] == n and v not in held)
        return made, freed

    def run(self, unit: list[int], order: list[int]) -> None:
        for j in unit:
            self.done[j] = True
            order.append(j)
            self._forget(self._by_step.pop(j, ()), turns=True)
            for v in self.reads[j]:
                was = self.left[v]
                self.left[v] = was - 1
                asked = self._by_value.get(v)
                if asked:   # only the prices that compared left[v] with its count before or after
                    self._forget(asked.pop(was, ()), turns=False)
                    self._forget(asked.pop(was - 1, ()), turns=False)

    def _forget(self, steps, turns: bool) -> None:
        self.stale.update(steps)
        for i in steps:
            self._priced.pop(i, None)
            if turns:
                self._turns.pop(i, None)


def _greedy(plan: Plan, recomputes, key) -> list[int]:
    """The steps' indices in the order that frees early: inputs first, then turn by turn the
    backward step (with the recompute steps it pulls in) that ``key`` ranks first, ties in
    plan order."""
    st = _State(plan, recomputes)
    order: list[int] = []
    st.run([i for i, s in enumerate(plan.steps) if s.kind == "input"], order)
    waiting = {i for i in range(len(plan.steps)) if not st.done[i] and not st.late[i]}
    ranked: dict[int, tuple] = {}   # waiting step whose turn can run -> (*key, step): no two tie
    heap: list[tuple] = []          # ranked's entries, and ones replaced since (skipped when met)
    st.stale = set(waiting)
    while waiting:
        for i in st.stale & waiting:   # the others' turns and prices still hold
            if st.turn(i) is None:
                ranked.pop(i, None)
            else:
                rank = (*key(*st.price(i)), i)
                if ranked.get(i) != rank:
                    ranked[i] = rank
                    heapq.heappush(heap, rank)
        st.stale.clear()
        if not ranked:   # a recompute step reads a backward step's value: keep the plan's order
            return list(range(len(plan.steps)))
        while ranked.get(heap[0][-1]) != heap[0]:
            heapq.heappop(heap)
        i = heapq.heappop(heap)[-1]
        unit = st.turn(i)
        del ranked[i]
        waiting.discard(i)
        st.run(unit, order)
    # recompute steps no backward step reads (none should be left), in plan order
    st.run([i for i in range(len(plan.steps)) if not st.done[i]], order)
    return order
