"""The simulated mesh: every rank in one process.

:class:`SimulatedComm` computes each collective exactly from the group
members' tensors (the simulated implementations of
:mod:`meshdsl.collectives`, reducing in group order), so results are
deterministic and match what real processes get; each collective's parts are first checked
as real ranks would hand them in (:mod:`.real_parts`), so a plan that only the simulated
mesh could run fails here too.  :func:`meshdsl.runtime.simulated.run_simulated`
runs a whole plan on it and returns full outputs.
"""
from __future__ import annotations


from ..collectives import COLLECTIVES, parts_of
from ..errors import GraphError, MeshError, message
from ..layout.mesh import Mesh
from .communicator import Communicator, as_device
from .real_parts import check_collective


class SimulatedComm(Communicator):
    """Ranks of ``mesh`` in this process; ``xs[i]`` belongs to ``ranks[i]`` (default: every rank).

    Point-to-point sends leave their tensors in :attr:`mailbox` (keyed by destination
    rank and tag) and receives take them out, so the two ends of a transfer may run
    at different times, on different views (:meth:`view`).
    """

    def __init__(self, mesh: Mesh, ranks=None, *, mailbox: dict | None = None, log: list | None = None,
                 device=None):
        if isinstance(mesh, str):  # "data:2; model:2", as md.compile takes it
            mesh = Mesh.parse(mesh)
        if not isinstance(mesh, Mesh):
            raise MeshError(message(f"SimulatedComm: mesh is {mesh!r} ({type(mesh).__name__}), not a Mesh.",
                                    rule="a communicator holds the ranks of one mesh",
                                    fix="pass plan.mesh, md.Mesh.parse('data:2') or the mesh string 'data:2'"))
        self.mesh = mesh
        self.device = as_device(device)
        self.ranks = tuple(range(mesh.size)) if ranks is None else tuple(ranks)
        self.log: list[tuple[str, tuple[str, ...], int]] = [] if log is None else log
        self.mailbox: dict = {} if mailbox is None else mailbox
        self._held = frozenset(self.ranks)

    def view(self, ranks) -> "SimulatedComm":
        """A communicator holding only ``ranks`` (e.g. one pipeline stage), sharing mailbox and log."""
        return SimulatedComm(self.mesh, ranks, mailbox=self.mailbox, log=self.log, device=self.device)

    def collective(self, kind, xs, axes, args):
        """See :meth:`Communicator.collective`; every call is appended to :attr:`log`."""
        check_collective(self, kind, xs, axes, args)   # as real ranks would move them (real_parts.py)
        c = COLLECTIVES[kind]
        if c.mailbox == "take":
            n, off = self.mesh.axis_size(axes), args["offset"]
            try:  # a member with no sender (the first stage, for offset 1) gets None
                xs = [self.mailbox.pop((r, args["tag"])) if 0 <= self.mesh.index_along(r, axes) - off < n
                      else None for r in self.ranks]
            except KeyError as e:
                raise GraphError(message(f"recv (tag {args['tag']}): nothing was sent to rank {e.args[0][0]}.",
                                         rule="a receive runs after its send",
                                         fix="run the sending step first")) from None
        x0 = next((x for x in xs if x is not None), None)
        self.log.append((kind, tuple(axes), 0 if x0 is None else x0.numel() * x0.element_size()))
        groups = self.mesh.groups(tuple(axes))
        if len(self.ranks) == self.mesh.size:
            full = list(xs)
        else:
            full = [None] * self.mesh.size
            for r, x in zip(self.ranks, xs):
                full[r] = x
            groups = tuple(g for g in groups if self._held.intersection(g))
            assert c.point_to_point or all(self._held.issuperset(g) for g in groups), \
                f"{kind} over {axes} needs ranks this view does not hold"
        if args.get("uneven"):  # parts of unequal length: each group's lengths (collectives.parts_of)
            args = {**args, "parts": tuple(parts_of(args, self.mesh, g, axes) for g in groups)}
        out = c.simulated(full, groups, args)
        if c.mailbox == "put":
            for r, y in enumerate(out):
                if y is not None:
                    self.mailbox[(r, args["tag"])] = y
            return [None] * len(self.ranks)
        return [out[r] for r in self.ranks]
