"""How one tensor is laid out on the mesh: which axes split each dim, which are partial.

A :class:`Sharding` maps every dim of a tensor (by name) to the tuple of mesh
axes that split it, first axis major, plus the axes over which the local
values are still *partial sums* (Mesh-TF's lazy allreduce).

A dim its axes do not divide is split unevenly, as ``torch.tensor_split`` cuts:
each axis, first to last, cuts the part the axes before it left into parts whose
sizes differ by at most one, the first ``size % n`` of them one longer
(:func:`chunk`).  Cutting axis by axis keeps every re-layout exact: a re-layout
only adds or removes axes at a dim's minor end, so the parts a collective joins
or cuts are always the parts of one axis's cut.  Every part has ``floor`` or
``ceil`` of ``size / n`` elements (``n`` the axes' product), so the largest local
shape (:meth:`Sharding.local_shape` without a rank) is the ceiling on every dim.

A dim split over one axis may instead have given part lengths (``Sharding.parts``): a
pipeline whose stages run unequal numbers of layers stores each stage's layers where it
runs them (``lowering/stage_layers.py``).  Collectives that join or cut such a dim carry
the lengths (``collectives.parts_of``).

A dim split over one axis of size p may instead be split block-cyclically (``Sharding.cyclic``):
cut into ``p * v`` equal blocks, the rank at index i of the axis holds blocks i, i + p, ..,
i + (v - 1) p, one after another.  An interleaved pipeline stores each rank's layer chunks so
(``lowering/interleave.py``).  A rank's part is then ``v`` regions of the full tensor
(:meth:`Sharding.regions`); gathers put the blocks back in order (:func:`cyclic_order`).  The
blocks may have given, unequal lengths (``Sharding.blocks``: an interleaved pipeline whose
virtual stages run unequal numbers of layers); each rank's part length, the sum of its blocks,
is then its given part (``Sharding.parts``), which collectives carry as for unequal stages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from ..core.shape import Shape
from .mesh import Mesh


def chunk(size: int, mesh: Mesh, rank: int, axes) -> tuple[int, int]:
    """``(offset, length)`` of ``rank``'s part of a dim of ``size`` split over ``axes``.

    Each axis, first (major) to last, cuts the part left so far into
    ``mesh.sizes[axis]`` parts as ``torch.tensor_split`` does; with every axis
    dividing what it cuts, this is ``index * size // n``, the even split.
    """
    off, n = 0, size
    if axes:
        coords = mesh.coords(rank)
        for a in axes:
            q, r = divmod(n, mesh.sizes[a])
            i = coords[a]
            off += i * q + min(i, r)
            n = q + (i < r)
    return off, n


def part_sizes(size: int, mesh: Mesh, members, axes) -> tuple[int, ...]:
    """The length of each member's part of a dim of ``size`` split over ``axes`` (see :func:`chunk`)."""
    return tuple(chunk(size, mesh, r, axes)[1] for r in members)


def cyclic_order(size: int, p: int, v: int, lengths=None) -> list[int]:
    """For a dim of ``size`` split block-cyclically over ``p`` ranks, ``v`` blocks each (of
    ``lengths``, the ``p * v`` blocks' lengths in the dim's order, when not equal): the
    position, in the ranks' local parts joined in rank order, of each global index."""
    lengths = block_lengths(size, p, v, lengths)
    at, start = 0, [0] * (p * v)   # each block's position in the joined parts
    for i in range(p):
        for c in range(v):
            start[c * p + i], at = at, at + lengths[c * p + i]
    return [start[b] + j for b in range(p * v) for j in range(lengths[b])]


def block_lengths(size: int, p: int, v: int, lengths=None) -> tuple[int, ...]:
    """The lengths of the ``p * v`` blocks of a block-cyclic dim of ``size``: ``lengths`` when
    given, else equal."""
    return tuple(lengths) if lengths else (size // (p * v),) * (p * v)


def is_even(size: int, mesh: Mesh, axes) -> bool:
    """Whether ``axes`` split a dim of ``size`` into parts of one length."""
    return size % mesh.axis_size(tuple(axes)) == 0


@dataclass(frozen=True)
class Sharding:
    """``dims``: ((dim_name, axes), ...) in the tensor's dim order; ``partial``: axes."""

    dims: tuple[tuple[str, tuple[str, ...]], ...]
    partial: tuple[str, ...] = ()
    #: ((dim_name, lengths), ...): given part lengths of dims split over one axis, by the axis's
    #: index (the other dims are cut as :func:`chunk` does)
    parts: tuple[tuple[str, tuple[int, ...]], ...] = ()
    #: ((dim_name, v), ...): dims split over one axis block-cyclically, ``v`` blocks per rank
    #: (see the module docstring)
    cyclic: tuple[tuple[str, int], ...] = ()
    #: ((dim_name, lengths), ...): a block-cyclic dim's given block lengths, ``p * v`` of them in
    #: the dim's order (its :attr:`parts` then hold each rank's total, the sum of its blocks)
    blocks: tuple[tuple[str, tuple[int, ...]], ...] = ()

    # Shardings key the compiler's caches (choices, prices, held copies): the hash is worked out
    # once per instance, the dataclass's own value, and left out of a pickle (a string's hash
    # differs between processes).
    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash((self.dims, self.partial, self.parts, self.cyclic, self.blocks))
        return h

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        return (self.dims == other.dims and self.partial == other.partial and self.parts == other.parts
                and self.cyclic == other.cyclic and self.blocks == other.blocks)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    @staticmethod
    def replicated(shape: Shape) -> "Sharding":
        return Sharding(tuple((n, ()) for n in shape.names))

    @staticmethod
    def of(shape: Shape, split: dict[str, tuple[str, ...]], partial=()) -> "Sharding":
        return Sharding(tuple((n, tuple(split.get(n, ()))) for n in shape.names), tuple(partial))

    @cached_property
    def split(self) -> dict[str, tuple[str, ...]]:
        return {n: a for n, a in self.dims if a}

    def axes_of(self, name: str) -> tuple[str, ...]:
        return self.split.get(name, ())

    @cached_property
    def used_axes(self) -> frozenset[str]:
        return frozenset(a for _, axes in self.dims for a in axes) | frozenset(self.partial)

    def with_partial(self, partial) -> "Sharding":
        return Sharding(self.dims, tuple(partial), self.parts, self.cyclic, self.blocks)

    @cached_property
    def given_parts(self) -> dict[str, tuple[int, ...]]:
        """Dim name -> its given part lengths (see :attr:`parts`)."""
        return dict(self.parts)

    def with_parts(self, name: str, lengths) -> "Sharding":
        """This sharding with dim ``name`` (split over one axis) cut into parts of ``lengths``."""
        assert len(self.axes_of(name)) == 1, f"given parts of '{name}' need one axis, not {self.axes_of(name)}"
        assert name not in self.cyclic_blocks, f"'{name}' is block-cyclic: its blocks' lengths go to with_cyclic"
        return Sharding(self.dims, self.partial,
                        tuple((n, p) for n, p in self.parts if n != name) + ((name, tuple(lengths)),), self.cyclic,
                        self.blocks)

    @cached_property
    def cyclic_blocks(self) -> dict[str, int]:
        """Dim name -> its blocks per rank, where split block-cyclically (see :attr:`cyclic`)."""
        return dict(self.cyclic)

    @cached_property
    def given_blocks(self) -> dict[str, tuple[int, ...]]:
        """Dim name -> its blocks' given lengths, where block-cyclic with unequal blocks (see :attr:`blocks`)."""
        return dict(self.blocks)

    def with_cyclic(self, name: str, v: int, lengths=None) -> "Sharding":
        """This sharding with dim ``name`` (split over one axis) split block-cyclically, ``v``
        blocks per rank; ``v = 1``: one block per rank, the even split.

        ``lengths``: the ``p * v`` blocks' lengths in the dim's order, when not equal (with
        ``v = 1``: each rank's part, as :meth:`with_parts`)."""
        assert len(self.axes_of(name)) == 1, name
        cyclic = tuple((n, b) for n, b in self.cyclic if n != name) + (((name, v),) if v > 1 else ())
        parts = tuple((n, p) for n, p in self.parts if n != name)
        blocks = tuple((n, b) for n, b in self.blocks if n != name)
        if lengths is not None:
            lengths = tuple(lengths)
            p = len(lengths) // v
            assert p * v == len(lengths), f"{len(lengths)} block lengths for {v} blocks per rank"
            parts += ((name, tuple(sum(lengths[c * p + i] for c in range(v)) for i in range(p))),)
            blocks += ((name, lengths),) if v > 1 else ()
        return Sharding(self.dims, self.partial, parts, cyclic, blocks)

    def regions(self, shape: Shape, mesh: Mesh, rank: int) -> tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...]:
        """``rank``'s part of the full tensor as ``(index in the full tensor, index in the local
        one)`` pairs: one pair, but one per block of a block-cyclic dim."""
        if not self.cyclic:
            idx = self.slice_index(shape, mesh, rank)
            return ((idx, tuple(slice(0, s.stop - s.start) for s in idx)),)
        out = [((), ())]
        for d in shape:
            v = self.cyclic_blocks.get(d.name)
            if v is None:
                off, n = self._chunk(d.size, d.name, mesh, rank)
                cuts = [(slice(off, off + n), slice(0, n))]
            else:
                cuts = self._blocks_of(d.size, d.name, v, mesh, rank)
            out = [(g + (cg,), loc + (cl,)) for g, loc in out for cg, cl in cuts]
        return tuple(out)

    def _blocks_of(self, size: int, name: str, v: int, mesh: Mesh, rank: int) -> list[tuple[slice, slice]]:
        """``rank``'s blocks of block-cyclic dim ``name``: ``(index in the full dim, in the local one)``."""
        axis = self.axes_of(name)[0]
        p, i = mesh.sizes[axis], mesh.coords(rank)[axis]
        lengths = block_lengths(size, p, v, self.given_blocks.get(name) if self.blocks else None)
        cuts, at = [], 0
        for c in range(v):
            b = c * p + i
            start = sum(lengths[:b])
            cuts.append((slice(start, start + lengths[b]), slice(at, at + lengths[b])))
            at += lengths[b]
        return cuts

    def _chunk(self, size: int, name: str, mesh: Mesh, rank: int) -> tuple[int, int]:
        """``(offset, length)`` of ``rank``'s part of dim ``name`` (see :func:`chunk`)."""
        lengths = self.given_parts.get(name) if self.parts else None
        if lengths is None:
            return chunk(size, mesh, rank, self.axes_of(name))
        i = mesh.coords(rank)[self.axes_of(name)[0]]
        return sum(lengths[:i]), lengths[i]

    def local_shape(self, shape: Shape, mesh: Mesh, rank: int | None = None) -> tuple[int, ...]:
        """``rank``'s local shape; without a rank the largest one (every rank's when the split is even)."""
        if rank is not None:
            if self.parts:
                return tuple(self._chunk(d.size, d.name, mesh, rank)[1] for d in shape)
            split = self.split   # (the hot path: a dim no axis splits is whole)
            return tuple(chunk(d.size, mesh, rank, split[d.name])[1] if d.name in split else d.size
                         for d in shape)
        if self.parts:
            given = self.given_parts
            return tuple(max(given[d.name]) if d.name in given else -(-d.size // mesh.axis_size(self.axes_of(d.name)))
                         for d in shape)
        split = self.split   # (the hot path, as above)
        return tuple(-(-d.size // mesh.axis_size(split[d.name])) if d.name in split else d.size for d in shape)

    def offsets(self, shape: Shape, mesh: Mesh, rank: int) -> tuple[int, ...]:
        assert not self.cyclic, f"{self}: a block-cyclic dim has several offsets per rank (Sharding.regions)"
        return tuple(self._chunk(d.size, d.name, mesh, rank)[0] for d in shape)

    def slice_index(self, shape: Shape, mesh: Mesh, rank: int) -> tuple[slice, ...]:
        """The index of this rank's slice in the full tensor (dims in ``shape`` order); a
        block-cyclic dim has several (:meth:`regions`)."""
        assert not self.cyclic, f"{self}: a block-cyclic dim has several regions per rank (Sharding.regions)"
        return tuple(slice(off, off + n) for off, n in
                     (self._chunk(d.size, d.name, mesh, rank) for d in shape))

    def local_numel(self, shape: Shape, mesh: Mesh) -> int:
        """Elements of the largest local slice (what costs and memory reports count)."""
        return math.prod(self.local_shape(shape, mesh))

    def __str__(self) -> str:
        given = self.given_parts if self.parts else {}
        blocks = self.given_blocks if self.blocks else {}
        parts = [f"{n}:{'(' + ','.join(a) + ')' if len(a) > 1 else a[0]}"
                 + (f"[{','.join(map(str, given[n]))}]" if n in given and n not in blocks else "")
                 + (f"[cyclic {self.cyclic_blocks[n]}]" if self.cyclic and n in self.cyclic_blocks else "")
                 + (f"[blocks {','.join(map(str, blocks[n]))}]" if n in blocks else "")
                 for n, a in self.dims if a]
        s = "{" + ", ".join(parts) + "}"
        if self.partial:
            s += f" partial({','.join(self.partial)})"
        return s
