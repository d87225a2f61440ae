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
* Before the backend, the graph is rewritten where inductor would move more memory than
  ``torch.compile`` of a module does: a loop's stacked gradients as one ``cat`` its matmuls
  write into (:func:`_stack_layer_writes`); for inductor, matrix-vector products as fused
  sums, activations recomputed per reader, sums with many readers written out once.
* A trace or compile the backend rejects turns the whole step off for this executor, with
  a one-line notice: the segments run instead.  A compiled call that raises (an index
  out of range, which the eager ``gather`` reports as the user's error) runs the step
  again eagerly, which raises the user's error or, if it succeeds, leaves the whole step
  off with a notice.
"""
from __future__ import annotations

import contextlib
import time

import torch

from ..comm.simulated import SimulatedComm
from ..errors import MeshDSLError
from ..ops.layernorm import opaque_backward
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


_aten = torch.ops.aten
#: ops that make a tensor whose contents are never read before being written (a loop's stacked buffer)
_EMPTY = frozenset({_aten.new_empty.default, _aten.empty.memory_format, _aten.empty_strided.default,
                    _aten.new_empty_strided.default})
#: ops that give a contiguous tensor's elements another shape, in the same order
_VIEWS = frozenset({_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default})


def _layer_writes(base) -> tuple[list, list] | None:
    """(the ``select_scatter`` nodes that write every layer slice of the empty buffer ``base``
    one after another along dim 0, each one's source in layer order), or None where the buffer
    is not written that way (another dim, a slice written twice or not at all, a reader between
    the writes)."""
    chain, cur = [], base
    while len(cur.users) == 1:
        (nxt,) = cur.users
        if nxt.target is not _aten.select_scatter.default or nxt.args[0] is not cur or nxt.args[2] != 0:
            break
        chain.append(nxt)
        cur = nxt
    whole = base.meta.get("val")
    layers = whole.shape[0] if isinstance(whole, torch.Tensor) and whole.dim() else 0
    src = {ss.args[3] % layers: ss.args[1] for ss in chain} if layers else {}
    if not chain or len(chain) != layers or sorted(src) != list(range(layers)):
        return None
    return chain, [src[l] for l in range(layers)]


def _contiguous_source(node):
    """``node`` seen through views of contiguous tensors (their elements in the same order)."""
    while (node.target in _VIEWS and isinstance(node.args[0], torch.fx.Node)
           and isinstance(node.args[0].meta.get("val"), torch.Tensor) and node.args[0].meta["val"].is_contiguous()):
        node = node.args[0]
    return node


def _like(t: torch.Tensor, shape) -> torch.Tensor:
    """A new node's example value: ``t``'s dtype and ``shape`` on the meta device (no data: the
    passes below read only shapes and dtypes, and inductor traces the graph again)."""
    return torch.empty(shape, dtype=t.dtype, device="meta")


def _stack_layer_writes(gm) -> int:
    """Rewrite each loop-stacked buffer of ``gm`` whose layer slices are written one by one
    (``select_scatter`` on an empty buffer: what functionalization makes of the eager loop's
    ``mm(out=layer slice)``) as one ``cat`` of the layers' results.  Inductor lowers each
    ``select_scatter`` as a pass over the whole buffer (the layers' products copied in once
    more); a ``cat`` of the products themselves is a buffer their matmuls write into directly,
    so the weight gradients cost no copy.  Returns the number of buffers rewritten."""
    graph, done = gm.graph, 0
    graph.eliminate_dead_code()   # (the loop's unbinds of each buffer, read by nobody)
    for base in [n for n in graph.nodes if n.op == "call_function" and n.target in _EMPTY]:
        found = _layer_writes(base)
        if found is None:
            continue
        chain, sources = found
        whole = base.meta["val"]
        mats = [_contiguous_source(s) for s in sources]
        vals = [m.meta.get("val") for m in mats]
        same = all(isinstance(v, torch.Tensor) and v.is_contiguous() and v.dim() >= 1
                   and v.shape == vals[0].shape and v.dtype == whole.dtype for v in vals)
        with graph.inserting_before(chain[-1]):   # (after every source: the last write reads the last one)
            if same:   # rows of the products one after another: the stacked buffer's element order
                cat = graph.call_function(_aten.cat.default, (mats, 0))
                cat.meta["val"] = _like(whole, (len(vals) * vals[0].shape[0], *vals[0].shape[1:]))
                new = graph.call_function(_aten.view.default, (cat, list(whole.shape)))
            else:
                new = graph.call_function(_aten.stack.default, (sources, 0))
            new.meta["val"] = _like(whole, whole.shape)
        chain[-1].replace_all_uses_with(new)
        for ss in reversed(chain):
            graph.erase_node(ss)
        done += 1
    graph.eliminate_dead_code()
    gm.recompile()
    return done


def _vector_products_as_sums(gm) -> int:
    """Rewrite each ``mm`` of ``gm`` whose product is one row or one column (an RMS norm's
    backward sums its rows that way: BLAS is the fastest sum in eager torch) as a product and a
    sum, which inductor fuses into the kernel that makes the matrix operand, where a BLAS call
    needs that operand written out first.  Returns the number rewritten."""
    graph, done = gm.graph, 0
    for mm in [n for n in graph.nodes if n.op == "call_function" and n.target is _aten.mm.default]:
        a, b = mm.args
        va, vb = a.meta.get("val"), b.meta.get("val")
        if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)) or va.dtype != vb.dtype:
            continue
        m, n = va.shape[0], vb.shape[1]
        if n == 1:      # [M, K] @ [K, 1]: each row of A times B's column, summed over K
            row, mat, dim = b, a, 1
        elif m == 1:    # [1, K] @ [K, N]: each column of B times A's row, summed over K
            row, mat, dim = a, b, 0
        else:
            continue
        with graph.inserting_before(mm):
            t = graph.call_function(_aten.t.default, (row,))
            t.meta["val"] = _like(va, tuple(reversed(row.meta["val"].shape)))
            prod = graph.call_function(_aten.mul.Tensor, (mat, t))
            prod.meta["val"] = _like(va, mat.meta["val"].shape)
            total = graph.call_function(_aten.sum.dim_IntList, (prod, [dim], True))
            total.meta["val"] = _like(va, (m, n))
        mm.replace_all_uses_with(total)
        graph.erase_node(mm)
        done += 1
    gm.recompile()
    return done


#: activations whose every reader computes them again from their input, rather than one buffer
#: written for all (see :func:`_recompute_activations`)
_RECOMPUTED = frozenset({_aten.silu.default, _aten.sigmoid.default})


def _recompute_activations(gm) -> int:
    """Give each reader of a SiLU or sigmoid of ``gm`` past the first its own copy of the op.
    Inductor writes out a pointwise result with an ``exp`` in it that has two readers (the
    forward's product and the backward's, a whole step apart), a pass over memory each way;
    with one reader each, both compute it from its input, which the backward reads anyway
    (``silu_backward``), as torch.compile's partitioner chooses for a module's backward.
    Returns the number of copies made."""
    graph, done = gm.graph, 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in _RECOMPUTED]:
        for user in list(node.users)[1:]:
            with graph.inserting_before(user):
                again = graph.call_function(node.target, node.args, node.kwargs)
            again.meta.update(node.meta)
            user.replace_input_with(node, again)
            done += 1
    gm.recompile()
    return done


#: a sum with at least this many readers is written out once (see :func:`_write_out_sums`)
SUM_READERS = 3


def _write_out_sums(gm) -> int:
    """Have inductor write out each ``add`` of ``gm`` with :data:`SUM_READERS` or more readers
    (a residual stream's value: the next layer's sum, its norm, the backward's norm) as one
    buffer its readers load.  Inductor otherwise inlines a sum into each reader until a chain
    has read more than ``realize_reads_threshold`` buffers: every norm of the residual stream,
    forward and backward, then adds up to that many addends again, where the twin's compiled
    backward reads the one tensor its forward saved.  Returns the number of sums written out."""
    from torch._inductor import inductor_prims
    keep = getattr(inductor_prims, "force_stride_order", None)   # internal to torch: may go in a release
    if keep is None:
        return 0
    graph, done = gm.graph, 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is _aten.add.Tensor]:
        val = node.meta.get("val")
        if len(node.users) < SUM_READERS or not isinstance(val, torch.Tensor) or not val.is_contiguous():
            continue
        with graph.inserting_after(node):
            kept = graph.call_function(keep, (node, list(val.stride())))
        kept.meta.update(node.meta)
        node.replace_all_uses_with(kept, delete_user_cb=lambda user: user is not kept)
        done += 1
    gm.recompile()
    return done


#: the rewrites of a traced step before inductor, in order (see the module docstring)
INDUCTOR_REWRITES = (_fold_constants, _vector_products_as_sums, _recompute_activations, _write_out_sums)


def _inductor(gm, example_inputs, rewrites: bool = True):
    """``compile_fx`` on fake example inputs with a shape env, as dynamo hands them: without one,
    inductor's FX graph cache passes the graph by, and every process would compile it again.
    ``rewrites``: :data:`INDUCTOR_REWRITES` first."""
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    for rewrite in INDUCTOR_REWRITES if rewrites else ():
        rewrite(gm)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [mode.from_tensor(x, static_shapes=True) for x in example_inputs]
    return compile_fx(gm, fakes)


def _bare_inductor(gm, example_inputs):
    return _inductor(gm, example_inputs, rewrites=False)


def _backend(backend, rewrites: bool = True):
    """The ``(graph, example inputs) -> callable`` a backend name (or a callable backend) stands for.
    ``aot_eager`` and ``eager`` run the traced graph as it is: it is already the functionalized
    ATen graph AOT would hand its compiler, so tracing it again would change nothing.
    ``rewrites``: inductor with its rewrites (:func:`_inductor`); other backends are as they are."""
    if callable(backend):
        return backend
    if backend in ("aot_eager", "eager"):
        return _run_as_traced
    if backend == "inductor":
        return _inductor if rewrites else _bare_inductor
    from torch._dynamo.backends.registry import lookup_backend
    return lookup_backend(backend)


#: The forms a whole step is compiled in, tried in order until one agrees with the eager executor
#: (``WholeStep._first_agreeing``): (the layer norms' backward as one opaque op, the graph
#: rewrites), each with what the notice says of it.  The opaque op is torch's own kernel
#: (:func:`~..ops.layernorm.opaque_backward`), where inductor's code for the decomposed backward
#: was seen wrong on a GPU (docs/design/compile.md); the rewrites were not at fault there.
FORMS = ((False, True, ""), (True, True, "with torch's layer-norm backward kernel"),
         (True, False, "with torch's layer-norm backward kernel and without the graph rewrites"))


def _strided_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` with its strides: ``clone()`` makes a tensor with gaps (a feed sliced as
    ``t[:, :-1]``) contiguous, and a graph traced on that copy views it as contiguous, which the
    caller's tensor, keyed by its strides, is not."""
    return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device).copy_(x)


def trace_step(eager, tensors: list, feeds: dict, params: dict, opaque_norms: bool = False):
    """(the eager executor's run as one functionalized graph, traced on copies of ``tensors`` (the
    flat ``feeds`` and ``params``, :func:`_flat`), those copies, the output names, each one's tensor
    count (None: the output is None)).  ``opaque_norms``: layer norms' backward as one opaque op."""
    from torch.fx.experimental.proxy_tensor import make_fx
    names, counts = list(eager.plan.outputs), []

    def step(*xs):
        out = eager.run(*_unflat(list(xs), feeds, params))
        counts[:] = [None if out[name] is None else len(out[name]) for name in names]
        return [x for name in names for x in (out[name] or ())]

    copies = [_strided_copy(x) for x in tensors]   # the trace runs the step: it may not touch the caller's
    with opaque_backward() if opaque_norms else contextlib.nullcontext():
        gm = make_fx(torch.func.functionalize(step, remove="mutations"))(*copies)
    if _mutates_inputs(gm):
        raise RuntimeError("the traced step writes into its inputs")
    return gm, copies, names, list(counts)


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
        t0, stats = time.perf_counter(), self.settings.stats
        traced = self._first_agreeing(tensors, feeds, params)
        if traced is None:
            return None
        self.compiled[key] = traced
        stats.whole += 1
        stats.steps += num_kernels(self.ex.plan)
        stats.seconds += time.perf_counter() - t0
        return traced

    def _first_agreeing(self, tensors, feeds, params) -> _Traced | None:
        """The step compiled in the first of :data:`FORMS` whose outputs agree with the eager
        executor's, with one notice where that is not the first form; the eager run where none
        does (one notice); None where tracing, compiling or a call failed (whole step off)."""
        offs = []
        for opaque, rewrites, how in FORMS:
            traced, off = self._attempt(tensors, feeds, params, opaque, rewrites)
            if traced is None or off is None:
                if traced is not None and offs:
                    self._notice(f"differs from the eager executor's ({offs[0]}); compiled again {how}, "
                                 "it agrees", None)
                return traced
            offs.append(off)
        again = "; ".join(f"compiled again {how}: {off}" for (_, _, how), off in zip(FORMS[1:], offs[1:]))
        self._notice(f"differs from the eager executor's ({offs[0]}; {again}), so the step runs eagerly", None)
        return _Traced(_EagerStep(self.twin, feeds, params, traced.names), traced.names, traced.counts)

    def _attempt(self, tensors, feeds, params, opaque: bool = False,
                 rewrites: bool = True) -> tuple[_Traced | None, str | None]:
        """(the step traced and compiled, how its first outputs differ from the eager twin's or
        None where they agree); (None, None) where tracing, compiling or the call failed, which
        turns the whole step off.  ``opaque``: the layer norms' backward as one opaque op (torch's
        kernel, not the compiler's code: :func:`opaque_backward`); ``rewrites``: the graph rewrites
        (the stacked gradients' and :data:`INDUCTOR_REWRITES`)."""
        try:
            gm, copies, names, counts = trace_step(self._eager_twin(), tensors, feeds, params, opaque)
            if rewrites:
                _stack_layer_writes(gm)
            fn = self._captured(_backend(self.settings.backend, rewrites)(gm, copies), copies)
        except MeshDSLError:
            raise   # the user's own error (a bad feed), as the eager run raises it
        except Exception as e:  # noqa: BLE001  (whatever tracing or the backend raises: segments instead)
            self._turn_off("could not be compiled", e)
            return None, None
        traced = _Traced(fn, names, counts)
        try:
            return traced, self._disagreement(traced, tensors, feeds, params)
        except MeshDSLError:
            raise   # the user's own error (an id out of range), as the eager run raises it
        except Exception as e:  # noqa: BLE001  (the compiled call raised: segments instead)
            self._turn_off("its compiled call raised", e)
            return None, None

    def _disagreement(self, traced: _Traced, tensors: list, feeds: dict, params: dict) -> str | None:
        """How the compiled step's first outputs differ from the eager twin's beyond what
        ``check`` allows (:mod:`.agreement`); None where they agree.  Each side runs on copies."""
        got = traced.outputs(traced.fn(*[_strided_copy(x) for x in tensors]))
        want = self.twin.run(*_unflat([_strided_copy(x) for x in tensors], feeds, params))
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
