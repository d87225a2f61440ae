"""``--compile``: a rank's plan run as segments compiled by ``torch.compile`` (inductor).

The executor's straight-line program (:mod:`.program`) already lists a rank's steps in
issue order.  With ``compile`` each maximal run of consecutive local steps between two
other steps (collectives, loops, pipelines, reads of a collective still in flight) becomes
one *segment*: a function generated from the steps (one kernel call per step and held
rank, never from a user's string), traced by dynamo and compiled by the backend, so the
elementwise chains between matmuls fuse and the per-step Python disappears.  Collectives
stay outside, run by the communicator as in the eager executor, so every communicator
(simulated, gloo, shared memory) and the issue order's overlap work unchanged.  A loop's
body is a plan of its own with its own segments: compiled once, run for every layer
(regional compilation).  Where every rank is in this process, the whole run is one graph
instead (:mod:`.whole`, :func:`whole_step`); segments run what it cannot hold.  See
docs/design/compile.md.

* Kernels, their attrs and their per-rank contexts are the segment function's arguments,
  not baked in: two executors whose segments have the same source share one compiled
  function (a pipeline prepares a loop's body once per stage and micro-batch), and
  dynamo's guards recompile where a kernel reads something that differs.
* Shapes are static (``dynamic=False``): a plan never changes its shapes.
* Segments run the plain kernels (no in-place adds, no donation): the compiler plans the
  memory, and the results are the same values.
* A segment the backend cannot compile runs eagerly from its first call on, with a
  one-line notice: never an error in the middle of a run.
* Compile time is the first call's time per segment, summed in :class:`CompileStats`;
  inductor's FX graph cache (on by default, under ``torch._inductor``'s cache dir) keeps
  compiled kernels across runs and processes.
"""
from __future__ import annotations

import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

from ..errors import GraphError, env_choice, message
from .program import ALIASES, Unit, units_of
from .steps import local_kernel, reads_salt
from .whole import WholeStep, why_not

#: the ``torch.compile`` backends a user may name (``compile=True`` means inductor)
BACKENDS = ("inductor", "aot_eager", "eager")
#: local ops left out of segments: gather checks its ids against the table on the host (an error
#: the user can act on, from a read-back dynamo would break its graph at)
EAGER_OPS = frozenset({"gather"})
#: a run of local steps shorter than this (not counting aliases) stays eager: too little to fuse
MIN_KERNELS = 2


def _stderr_notice(line: str) -> None:
    print(f"meshdsl: {line}", file=sys.stderr, flush=True)


@dataclass
class CompileStats:
    """What compiling cost, shared by an executor and its loops' bodies."""

    whole: int = 0            # whole steps compiled as one graph each (:mod:`.whole`)
    cuda_graphs: int = 0      # of them, captured as a CUDA graph (:mod:`.cuda_graph`)
    segments: int = 0         # segments compiled (their first calls)
    steps: int = 0            # local kernels in them (an alias is none)
    shared: int = 0           # segments that run a function another one of this run compiled (same source)
    keys: set = field(default_factory=set)   # the (source, shapes) this run's segments compiled
    seconds: float = 0.0      # the first calls' wall time (tracing, compiling, one run)
    fallbacks: list = field(default_factory=list)   # one line per segment left eager

    def summary(self) -> str:
        shared = f" (and {self.shared} more sharing them)" if self.shared else ""
        eager = f"; {len(self.fallbacks)} left eager" if self.fallbacks else ""
        captured = f" ({self.cuda_graphs} captured as CUDA graphs)" if self.cuda_graphs else ""
        what = (f"the whole step as {self.whole} graph(s){captured}" if self.whole else "") + \
            (" and " if self.whole and self.segments else "") + \
            (f"{self.segments} segment(s)" if self.segments or not self.whole else "")
        return f"{what} of {self.steps} local kernels{shared} compiled in {self.seconds:.1f} s{eager}"


def cuda_graphs_wanted() -> bool:
    """``$MESHDSL_CUDA_GRAPHS``, checked: whether ``--compile`` captures a whole step on a GPU as a CUDA graph."""
    return env_choice("MESHDSL_CUDA_GRAPHS", ("1", "0"), "a CUDA-graph setting",
                      "set it to 0 to run compiled steps without CUDA graphs", GraphError) == "1"


@dataclass(eq=False)
class CompileSettings:
    """How an executor compiles (``Executor(..., compile=...)``); its loops' bodies share it."""

    backend: str = "inductor"
    stats: CompileStats = field(default_factory=CompileStats)
    notice: Callable[[str], None] = _stderr_notice
    #: whether a plan that can be one graph compiles as one (:mod:`.whole`); False: segments always
    whole: bool = True
    #: whether a whole step on a CUDA device is captured as a CUDA graph (:mod:`.cuda_graph`);
    #: default: ``$MESHDSL_CUDA_GRAPHS`` (``1``, or ``0`` to leave them out)
    cuda_graphs: bool = field(default_factory=lambda: cuda_graphs_wanted())


def settings_of(compile) -> CompileSettings | None:
    """``compile`` as given to the executor: False/None (eager), True (inductor), a backend
    name, or :class:`CompileSettings` (shared as it is).

    Raises:
      GraphError: an unknown backend name.
    """
    if compile is None or compile is False:
        return None
    if isinstance(compile, CompileSettings):
        return compile
    backend = "inductor" if compile is True else compile
    if backend not in BACKENDS:
        raise GraphError(message(f"Executor(compile={compile!r}): unknown backend.",
                                 inputs=[f"backends: {', '.join(BACKENDS)}"],
                                 rule="compile is True (inductor), False, or a torch.compile backend named above",
                                 fix="pass compile=True"))
    return CompileSettings(backend)


def whole_step(ex) -> WholeStep | None:
    """Executor ``ex``'s :class:`~.whole.WholeStep` (made at its first run), or None where its runs
    take the segments: whole steps turned off, a loop's body (its loop runs it), a plan that
    cannot be one graph (:func:`.whole.why_not`), or a whole step that failed."""
    settings = ex.compiling
    if not settings.whole or not ex.check_feeds:
        return None
    if ex.whole is None:
        ex.whole = WholeStep(ex, settings) if why_not(ex) is None else False
    return ex.whole if ex.whole and not ex.whole.off else None


def segments_of(ex, units: list[Unit], settings: CompileSettings) -> list[Unit]:
    """``units`` with each run of compilable local units (see the module docstring) as one segment.

    A run also ends before a step that first reads a collective's result, so the wait stays
    where the issue order put it, after the compute that does not need it.  A local step that
    reads nothing (a constant, positions) runs eagerly before the run it stands in: it allocates
    on the run's device, which dynamo cannot read.
    """
    steps = ex.plan.steps
    out, run = [], []
    from_rule, read = set(), set()

    def close():
        kernels = [i for i in run if steps[i].op not in ALIASES]
        if len(kernels) >= MIN_KERNELS:
            out.append(Unit("segment", list(run), Segment(ex, list(run), settings)))
        else:
            out.extend(Unit("local", [i]) for i in run)
        run.clear()

    for u in units:
        if u.kind == "local" and not steps[u.steps[0]].ins:
            out.append(u)   # a constant (made where the run is: a context dynamo cannot read) goes first
            continue
        if u.kind == "local" and not reads_salt(steps[u.steps[0]].op) and steps[u.steps[0]].op not in EAGER_OPS:
            ins = steps[u.steps[0]].ins
            if run and any(v in from_rule and v not in read for v in ins):
                close()
            read.update(ins)
            run.append(u.steps[0])
            continue
        close()
        out.append(u)
        if u.kind == "call":
            from_rule.update(o for i in u.steps for o in steps[i].outs)
    close()
    return out


#: (segment source, backend, input shapes) -> its compiled function, shared by every executor
_COMPILED: dict[tuple, Callable] = {}


def segment_source(ex, steps: list[int], ins: list[int], outs: list[int]) -> tuple[str, tuple, tuple, tuple]:
    """The source of ``segment(K, A, C, *inputs) -> outputs``: local ``steps`` of ``ex`` on one
    held rank, and the kernels, attrs and per-rank contexts its lines name (``K[k]``, ``A[k]``, and
    ``C[k]`` from ``contexts[rank position][k]``).  Every held rank runs the same function; a step
    that the others would read from a representative (:func:`.steps.representatives`) runs on each,
    with the representative's context: the same numbers."""
    lines, kernels, attrs, ctxs = [], [], [], []
    for i in steps:
        s = ex.plan.steps[i]
        if s.op in ALIASES:
            lines.append(f"v{s.outs[0]} = v{s.ins[0]}")
            continue
        k = len(kernels)
        kern = local_kernel(ex.ctx, i, s, plain=True)
        kernels.append(kern.fn)
        attrs.append(kern.attrs)
        ctxs.append(kern.ctxs if kern.of is None else tuple(kern.ctxs[r] for r in kern.of))
        call = f"K[{k}](C[{k}], A[{k}], {', '.join(f'v{v}' for v in s.ins)})"
        if len(s.outs) == 1:
            lines.append(f"v{s.outs[0]} = {call}")
        else:
            lines.append(f"r_ = {call}")
            lines += [f"v{o} = r_[{p}]" for p, o in enumerate(s.outs)]
    params = "".join(f", v{v}" for v in ins)
    results = "".join(f"v{o}, " for o in outs)
    source = f"def segment(K, A, C{params}):\n" + "".join(f"    {x}\n" for x in lines) + f"    return ({results})\n"
    contexts = tuple(tuple(c[j] for c in ctxs) for j in range(len(ex.comm.ranks)))
    return source, tuple(kernels), tuple(attrs), contexts


class Segment:
    """One compiled segment, called by the program once per held rank: ``segment(j, *inputs)``
    with rank position ``j``'s inputs, returning its outputs.  Its source is written with the
    program (:meth:`bind`); the first call finds or makes its compiled function, and each rank's
    first call compiles it (dynamo recompiles only where a kernel reads a context that differs
    between ranks), or it stays eager with a notice."""

    def __init__(self, ex, steps: list[int], settings: CompileSettings):
        # (weak: the executor's program holds this segment's run, so a strong one would make a cycle)
        self._ex, self.steps, self.settings = weakref.ref(ex), steps, settings
        self.source = None
        self.fn = self.eager = None
        self.kernels = self.attrs = self.contexts = ()
        self.first = set(range(len(ex.comm.ranks)))   # rank positions not yet called
        self.fresh = False   # whether this segment made its compiled function (else another segment of this run did)

    def bind(self, ins: list[int], outs: list[int]) -> None:
        self.source, self.kernels, self.attrs, self.contexts = segment_source(self._ex(), self.steps, ins, outs)
        self.eager = self._function()

    def _function(self):
        namespace: dict = {}
        exec(compile(self.source, f"<meshdsl segment of {len(self.steps)} steps>", "exec"), namespace)
        return namespace["segment"]

    def _compiled(self, xs):
        """The compiled function for this source and these inputs' shapes: one per (source,
        shapes), so that dynamo's recompile limit per function is never what decides."""
        key = (self.source, repr(self.settings.backend),
               tuple((tuple(x.shape), x.dtype, x.device) if hasattr(x, "shape") else type(x) for x in xs))
        compiled = _COMPILED.get(key)
        if compiled is None:   # the process's first: compiled here (an earlier run's is reused)
            import torch
            compiled = _COMPILED[key] = torch.compile(self._function(), backend=self.settings.backend,
                                                      dynamic=False)
        # Counted as this run's own the first time this run meets it, whatever ran before in the
        # process, so the summary reads the same in a fresh process and in a test session.
        self.fresh = key not in self.settings.stats.keys
        self.settings.stats.keys.add(key)
        return compiled

    def label(self) -> str:
        ops = sorted({self._ex().plan.steps[i].op for i in self.steps})
        return f"segment of {len(self.steps)} local steps ({', '.join(ops[:6])}{', ...' if len(ops) > 6 else ''})"

    def __call__(self, j: int, *xs):
        if self.first:
            return self._first_call(j, xs)
        try:
            return self.fn(self.kernels, self.attrs, self.contexts[j], *xs)
        except Exception as e:  # noqa: BLE001  (a recompile the backend rejects: go on eagerly)
            if self.fn is self.eager:
                raise
            return self._fall_back(e, j, xs)

    def _first_call(self, j: int, xs):
        if j not in self.first or self.fn is self.eager:
            return self.fn(self.kernels, self.attrs, self.contexts[j], *xs)
        first_of_all = len(self.first) == len(self.contexts)
        self.first.discard(j)
        stats, t0 = self.settings.stats, time.perf_counter()
        try:
            if self.fn is None:
                self.fn = self._compiled(xs)
            out = self.fn(self.kernels, self.attrs, self.contexts[j], *xs)
        except Exception as e:  # noqa: BLE001  (whatever the backend raises, the run goes on eagerly)
            return self._fall_back(e, j, xs)
        if first_of_all and self.fresh:
            stats.segments += 1
            stats.steps += len(self.kernels)
        elif first_of_all:
            stats.shared += 1
        stats.seconds += time.perf_counter() - t0
        return out

    def _fall_back(self, e: Exception, j: int, xs):
        e = getattr(e, "inner_exception", None) or e   # dynamo wraps what the backend raised
        first = (str(e).strip().splitlines() or [""])[0][:160]
        line = f"--compile: {self.label()} runs eagerly: {type(e).__name__}: {first}"
        self.settings.stats.fallbacks.append(line)
        self.settings.notice(line)
        self.fn = self.eager
        return self.eager(self.kernels, self.attrs, self.contexts[j], *xs)


def plan_summary(ex) -> dict:
    """What compiling makes of executor ``ex``'s plan, without compiling: over the plan and every
    loop body in it (a pipeline's own steps stay eager; its loops' bodies compile), the segments,
    the local steps (not counting aliases) they hold of all, and the ops of those left eager."""
    out = {"segments": 0, "compiled_steps": 0, "local_steps": 0, "eager_ops": set()}

    def kernels(p, steps):
        return sum(p.steps[i].op not in ALIASES for i in steps)

    def walk(p, runs: bool):
        if runs:   # the plan itself, or a loop's body: an executor of its own runs it
            sub = ex if p is ex.plan else type(ex)(p, ex.comm, compile=ex.compiling)
            for u in segments_of(sub, units_of(sub), sub.compiling):
                if u.kind == "segment":
                    out["segments"] += 1
                    out["compiled_steps"] += kernels(p, u.steps)
                elif u.kind == "local" and p.steps[u.steps[0]].op not in ALIASES and p.steps[u.steps[0]].ins:
                    out["eager_ops"].add(p.steps[u.steps[0]].op)   # (a constant is made, not computed)
            out["local_steps"] += kernels(p, [i for i, s in enumerate(p.steps) if s.kind == "local" and s.ins])
        for s in p.steps:
            for body in s.subplans:
                walk(body, s.kind == "repeat")   # a pipeline's segments: only their loops compile

    walk(ex.plan, True)
    out["eager_ops"] = sorted(out["eager_ops"])
    why = why_not(ex)   # on the simulated mesh, the whole step as one graph instead (.whole)
    out["whole_step"] = {"simulated": why is None, "why_not": why}
    return out
