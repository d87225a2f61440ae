"""Checks the command line runs before any work starts: flag ranges, process count, memory.

Every user error should surface here, in the parent process and within a
second or two, rather than ten seconds later as one rank's traceback:

* ``argparse`` ``type=`` validators give each numeric flag its range
  (:func:`int_in`, :func:`float_in`);
* :func:`check_processes` refuses more local processes than the machine can
  reasonably run, and a backend it cannot run (``nccl`` without CUDA);
* :func:`check_simulated_memory` refuses a simulated run whose values cannot
  fit in the memory available.
"""
from __future__ import annotations

import argparse
import math
import os

from ..errors import MeshDSLError, message
from ..layout.mesh import Mesh
from ..lowering.plan import Plan

SEED_MAX = 2**63 - 1
PROCS_PER_CPU = 4  # local processes per CPU core allowed without --max-procs


class UsageError(MeshDSLError):
    """A command-line request that is well formed but cannot or should not run."""


# ----------------------------------------------------------------- flag types

def int_in(lo: int, hi: int | None = None, fix: str = ""):
    """An argparse ``type=`` that accepts integers in ``[lo, hi]`` (``hi=None``: no upper bound)."""
    allowed = f"{lo} <= N" + (f" <= {hi}" if hi is not None else "")

    def parse(text: str) -> int:
        try:
            value = int(text, 0) if text.strip().lower().startswith(("0x", "0o", "0b")) else int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"'{text}' is not an integer; allowed: {allowed}; fix: {fix}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{value} is out of range; allowed: {allowed}; fix: {fix}")
        return value

    return parse


def float_in(lo: float | None = None, *, lo_open: bool = False, fix: str = ""):
    """An argparse ``type=`` for finite floats ``>= lo`` (``> lo`` with ``lo_open``)."""
    if lo is None:
        allowed = "a finite number"
    else:
        allowed = f"a finite number {'>' if lo_open else '>='} {lo:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"'{text}' is not a number; allowed: {allowed}; fix: {fix}") from None
        bad = not math.isfinite(value)
        if lo is not None and not bad:
            bad = value <= lo if lo_open else value < lo
        if bad:
            raise argparse.ArgumentTypeError(f"{text} is out of range; allowed: {allowed}; fix: {fix}")
        return value

    return parse


# ------------------------------------------------------------ process count

def check_output_path(flag: str, path: str, what: str, example: str) -> None:
    """Refuse an output file ``path`` (given as ``flag``) that cannot be written, before any work.

    Args:
      what: what the file is, e.g. "a JSON file"; example: a good value, e.g. "run.json".
    """
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        why = "is a folder" if os.path.isdir(path) else \
            "is in a folder that does not exist" if not os.path.isdir(folder) else "is in a read-only folder"
        raise UsageError(message(f"{flag} {path}: the file {why}.", inputs=[f"folder: {folder}"],
                                 rule=f"{flag} names {what} to create or replace",
                                 fix=f"pass a file in an existing, writable folder, e.g. {flag} {example}"))


def max_local_procs() -> int:
    """The default limit on local processes: :data:`PROCS_PER_CPU` per CPU core."""
    return PROCS_PER_CPU * (os.cpu_count() or 1)


def check_processes(mesh: Mesh, nproc: int, max_procs: int | None) -> None:
    """Refuse a local job the machine should not run.

    Args:
      mesh: the job's mesh (one process per device).
      nproc: processes the job would start.
      max_procs: the limit; ``None`` means :func:`max_local_procs`.

    Raises:
      MeshError: ``nproc`` is not the mesh size.
      UsageError: ``nproc`` is over the limit.
    """
    from ..exec.distributed import check_world_size

    check_world_size(mesh, nproc)
    limit = max_local_procs() if max_procs is None else max_procs
    if nproc > limit:
        raise UsageError(message(
            f"mesh '{mesh}' needs {nproc} local processes, more than the limit of {limit}",
            inputs=[f"mesh: {mesh} ({mesh.size} devices)", f"CPU cores: {os.cpu_count()}",
                    f"limit: {limit}" + ("" if max_procs is not None else
                                         f" ({PROCS_PER_CPU} per core)")],
            rule="a local job starts one process per mesh device; far more processes than cores "
                 "only thrash",
            fix="use a smaller mesh, run `check` without --nproc (the simulated mesh), spread the "
                f"job over machines with torchrun, or raise the limit with --max-procs {nproc}"))


# ------------------------------------------------------------------- memory

def plan_bytes(plan: Plan) -> int:
    """Bytes of every value of ``plan`` on one rank, sub-plans counted once per run (``Step.times``).

    This counts every value as if all were alive at once (the executor frees
    values after their last reader), so it is an upper bound.
    """
    total = sum(v.local_bytes(plan.mesh) for v in plan.values.values())
    return total + sum(s.times * plan_bytes(sub) for s in plan.steps for sub in s.subplans)


def dense_bytes(plan: Plan) -> int:
    """Bytes of the plan's values at their full (unsharded) shapes: what the dense run holds at most."""
    total = sum(math.prod(d.size for d in v.shape) * v.dtype.itemsize for v in plan.values.values())
    return total + sum(s.times * dense_bytes(sub) for s in plan.steps for sub in s.subplans)


def available_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo, or None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _gib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def check_simulated_memory(plan: Plan, available: int | None = None) -> None:
    """Refuse a simulated ``check`` whose values would not fit in memory.

    The estimate is the plan's value bytes on every rank (the simulated mesh
    holds all ranks in this process) plus the dense reference's values, each
    counted as if alive at once: an upper bound.

    Raises:
      UsageError: the estimate exceeds ``available`` (default: MemAvailable).
    """
    available = available_bytes() if available is None else available
    if available is None:
        return
    per_rank = plan_bytes(plan)
    need = per_rank * plan.mesh.size + dense_bytes(plan)
    if need <= available:
        return
    raise UsageError(message(
        f"the simulated run of mesh '{plan.mesh}' needs up to {_gib(need)}, more than the "
        f"{_gib(available)} of memory available",
        inputs=[f"mesh: {plan.mesh} ({plan.mesh.size} ranks, all simulated in this process)",
                f"per rank: {_gib(per_rank)} of values; dense reference: {_gib(dense_bytes(plan))}"],
        rule="the estimate counts every value of the plan on every rank as if alive at once",
        fix="use --tiny, a smaller mesh, or --nproc N to run the ranks as separate processes"))


def resolve_auto_layout(args, default_nproc: int | None = None, model=None) -> None:
    """``--layout auto`` (and ``--mesh auto``): replace them by the search's best layout (printed)."""
    if getattr(args, "layout", None) == "auto" or getattr(args, "mesh", None) == "auto":
        from .search_cli import auto_layout
        auto_layout(args, default_nproc, model)


__all__ = ["resolve_auto_layout", "UsageError", "int_in", "float_in", "check_processes", "check_simulated_memory",
           "plan_bytes", "dense_bytes", "available_bytes", "max_local_procs"]
