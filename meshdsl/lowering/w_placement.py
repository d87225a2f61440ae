"""Zero-bubble W placement: how many weight-gradient actions each rank puts off, found by simulation.

A backward split into B (the input gradient, sent upstream at once) and W (the weight
gradients) lets a rank run a W later than right after its B: the next B starts sooner, its
gradient reaches the rank upstream sooner, and the W fills time the rank would otherwise
wait.  ZB-H1 puts off Ws by a fixed rule for 1F1B (:func:`~.schedule_gen.zero_bubble_h1`).
For interleaved 1F1B no fixed rule tried was never worse over p in {2, 3, 4, 8} and v in
{2, 3}: the best count differs by rank and by the F, B and W costs.  So :func:`put_off_ws`
searches: rank r runs its last ``counts[r]`` Ws after its last B (a count of 1 moves nothing:
the last W already follows the last B), and the counts are chosen by simulating the schedule
at the given costs.

The search starts from no W put off (every W right after its B: the schedule as the runtime
runs the plain one, :func:`~.schedule.split_backward`) and takes a count only if it shortens
the simulated makespan, so the result is never slower than that at those costs.  Each W put
off holds its micro-batch's activations longer; no rank may hold more than the plain
schedule's busiest rank already does (ZB-H1's rule: the bubble shrinks at the same peak).
Ws carry nothing between ranks, so moving them keeps the transfers, their order and the
absence of deadlock.

    >>> orders = [[("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]]
    >>> with_ws(orders)[0]
    [('F', 0, 0), ('F', 1, 0), ('B', 0, 0), ('W', 0, 0), ('B', 1, 0), ('W', 1, 0)]
    >>> put_off(with_ws(orders)[0], 2)
    [('F', 0, 0), ('F', 1, 0), ('B', 0, 0), ('B', 1, 0), ('W', 0, 0), ('W', 1, 0)]
"""
from __future__ import annotations

from typing import Callable, Sequence

from .schedule import Action, Number, Schedule, _match, _walk, with_transfers
from .timeline import bubble_from_timeline

Order = list[tuple[str, int, int]]


def with_ws(orders: Sequence[Sequence[tuple[str, int, int]]]) -> list[Order]:
    """Per-rank compute orders with each B followed by its W (nothing put off yet)."""
    return [[x for kind, mb, stage in order for x in ((kind, mb, stage),) + ((("W", mb, stage),) if kind == "B" else ())]
            for order in orders]


def put_off(order: Order, count: int) -> Order:
    """``order`` (one rank's, each B followed by its W) with its last ``count`` Ws moved after its
    last B, in their order; the rest stay right after their B."""
    ws = [i for i, (kind, _, _) in enumerate(order) if kind == "W"]
    moved = set(ws[len(ws) - count:]) if count > 0 else set()
    return [x for i, x in enumerate(order) if i not in moved] + [order[i] for i in sorted(moved)]


class _Trial:
    """Simulates one choice of counts: the makespan and each rank's peak of held activations."""

    def __init__(self, name: str, orders: list[Order], num_ranks: int, num_microbatches: int, num_chunks: int,
                 cost: Callable[[Action], Number]):
        self.name, self.orders, self.cost = name, orders, cost
        self.sizes = (num_ranks, num_microbatches, num_chunks)
        # Moving Ws leaves every rank's transfers in the same order: pair sends and receives once.
        first = self.schedule([0] * num_ranks)
        self.pairs = _match(first, {a: (r, i) for r, row in enumerate(first.actions) for i, a in enumerate(row)})

    def schedule(self, counts: Sequence[int]) -> Schedule:
        p, m, v = self.sizes
        orders = [put_off(order, c) for order, c in zip(self.orders, counts)]
        return Schedule(self.name, p, m, with_transfers(orders, p * v), v)

    def __call__(self, counts: Sequence[int]) -> tuple[Number, tuple[int, ...]]:
        timeline, blocked = _walk(self.schedule(counts), self.pairs, self.cost, 0)
        assert not blocked, "moving a W cannot block a transfer"
        stats = bubble_from_timeline(timeline)
        return stats.makespan, tuple(r.peak_activations for r in stats.ranks)


def put_off_ws(name: str, orders: Sequence[Sequence[tuple[str, int, int]]], num_ranks: int, num_microbatches: int,
               num_chunks: int, cost: Callable[[Action], Number]) -> tuple[list[Order], tuple[int, ...]]:
    """``orders`` (per rank, F and B) with a W after each B, and per rank the count of its last Ws
    put off after its last B that makes the shortest makespan at ``cost``.

    Coordinate descent from no W put off, the last rank first (it makes the gradients every
    other rank waits for): each rank in turn takes the count, from 0 up, with the shortest
    makespan (ties: fewer activations held over all ranks, then fewer Ws put off), while its peak
    stays within the plain schedule's largest; sweeps repeat until none changes.

    Returns:
      the orders with the Ws placed, and the count per rank.
    """
    base = with_ws(orders)
    trial = _Trial(name, base, num_ranks, num_microbatches, num_chunks, cost)
    counts = [0] * num_ranks
    makespan, peaks = trial(counts)
    cap = max(peaks)
    best = (makespan, sum(peaks), 0)
    changed = True
    while changed:
        changed = False
        for r in reversed(range(num_ranks)):
            num_ws = sum(1 for kind, _, _ in base[r] if kind == "W")
            for c in range(1, num_ws + 1):
                tried = counts[:r] + [c] + counts[r + 1:]
                makespan, peaks = trial(tried)
                if peaks[r] > cap:   # putting off one more W never holds fewer
                    break
                key = (makespan, sum(peaks), sum(tried))
                if key < best:
                    best, counts, changed = key, tried, True
    return [put_off(order, c) for order, c in zip(base, counts)], tuple(counts)
