"""What real ranks need of each collective's parts, checked on the simulated mesh.

:class:`~.simulated.SimulatedComm` joins whatever each member holds, so a plan whose members
hold parts of lengths its step does not give would still run there.  gloo and NCCL move parts
of one length, taken from each caller's own tensor (:mod:`.torch_collectives` pads only the
lengths a step's ``uneven`` arg gives): on real processes that plan gathers garbage or
crashes.  :func:`check_collective` runs before every simulated collective and raises where a
member hands in what a real rank would move otherwise, so ``meshdsl check`` and every
simulated test show in one process what a ``--nproc`` run would do to the plan.
"""
from __future__ import annotations

from ..collectives import flat_args, parts_of
from ..errors import GraphError, message
from ..lowering.pipeline import MB_AXIS

#: bucket kind -> the kind its flat buffer runs as
FLAT = {"bucket_allreduce": "allreduce", "bucket_reduce_scatter": "reduce_scatter", "bucket_allgather": "allgather"}


def check_collective(comm, kind, xs, axes, args) -> None:
    """Raise where real ranks would run this collective of ``comm``'s held ranks (``xs``, one per
    held rank) otherwise than the simulated mesh does."""
    if MB_AXIS in axes and kind not in ("allreduce", "send", "recv") and not mb_gather_ok(kind, axes, args):
        _mismatch(kind, axes, "a real rank holds all its micro-batches: it folds sums over them, and joins "
                              "them (an even allgather with the micro-batch axis first or last)")
    if MB_AXIS in axes and kind in ("allreduce", "allgather") and len(comm.ranks) % comm.mesh.sizes[MB_AXIS]:
        _mismatch(kind, axes, f"a view of {len(comm.ranks)} micro-batch ranks: a real rank folds or joins all "
                              "its micro-batches at once")
    if kind == "recv":   # a real rank receives into a buffer of its plan's local shape (the template)
        for r, like in zip(comm.ranks, xs):
            got = comm.mailbox.get((r, args["tag"]))
            if got is not None and like is not None and (got.shape, got.dtype) != (like.shape, like.dtype):
                _mismatch(kind, axes, f"rank {r} was sent {tuple(got.shape)} {got.dtype}, its plan expects "
                                      f"{tuple(like.shape)} {like.dtype}")
    if kind in FLAT:   # a gradient bucket: its one flat buffer per rank, cut as its args say
        kind, args = FLAT[kind], flat_args(args)
    if kind in ("allgather", "reduce_scatter", "alltoall", "allreduce"):
        held = dict(zip(comm.ranks, xs))
        for g in comm.mesh.groups(tuple(axes)):
            if all(r in held and held[r] is not None for r in g):
                why = parts_problem(kind, [tuple(held[r].shape) for r in g], parts_of(args, comm.mesh, g, axes),
                                    args)
                if why:
                    _mismatch(kind, axes, why)


def mb_gather_ok(kind, axes, args) -> bool:
    """Whether a real rank holding all its micro-batches runs collective ``kind`` over ``axes``
    (with the micro-batch axis) by joining them locally (:class:`~.microbatch.MicrobatchComm`):
    an even allgather whose micro-batch axis is first (each micro-batch gathered over the real
    axes, then joined) or last (joined, then gathered)."""
    return kind == "allgather" and not args.get("uneven") and MB_AXIS in (axes[0], axes[-1])


def parts_problem(kind: str, shapes: list, lengths: dict, args) -> str | None:
    """Why real ranks would move a group's parts (``shapes``, in group order) otherwise than the
    simulated mesh, or None; ``lengths``: dim position -> each member's length, from the step's
    ``uneven`` arg."""
    n = len(shapes)
    joined = args["dim"] if kind == "allgather" else args.get("concat_dim")   # each member's own part
    if joined is not None and joined in lengths:
        if [s[joined] for s in shapes] != list(lengths[joined]):
            return f"members hold {[s[joined] for s in shapes]} along dim {joined}, the step gives {lengths[joined]}"
        shapes = [s[:joined] + (0,) + s[joined + 1:] for s in shapes]
    if len(set(shapes)) > 1:
        return f"members hand in shapes {shapes}, and the step gives no lengths where they differ"
    cut = args["dim"] if kind == "reduce_scatter" else args.get("split_dim") if kind != "allgather" else None
    if cut is not None and cut in lengths and sum(lengths[cut]) != shapes[0][cut]:
        return f"dim {cut} of {shapes[0][cut]} cut at {lengths[cut]}"
    if cut is not None and cut not in lengths and _chunks(shapes[0][cut], n) != n:
        # with no lengths given a real rank cuts as torch.chunk does (10 into 4: 3, 3, 3, 1)
        return f"dim {cut} of {shapes[0][cut]} cut into {n} parts by torch.chunk makes {_chunks(shapes[0][cut], n)}"
    return None


def _chunks(size: int, n: int) -> int:
    """How many pieces ``torch.chunk`` cuts ``size`` elements into when asked for ``n``."""
    step = -(-size // n)
    return -(-size // step) if size else n


def _mismatch(kind, axes, why: str):
    raise GraphError(message(
        f"{kind} over {tuple(a for a in axes if a != MB_AXIS) or 'the micro-batches'}: real processes would "
        "run this plan's collective otherwise than the simulated mesh.", bullets=[why],
        rule="every member of a collective hands in a part of the length its step gives (gloo and NCCL "
             "take each part's length from the caller's own tensor)",
        fix="this is a meshdsl bug: please report the model, mesh and layout"))
