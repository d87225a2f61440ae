"""``--compile``'s whole step: a plan whose every step runs in this process, as one graph.

Where every rank the executor holds is in this process (the simulated mesh) and no step
needs the host between kernels, the eager executor's whole run (its program, loops,
collectives of the simulated mesh) is traced once by ``make_fx`` on the run's own inputs,
functionalized, and handed to the backend as one graph: a plan's shapes never change, so
the result is a plain callable with no guards, called once per step.  A loop's layers are
unrolled into the graph (up to :data:`MAX_LAYERS` in all), so the compiler fuses across
layers and between forward and backward, and the per-layer Python of the eager loop is
gone.  The segments of :mod:`.compiled` stay for what a whole step cannot hold:
collectives between processes, pipelines, kernels that read the run's salt (dropout).

* The compiled callable is keyed on its inputs' metadata (names, shapes, strides, dtypes,
  devices, the containers they came in, any non-tensor feed's value): a new key traces
  and compiles again; the key is all a call checks.
* Before its first use a compiled step's outputs are compared with the eager executor's at
  ``check``'s tolerance (:mod:`.agreement`): one that differs is replaced by the eager run,
  with a one-line notice.  On a CUDA device the step is captured as a CUDA graph
  (:mod:`.cuda_graph`).
* The trace runs on copies of the inputs, and a graph that writes into its inputs (an
  eager run that donates its params) is refused: the compiled step makes new tensors.
* A trace or compile the backend rejects turns the whole step off for this executor, with
  a one-line notice: the segments run instead.  A compiled call that raises (an index
  out of range, which the eager ``gather`` reports as the user's error) runs the step
  again eagerly, which raises the user's error or, if it succeeds, leaves the whole step
  off with a notice.
"""
from __future__ import annotations

import time

import torch

from ..comm.simulated import SimulatedComm
from ..errors import MeshDSLError
from .agreement import disagreement
from .context import PerRank
from .cuda_graph import Graphed, capturable
from .steps import reads_salt

#: the most layers (summed over a plan's loops) a whole step unrolls; above, segments
MAX_LAYERS = 16
#: step kinds a whole step cannot trace (a pipeline's schedule runs its own actions)
_REFUSED = frozenset({"pipeline", "accumulate"})


def why_not(ex) -> str | None:
    """Why executor ``ex``'s run cannot be one graph (None: it can)."""
    if not isinstance(ex.comm, SimulatedComm):
        return "its collectives go between processes"
    layers = 0

    def walk(plan, runs: int) -> str | None:   # runs: how often the plan runs per step
        nonlocal layers
        for s in plan.steps:
            if s.kind in _REFUSED:
                return f"it runs a {s.kind}"
            if s.kind == "local" and reads_salt(s.op):
                return f"'{s.op}' reads the run's salt"
            if s.kind == "repeat":
                layers += runs * s.times
                if s.args.get("streamed"):   # their reductions land in place, told apart by data_ptr
                    return "its loop reduces gradients layer by layer"
            for body in s.subplans:
                why = walk(body, runs * (s.times if s.kind == "repeat" else 1))
                if why:
                    return why
        return None

    why = walk(ex.plan, 1)
    if why is None and layers > MAX_LAYERS:
        why = f"its loops run {layers} layers (a whole step unrolls at most {MAX_LAYERS})"
    return why


def num_kernels(plan) -> int:
    """The local kernels a whole step of ``plan`` runs, a loop's body counted once per layer."""
    n = sum(s.kind == "local" and s.op not in ("stop_gradient", "rename") for s in plan.steps)
    return n + sum(s.times * num_kernels(body) for s in plan.steps if s.kind == "repeat" for body in s.subplans)


def _flat(feeds: dict, params: dict):
    """(the tensors of ``feeds`` and ``params`` in order, a hashable key of their structure and
    metadata).  A feed is a tensor, a list of them (per held rank) or a Python value (in the key)."""
    tensors, key = [], []
    for group in (feeds, params):
        for name, x in group.items():
            if isinstance(x, torch.Tensor):
                tensors.append(x)
                key.append((name, x.shape, x.stride(), x.dtype, x.device))
            elif isinstance(x, list):
                tensors.extend(x)
                key.append((name, type(x), tuple((t.shape, t.stride(), t.dtype, t.device) for t in x)))
            else:
                key.append((name, "value", x))
        key.append("|")
    return tensors, tuple(key)


def _unflat(tensors: list, feeds: dict, params: dict) -> tuple[dict, dict]:
    """``feeds`` and ``params`` with their tensors replaced by ``tensors`` (as :func:`_flat` listed them)."""
    it = iter(tensors)
    out = []
    for group in (feeds, params):
        new = {}
        for name, x in group.items():
            if isinstance(x, torch.Tensor):
                new[name] = next(it)
            elif isinstance(x, list):
                new[name] = type(x)(next(it) for _ in x) if isinstance(x, PerRank) else [next(it) for _ in x]
            else:
                new[name] = x
        out.append(new)
    return out[0], out[1]


class _Traced:
    """One compiled whole step: ``fn(*tensors) -> flat outputs``, and how to rebuild the outputs."""

    def __init__(self, fn, names: list[str], counts: list):
        self.fn, self.names, self.counts = fn, names, counts   # counts: per output, its tensor count (None: None)

    def outputs(self, flat) -> dict:
        out, k = {}, 0
        for name, n in zip(self.names, self.counts):
            if n is None:
                out[name] = None
            else:
                out[name] = list(flat[k:k + n])
                k += n
        return out


def _mutates_inputs(gm) -> bool:
    """Whether the functionalized graph ``gm`` writes into one of its placeholders."""
    placeholders = {n for n in gm.graph.nodes if n.op == "placeholder"}
    return any(n.op == "call_function" and getattr(n.target, "_schema", None) is not None
               and n.target._schema.is_mutable and n.args and n.args[0] in placeholders
               for n in gm.graph.nodes)


def _run_as_traced(gm, example_inputs):
    return gm


#: the most elements a tensor computed from no input (a rope table, a mask) may have to be kept as a constant
MAX_FOLDED = 1 << 16


def _fold_constants(gm) -> None:
    """Replace what ``gm`` computes from none of its inputs (rope tables, causal masks: made
    afresh each step by the eager kernels) by the computed tensors, where small
    (:data:`MAX_FOLDED`): the compiled step reads them instead of making them."""
    from torch._inductor.constant_folding import ConstantFolder, replace_node_with_constant
    with torch.utils._python_dispatch._disable_current_modes():
        folder = ConstantFolder(gm, skip_constructors=False)
        folder.run()
        for node, value in folder.node_replacements.items():
            if isinstance(value, torch.Tensor) and value.numel() <= MAX_FOLDED:
                replace_node_with_constant(gm, node, value)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def _inductor(gm, example_inputs):
    """``compile_fx`` on fake example inputs with a shape env, as dynamo hands them: without one,
    inductor's FX graph cache passes the graph by, and every process would compile it again."""
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    _fold_constants(gm)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    return compile_fx(gm, [mode.from_tensor(x, static_shapes=True) for x in example_inputs])


def _backend(backend):
    """The ``(graph, example inputs) -> callable`` a backend name (or a callable backend) stands for.
    ``aot_eager`` and ``eager`` run the traced graph as it is: it is already the functionalized
    ATen graph AOT would hand its compiler, so tracing it again would change nothing."""
    if callable(backend):
        return backend
    if backend in ("aot_eager", "eager"):
        return _run_as_traced
    if backend == "inductor":
        return _inductor
    from torch._dynamo.backends.registry import lookup_backend
    return lookup_backend(backend)


class _EagerStep:
    """A whole step's stand-in where its compiled form disagreed with the eager executor: the
    eager ``twin`` run on the call's tensors, flattened as a compiled step returns them."""

    def __init__(self, twin, feeds: dict, params: dict, names: list[str]):
        self.twin, self.feeds, self.params, self.names = twin, feeds, params, names

    def __call__(self, *tensors):
        out = self.twin.run(*_unflat(list(tensors), self.feeds, self.params))
        return [x for name in self.names for x in (out[name] or ())]


class WholeStep:
    """Executor ``ex``'s runs as compiled whole steps (see the module docstring).  ``settings``:
    its :class:`~.compiled.CompileSettings` (backend, stats, notice)."""

    def __init__(self, ex, settings):
        self.ex, self.settings = ex, settings
        self.twin = None          # the eager executor traced (and run again where a call raises)
        self.compiled: dict[tuple, _Traced] = {}
        self.off = False          # a trace or compile failed: segments from now on

    def __call__(self, feeds: dict, params: dict) -> dict | None:
        """The run's outputs, or None where the whole step is off (the caller runs the segments)."""
        tensors, key = _flat(feeds, params)
        traced = self.compiled.get(key)
        if traced is None:
            traced = self._compile(key, tensors, feeds, params)
            if traced is None:
                return None
        try:
            return traced.outputs(traced.fn(*tensors))
        except Exception as e:  # noqa: BLE001  (rerun eagerly: the user's error, or the numbers)
            out = self.twin.run(feeds, params)
            self._turn_off("its compiled call raised", e)
            return out

    def _eager_twin(self):
        if self.twin is None:
            ex = self.ex
            self.twin = type(ex)(ex.plan, ex.comm)   # no donation: a compiled step makes new tensors
        return self.twin

    def _compile(self, key, tensors, feeds, params) -> _Traced | None:
        from torch.fx.experimental.proxy_tensor import make_fx
        twin, stats = self._eager_twin(), self.settings.stats
        names, counts = list(twin.plan.outputs), []

        def step(*xs):
            out = twin.run(*_unflat(list(xs), feeds, params))
            flat = []
            counts.clear()
            for name in names:
                got = out[name]
                counts.append(None if got is None else len(got))
                flat.extend(got or ())
            return flat

        t0 = time.perf_counter()
        copies = [x.clone() for x in tensors]   # the trace runs the step: it may not touch the caller's
        try:
            gm = make_fx(torch.func.functionalize(step, remove="mutations"))(*copies)
            if _mutates_inputs(gm):
                raise RuntimeError("the traced step writes into its inputs")
            fn = _backend(self.settings.backend)(gm, copies)
            fn = self._captured(fn, copies)
        except MeshDSLError:
            raise   # the user's own error (a bad feed), as the eager run raises it
        except Exception as e:  # noqa: BLE001  (whatever tracing or the backend raises: segments instead)
            self._turn_off("could not be compiled", e)
            return None
        traced = _Traced(fn, names, list(counts))
        try:
            off = self._disagreement(traced, tensors, feeds, params)
        except MeshDSLError:
            raise   # the user's own error (an id out of range), as the eager run raises it
        except Exception as e:  # noqa: BLE001  (the compiled call raised: segments instead)
            self._turn_off("its compiled call raised", e)
            return None
        if off is not None:
            self._notice(f"differs from the eager executor's ({off}), so the step runs eagerly", None)
            traced = _Traced(_EagerStep(twin, feeds, params, names), names, list(counts))
        self.compiled[key] = traced
        stats.whole += 1
        stats.steps += num_kernels(self.ex.plan)
        stats.seconds += time.perf_counter() - t0
        return traced

    def _disagreement(self, traced: _Traced, tensors: list, feeds: dict, params: dict) -> str | None:
        """How the compiled step's first outputs differ from the eager twin's beyond what
        ``check`` allows (:mod:`.agreement`); None where they agree.  Each side runs on copies."""
        got = traced.outputs(traced.fn(*[x.clone() for x in tensors]))
        want = self.twin.run(*_unflat([x.clone() for x in tensors], feeds, params))
        return disagreement(got, {k: want[k] for k in traced.names})

    def _captured(self, fn, example: list):
        """``fn`` captured as a CUDA graph where the settings ask for it and the inputs allow it
        (:mod:`.cuda_graph`); ``fn`` as it is otherwise, or where the capture fails (a notice)."""
        if not self.settings.cuda_graphs or capturable(example) is not None:
            return fn
        try:
            graphed = Graphed(fn, example)
        except Exception as e:  # noqa: BLE001  (a kernel CUDA cannot capture: the compiled step, uncaptured)
            self._notice("could not be captured as a CUDA graph, it runs compiled without one", e)
            return fn
        self.settings.stats.cuda_graphs += 1
        return graphed

    def _turn_off(self, what: str, e: Exception) -> None:
        self._notice(f"{what}, segments run instead", e)
        self.off = True

    def _notice(self, what: str, e: Exception | None) -> None:
        line = f"--compile: the whole step {what}"
        if e is not None:
            e = getattr(e, "inner_exception", None) or e
            line += f": {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
        self.settings.stats.fallbacks.append(line)
        self.settings.notice(line)
