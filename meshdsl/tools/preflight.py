"""Checks the command line runs before any work starts: flag ranges, process count, memory.

Every user error should surface here, in the parent process and within a
second or two, rather than ten seconds later as one rank's traceback:

* ``argparse`` ``type=`` validators give each numeric flag its range
  (:func:`int_in`, :func:`float_in`);
* :func:`check_processes` refuses more local processes than the machine can
  reasonably run, and a backend it cannot run (``nccl`` without CUDA);
* :func:`check_simulated_memory` refuses a simulated run whose values cannot
  fit in the memory available;
* :func:`check_memory` refuses a job whose predicted memory per rank (the plan's
  params, gradients, optimizer state and peak activations:
  :func:`meshdsl.lowering.memory.memory_report`) exceeds what the machine has
  (its RAM, shared by its local ranks, or each rank's GPU), before anything is
  allocated; ``plan`` prints :func:`memory_warning` instead.
  ``MESHDSL_MEMORY_CHECK=0`` turns the refusal into that warning.
"""
from __future__ import annotations

import argparse
import math
import os

from ..errors import MeshDSLError, message
from ..layout.mesh import Mesh
from ..lowering.plan import Plan
from ..lowering.users_terms import about_plan, num_microbatches, user_mesh_layout

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
    from ..comm.distributed import check_world_size

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
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
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
    m = num_microbatches(plan)
    each = "per rank" if m == 1 else "per rank and micro-batch"
    raise UsageError(about_plan(message(
        f"the simulated run of mesh '{plan.mesh}' needs up to {_gib(need)}, more than the "
        f"{_gib(available)} of memory available",
        inputs=[f"mesh: {plan.mesh}", f"ranks: {plan.mesh.size // m}, all simulated in this process",
                f"{each}: {_gib(per_rank)} of values; dense reference: {_gib(dense_bytes(plan))}"],
        rule="the estimate counts every value of the plan on every rank as if alive at once",
        fix="use --tiny, a smaller mesh, or --nproc N to run the ranks as separate processes"), plan))


MEMORY_CHECK_ENV = "MESHDSL_MEMORY_CHECK"  # "0": warn instead of refusing (check_memory)


def total_memory_bytes() -> tuple[int | None, str]:
    """This machine's RAM and where the figure comes from: ``MemTotal`` (/proc/meminfo, else
    ``os.sysconf``), or the cgroup's ``memory.max`` when a container sets a lower one; None if
    unknown."""
    total, source = None, "MemTotal"
    try:
        with open("/proc/meminfo") as f:
            total = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:")), None)
    except OSError:
        pass
    if total is None:
        try:
            total, source = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "sysconf"
        except (ValueError, OSError, AttributeError):
            pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            cap = f.read().strip()
        if cap.isdigit() and (total is None or int(cap) < total):
            total, source = int(cap), "cgroup memory.max"
    except OSError:
        pass
    return total, source


def _memory_limit(gpu: bool) -> tuple[int | None, str]:
    """Bytes of the memory the ranks here share, and what it is: this machine's RAM, or (``gpu``)
    the smallest GPU's."""
    if gpu:
        import torch
        if not torch.cuda.is_available():
            return None, ""
        size = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
        return size, f"the GPU's memory, {_gib(size)} (torch.cuda)"
    total, source = total_memory_bytes()
    return total, f"this machine's memory, {_gib(total or 0)} ({source})"


def predicted_bytes(plan: Plan, ranks_here: int = 1) -> tuple[int, int, str]:
    """What the plan's tensors need (params + gradients + optimizer state + peak activations):
    ``(bytes for the ranks_here ranks that share one memory, bytes of the largest rank, that
    rank's four figures in words)``.  All the mesh's ranks: their figures summed; fewer (a
    torchrun host's): the largest rank's times their count.  A rank is a process: the
    micro-batch ranks it holds (``_mb``, minor) count as the largest of them."""
    from ..lowering.memory import KEYS, memory_report
    from ..lowering.pipeline import MB_AXIS
    virtual = memory_report(plan, per_rank=True)["ranks"]
    mb = plan.mesh.sizes.get(MB_AXIS, 1)
    ranks = [max(virtual[r:r + mb], key=lambda x: sum(x.values())) for r in range(0, len(virtual), mb)]
    totals = [sum(r[k] for k in KEYS) for r in ranks]
    big = ranks[totals.index(max(totals))]
    words = f"params {_gib(big['params'])}, grads {_gib(big['grads'])}, optimizer state " \
            f"{_gib(big['optimizer'])}, peak activations {_gib(big['activations_peak'])}"
    here = sum(totals) if ranks_here >= len(ranks) else max(totals) * ranks_here
    return here, max(totals), words


def _over(plan: Plan, gpu: bool, ranks_here: int):
    """``(need, per_rank, words, limit, where)`` when the plan does not fit here, else None."""
    limit, where = _memory_limit(gpu)
    need, per_rank, words = predicted_bytes(plan, ranks_here)
    if limit is None or need <= limit:
        return None
    return need, per_rank, words, limit, where


def _need_words(need: int, per_rank: int, ranks_here: int, gpu: bool) -> str:
    if ranks_here == 1:
        return f"{_gib(need)} per rank"
    return f"{_gib(need)} for the {ranks_here} ranks on this {'GPU' if gpu else 'machine'} " \
           f"(up to {_gib(per_rank)} per rank)"


def memory_warning(plan: Plan, gpu: bool = False, ranks_here: int = 1) -> str | None:
    """One line when the plan's predicted memory exceeds this machine's (see
    :func:`check_memory`); None when it fits or the machine's memory is unknown."""
    over = _over(plan, gpu, ranks_here)
    if over is None:
        return None
    need, per_rank, _, _, where = over
    return (f"warning: predicted memory {_need_words(need, per_rank, ranks_here, gpu)} exceeds {where}: "
            f"run, check and train refuse this job here")


def check_memory(plan: Plan, command: str, gpu: bool = False, ranks_here: int = 1) -> None:
    """Refuse a job whose predicted memory exceeds what this machine has, before anything is
    allocated.

    The prediction is :func:`~meshdsl.lowering.memory.memory_report`'s (``meshdsl plan``'s
    memory line), read off the plan: what the plan's own tensors need.  A process needs
    more (the interpreter, torch), so a job refused here could never run.

    Args:
      command: ``run``, ``check`` or ``train``, for the warning (``MESHDSL_MEMORY_CHECK=0``).
      gpu: the ranks' tensors live on GPUs (their memory is the limit), not in RAM.
      ranks_here: ranks that share the memory checked: every local process (RAM), the
        simulated ranks on one GPU, or 1 (a GPU of its own per rank).

    Raises:
      UsageError: the prediction, the limit and the fix; unless ``MESHDSL_MEMORY_CHECK=0``,
        which prints :func:`memory_warning` and goes on.
    """
    over = _over(plan, gpu, ranks_here)
    if over is None:
        return
    need, per_rank, words, _, where = over
    if os.environ.get(MEMORY_CHECK_ENV, "").strip() == "0":
        import sys
        print(f"meshdsl {command}: {memory_warning(plan, gpu, ranks_here)}; {MEMORY_CHECK_ENV}=0: running anyway",
              file=sys.stderr, flush=True)
        return
    raise UsageError(message(
        f"the predicted memory, {_need_words(need, per_rank, ranks_here, gpu)}, exceeds {where}",
        inputs=[f"mesh: {user_mesh_layout(plan)[0]}", f"the largest rank: {words}"],
        rule="a job runs only where its plan's tensors fit (the prediction is `meshdsl plan`'s memory line: "
             "the plan's own tensors, without the interpreter and torch)",
        fix=f"use a smaller --config (or --tiny), shard params and optimizer state over devices that have "
            f"memory of their own (e.g. 'params.d_model:data' over GPUs or machines), or run where there is "
            f"more memory; {MEMORY_CHECK_ENV}=0 runs it anyway"))


__all__ = ["UsageError", "int_in", "float_in", "check_processes", "check_simulated_memory",
           "check_memory", "memory_warning", "predicted_bytes", "total_memory_bytes", "MEMORY_CHECK_ENV",
           "plan_bytes", "dense_bytes", "available_bytes", "max_local_procs"]
