"""The collective kinds: one table that plans, cost models and communicators read.

Each :class:`Collective` says, for one kind of communication over mesh axes:

* the step args it reads (its schema, checked when a plan step is emitted);
* its cost: bytes on the wire per byte a rank sends, in a group of ``n``;
* whether it is point-to-point (a rank talks to one peer, not the whole group);
* what it computes: its reference implementation over every rank's tensor (the
  simulated mesh runs it);
* whether communicators may start it asynchronously, so the executor overlaps it
  with compute.

How a kind runs on real processes is the communicator's business
(:mod:`meshdsl.comm.torch_collectives` for torch.distributed, with shared memory
chosen there).  Adding a kind means one entry here and one there; plans, the cost
model, the executor, training-step stats and reports look kinds up in
:data:`COLLECTIVES` and need no change.

The simulated implementation takes ``(xs, groups, args)``: ``xs[r]`` is rank
``r``'s tensor and ``groups`` the mesh groups over the step's axes (each
ordered first axis major); it returns one tensor (or ``None``) per rank.
Simulated implementations index ``xs`` by global rank; a rank the
communicator does not hold has ``None`` there (a pipeline stage runs on a
communicator that holds only its own ranks).  They reduce in group order, as the
torch.distributed ones do, so results agree bit for bit except the backend's own allreduce sum.

A dim split unevenly (:mod:`meshdsl.layout.sharding`) has parts of unequal
length.  A step that joins or cuts such parts carries the ``uneven`` arg
(:func:`meshdsl.lowering.uneven.uneven_arg`); a communicator turns it into each
member's length (:func:`parts_of`) and hands the simulated implementation
``args["parts"]``, one ``{dim position: lengths}`` per group, so it joins and
cuts exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .layout.mesh import Mesh
from .layout.sharding import part_sizes

#: Reductions a collective may apply, as the fold the simulated mesh uses.
REDUCE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


@dataclass(frozen=True)
class Collective:
    """One collective kind; see the module docstring.

    Attributes:
      name: the step kind, e.g. ``"allreduce"``.
      args: the step args it reads, e.g. ``("op",)``.
      fraction: ``fraction(n)``: bytes on the wire per byte sent, group of ``n`` (ring algorithms).
      simulated: ``simulated(xs, groups, args) -> list``: the reference implementation.
      asynchronous: a communicator may start it and hand back a pending result.
      point_to_point: each rank exchanges with one peer rather than the whole group.
      mailbox: for one half of a point-to-point pair: ``"put"`` (a send: on the simulated
        mesh its results are left in the communicator's mailbox, keyed by destination rank
        and ``tag``) or ``"take"`` (a receive: its inputs are taken from there); None otherwise.
    """

    name: str
    args: tuple[str, ...]
    fraction: Callable[[int], float]
    simulated: Callable
    asynchronous: bool = False
    point_to_point: bool = False
    mailbox: str | None = None


COLLECTIVES: dict[str, Collective] = {}


def register(c: Collective) -> Collective:
    """Put ``c`` in :data:`COLLECTIVES` (replacing a kind of the same name)."""
    COLLECTIVES[c.name] = c
    return c


def parts_of(args, mesh: Mesh, members, axes) -> dict[int, tuple[int, ...]]:
    """Dim position -> each member's length along it, for a step over ``axes`` whose
    ``uneven`` arg names dims of unequal parts; ``{}`` for an even step.  An entry
    ``(position, size, above, lengths)`` gives the parts' lengths by the index along the one
    axis that splits the dim (a sharding's given parts, ``Sharding.parts``)."""
    axes = tuple(axes)
    out = {}
    for pos, size, above, *given in args.get("uneven") or ():
        out[pos] = (tuple(given[0][mesh.coords(r)[axes[-1]]] for r in members) if given
                    else part_sizes(size, mesh, members, tuple(above) + axes))
    return out


def cut(x, n: int, dim: int, lengths=None):
    """``x`` cut along ``dim`` into ``n`` parts: of ``lengths`` when given, else equal."""
    return x.split(list(lengths), dim=dim) if lengths else x.chunk(n, dim=dim)


def _group_parts(args, i: int) -> dict:
    """The ``{dim position: lengths}`` of group ``i`` (see the module docstring)."""
    parts = args.get("parts")
    return parts[i] if parts else {}


def _fold(xs, group, op):
    """Reduce the group's tensors with ``op`` in group order (deterministic)."""
    acc = xs[group[0]]
    for r in group[1:]:
        acc = REDUCE[op](acc, xs[r])
    return acc


# ----------------------------------------------------------------------------- allreduce

def _sim_allreduce(xs, groups, args):
    out = list(xs)
    for g in groups:
        acc = _fold(xs, g, args.get("op", "sum"))
        for r in g:
            out[r] = acc
    return out


register(Collective("allreduce", ("op",), lambda n: 2 * (n - 1) / n, _sim_allreduce, asynchronous=True))


# ----------------------------------------------------------------------------- allgather

def _sim_allgather(xs, groups, args):
    out = list(xs)
    for g in groups:
        full = torch.cat([xs[r] for r in g], dim=args["dim"])
        for r in g:
            out[r] = full
    return out


register(Collective("allgather", ("dim", "uneven"), lambda n: float(n - 1), _sim_allgather, asynchronous=True))


# ----------------------------------------------------------------------------- alltoall

def _sim_alltoall(xs, groups, args):
    out = list(xs)
    split = args["split_dim"]
    for i, g in enumerate(groups):
        lengths = _group_parts(args, i).get(split)
        chunks = {r: cut(xs[r], len(g), split, lengths) for r in g}
        for j, r in enumerate(g):
            out[r] = torch.cat([chunks[s][j] for s in g], dim=args["concat_dim"])
    return out


register(Collective("alltoall", ("split_dim", "concat_dim", "uneven"), lambda n: (n - 1) / n, _sim_alltoall))


# ----------------------------------------------------------------------------- reduce_scatter

def _sim_reduce_scatter(xs, groups, args):
    out = list(xs)
    for i, g in enumerate(groups):
        acc = _fold(xs, g, args.get("op", "sum"))
        chunks = cut(acc, len(g), args["dim"], _group_parts(args, i).get(args["dim"]))
        for j, r in enumerate(g):
            out[r] = chunks[j].contiguous()
    return out


register(Collective("reduce_scatter", ("dim", "op", "uneven"), lambda n: (n - 1) / n, _sim_reduce_scatter,
                    asynchronous=True))


# ----------------------------------------------------------------------------- buckets
# Several gradients reduced in one flat buffer (DDP's buckets): one call's latency and one
# kernel launch instead of one per gradient.  lowering/bucket.py (and coalesce.py, for an
# activation's small collectives made back to back) makes the steps; the
# executor's bucket rule (runtime/steps.py) packs the members into the buffer and unpacks the
# result, so the implementations below see one 1-D tensor per rank.  A reduce-scatter
# bucket is packed chunk-major (member j's chunks of every gradient, then member j+1's), so
# scattering the flat buffer along its only dim hands each member its chunk of every gradient.

def flat_args(args):
    """A bucket's args as its flat buffer's: reduce with its ``op`` along the only dim.  A
    reduce-scatter bucket of members split unevenly (``cuts``: each member's part lengths)
    cuts its buffer unevenly too: its ``uneven`` arg gives the flat parts' lengths, and the
    lengths a communicator worked out from it (``parts``, ``lengths``) go along."""
    return {"op": args.get("op", "sum"), "dim": 0,
            **{k: args[k] for k in ("uneven", "parts", "lengths") if args.get(k)}}


register(Collective("bucket_allreduce", ("op",), lambda n: 2 * (n - 1) / n, _sim_allreduce,
                    asynchronous=True))
register(Collective("bucket_reduce_scatter", ("op", "dims", "cuts", "uneven"), lambda n: (n - 1) / n,
                    lambda xs, groups, args: _sim_reduce_scatter(xs, groups, flat_args(args)), asynchronous=True))
# An allgather bucket (lowering/coalesce.py: activations' gathers made back to back) packs each
# rank's members' parts one after another; gathering the flat buffers along the only dim gives one
# row per member of the group, in group order, and the executor joins each member's parts from
# the rows along its own ``dims`` entry (:func:`meshdsl.comm.bucket.unpack_gathered`).
register(Collective("bucket_allgather", ("dims",), lambda n: float(n - 1),
                    lambda xs, groups, args: _sim_allgather(xs, groups, flat_args(args)), asynchronous=True))


# ----------------------------------------------------------------------------- permute

# Member j sends to member j + offset and receives from j - offset (modulo the group with
# ``wrap``); with ``reverse``, member j trades with member n - 1 - j instead (a flip of a split
# dim: lowering/flip.py), the middle member of an odd group keeping its own.

def _sim_permute(xs, groups, args):
    offset, wrap = args["offset"], args["wrap"]
    out: list = [None] * len(xs)
    for g in groups:
        n = len(g)
        for j, r in enumerate(g):
            src = n - 1 - j if args.get("reverse") else j - offset
            if wrap:
                src %= n
            elif not 0 <= src < n:
                continue
            out[r] = xs[g[src]]
    return out


register(Collective("permute", ("offset", "wrap", "reverse"), lambda n: 1.0, _sim_permute, point_to_point=True))
# Permutes of one offset made back to back (lowering/coalesce.py: a sliding window's key and value
# halos, both to the next rank) sent as one: each rank's members packed in one flat buffer, which
# moves as a permute does; a member with no sender gets ``None`` (comm/bucket.py).
register(Collective("bucket_permute", ("offset", "wrap", "reverse"), lambda n: 1.0, _sim_permute,
                    point_to_point=True))


# ----------------------------------------------------------------------------- send / recv
# Pipeline transfers: along the step's axis, member j sends to member j + offset, and
# member j receives from member j - offset.  A send is one plan step run by the
# senders, its recv another run by the receivers; ``tag`` pairs them.  On the simulated
# mesh the send leaves its tensors in the communicator's mailbox and the recv takes them
# out; on torch.distributed the send is an isend the communicator waits for later (so
# two stages sending to each other never block on each other), the recv an irecv that
# is posted, then waited on (``start`` posts it alone, for a pipeline that waits later).  One
# whose args ask for ``pipe`` (a pipeline's carry) takes the group's shared-memory channels
# where the communicator opened them (comm/shm_pipe.py).

def _sim_send(xs, groups, args):
    off = args["offset"]
    out: list = [None] * len(xs)
    for g in groups:
        for j, r in enumerate(g):
            if xs[r] is not None and 0 <= j + off < len(g):
                out[g[j + off]] = xs[r]
    return out


def _sim_recv(xs, groups, args):
    return list(xs)  # the communicator put the mailbox's tensors in xs


register(Collective("send", ("offset", "tag"), lambda n: 1.0, _sim_send, point_to_point=True, mailbox="put"))
register(Collective("recv", ("offset", "tag"), lambda n: 1.0, _sim_recv, asynchronous=True,
                    point_to_point=True, mailbox="take"))
