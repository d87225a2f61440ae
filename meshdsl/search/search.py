"""Rank the candidates of :mod:`.space` by predicted step time.

The space holds every dim of the model; the options a cheap estimate prunes
(:mod:`.dims`) are counted, not compiled.  Each other candidate is compiled (one
training step) and priced by :func:`.predict.predict`; one that does not compile
is invalid, one whose memory per rank exceeds the limit is infeasible, and both
are counted (not ranked).  A space of at most :data:`EXHAUSTIVE_LIMIT` candidates is searched
exhaustively.  A larger one is searched coarse to fine, a beam over meshes:
each mesh is first priced by its cheapest few *skeletons* (the first option
of each role: plain DP, Megatron TP, the fewest micro-batches), the
:data:`BEAM` best meshes survive, and every candidate on them is then
priced.  Options inside a role change a step's time far less than the mesh
shape does (which dims are split how many ways), which is what makes the
beam safe.

Every listed candidate uses every axis of its mesh.  One whose axis no rule splits over
(``data:2; model:2`` with ``batch:data`` alone) is a smaller mesh in disguise: the axis's
ranks repeat each other's work, and asked for fewer processes the search finds the smaller
mesh itself.  Such a candidate is priced (the reference) but not listed, nor is one whose rules
on that axis save no more than :data:`RESOLUTION` of its step time and leave each rank at least
:data:`REPLICATED_WORK` of its work (a small side dim split over the otherwise idle axis): both are
counted as invalid, with the reason.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from ..errors import MeshDSLError
from ..lowering.compiler import compile as compile_plan
from ..lowering.partition import with_schedule
from ..lowering.schedule_gen import parse_schedule
from ..train.state_updates import check_held_where_updated, with_updates
from .calibrate import Calibration, Line
from .dims import Splits
from .predict import Prediction, path_compute_s, predict
from .space import Candidate, candidates, idle_axes

EXHAUSTIVE_LIMIT = 600
BEAM = 3
SKELETONS = 2
#: Pipelined plans the search keeps to re-price under another schedule (it prices a layout's
#: schedules one after another, so a couple suffice).
KEEP_PLANS = 2
#: How close (relative) two predicted step times are for the ranking to call them equal and
#: prefer the candidate with fewer rules (:func:`order`): a rule predicted to save less than this
#: is within what the cost model can tell apart, so it does not earn its place.
RESOLUTION = 0.01
#: The share of the whole model's work per rank (no rule on the mesh) at or above which a
#: candidate is in effect replicated (:meth:`SearchResult.replicates`): its rules split only a
#: side of the model.
REPLICATED_WORK = 0.95
#: Young-generation collections between two full ones while a search runs (Python's default: 10),
#: see :func:`few_full_collections`.
GC_FULL = 1000


@dataclass
class Ranked:
    """A candidate with its prediction."""

    candidate: Candidate
    prediction: Prediction

    def to_json(self) -> dict:
        """The ``--json`` entry: ``mesh``, ``layout``, ``predicted_ms``, ``predicted_memory_bytes``,
        ``comm_bytes`` (plus ``microbatches`` and ``schedule`` for a pipelined candidate, which
        ``run`` needs as flags)."""
        c, p = self.candidate, self.prediction
        out = {"mesh": c.mesh, "layout": c.layout, "predicted_ms": p.step_s * 1e3,
               "predicted_memory_bytes": p.memory_bytes, "comm_bytes": p.comm_bytes}
        if c.pipelined:
            out.update(microbatches=c.microbatches, schedule=c.schedule)
        return out


@dataclass
class SearchResult:
    """Ranked candidates, best first, and what was dropped.

    Attributes:
      ranked: the feasible candidates by predicted step time.
      num_candidates: the size of the space.
      num_evaluated: candidates compiled and priced.
      invalid: ``(candidate, reason)`` of those that do not compile (a dim the axis does not
        divide, one dim on two axes, the compiler's refusal).
      infeasible: ranked entries over the memory limit.
      strategy: ``"exhaustive"`` or ``"beam"``.
      seconds: wall time of the search.
      by_cost: ``(candidate, reason)`` of those with an option pruned by cost (not compiled).
      splits: the options per axis role and the verdict on each dim (:class:`~.dims.Splits`).
      work: a candidate's kernel work per rank in seconds without per-kernel costs (compiles it),
        for :meth:`replicates`.
    """

    ranked: list[Ranked]
    num_candidates: int
    num_evaluated: int
    invalid: list
    infeasible: list[Ranked]
    strategy: str
    seconds: float
    by_cost: list = field(default_factory=list)
    splits: Splits | None = None
    work: Callable[[Candidate], float] | None = None
    _work: dict = field(default_factory=dict, repr=False)

    def replicates(self, r: Ranked) -> bool:
        """``r`` leaves every rank doing about the whole model's work, whatever its rules say:
        its kernels' work per rank (FLOPs and bytes, without the per-kernel costs) is at least
        :data:`REPLICATED_WORK` of the same mesh's with no rule.  A pipeline never is.
        ``work`` (set by :func:`search`) prices a candidate's work; each is compiled once."""
        c = r.candidate
        if not c.layout or c.staged or self.work is None:
            return False
        idle = Candidate(c.mesh, "", c.microbatches)
        for x in (c, idle):
            if x not in self._work:
                self._work[x] = self.work(x)
        return self._work[c] >= REPLICATED_WORK * self._work[idle] > 0


def evaluate(outputs, cand: Candidate, cal: Calibration, compiled: dict | None = None,
             strict_splits: bool = False, work: _Work | None = None, updates=()) -> Ranked:
    """Compile ``cand`` and predict it (``strict_splits``: refuse an uneven split, as the compiler does).

    ``compiled``, when given, keeps the last few pipelined plans by (mesh, layout,
    micro-batches, virtual stages per rank): a candidate that differs from one of them only in
    its schedule takes that
    plan with its schedule swapped (:func:`~meshdsl.lowering.partition.with_schedule`, the
    same plan a compilation would give) instead of compiling again.  ``work``, when given, prices
    the candidate's work from the plan at once (:class:`_Work`).  ``updates``: the names of the
    frozen params the step sets (``Model.updates``), whose next values ``TrainStep`` needs made
    on every rank that holds them.

    Raises:
      MeshDSLError: the compiler's error when ``cand`` is invalid, or ``TrainStep``'s refusal of
        a pipeline whose updates read params on stages that do not update them.  (A plan the compiler
        returns is one real processes can run: it never moves micro-batches other than by
        summing them, see :meth:`~meshdsl.lowering.compiler.Lowerer.emit`.)
    """
    # Only plans with as many stages per rank swap schedules (the chunks are cut at compilation).
    key = (cand.mesh, cand.layout, cand.microbatches, parse_schedule(cand.schedule)[1])
    plan = None
    if compiled is not None and key in compiled:
        try:
            plan = with_schedule(compiled[key], cand.schedule)
        except (MeshDSLError, ValueError):
            plan = None      # compile, for the compiler's own error
    if plan is None:
        plan = compile_plan(outputs, cand.mesh, cand.layout, microbatches=cand.microbatches, schedule=cand.schedule,
                            strict_splits=strict_splits)
        if compiled is not None and cand.staged:
            compiled[key] = plan
            while len(compiled) > KEEP_PLANS:
                compiled.pop(next(iter(compiled)))
    if updates:   # a layout TrainStep refuses is no answer
        carried = [k for k in plan.params if f"new/{k}" in plan.outputs]
        check_held_where_updated(plan, carried, updates, cand.mesh, cand.layout)
    orders: dict = {}   # the plan's issue orders, for both prices
    if work is not None:
        work.of_plan(cand, plan, orders)
    return Ranked(cand, predict(plan, cal, orders))


def search(model, outputs, nproc: int, cal: Calibration, memory_limit: float | None = None,
           exhaustive_limit: int = EXHAUSTIVE_LIMIT, beam: int = BEAM, split_dims=(), no_split=(),
           strict_splits: bool = False) -> SearchResult:
    """Rank every layout of ``model`` on ``nproc`` processes by predicted step time.

    Args:
      model: the loaded model (the dims of its graph define the space).
      outputs: the training step's outputs (loss, new params, optimizer state); the
        ``new/NAME`` of each of the model's ``updates`` (frozen params set in the step) is
        added where missing, so the search prices the step that trains.
      nproc: processes (mesh devices).
      cal: the calibration to price with.
      memory_limit: bytes per rank a candidate may need at most (None: no limit).
      exhaustive_limit: the largest space searched exhaustively.
      beam: meshes kept by the coarse pass of a larger space.
      split_dims: dims the search always considers splitting, whatever their estimated cost,
        e.g. ``("kv_heads", "d_ff")``.
      no_split: dims the search never splits (on any axis, in any scope).
      strict_splits: no uneven split (a dim its mesh axes do not divide, which by default is
        split into parts the first ``size % n`` of which are one longer, priced by its largest part).

    Returns:
      A :class:`SearchResult`; ``ranked`` is empty when nothing is valid and fits.

    Raises:
      LayoutError: ``split_dims`` or ``no_split`` names a dim the model does not have.
    """
    with few_full_collections():
        return _search(model, outputs, nproc, cal, memory_limit, exhaustive_limit, beam, split_dims, no_split,
                       strict_splits)


@contextmanager
def few_full_collections():
    """Python's full garbage collections at most every :data:`GC_FULL` young ones while inside
    (:func:`search`, and ``meshdsl search`` around it: the model's build, the table).

    A search holds many plans (its compiled candidates, the compile cache), and each full
    collection walks all of them: at Python's default (every 10) they took a quarter of the
    search's time (``heldout_convnextv2`` on 4 processes: 40 s, 28 s with this).  Every cycle is
    still collected, later; the thresholds are put back on the way out."""
    old = gc.get_threshold()
    gc.set_threshold(old[0], old[1], max(old[2], GC_FULL))
    try:
        yield
    finally:
        gc.set_threshold(*old)


def _search(model, outputs, nproc, cal, memory_limit, exhaustive_limit, beam, split_dims, no_split,
            strict_splits) -> SearchResult:
    """:func:`search`'s work."""
    t0 = time.perf_counter()
    updates = getattr(model, "updates", None) or {}
    outputs = with_updates(outputs, updates, model.graph)
    stateful = any(k.startswith("opt/") for k in model.graph.params)
    splits = Splits.of(model, outputs, cal, nproc, stateful, split_dims, no_split, strict_splits)
    pruned: list = []
    by_cost: list = []
    space = list(candidates(model, nproc, stateful, pruned, splits, by_cost))
    seen: dict[Candidate, Ranked | str] = {}
    compiled: dict = {}
    work = _Work(outputs, cal, nproc, strict_splits)

    def price(c: Candidate):
        if c not in seen:
            try:
                seen[c] = evaluate(outputs, c, cal, compiled, strict_splits, work, tuple(updates))
            except MeshDSLError as e:
                seen[c] = str(e).splitlines()[0]
        return seen[c]

    if len(space) <= exhaustive_limit:
        strategy, todo = "exhaustive", space
    else:
        strategy = "beam"
        by_mesh: dict[str, list[Candidate]] = {}
        for c in space:
            by_mesh.setdefault(c.mesh, []).append(c)
        best: dict[str, float] = {}
        for mesh, cs in by_mesh.items():
            found = 0
            for c in _skeletons(cs):
                r = price(c)
                if isinstance(r, Ranked) and _fits(r, memory_limit):
                    best[mesh] = min(best.get(mesh, float("inf")), r.prediction.step_s)
                    found += 1
                if found == SKELETONS:
                    break
        keep = sorted(best, key=best.get)[:beam]
        todo = [c for m in keep for c in by_mesh[m]]
    # A layout's schedules one after another, so each pipelined layout compiles once.
    groups: dict[tuple, list[Candidate]] = {}
    for c in todo:
        groups.setdefault((c.mesh, c.layout, c.microbatches), []).append(c)
    for group in groups.values():
        for c in group:
            price(c)
    ranked = [r for r in seen.values() if isinstance(r, Ranked)]
    idle = _disguised(ranked, work)   # (whatever the memory limit: the same list)
    ok = order([r for r in ranked if _fits(r, memory_limit) and id(r) not in idle])
    over = [r for r in ranked if not _fits(r, memory_limit) and id(r) not in idle]
    invalid = pruned + [(c, r) for c, r in seen.items() if isinstance(r, str)] + \
        [(r.candidate, idle[id(r)]) for r in ranked if id(r) in idle]
    return SearchResult(ok, len(space) + len(pruned) + len(by_cost), len(seen), invalid, over, strategy,
                        time.perf_counter() - t0, by_cost, splits, work)


class _Work:
    """A candidate's kernel seconds per rank on the critical path priced by FLOPs and bytes alone
    (no per-kernel or dispatch cost, no core sharing): its work; 0 when it does not compile.

    Called with a candidate; each is priced once.  A candidate the search compiled is priced
    from its plan then (:meth:`of_plan`): asked later, the compile cache keeps the last 64
    plans only, and a search compiles more (``moe`` on 4 processes: 136, of which
    :func:`_disguised` then compiled ~70 again, a third of the search's time)."""

    def __init__(self, outputs, cal: Calibration, nproc: int, strict_splits: bool):
        self.outputs, self.strict_splits = outputs, strict_splits
        self.cal = replace(cal, matmul=Line(0.0, cal.matmul.rate), elementwise=Line(0.0, cal.elementwise.rate),
                           dispatch_s=0.0, pipeline_dispatch_s=0.0, cores=nproc)
        self.known: dict[Candidate, float] = {}

    def of_plan(self, c: Candidate, plan, orders: dict | None = None) -> None:
        """Price ``c``'s work from ``plan``, its compiled plan (``orders``: its issue orders, as
        :func:`~.predict.predict` takes them)."""
        if c not in self.known:
            self.known[c] = path_compute_s(plan, self.cal, orders)

    def __call__(self, c: Candidate) -> float:
        if c not in self.known:
            try:
                plan = compile_plan(self.outputs, c.mesh, c.layout, microbatches=c.microbatches,
                                    schedule=c.schedule, strict_splits=self.strict_splits)
            except MeshDSLError:
                self.known[c] = 0.0
            else:
                self.of_plan(c, plan)
        return self.known[c]


def order(ranked: list[Ranked], resolution: float = RESOLUTION) -> list[Ranked]:
    """``ranked`` best first: by predicted step time, except that a candidate ranks after a
    simpler one it is not predicted faster than by more than ``resolution`` (relative).

    A simpler candidate has the same mesh and pipeline and a strict subset of the rules: a
    rule that saves less than the cost model can resolve (a small side dim split over the
    model axis, which leaves every rank doing the whole model's work) does not put its layout
    first; the plain layout that says what the plan does ranks first instead.  Ties go to the
    fewer rules.
    """
    by_setup: dict[tuple, list[tuple[frozenset, Ranked]]] = {}
    for r in ranked:
        c = r.candidate
        by_setup.setdefault((c.mesh, c.microbatches, c.schedule), []).append((_rule_set(c), r))

    # Simpler first, so that a candidate ranks after the place its simpler ones were moved to.
    place: dict[int, float] = {}
    for r in sorted(ranked, key=lambda r: len(_rule_set(r.candidate))):
        c, t = r.candidate, r.prediction.step_s
        rules = _rule_set(c)
        place[id(r)] = max([t] + [place[id(s)] for rs, s in by_setup[(c.mesh, c.microbatches, c.schedule)]
                                  if rs < rules and t * (1 + resolution) >= s.prediction.step_s])
    return sorted(ranked, key=lambda r: (place[id(r)], len(_rule_set(r.candidate)), r.candidate))


def _disguised(ranked: list[Ranked], work: Callable[[Candidate], float],
               resolution: float = RESOLUTION) -> dict[int, str]:
    """Why each candidate of ``ranked`` that is a smaller mesh in disguise is one (by ``id``): an
    axis of its mesh splits nothing, or, beside such a candidate with a subset of its rules (same
    mesh and pipeline), it is not faster by more than ``resolution`` (relative) and its ranks do
    at least :data:`REPLICATED_WORK` of that one's ``work`` (a small side dim split)."""
    idle = [r for r in ranked if idle_axes(r.candidate)]
    out: dict[int, str] = {}
    for r in ranked:
        c = r.candidate
        if idle_axes(c):
            out[id(r)] = (f"axis '{idle_axes(c)[0]}' splits nothing: its ranks repeat each other's "
                          f"work (a smaller mesh in disguise)")
            continue
        for s in idle:
            d = s.candidate
            if (d.mesh, d.microbatches, d.schedule) == (c.mesh, c.microbatches, c.schedule) and \
                    _rule_set(d) < _rule_set(c) and r.prediction.step_s * (1 + resolution) >= s.prediction.step_s \
                    and work(c) >= REPLICATED_WORK * work(d) > 0:
                out[id(r)] = (f"its rules on axis '{idle_axes(d)[0]}' save less than {resolution:.0%} over "
                              f"leaving it idle (a smaller mesh in disguise)")
                break
    return out


def _rule_set(c: Candidate) -> frozenset:
    return frozenset(filter(None, c.layout.split("; ")))


def _fits(r: Ranked, limit: float | None) -> bool:
    return limit is None or r.prediction.memory_bytes <= limit


def _skeletons(cs: list[Candidate]):
    """A mesh's candidates, one per strategy family head first (``DP+TP`` before its variants),
    then the rest: the coarse pass prices the first :data:`SKELETONS` of them that are valid."""
    heads: set[str] = set()
    rest = []
    for c in cs:
        head = c.family.split("(")[0]
        if head in heads:
            rest.append(c)
        else:
            heads.add(head)
            yield c
    yield from rest
