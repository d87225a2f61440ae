"""Pipeline schedule generators: one small function per schedule.

A generator lists, per rank, the ``(kind, microbatch, stage)`` compute actions
in run order; :func:`register` records it with its theoretical peak of held
activations, and :func:`~.schedule.with_transfers` derives the sends and
receives.  :func:`make_schedule` builds one by name and validates it::

    @register("gpipe", peak=lambda p, m, v, rank: m)
    def gpipe(p, m):
        return [[("F", mb, r) for mb in range(m)] + [("B", mb, r) for mb in range(m)] for r in range(p)]

    >>> [str(a) for a in make_schedule("1f1b", 2, 3).actions[1][:4]]
    ['rF0@1<0', 'F0@1', 'B0@1', 'sB0@1>0']
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

from ..errors import did_you_mean, message
from .schedule import Action, Number, Schedule, ScheduleError, validate, with_transfers
from .timeline import costs, simulate
from .w_placement import put_off_ws

@dataclass(frozen=True)
class Generator:
    """A registered schedule: ``build(p, m, v=1) -> Schedule``; ``peak(p, m, v, rank)``, the activations
    (one per stage and micro-batch) a rank holds at once in theory; whether it takes virtual stages."""

    build: Callable[..., Schedule]
    peak: Callable[[int, int, int, int], int]
    chunked: bool = False


SCHEDULES: dict[str, Generator] = {}


def _check_sizes(name: str, p, m, v) -> None:
    bad = [f"{what} = {n!r}" for what, n in (("num_ranks", p), ("num_microbatches", m), ("num_chunks", v))
           if not isinstance(n, int) or isinstance(n, bool) or n < 1]
    if bad:
        raise ScheduleError(message(f"schedule {name!r}: sizes must be positive integers.", bullets=bad,
                                    rule="a pipeline has at least one rank, one micro-batch and one chunk"))


def register(name: str, *, peak: Callable[[int, int, int, int], int], chunked: bool = False):
    """Register a function of ``(p, m)`` (``(p, m, v)`` if ``chunked``) that returns compute orders per rank.

    The decorated name becomes a builder ``(p, m, v=1) -> Schedule``.
    """
    def wrap(order_fn):
        @functools.wraps(order_fn)
        def build(p: int, m: int, v: int = 1) -> Schedule:
            _check_sizes(name, p, m, v)
            if v != 1 and not chunked:
                others = sorted(n for n, g in SCHEDULES.items() if g.chunked)
                raise ScheduleError(message(f"schedule {name!r} with num_chunks={v}: it has no virtual stages.",
                                            fix=f"use num_chunks=1, or one of: {', '.join(others)}"))
            orders = order_fn(p, m, v) if chunked else order_fn(p, m)
            return Schedule(name, p, m, with_transfers(orders, p * v), v)
        SCHEDULES[name] = Generator(build, peak, chunked)
        return build
    return wrap


@register("gpipe", peak=lambda p, m, v, rank: m)
def gpipe(p: int, m: int):
    """GPipe: every forward, then every backward; each rank holds all m activations."""
    return [[("F", mb, r) for mb in range(m)] + [("B", mb, r) for mb in range(m)] for r in range(p)]


def _warm_then_alternate(forwards: list, backwards: list, warm: int) -> list:
    """``warm`` forwards, then one forward and one backward in turn, then the remaining backwards."""
    steady = [x for pair in zip(forwards[warm:], backwards) for x in pair]
    return forwards[:warm] + steady + backwards[len(forwards) - warm:]


@register("1f1b", peak=lambda p, m, v, rank: min(p - rank, m))
def one_f_one_b(p: int, m: int):
    """1F1B (PipeDream-flush): rank r runs p-1-r warm-up forwards, then alternates.

    It holds at most p - r activations instead of GPipe's m, for the same bubble.
    """
    return [_warm_then_alternate([("F", mb, r) for mb in range(m)], [("B", mb, r) for mb in range(m)],
                                 min(p - 1 - r, m)) for r in range(p)]


@register("interleaved", chunked=True,
          peak=lambda p, m, v, rank: min(v * m, 2 * (p - 1 - rank) + (v - 1) * p + 1))
def interleaved_1f1b(p: int, m: int, v: int):
    """Interleaved 1F1B (Megatron-LM's virtual stages): rank r runs stages r, r+p, ..., r+(v-1)p.

    Micro-batches go in groups of p: a group's forwards run through chunk 0, then
    chunk 1, ...; backwards mirror that from the last chunk.  Rank r warms up with
    2(p-1-r) + (v-1)p forwards.  With unit cost per chunk action the bubble
    shrinks to (p-1)/(v*m + p-1), for more activations held (counted per chunk).
    """
    return _interleaved_orders("interleaved", p, m, v)


def _interleaved_orders(name: str, p: int, m: int, v: int) -> list:
    """Interleaved 1F1B's per-rank F and B orders (for ``name``'s messages)."""
    if p < 2 or m % p:
        why = "it needs at least 2 ranks" if p < 2 else f"{m} is not a multiple of the {p} ranks"
        raise ScheduleError(message(
            f"schedule '{name}:{v}' with {p} rank(s) and {m} micro-batch(es): {why}.",
            rule="virtual stages need at least 2 ranks, and micro-batches in whole groups of num_ranks",
            fix=f"use at least 2 ranks and a multiple of {max(p, 2)} micro-batches "
                f"(microbatches={max(p, 2)}, --microbatches {max(p, 2)}), or '1f1b'"))
    order = [(c, mb) for g in range(0, m, p) for c in range(v) for mb in range(g, g + p)]
    return [_warm_then_alternate([("F", mb, c * p + r) for c, mb in order],
                                 [("B", mb, (v - 1 - c) * p + r) for c, mb in order],
                                 min(2 * (p - 1 - r) + (v - 1) * p, v * m)) for r in range(p)]


#: The costs :func:`interleaved_zero_bubble` places its Ws at: F = B = W = 1 (a matmul's backward
#: is two matmuls of its forward's size, one for the input gradient and one for the weight's).
ZB_COST = costs(1, 1, 0, 1)


def interleaved_zero_bubble_at(p: int, m: int, v: int, cost: Callable[[Action], Number] = ZB_COST) -> Schedule:
    """Interleaved 1F1B with its Ws placed by simulation at ``cost`` (:func:`.w_placement.put_off_ws`):
    rank r runs its last ``counts[r]`` Ws after its last B, the counts that make the shortest
    makespan at ``cost`` without any rank holding more activations than plain interleaved's
    busiest.  Never slower at ``cost`` than plain interleaved as the runtime runs it (each W
    right after its B's send).  The validated schedule, named ``interleaved-zb``.

    Raises:
      ScheduleError: sizes below 1, fewer than 2 ranks, or micro-batches not in whole groups of p.

    Example:
        >>> from meshdsl.lowering.timeline import simulate
        >>> [r.peak_activations for r in simulate(interleaved_zero_bubble_at(2, 8, 2)).ranks]
        [5, 4]
    """
    _check_sizes("interleaved-zb", p, m, v)
    schedule = Schedule("interleaved-zb", p, m, with_transfers(_zb_orders(p, m, v, cost), p * v), v)
    validate(schedule)
    return schedule


@functools.lru_cache(maxsize=64)
def _zb_peaks(p: int, m: int, v: int) -> tuple[int, ...]:
    """Per rank, the activations ``interleaved-zb`` holds at once at :data:`ZB_COST`."""
    return tuple(r.peak_activations for r in simulate(interleaved_zero_bubble(p, m, v), ZB_COST).ranks)


@register("interleaved-zb", chunked=True, peak=lambda p, m, v, rank: _zb_peaks(p, m, v)[rank])
def interleaved_zero_bubble(p: int, m: int, v: int):
    """Interleaved 1F1B with the zero-bubble split: each B sends its input gradient at once and its
    W (the weight gradients) runs right after, or, for a rank's last few, after its last B.

    How many each rank puts off is found by simulating at F = B = W = 1 (:data:`ZB_COST`;
    :func:`interleaved_zero_bubble_at` takes other costs): typically the last ranks put off
    theirs, whose Bs then run back to back and send the gradients upstream sooner.  No rank
    holds more activations than plain interleaved's rank 0, and at those costs the bubble is
    never larger than plain interleaved's (p = 2, v = 2, m = 8: 2.0% against 4.0%).
    """
    return [list(order) for order in _default_zb_orders(p, m, v)]


def _zb_orders(p: int, m: int, v: int, cost: Callable[[Action], Number]) -> list:
    return put_off_ws("interleaved-zb", _interleaved_orders("interleaved-zb", p, m, v), p, m, v, cost)[0]


@functools.lru_cache(maxsize=64)
def _default_zb_orders(p: int, m: int, v: int) -> tuple:
    """The orders at :data:`ZB_COST`, searched once per size (compile and the peaks read them)."""
    return tuple(tuple(order) for order in _zb_orders(p, m, v, ZB_COST))


@register("zbh1", peak=lambda p, m, v, rank: min(p, m))
def zero_bubble_h1(p: int, m: int):
    """ZB-H1 (zero bubble at 1F1B's memory, Qi et al. 2023): 1F1B with each backward split into
    B (the input gradient, sent upstream at once) and W (the weight gradients).

    Over the last p micro-batches rank r runs the W of micro-batch i right after the B
    of micro-batch i + r, and its last r Ws after its last B: at the end of 1F1B rank r
    is idle for r input-gradient times while the last gradients travel upstream, and
    the delayed Ws fill them.  Earlier Ws follow their own B (delaying them too, as the
    paper's figure does, gives the same makespan and peak, tested for p <= 6, m <= 12,
    but reads the layer inputs back from memory instead of cache).  Every rank then
    holds at most p activations (1F1B's rank 0 already does), and with F = B = W = 1 the
    bubble shrinks from 3(p-1) to p-1 time steps for m >= p.
    """
    rows = []
    for r in range(p):
        order, delayed = [], []
        for kind, mb, stage in _warm_then_alternate([("F", mb, r) for mb in range(m)],
                                                    [("B", mb, r) for mb in range(m)], min(p - 1 - r, m)):
            order.append((kind, mb, stage))
            if kind == "B":
                delayed.append(mb)
                if mb < m - p or len(delayed) > r:
                    order.append(("W", delayed.pop(0), stage))
        rows.append(order + [("W", mb, r) for mb in delayed])
    return rows


def make_schedule(name: str, num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """Build and validate the registered schedule ``name``.

    Raises:
      ScheduleError: unknown name (with a did-you-mean), sizes below 1, or chunks
        for a schedule without virtual stages.
    """
    if name not in SCHEDULES:
        raise ScheduleError(message(f"make_schedule({name!r}, ...): unknown schedule.",
                                    inputs=[f"known: {', '.join(sorted(SCHEDULES))}"],
                                    rule="a pipeline schedule is one meshdsl knows (the list above)",
                                    fix=f"pick a known schedule.{did_you_mean(name, SCHEDULES)}"))
    schedule = SCHEDULES[name].build(num_ranks, num_microbatches, num_chunks)
    validate(schedule)
    return schedule


def parse_schedule(text: str) -> tuple[str, int]:
    """A schedule as a user names it: a generator's name, and for one with virtual stages their
    number per rank after a colon.

    Example:
        >>> parse_schedule("1f1b"), parse_schedule("interleaved:2")
        (('1f1b', 1), ('interleaved', 2))

    Raises:
      ScheduleError: an unknown name (with a did-you-mean), a schedule with virtual stages
        named without their number, a number for one without, or a number below 1.
    """
    name, colon, count = str(text).partition(":")
    if name not in SCHEDULES:
        raise ScheduleError(message(f"schedule {text!r}: unknown schedule.",
                                    inputs=[f"known: {', '.join(sorted(schedule_names()))}"],
                                    rule="a pipeline schedule is one meshdsl knows (the list above)",
                                    fix=f"pick a known schedule.{did_you_mean(name, SCHEDULES)}"))
    chunked = SCHEDULES[name].chunked
    if chunked != bool(colon) or (colon and not (count.isdigit() and int(count) >= 1)):
        raise ScheduleError(message(
            f"schedule {text!r}: " + ("name its virtual stages per rank." if chunked else "it has no virtual stages."),
            rule=f"'{name}' runs v stages per rank, written {name}:v (v >= 1)" if chunked
            else f"'{name}' runs one stage per rank; virtual stages are written interleaved:v",
            fix=f"write e.g. {name}:2" if chunked else f"write {name}, or interleaved:2"))
    return name, int(count) if colon else 1


def named_schedule(text: str, num_ranks: int, num_microbatches: int) -> Schedule:
    """The validated schedule a user names (:func:`parse_schedule`), e.g. ``"interleaved:2"``."""
    name, chunks = parse_schedule(text)
    return make_schedule(name, num_ranks, num_microbatches, chunks)


def user_name(schedule: Schedule) -> str:
    """How a user names ``schedule``: its generator's name, with its virtual stages per rank."""
    return f"{schedule.name}:{schedule.num_chunks}" if SCHEDULES[schedule.name].chunked else schedule.name


def schedule_names() -> list[str]:
    """The schedules a user may name, as :func:`parse_schedule` reads them (``interleaved:v``)."""
    return [f"{n}:v" if g.chunked else n for n, g in SCHEDULES.items()]


def peak_theory(name: str, num_ranks: int, num_microbatches: int, rank: int = 0, num_chunks: int = 1) -> int:
    """Activations ``rank`` holds at once in theory: m for GPipe, min(p - rank, m) for 1F1B."""
    return SCHEDULES[name].peak(num_ranks, num_microbatches, num_chunks, rank)


def bubble_theory(num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> Fraction:
    """Idle fraction of each rank with equal action costs: (p-1)/(v*m + p-1)."""
    return Fraction(num_ranks - 1, num_chunks * num_microbatches + num_ranks - 1)
