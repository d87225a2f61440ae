"""A communicator that holds every rank of the mesh in one process.

Collectives are computed exactly from the group members' tensors, reducing in
group order, so results are deterministic and match what real processes get.
"""
from __future__ import annotations

import torch

from ..layout.mesh import Mesh
from .comm import Communicator

_REDUCE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def _fold(xs, group, op):
    """Reduce the group's tensors with ``op`` in group order (deterministic)."""
    acc = xs[group[0]]
    for r in group[1:]:
        acc = _REDUCE[op](acc, xs[r])
    return acc


class SimulatedComm(Communicator):
    """All ranks of ``mesh`` in this process; ``xs[i]`` belongs to rank ``i``."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.ranks = tuple(range(mesh.size))
        self.log: list[tuple[str, tuple[str, ...], int]] = []

    def _groups(self, axes):
        return self.mesh.groups(tuple(axes))

    def _record(self, kind, axes, xs):
        self.log.append((kind, tuple(axes), xs[0].numel() * xs[0].element_size()))

    def all_reduce(self, xs, axes, op):
        self._record("allreduce", axes, xs)
        out = list(xs)
        for g in self._groups(axes):
            acc = _fold(xs, g, op)
            for r in g:
                out[r] = acc
        return out

    def all_gather(self, xs, axes, dim):
        self._record("allgather", axes, xs)
        out = list(xs)
        for g in self._groups(axes):
            full = torch.cat([xs[r] for r in g], dim=dim)
            for r in g:
                out[r] = full
        return out

    def all_to_all(self, xs, axes, split_dim, concat_dim):
        self._record("alltoall", axes, xs)
        out = list(xs)
        for g in self._groups(axes):
            chunks = {r: xs[r].chunk(len(g), dim=split_dim) for r in g}
            for j, r in enumerate(g):
                out[r] = torch.cat([chunks[s][j] for s in g], dim=concat_dim)
        return out

    def reduce_scatter(self, xs, axes, dim, op):
        self._record("reduce_scatter", axes, xs)
        out = list(xs)
        for g in self._groups(axes):
            acc = _fold(xs, g, op)
            for j, r in enumerate(g):
                out[r] = acc.chunk(len(g), dim=dim)[j].contiguous()
        return out

    def permute(self, xs, axes, offset, wrap):
        self._record("permute", axes, xs)
        out: list = [None] * len(xs)
        for g in self._groups(axes):
            n = len(g)
            for j, r in enumerate(g):
                src = j - offset
                if wrap:
                    src %= n
                elif not 0 <= src < n:
                    continue
                out[r] = xs[g[src]]
        return out
