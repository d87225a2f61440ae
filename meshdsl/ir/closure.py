"""What a repeat block reads from the graphs around it: its closed-over tensors.

A block may use any tensor of the graph that calls ``repeat`` (an input, a
constant, a param not stacked along the layer dim, an activation computed before
the stack).  As JAX does for a scan's consts, the tensors are found while the block
is traced: the first op of the block that reads one (see ``Graph.add_node``) gets a
placeholder of the block in its place, named ``closed/<tensor name>``, and the
tensor becomes an extra input of the repeat node, fed unchanged to every layer.
Its gradient is the sum of the layers' gradients (:mod:`.repeat`).

A nested repeat reading a tensor two graphs out captures it through every block in
between, so each repeat node only reads tensors of the graph it is built in.

Loop-invariant ops leave the block (:meth:`Closure.hoist`): an op the block builds from
tensors of the graphs around it only (no carry, no layer's param, nothing the block made),
none made from a param (no gradient flows into it), gives the same value in every layer, so
it is built once in the graph around the block, and the block reads its result as a
closed-over tensor.  A count of the inputs made in a block is then made once per step (under
micro-batches, before them); a table of constants (rotary angles, a causal mask) costs once,
not once per layer.  Values with the examples' dim stay in the block (see :meth:`Closure.hoist`):
``batch``, or the user's name for it (``B``, ``N``, ``examples``) read off the graph
(:mod:`meshdsl.core.examples`), so a model hoists alike whatever it calls that dim.
"""
from __future__ import annotations

from weakref import WeakKeyDictionary

from ..core.examples import examples_dim_of
from ..core.graph import Graph, Node, Tensor
from ..errors import ShapeError, message
from ..ops.leaf import placeholder

#: The prefix of a closed-over tensor's placeholder name (and of its sub-plan input).
PREFIX = "closed/"

#: The examples' dim of each model graph, read when its first block is traced, so that every
#: trace of its blocks (a gradient's re-trace, once the graph has grown, included) hoists alike.
_EXAMPLES: WeakKeyDictionary = WeakKeyDictionary()


def examples_of_graph(graph: Graph) -> str | None:
    """The examples' dim of the model graph around ``graph`` (a repeat block, or the model's own):
    ``batch``, or the user's name for it (:func:`~meshdsl.core.examples.examples_dim_of`), or None."""
    while graph.outer is not None:
        graph = graph.outer
    if graph not in _EXAMPLES:
        _EXAMPLES[graph] = examples_dim_of(graph.nodes)
    return _EXAMPLES[graph]


class Closure:
    """The capture hook of one block (``graph.capture``).

    It captures while the block is traced (``open``); afterwards it only hands out what it
    captured (a nested repeat's backward block, traced later inside this block's, reads them).

    Attributes:
      graph: the block's graph.
      outer: the captured tensors of the graph around it (``graph.outer``), in capture order.
      inner: placeholder name -> the block's placeholder standing for each of them.
      open: whether the block is being traced.
      hoisted: the nodes of loop-invariant ops built outside the block, in trace order.
    """

    def __init__(self, graph: Graph, replay: list[Node] | None = None):
        self.graph = graph
        self.outer: list[Tensor] = []
        self.inner: dict[str, Tensor] = {}
        self.open = True
        self.hoisted: list[Node] = []
        self._made: dict[int, Tensor] = {}
        self._params_in: dict[int, bool] = {}   # id(tensor) -> made from a param
        self._copies: dict[int, Tensor] = {}    # id(a constant of the block) -> its copy outside
        # a re-trace of a block (its gradient's) reuses the first trace's hoisted nodes, in order
        self._replay = iter(replay) if replay is not None else None

    def hoist(self, op, inputs, attrs: dict, outs, name: str | None) -> Node | None:
        """The node of a loop-invariant op, built in the graph around the block, or None: the op
        belongs to the block.

        Invariant: the op reads tensors of graphs around the block and constants the block made
        (a scalar factor, an ``arange``: copied outside with it), at least one.  Never hoisted: an
        op reading nothing (a leaf, a constant: the block's own), a random op (``reads_salt``: its
        stream differs per layer), an op holding a sub-graph (a nested repeat, traced for this
        block), an op whose output has the examples' dim (``batch``, or the user's name for it: a
        pipeline would make it before the stack
        and send it to every later stage per micro-batch, where each stage recomputes it today from
        the inputs it is fed: a reduction over the batch, a count, leaves the block; a padding
        mask stays), and an op made from a param or from an enclosing block's placeholder (what the
        loss's gradient may flow into): a closed tensor's gradient is the sum of its layers'
        gradients in the tensor's dtype, so a hoisted op of a param would add them up in bf16
        under mixed precision (ir/precision.py replays it outside the block), where the block adds
        them up in the param's fp32 today.  The graph around may be a block being traced too: it
        hoists the op further when the op reads nothing of its own either.
        """
        if not self.open or op.reads_salt or _holds_graph(attrs):
            return None
        examples = examples_of_graph(self.graph)
        if examples is not None and any(examples in sh.names for sh, _ in outs):
            return None
        outside = [isinstance(t, Tensor) and t.graph is not self.graph and t.graph.encloses(self.graph)
                   for t in inputs]
        if not inputs or not all(o or _constant(t, self.graph) for o, t in zip(outside, inputs)):
            return None
        if any(self._from_params(t) for t, o in zip(inputs, outside) if o):
            return None
        return self._build(op, [t if o else self._copy(t) for o, t in zip(outside, inputs)], attrs, outs, name)

    def _copy(self, t: Tensor) -> Tensor:
        """Constant ``t`` of the block, made outside it too (once) for a hoisted op that reads it."""
        if id(t) not in self._copies:
            n = t.node
            self._copies[id(t)] = self._build(n.op, [], n.attrs, [(t.shape, t.dtype)], n.name).outputs[0]
        return self._copies[id(t)]

    def _build(self, op, inputs, attrs, outs, name) -> Node:
        """Build the node in the graph around the block (a re-trace: take the first trace's)."""
        if self._replay is not None:
            node = next(self._replay, None)
            if node is None or node.op is not op:
                raise ShapeError(f"repeat: the block traced differently twice (hoisting {op.name}, the first trace "
                                 f"hoisted {node!r}); blocks must be deterministic functions of (carry, params)")
        else:
            node = self.graph.outer.add_node(op, inputs, attrs, outs, name)
        self.hoisted.append(node)
        return node

    def _from_params(self, t: Tensor) -> bool:
        """Whether ``t`` is made from a param or a block's placeholder (a carry, a layer's param, a
        closed-over tensor of a nested block): a gradient may flow into it.  Remembered per tensor."""
        todo, seen = [t], []
        while todo:
            x = todo.pop()
            if id(x) in self._params_in:
                if self._params_in[id(x)]:
                    break
                continue
            if x.node.op.name in ("param", "placeholder"):
                break
            seen.append(x)
            todo.extend(x.node.inputs)
        else:
            for x in seen:
                self._params_in[id(x)] = False
            return False
        self._params_in[id(t)] = True
        return True

    def replayed_all(self) -> bool:
        """Whether a re-trace hoisted every node the first trace did."""
        return self._replay is None or next(self._replay, None) is None

    def __call__(self, t: Tensor) -> Tensor:
        """The block's placeholder for ``t``, a tensor of a graph enclosing the block."""
        hit = self._made.get(id(t))
        if hit is not None:
            return hit
        around = self.graph.outer
        if t.graph is not around:  # a nested block: the block around this one reads it first
            t = around.capture(t)
            hit = self._made.get(id(t))
            if hit is not None:
                return hit
        if not self.open:
            raise ShapeError(message(
                f"repeat: an op was built into block '{self.graph.name}' after its trace ended, reading {t!r} "
                "of the graph around it.",
                bullets=["most often: a tensor made inside the block (kept in a list or a global while the block "
                         "ran) is used after the repeat; it exists only inside the layer loop",
                         "or: the block reads a tensor from outside only when it is traced again"],
                rule="a block's tensors stay inside the block; what leaves a repeat is its carry and its per-layer "
                     "outputs; blocks are deterministic functions of (carry, params) and what they read from outside",
                fix="return the tensor as a per-layer output, block returns (carry, {'name': t}) and repeat returns "
                    "(carry, {'name': stacked over the layers}); and read the same tensors every time the block runs"))
        with self.graph:
            ph = placeholder(PREFIX + t.name, t.shape, t.dtype, t.scopes)
        self.outer.append(t)
        self.inner[ph.node.name] = ph
        self._made[id(t)] = ph
        return ph


def _constant(t, graph: Graph) -> bool:
    """Whether ``t`` is a constant made in ``graph`` (an op reading nothing, not a leaf, not random)."""
    return (isinstance(t, Tensor) and t.graph is graph and not t.node.inputs and not t.node.op.reads_salt
            and t.node.op.name not in ("placeholder", "param", "input") and not _holds_graph(t.node.attrs))


def _holds_graph(attrs: dict) -> bool:
    """Whether an op's attrs hold a sub-graph (a repeat's block)."""
    return any(isinstance(getattr(v, "graph", None), Graph) for v in attrs.values())


def activations(closed: dict[str, Tensor], outer: list[Tensor]) -> list[Tensor]:
    """The placeholders of ``closed`` that stand for batch activations (tensors with the
    examples' dim, :func:`examples_of_graph`: an encoder's output, a mask).  What the block
    computes from them is saved for its backward like what it computes from the carry; what it
    computes from params, constants and tables is recomputed."""
    examples = examples_of_graph(outer[0].graph) if outer else None
    return [ph for ph, t in zip(closed.values(), outer) if examples is not None and examples in t.shape.names]
