"""Communication audit: every collective of every model's training step, checked by rule.

meshdsl promises that each op lowers to local compute plus exactly the collectives the layout
needs.  This script compiles the training step (forward, backward, SGD update: what
``TrainStep`` runs) of each shipped model (``models/*.py``) and each held-out model
(``tests/heldout_*.py``), tiny configs, under four standard layouts, lists every collective
with its bytes per step and the plan's note, and flags the ones a distributed-systems engineer
would question:

* ``dp``: on the ``data`` axis of data parallelism (``batch:data``, mesh ``data:2``) or FSDP
  (``batch:data; params.X:data``, ``X`` the param dim holding the most bytes, ``d_model`` where
  the model has it), anything but a gradient's reduction, a scalar (the loss, a metric) and,
  under FSDP, the gather of a param (a value with no batch-like dim) and the reduction of a value
  computed from params alone (a weight norm's row sums over the split ``X``: each rank holds
  only its part of ``X``; a value that also reads an input is still flagged);
* ``megatron``: under tensor parallelism on the model's matmul pair (``heads:model; d_ff:model``,
  else the pair :func:`meshdsl.search.dims.megatron_dims` finds in the graph; mesh ``model:2``),
  a collective other than an allreduce, or a layer body (``md.repeat``) with more than the
  textbook 2 allreduces forward or 2 backward per layer;
* ``gather+slice``: an allgather whose result a local split cuts back on the same axes;
* ``reshape``: a reshape, rearrange, rename, concat or slice whose input is gathered;
* ``duplicate``: the same value moved the same way twice in one (sub-)plan;
* ``unused``: a collective whose result nothing reads.

Sequence parallelism (``seq:model``) is listed with the reshape, duplicate and unused rules
only (its gathers of keys and values are what the layout asks for).  A flag is a question,
not a verdict: ``docs/benchmarks.md`` (communication audit) says which were needed and which
were waste (and fixed).

    python bench/comm_audit.py                     # the table, every model and layout
    python bench/comm_audit.py --flagged           # ... then each flagged collective
    python bench/comm_audit.py --models moe,heldout_mixtral --layouts dp --all
    python bench/comm_audit.py --json audit.json
"""

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import meshdsl as md  # noqa: E402
from meshdsl.lowering.plan import Plan  # noqa: E402
from meshdsl.search.dims import MEGATRON, megatron_dims  # noqa: E402
from meshdsl.search.estimate import profile  # noqa: E402
from meshdsl.train.step import step_outputs  # noqa: E402

REDUCTIONS = ("allreduce", "reduce_scatter", "bucket_allreduce", "bucket_reduce_scatter")
GATHERS = ("allgather", "alltoall", "bucket_allgather")
RESHAPING = ("reshape", "rearrange", "rename", "concat", "slice")
TEXTBOOK_PER_LAYER = 2   # Megatron: one allreduce per row-parallel matmul (forward), one per column-parallel input (backward)


def model_paths() -> list[Path]:
    """The shipped models, then the held-out ones."""
    shipped = sorted(p for p in (ROOT / "models").glob("*.py") if p.name != "__init__.py")
    return shipped + sorted((ROOT / "tests").glob("heldout_*.py"))


@dataclass
class Row:
    """One collective as the audit lists it."""

    kind: str
    axes: tuple
    times: int
    bytes: int           # per rank per step: bytes of one run times the runs
    phase: str
    op: str
    label: str
    note: str
    flags: list = field(default_factory=list)


@dataclass
class Audit:
    """One (model, layout): its collectives, or why it did not compile."""

    model: str
    layout: str
    mesh: str
    rules: str
    rows: list = field(default_factory=list)
    error: str = ""

    @property
    def count(self) -> int:
        return sum(r.times for r in self.rows)

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def flagged(self) -> list:
        return [r for r in self.rows if r.flags]


def layouts_of(model, outputs) -> list[tuple[str, str, str]]:
    """``(name, mesh, layout)`` of each standard layout the model has the dims for."""
    prof = profile(outputs)
    param_bytes: dict[str, int] = {}
    for p in model.params.values():
        for d in p.shape.names:
            param_bytes[d] = param_bytes.get(d, 0) + p.shape.numel * p.dtype.itemsize
    pair = MEGATRON if all(d in prof.dims for d in MEGATRON) else megatron_dims(model.loss, param_bytes, prof)
    out = []
    if "batch" in prof.dims:
        out.append(("dp", "data:2", "batch:data"))
    if len(pair) == 2:
        out.append(("megatron", "model:2", f"{pair[0]}:model; {pair[1]}:model"))
    if "seq" in prof.dims:
        out.append(("seq", "model:2", "seq:model"))
    reserved = {"batch", "layer", *prof.layer_dims, *prof.batch_like}
    dims = sorted((d for d in param_bytes if d not in reserved), key=lambda d: (-param_bytes[d], d))
    fsdp = "d_model" if "d_model" in dims else next(iter(dims), None)
    if "batch" in prof.dims and fsdp is not None:
        out.append(("fsdp", "data:2", f"batch:data; params.{fsdp}:data"))
    return out


def _plans(plan: Plan, outer: frozenset = frozenset()):
    """``(plan, runs, from_params)`` of the plan and each sub-plan, with how often it runs per
    step and its values computed from params alone (:func:`_from_params`)."""
    mine = _from_params(plan, outer)
    yield plan, 1, mine
    for s in plan.steps:
        for k, sub in enumerate(s.subplans):
            # a sub-plan's inputs are its step's inputs, in order (a layer's slice of a stacked param)
            bound = list(sub.inputs.values())
            inner = frozenset(b for b, v in zip(bound, s.ins) if v in mine) if len(bound) == len(s.ins) \
                else frozenset()
            for p, n, params in _plans(sub, inner):
                yield p, n * s.runs(k), params


def _from_params(plan: Plan, bound: frozenset) -> frozenset:
    """The values of ``plan`` computed from params (or ``bound``: its inputs that are) and
    constants alone, no input read on the way."""
    out: set[int] = set()
    for s in plan.steps:
        if s.kind == "param" or (s.kind == "input" and set(s.outs) <= bound) or \
                (s.kind != "input" and not s.subplans and all(v in out for v in s.ins)):
            out.update(s.outs)
    return frozenset(out)


def _readers(plan: Plan) -> dict[int, list]:
    out: dict[int, list] = {}
    for s in plan.steps:
        for v in s.ins:
            out.setdefault(v, []).append(s)
    return out


def _scalar(plan: Plan, v: int) -> bool:
    return plan.values[v].shape.numel == 1


def _has(plan: Plan, v: int, dims) -> bool:
    return bool(set(plan.values[v].shape.names) & dims)


def _rules(name: str, plan: Plan, s, readers, seen, batch_like, from_params=frozenset()) -> list[str]:
    """The flags of collective step ``s`` of ``plan`` under standard layout ``name``
    (``from_params``: the values of ``plan`` computed from params alone)."""
    flags = []
    gathers = s.kind in GATHERS
    if name in ("dp", "fsdp") and "data" in s.axes:
        grad = s.kind in REDUCTIONS and s.phase in ("backward", "update") and \
            not any(_has(plan, v, batch_like) for v in s.ins)
        param = name == "fsdp" and s.kind in ("allgather", "bucket_allgather") and \
            not any(_has(plan, v, batch_like) for v in s.ins)
        # params.X:data splits each param's X: a sum over X of a value made from params alone is partial
        of_params = name == "fsdp" and s.kind in REDUCTIONS and all(v in from_params for v in s.ins)
        if not (grad or param or of_params or all(_scalar(plan, v) for v in s.ins)):
            flags.append("dp: not a gradient, scalar, param gather or reduction of a param-only value")
    if name == "megatron" and s.kind not in ("allreduce", "bucket_allreduce"):
        flags.append(f"megatron: {s.kind}")
    if s.kind in ("allgather", "bucket_allgather") and any(r.kind == "split" and set(r.axes) & set(s.axes)
                                     for v in s.outs for r in readers.get(v, ())):
        flags.append("gather+slice: gathered, then cut back")
    # (a bucket of gathers made back to back, lowering/coalesce.py: its note keeps each member's)
    if gathers and s.op in RESHAPING and (s.note.startswith("re-layout input") or ": re-layout input" in s.note):
        flags.append(f"reshape: {s.op} gathers its input")
    key = (s.kind, s.axes, s.ins, tuple(sorted((k, str(v)) for k, v in s.args.items())))
    if key in seen:
        flags.append("duplicate: the same value moved twice")
    seen.add(key)
    outputs = set(plan.outputs.values())
    if s.outs and not any(v in outputs or readers.get(v) for v in s.outs):
        flags.append("unused: nothing reads the result")
    return flags


def audit_plan(model: str, name: str, mesh: str, rules: str, plan: Plan, batch_like) -> Audit:
    """Every collective of ``plan``, flagged by the rules of standard layout ``name``."""
    a = Audit(model, name, mesh, rules)
    for sub, runs, from_params in _plans(plan):
        readers, seen = _readers(sub), set()
        in_loop = sub is not plan
        per_phase: dict[str, list] = {}
        for s in sub.steps:
            if not s.is_collective:
                continue
            row = Row(s.kind, s.axes, runs, runs * s.bytes, s.phase, s.op, s.label, s.note,
                      _rules(name, sub, s, readers, seen, batch_like, from_params))
            a.rows.append(row)
            if name == "megatron" and in_loop and "model" in s.axes:
                per_phase.setdefault(s.phase, []).append(row)
        for phase, rows in per_phase.items():   # one run of a layer body is one layer
            if phase in ("forward", "backward") and len(rows) > TEXTBOOK_PER_LAYER:
                for r in rows:
                    r.flags.append(f"megatron: {len(rows)} collectives per layer in the {phase}")
    return a


def audit_model(path: Path, only=None) -> list[Audit]:
    """Each standard layout's audit of the model at ``path`` (tiny config)."""
    name = path.stem
    try:   # a model that does not build is one row of the table, not the end of the audit
        model = md.load_model(str(path), tiny=True)
        outputs = step_outputs(model.loss, model.params, 0.1, updates=model.updates)   # the step `train` runs
    except md.MeshDSLError as e:
        what = [ln for ln in str(e).splitlines() if ln and not ln.startswith((" ", "while building"))]
        return [Audit(name, "build", "", "", error=(what or [str(e)])[0])]   # (the error, not the traceback's lines)
    batch_like = set(profile(outputs).batch_like)
    out = []
    for lay, mesh, rules in layouts_of(model, outputs):
        if only and lay not in only:
            continue
        try:
            plan = md.compile(outputs, mesh, rules)
        except md.MeshDSLError as e:
            out.append(Audit(name, lay, mesh, rules, error=str(e).splitlines()[0]))
            continue
        out.append(audit_plan(name, lay, mesh, rules, plan, batch_like))
    return out


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def print_summary(audits: list[Audit]) -> None:
    """One line per (model, layout): collectives and bytes per step per rank, flagged ones."""
    print(f"{'model':22s} {'layout':8s} {'rules':36s} {'collectives':>11s} {'bytes/step':>10s} {'flagged':>7s}")
    for a in audits:
        if a.error:
            print(f"{a.model:22s} {a.layout:8s} {a.rules:36s} refused: {a.error[:60]}")
            continue
        print(f"{a.model:22s} {a.layout:8s} {a.rules:36s} {a.count:11d} {_size(a.bytes):>10s} {len(a.flagged):7d}")
    ok = [a for a in audits if not a.error]
    print(f"{len(ok)} plans of {len({a.model for a in audits})} models: {sum(a.count for a in ok)} collectives, "
          f"{_size(sum(a.bytes for a in ok))} per rank per step, {sum(len(a.flagged) for a in ok)} flagged")


def print_detail(audits: list[Audit], show_all: bool) -> None:
    """Each flagged collective (``show_all``: every one) with the plan's note and the flags."""
    print("\n" + ("collectives" if show_all else "flagged collectives"))
    for a in audits:
        for r in (a.rows if show_all else a.flagged):
            print(f"  {a.model} [{a.layout}] {r.kind}({','.join(r.axes)}) x{r.times} {_size(r.bytes)} "
                  f"{r.phase} {r.label}: {r.note or '(no note)'}\n      -> {'; '.join(r.flags) or '-'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", help="comma-separated file stems (default: every model)")
    ap.add_argument("--layouts", help="comma-separated of dp, megatron, seq, fsdp (default: all)")
    ap.add_argument("--flagged", action="store_true", help="list each flagged collective after the table")
    ap.add_argument("--all", action="store_true", help="list every collective after the table")
    ap.add_argument("--json", help="also write the audit to this JSON file")
    args = ap.parse_args(argv)
    paths = model_paths()
    if args.models:
        want = set(args.models.split(","))
        paths = [p for p in paths if p.stem in want]
    only = set(args.layouts.split(",")) if args.layouts else None
    audits = [a for p in paths for a in audit_model(p, only)]
    print_summary(audits)
    if args.flagged or args.all:
        print_detail(audits, args.all)
    if args.json:
        Path(args.json).write_text(json.dumps([{**a.__dict__, "rows": [r.__dict__ for r in a.rows]}
                                               for a in audits], indent=1, default=list))
    return 0


if __name__ == "__main__":
    sys.exit(main())
