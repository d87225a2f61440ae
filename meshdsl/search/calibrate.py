"""Calibration: this machine's measured collectives and kernels, fitted, priced and cached.

``meshdsl calibrate`` (:func:`meshdsl.search.measure.calibrate`) runs the two sweeps of
:mod:`.sweep` and fits them here:

* collectives, on real processes (:func:`meshdsl.processes.launcher.spawn`, one torch
  thread per rank), per job size: for each kind and group size, seconds against
  message size, and what a collective reached from compute costs on top.  The
  samples are kept and a collective is priced by interpolating between them
  (gloo's time per byte is not constant: large messages cost more per byte
  than medium ones); the summary line printed is
  ``latency + fraction(n) * bytes / bandwidth``, the latency the smallest
  message's time and ``fraction`` the kind's ring factor from
  :data:`meshdsl.collectives.COLLECTIVES` (so ``bandwidth`` is a bus
  bandwidth, comparable across kinds and sizes);
* kernels, in this process with one thread: matmul/bmm seconds against FLOPs,
  and elementwise/reduction seconds against bytes touched, each
  ``overhead + amount / rate``, the overhead timed on a kernel with almost no work;
* the executor's own cost per step (dispatch, bookkeeping): a small training
  step is run by :class:`~meshdsl.runtime.executor.Executor` and the part of its
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
from dataclasses import dataclass, field

from ..collectives import COLLECTIVES
from ..lowering.cost import DEFAULT as DEFAULT_COST
from .sweep import KINDS

#: Kinds priced with another's measurements: a bucket is its member kind over one buffer.
PRICED_AS = {"recv": "send", "permute": "send", "bucket_permute": "send", "bucket_allreduce": "allreduce",
             "bucket_reduce_scatter": "reduce_scatter", "bucket_allgather": "allgather"}
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
        at = _job_at(self.samples, job or n)
        points = self.samples[at].get(kind, {}).get(n) if at is not None else None
        if points:
            return interpolate(points, nbytes)
        table = self.collectives.get(kind) or self.collectives["allreduce"]
        near = min(table, key=lambda m: (abs(m - n), m))
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
    """Write ``cal`` to its cache file; returns the path.

    The JSON goes into a new file beside it, named by ``tempfile`` (created ``O_EXCL``: never an
    existing file, nor through a link placed at a name one could guess), renamed over it whole.
    """
    import tempfile

    path = cache_path(cal.backend, cal.host)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(cal.to_json(), f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
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
