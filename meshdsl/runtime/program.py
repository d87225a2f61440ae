"""A plan's issue order as one generated Python function: the executor's straight-line program.

The interpreted loop (``Executor.run`` with ``stats``) calls one prepared closure per step and
keeps every value in a dict.  Here the same steps become the lines of one function, generated
once per executor from the plan (from step indices and value ids only, never from a user's
string) and compiled with Python's ``compile()`` (its code object cached by source text, :func:`_code_of`):

* a local step is one kernel call on Python locals, one per held rank
  (``v12_0 = K3(C3_0, A3, v10_0, v11_0)``, or ``K3(v10_0, v11_0)`` where the op's kernel reads
  no context: ``Op.direct_for``, bound to the rank's local shapes, which the plan fixes: an
  einsum's matmul generated for them, an elementwise op's torch function, an add into one of
  its operands); an identity kernel (``stop_gradient``, ``rename``) is an alias; params and feeds are read
  straight from the run's dicts;
* a local step whose call a loop replaced (a gradient's matmul writing into the loop's stacked
  buffer: :func:`.deferred.install`) calls the per-rank kernel the new call carries, inline too;
* every other step (collectives, loops, pipelines) calls its prepared rule with the ``env``
  dict: the locals it reads are written to ``env`` just before, and what it makes is read back
  (waiting, if it is in flight, unless its call says its results never are: ``call.settled``)
  just before its first local reader, so communication still overlaps the compute the issue
  order put before that read;
* each value is dropped after its last reader, as the interpreted loop does.

With ``--compile`` (:mod:`.compiled`), runs of consecutive local steps become segments: each one
function, traced and compiled by ``torch.compile``, called from the program like a kernel.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..comm.communicator import Pending
from ..core.lru import Lru
from ..ops.inplace import direct_add
from ..ops.registry import OPS, Op
from .context import PerRank
from .steps import local_kernel

#: local ops whose kernel returns its input unchanged: the program binds the same tensor
ALIASES = frozenset({"stop_gradient", "rename"})
#: step kinds whose result is never in flight
_LEAVES = frozenset({"input", "param"})


@dataclass
class Unit:
    """One line group of the program: ``kind`` 'local' (an inline kernel, ``steps == [i]``),
    'segment' (local steps run as one compiled function, ``run``), 'leaf' (a param or input
    read from the run's dicts), 'rank' (a local step whose call a loop replaced by one with a
    per-rank kernel, inline like 'local') or 'call' (step ``i``'s prepared rule on ``env``)."""

    kind: str
    steps: list
    run: object = None


def _per_rank(call):
    """A replaced call's per-rank kernel ``fn(j, *xs)`` (a loop's sink: :func:`.deferred.install`), or None."""
    return getattr(call, "per_rank", None)


def units_of(ex) -> list[Unit]:
    """The executor's steps in issue order, as units (no segments yet)."""
    steps, rules = ex.plan.steps, ex.rules
    out = []
    for i in ex.order:
        s = steps[i]
        if s.kind == "local" and ex.calls[i] is rules[i]:
            out.append(Unit("local", [i]))
        elif s.kind == "local" and len(s.outs) == 1 and _per_rank(ex.calls[i]) is not None:
            out.append(Unit("rank", [i]))
        elif s.kind in _LEAVES:
            out.append(Unit("leaf", [i]))
        else:
            out.append(Unit("call", [i]))
    return out


def drop(env: dict, v: int) -> None:
    """Forget value ``v`` of ``env``, waiting for it first if it is still in flight."""
    x = env.pop(v, None)
    if isinstance(x, Pending):
        x.wait()


class _Writer:
    """Writes the program's lines, tracking which values are bound to locals and which are in ``env``."""

    def __init__(self, ex, units: list[Unit], ins: tuple = ()):
        self.ex, self.units = ex, units
        self.ins = {name: k for k, name in enumerate(ins)}   # inputs passed as arguments I0, I1, ...
        self.steps = ex.plan.steps
        self.num_ranks = len(ex.comm.ranks)
        self.lines: list[str] = []
        self.consts: dict[str, object] = {"drop": drop, "FEED": ex.ctx.feed, "PerRank": PerRank}
        self.bound: dict[int, list[str]] = {}    # value id -> its local names, one per held rank
        self.in_env: set[int] = set()             # values env holds
        self.from_rule: set[int] = set()          # values a rule made: read back through get
        self.kept = set(ex.plan.outputs.values())
        self.producer = {v: s.kind for s in self.steps for v in s.outs}
        # position of each value's last reading unit; values nobody reads are dropped at once
        self.last: dict[int, int] = {}
        for u_pos, u in enumerate(units):
            for i in u.steps:
                for v in self.steps[i].ins:
                    self.last[v] = u_pos

    def name_of(self, text: str) -> str:
        """The constant that holds a feed's, param's or output's name: names are the user's strings,
        so the source refers to them and never spells them."""
        key = f"N{len(self.consts)}"
        self.consts[key] = text
        return key

    def names(self, v: int) -> list[str]:
        return [f"v{v}_{j}" for j in range(self.num_ranks)]

    def local_shapes(self, vids, j: int) -> tuple:
        """The local shapes of values ``vids`` on held rank ``j`` (the plan's: every run has them)."""
        plan = self.ex.plan
        return tuple(plan.values[v].local_shape(plan.mesh, self.ex.comm.ranks[j]) for v in vids)

    def emit(self, line: str) -> None:
        self.lines.append("    " + line)

    def bind(self, v: int) -> list[str]:
        """The local names of ``v``, read from ``env`` first if need be."""
        names = self.bound.get(v)
        if names is None:
            names = self.bound[v] = self.names(v)
            src = f"get({v})" if v in self.from_rule else f"env[{v}]"
            self.emit(f"{', '.join(names)}, = {src}")
        return names

    def flush(self, v: int) -> None:
        """Put bound value ``v`` into ``env`` (a rule or the caller reads it there)."""
        if v not in self.in_env:
            self.emit(f"env[{v}] = [{', '.join(self.bound[v])}]")
            self.in_env.add(v)

    def free(self, pos: int, made: list[int]) -> None:
        """Drop what unit ``pos`` read last, and what it made that nobody reads."""
        done = [v for v in {v for i in self.units[pos].steps for v in self.steps[i].ins}
                if self.last[v] == pos and v not in self.kept]
        done += [v for v in made if v not in self.last and v not in self.kept]
        for v in sorted(done):
            names = self.bound.pop(v, None)
            if names:
                self.emit(f"del {', '.join(names)}")
            if v in self.in_env:   # (a rule's result read through get is no longer in flight)
                self.emit(f"drop(env, {v})" if v in self.from_rule and not names else f"del env[{v}]")
                self.in_env.discard(v)

    # -- units
    def local(self, i: int) -> list[int]:
        s, n = self.steps[i], self.num_ranks
        ins = [self.bind(v) for v in s.ins]
        outs = [self.names(o) for o in s.outs]
        for o, names in zip(s.outs, outs):
            self.bound[o] = names
        if s.op in ALIASES and len(s.ins) == 1 and s.args["fn"] == OPS[s.op].compute:
            for j in range(n):
                self.emit(f"{outs[0][j]} = {ins[0][j]}")
            return list(s.outs)
        k = local_kernel(self.ex.ctx, i, s)
        op = OPS.get(s.op)
        # the op's plain kernel with its attrs bound, where it reads no ctx: called without its frame,
        # bound per held rank to its inputs' local shapes (the plan fixes them: Op.direct_for)
        if op is None or k.reads_salt:
            direct = None
        elif k.fn == op.compute and type(op).direct_for is Op.direct_for:   # (shapes unread: one for all)
            fn = op.direct(k.attrs)
            direct = None if fn is None else [fn] * len(k.reps)
        elif k.fn == op.compute:
            direct = [op.direct_for(k.attrs, self.local_shapes(s.ins, j), self.local_shapes(s.outs, j))
                      for j in k.reps]
            direct = None if None in direct else direct
        else:   # (an add into one of its operands: ops/inplace.py)
            fn = direct_add(k.fn, k.attrs)
            direct = None if fn is None else [fn] * len(k.reps)
        self.consts[f"K{i}"], self.consts[f"A{i}"] = k.fn, k.attrs
        for r, (j, c) in enumerate(zip(k.reps, k.ctxs)):
            self.consts[f"C{i}_{j}"] = c
            ctx = f"(C{i}_{j}.with_salt(S) if S else C{i}_{j})" if k.reads_salt else f"C{i}_{j}"
            args = ", ".join(x[j] for x in ins)
            if direct:
                kernel = f"K{i}" if r == 0 or direct[r] is direct[0] else f"K{i}_{j}"
                self.consts[kernel] = direct[r]
            call = f"{kernel}({args})" if direct else f"K{i}({ctx}, A{i}, {args})"
            if len(s.outs) == 1:
                self.emit(f"{outs[0][j]} = {call}")
            else:
                self.emit(f"r_ = {call}")
                for o, names in enumerate(outs):
                    self.emit(f"{names[j]} = r_[{o}]")
        if k.of is not None:  # the other held ranks read their representative's result
            for j, r in enumerate(k.of):
                if j != k.reps[r]:
                    for names in outs:
                        self.emit(f"{names[j]} = {names[k.reps[r]]}")
        return list(s.outs)

    def rank(self, i: int) -> list[int]:
        """A replaced local call run inline, one call per held rank: ``v_j = PR(j, ins_j...)``."""
        s = self.steps[i]
        ins = [self.bind(v) for v in s.ins]
        outs = self.bound[s.outs[0]] = self.names(s.outs[0])
        self.consts[f"PR{i}"] = _per_rank(self.ex.calls[i])
        for j in range(self.num_ranks):
            self.emit(f"{outs[j]} = PR{i}({j}, {', '.join(x[j] for x in ins)})")
        return list(s.outs)

    def leaf(self, i: int) -> list[int]:
        s, (o,) = self.steps[i], self.steps[i].outs
        names, name = self.names(o), self.name_of(s.args["name"])
        self.bound[o] = names
        if s.kind == "param":
            self.emit(f"{', '.join(names)}, = P[{name}]")
        elif s.args["name"] in self.ins:   # a loop's body, handed each held rank's tensor (see source_of)
            self.emit(f"{', '.join(names)}, = I{self.ins[s.args['name']]}")
        elif not self.ex.check_feeds and self.ex.device.type == "cpu":  # a loop's body, fed its own tensors
            self.emit(f"x_ = F[{name}]")
            self.emit(f"{', '.join(names)}, = x_ if type(x_) is PerRank else FEED({name}, {o}, x_)")
        else:
            self.emit(f"{', '.join(names)}, = FEED({name}, {o}, F[{name}])")
        return [o]

    def call(self, i: int) -> list[int]:
        s = self.steps[i]
        for v in s.ins:
            if v in self.bound:
                self.flush(v)
        self.consts[f"R{i}"] = self.ex.calls[i]
        line = f"R{i}(env, get, run)"
        if s.is_collective and s.ins and all(self.producer.get(v) == "input" for v in s.ins):
            line = f"if {s.outs[0]} not in env: {line}"   # started ahead by a loop (prefetched)
        self.emit(line)
        settled = getattr(self.ex.calls[i], "settled", False)   # (its results are never in flight)
        for o in s.outs:
            self.in_env.add(o)
            if not settled:
                self.from_rule.add(o)
        return list(s.outs)

    def segment(self, u: Unit) -> list[int]:
        """A compiled segment (:mod:`.compiled`), called once per held rank."""
        made = {o for i in u.steps for o in self.steps[i].outs}
        ins = sorted({v for i in u.steps for v in self.steps[i].ins} - made)
        pos = self.units.index(u)
        outs = [o for i in u.steps for o in self.steps[i].outs
                if o in self.kept or (o in self.last and self.last[o] > pos)]
        u.run.bind(ins, outs)
        names = {v: self.bind(v) for v in ins}
        for o in outs:
            self.bound[o] = self.names(o)
        seg = f"SEG{u.steps[0]}"
        self.consts[seg] = u.run
        for j in range(self.num_ranks):
            call = f"{seg}({', '.join([str(j)] + [names[v][j] for v in ins])})"
            self.emit(f"{''.join(self.bound[o][j] + ', ' for o in outs)}= {call}" if outs else call)
        return sorted(made)

def source_of(ex, units: list[Unit], timed: bool = False, ins: tuple = (),
              outs: tuple | None = None) -> tuple[str, dict]:
    """The program's source text and the constants its lines name.  ``timed``: each unit adds its
    seconds to ``run.stats`` under its step kind, less what it waited for (``stats['wait']``,
    which ``get`` adds to), as the interpreted loop does; a loop or pipeline times its own steps.

    ``ins``: input names whose held ranks' tensors (one list each, already on the executor's
    device, unchecked: a loop's body fed its plan's own tensors) are the arguments after ``run``,
    in this order; ``outs``: output names, returned as a tuple of per-rank lists in this order
    instead of a dict (:class:`.layers` runs a block's layers this way)."""
    w = _Writer(ex, units, ins)
    w.emit("S, F, P = run.salt, run.feeds, run.params")
    if timed:
        w.consts["clock"] = time.perf_counter
        w.emit("ST = run.stats")
    for pos, u in enumerate(units):
        start = len(w.lines)
        made = w.segment(u) if u.kind == "segment" else getattr(w, u.kind)(u.steps[0])
        w.free(pos, made)
        s = ex.plan.steps[u.steps[0]]
        if timed and not s.subplans:
            kind = "local" if u.kind == "segment" else s.kind
            w.lines[start:start] = ['    t_, w_ = clock(), ST.get("wait", 0.0)']
            w.emit(f'ST[{kind!r}] = ST.get({kind!r}, 0.0) + clock() - t_ - (ST.get("wait", 0.0) - w_)')
    # the outputs, each held rank's tensors (read through get where a rule made them: it waits)
    def read(v):
        return f"[{', '.join(w.bound[v])}]" if v in w.bound else f"get({v})"
    if outs is None:
        w.emit(f"return {{{', '.join(f'{w.name_of(name)}: {read(v)}' for name, v in ex.plan.outputs.items())}}}")
    else:
        w.emit(f"return ({''.join(read(ex.plan.outputs[name]) + ', ' for name in outs)})")
    args = "".join(f", I{k}" for k in range(len(ins)))
    return f"def program(env, get, run{args}):\n" + "\n".join(w.lines) + "\n", w.consts


def build(ex, units: list[Unit], timed: bool = False, ins: tuple = (), outs: tuple | None = None):
    """``program(env, get, run) -> {output name: [tensor per held rank]}``: ``units`` as one compiled
    Python function (see :func:`source_of`); with ``ins``, ``program(env, get, run, *per-rank lists)``,
    with ``outs``, the outputs as a tuple."""
    source, consts = source_of(ex, units, timed, ins, outs)
    namespace = dict(consts)
    exec(_code_of(source, f"<meshdsl program of {len(ex.plan.steps)} steps>"), namespace)
    program = namespace.pop("program")   # (its globals holding it back would make a cycle)
    program.source = source
    return program


#: (source, file name) -> its code object, the last 64 compiled: plans of one structure (the
#: same steps and value ids, e.g. one graph under layouts that differ only in which dims they
#: split) write the same source, and Python's compile() is most of a build
_CODE = Lru(64)


def _code_of(source: str, filename: str):
    """``compile(source, filename, "exec")``, cached (a code object is immutable: each
    ``exec`` of it with its own constants makes a function of its own)."""
    return _CODE.get_or_make((source, filename), lambda: compile(source, filename, "exec"))
