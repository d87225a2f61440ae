"""Running a gradient bucket: several values reduced in one flat buffer.

A ``bucket_allreduce`` or ``bucket_reduce_scatter`` step (made by
:mod:`meshdsl.lowering.bucket`) has one input and one output per member; the
collective rule of :mod:`.steps` hands such steps to :func:`prepare_bucket`.
Per held rank the rule packs the members into one 1-D buffer, starts the
collective on it (asynchronously where the communicator can), and gives each
output a handle that unpacks its piece when first read, so a reader waits for
the bucket no earlier than it needs one of its members.
"""
from __future__ import annotations

import torch

from .comm import Pending


def unpack(flat: torch.Tensor, numels, shapes) -> list[torch.Tensor]:
    """``flat`` cut into pieces of ``numels`` elements, viewed as ``shapes`` (no copy)."""
    return [p.view(shape) for p, shape in zip(torch.split(flat.reshape(-1), numels), shapes)]


class _Unpacked:
    """The bucket's result, cut into the members' tensors on first use."""

    __slots__ = ("pending", "numels", "shapes", "parts")

    def __init__(self, pending, numels, shapes):
        self.pending, self.numels, self.shapes, self.parts = pending, numels, shapes, None

    def part(self, k: int) -> list:
        if self.parts is None:
            flats = self.pending.wait()
            self.pending = None
            self.parts = [unpack(flat, self.numels, self.shapes) for flat in flats]
        return [parts[k] for parts in self.parts]


class _Member(Pending):
    """Member ``k`` of a bucket in flight."""

    __slots__ = ("whole", "k")

    def __init__(self, whole: _Unpacked, k: int):
        self.whole, self.k = whole, k

    def wait(self):
        return self.whole.part(self.k)


def pack(xs) -> torch.Tensor:
    """``xs`` flattened into one 1-D buffer, in order."""
    return torch.cat([x.reshape(-1) for x in xs])


def _pack_allreduce(xs, num_chunks, dims):
    return pack(xs)


def _pack_reduce_scatter(xs, num_chunks, dims):
    # chunk-major: every member's chunk 0, then every member's chunk 1, ...
    chunks = [x.chunk(num_chunks, d) for x, d in zip(xs, dims)]
    return torch.cat([c[j].reshape(-1) for j in range(num_chunks) for c in chunks])


def bucket_members(ex, s) -> tuple[list[int], list]:
    """The element counts and local shapes of bucket step ``s``'s members, in order."""
    mesh = ex.plan.mesh
    shapes = [ex.plan.values[v].local_shape(mesh) for v in s.outs]
    return [int(torch.Size(shape).numel()) for shape in shapes], shapes


def start_packed(comm, s, flats, numels, shapes) -> list[Pending]:
    """Start bucket step ``s`` on ``flats`` (one packed 1-D buffer per held rank); a handle per
    member.  An allreduce bucket reduces the buffers in place where the communicator can."""
    whole = _Unpacked(comm.start(s.kind, flats, s.axes, s.args), numels, shapes)
    return [_Member(whole, k) for k in range(len(s.outs))]


def prepare_bucket(ex, i, s):
    """The executor's call for bucket step ``s`` (the collective rule hands buckets here)."""
    comm, ins, outs = ex.comm, s.ins, s.outs
    numels, shapes = bucket_members(ex, s)
    pack = _pack_allreduce if s.kind == "bucket_allreduce" else _pack_reduce_scatter
    num_chunks, dims = ex.plan.mesh.axis_size(s.axes), s.args.get("dims", ())

    def call(env, get, run):
        members = [get(v) for v in ins]
        flats = [pack([m[j] for m in members], num_chunks, dims) for j in range(len(comm.ranks))]
        for vid, member in zip(outs, start_packed(comm, s, flats, numels, shapes)):
            env[vid] = member
    return call
