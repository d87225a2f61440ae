"""The search space: meshes for N processes and the layouts over them.

A mesh gives each of its axes one role, and the axis is named after it:
``pipe`` (major), ``data``, ``model`` (minor, so tensor-parallel groups are
neighbouring ranks, as Megatron places them).  Every ordered factorisation of
N into factors >= 2 over a subset of the roles is a mesh.  Each role then has
layout options built from every dim of the model's graph (:mod:`.dims`: which
dims, ranked how, and why):

* ``data``: ``batch`` over it (data parallel); with optimizer state, ZeRO-1
  (``opt.X``) and ZeRO-2 (``opt.`` and ``grads.X``); FSDP (``params.X``) over the
  param dims that shard the most bytes (``d_model`` always); with ``experts``,
  expert parallelism over the same axis;
* ``model``: Megatron (``heads`` and ``d_ff``), then any other dim alone or two
  that no tensor holds together, the best few by a cheap estimate (``seq`` and
  ``experts`` always), and, beside another axis, no rule at all (:data:`REPLICATED`: the
  axis replicates the model; priced only as the reference a side-dim split is measured
  against, never listed: :mod:`.search`);
* ``pipe``: the dim a ``repeat`` scans over, with a micro-batch count (2, 4, 8:
  the ones the batch allows) and a schedule (gpipe, 1f1b, zbh1, and where the layers and
  micro-batches allow two virtual stages per rank, interleaved:2 and interleaved-zb:2).

A candidate is one option per role, and on a mesh without a pipeline also a
gradient accumulation count (:data:`ACCUMULATION`: fewer activations held, more
kernels).  :func:`candidates` yields the strings; one with an option pruned by
cost, a dim the axis cannot split or one dim on two axes is dropped with its
reason; whether the rest compiles is settled by compiling it, in :mod:`.search`.
A dim an axis does not divide is split unevenly (padded shards: :mod:`meshdsl.lowering.uneven`)
unless the search is strict; a repeat's layers and a micro-batched batch are never.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from .calibrate import Calibration
from .dims import Option, Splits

ROLES = ("pipe", "data", "model")
#: Gradient accumulation without a pipeline: micro-batch counts offered on meshes with no ``pipe`` axis.
ACCUMULATION = (2,)
#: The model axis's option of no rule: every rank of a model group holds and runs the whole model
#: (a smaller mesh in disguise, so never listed; the reference a split of a small side dim is
#: measured against, see :mod:`.search`).
REPLICATED = Option("", "replicated", "")


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
    def staged(self) -> bool:
        """The layout pipelines a repeat: a rule puts its layer dim over the ``pipe`` axis."""
        return any(axis == "pipe" for _, axis in _rules(self.layout))

    @property
    def pipelined(self) -> bool:
        """Micro-batched: a pipeline or a gradient accumulation (``run`` needs the flags)."""
        return self.microbatches > 1 or self.staged


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


def _rules(layout: str) -> list[tuple[str, str]]:
    return [tuple(rule.split(":")) for rule in filter(None, layout.split("; "))]


def idle_axes(c: Candidate) -> list[str]:
    """The axes of ``c``'s mesh that no rule of its layout splits over (each replicates the model)."""
    used = {axis for _, axis in _rules(c.layout)}
    return [a.split(":")[0] for a in c.mesh.split("; ") if a.split(":")[0] not in used and not a.endswith(":1")]


def twice(c: Candidate) -> str | None:
    """Why ``c``'s rules contradict each other (one dim, in one scope, on two axes), or None."""
    seen: dict[str, str] = {}
    for target, axis in _rules(c.layout):
        if seen.setdefault(target, axis) != axis:
            return f"dim '{target}' split over both '{seen[target]}' and '{axis}'"
    return None


def indivisible(c: Candidate, dims: dict[str, int], strict: bool = False, layers=(),
                examples: str | None = "batch") -> str | None:
    """Why ``c`` cannot compile for lack of divisibility (a quick test before compiling), or None.

    A rule's dim that the size of the axes it is split over does not divide is split unevenly,
    unless ``strict`` (the compiler's ``strict_splits``), a part would be empty, it is a repeat's
    layer dim (``layers``: its stages run whole layers, as many each) or it is the examples' dim
    (``examples``) of a micro-batched candidate (divided by the data axis times the micro-batches).
    """
    sizes = dict((name, int(size)) for name, size in (a.split(":") for a in c.mesh.split("; ")))
    split: dict[str, int] = {}
    for target, axis in _rules(c.layout):
        dim = target.rsplit(".", 1)[-1]
        split[dim] = max(split.get(dim, 1), sizes[axis])
    if c.microbatches > 1 and examples is not None:
        split[examples] = split.get(examples, 1) * c.microbatches
    for dim, k in split.items():
        n = dims.get(dim, k)
        if n % k and (strict or n < k or dim in layers or (dim == examples and c.microbatches > 1)):
            return f"dim '{dim}' of size {dims[dim]} is not divisible by {k}"
    return None


def candidates(model, nproc: int, stateful: bool = False, pruned: list | None = None,
               splits: Splits | None = None, by_cost: list | None = None, strict: bool = False):
    """Yield every :class:`Candidate` for ``model`` on ``nproc`` processes whose options are kept,
    whose dims split (see :func:`indivisible`) and whose rules agree (:func:`twice`); not yet
    compiled.

    Args:
      model: a loaded :class:`~meshdsl.train.model.Model`.
      nproc: processes (mesh devices).
      stateful: the optimizer keeps state (ZeRO options make sense).
      pruned: a list that receives ``(candidate, reason)`` for each candidate dropped as invalid.
      splits: the options per role (:class:`~.dims.Splits`); default: every dim of the model's
        SGD training step, ranked with the default calibration.
      by_cost: a list that receives ``(candidate, reason)`` for each candidate with an option
        pruned by cost.
      strict: no uneven split (a dim its axes do not divide), when ``splits`` is not given
        (else ``splits.strict`` says).
    """
    if splits is None:
        splits = Splits.of(model, model.train_step(), Calibration.defaults(), nproc, stateful, strict=strict)
    dims, strict, layers, examples = splits.dims, splits.strict, splits.prof.layer_dims, splits.prof.examples
    batch = dims.get(examples, 1)
    for mesh in meshes(nproc):
        sizes = dict(mesh)
        per_replica = batch // sizes.get("data", 1) if batch % sizes.get("data", 1) == 0 else 0
        # An idle model axis beside an axis that splits: the whole layout idle is no search answer.
        idle = [REPLICATED] if len(mesh) > 1 else []
        per_role = [splits.options(role, size, per_replica) + (idle if role == "model" else [])
                    if size > 1 else [Option(f"{examples}:{role}" if role == "data" and examples else "", "single", "")]
                    for role, size in mesh]
        text = "; ".join(f"{r}:{s}" for r, s in mesh)
        accum = (1,) if "pipe" in sizes else (1,) + ACCUMULATION
        for combo, k in itertools.product(itertools.product(*per_role), accum):
            rules = "; ".join(o.rules for o in combo if o.rules)
            m = max(o.microbatches for o in combo) * k
            sched = next((o.schedule for o in combo if o.schedule), "gpipe")
            family = "+".join(o.name for o in combo) + (f"+accum{k}" if k > 1 else "")
            c = Candidate(text, rules, m, sched, family)
            cost = next((o.pruned for o in combo if o.pruned), None)
            why = twice(c) or indivisible(c, dims, strict, layers, examples)
            if why is not None:
                if pruned is not None:
                    pruned.append((c, why))
            elif cost is not None:
                if by_cost is not None:
                    by_cost.append((c, cost))
            else:
                yield c
