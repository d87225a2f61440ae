"""Which dims the layout search splits over each axis role, and why.

Every dim of the training step's graph is a candidate (params, inputs, activations,
the dims inside ``repeat`` blocks), none by its name alone:

* ``data`` axis: the examples' dim (data parallel: ``batch``, or the user's name for it read off
  the graph, :mod:`meshdsl.core.examples`), and the params' storage split along one of
  their dims (FSDP ``params.X``; ZeRO-1/2 ``opt.X``, ``grads.X`` with optimizer state),
  ranked by the share of the param bytes they shard; ``experts`` (or the dim a dispatch's rename
  makes, :func:`expert_dims`) with it (expert parallel) where the model has it;
* ``model`` axis: any other dim, alone, or two that no tensor holds together (a
  Megatron-style pair), ranked by :func:`.estimate.estimate` (kernels and bytes moved
  with that split alone); not ``batch`` nor a dim renamed from it (the micro-batches
  split those);
* ``pipe`` axis: the dim a ``repeat`` scans over, with each schedule (:data:`SCHEDULES`, and
  :data:`VIRTUAL_SCHEDULES` where they fit).

Per axis size the best :data:`MODEL_KEEP` dims, :data:`PAIR_KEEP` pairs (that
estimate no worse than those dims alone) and :data:`FSDP_KEEP` param dims are kept,
with the seeds (the families known to work: DP, Megatron on ``heads`` and ``d_ff`` (in a model
with other names, the two dims a weight's matmul makes and another contracts: :func:`megatron_dims`),
FSDP on ``d_model``, ``seq`` (or :func:`sequence_dims`), ``experts``, the pipeline) and the dims the caller
names (``split_dims``, and their pairs); the others are pruned by cost, and a dim in
``no_split`` is never split.  A dim the axis does not divide is split unevenly
(:mod:`meshdsl.lowering.uneven`: the first ``size % k`` parts one longer), ranked by the same
estimate, which prices its largest part (the others idle that long: the waste); with strict
splits (``strict=True``, ``--strict-splits``), or where a part would be empty, it stays in
the space as "not divisible" (its candidates are invalid).  Each choice is a :class:`Verdict`
with its figure, for ``meshdsl search --explain``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..errors import LayoutError, did_you_mean, message
from ..lowering.schedule_gen import parse_schedule
from .calibrate import Calibration
from .estimate import NO_WORK, Estimate, Profile, estimate, profile

MICROBATCHES = (2, 4, 8)
SCHEDULES = ("gpipe", "1f1b", "zbh1")
#: Schedules with virtual stages, offered where each rank's layers cut into their chunks and the
#: micro-batches come in whole groups of the pipe axis (interleaved 1F1B, and with its Ws placed
#: by simulation, ``lowering/w_placement.py``).
VIRTUAL_SCHEDULES = ("interleaved:2", "interleaved-zb:2")
#: Best single dims kept per model axis size, beside the seeds.
MODEL_KEEP = 3
#: Best pairs of dims kept per model axis size, beside Megatron's and the named ones (a pair is
#: kept only if its estimate is no worse than the worst dim kept alone).
PAIR_KEEP = 1
#: Param dims FSDP keeps per data axis size (the ones that shard the most bytes).
FSDP_KEEP = 2
MEGATRON = ("heads", "d_ff")
#: Dims always offered on a model axis (sequence and expert parallelism).
MODEL_SEEDS = ("seq", "experts")
#: The name a layout rule reserves for a pipeline (``lowering/pipeline.py``).
LAYER = "layer"


@dataclass(frozen=True)
class Option:
    """One layout option of an axis: its rules, a family name, and what it splits.

    ``pruned`` says why the search does not compile it (by cost); None: it is kept.
    """

    rules: str
    name: str
    split: str
    microbatches: int = 1
    schedule: str = ""
    pruned: str | None = None


@dataclass(frozen=True)
class Verdict:
    """What the search made of splitting ``split`` (``"kv_heads"``, ``"heads+d_ff"``,
    ``"params.d_model"``) over an axis of ``size`` in ``role``: kept or not, and why."""

    role: str
    size: int
    split: str
    kept: bool
    why: str
    rules: str = ""


class Splits:
    """The options of each axis role for one model and job, with the verdicts behind them.

    Build with :meth:`of`.  ``options(role, size, per_replica)`` lists an axis's options
    (pruned ones too, marked); ``verdicts(role, size)`` says why each dim was or was not kept.
    """

    def __init__(self, prof: Profile, param_bytes: dict[str, int], total_param_bytes: int, cal: Calibration,
                 job: int, stateful: bool, split_dims: tuple[str, ...] = (), no_split: tuple[str, ...] = (),
                 strict: bool = False):
        self.prof, self.cal, self.job, self.stateful = prof, cal, job, stateful
        #: refuse uneven splits (a dim an axis does not divide), as ``compile(strict_splits=True)``
        self.strict = bool(strict)
        self.dims = prof.dims
        self.forced, self.banned = tuple(split_dims), frozenset(no_split)
        self.param_bytes = param_bytes   # dim -> bytes of the params that hold it
        self.total_param_bytes = max(1, total_param_bytes)
        self._memo: dict = {}
        #: the Megatron pair: ``heads`` and ``d_ff`` where the model has them, else the pair
        #: found in its forward graph (:func:`megatron_dims`, set by ``of``)
        self.megatron: tuple[str, ...] = MEGATRON
        #: the sequence-parallel seeds beside ``seq``: :func:`sequence_dims` (set by ``of``)
        self.sequence: set[str] = set()
        #: the expert-parallel dims: ``experts``, or in a model without it :func:`expert_dims` (set by ``of``)
        self.experts: tuple[str, ...] = ("experts",)

    @classmethod
    def of(cls, model, outputs, cal: Calibration, job: int, stateful: bool,
           split_dims=(), no_split=(), strict: bool = False) -> "Splits":
        """The splits of ``model``'s training step ``outputs`` on ``job`` processes (``strict``:
        without uneven splits).

        Raises:
          LayoutError: ``split_dims`` or ``no_split`` names a dim the model does not have, or
            the same dim twice.
        """
        prof = profile(outputs)
        split_dims, no_split = tuple(split_dims or ()), tuple(no_split or ())
        _check_names(prof.dims, split_dims, no_split)
        param_bytes: dict[str, int] = {}
        sizes = [(p.shape.names, p.shape.numel * p.dtype.itemsize) for p in model.params.values()]
        for names, nbytes in sizes:
            for d in names:
                param_bytes[d] = param_bytes.get(d, 0) + nbytes
        made = cls(prof, param_bytes, sum(b for _, b in sizes), cal, job, stateful, split_dims, no_split, strict)
        if not all(d in prof.dims for d in MEGATRON):   # the usual names: as before; any others: the graph's
            made.megatron = megatron_dims(model.loss, param_bytes, prof)
        forward = profile([model.loss]) if "seq" not in prof.dims or "experts" not in prof.dims else None
        if "seq" not in prof.dims:
            made.sequence = sequence_dims(forward)
        if "experts" not in prof.dims:
            made.experts = expert_dims(forward)
        return made

    def estimate(self, split: tuple[str, ...], k: int) -> Estimate:
        key = ("est", split, k)
        if key not in self._memo:
            self._memo[key] = estimate(self.prof, split, k, self.cal, self.job)
        return self._memo[key]

    def options(self, role: str, size: int, per_replica: int = 1) -> list[Option]:
        """The options of an axis of ``size`` in ``role`` (the pipe role's depend on the batch
        per data replica, ``per_replica``, which its micro-batches must divide)."""
        if role == "pipe":
            return self._pipe(size, per_replica)[0]
        return self._role(role, size)[0]

    def verdicts(self, role: str, size: int) -> list[Verdict]:
        """Why each dim was or was not kept on an axis of ``size`` in ``role``."""
        return self._pipe(size, 0)[1] if role == "pipe" else self._role(role, size)[1]

    def _role(self, role: str, size: int):
        key = (role, size)
        if key not in self._memo:
            self._memo[key] = self._data(size) if role == "data" else self._model(size)
        return self._memo[key]

    # ------------------------------------------------------------------ roles

    def _eligible(self, d: str) -> bool:
        return d in self.dims and d not in self.banned and self.dims[d] > 1

    def _divides(self, d: str, k: int) -> bool:
        """``d`` can be split ``k`` ways: evenly, or unevenly (without strict splits) with no part empty."""
        n = self.dims[d]
        return n % k == 0 or (not self.strict and n >= k)

    def _indivisible(self, d: str, k: int) -> str:
        """Why ``d`` cannot be split ``k`` ways (``_divides`` is False)."""
        n = self.dims[d]
        return f"not divisible: size {n} by {k}" + (" (strict splits: no uneven split)" if n >= k else "")

    def uneven(self, d: str, k: int) -> str:
        """What splitting ``d`` unevenly ``k`` ways wastes, for a verdict (``""`` when ``k`` divides it)."""
        return uneven_note(self.dims[d], k) if self.dims[d] % k else ""

    def _data(self, k: int):
        """DP, ZeRO-1/2 and FSDP over the param dims sharding the most bytes, expert parallel,
        each beside DP on the examples' dim (``batch``, or the user's name for it)."""
        b = self.prof.examples
        if b is None or not self._eligible(b):
            why = ("no examples' dim: no input dim that no param holds" if b is None else
                   "excluded (no_split)" if b in self.banned else f"size {self.dims[b]}")
            return [], [Verdict("data", k, b or "batch", False, why)]
        opts = [Option(f"{b}:data", "DP", b)]
        verdicts = [Verdict("data", k, b, self._divides(b, k),
                            f"seed: data parallel{_with(self.uneven(b, k))}" if self._divides(b, k)
                            else self._indivisible(b, k), f"{b}:data")]
        reserved = {b, LAYER, *self.prof.layer_dims}
        dims = sorted((d for d in self.param_bytes if self._eligible(d) and d not in reserved),
                      key=lambda d: (-self.param_bytes[d], d))
        ranked = [d for d in dims if self._divides(d, k)]
        best = ranked[:FSDP_KEEP]
        fsdp = []
        for d in dims:
            share = f"shards {self.param_bytes[d] / self.total_param_bytes:.0%} of the param bytes"
            name, rules = ("FSDP" if d == "d_model" else f"FSDP({d})"), f"{b}:data; params.{d}:data"
            pruned = None
            share += _with(self.uneven(d, k)) if self._divides(d, k) else ""
            if not self._divides(d, k):
                why = self._indivisible(d, k)
            elif d == "d_model":
                why = f"seed: FSDP, {share}"
            elif d in self.forced:
                why = f"named by split_dims, {share}"
            elif d in best:
                why = f"kept: {share}, among the {FSDP_KEEP} that shard the most"
            else:
                floor = self.param_bytes[best[-1]] / self.total_param_bytes
                why = pruned = (f"pruned by cost: {share}; FSDP keeps the {FSDP_KEEP} that shard the most "
                                f"(at least {floor:.0%})")
            fsdp.append(Option(rules, name, f"params.{d}", pruned=pruned))
            verdicts.append(Verdict("data", k, f"params.{d}", pruned is None and self._divides(d, k), why, rules))
        zero = "d_model" if "d_model" in dims else next(iter(ranked), None)
        if self.stateful and zero is not None:
            tag = "" if zero == "d_model" else f"({zero})"
            for name, rules in ((f"ZeRO-1{tag}", f"{b}:data; opt.{zero}:data"),
                                (f"ZeRO-2{tag}", f"{b}:data; opt.{zero}:data; grads.{zero}:data")):
                opts.append(Option(rules, name, rules.rsplit("; ", 1)[-1].split(":")[0]))
                verdicts.insert(len(opts) - 1, Verdict("data", k, opts[-1].split, self._divides(zero, k),
                                        f"seed: {name}{_with(self.uneven(zero, k))}" if self._divides(zero, k) else
                                        self._indivisible(zero, k), rules))
        opts += fsdp
        for x in self.experts:
            if self._eligible(x):
                opts.append(Option(f"{b}:data; {x}:data", "DP+EP", x))
                verdicts.append(Verdict("data", k, x, True, "seed: expert parallel", f"{b}:data; {x}:data"))
        return opts, verdicts

    def _model(self, k: int):
        """Megatron, then every other dim alone or in a pair, best estimate first."""
        reserved = {LAYER, *self.prof.layer_dims, *self.prof.batch_like}
        singles = [d for d in self.dims if self._eligible(d) and d not in reserved]
        kept, bar, scored, cut, tail = self._singles(singles, k)
        head: list[tuple[Option, Verdict]] = []
        pair = self.megatron
        if len(pair) == 2 and all(self._eligible(d) for d in pair):
            rules, split = "; ".join(f"{d}:model" for d in pair), "+".join(pair)
            fits = all(self._divides(d, k) for d in pair)
            uneven = "; ".join(filter(None, (self.uneven(d, k) for d in pair))) if fits else ""
            why = "seed: Megatron" + (f", {uneven}" if uneven else "") + \
                (f", {self.estimate(pair, k).describe()}" if fits else
                 ", " + "; ".join(self._indivisible(d, k) for d in pair if not self._divides(d, k)))
            head.append((Option(rules, "TP(megatron)", split), Verdict("model", k, split, True, why, rules)))
        conflicts = self._pairs(kept, k, bar, scored, cut)
        scored.sort(key=lambda s: (s[0], s[1].rules))
        cut.sort(key=lambda s: (s[0], s[1].rules))
        ordered = head + [(o, v) for _, o, v in scored + cut] + tail
        return [o for o, _ in ordered if o is not None], [v for _, v in ordered] + conflicts

    def _singles(self, singles: list[str], k: int):
        """The dims kept alone on a model axis of ``k`` (seeds, named, the best few), the worst
        estimate kept by rank (the bar a pair must meet), and the scored, cut and indivisible options."""
        fits = sorted((d for d in singles if self._divides(d, k)), key=lambda d: (self.estimate((d,), k).total_s, d))
        seeds = set(MODEL_SEEDS) | self.sequence
        seeded = seeds | set(self.forced)
        kept = [d for d in fits if d in seeded] + [d for d in fits if d not in seeded][:MODEL_KEEP]
        ranked = [self.estimate((d,), k).total_s for d in kept if d not in seeded]
        bar = max(ranked or [self.estimate((d,), k).total_s for d in kept] or [0.0])
        scored, cut = [], []
        tail = [(None, Verdict("model", k, d, False, "excluded (no_split)")) for d in sorted(self.banned)]
        for d in singles:
            rules, name = f"{d}:model", f"TP({d})"
            if not self._divides(d, k):
                why = self._indivisible(d, k)
                tail.append((Option(rules, name, d), Verdict("model", k, d, False, why, rules)))
                continue
            est, uneven = self.estimate((d,), k), _with(self.uneven(d, k))
            if d in kept:
                why = ("seed" if d in seeds else "named by split_dims" if d in self.forced else "kept") + \
                    f"{uneven}: {est.describe()}"
                scored.append((est.total_s, Option(rules, name, d), Verdict("model", k, d, True, why, rules)))
            else:
                why = (f"pruned by cost{uneven}: {est.describe()}, over {bar * 1e3:.2f} ms (the worst of the "
                       f"{MODEL_KEEP} dims kept)")
                cut.append((est.total_s, Option(rules, name, d, pruned=why), Verdict("model", k, d, False, why, rules)))
        return kept, bar, scored, cut, tail

    def _pairs(self, kept: list[str], k: int, bar: float, scored: list, cut: list) -> list[Verdict]:
        """Score the pairs of kept dims that no tensor holds together into ``scored`` / ``cut``:
        a pair of dims named by split_dims is kept; else the best :data:`PAIR_KEEP` whose estimate
        is at most ``bar`` (a pair must compete with the dims kept alone).  Returns the conflicts."""
        pairs, conflicts = [], []
        for a, b in itertools.combinations(kept, 2):
            if {a, b} == set(self.megatron):
                continue
            where = self.prof.together(a, b)
            if where is not None:
                conflicts.append(Verdict("model", k, f"{a}+{b}", False, f"conflict: tensor {where} holds both"))
            else:
                pairs.append(((a, b), self.estimate((a, b), k)))
        pairs.sort(key=lambda p: (p[1].total_s, p[0]))
        ranked = 0
        for (a, b), est in pairs:
            rules, split = f"{a}:model; {b}:model", f"{a}+{b}"
            named = a in self.forced and b in self.forced
            uneven = "; ".join(filter(None, (self.uneven(d, k) for d in (a, b))))
            uneven = f" ({uneven})" if uneven else ""
            if named or (ranked < PAIR_KEEP and est.total_s <= bar):
                ranked += 0 if named else 1
                why = ("named by split_dims" if named else "kept") + f"{uneven}: {est.describe()}"
                scored.append((est.total_s, Option(rules, f"TP({split})", split),
                               Verdict("model", k, split, True, why, rules)))
                continue
            why = (f"pruned by cost{uneven}: {est.describe()}, over " +
                   (f"{bar * 1e3:.2f} ms (the worst dim kept alone)" if est.total_s > bar else
                    f"the {PAIR_KEEP} better pair{'s' if PAIR_KEEP > 1 else ''} kept"))
            cut.append((est.total_s, Option(rules, f"TP({split})", split, pruned=why),
                        Verdict("model", k, split, False, why, rules)))
        return conflicts

    def _pipe(self, k: int, per_replica: int):
        key = ("pipe", k, per_replica)
        if key not in self._memo:
            opts, verdicts = [], []
            for layer in self.prof.layer_dims:
                if layer in self.banned:
                    verdicts.append(Verdict("pipe", k, layer, False, "excluded (no_split)"))
                    continue
                verdicts.append(Verdict("pipe", k, layer, True, "seed: pipeline", f"{layer}:pipe"))
                tag = "" if layer == LAYER else f"{layer},"
                for m in MICROBATCHES:
                    if per_replica % m == 0:
                        for sched in SCHEDULES + virtual_schedules(self.dims[layer], k, m):
                            opts.append(Option(f"{layer}:pipe", f"PP({tag}m={m},{sched})", layer, m, sched))
            self._memo[key] = opts, verdicts
        return self._memo[key]


def megatron_dims(loss, param_bytes: dict[str, int], prof: Profile) -> tuple[str, ...]:
    """The dims a Megatron split takes, found in the forward graph of ``loss``, not by name.

    A dim qualifies when a matmul makes it from a weight (an operand with no batch dim: the
    column-parallel matmul, q's heads, the MLP's hidden units) and a matmul contracts it with a
    weight (the row-parallel one), and no other op keeps it whole or reduces over it (a norm,
    a softmax, the loss, an attention's feature dim, a product of two activations): split, it
    then costs one partial sum at its contraction.  Of those, the two holding the most param
    bytes that no tensor holds together (``heads`` and ``d_ff`` in a transformer, whatever
    their names), or ``()`` with fewer than two.
    """
    from ..core.graph import topo_nodes
    from .predict import MATMUL_OPS
    batch = set(prof.batch_like)
    made, contracted, blocked = set(), set(), set()

    def walk(nodes) -> None:
        for n in nodes:
            subs = n.op.subgraphs(n)
            if subs:
                for graph, _ in subs:
                    walk(graph.nodes)
                continue
            ins = [set(t.shape.names) for t in n.inputs]
            out = set().union(*(t.shape.names for t in n.outputs)) if n.outputs else set()
            if n.op.name in MATMUL_OPS and len(ins) == 2:
                weights = [d for d in ins if not d & batch]
                acts = [d for d in ins if d & batch]
                if len(weights) == 1 and len(acts) == 1:
                    made.update((weights[0] & out) - acts[0])
                    contracted.update((weights[0] & acts[0]) - out)
                else:   # two activations (q . k) or two weights: a dim contracted there is summed whole
                    blocked.update((ins[0] & ins[1]) - out)
                continue
            if n.op.name in NO_WORK:
                continue
            spec = n.op.spec(n)
            blocked.update(spec.fixed, spec.reduce)

    walk(topo_nodes([loss]))
    reserved = {LAYER, *prof.layer_dims, *batch}
    found = sorted((d for d in param_bytes if d in made & contracted and d not in blocked | reserved),
                   key=lambda d: (-param_bytes[d], d))
    pair: list[str] = []
    for d in found:
        if all(prof.together(d, other) is None for other in pair):
            pair.append(d)
        if len(pair) == 2:
            break
    return tuple(pair) if len(pair) == 2 else ()


def sequence_dims(prof: Profile) -> set[str]:
    """The dims sequence parallelism splits, read off the forward graph's profile ``prof``, not by
    the name ``seq``: a dim that a ``rename`` makes another of (the keys of attention, ``T -> Tk``)
    where an op then computes over both (the attention, or its scores ``[.., T, Tk]``); the
    examples' dims (renamed for experts) are not."""
    renamed = {(comp, name) for w in prof.works for names, computed, _ in w.outs
               for name, comp in zip(names, computed) if name != comp and comp not in prof.batch_like}
    return {a for a, b in renamed if any(a in w.dims and b in w.dims for w in prof.works)}


def expert_dims(prof: Profile) -> tuple[str, ...]:
    """The dims expert parallelism splits beside the examples' dim, read off the forward graph's
    profile ``prof``, not by the name ``experts``: the dims a ``rename`` makes of others where it
    renames the examples' dim away (Mesh-TensorFlow's dispatch, ``[gate_experts, batch, ..] ->
    [experts, expert_batch, ..]``: the data axis moves from the examples to the experts)."""
    found: list[str] = []
    for w in prof.works:
        for names, computed, _ in w.outs:
            pairs = [(n, c) for n, c in zip(names, computed) if n != c]
            if any(c == prof.examples for _, c in pairs):
                # a dim renamed to the examples' own name (a contrastive loss's logits transposed,
                # ``[batch, pair] -> [img_row, batch]``) is the examples again, not experts
                found += [n for n, c in pairs if c != prof.examples and n != prof.examples and n not in found]
    return tuple(found)


def virtual_schedules(layers: int, k: int, m: int) -> tuple[str, ...]:
    """The schedules of :data:`VIRTUAL_SCHEDULES` that run ``layers`` on a pipe axis of ``k``
    with ``m`` micro-batches: v chunks of equal layers per rank, micro-batches in groups of k."""
    return tuple(s for s in VIRTUAL_SCHEDULES if layers % (k * parse_schedule(s)[1]) == 0 and m % k == 0)


def uneven_note(n: int, k: int) -> str:
    """A dim of size ``n`` split unevenly ``k`` ways, and its waste: e.g. for 257 over 4,
    ``"uneven split 257/4: parts of 65 and 64, the largest 1.2% over an even share"``.  Every
    rank runs as long as the largest part (and holds that much), so the waste is its excess."""
    hi, lo = -(-n // k), n // k
    return f"uneven split {n}/{k}: parts of {hi} and {lo}, the largest {hi * k / n - 1:.1%} over an even share"


def _with(note: str) -> str:
    return f" ({note})" if note else ""


def _check_names(dims: dict, split_dims: tuple, no_split: tuple) -> None:
    bad = [f"'{d}' is not a dim of the model.{did_you_mean(d, dims)}" for d in (*split_dims, *no_split)
           if d not in dims]
    both = sorted(set(split_dims) & set(no_split))
    bad += [f"'{d}' is both in split_dims and in no_split" for d in both]
    if bad:
        raise LayoutError(message(
            "search: split_dims / no_split (--split-dims / --no-split) name dims the search cannot use.",
            inputs=[f"split_dims: {list(split_dims)}", f"no_split: {list(no_split)}",
                    f"the model's dims: {', '.join(sorted(dims))}"],
            bullets=bad, rule="name dims of the model's graph, each in one list at most",
            fix="name dims from the list above, each once"))
