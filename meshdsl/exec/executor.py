"""Runs a :class:`~meshdsl.lowering.plan.Plan` against a communicator.

The same code serves the simulated mesh (every rank in one process) and
torch.distributed (one rank per process): values are lists with one local
tensor per rank the communicator holds.  Per-rank context (slice offsets) is
computed once per plan.

Steps run in an issue order computed once per plan (:func:`issue_order`):
collectives the communicator runs asynchronously start as soon as their input
exists, and steps that need their results run after the other ready work, so
communication overlaps compute without changing any step's result.
"""
from __future__ import annotations

import time

import torch

from ..errors import GraphError, message
from ..lowering.plan import Plan, Value
from ..lowering.relayout import plan_moves
from ..layout.sharding import Sharding
from ..ops.registry import LocalCtx
from .comm import Communicator, Pending
from .dense import check_feed


class PerRank(list):
    """Feeds or params given as local slices, one per rank the communicator holds."""


def _ctx(mesh, rank: int, compute: dict, sizes: dict) -> LocalCtx:
    offs, loc = {}, {}
    for d, axes in compute.items():
        if axes:
            n = sizes[d] // mesh.axis_size(axes)
            loc[d] = n
            offs[d] = mesh.index_along(rank, axes) * n
    return LocalCtx(offs, loc)


def run_collective(comm: Communicator, kind: str, xs, axes, args):
    """Execute one collective or split step on the held ranks' tensors."""
    if kind == "allreduce":
        return comm.all_reduce(xs, axes, args.get("op", "sum"))
    if kind == "allgather":
        return comm.all_gather(xs, axes, args["dim"])
    if kind == "alltoall":
        return comm.all_to_all(xs, axes, args["split_dim"], args["concat_dim"])
    if kind == "reduce_scatter":
        return comm.reduce_scatter(xs, axes, args["dim"], args.get("op", "sum"))
    if kind == "permute":
        return comm.permute(xs, axes, args["offset"], args["wrap"])
    if kind == "split":
        mesh, dim, n = comm.mesh, args["dim"], comm.mesh.axis_size(axes)
        out = []
        for r, x in zip(comm.ranks, xs):
            size = x.shape[dim] // n
            out.append(x.narrow(dim, mesh.index_along(r, axes) * size, size).contiguous())
        return out
    raise AssertionError(kind)


def issue_order(plan: Plan, async_kinds=frozenset()) -> list[int]:
    """The order in which to run ``plan.steps``: a topological order that starts
    asynchronous collectives early and consumes their results late.

    List scheduling over the value dependencies: a ready step whose kind is in
    ``async_kinds`` is issued at once (starting it costs little and hides its
    latency behind what follows); otherwise the ready step that waits on the
    most recently issued collective still in flight goes last, ties broken by
    plan order.  The order depends on the plan alone, so every rank issues the
    same collectives in the same order.

    Args:
      plan: a compiled plan.
      async_kinds: collective kinds the communicator overlaps (``Communicator.async_kinds``).

    Returns:
      Step indices, each once.
    """
    steps = plan.steps
    producer = {v: i for i, s in enumerate(steps) for v in s.outs}
    users: list[list[int]] = [[] for _ in steps]
    waiting = [0] * len(steps)
    for i, s in enumerate(steps):
        deps = {producer[v] for v in s.ins if v in producer}
        waiting[i] = len(deps)
        for j in deps:
            users[j].append(i)
    ready = [i for i, n in enumerate(waiting) if n == 0]
    in_flight: dict[int, int] = {}   # value id -> position its collective was issued at
    order: list[int] = []
    while ready:
        starts = [i for i in ready if steps[i].kind in async_kinds]
        if starts:
            i = min(starts)
        else:
            i = min(ready, key=lambda j: (max((in_flight[v] for v in steps[j].ins if v in in_flight),
                                              default=-1), j))
        ready.remove(i)
        s = steps[i]
        if s.kind in async_kinds:
            for v in s.outs:
                in_flight[v] = len(order)
        else:
            for v in s.ins:
                in_flight.pop(v, None)
        order.append(i)
        for j in users[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.append(j)
    assert len(order) == len(steps), "plan steps form a cycle"
    return order


class Executor:
    """Executes ``plan`` for the ranks ``comm`` holds.

    Args:
      plan: a compiled plan.
      comm: SimulatedComm (all ranks) or TorchComm (this process's rank).
    """

    def __init__(self, plan: Plan, comm: Communicator, donate_params: bool = False):
        if comm.mesh.size != plan.mesh.size or comm.mesh.axes != plan.mesh.axes:
            raise GraphError(message(f"executor: plan mesh '{plan.mesh}' differs from communicator mesh '{comm.mesh}'.",
                                     rule="a plan runs on the mesh it was compiled for",
                                     fix="compile with the same mesh string"))
        self.plan, self.comm = plan, comm
        mesh = plan.mesh
        self.order = issue_order(plan, getattr(comm, "async_kinds", frozenset()))
        self.ctxs = {}
        last_use: dict[int, int] = {}
        for i in self.order:
            s = plan.steps[i]
            for v in s.ins:
                last_use[v] = i
            if s.kind == "local":
                self.ctxs[i] = [_ctx(mesh, r, s.args["compute"], s.args["sizes"]) for r in comm.ranks]
            if s.kind == "repeat":
                s.args["runner"] = s.args.get("runner") or {}
        keep = set(plan.outputs.values())
        self.free_after = {}
        for v, i in last_use.items():
            if v not in keep:
                self.free_after.setdefault(i, []).append(v)
        self._subs: dict[int, "Executor"] = {}
        # With donate_params (a training loop that replaces its params by the updated
        # ones), an update that is the last reader of its param overwrites it in place.
        # Only with one held rank: simulated ranks may share a replicated tensor.
        self.fns = {i: s.args["fn"] for i, s in enumerate(plan.steps) if s.kind == "local"}
        if donate_params and len(comm.ranks) == 1:
            param_vids = {s.outs[0] for s in plan.steps if s.kind == "param"}
            # never under a collective that may still be reading it, nor when it is an output
            param_vids -= {v for s in plan.steps if s.kind != "local" for v in s.ins}
            param_vids -= set(plan.outputs.values())
            for i, s in enumerate(plan.steps):
                inplace = getattr(s.args.get("fn"), "__self__", None)
                inplace = getattr(inplace, "compute_inplace", None)
                if s.kind == "local" and inplace and s.ins[0] in param_vids and last_use.get(s.ins[0]) == i:
                    self.fns[i] = inplace
        self._leaves = {s.outs[0]: s.args["tensor"] for s in plan.steps if s.kind in ("input", "param")}
        self._slice_idx: dict[int, list[tuple]] = {}

    # -- params and feeds
    def local_slices(self, value: Value, full: torch.Tensor) -> list[torch.Tensor]:
        """Each held rank's slice of ``full`` (indices worked out once per value)."""
        idx = self._slice_idx.get(value.id)
        if idx is None:
            idx = self._slice_idx[value.id] = [value.sharding.slice_index(value.shape, self.plan.mesh, r)
                                               for r in self.comm.ranks]
        return [full[i].contiguous() for i in idx]

    def init_params(self, seed: int = 0) -> dict[str, list[torch.Tensor]]:
        """Every param's local slices, from the layout-independent init."""
        from ..ops.leaf import init_value
        out = {}
        for s in self.plan.steps:
            if s.kind == "param":
                node = s.args["tensor"]
                out[s.args["name"]] = self.local_slices(self.plan.values[s.outs[0]], init_value(node, seed))
        return out

    def _feed(self, name, vid, value):
        v = self.plan.values[vid]
        if isinstance(value, PerRank):
            if len(value) != len(self.comm.ranks):
                raise GraphError(message(f"feed '{name}': {len(value)} slices for {len(self.comm.ranks)} rank(s).",
                                         rule="per-rank feeds give one local slice per rank held",
                                         fix="pass one tensor per rank, or the full tensor"))
            want = v.local_shape(self.plan.mesh)
            for x in value:
                if tuple(x.shape) != want:
                    raise GraphError(message(f"feed '{name}': local slice shape {tuple(x.shape)} != {want}.",
                                             inputs=[f"layout of '{name}': {v.sharding}"],
                                             rule="a per-rank slice has the local shape the layout gives",
                                             fix=f"slice it to {want} or feed the full tensor"))
            return list(value)
        check_feed(self.plan_tensor(name, vid), value)
        return self.local_slices(v, value)

    def plan_tensor(self, name, vid):
        try:
            return self._leaves[vid]
        except KeyError:
            raise KeyError(name) from None

    # -- running
    def run(self, feeds: dict | None = None, params: dict | None = None, salt: int = 0,
            stats: dict | None = None) -> dict[str, list[torch.Tensor]]:
        """Run the plan; returns output name -> local tensors (one per held rank).

        With ``stats`` (a dict), seconds spent per step kind are added to it, and
        time blocked on collectives in flight under 'wait'.
        """
        feeds = feeds or {}
        if params is None:
            params = self.init_params()
        env: dict[int, list] = {}
        comm = self.comm

        clock = time.perf_counter if stats is not None else None

        def get(v):
            x = env[v]
            if isinstance(x, Pending):
                if clock:
                    t0 = clock()
                    x = env[v] = x.wait()
                    stats["wait"] = stats.get("wait", 0.0) + clock() - t0
                else:
                    x = env[v] = x.wait()
            return x

        steps = self.plan.steps
        for i in self.order:
            s = steps[i]
            k = s.kind
            if clock:
                t0, waited = clock(), stats.get("wait", 0.0)
            if k == "local":
                ins = [get(v) for v in s.ins]
                ctxs = self.ctxs[i]
                fn, attrs = self.fns[i], s.args["attrs"]
                res = [fn(c.with_salt(salt) if salt else c, attrs, *[x[j] for x in ins])
                       for j, c in enumerate(ctxs)]
                if len(s.outs) == 1:
                    env[s.outs[0]] = res
                else:
                    for o, vid in enumerate(s.outs):
                        env[vid] = [r[o] for r in res]
            elif k == "param":
                name = s.args["name"]
                if name not in params:
                    raise GraphError(message(f"run: no value for param '{name}'.", rule="every param the plan reads is given",
                                             fix="use Executor.init_params() or pass it"))
                env[s.outs[0]] = params[name]
            elif k == "input":
                name = s.args["name"]
                if name not in feeds:
                    raise GraphError(message(f"run: no value fed for input '{name}'.",
                                             inputs=[f"fed: {sorted(feeds)}"],
                                             rule="every input the outputs need is fed", fix=f"add '{name}' to the feeds"))
                env[s.outs[0]] = self._feed(name, s.outs[0], feeds[name])
            elif k == "repeat":
                outs = s.args["execute"](self, s, [get(v) for v in s.ins], salt, stats)
                for vid, x in zip(s.outs, outs):
                    env[vid] = x
            elif k == "split":
                env[s.outs[0]] = run_collective(comm, k, get(s.ins[0]), s.axes, s.args)
            else:
                env[s.outs[0]] = comm.start(k, get(s.ins[0]), s.axes, s.args)
            for v in self.free_after.get(i, ()):
                x = env.pop(v, None)
                if isinstance(x, Pending):
                    x.wait()
            if clock and k != "repeat":  # a repeat's sub-plan counts its own steps
                stats[k] = stats.get(k, 0.0) + clock() - t0 - (stats.get("wait", 0.0) - waited)
        return {name: get(vid) for name, vid in self.plan.outputs.items()}

    # -- assembling full tensors
    def to_full(self, vid: int, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Gather (and reduce) value ``vid``'s local tensors into full tensors on every held rank."""
        v = self.plan.values[vid]
        rep = Sharding.replicated(v.shape)
        for m in plan_moves(v.shape, v.sharding, rep, self.plan.mesh):
            pos = v.shape.index(m.dim) if m.dim else None
            xs = run_collective(self.comm, m.kind, xs, m.axes, {"dim": pos, "op": "sum"})
        return xs

    def full_outputs(self, outs: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Full output tensors (as seen by the first held rank)."""
        return {k: self.to_full(self.plan.outputs[k], xs)[0] for k, xs in outs.items()}
