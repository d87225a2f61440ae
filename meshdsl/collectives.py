"""The collective kinds: one table that plans, cost models and communicators read.

Each :class:`Collective` says, for one kind of communication over mesh axes:

* the step args it reads (its schema, checked when a plan step is emitted);
* its cost: bytes on the wire per byte a rank sends, in a group of ``n``;
* whether it is point-to-point (a rank talks to one peer, not the whole group);
* how it runs on the simulated mesh (every rank's tensor in one process);
* how it runs on torch.distributed (this process's one rank), and optionally
  how to start it asynchronously so the executor overlaps it with compute.

Adding a kind (``send``/``recv`` for pipelines, say) means writing one entry
here; plans, the cost model, both communicators, the executor, training-step
stats and reports look kinds up in :data:`COLLECTIVES` and need no change.

The simulated implementation takes ``(xs, groups, args)``: ``xs[r]`` is rank
``r``'s tensor and ``groups`` the mesh groups over the step's axes (each
ordered first axis major); it returns one tensor (or ``None``) per rank.
The distributed one takes ``(comm, x, group, args)``: a ``TorchComm``, this
rank's tensor and its group (``members``, ``group_rank``, ``me``, ``pg``).
Simulated implementations index ``xs`` by global rank; a rank the
communicator does not hold has ``None`` there (a pipeline stage runs on a
communicator that holds only its own ranks).  Both reduce in group order, so results agree bit for bit except the
backend's own allreduce sum.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

#: Reductions a collective may apply, as the fold the simulated mesh uses.
REDUCE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


@dataclass(frozen=True)
class Collective:
    """One collective kind; see the module docstring for the two implementations.

    Attributes:
      name: the step kind, e.g. ``"allreduce"``.
      args: the step args it reads, e.g. ``("op",)``.
      fraction: ``fraction(n)``: bytes on the wire per byte sent, group of ``n`` (ring algorithms).
      simulated: ``simulated(xs, groups, args) -> list``.
      distributed: ``distributed(comm, x, group, args) -> tensor``.
      start: optional ``start(comm, x, group, args) -> (work, finish)``: an async
        torch.distributed call and a function giving its result once ``work`` is done.
      point_to_point: each rank exchanges with one peer rather than the whole group.
      mailbox: for one half of a point-to-point pair: ``"put"`` (a send: on the simulated
        mesh its results are left in the communicator's mailbox, keyed by destination rank
        and ``tag``) or ``"take"`` (a receive: its inputs are taken from there); None otherwise.
    """

    name: str
    args: tuple[str, ...]
    fraction: Callable[[int], float]
    simulated: Callable
    distributed: Callable
    start: Callable | None = None
    point_to_point: bool = False
    mailbox: str | None = None


COLLECTIVES: dict[str, Collective] = {}


def register(c: Collective) -> Collective:
    """Put ``c`` in :data:`COLLECTIVES` (replacing a kind of the same name)."""
    COLLECTIVES[c.name] = c
    return c


def _fold(xs, group, op):
    """Reduce the group's tensors with ``op`` in group order (deterministic)."""
    acc = xs[group[0]]
    for r in group[1:]:
        acc = REDUCE[op](acc, xs[r])
    return acc


def _dist():
    # Imported on first use: plans and the simulated mesh never need torch.distributed.
    import torch.distributed as dist
    return dist


def _reduce_op(op: str):
    dist = _dist()
    return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]


# ----------------------------------------------------------------------------- allreduce

def _sim_allreduce(xs, groups, args):
    out = list(xs)
    for g in groups:
        acc = _fold(xs, g, args.get("op", "sum"))
        for r in g:
            out[r] = acc
    return out


class _Finished:
    """The work handle of a collective that ran to the end when it was started."""

    @staticmethod
    def wait():
        return True


def _all_reduce_(comm, out, group, op: str, async_op: bool):
    """Reduce ``out`` over ``group`` in place: through shared memory where the communicator
    has a segment for the group (:mod:`meshdsl.exec.shm`, at once), else the backend's."""
    shm = _shm(comm, group, out)
    if shm is not None:
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


register(Collective("allreduce", ("op",), lambda n: 2 * (n - 1) / n, _sim_allreduce, _dist_allreduce,
                    _start_allreduce))


# ----------------------------------------------------------------------------- allgather

def _sim_allgather(xs, groups, args):
    out = list(xs)
    for g in groups:
        full = torch.cat([xs[r] for r in g], dim=args["dim"])
        for r in g:
            out[r] = full
    return out


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


register(Collective("allgather", ("dim",), lambda n: float(n - 1), _sim_allgather, _dist_allgather,
                    _start_allgather))


# ----------------------------------------------------------------------------- alltoall

def _sim_alltoall(xs, groups, args):
    out = list(xs)
    for g in groups:
        chunks = {r: xs[r].chunk(len(g), dim=args["split_dim"]) for r in g}
        for j, r in enumerate(g):
            out[r] = torch.cat([chunks[s][j] for s in g], dim=args["concat_dim"])
    return out


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


register(Collective("alltoall", ("split_dim", "concat_dim"), lambda n: (n - 1) / n, _sim_alltoall,
                    _dist_alltoall))


# ----------------------------------------------------------------------------- reduce_scatter

def _sim_reduce_scatter(xs, groups, args):
    out = list(xs)
    for g in groups:
        acc = _fold(xs, g, args.get("op", "sum"))
        for j, r in enumerate(g):
            out[r] = acc.chunk(len(g), dim=args["dim"])[j].contiguous()
    return out


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


register(Collective("reduce_scatter", ("dim", "op"), lambda n: (n - 1) / n, _sim_reduce_scatter,
                    _dist_reduce_scatter, _start_reduce_scatter))


# ----------------------------------------------------------------------------- gradient buckets
# Several gradients reduced in one flat buffer (DDP's buckets): one call's latency and one
# kernel launch instead of one per gradient.  lowering/bucket.py makes the steps; the
# executor's bucket rule (exec/bucket.py) packs the members into the buffer and unpacks the
# result, so the implementations below see one 1-D tensor per rank.  A reduce-scatter
# bucket is packed chunk-major (member j's chunks of every gradient, then member j+1's), so
# scattering the flat buffer along its only dim hands each member its chunk of every gradient.

def _flat(args):
    return {"op": args.get("op", "sum"), "dim": 0}


def _start_bucket_allreduce(comm, x, group, args):
    # The packed buffer is this step's own: reduce it in place, no copy.
    op = comm.check_op(args.get("op", "sum"))
    out = comm.prep(x)
    return _all_reduce_(comm, out, group, op, async_op=True), lambda: out


register(Collective("bucket_allreduce", ("op",), lambda n: 2 * (n - 1) / n, _sim_allreduce, _dist_allreduce,
                    _start_bucket_allreduce))
register(Collective("bucket_reduce_scatter", ("op", "dims"), lambda n: (n - 1) / n,
                    lambda xs, groups, args: _sim_reduce_scatter(xs, groups, _flat(args)),
                    lambda comm, x, group, args: _dist_reduce_scatter(comm, x, group, _flat(args)),
                    lambda comm, x, group, args: _start_reduce_scatter(comm, x, group, _flat(args))))


# ----------------------------------------------------------------------------- permute

def _sim_permute(xs, groups, args):
    offset, wrap = args["offset"], args["wrap"]
    out: list = [None] * len(xs)
    for g in groups:
        n = len(g)
        for j, r in enumerate(g):
            src = j - offset
            if wrap:
                src %= n
            elif not 0 <= src < n:
                continue
            out[r] = xs[g[src]]
    return out


def _dist_permute(comm, x, group, args):
    # One irecv and one isend per rank, both posted before either is waited on
    # (no batched p2p, which can hang on gloo).
    n, j = group.size, group.me
    dst, src = j + args["offset"], j - args["offset"]
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


register(Collective("permute", ("offset", "wrap"), lambda n: 1.0, _sim_permute, _dist_permute,
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
# where the communicator opened them (exec/shm_pipe.py).

def _peer(group, offset):
    j = group.me + offset
    return group.members[j] if 0 <= j < group.size else None


def _sim_send(xs, groups, args):
    off = args["offset"]
    out: list = [None] * len(xs)
    for g in groups:
        for j, r in enumerate(g):
            if xs[r] is not None and 0 <= j + off < len(g):
                out[g[j + off]] = xs[r]
    return out


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


def _sim_recv(xs, groups, args):
    return list(xs)  # the communicator put the mailbox's tensors in xs


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


register(Collective("send", ("offset", "tag"), lambda n: 1.0, _sim_send, _dist_send, point_to_point=True,
                    mailbox="put"))
register(Collective("recv", ("offset", "tag"), lambda n: 1.0, _sim_recv, _dist_recv, _start_recv,
                    point_to_point=True, mailbox="take"))
