"""How each collective kind runs on torch.distributed, for :class:`~.distributed.TorchComm`.

:data:`TORCH` maps a kind of :data:`meshdsl.collectives.COLLECTIVES` to ``(run, start)``:
``run(comm, x, group, args) -> tensor`` on this process's one rank, and optionally
``start(comm, x, group, args) -> (work, finish)``, an asynchronous call and a function
giving its result once ``work`` is done.  ``group`` has ``members``, ``group_rank``,
``me`` and ``pg``.  The transport is chosen here: a CPU tensor takes the group's
shared-memory segment (:mod:`.shm`) or a pipeline carry's channels (:mod:`.shm_pipe`)
where the communicator opened them, anything else the backend (gloo, NCCL).  Results
reduce in group order, as the simulated mesh does.
"""
from __future__ import annotations

import torch

from ..collectives import REDUCE, flat_args


def _dist():
    # Imported on first use: plans and the simulated mesh never need torch.distributed.
    import torch.distributed as dist
    return dist


def _reduce_op(op: str):
    dist = _dist()
    return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]


class _Finished:
    """The work handle of a collective that ran to the end when it was started."""

    @staticmethod
    def wait():
        return True


def _all_reduce_(comm, out, group, op: str, async_op: bool):
    """Reduce ``out`` over ``group`` in place: through shared memory where the communicator
    has a segment for the group (:mod:`meshdsl.comm.shm`: started now, folded on ``wait``),
    else the backend's."""
    shm = _shm(comm, group, out)
    if shm is not None:
        if async_op:
            return shm.start_allreduce(out, REDUCE[op], group.me, group.members)
        shm.allreduce_(out, REDUCE[op], group.me, group.members)
        return _Finished()
    return _dist().all_reduce(out, op=_reduce_op(op), group=group.pg, async_op=async_op)


def _dist_allreduce(comm, x, group, args):
    op = comm.check_op(args.get("op", "sum"))
    if group.size == 1:
        return x
    out = comm.prep(x).clone()
    _all_reduce_(comm, out, group, op, async_op=False)
    return out


def _start_allreduce(comm, x, group, args):
    op = comm.check_op(args.get("op", "sum"))
    out = comm.prep(x).clone()  # all_reduce works in place; x may have other readers
    return _all_reduce_(comm, out, group, op, async_op=True), lambda: out


def _dist_allgather(comm, x, group, args):
    if group.size == 1:
        return torch.cat([x], dim=args["dim"])
    work, finish = _start_allgather(comm, x, group, args, async_op=False)
    return finish()


def _shm(comm, group, x):
    """The communicator's shared-memory segment for ``group`` when ``x`` may use it, else None."""
    return comm.shm_group(group) if x.device.type == "cpu" else None


def _start_allgather(comm, x, group, args, async_op=True):
    x_c = comm.prep(x)
    shm = _shm(comm, group, x_c)
    if shm is not None:
        out = shm.gather(x_c, group.me, group.members, lambda parts: torch.cat(parts, dim=args["dim"]))
        if out is not None:
            return _Finished(), lambda: out
    parts = [torch.empty_like(x_c) for _ in range(group.size)]
    work = _dist().all_gather(parts, x_c, group=group.pg, async_op=async_op)
    return work, lambda: torch.cat([parts[g] for g in group.group_rank], dim=args["dim"])


def _dist_alltoall(comm, x, group, args):
    if group.size == 1:
        return torch.cat([x.chunk(1, dim=args["split_dim"])[0]], dim=args["concat_dim"])
    out = _shm_exchange(comm, x, group, args["split_dim"], lambda parts: torch.cat(parts, dim=args["concat_dim"]))
    if out is not None:
        return out
    return torch.cat(comm.exchange(x, group, args["split_dim"]), dim=args["concat_dim"])


def _shm_exchange(comm, x, group, dim, combine):
    """``combine`` of the all-to-all's parts, through shared memory; None where that cannot run."""
    shm = _shm(comm, group, x)  # CPU tensors only: exchange reads x as it is, no prep
    return None if shm is None else shm.exchange(x, dim, group.me, group.members, combine)


def _dist_reduce_scatter(comm, x, group, args):
    # An all-to-all plus a local fold in group order: on gloo faster than
    # dist.reduce_scatter (which gloo emulates) and bitwise equal to the simulated mesh.
    op = comm.check_op(args.get("op", "sum"))
    if group.size == 1:
        return x.chunk(1, dim=args["dim"])[0].contiguous()
    out = _shm_exchange(comm, x, group, args["dim"], lambda parts: _fold_parts(parts, op))
    if out is not None:
        return out
    return _fold_parts(comm.exchange(x, group, args["dim"]), op)


def _fold_parts(parts, op):
    out = parts[0]
    for p in parts[1:]:
        out = REDUCE[op](out, p)
    return out.contiguous()


def _start_reduce_scatter(comm, x, group, args):
    # The same all-to-all and fold as _dist_reduce_scatter, with the all-to-all in flight.
    op = comm.check_op(args.get("op", "sum"))
    out = _shm_exchange(comm, x, group, args["dim"], lambda parts: _fold_parts(parts, op))
    if out is not None:
        return _Finished(), lambda: out
    work, parts = comm.start_exchange(x, group, args["dim"])
    return work, lambda: _fold_parts(parts(), op)


def _start_bucket_allreduce(comm, x, group, args):
    # The packed buffer is this step's own: reduce it in place, no copy (or, a span of the
    # communicator's reduce buffer, into its result area: the handle's ``out``).
    op = comm.check_op(args.get("op", "sum"))
    out = comm.prep(x)
    work = _all_reduce_(comm, out, group, op, async_op=True)
    return work, lambda: getattr(work, "out", out)


def _dist_permute(comm, x, group, args):
    # One irecv and one isend per rank, both posted before either is waited on
    # (no batched p2p, which can hang on gloo).
    n, j = group.size, group.me
    dst, src = j + args["offset"], j - args["offset"]
    if args.get("reverse"):   # member j trades with member n - 1 - j (collectives.py)
        dst = src = n - 1 - j
    if args["wrap"]:
        dst, src = dst % n, src % n
    dst = dst if 0 <= dst < n else None
    src = src if 0 <= src < n else None
    if src == j:  # offset is a multiple of the group size: nothing moves
        return x
    dist = _dist()
    x_c = comm.prep(x)
    out = None if src is None else torch.empty_like(x_c)
    reqs = []
    if out is not None:
        reqs.append(dist.irecv(out, src=group.members[src], group=group.pg))
    if dst is not None:
        reqs.append(dist.isend(x_c, dst=group.members[dst], group=group.pg))
    for r in reqs:
        r.wait()
    return out


def _peer(group, offset):
    j = group.me + offset
    return group.members[j] if 0 <= j < group.size else None


def _pipe(comm, x, group, args):
    """The shared-memory channels for this transfer (a pipeline's carry, on CPU), or None: gloo."""
    return comm.pipe_for(group) if args.get("pipe") and x.device.type == "cpu" else None


def _dist_send(comm, x, group, args):
    dst = _peer(group, args["offset"])
    if dst is not None:
        x_c = comm.prep(x)
        if (pipe := _pipe(comm, x_c, group, args)) is not None:
            pipe.send(x_c, group.me, group.me + args["offset"], args["tag"])
        else:
            comm.hold(_dist().isend(x_c, dst=dst, group=group.pg, tag=args["tag"]), x_c)
    return None


class _Nothing:
    """The work of a receive with no sender: done at once, with no result."""

    def wait(self):
        return True


def _start_recv(comm, x, group, args):
    # x is a template with the local shape and dtype of what arrives.  Posted early (a
    # pipeline posts its next receive before computing), the message lands meanwhile.
    src = _peer(group, -args["offset"])
    if src is None:
        return _Nothing(), lambda: None
    out = torch.empty_like(comm.prep(x))
    if (pipe := _pipe(comm, out, group, args)) is not None:
        return pipe.recv(out, group.me - args["offset"], group.me, args["tag"]), lambda: out
    return _dist().irecv(out, src=src, group=group.pg, tag=args["tag"]), lambda: out


def _dist_recv(comm, x, group, args):
    work, finish = _start_recv(comm, x, group, args)
    work.wait()
    return finish()


def _bucket_reduce_scatter(comm, x, group, args):
    return _dist_reduce_scatter(comm, x, group, flat_args(args))


def _start_bucket_reduce_scatter(comm, x, group, args):
    return _start_reduce_scatter(comm, x, group, flat_args(args))


def _bucket_allgather(comm, x, group, args):
    return _dist_allgather(comm, x, group, flat_args(args))


def _start_bucket_allgather(comm, x, group, args):
    # every member's buffer, one after another: the flat allgather's result the executor cuts up
    return _start_allgather(comm, x, group, flat_args(args))


# ----------------------------------------------------------------------------- uneven parts
# gloo and NCCL move parts of one length.  A step whose parts differ in length (an uneven
# split: args["lengths"], {dim position: each member's length}, which TorchComm works out
# from the step's ``uneven`` arg) pads every part to the longest, runs the even collective
# and cuts the padding off what arrives; the padding never reaches a result.

def _pad_to(x, dim: int, n: int):
    """``x`` with zeros appended along ``dim`` up to length ``n``."""
    if x.shape[dim] == n:
        return x
    shape = list(x.shape)
    shape[dim] = n - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim)


def _spread(x, dim: int, lengths, width: int):
    """``x`` cut along ``dim`` into parts of ``lengths``, each padded to ``width``, joined again."""
    return torch.cat([_pad_to(p, dim, width) for p in x.split(list(lengths), dim)], dim)


def _trim(y, dim: int, lengths, width: int):
    """The inverse of :func:`_spread`: ``y``'s parts of ``width`` cut to ``lengths`` and joined."""
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(y.split(width, dim), lengths)], dim)


def _pad_gather(x, args, me):
    (dim, lengths), = args["lengths"].items()
    width = max(lengths)
    return _pad_to(x, dim, width), lambda y: _trim(y, dim, lengths, width)


def _pad_scatter(x, args, me):
    (dim, lengths), = args["lengths"].items()
    width = max(lengths)
    return _spread(x, dim, lengths, width), lambda y: y.narrow(dim, 0, lengths[me]).contiguous()


def _pad_alltoall(x, args, me):
    split, concat = args["split_dim"], args["concat_dim"]
    cut, joined = args["lengths"].get(split), args["lengths"].get(concat)
    if cut:
        x = _spread(x, split, cut, max(cut))
    if joined:
        x = _pad_to(x, concat, max(joined))

    def undo(y):
        if cut:
            y = y.narrow(split, 0, cut[me])
        if joined:
            y = _trim(y, concat, joined, max(joined))
        return y.contiguous()
    return x, undo


def _padded(pad, run, start):
    """``(run, start)`` of a kind whose parts may differ in length: ``pad(x, args, me) -> (x
    padded, undo)`` makes them equal, and ``undo`` cuts the padding off the result."""
    def run_padded(comm, x, group, args):
        if not args.get("lengths"):
            return run(comm, x, group, args)
        x, undo = pad(x, args, group.me)
        return undo(run(comm, x, group, args))

    def start_padded(comm, x, group, args):
        if not args.get("lengths"):
            return start(comm, x, group, args)
        x, undo = pad(x, args, group.me)
        work, finish = start(comm, x, group, args)
        return work, lambda: undo(finish())
    return run_padded, start and start_padded


#: collective kind -> (run, start or None)
TORCH = {
    "allreduce": (_dist_allreduce, _start_allreduce),
    "allgather": _padded(_pad_gather, _dist_allgather, _start_allgather),
    "alltoall": _padded(_pad_alltoall, _dist_alltoall, None),
    "reduce_scatter": _padded(_pad_scatter, _dist_reduce_scatter, _start_reduce_scatter),
    "bucket_allreduce": (_dist_allreduce, _start_bucket_allreduce),
    "bucket_reduce_scatter": _padded(_pad_scatter, _bucket_reduce_scatter, _start_bucket_reduce_scatter),
    "bucket_allgather": (_bucket_allgather, _start_bucket_allgather),
    "permute": (_dist_permute, None),
    "bucket_permute": (_dist_permute, None),   # (one flat buffer, the same on every rank: lowering/coalesce.py)
    "send": (_dist_send, None),
    "recv": (_dist_recv, _start_recv),
}
