"""How the executor runs each step kind: a table of small rules.

A rule is ``prepare(ctx, i, step) -> call``: it runs once per (executor, step)
and returns ``call(env, get, run)``, which the executor's loop invokes each
time the plan runs.  Work that depends only on the plan (slice offsets,
which kernel to call) happens in ``prepare``, so the loop does no lookups.

* ``env`` maps value ids to per-rank lists (or :class:`~.comm.Pending` results);
* ``get(v)`` reads value ``v``, waiting for it if it is still in flight;
* ``run`` carries this run's feeds, params, salt and stats.

Collective kinds share one rule (:data:`meshdsl.collectives.COLLECTIVES`
says what each does); step kinds with sub-plans register theirs where they
are defined (the repeat loop in :mod:`.layers`).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ..collectives import COLLECTIVES
from ..errors import GraphError, message
from ..layout.sharding import chunk
from ..lowering.pipeline import MB_AXIS, per_microbatch
from ..ops.inplace import Operand, add_kernel
from ..ops.registry import OPS, LocalCtx
from ..comm.bucket import bucket_members, packing, start_packed_each
from ..comm.communicator import Pending
from ..comm.microbatch import real_rank

#: step kind -> ``prepare(ctx, i, step)``; collective kinds use :func:`_prepare_collective`.
STEP_RULES: dict[str, Callable] = {}


def step_rule(kind: str):
    """Decorator: register ``prepare(ctx, i, step)`` as the rule of step kind ``kind``."""
    def deco(fn):
        STEP_RULES[kind] = fn
        return fn
    return deco


def rule_for(kind: str) -> Callable:
    """The prepare function of step kind ``kind``."""
    rule = STEP_RULES.get(kind)
    if rule is None:
        assert kind in COLLECTIVES, f"no executor rule for step kind '{kind}'"
        return _prepare_collective
    return rule


def split_local(comm, xs, axes, dim: int):
    """Each held rank's slice along ``dim`` of a tensor replicated over ``axes`` (no communication);
    axes that do not divide the dim cut it unevenly, as :func:`~meshdsl.layout.sharding.chunk` does."""
    return [x.narrow(dim, *chunk(x.shape[dim], comm.mesh, r, axes)).contiguous() for r, x in zip(comm.ranks, xs)]


def representatives(plan, comm, s) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Where step ``s`` need run once per real rank, not once per micro-batch.

    Under gradient accumulation (and in a pipeline's final segment) a process holds
    the ``m`` micro-batch ranks of its real rank.  A step none of whose values is
    split or partial along the micro-batch axis computes the same thing on all ``m``
    (the optimizer update, an allgather of FSDP params): it runs on one of them, the
    *representative*, and the others read its result.

    Returns:
      ``(reps, of)``: the positions (in ``comm.ranks``) of the representatives,
      and for each held rank the index in ``reps`` of its own; ``None`` when the
      step varies along the micro-batch axis or every held rank is its own.
    """
    found = one_per_real_rank(plan.mesh, comm.ranks)   # (cheap: None off micro-batch meshes)
    return None if found is None or per_microbatch(s, plan.values) else found


def one_per_real_rank(mesh, ranks) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(reps, of)`` as :func:`representatives` gives them for held ``ranks``: the first held
    rank of each real rank; ``None`` when every held rank is a real rank of its own."""
    if MB_AXIS not in mesh.sizes or len(ranks) == 1:
        return None
    first: dict[int, int] = {}
    reps: list[int] = []
    of = []
    for j, r in enumerate(ranks):
        key = real_rank(mesh, r)
        if key not in first:
            first[key] = len(reps)
            reps.append(j)
        of.append(first[key])
    return (tuple(reps), tuple(of)) if len(reps) < len(ranks) else None


def _spread(res: list, of) -> list:
    """Per held rank, its representative's result (``of`` from :func:`representatives`; None: its own)."""
    return res if of is None else [res[k] for k in of]


class Spread(Pending):
    """A result computed on the representatives only (:func:`representatives`), read by every held rank."""

    __slots__ = ("pending", "of")

    def __init__(self, pending: Pending, of: tuple[int, ...]):
        self.pending, self.of = pending, of

    def wait(self):
        return _spread(self.pending.wait(), self.of)


def _ctx(mesh, rank: int, compute: dict, sizes: dict, parts=None) -> LocalCtx:
    """``rank``'s slice of each dim a local step splits: cut as :func:`chunk` cuts, or at the
    given lengths of ``parts`` (unequal pipeline stages, :mod:`meshdsl.lowering.local_parts`)."""
    offs, loc = {}, {}
    for d, axes in compute.items():
        if not axes:
            continue
        lengths = parts.get(d) if parts else None
        if lengths is None:
            offs[d], loc[d] = chunk(sizes[d], mesh, rank, axes)
        else:
            i = mesh.coords(rank)[axes[0]]
            offs[d], loc[d] = sum(lengths[:i]), lengths[i]
    return LocalCtx(offs, loc)


def inplace_adds(plan) -> dict[int, Callable]:
    """Step index -> the in-place kernel of each plain ``add`` step of ``plan`` that may write
    into an operand (:func:`meshdsl.ops.inplace.add_kernel`).

    Readers are counted over every step (collectives and loops included), the plan's
    outputs are kept, and an operand fits when it has the sum's global shape, dtype and
    sharding, so its local slice has the sum's local shape on every rank.  Only local
    steps produce fresh operands: a collective's result may be shared between simulated ranks.
    """
    steps, values = plan.steps, plan.values
    readers: dict[int, int] = {}
    for s in steps:
        for v in s.ins:
            readers[v] = readers.get(v, 0) + 1
    producer = {v: s for s in steps if s.kind == "local" for v in s.outs}
    kept = set(plan.outputs.values())
    add = OPS["add"].compute
    out = {}
    for i, s in enumerate(steps):
        if s.kind != "local" or s.op != "add" or s.args["fn"] != add:  # a scaled (lazy partial) add keeps its own
            continue
        sum_ = values[s.outs[0]]

        def operand(v):
            p, x = producer.get(v), values[v]
            return Operand(p.op if p else "", len(p.ins) if p else 0, readers[v], v in kept,
                           x.dtype == sum_.dtype and x.shape == sum_.shape and x.sharding == sum_.sharding)
        fn = add_kernel(s.args["attrs"], (operand(s.ins[0]), operand(s.ins[1])))
        if fn is not None:
            out[i] = fn
    return out


class LocalKernel(NamedTuple):
    """How local step ``i`` runs (:func:`local_kernel`): ``fn(ctx, attrs, *xs)`` on the held ranks at
    positions ``reps`` (each with its context in ``ctxs``), ``of`` spreading their results as
    :func:`representatives` says (None: every held rank computes its own); ``reads_salt``: the kernel
    reads the run's salt (``ctx.with_salt``)."""

    fn: Callable
    attrs: dict
    reps: tuple
    of: tuple | None
    ctxs: tuple
    reads_salt: bool


def reads_salt(op_name: str) -> bool:
    """Whether the kernel of local op ``op_name`` may read the salt: its op says so; a fused
    kernel (``einsum+sgd_update``, no op of its own) does when one of its parts does."""
    parts = [OPS.get(p) for p in op_name.split("+")]
    return any(op is None or op.reads_salt for op in parts)


def local_kernel(ctx, i, s, plain: bool = False) -> LocalKernel:
    """How local step ``i`` (``s``) runs in ``ctx``: on every held rank, or on one micro-batch rank
    per process (representatives) whose result the others read.  Its kernel writes into an
    operand where ``ctx`` allows (a donated param, an add into a fresh operand), unless ``plain``.

    Where it runs is worked out once per (``ctx``, step): the rule and the program writer
    (:mod:`.program`) both ask."""
    memo = ctx.cache.setdefault(__name__, {})
    hit = memo.get(i)
    if hit is None or hit[0] is not s:
        reps, of = representatives(ctx.plan, ctx.comm, s) or (tuple(range(len(ctx.comm.ranks))), None)
        ctxs = tuple(_ctx(ctx.plan.mesh, ctx.comm.ranks[j], s.args["compute"], s.args["sizes"], s.args.get("parts"))
                     for j in reps)
        hit = memo[i] = (s, tuple(reps), of, ctxs, reads_salt(s.op))
    _, reps, of, ctxs, salted = hit
    fn = s.args["fn"] if plain else s.args["inplace"] if i in ctx.donated else ctx.add_into.get(i, s.args["fn"])
    return LocalKernel(fn, s.args["attrs"], reps, of, ctxs, salted)


@step_rule("local")
def _prepare_local(ctx, i, s):
    # Run on every held rank, or on one micro-batch rank per process (representatives) and spread.
    fn, attrs, reps, of, ctxs, salted = local_kernel(ctx, i, s)
    ins, outs = s.ins, s.outs
    if len(ctx.comm.ranks) == 1 and len(outs) == 1:  # one held rank (every real process): no per-rank loop
        (c,), (out,) = ctxs, outs
        if not salted and len(ins) == 1:
            (x,) = ins

            def call_unary(env, get, run):
                env[out] = [fn(c, attrs, get(x)[0])]
            return call_unary
        if not salted and len(ins) == 2:
            x, y = ins

            def call_binary(env, get, run):
                env[out] = [fn(c, attrs, get(x)[0], get(y)[0])]
            return call_binary

        def call_one(env, get, run):
            env[out] = [fn(c.with_salt(run.salt) if run.salt and salted else c, attrs, *[get(v)[0] for v in ins])]
        return call_one

    def call(env, get, run):
        xs = [get(v) for v in ins]
        salt = run.salt if salted else 0
        res = [fn(c.with_salt(salt) if salt else c, attrs, *[x[j] for x in xs]) for j, c in zip(reps, ctxs)]
        if len(outs) == 1:
            env[outs[0]] = _spread(res, of)
        else:
            for o, vid in enumerate(outs):
                env[vid] = _spread([r[o] for r in res], of)
    return call


@step_rule("param")
def _prepare_param(ctx, i, s):
    name, out = s.args["name"], s.outs[0]

    def call(env, get, run):
        if name not in run.params:
            raise GraphError(message(f"run: no value for param '{name}'.", rule="every param the plan reads is given",
                                     fix="use Executor.init_params() or pass it"))
        env[out] = run.params[name]
    return call


@step_rule("input")
def _prepare_input(ctx, i, s):
    name, out = s.args["name"], s.outs[0]

    def call(env, get, run):
        if name not in run.feeds:
            raise GraphError(message(f"run: no value fed for input '{name}'.", inputs=[f"fed: {sorted(run.feeds)}"],
                                     rule="every input the outputs need is fed", fix=f"add '{name}' to the feeds"))
        env[out] = ctx.feed(name, out, run.feeds[name])
    return call


@step_rule("split")
def _prepare_split(ctx, i, s):
    (src,), out, axes, dim = s.ins, s.outs[0], s.axes, s.args["dim"]
    reps, of = representatives(ctx.plan, ctx.comm, s) or (range(len(ctx.comm.ranks)), None)
    comm = ctx.comm if of is None else ctx.comm.view([ctx.comm.ranks[j] for j in reps])
    cut = _stored_cut(ctx.plan.values[out], dim, axes, comm)

    def call(env, get, run):
        xs = get(src)
        if of is not None:
            xs = [xs[j] for j in reps]
        env[out] = _spread(split_local(comm, xs, axes, dim) if cut is None else
                           [_take(x, dim, c) for x, c in zip(xs, cut)], of)
    return call


def _stored_cut(value, dim: int, axes, comm) -> list | None:
    """Per held rank, the ``(start, length)`` runs of dim ``dim`` that split ``value`` stores, where
    a pass after lowering stored it otherwise than the even cut over ``axes`` the step was made
    with (a pipeline's unequal stages or virtual stages: given part lengths, blocks; a stack on
    one stage of several: whole there); None where the even cut is how it is stored."""
    sh, name = value.sharding, value.shape.names[dim]
    split = sh.axes_of(name)
    # the even cut: the step's axes are the last of the dim's (a split of a dim already split over
    # the group's major axes cuts the local part further, as ``chunk`` nests)
    if split[len(split) - len(axes):] == tuple(axes) and name not in dict(sh.parts) and name not in sh.cyclic_blocks:
        return None
    out = []
    for r in comm.ranks:
        regions = sorted(sh.regions(value.shape, comm.mesh, r), key=lambda g: g[1][dim].start)
        out.append([(g[dim].start, g[dim].stop - g[dim].start) for g, _ in regions])
    return out


def _take(x, dim: int, runs) -> "torch.Tensor":
    """The runs ``(start, length)`` of ``x`` along ``dim``, joined in order."""
    parts = [x.narrow(dim, a, n) for a, n in runs]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim)).contiguous()


def _prepare_collective(ctx, i, s):
    if len(s.ins) > 1:  # a gradient bucket: several values through one flat buffer
        return _prepare_bucket(ctx, i, s)
    go, (src,), out = starter(ctx, s), s.ins, s.outs[0]

    def call(env, get, run):
        env[out] = go(get(src))
    return call


def _prepare_bucket(ctx, i, s):
    """The executor's call for bucket step ``s`` (the collective rule hands buckets here)."""
    go, ins, outs = packed_starter(ctx, s), s.ins, s.outs

    def call(env, get, run):
        for vid, member in zip(outs, go([get(v) for v in ins])):
            env[vid] = member
    return call


def packed_starter(ctx, s) -> Callable:
    """``go(members) -> [Pending]``: starts bucket step ``s`` on its members (each the held ranks'
    tensors, in the step's order) packed in one flat buffer per held rank; a handle per member."""
    comm = ctx.comm
    layouts = [bucket_members(ctx.plan, s, r) for r in comm.ranks]   # a member split unevenly differs by rank
    num_chunks, dims, cuts = ctx.plan.mesh.axis_size(s.axes), s.args.get("dims", ()), s.args.get("cuts", ())
    pack, cut = packing(s.kind, num_chunks, dims)

    def go(members):
        flats = [pack([m[j] for m in members], num_chunks, dims, cuts) for j in range(len(comm.ranks))]
        return start_packed_each(comm, s, flats, layouts, cut)
    return go


def starter(ctx, s) -> Callable:
    """``go(xs) -> Pending``: starts collective step ``s`` on the held ranks' tensors ``xs``
    (on the representatives only where :func:`representatives` allows)."""
    kind, axes, args = s.kind, s.axes, s.args
    tw = representatives(ctx.plan, ctx.comm, s)
    if tw is None:
        start = ctx.comm.start
        return lambda xs: start(kind, xs, axes, args)
    reps, of = tw
    start = ctx.comm.view([ctx.comm.ranks[j] for j in reps]).start
    return lambda xs: Spread(start(kind, [xs[j] for j in reps], axes, args), of)
