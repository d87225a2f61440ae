"""Bind each spawned rank to cores of its own.

Ranks left to the kernel's scheduler move between cores: a rank that wakes from a
collective may find its core busy and start on another, whose caches hold the other
rank's data, and the two ranks' steps drift apart, so the faster one waits at each
gradient sum.  ``MESHDSL_BIND_CORES=rank`` gives rank ``r`` of ``n`` the ``r``-th of
``n`` equal, contiguous slices of the cores this process may use (what
``os.sched_getaffinity`` allows: a container's or ``taskset``'s set), as Intel's and
DeepSpeed's launchers do with ``--bind_cores_to_rank``.  It applies where there are at
least as many cores as ranks; with fewer, every rank keeps the whole set.  The default,
``none``, leaves the scheduler free.  torchrun's ranks are started by torchrun: bind
them with its own options or ``taskset``.
"""
from __future__ import annotations

import os

from ..errors import DistributedError, env_choice

ENV = "MESHDSL_BIND_CORES"
MODES = ("none", "rank")


def mode() -> str:
    """``$MESHDSL_BIND_CORES``, checked: ``none`` (the default) or ``rank``."""
    return env_choice(ENV, MODES, "a core binding", "set it to rank to give each rank cores of its own",
                      DistributedError)


def cores_of(rank: int, nproc: int, usable: list[int]) -> list[int]:
    """Rank ``rank``'s slice of ``usable`` (sorted core ids) among ``nproc`` ranks: the
    ``rank``-th of ``nproc`` contiguous slices of ``len(usable) // nproc`` cores (the
    remainder left to no rank); all of ``usable`` when there are fewer cores than ranks."""
    if nproc > len(usable):
        return list(usable)
    each = len(usable) // nproc
    return list(usable[rank * each:(rank + 1) * each])


def bind_rank(rank: int, nproc: int) -> list[int] | None:
    """Bind this process to its cores under ``MESHDSL_BIND_CORES=rank``; the cores, or None
    when it stays unbound (the default, no ``sched_setaffinity``, or fewer cores than ranks)."""
    if mode() != "rank" or not hasattr(os, "sched_setaffinity"):
        return None
    usable = sorted(os.sched_getaffinity(0))
    if nproc > len(usable):
        return None
    mine = cores_of(rank, nproc, usable)
    os.sched_setaffinity(0, mine)
    return mine
