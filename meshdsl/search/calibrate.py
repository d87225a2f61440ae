"""Calibration: measure this machine's collectives and kernels, fit a few figures, cache them.

``meshdsl calibrate`` runs two sweeps and fits straight lines to them:

* collectives, on real processes (:func:`meshdsl.exec.launch.spawn`, one torch
  thread per rank): for each kind and group size, seconds against message
  size.  The samples are kept and a collective is priced by interpolating
  between them (gloo's time per byte is not constant: large messages cost
  more per byte than medium ones); the summary line printed is
  ``latency + fraction(n) * bytes / bandwidth``, the latency the smallest
  message's time and ``fraction`` the kind's ring factor from
  :data:`meshdsl.collectives.COLLECTIVES` (so ``bandwidth`` is a bus
  bandwidth, comparable across kinds and sizes);
* kernels, in this process with one thread: matmul/bmm seconds against FLOPs,
  and elementwise/reduction seconds against bytes touched, each
  ``overhead + amount / rate``, the overhead timed on a kernel with almost no work;
* the executor's own cost per step (dispatch, bookkeeping): a small training
  step is run by :class:`~meshdsl.exec.executor.Executor` and the part of its
  time the kernel lines do not explain is spread over its steps.

The result is a :class:`Calibration` saved as JSON in
``$MESHDSL_CACHE_DIR`` (default ``~/.cache/meshdsl``), one file per host and
backend.  :func:`load` returns it, or the uncalibrated defaults of
:mod:`meshdsl.lowering.cost` when there is none.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field

import torch

from ..collectives import COLLECTIVES
from ..lowering.cost import DEFAULT as DEFAULT_COST
from .overhead import dispatch_seconds, median_time, pipeline_dispatch_seconds

#: The collective kinds the sweep measures (``send`` stands for the send/recv pair).
KINDS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "send")
#: Kinds priced with another's measurements: a bucket is its member kind over one buffer.
PRICED_AS = {"recv": "send", "permute": "send", "bucket_allreduce": "allreduce",
             "bucket_reduce_scatter": "reduce_scatter"}
#: Message sizes in bytes per rank: full sweep and ``--quick``.
SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 19, 1 << 20, 1 << 22, 1 << 24)
QUICK_SIZES = (1 << 10, 1 << 16, 1 << 20)
#: Kernel sweep: square matmul sides and elementwise element counts.
MATMUL_SIDES = (32, 64, 128, 256, 384)
ELEMENTWISE_NUMELS = (1 << 10, 1 << 14, 1 << 17, 1 << 20)
#: Seconds of compute before each collective that :func:`_after_compute` times.
BURST_S = 1e-3
VERSION = 2


def _job_at(table: dict, job: int) -> int | None:
    """The smallest job size in ``table`` of at least ``job`` processes, else the largest."""
    jobs = sorted(table)
    return next((j for j in jobs if j >= job), jobs[-1] if jobs else None)


def cache_dir() -> str:
    """Where calibrations live: ``$MESHDSL_CACHE_DIR``, else ``~/.cache/meshdsl``."""
    return os.environ.get("MESHDSL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "meshdsl")


def cache_path(backend: str = "gloo", host: str | None = None) -> str:
    """``<cache dir>/calibration-<host>-<backend>.json``."""
    return os.path.join(cache_dir(), f"calibration-{host or socket.gethostname()}-{backend}.json")


@dataclass(frozen=True)
class Line:
    """``seconds = fixed_s + amount / rate``: a fitted line (amount in FLOPs or bytes)."""

    fixed_s: float
    rate: float

    def seconds(self, amount: float) -> float:
        return self.fixed_s + amount / self.rate


@dataclass
class Calibration:
    """Fitted figures of one host and backend.

    Attributes:
      collectives: kind -> group size -> :class:`Line` (``rate`` is the bus bandwidth in B/s,
        applied to ``fraction(n) * bytes``): the summary of ``samples``.
      samples: job size -> kind -> group size -> measured ``(bytes per rank, seconds)``, by
        size, with that many processes running (on a small host a 4-process job's
        collectives share the cores with twice as many processes as a 2-process job's); a
        collective of a measured kind and group is priced between them.
      after_compute_s: job size -> group size -> what a collective costs on top of its sweep
        time when the ranks come to it from compute, not from a barrier (measured; the cost
        model adds it to the first collective after local compute).
      matmul: seconds of a matmul-like kernel against its FLOPs.
      elementwise: seconds of an elementwise or reduction kernel against the bytes it touches.
      cores: CPU cores of the host: ranks beyond them share a core, so compute slows.
      source: ``"measured"`` or ``"defaults"`` (no calibration yet).
      dispatch_s: the executor's own seconds per step, on top of the kernel or collective.
      pipeline_dispatch_s: the same inside a pipeline's forward and backward actions (its
        runtime's per-action bookkeeping); 0: as ``dispatch_s``.
    """

    collectives: dict[str, dict[int, Line]]
    matmul: Line
    elementwise: Line
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    host: str = field(default_factory=socket.gethostname)
    backend: str = "gloo"
    source: str = "measured"
    dispatch_s: float = 0.0
    pipeline_dispatch_s: float = 0.0
    samples: dict[int, dict[str, dict[int, list[tuple[int, float]]]]] = field(default_factory=dict)
    after_compute_s: dict[int, dict[int, float]] = field(default_factory=dict)

    def collective(self, kind: str, nbytes: int, n: int, job: int | None = None) -> float:
        """Seconds of one collective sending ``nbytes`` per rank in a group of ``n``, in a job
        of ``job`` processes (default ``n``).

        A measured kind and group size is interpolated linearly between its samples (and
        continued past the largest along its last two), those of the smallest measured job
        of at least ``job`` processes (else the largest).  An unmeasured group size takes
        the nearest measured one's line, its latency scaled by the ring steps ``(n - 1)``;
        ``recv`` is priced with its ``send`` and a bucket as its members' kind (:data:`PRICED_AS`).
        """
        if n <= 1 or kind == "split":
            return 0.0
        kind = PRICED_AS.get(kind, kind)
        table = self.collectives.get(kind) or self.collectives["allreduce"]
        near = min(table, key=lambda m: (abs(m - n), m))
        at = _job_at(self.samples, job or n)
        points = self.samples[at].get(kind, {}).get(n) if at is not None else None
        if points:
            return interpolate(points, nbytes)
        line = table[near]
        steps = 1 if kind == "send" else (n - 1) / max(near - 1, 1)
        return line.fixed_s * steps + COLLECTIVES[kind].fraction(n) * nbytes / line.rate

    def after_compute(self, n: int, job: int) -> float:
        """Seconds a collective over ``n`` ranks costs beyond :meth:`collective` when the ranks
        come to it from compute, in a job of ``job`` processes (0 where not measured)."""
        at = _job_at(self.after_compute_s, job)
        return self.after_compute_s[at].get(n, 0.0) if at is not None else 0.0

    def kernel(self, matmul: bool, flops: int, nbytes: int, num_ranks: int = 1) -> float:
        """Seconds of one local kernel; ranks beyond :attr:`cores` share cores (a slowdown)."""
        t = self.matmul.seconds(flops) if matmul else self.elementwise.seconds(nbytes)
        return t * max(1.0, num_ranks / self.cores)

    def to_json(self) -> dict:
        return {"version": VERSION, "host": self.host, "backend": self.backend, "cores": self.cores,
                "source": self.source, "dispatch_s": self.dispatch_s,
                "pipeline_dispatch_s": self.pipeline_dispatch_s,
                "collectives": {k: {str(n): vars(l) for n, l in t.items()} for k, t in self.collectives.items()},
                "matmul": vars(self.matmul), "elementwise": vars(self.elementwise),
                "samples": {str(j): {k: {str(n): [list(p) for p in pts] for n, pts in t.items()}
                                     for k, t in kinds.items()} for j, kinds in self.samples.items()},
                "after_compute_s": {str(j): {str(n): x for n, x in t.items()}
                                    for j, t in self.after_compute_s.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "Calibration":
        return cls({k: {int(n): Line(**l) for n, l in t.items()} for k, t in d["collectives"].items()},
                   Line(**d["matmul"]), Line(**d["elementwise"]), d["cores"], d["host"], d["backend"],
                   d.get("source", "measured"), d.get("dispatch_s", 0.0), d.get("pipeline_dispatch_s", 0.0),
                   {int(j): {k: {int(n): [(int(b), float(t)) for b, t in pts] for n, pts in t.items()}
                             for k, t in kinds.items()} for j, kinds in d.get("samples", {}).items()},
                   {int(j): {int(n): float(x) for n, x in t.items()} for j, t in d.get("after_compute_s", {}).items()})

    @classmethod
    def defaults(cls) -> "Calibration":
        """The uncalibrated figures of :data:`meshdsl.lowering.cost.DEFAULT`."""
        c = DEFAULT_COST
        line = Line(c.latency_s, c.bandwidth_Bps)
        return cls({k: {2: line} for k in KINDS}, Line(10e-6, c.flops_per_s), Line(5e-6, 2e9),
                   source="defaults")


def load(backend: str = "gloo") -> Calibration:
    """This host's cached calibration for ``backend``, or :meth:`Calibration.defaults`."""
    try:
        with open(cache_path(backend)) as f:
            d = json.load(f)
        if d.get("version") == VERSION:
            return Calibration.from_json(d)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return Calibration.defaults()


def save(cal: Calibration) -> str:
    """Write ``cal`` to its cache file; returns the path."""
    path = cache_path(cal.backend, cal.host)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(cal.to_json(), f, indent=1)
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------- fitting

def interpolate(points: list[tuple[int, float]], x: float) -> float:
    """Piecewise-linear ``y(x)`` through ``points`` (sorted by x): the first point's y below
    them, their last two points' line above them (never below the last y)."""
    if x <= points[0][0] or len(points) == 1:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return max(y1, y1 + (y1 - y0) * (x - x1) / (x1 - x0))


def monotone(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """``points`` (sorted by size) with each time lowered to the least time of any larger size:
    a larger message never costs less, and timing noise only ever adds."""
    out, low = [], float("inf")
    for x, y in reversed(points):
        low = min(low, y)
        out.append((x, low))
    return out[::-1]


def fit_line(xs, ys, fixed: float | None = None) -> Line:
    """Least squares ``y = a + x / rate`` with ``a >= 0`` and a positive rate; with ``fixed``
    the intercept is that measured one and only the rate is fitted."""
    if fixed is not None:
        sxx = sum(x * x for x in xs)
        slope = sum(x * (y - fixed) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
        if slope <= 0:
            slope = max(ys) / max(xs) if max(xs) else 1e-12
        return Line(fixed, 1.0 / max(slope, 1e-18))
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    if slope <= 0:  # noise swamped the size dependence: price everything by the largest case
        slope = max(ys) / max(xs) if max(xs) else 1e-12
    fixed = my - slope * mx
    if fixed < 0:  # a negative intercept is noise; refit through the origin
        fixed = 0.0
        slope = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return Line(fixed, 1.0 / max(slope, 1e-18))


def _time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def sweep_kernels(quick: bool = False, tick=lambda: None) -> dict:
    """Time matmul/bmm and elementwise/reduction kernels with one thread; returns the samples."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    reps = 2 if quick else 4
    mm, ew = [], []
    try:
        for side in MATMUL_SIDES[:-1] if quick else MATMUL_SIDES:
            a, b = torch.randn(side, side), torch.randn(side, side)
            mm.append((2 * side ** 3, _time(lambda: a @ b, reps)))
            a3, b3 = torch.randn(4, side // 2, side), torch.randn(4, side, side // 2)
            mm.append((2 * 4 * (side // 2) ** 2 * side, _time(lambda: torch.bmm(a3, b3), reps)))
            tick()
        for numel in ELEMENTWISE_NUMELS:
            x, y = torch.randn(numel), torch.randn(numel)
            ew.append((3 * 4 * numel, _time(lambda: x * y, reps)))
            ew.append((2 * 4 * numel, _time(lambda: torch.exp(x), reps)))
            ew.append((4 * numel, _time(lambda: x.sum(), reps)))
            tick()
        # The per-kernel cost is measured, not extrapolated: a kernel with almost nothing to
        # do (a fit through the large sizes puts its intercept wherever their noise lands).
        a, x = torch.randn(8, 8), torch.randn(16)
        fixed = {"matmul": median_time(lambda: a @ a, 200), "elementwise": median_time(lambda: x * x, 200)}
    finally:
        torch.set_num_threads(threads)
    return {"matmul": mm, "elementwise": ew, "fixed": fixed}


def _collective_job(comm, sizes, reps, progress_file, done):
    """On every rank: time each kind over each group (axes suffix) and size; rank 0 writes
    the running count of samples (from ``done``) to ``progress_file``."""
    import torch.distributed as dist

    axes = comm.mesh.names
    out: dict = {}
    for kind in KINDS:
        for j in range(len(axes)):
            group = tuple(axes[j:])
            n = comm.mesh.axis_size(group)
            if kind == "send" and n != 2:
                continue
            for size in sizes:
                numel = size // 4
                x = torch.randn(max(numel, n * 2))
                args = {"allreduce": {"op": "sum"}, "allgather": {"dim": 0},
                        "reduce_scatter": {"dim": 0, "op": "sum"},
                        "alltoall": {"split_dim": 0, "concat_dim": 0}, "send": {"offset": 1, "tag": 7}}[kind]
                me = comm.mesh.index_along(comm.rank, group)

                def once():
                    if kind == "send":
                        comm.collective("send" if me == 0 else "recv", [x], group, args)
                        comm.drain()
                    else:
                        comm.collective(kind, [x], group, args)

                times = []
                # small messages are cheap and noisy: more repetitions
                for _ in range(reps * max(1, min(4, (1 << 22) // max(size, 1))) + 1):
                    dist.barrier()
                    t0 = time.perf_counter()
                    once()
                    times.append(time.perf_counter() - t0)
                out.setdefault(kind, {}).setdefault(n, []).append((x.numel() * 4, min(times[1:])))
                done += 1
                if comm.rank == 0 and progress_file:
                    with open(progress_file, "w") as f:
                        f.write(str(done))
    return out, _after_compute(comm, reps)


def _after_compute(comm, reps):
    """Per group size: the mean seconds a small allreduce takes when every rank comes to it
    from :data:`BURST_S` of compute (as in a training step), less its least time when the
    ranks come to it from a barrier (what the sweep prices).  The difference is what the
    sweep misses: the ranks arrive apart and a waiting rank is woken late."""
    import torch.distributed as dist

    a = torch.randn(96, 96)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    k = max(1, round(BURST_S / ((time.perf_counter() - t0) / 20)))
    x = torch.randn(256)
    extra = {}
    for j in range(len(comm.mesh.names)):
        group = tuple(comm.mesh.names[j:])
        times = {True: [], False: []}
        for i in range(48 * reps + 2):
            busy = i % 2 == 0
            if busy:
                for _ in range(k):
                    a @ a
            else:
                dist.barrier()
            t0 = time.perf_counter()
            comm.collective("allreduce", [x], group, {"op": "sum"})
            if i >= 2:
                times[busy].append(time.perf_counter() - t0)
        # The sweep prices a collective at its least time; reached from compute it costs on
        # average this much more (sometimes a late wake-up of milliseconds, mostly little).
        busy = times[True]
        extra[comm.mesh.axis_size(group)] = max(0.0, sum(busy) / len(busy) - min(times[False]))
    return extra


def collective_mesh(nproc: int) -> str:
    """A mesh whose axis suffixes give groups of 2, 4, ... ``nproc`` ranks (one axis otherwise)."""
    if nproc >= 2 and nproc & (nproc - 1) == 0:
        return "; ".join(f"g{i}:2" for i in range(nproc.bit_length() - 1))
    return f"g0:{nproc}"


def job_sizes(nproc: int) -> list[int]:
    """The job sizes the sweep runs: 2, 4, ... up to ``nproc``, and ``nproc``."""
    return sorted({1 << k for k in range(1, nproc.bit_length()) if 1 << k <= nproc} | {nproc})


def num_collective_samples(nproc: int, quick: bool) -> int:
    sizes = len(QUICK_SIZES if quick else SIZES)
    return sum(sizes * (len(collective_mesh(j).split(";")) * (len(KINDS) - 1) + 1) for j in job_sizes(nproc))


def sweep_collectives(nproc: int, backend: str = "gloo", quick: bool = False, progress_file: str | None = None,
                      timeout: float = 120.0) -> dict:
    """Run :func:`_collective_job` on 2, 4, ... ``nproc`` fresh processes (one job per size);
    returns job size -> kind -> group size -> samples, and job size -> group size -> the
    extra seconds of a collective reached from compute (:func:`_after_compute`)."""
    from ..exec.launch import spawn

    sizes = QUICK_SIZES if quick else SIZES
    out, after, done = {}, {}, 0
    for job in job_sizes(nproc):
        results = spawn(_collective_job, job, args=(sizes, 2 if quick else 4, progress_file, done),
                        timeout=timeout, backend=backend, mesh=collective_mesh(job))
        # Every rank waited for the slowest in each sample: take the per-sample max.
        merged: dict = {}
        for kind, table in results[0][0].items():
            for n, rows in table.items():
                merged.setdefault(kind, {})[n] = [
                    (b, max(r[0][kind][n][i][1] for r in results)) for i, (b, _) in enumerate(rows)]
                done += len(rows)
        out[job] = merged
        after[job] = {n: max(r[1][n] for r in results) for n in results[0][1]}
    return out, after


def summary_lines(kinds: dict) -> dict[str, dict[int, Line]]:
    """kind -> group size -> samples, summed up as lines: the latency the smallest message's
    time (not a fit's intercept, which lands wherever the largest sizes' noise puts it), the
    bus bandwidth fitted over the ring factor's bytes."""
    out: dict = {}
    for kind, table in kinds.items():
        for n, rows in table.items():
            frac = COLLECTIVES[kind].fraction(n)
            out.setdefault(kind, {})[n] = fit_line([frac * b for b, _ in rows], [t for _, t in rows],
                                                   fixed=rows[0][1])
    return out


def fit(collective_samples: dict, kernel_samples: dict, backend: str = "gloo",
        after_compute: dict | None = None) -> Calibration:
    """A :class:`Calibration` from the two sweeps' samples (and :func:`_after_compute`'s
    figures, job size -> group size -> seconds)."""
    samples = {job: {kind: {n: monotone(sorted(rows)) for n, rows in table.items()}
                     for kind, table in kinds.items()} for job, kinds in collective_samples.items()}
    coll = summary_lines(samples[max(samples)]) if samples else {}
    mm = kernel_samples["matmul"]
    ew = kernel_samples["elementwise"]
    fixed = kernel_samples.get("fixed", {})
    return Calibration(coll, fit_line([f for f, _ in mm], [t for _, t in mm], fixed.get("matmul")),
                       fit_line([b for b, _ in ew], [t for _, t in ew], fixed.get("elementwise")),
                       backend=backend, samples=samples, after_compute_s=dict(after_compute or {}))


def calibrate(nproc: int = 2, backend: str = "gloo", quick: bool = False, advance=lambda k: None,
              timeout: float = 120.0) -> Calibration:
    """Run both sweeps on this machine, fit them, save the result and return it.

    Args:
      nproc: processes of the collective sweep; a power of two measures groups of 2, 4, ... nproc.
      backend: the torch.distributed backend to measure.
      quick: fewer sizes and repetitions (a few seconds; for tests).
      advance: called with the number of samples just finished (drives a progress bar).
      timeout: seconds the collective sweep may take before its processes are killed.

    Returns:
      The saved :class:`Calibration` (see :func:`cache_path`).
    """
    import tempfile
    import threading

    kernels = sweep_kernels(quick, tick=lambda: advance(1))
    with tempfile.TemporaryDirectory() as tmp:
        progress = os.path.join(tmp, "done")
        box: dict = {}

        def work():
            try:
                box["samples"] = sweep_collectives(nproc, backend, quick, progress, timeout)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
                box["error"] = e

        t = threading.Thread(target=work, daemon=True)
        t.start()
        seen = 0
        while t.is_alive():
            t.join(0.2)
            try:
                with open(progress) as f:
                    now = int(f.read() or 0)
            except (OSError, ValueError):
                continue
            if now > seen:
                advance(now - seen)
                seen = now
        if "error" in box:
            raise box["error"]
    samples, after = box["samples"]
    cal = fit(samples, kernels, backend, after)
    cal.dispatch_s = dispatch_seconds(cal, 5 if quick else 20)
    cal.pipeline_dispatch_s = pipeline_dispatch_seconds(cal, 3 if quick else 10)
    advance(1)
    save(cal)
    return cal


def num_kernel_samples(quick: bool) -> int:
    return len(MATMUL_SIDES) - (1 if quick else 0) + len(ELEMENTWISE_NUMELS) + 1
