"""The SPMD plan: an immutable, inspectable list of steps that every rank runs.

A step is local compute on slices, a collective over named mesh axes (a kind
in :data:`meshdsl.collectives.COLLECTIVES`), a local split, a leaf (param /
input), or a step that runs sub-plans (a loop body, a pipeline's segments).
Values are numbered; each has a global shape, a dtype and a
:class:`~meshdsl.layout.sharding.Sharding`.  Figures (bytes per collective,
FLOPs per kernel) are plain fields, so reports, cost models and layout search
read the same data the executors run.  A plan compiled with micro-batches runs on the mesh plus
the virtual micro-batch axis :data:`MB_AXIS`; a process holds all its micro-batch ranks, so a step
that still varies by micro-batch where the process runs them all at once (outside a pipeline's
per-micro-batch segments) runs once per micro-batch, and the figures count it so (:meth:`Plan.walk`).

Plans, steps and values are frozen once built: a compiled plan may be shared
(the compile cache hands the same one out again) and nobody may change it.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import torch

from ..collectives import COLLECTIVES
from ..core.shape import Shape
from ..layout.layout import Layout
from ..layout.mesh import Mesh
from ..layout.sharding import Sharding

#: The virtual micro-batch axis (a leading underscore keeps it apart from user axes).
MB_AXIS = "_mb"

#: Step kind -> the args its steps carry (the schema :func:`step_args` checks).
#: Collective kinds take theirs from :data:`meshdsl.collectives.COLLECTIVES`.
STEP_KINDS: dict[str, frozenset[str]] = {
    # parts: {dim: lengths} of dims cut at given lengths (lowering/local_parts.py)
    "local": frozenset({"fn", "inplace", "donates", "attrs", "compute", "sizes", "parts"}),
    "split": frozenset({"dim"}),
    "param": frozenset({"name", "tensor"}),
    "input": frozenset({"name", "tensor"}),
}


def register_step_kind(kind: str, args) -> None:
    """Declare a step kind and the args its steps carry (e.g. a loop over a sub-plan)."""
    STEP_KINDS[kind] = frozenset(args)


def step_args(kind: str, args: Mapping | None) -> Mapping:
    """``args`` as a read-only mapping, checked against the schema of ``kind``."""
    args = dict(args or {})
    allowed = STEP_KINDS.get(kind)
    if allowed is None:
        allowed = frozenset(COLLECTIVES[kind].args)
    assert set(args) <= allowed, f"step '{kind}' carries args {sorted(set(args) - allowed)} outside its schema"
    return MappingProxyType(args)


def varies_by_microbatch(step, values) -> bool:
    """Whether one of plan step ``step``'s values is split or partial along :data:`MB_AXIS`."""
    return any(MB_AXIS in values[v].sharding.used_axes for v in (*step.ins, *step.outs) if v in values)


def _frozen(d) -> Mapping:
    return d if isinstance(d, MappingProxyType) else MappingProxyType(dict(d))


@dataclass(frozen=True)
class Value:
    """A value flowing through the plan: a tensor in some sharding."""

    id: int
    shape: Shape
    dtype: torch.dtype
    sharding: Sharding

    def local_shape(self, mesh: Mesh, rank: int | None = None) -> tuple[int, ...]:
        """``rank``'s local shape; without a rank the largest (an uneven split's first part)."""
        return self.sharding.local_shape(self.shape, mesh, rank)

    def local_bytes(self, mesh: Mesh) -> int:
        """Bytes of the largest local slice (every rank's when the split is even).

        Kept for the last mesh asked (a value's fields never change): the cost model and the
        memory report ask for every value of a plan many times (a search of llama on 4 ranks:
        ~270k calls, a quarter of its time)."""
        memo = self.__dict__.get("_local_bytes")
        if memo is not None and memo[0] is mesh:
            return memo[1]
        n = self.dtype.itemsize
        for s in self.local_shape(mesh):
            n *= s
        object.__setattr__(self, "_local_bytes", (mesh, n))
        return n


@dataclass(frozen=True, eq=False)
class Step:
    """One instruction of the plan.

    Attributes:
      kind: a key of :data:`STEP_KINDS` ('local', 'split', 'param', 'input', 'repeat'),
        or a collective kind of :data:`meshdsl.collectives.COLLECTIVES`.
      node: id of the graph node the step belongs to; op / label / phase copy it.
      ins, outs: value ids.
      axes: mesh axes of a collective or split (first major).
      args: what the executor needs, read-only, keys as the kind's schema declares:
        'dim' (position), 'op' (reduce op), 'offset'/'wrap' (permute),
        'fn'/'inplace'/'attrs'/'compute'/'sizes' (local kernels; 'inplace' is the
        kernel's variant that overwrites its first input, or None).
      bytes: per-rank bytes of the buffer a collective sends (its local input).
      flops: FLOPs of a local kernel on one rank.
      note: why the step is there, when it is not obvious (e.g. a re-layout).
      subplans: plans this step runs (a loop body); their figures count ``times`` over.
      times: how often each sub-plan runs per run of the step.
      sub_times: per sub-plan counts instead of ``times``, when they differ (a pipeline
        runs its forward and backward segments once per micro-batch, the rest once).
      one_microbatch: per sub-plan, whether each of its runs holds one micro-batch of a process
        (a pipeline's forward and backward segments, run once per micro-batch), not all the
        micro-batches the step itself holds (its other sub-plans: the prologue, the final segment).
      written: how the user wrote the op where its name is one the graph made up (an einsum's
        equation and operands, :func:`written`), so that a refusal built from steps can say it.
    """

    kind: str
    node: int
    op: str
    label: str
    phase: str
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    axes: tuple[str, ...] = ()
    args: Mapping = field(default_factory=lambda: MappingProxyType({}))
    bytes: int = 0
    flops: int = 0
    note: str = ""
    subplans: tuple["Plan", ...] = ()
    times: int = 1
    sub_times: tuple[int, ...] = ()
    one_microbatch: tuple[bool, ...] = ()
    written: str = ""

    def runs(self, k: int) -> int:
        """How often sub-plan ``k`` runs per run of the step."""
        return self.sub_times[k] if self.sub_times else self.times

    def held(self, k: int, held: int) -> int:
        """The micro-batches a process holds in each run of sub-plan ``k``, when it holds ``held``
        in a run of the step."""
        return 1 if self.one_microbatch and self.one_microbatch[k] else held

    def __post_init__(self):
        if not isinstance(self.args, MappingProxyType):
            object.__setattr__(self, "args", MappingProxyType(dict(self.args)))

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVES


#: How autodiff prefixes the names of the nodes of a node's gradient (``grad_<name>/...``).
GRAD = "grad_"


def step_called(s: Step) -> str:
    """How a message names plan step ``s``: :func:`called` with the op as the user wrote it."""
    return called(s.label, s.op, written_as=s.written)


def sum_begun_by(steps, values, v: int, axis: str) -> Step | None:
    """The local step of ``steps`` that began value ``v``'s partial sum over mesh ``axis``, from values
    not partial over it (the ops that pass the partial sum on skipped): what a refusal of that sum
    names as the op the user wrote (an einsum over the layers, not the add that reads it); or None."""
    made = {u: s for s in steps for u in s.outs}
    s = made.get(v)
    while s is not None and not s.is_collective:
        nxt = next((u for u in s.ins if u in values and axis in values[u].sharding.partial), None)
        if nxt is None:
            return s
        s = made.get(nxt)
    return None


def called(label: str, op: str, node=None, written_as: str = "") -> str:
    """How a message names a node or step: its name, as ``meshdsl plan``'s rows show it, with its
    op when the name does not say it: ``'sub'``, ``'einsum_1'``, ``'reduce_mean'`` (a sum times
    1/n, but named as the user wrote it), ``'h' (add)``, and a gradient's node by the op the user
    wrote: ``'layer_norm_backward' (of layer_norm's gradient)`` for
    ``grad_layer_norm/layer_norm_backward``; a step of an md op built of others by the op the
    user called: ``'concat/pad' (a pad inside md.concat)``.  Given the ``node``, an einsum's name
    the graph made up (``'einsum_12'``: which of the model's contractions?) also says how the user
    wrote it (:func:`written`; a step carries that text as ``written_as``)."""
    from .. import ops
    head, sep, tail = label.partition("/")
    if sep and head.startswith(GRAD):
        return f"'{tail}' (of {head[len(GRAD):]}'s gradient)"
    outer = [p for p in (re.sub(r"_\d+$", "", x) for x in label.split("/")[:-1]) if callable(getattr(ops, p, None))]
    if outer:
        return f"'{label}' (a {op} inside md.{outer[-1]})"
    if (node is not None or written_as) and op == "einsum" and re.sub(r"_\d+$", "", label.rpartition("/")[2]) == op:
        return f"'{label}' ({written_as or written(node)})"
    base = re.sub(r"_\d+$", "", label)
    said = base == op or callable(getattr(ops, base, None))
    return f"'{label}'" if said else f"'{label}' ({op})"


def written(node) -> str:
    """An einsum node as the user's call wrote it: its equation and operand dims
    (``md.einsum("batch e, batch2 e -> batch batch2") of [batch:4, e:3] and [batch2:4, e:3]``)."""
    eq = ", ".join(" ".join(x.shape.names) for x in node.inputs) + " -> " + " ".join(node.attrs["out"])
    return f'md.einsum("{eq}") of ' + " and ".join(str(x.shape) for x in node.inputs)


@dataclass(frozen=True)
class Plan:
    """A compiled SPMD program: steps, values, and which values are the outputs.

    The containers are read-only (tuples and mapping proxies), so a plan can be
    shared between executors and the compile cache.
    """

    mesh: Mesh
    layout: Layout
    steps: tuple[Step, ...]
    values: Mapping[int, Value]
    outputs: Mapping[str, int]
    params: Mapping[str, int] = field(default_factory=dict)   # param name -> value id
    inputs: Mapping[str, int] = field(default_factory=dict)   # input name -> value id
    notes: tuple[str, ...] = ()
    #: value id -> the mesh ranks that hold it, for params, inputs and outputs a pipeline
    #: keeps on some stages only (absent: every rank).
    holders: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    #: every param of the outputs' graph, read or not: name -> (shape, dtype), so that params
    #: given by name can be told apart: one the plan does not read is ignored, a typo refused.
    graph_params: Mapping[str, tuple[Shape, torch.dtype]] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        for name in ("values", "outputs", "params", "inputs", "holders", "graph_params"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        object.__setattr__(self, "steps", tuple(self.steps))
        object.__setattr__(self, "notes", tuple(self.notes))

    @property
    def held_microbatches(self) -> int:
        """The micro-batches a process holds at the plan's top level: its mesh's :data:`MB_AXIS`."""
        return self.mesh.sizes.get(MB_AXIS, 1)

    def walk(self, held: int | None = None):
        """Every step, sub-plans' steps included (before the step that runs them), with how
        often it runs per run of the plan on one process.

        ``held``: the micro-batches a process holds in a run of the plan (default: all of its
        mesh's, :data:`MB_AXIS`).  A step that varies by micro-batch runs once for each
        (``comm/microbatch.py``: one message per micro-batch rank held), one that does not
        runs once (``runtime/steps.py``: representatives), and a collective over the
        micro-batch axis too folds them first, then runs once."""
        held = self.held_microbatches if held is None else held
        for s in self.steps:
            for k, sub in enumerate(s.subplans):
                for c, mult in sub.walk(s.held(k, held)):
                    yield c, mult * s.runs(k)
            yield s, self.held_runs(s, held)

    def held_runs(self, s: Step, held: int | None = None) -> int:
        """How often step ``s`` of this plan runs in one run of it when a process holds ``held``
        micro-batches (default: all of its mesh's; see :meth:`walk`)."""
        held = self.held_microbatches if held is None else held
        if held == 1 or s.subplans or (s.is_collective and MB_AXIS in s.axes):
            return 1
        return held if varies_by_microbatch(s, self.values) else 1

    def collectives(self):
        """Every collective step, sub-plans included, with how often it runs per run of the plan."""
        return ((s, mult) for s, mult in self.walk() if s.is_collective)

    def totals(self) -> dict[str, dict[str, int]]:
        """Collective count and bytes per kind, e.g. ``{"allreduce": {"count": 2, "bytes": 8}}``."""
        out: dict[str, dict[str, int]] = {}
        for s, mult in self.collectives():
            t = out.setdefault(s.kind, {"count": 0, "bytes": 0})
            t["count"] += mult
            t["bytes"] += mult * s.bytes
        return out

    def totals_by_axis(self) -> dict[tuple[str, tuple[str, ...]], dict[str, int]]:
        """As :meth:`totals`, keyed by (kind, axes)."""
        out: dict = {}
        for s, mult in self.collectives():
            t = out.setdefault((s.kind, s.axes), {"count": 0, "bytes": 0})
            t["count"] += mult
            t["bytes"] += mult * s.bytes
        return out

    def flops(self, held: int | None = None) -> int:
        """FLOPs of one run on one rank, sub-plans counted as often as they run (:meth:`walk`;
        ``held`` as there: a pipeline's forward segment alone holds one micro-batch a run)."""
        return sum(s.flops * mult for s, mult in self.walk(held) if s.flops)

    def signature(self) -> str:
        """A hash of everything that must agree across ranks (steps, shapes, collectives)."""
        h = hashlib.sha256()
        h.update(f"{self.mesh}|{self.layout}".encode())
        for s in self.steps:
            h.update(f"{s.kind}|{s.op}|{s.label}|{s.ins}|{s.outs}|{s.axes}|{s.bytes}|{s.times}|{s.sub_times}|".encode())
            for k in sorted(s.args):
                v = s.args[k]
                if v is None or isinstance(v, (bool, int, float, str)):
                    h.update(f"{k}={v}".encode())
            for sub in s.subplans:
                h.update(sub.signature().encode())
        for v in self.values.values():
            h.update(f"{v.id}:{v.shape}:{v.dtype}:{v.sharding}".encode())
        return h.hexdigest()[:16]
