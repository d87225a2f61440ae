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
"""
from __future__ import annotations

from ..core.graph import Graph, Tensor
from ..errors import ShapeError, message
from ..ops.leaf import placeholder

#: The prefix of a closed-over tensor's placeholder name (and of its sub-plan input).
PREFIX = "closed/"


class Closure:
    """The capture hook of one block (``graph.capture``).

    It captures while the block is traced (``open``); afterwards it only hands out what it
    captured (a nested repeat's backward block, traced later inside this block's, reads them).

    Attributes:
      graph: the block's graph.
      outer: the captured tensors of the graph around it (``graph.outer``), in capture order.
      inner: placeholder name -> the block's placeholder standing for each of them.
      open: whether the block is being traced.
    """

    def __init__(self, graph: Graph):
        self.graph = graph
        self.outer: list[Tensor] = []
        self.inner: dict[str, Tensor] = {}
        self.open = True
        self._made: dict[int, Tensor] = {}

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


def activations(closed: dict[str, Tensor], outer: list[Tensor]) -> list[Tensor]:
    """The placeholders of ``closed`` that stand for batch activations (tensors with a
    ``batch`` dim: an encoder's output, a mask).  What the block computes from them is
    saved for its backward like what it computes from the carry; what it computes from
    params, constants and tables is recomputed."""
    return [ph for ph, t in zip(closed.values(), outer) if "batch" in t.shape.names]
