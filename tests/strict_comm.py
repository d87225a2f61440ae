"""The simulated mesh, checking each collective's parts as real processes need them.

:class:`~meshdsl.comm.simulated.SimulatedComm` joins whatever each member holds, so a plan
whose members hold parts of lengths the step does not say still runs there.  gloo and NCCL
move parts of one length, taken from the caller's own tensor (``comm/torch_collectives.py``
pads only the lengths a step's ``uneven`` arg gives): there such a plan gathers garbage or
crashes.  :class:`StrictComm` raises where a collective's parts differ from what a real rank
would assume, so one process shows what a ``--nproc`` run would do to the plan.
"""
from __future__ import annotations

from meshdsl.collectives import parts_of
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.lowering.pipeline import MB_AXIS


class PartsMismatch(AssertionError):
    """A collective whose members' parts a real communicator would move wrongly."""


class StrictComm(SimulatedComm):
    """:class:`SimulatedComm`, checking the shapes each collective's members hand in."""

    def view(self, ranks) -> "StrictComm":
        return StrictComm(self.mesh, ranks, mailbox=self.mailbox, log=self.log, device=self.device)

    def collective(self, kind, xs, axes, args):
        check_collective(self, kind, xs, axes, args)
        return super().collective(kind, xs, axes, args)


def check_collective(comm: SimulatedComm, kind, xs, axes, args) -> None:
    """Raises :class:`PartsMismatch` where real ranks would run this collective of ``comm``'s
    held ranks otherwise than the simulated mesh does."""
    if MB_AXIS in axes and kind != "allreduce" and kind not in ("send", "recv"):
        raise PartsMismatch(f"{kind} over {tuple(axes)}: a real rank holds all its micro-batches and folds "
                            "only sums over them (comm/microbatch.py)")
    if MB_AXIS in axes and kind == "allreduce" and len(comm.ranks) % comm.mesh.sizes[MB_AXIS]:
        raise PartsMismatch(f"allreduce over {tuple(axes)} on a view of {len(comm.ranks)} micro-batch ranks: a "
                            "real rank folds all its micro-batches at once (comm/microbatch.py)")
    if kind == "recv":   # a real rank receives into a buffer of its plan's local shape (the template)
        for r, like in zip(comm.ranks, xs):
            got = comm.mailbox.get((r, args["tag"]))
            if got is not None and like is not None and (got.shape, got.dtype) != (like.shape, like.dtype):
                raise PartsMismatch(f"recv (tag {args['tag']}) on rank {r}: sent {tuple(got.shape)} {got.dtype}, "
                                    f"the receiver's plan expects {tuple(like.shape)} {like.dtype}")
    if kind in ("allgather", "reduce_scatter", "alltoall", "allreduce"):
        held = dict(zip(comm.ranks, xs))
        for g in comm.mesh.groups(tuple(axes)):
            if all(r in held and held[r] is not None for r in g):
                check_parts(kind, [tuple(held[r].shape) for r in g], parts_of(args, comm.mesh, g, axes), args)


def check_parts(kind: str, shapes: list, lengths: dict, args) -> None:
    """What a real communicator assumes of a group's parts (``lengths``: dim position -> each
    member's length, from the step's ``uneven`` arg)."""
    n = len(shapes)
    joined = args["dim"] if kind == "allgather" else args.get("concat_dim")   # each member's own part
    if joined is not None and joined in lengths:
        if [s[joined] for s in shapes] != list(lengths[joined]):
            raise PartsMismatch(f"{kind}: members hold {[s[joined] for s in shapes]} along dim {joined}, "
                                f"the step says {lengths[joined]}")
        shapes = [s[:joined] + (0,) + s[joined + 1:] for s in shapes]
    if len(set(shapes)) > 1:
        raise PartsMismatch(f"{kind} (no given lengths where they differ): members hand in shapes {shapes}")
    if kind == "allgather":
        return
    cut = args["dim"] if kind == "reduce_scatter" else args.get("split_dim")
    if cut is not None:
        if cut in lengths and sum(lengths[cut]) != shapes[0][cut]:
            raise PartsMismatch(f"{kind}: dim {cut} of {shapes[0][cut]} cut at {lengths[cut]}")
        if cut not in lengths and shapes[0][cut] % n:
            raise PartsMismatch(f"{kind}: dim {cut} of {shapes[0][cut]} cut into {n} equal parts")
