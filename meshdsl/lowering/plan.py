"""The SPMD plan: a flat, inspectable list of steps that every rank runs.

A step is local compute on slices, a collective over named mesh axes, a local
split, or a leaf (param / input).  Values are numbered; each has a global
shape, a dtype and a :class:`~meshdsl.layout.sharding.Sharding`.  Figures
(bytes per collective, FLOPs per kernel) are plain fields, so reports, cost
models and layout search read the same data the executors run.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from ..core.shape import Shape
from ..layout.layout import Layout
from ..layout.mesh import Mesh
from ..layout.sharding import Sharding

COLLECTIVES = ("allreduce", "allgather", "alltoall", "reduce_scatter", "permute")


@dataclass
class Value:
    """A value flowing through the plan: a tensor in some sharding."""

    id: int
    shape: Shape
    dtype: torch.dtype
    sharding: Sharding

    def local_shape(self, mesh: Mesh) -> tuple[int, ...]:
        return self.sharding.local_shape(self.shape, mesh)

    def local_bytes(self, mesh: Mesh) -> int:
        n = 1
        for s in self.local_shape(mesh):
            n *= s
        return n * self.dtype.itemsize


@dataclass
class Step:
    """One instruction of the plan.

    Attributes:
      kind: 'local', 'split', 'param', 'input', 'repeat', or a collective in
        :data:`COLLECTIVES`.
      node: id of the graph node the step belongs to; op / label / phase copy it.
      ins, outs: value ids.
      axes: mesh axes of a collective or split (first major).
      args: what the executor needs: 'dim' (position), 'op' (reduce op),
        'offset'/'wrap' (permute), 'fn'/'attrs'/'compute' (local kernels).
      bytes: per-rank bytes of the buffer a collective sends (its local input).
      flops: FLOPs of a local kernel on one rank.
      note: why the step is there, when it is not obvious (e.g. a re-layout).
    """

    kind: str
    node: int
    op: str
    label: str
    phase: str
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    axes: tuple[str, ...] = ()
    args: dict = field(default_factory=dict)
    bytes: int = 0
    flops: int = 0
    note: str = ""

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVES


@dataclass
class Plan:
    """A compiled SPMD program: steps, values, and which values are the outputs."""

    mesh: Mesh
    layout: Layout
    steps: list[Step]
    values: dict[int, Value]
    outputs: dict[str, int]
    params: dict[str, int] = field(default_factory=dict)   # param name -> value id
    inputs: dict[str, int] = field(default_factory=dict)   # input name -> value id
    notes: list[str] = field(default_factory=list)
    repeat: int = 1  # how many times the plan runs when it is a repeat block

    def collectives(self):
        """Every collective step, including those inside repeat blocks (with their multiplicity)."""
        for s in self.steps:
            if s.kind == "repeat":
                for sub in (s.args["plan"],):
                    for c, mult in sub.collectives():
                        yield c, mult * s.args["times"]
            elif s.is_collective:
                yield s, 1

    def totals(self) -> dict[str, dict[str, int]]:
        """Collective count and bytes per kind, e.g. ``{"allreduce": {"count": 2, "bytes": 8}}``."""
        out: dict[str, dict[str, int]] = {}
        for s, mult in self.collectives():
            t = out.setdefault(s.kind, {"count": 0, "bytes": 0})
            t["count"] += mult
            t["bytes"] += mult * s.bytes
        return out

    def totals_by_axis(self) -> dict[tuple[str, tuple[str, ...]], dict[str, int]]:
        out: dict = {}
        for s, mult in self.collectives():
            t = out.setdefault((s.kind, s.axes), {"count": 0, "bytes": 0})
            t["count"] += mult
            t["bytes"] += mult * s.bytes
        return out

    def flops(self) -> int:
        total = 0
        for s in self.steps:
            if s.kind == "repeat":
                total += s.args["plan"].flops() * s.args["times"]
            else:
                total += s.flops
        return total

    def signature(self) -> str:
        """A hash of everything that must agree across ranks (steps, shapes, collectives)."""
        h = hashlib.sha256()
        h.update(f"{self.mesh}|{self.layout}".encode())
        for s in self.steps:
            h.update(f"{s.kind}|{s.op}|{s.label}|{s.ins}|{s.outs}|{s.axes}|{s.bytes}|".encode())
            for k in sorted(k for k in s.args if k in ("dim", "op", "offset", "wrap", "times")):
                h.update(f"{k}={s.args[k]}".encode())
            if s.kind == "repeat":
                h.update(s.args["plan"].signature().encode())
        for v in self.values.values():
            h.update(f"{v.id}:{v.shape}:{v.dtype}:{v.sharding}".encode())
        return h.hexdigest()[:16]
