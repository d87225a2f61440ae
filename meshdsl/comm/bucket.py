"""Running a bucket: several values reduced (or gathered, or moved) in one flat buffer.

A ``bucket_allreduce``, ``bucket_reduce_scatter``, ``bucket_allgather`` or ``bucket_permute``
step (made by :mod:`meshdsl.lowering.bucket` and :mod:`meshdsl.lowering.coalesce`) has one
input and one output per member; the collective rule of :mod:`.steps` hands such steps to
:func:`prepare_bucket`.  Per held rank the rule packs the members into one 1-D buffer
(:func:`packing` says how, and how its result is cut up), starts the
collective on it (asynchronously where the communicator can), and gives each
output a handle that unpacks its piece when first read, so a reader waits for
the bucket no earlier than it needs one of its members.
"""
from __future__ import annotations

import torch

from .communicator import Pending


def unpack(flat: torch.Tensor, numels, shapes) -> list[torch.Tensor]:
    """``flat`` cut into pieces of ``numels`` elements, viewed as ``shapes`` (no copy)."""
    return [p.view(shape) for p, shape in zip(torch.split(flat.reshape(-1), numels), shapes)]


def unpack_gathered(flat: torch.Tensor, numels, shapes, num_parts: int, dims) -> list[torch.Tensor]:
    """An allgather bucket's result ``flat`` (each member of the group's packed buffer, one row
    after another) cut into its members' gathered tensors of ``numels`` elements and ``shapes``:
    member ``k``'s part from every row, joined along ``dims[k]`` in row order, as an allgather of
    member ``k`` alone joins them (a copy, no arithmetic: the same bits)."""
    rows, out, at = flat.reshape(num_parts, -1), [], 0
    for numel, shape, dim in zip(numels, shapes, dims):
        part, width = list(shape), numel // num_parts
        part[dim] //= num_parts
        out.append(rows[:, at:at + width].reshape(num_parts, *part).movedim(0, dim).reshape(shape))
        at += width
    return out


class _Unpacked:
    """The bucket's result, cut into the members' tensors on first use; ``layouts``: per held
    rank, its members' ``(numels, shapes)``; ``cut(flat, numels, shapes)`` cuts (:func:`unpack`)."""

    __slots__ = ("pending", "layouts", "parts", "cut")

    def __init__(self, pending, layouts, cut=unpack):
        self.pending, self.layouts, self.parts, self.cut = pending, layouts, None, cut

    def part(self, k: int) -> list:
        if self.parts is None:
            flats = self.pending.wait()
            self.pending = None
            # (a permute's rank with no sender received nothing: None for each member)
            self.parts = [[None] * len(numels) if flat is None else self.cut(flat, numels, shapes)
                          for flat, (numels, shapes) in zip(flats, self.layouts)]
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


def pack_allreduce(xs, num_chunks, dims, cuts=()):
    return pack(xs)


def pack_reduce_scatter(xs, num_chunks, dims, cuts=()):
    """Chunk-major: every member's chunk 0, then every member's chunk 1, ...; a member with
    lengths in ``cuts`` (split unevenly: the bucket step's ``cuts`` arg) is cut at those."""
    chunks = [x.split(list(c), d) if c else x.chunk(num_chunks, d)
              for x, d, c in zip(xs, dims, cuts or [()] * len(xs))]
    return torch.cat([c[j].reshape(-1) for j in range(num_chunks) for c in chunks])


def packing(kind: str, num_chunks: int, dims):
    """``(pack, cut)`` of bucket kind ``kind`` over a group of ``num_chunks`` whose members run
    along ``dims`` (a reduce-scatter's and an allgather's): ``pack(xs, num_chunks, dims, cuts)``
    makes a held rank's flat buffer, ``cut(flat, numels, shapes)`` its result's members (an
    allreduce's and a permute's buffer is their members one after another, and so is their result)."""
    if kind == "bucket_allgather":
        return pack_allreduce, lambda flat, numels, shapes: unpack_gathered(flat, numels, shapes, num_chunks, dims)
    return (pack_reduce_scatter if kind == "bucket_reduce_scatter" else pack_allreduce), unpack


def start_packed(comm, s, flats, numels, shapes) -> list[Pending]:
    """Start bucket step ``s`` on ``flats`` (one packed 1-D buffer per held rank); a handle per
    member.  An allreduce bucket reduces the buffers in place where the communicator can."""
    return start_packed_each(comm, s, flats, [(numels, shapes)] * len(flats))


def start_packed_each(comm, s, flats, layouts, cut=unpack) -> list[Pending]:
    """:func:`start_packed` with each held rank's own ``(numels, shapes)`` in ``layouts``: a
    member split unevenly has another local shape on another group of ranks; ``cut``: as
    :func:`packing` gives it."""
    whole = _Unpacked(comm.start(s.kind, flats, s.axes, s.args), layouts, cut)
    return [_Member(whole, k) for k in range(len(s.outs))]


def bucket_members(plan, s, rank: int | None = None) -> tuple[list[int], list]:
    """The element counts and local shapes of bucket step ``s``'s members on ``rank``, in order
    (without a rank: the largest local shapes, every rank's when no member is split unevenly)."""
    mesh = plan.mesh
    shapes = [plan.values[v].local_shape(mesh, rank) for v in s.outs]
    return [int(torch.Size(shape).numel()) for shape in shapes], shapes
