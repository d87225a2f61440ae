"""The graph IR: symbolic tensors produced by op nodes.

User code builds a :class:`Graph` by calling ops on :class:`Tensor` objects.
Nothing runs while building; executors and the compiler walk the nodes later.
A node remembers the phase it was built in (forward, backward, update) so plans
can report where communication happens.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import GraphError, ShapeError, clip, message
from .shape import Shape
from .torch_hints import TORCH_HINTS

PHASES = ("forward", "backward", "update")


class Tensor:
    """A symbolic tensor: one output of a graph node, with a named shape and a dtype."""

    __slots__ = ("node", "index", "shape", "dtype", "scopes", "__weakref__")

    def __init__(self, node: "Node", index: int, shape: Shape, dtype: torch.dtype):
        self.node = node
        self.index = index
        self.shape = shape
        self.dtype = dtype
        # Layout scopes, most specific first: a param's own name, then "params".
        self.scopes: tuple[str, ...] = ()

    @property
    def graph(self) -> "Graph":
        return self.node.graph

    @property
    def name(self) -> str:
        return self.node.name if len(self.node.outputs) == 1 else f"{self.node.name}:{self.index}"

    def __repr__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return f"Tensor({self.name}, {self.shape}, {dt})"

    # Operator sugar.  The functions live in meshdsl.ops, a room above this one,
    # which hands them over with set_operators() when it is imported.
    def _ops(self):
        return _OPERATORS

    def __add__(self, o): return self._ops().add(self, o)
    def __radd__(self, o): return self._ops().add(o, self)
    def __sub__(self, o): return self._ops().sub(self, o)
    def __rsub__(self, o): return self._ops().sub(o, self)
    def __mul__(self, o): return self._ops().mul(self, o)
    def __rmul__(self, o): return self._ops().mul(o, self)
    def __truediv__(self, o): return self._ops().div(self, o)
    def __rtruediv__(self, o): return self._ops().div(o, self)
    def __neg__(self): return self._ops().neg(self)
    def __pow__(self, o): return self._ops().pow(self, o)
    def __lt__(self, o): return self._ops().less(self, o)
    def __le__(self, o): return self._ops().less_equal(self, o)
    def __gt__(self, o): return self._ops().greater(self, o)
    def __ge__(self, o): return self._ops().greater_equal(self, o)
    def __abs__(self): return self._ops().abs(self)
    def __pos__(self): return self
    __hash__ = object.__hash__

    def __round__(self, ndigits=None):
        if ndigits is None:
            return self._ops().round(self)
        raise _misuse(self, f"has no round(x, {ndigits!r}): md.round rounds to whole numbers",
                      f"scale around it: md.round(x * 10 ** {ndigits!r}) / 10 ** {ndigits!r}")

    def __rpow__(self, o):
        if isinstance(o, (int, float)) and not isinstance(o, bool) and o > 0:
            return self._ops().exp(self * math.log(o))  # b ** x = exp(x log b), differentiable in x
        raise _misuse(self, f"is the exponent of {clip(repr(o), 40)} ({type(o).__name__}): '** x' takes a "
                            "positive Python number as its base", "write md.exp(x * math.log(b)) for a base b > 0")

    def __invert__(self): return self._logical("~", "logical_not", self)
    def __and__(self, o): return self._logical("&", "logical_and", self, o)
    def __rand__(self, o): return self._logical("&", "logical_and", o, self)
    def __or__(self, o): return self._logical("|", "logical_or", self, o)
    def __ror__(self, o): return self._logical("|", "logical_or", o, self)

    def _logical(self, sign: str, op: str, *args):
        """``~``, ``&``, ``|`` on boolean masks, as torch's; other dtypes have no bitwise ops here."""
        bad = [a for a in args if not (isinstance(a, Tensor) and a.dtype == torch.bool)]
        if bad:
            raise _misuse(self, f"has no '{sign}' with {clip(repr(bad[0]), 60)}: '{sign}' combines boolean "
                                "masks only (meshdsl has no bitwise integer ops)",
                          f"combine masks with md.{op}(...) (both boolean, e.g. x > 0); "
                          "make a mask of a number tensor first, e.g. md.not_equal(x, 0)")
        return getattr(self._ops(), op)(*args)

    def __floordiv__(self, o): return self._ops().floor_divide(self, o)
    def __rfloordiv__(self, o): return self._ops().floor_divide(o, self)
    def __mod__(self, o): return self._ops().remainder(self, o)
    def __rmod__(self, o): return self._ops().remainder(o, self)

    # Python and torch habits that have no meaning on a symbolic tensor: each names the
    # meshdsl way instead of failing deep inside torch or silently (``if x > 0:``).
    def __bool__(self):
        raise _misuse(self, "has no truth value: it holds no numbers while the graph is built",
                      "'if x > 0:' picks one branch for every element; choose per element with "
                      "md.where(x > 0, a, b)")

    def __matmul__(self, o):
        raise _misuse(self, "has no '@': dims are matched by name, not by position",
                      'contract named dims with md.einsum("batch d_model, d_model d_ff -> batch d_ff", x, w)')

    __rmatmul__ = __matmul__

    def __getitem__(self, key):
        raise _misuse(self, f"cannot be indexed ([{key!r}]): dims are named, not positional",
                      "take a range with md.slice_(x, 'dim', start, stop), rows with md.gather(table, ids, 'dim'), "
                      "or a dim with x.shape.get('dim')")

    def __setitem__(self, key, value):
        raise _misuse(self, f"cannot be assigned to ([{key!r}] = ...): a Tensor is a value, not a buffer",
                      "make a new tensor: md.where(mask, value, x) sets the elements where mask holds")

    def __iter__(self):
        raise _misuse(self, "cannot be iterated: it holds no numbers while the graph is built",
                      "split a dim with md.slice_ or md.rearrange; read values after running: md.run_dense(...)")

    def __len__(self):
        raise _misuse(self, "has no len(): its dims are named",
                      "read a dim with x.shape.get('dim') (its .size), or every dim with x.shape")

    def __float__(self):
        raise _misuse(self, "has no Python value while the graph is built",
                      "run the graph (md.run_dense, md.run_simulated, a TrainStep) and read the returned torch tensor")

    __int__ = __index__ = __float__

    def __getattr__(self, attr: str):
        # Only reached for a name the class lacks.  Names Python and libraries probe (dunders, private
        # names) keep the plain AttributeError, so hasattr() and copy/pickle protocols behave.
        if attr.startswith("_"):
            raise AttributeError(attr)
        hint = TORCH_HINTS.get(attr)
        raise _MisuseAttribute(message(
            f"meshdsl {self!r} has no attribute or method '{attr}'.",
            rule="a meshdsl Tensor is symbolic (name, shape, dtype); ops are functions of the meshdsl module, "
                 "not tensor methods",
            fix=hint or "call the op as md.<op>(x, ...) (the list: docs/guide/api.md)"))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        hint = TORCH_HINTS.get(name)
        raise GraphError(message(
            f"torch.{name} was called on a meshdsl Tensor.",
            rule="torch functions compute on torch tensors; a meshdsl Tensor is symbolic (named dims, no values) "
                 "and is computed with meshdsl ops, which the compiler can split over a mesh",
            fix=hint or f"use the meshdsl op of the same name, md.{name}(...), if there is one "
                        "(the list: docs/guide/api.md)"))




def not_a_tensor(what: str, arg: str, value) -> ShapeError:
    """The error for ``value`` passed as ``arg`` of ``what`` where a meshdsl Tensor belongs."""
    if isinstance(value, torch.Tensor):
        shown = f"a torch.Tensor of shape {tuple(value.shape)}"
        fix = ("declare it in the graph, md.input('x', [md.Dim(...), ...]), and feed the torch tensor when "
               "running; or, for a fixed value, md.constant(value, [dims])")
    elif isinstance(value, (bool, int, float)):
        shown = f"the Python {type(value).__name__} {value!r}"
        fix = ("make it a Tensor, md.constant(value) (a scalar) or md.constant(value, [dims]); "
               "a number does combine with a Tensor by operators: x * 2.0")
        if isinstance(value, bool):  # x == 0 is Python's identity test, a bool, not a mask
            fix = "compare elementwise with md.equal(x, y) or md.not_equal(x, y) ('==' on a Tensor is Python's " \
                  "identity test); " + fix
    else:
        shown = f"{clip(repr(value), 60)} ({type(value).__name__})"
        fix = "pass a Tensor made by md.input, md.param or an op"
    return ShapeError(message(f"{what}: {arg} is {shown}, not a meshdsl Tensor.",
                              rule="ops take meshdsl Tensors: symbolic values with named dims and a dtype",
                              fix=fix))


class _MisuseAttribute(GraphError, AttributeError):
    """A missing Tensor attribute: a GraphError with the house message that still is an
    AttributeError, so ``hasattr``/``getattr(x, name, default)`` keep working."""


def _misuse(t: Tensor, what: str, fix: str) -> GraphError:
    return GraphError(message(f"meshdsl {t!r} {what}.",
                              rule="a meshdsl Tensor is symbolic: named dims and a dtype, no values until the "
                                   "graph runs",
                              fix=fix))


#: The namespace the operator sugar calls into (``meshdsl.ops``); see :func:`set_operators`.
_OPERATORS: Any = None


def set_operators(namespace) -> None:
    """Give :class:`Tensor`'s operators (``+``, ``*``, ``<``, ...) the functions of ``namespace``.

    ``meshdsl.ops`` calls this on import; core itself never imports the ops.
    """
    global _OPERATORS
    _OPERATORS = namespace


@dataclass(eq=False)
class Node:
    """One op application: ``op`` applied to ``inputs`` with ``attrs``."""

    id: int
    op: Any  # meshdsl.ops.registry.Op
    inputs: tuple[Tensor, ...]
    attrs: dict
    graph: "Graph"
    phase: str
    name: str
    outputs: tuple[Tensor, ...] = field(default_factory=tuple)

    def __repr__(self) -> str:
        return f"Node#{self.id}({self.op.name}, {self.name}, {self.phase})"


_current: list["Graph"] = []


class ParamTable(dict):
    """A graph's params by name, as ``g.params["w1"]`` reads them; ``g.params()`` copies them."""

    def __call__(self) -> dict[str, Tensor]:
        """A new dict of the model's params by name, in the order they were made, without the
        optimizer state a training step adds (``opt/<param>/<slot>``): what ``md.Model``'s
        ``params`` takes when every param trains (``md.Model(g, loss, g.params(), ...)``)."""
        return {k: t for k, t in self.items() if not k.startswith("opt/")}


class Graph:
    """A container of nodes.  Use ``with Graph() as g:`` to build into it.

    Ops on tensors build into their tensors' graph; ops without tensor inputs
    (params, inputs, iota) build into the innermost active graph.
    """

    _ids = itertools.count()

    def __init__(self, name: str = "graph"):
        self.name = name
        self.nodes: list[Node] = []
        #: every param by name (``g.params()``: a copy without optimizer state)
        self.params: ParamTable = ParamTable()
        self.inputs: dict[str, Tensor] = {}
        self.phase = "forward"
        self._scope: list[str] = []
        self._names: dict[str, int] = {}
        self.uid = next(Graph._ids)
        # A repeat block: the graph it is built for, and the hook that turns a tensor of an
        # enclosing graph into one of its own (``ir/closure.py``).
        self.outer: Graph | None = None
        self.capture = None
        # Nodes of ops that mark themselves ``cse`` (a rename), by op, inputs, attrs and phase: an
        # identical one is not built again (see :meth:`add_node`).
        self._built: dict[tuple, Node] = {}

    def __enter__(self) -> "Graph":
        _current.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _current.pop()

    @staticmethod
    def current() -> "Graph":
        if not _current:
            raise GraphError(message(
                "No active graph: ops without tensor inputs (param, input, iota) need one.",
                rule="build a model inside 'with meshdsl.Graph() as g:'",
                fix="wrap the model-building code in 'with meshdsl.Graph():'"))
        return _current[-1]

    @contextlib.contextmanager
    def scope(self, name: str):
        """Prefix the names of nodes built inside, e.g. ``attn/einsum``."""
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()

    @contextlib.contextmanager
    def in_phase(self, phase: str):
        assert phase in PHASES
        old, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = old

    def _unique(self, base: str) -> str:
        full = "/".join(self._scope + [base])
        n = self._names.get(full, 0)
        self._names[full] = n + 1
        return full if n == 0 else f"{full}_{n}"

    def encloses(self, inner: "Graph") -> bool:
        """Whether ``inner`` is a block built inside this graph (directly or nested)."""
        g = inner.outer
        while g is not None:
            if g is self:
                return True
            g = g.outer
        return False

    def _local(self, op, t: Tensor) -> Tensor:
        """Input ``t`` of an op built here: itself, or a block's stand-in for a tensor of a
        graph around it (captured when the block is traced)."""
        if t.graph is self:
            return t
        if self.capture is not None and t.graph.encloses(self):
            return self.capture(t)
        if self.outer is not None:
            raise GraphError(message(
                f"{op.name}: the repeat block '{self.name}' reads {t!r} of graph '{t.graph.name}' (#{t.graph.uid}), "
                "which does not enclose the block.",
                inputs=[f"block built for graph '{self.outer.name}' (#{self.outer.uid})"],
                rule="a repeat block reads its carry, its stacked params and any tensor of the graph that calls "
                     "repeat (and of the blocks around it, for a nested repeat)",
                fix=f"build '{t.name}' in graph '{self.outer.name}' before calling repeat, or pass it to repeat "
                    "in the params dict, stacked along the layer dim"))
        raise GraphError(message(
            f"{op.name}: input {t!r} belongs to graph '{t.graph.name}' (#{t.graph.uid}), "
            f"not '{self.name}' (#{self.uid}).",
            rule="all inputs of an op come from one graph (a repeat block also reads the graphs around it)",
            fix="build the whole model inside one 'with Graph():' block"))

    def add_node(self, op, inputs, attrs, outs, name: str | None = None) -> Node:
        """Append a node; ``outs`` is a list of (Shape, dtype).  In a repeat block being traced,
        an op reading only tensors from outside the block is built outside it instead, once for
        every layer (the block's hook decides, ``ir/closure.py`` ``Closure.hoist``)."""
        if self.capture is not None:
            hoisted = self.capture.hoist(op, inputs, attrs, outs, name)
            if hoisted is not None:
                return hoisted
        inputs = [self._local(op, t) for t in inputs]
        # A pure view op (``op.cse``) of the same tensor with the same attrs is that node again:
        # ``k`` and ``v`` each made from ``rename(y, seq="key_seq")`` read one renamed tensor,
        # so their gradients are summed before they go back through the rename (a split dim's
        # partial sums reduced once, not once per rename).
        key = _cse_key(op, inputs, attrs, self.phase) if op.cse and name is None else None
        if key in self._built:
            return self._built[key]
        node = Node(len(self.nodes), op, tuple(inputs), attrs, self, self.phase,
                    self._unique(name or op.name))
        node.outputs = tuple(Tensor(node, i, s, d) for i, (s, d) in enumerate(outs))
        self.nodes.append(node)
        if key is not None:
            self._built[key] = node
        return node

    def built(self, op, inputs, attrs: dict, phase: str) -> Node | None:
        """The node of deterministic (``cse``) ``op`` built here on these very ``inputs``, with
        these ``attrs`` in ``phase``, or None: a fused op's composite lowered beside the user's
        own logsumexp of the same logits reuses its values (``lowering/composite.py``)."""
        return self._built.get(_cse_key(op, inputs, attrs, phase)) if op.cse else None


def _cse_key(op, inputs, attrs: dict, phase: str) -> tuple:
    return (op.name, tuple(id(t) for t in inputs), repr(sorted(attrs.items())), phase)


def graph_of(*xs) -> Graph:
    """The graph of the first Tensor among ``xs``, else the active graph.

    When the active graph is a repeat block built inside that tensor's graph (it is being
    traced), the block: an op of the block on tensors of the graphs around it is part of
    the block, which reads them as closed-over inputs.
    """
    for x in xs:
        if isinstance(x, Tensor):
            inner = _current[-1] if _current else None
            return inner if inner is not None and inner.capture is not None and x.graph.encloses(inner) \
                else x.graph
    return Graph.current()


def topo_nodes(outputs, stop=None) -> list[Node]:
    """Nodes needed for ``outputs``, in build order (which is a topological order).

    ``stop`` holds ``id()``s of tensors whose values are given: the walk does not
    go through them as inputs, so their producers are left out unless something
    else needs them (the producers of ``outputs`` themselves are always included).
    """
    stop = stop or ()
    need: set[int] = set()
    stack = [t.node for t in outputs]
    graph = outputs[0].graph if outputs else None
    while stack:
        n = stack.pop()
        if n.id in need:
            continue
        need.add(n.id)
        stack.extend(t.node for t in n.inputs if id(t) not in stop)
    return [n for n in graph.nodes if n.id in need] if graph else []


def readers_of(nodes) -> dict[int, list[Node]]:
    """``id(tensor) -> the nodes of ``nodes`` that read it``, in ``nodes``' order (once per input
    position: a node reading a tensor twice is listed twice)."""
    readers: dict[int, list[Node]] = {}
    for n in nodes:
        for x in n.inputs:
            readers.setdefault(id(x), []).append(n)
    return readers
