"""The op table.  Each op declares, in one class, everything the system needs:

* ``infer``   : the shape rule (output shapes and dtypes from inputs and attrs);
* ``compute`` : the local torch kernel, used by the dense executor (whole
  tensors) and by every rank of a mesh (slices; ``ctx`` gives slice offsets);
* ``grad``    : reverse-mode rule, built from other named-tensor ops;
* ``spec``    : how the generic lowering rule may shard its compute;
* ``compute_inplace`` (optional): the kernel writing into its first input.

A new op touches one file: subclass :class:`Op` and call :func:`register`.
How a node becomes plan steps is the lowering's business: ops that need
communication of their own get a rule in :mod:`meshdsl.lowering.rules`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from ..core.graph import Tensor, graph_of, not_a_tensor
from ..errors import GraphError, message
from ..core.shape import Shape

OPS: dict[str, "Op"] = {}


def register(cls):
    """Class decorator: instantiate the op and put it in :data:`OPS`."""
    OPS[cls.name] = cls()
    return cls


@dataclass
class ComputeSpec:
    """How an op's local compute may be sharded (for the generic lowering rule).

    Attributes:
      dims: every dim the compute touches, name -> size.
      fixed: dims that must be whole (unsplit) on every rank.
      reduce: input dims absent from the output, name -> 'sum' | 'max' | 'min'.
        A split 'sum' dim leaves a lazy partial sum; 'max'/'min' are reduced at once.
        With several outputs, each is a partial sum over the 'sum' dims it lacks.
      out_rename: output dim name -> compute dim name, for ops that rename dims.
    """

    dims: dict[str, int]
    fixed: frozenset[str] = frozenset()
    reduce: dict[str, str] = field(default_factory=dict)
    out_rename: dict[str, str] = field(default_factory=dict)


class LocalCtx:
    """What a local kernel may know about its rank: the global offset of each dim's slice."""

    __slots__ = ("offsets", "sizes", "salt")

    def __init__(self, offsets: dict[str, int] | None = None, sizes: dict[str, int] | None = None,
                 salt: int = 0):
        self.offsets = offsets or {}
        self.sizes = sizes or {}
        self.salt = salt

    def offset(self, name: str) -> int:
        """Global index of this rank's first element along dim ``name``."""
        return self.offsets.get(name, 0)

    def size(self, name: str, full: int) -> int:
        """Local size of dim ``name`` (``full`` when the dim is whole here)."""
        return self.sizes.get(name, full)

    def with_salt(self, salt: int) -> "LocalCtx":
        return LocalCtx(self.offsets, self.sizes, salt)


DENSE_CTX = LocalCtx()

#: The device the running program's values live on (None: torch's default device).
_RUN_DEVICE: ContextVar = ContextVar("meshdsl_run_device", default=None)


def run_device():
    """Where a kernel with no tensor inputs (``iota``) makes its result: the device of the
    program now running (set by the executors), else torch's default device (None)."""
    return _RUN_DEVICE.get()


class running_on:
    """``with running_on(device):`` runs the enclosed kernels' input-free allocations on ``device``
    (a class, not a generator: entered once per step, it costs no generator frames)."""

    __slots__ = ("device", "token")

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        self.token = _RUN_DEVICE.set(self.device)

    def __exit__(self, *exc):
        _RUN_DEVICE.reset(self.token)


class Op(ABC):
    """Base class of every op; see the module docstring."""

    name = "op"
    #: True: the op is linear when *all* inputs are partial sums over the same axes
    #: (add, sub, concat, unary linear maps), so the partial sum passes through lazily.
    linear = False
    #: input positions in which the op is linear on its own (mul: either operand,
    #: div: the numerator): one of them may be partial while the others are not.
    linear_args: tuple[int, ...] = ()
    #: linear in each input on its own, the others fixed (einsum): inside a repeat's block a
    #: partial sum over the micro-batches passes through it (it cannot be reduced there);
    #: elsewhere one partial input passes through where the cost model finds the result cheaper
    #: to reduce than the input (:func:`~meshdsl.lowering.generic._partial_modes`).
    multilinear = False
    #: ops whose outputs carry no gradient (integer or boolean results).
    differentiable = True
    #: ops that cut reverse mode (stop_gradient): nothing behind them is differentiated.
    blocks_gradient = False
    #: ``compute_inplace(ctx, attrs, *xs)``: the kernel, writing its result into
    #: ``xs[0]``; an executor that may donate that input uses it.  None: no such variant.
    compute_inplace = None
    #: whether ``compute`` reads ``ctx.salt`` (the layer index in a loop: a random op's stream)
    reads_salt = False
    #: the input positions ``compute_inplace`` writes into (all donated, or it is not used).
    donates: tuple[int, ...] = (0,)
    #: a pure view (rename): one built again on the same input with the same attrs is the
    #: first node (:meth:`~meshdsl.core.graph.Graph.add_node`).
    cse = False

    @abstractmethod
    def infer(self, inputs: list[Tensor], attrs: dict) -> list[tuple[Shape, torch.dtype]]:
        """Output (shape, dtype) pairs."""

    @abstractmethod
    def compute(self, ctx: LocalCtx, attrs: dict, *xs):
        """Local torch kernel on (slices of) the inputs."""

    def direct(self, attrs: dict):
        """``compute`` with ``attrs`` bound, as ``fn(*xs)`` for a kernel that reads no ``ctx`` (the
        executor's straight-line program calls it without the op's frame), or None."""
        return None

    def direct_for(self, attrs: dict, ins: tuple, outs: tuple):
        """:meth:`direct` for inputs and outputs of these local shapes only (``ins``, ``outs``: one
        tuple per tensor), or None: the executor's program binds it per step and rank, since a plan
        runs each step on the same shapes every time.  By default :meth:`direct`."""
        return self.direct(attrs)

    def grad(self, node, douts):
        if node.phase == "backward":   # made by a gradient: md.vjp's result differentiated again
            raise GraphError(message(
                f"grad: op '{self.name}' ({node.name}) belongs to a gradient and has no gradient rule (no "
                "second-order rule): a gradient of that gradient cannot pass through it.",
                rule="differentiating md.vjp's results needs a second-order rule for every op of the inner "
                     "gradient; the fused backward kernels (md.repeat's scan, attention, the norms) have none",
                fix="build the function whose gradient is differentiated again from ops with second-order "
                    "rules: md.repeat's layers as a Python loop, a fused attention or norm as its composite ops"))
        raise GraphError(message(
            f"grad: op '{self.name}' ({node.name}) has no gradient rule.",
            rule="every op on the path from a param to the loss needs a gradient",
            fix="wrap the op's input in meshdsl.stop_gradient(...) if no gradient should flow"))

    def is_linear(self, node) -> bool:
        return self.linear

    def linear_in_all(self, node, idxs) -> bool:
        """Whether ``node`` is jointly linear in its inputs ``idxs``, the others fixed (partial sums
        over the same axes there pass through together): by default a linear op, all of them."""
        return self.is_linear(node) and len(idxs) == len(node.inputs)

    def linear_in(self, node, i: int) -> bool:
        """Whether ``node`` is linear in its input ``i`` on its own, the others fixed (one partial
        sum there passes through): ``i in linear_args`` unless the op says more of the node."""
        return i in self.linear_args

    def spec(self, node) -> ComputeSpec:
        """Default: elementwise over the output dims."""
        return ComputeSpec({d.name: d.size for d in node.outputs[0].shape})

    def subgraphs(self, node) -> tuple:
        """Graphs the node runs inside (a repeat's block), each with the tensor names
        in it that layouts may scope: ``((graph, names), ...)``."""
        return ()

    def drop_unused_outputs(self, node, used: list[bool]):
        """Attrs that compute only the outputs marked ``used`` and how many outputs
        that leaves, or None when the op always computes them all.  Only trailing
        outputs may be dropped (a repeat's saved activations)."""
        return None

    def flops(self, node, local: dict[str, int]) -> int:
        """FLOPs of one local kernel call, given the local size of every compute dim."""
        return local_elements(node.outputs[0].shape, local)


def local_elements(shape, local: dict[str, int]) -> int:
    """The elements of one rank's part of ``shape``: ``local`` gives a split dim's local size."""
    n = 1
    for d in shape:
        n *= local.get(d.name, d.size)
    return n


def has_gradient(op: Op) -> bool:
    """Whether reverse mode passes through ``op``: it is differentiable and has a rule of its
    own.  Every other op with a floating-point input is an error for ``vjp`` to cross
    (the backward kernels: a second-order gradient), never a gradient silently dropped."""
    return op.differentiable and type(op).grad is not Op.grad


def apply(op_name: str, inputs, attrs: dict | None = None, name: str | None = None):
    """Build a node of op ``op_name``; returns its output (or a tuple of outputs)."""
    op = OPS[op_name]
    attrs = attrs or {}
    for i, x in enumerate(inputs):
        if not isinstance(x, Tensor):
            raise not_a_tensor(op_name, f"operand {i}" if len(inputs) > 1 else "its input", x)
    g = graph_of(*inputs)
    outs = op.infer(list(inputs), attrs)
    node = g.add_node(op, inputs, attrs, outs, name)
    return node.outputs[0] if len(node.outputs) == 1 else node.outputs
