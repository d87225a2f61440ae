"""The search space: meshes for N processes and the layouts over them.

A mesh gives each of its axes one role, and the axis is named after it:
``pipe`` (major), ``data``, ``model`` (minor, so tensor-parallel groups are
neighbouring ranks, as Megatron places them).  Every ordered factorisation of
N into factors >= 2 over a subset of the roles is a mesh.  Each role then has
a few layout options, built from the dims the model has:

* ``data``: ``batch`` over it (data parallel); with optimizer state, ZeRO-1
  (``opt.d_model``) and ZeRO-2 (``opt.`` and ``grads.d_model``); FSDP
  (``params.d_model``, or ``params.d_ff``); with ``experts``, expert parallelism over the same axis;
* ``model``: Megatron (``heads`` and ``d_ff``), ``d_ff`` alone, ``heads``
  alone, ``vocab``, ``experts``, ``seq``, ``d_model``, each where the model has the dims;
* ``pipe``: ``layer`` over it, with a micro-batch count (2, 4, 8: the ones the
  batch allows) and a schedule (gpipe, 1f1b, zbh1).

A candidate is one option per role, and on a mesh without a pipeline also a
gradient accumulation count (:data:`ACCUMULATION`: fewer activations held, more
kernels).  :func:`candidates` yields the strings;
whether a candidate compiles (a dim the axis does not divide, a schedule the
layer count does not allow) is settled by compiling it, in :mod:`.search`.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

ROLES = ("pipe", "data", "model")
MICROBATCHES = (2, 4, 8)
#: Gradient accumulation without a pipeline: micro-batch counts offered on meshes with no ``pipe`` axis.
ACCUMULATION = (2,)
SCHEDULES = ("gpipe", "1f1b", "zbh1")


@dataclass(frozen=True, order=True)
class Candidate:
    """One point of the space: strings that ``meshdsl run`` accepts as they are.

    Attributes:
      mesh: e.g. ``"data:2; model:2"``.
      layout: e.g. ``"batch:data; heads:model; d_ff:model"``.
      microbatches: ``--microbatches`` (1 without a pipeline).
      schedule: ``--schedule`` (``gpipe`` without a pipeline).
      family: a short name of the strategy, e.g. ``"DP+TP(megatron)"``.
    """

    mesh: str
    layout: str
    microbatches: int = 1
    schedule: str = "gpipe"
    family: str = ""

    @property
    def pipelined(self) -> bool:
        return self.microbatches > 1 or "layer:" in self.layout


def factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    """Ordered ``k``-tuples of factors >= 2 whose product is ``n``."""
    if k == 0:
        return [()] if n == 1 else []
    out = []
    for f in range(2, n + 1):
        if n % f == 0:
            out += [(f,) + rest for rest in factorizations(n // f, k - 1)]
    return out


def meshes(n: int) -> list[tuple[tuple[str, int], ...]]:
    """Every mesh of ``n`` devices as ``((role, size), ...)``, roles in :data:`ROLES` order."""
    if n == 1:
        return [(("data", 1),)]
    out = []
    for k in range(1, len(ROLES) + 1):
        for roles in itertools.combinations(ROLES, k):
            for sizes in factorizations(n, k):
                out.append(tuple(zip(roles, sizes)))
    return out


def role_options(role: str, size: int, dims: dict[str, int], stateful: bool,
                 batch_per_replica: int) -> list[tuple[str, str, int, str]]:
    """``(rules, name, microbatches, schedule)`` options of one axis of ``size`` in ``role``."""
    ax = role
    if role == "data":
        opts = [(f"batch:{ax}", "DP", 1, "")]
        if "d_model" in dims:
            if stateful:
                opts.append((f"batch:{ax}; opt.d_model:{ax}", "ZeRO-1", 1, ""))
                opts.append((f"batch:{ax}; opt.d_model:{ax}; grads.d_model:{ax}", "ZeRO-2", 1, ""))
            opts.append((f"batch:{ax}; params.d_model:{ax}", "FSDP", 1, ""))
        if "d_ff" in dims:
            opts.append((f"batch:{ax}; params.d_ff:{ax}", "FSDP(d_ff)", 1, ""))
        if "experts" in dims:
            opts.append((f"batch:{ax}; experts:{ax}", "DP+EP", 1, ""))
        return opts
    if role == "model":
        opts = []
        if "heads" in dims and "d_ff" in dims:
            opts.append((f"heads:{ax}; d_ff:{ax}", "TP(megatron)", 1, ""))
        for d in ("d_ff", "heads", "vocab", "experts", "seq", "d_model"):
            if d in dims:
                opts.append((f"{d}:{ax}", f"TP({d})", 1, ""))
        return opts
    opts = []
    if "layer" in dims:
        for m in MICROBATCHES:
            if batch_per_replica % m == 0:
                for sched in SCHEDULES:
                    opts.append((f"layer:{ax}", f"PP(m={m},{sched})", m, sched))
    return opts


def model_dims(model) -> dict[str, int]:
    """Dim name -> size over the model's params and inputs."""
    feeds = {}
    for t in list(model.params.values()) + _inputs(model):
        for d in t.shape:
            feeds[d.name] = d.size
    return feeds


def _inputs(model) -> list:
    return [n.outputs[0] for n in model.graph.nodes if n.op.name == "input"]


def indivisible(c: Candidate, dims: dict[str, int]) -> str | None:
    """Why ``c`` cannot compile for lack of divisibility (a quick test before compiling), or None.

    Every rule's dim must be divisible by the size of the axes it is split over, and the
    batch by the data axis times the micro-batches.
    """
    sizes = dict((name, int(size)) for name, size in (a.split(":") for a in c.mesh.split("; ")))
    split: dict[str, int] = {}
    for rule in filter(None, c.layout.split("; ")):
        target, axis = rule.split(":")
        dim = target.rsplit(".", 1)[-1]
        split[dim] = max(split.get(dim, 1), sizes[axis])
    if c.microbatches > 1:
        split["batch"] = split.get("batch", 1) * c.microbatches
    for dim, k in split.items():
        if dims.get(dim, k) % k:
            return f"dim '{dim}' of size {dims[dim]} is not divisible by {k}"
    return None


def candidates(model, nproc: int, stateful: bool = False, pruned: list | None = None):
    """Yield every :class:`Candidate` for ``model`` on ``nproc`` processes whose dims divide
    (see :func:`indivisible`; not yet compiled).

    Args:
      model: a loaded :class:`~meshdsl.train.model.Model`.
      nproc: processes (mesh devices).
      stateful: the optimizer keeps state (ZeRO options make sense).
      pruned: a list that receives ``(candidate, reason)`` for each candidate dropped.
    """
    dims = model_dims(model)
    batch = dims.get("batch", 1)
    for mesh in meshes(nproc):
        sizes = dict(mesh)
        per_replica = batch // sizes.get("data", 1) if batch % sizes.get("data", 1) == 0 else 0
        per_role = [role_options(role, size, dims, stateful, per_replica) if size > 1 else
                    [(f"batch:{role}" if role == "data" else "", "single", 1, "")] for role, size in mesh]
        text = "; ".join(f"{r}:{s}" for r, s in mesh)
        accum = (1,) if "pipe" in sizes else (1,) + ACCUMULATION
        for combo, k in itertools.product(itertools.product(*per_role), accum):
            rules = "; ".join(r for r, _, _, _ in combo if r)
            m = max(c[2] for c in combo) * k
            sched = next((c[3] for c in combo if c[3]), "gpipe")
            family = "+".join(name for _, name, _, _ in combo) + (f"+accum{k}" if k > 1 else "")
            c = Candidate(text, rules, m, sched, family)
            why = indivisible(c, dims)
            if why is None:
                yield c
            elif pruned is not None:
                pruned.append((c, why))
