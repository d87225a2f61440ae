"""compile(): lower a graph on a mesh with a layout into an SPMD :class:`Plan`.

Nodes are lowered in build order, each by its op's rule (most use the generic
rule in :mod:`.generic`).  Values are re-laid out only where a consumer needs
it (a value made from iota and constants alone is made again there, :mod:`.remake`;
a split tensor that one reader gathers and another reduces around is lowered once more,
every reader knowing of the gather, :mod:`.shared_moves`; a value computed from params alone may
keep its params' layout, :mod:`.param_values`); outputs are brought to their
layout at the end.  Plans are cached on the
graph, the outputs, the mesh and the layout (the last 64 compilations); a
cached plan is immutable, so handing it out again is safe.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

from ..core.graph import Node, Tensor, readers_of, topo_nodes
from ..ir.interpret import outputs_dict
from ..errors import GraphError, LayoutError, message
from ..layout.layout import Layout
from ..layout.mesh import Mesh
from ..layout.sharding import Sharding
from ..ops.arguments import checked_call
from .accumulate import accumulate
from .bucket import DEFAULT_BUCKET_MB, bucket as bucket_steps
from .cost import DEFAULT, CostModel
from .coalesce import coalesce
from .concat import absorbed_parts
from .concat_contract import summing_parts
from .fuse import fuse as fuse_steps
from .cyclic_dims import NotCyclic, store_cyclic
from .dead_moves import live_steps
from .implied import implied_layout
from .lazy_grads import lazy_to_gradients, lazy_to_smaller_sums
from .param_values import better, gathered_in_pieces, least_offered, offering, offers, param_scopes, with_param_targets
from .partition import partition
from .stage_layers import stack_lines
from .pipeline import MB_AXIS, detect as detect_pipeline
from .plan import Plan, Step, Value, called, step_args, written
from .remake import made_from_nothing, remake, remake_cost
from .shared_moves import cheaper, cheaper_packed, foresee, projected_once
from .shared_sums import meeting_sums, moved_around, summed_terms
from .relayout import move_args, move_bytes, plan_moves
from .rules import rule_for
from .uneven import find as find_uneven
from .update_values import passed_on, with_output_targets
from .users_terms import users_terms, with_given


def _summed_reads(nodes, summed) -> dict[int, int]:
    """``id(value) -> reads``: the reads of each value made before the linear ops (add,
    reduce_sum, ...) whose results go only into ``summed`` (a backward block's gradients of
    what it reads from outside, added up over the layers), by those ops.

    A partial sum read there and by another op is then passed on lazily to both: the
    other reduces it where it needs it whole (the carry's gradient, once per layer), the
    sum over the layers reduces its share once after the loop; read as two readers, it
    was reduced at its first one, every layer (DETR's object queries, added to the
    decoder's carry: their gradient's partial sum over ``model``).
    """
    want = {id(t) for t in summed}
    if not want:
        return {}
    readers = readers_of(nodes)
    only: set[int] = set()     # ids of the nodes whose results reach only ``summed``, linearly
    for n in reversed(nodes):
        if n.op.is_linear(n) and all(t.dtype.is_floating_point for t in n.outputs) and all(
                (id(t) in want or readers.get(id(t))) and all(r.id in only for r in readers.get(id(t), ()))
                for t in n.outputs):
            only.add(n.id)
    made_there = {id(t) for n in nodes if n.id in only for t in n.outputs}
    reads: dict[int, int] = {}
    for n in nodes:
        if n.id in only:
            for x in n.inputs:
                if id(x) not in made_there:
                    reads[id(x)] = reads.get(id(x), 0) + 1
    return reads


class Lowerer:
    """State of one compilation: values, steps, and the tensor -> value binding."""

    def __init__(self, mesh: Mesh, layout: Layout, cost: CostModel = DEFAULT):
        self.mesh, self.layout, self.cost = mesh, layout, cost
        self.values: dict[int, Value] = {}
        self.steps: list[Step] = []
        self.env: dict[int, int] = {}  # id(Tensor) -> value id
        self.keep: list[Tensor] = []   # keeps bound tensors alive so ids stay unique
        self.notes: list[str] = []
        self.params: dict[str, int] = {}
        self.inputs: dict[str, int] = {}
        self._targets: dict[int, list] = {}
        self._relaid: dict[tuple[int, Sharding], int] = {}  # a value is re-laid out once per target
        self._held: dict[int, frozenset] = {}   # value -> the shardings it was re-laid out to (_relaid's keys)
        self._made_from: dict[int, int] = {}    # a value relayout made -> the value it was made from
        # id(Tensor) -> shardings it will be brought to anyway, and -> the one sharding its readers
        # move it to (a repeat's block lowered before did so): the generic rule prices the first
        # free, as held, and an output made elsewhere than the second with that move (:mod:`.foresight`)
        self.foreseen: dict[int, frozenset] = {}
        self.wanted: dict[int, Sharding] = {}
        # id(Tensor) -> the number of terms of a sum it is a term of, reduced once (:mod:`.shared_sums`)
        self.shared_sums: dict[int, int] = {}
        # whether a partial input is reduced beside another reduced at the same op, as one packed
        # allreduce; whether the generic rule met an op where that may pay (:func:`.generic.packable`)
        self.pack_reductions = False
        self.packable = False
        # value -> (the step making it from nothing, its node): a constant, an iota, a rotary table
        # computed from them (:mod:`.remake`)
        self.made_from_nothing: dict[int, tuple[Step, Node | None]] = {}
        # Tensors this plan reads: a node with optional outputs (a repeat's saved
        # activations) lowers only the ones in here.
        self.used: set[int] = set()
        self.pipeline_axis: str | None = None  # the mesh axis a repeat's layers are pipelined over
        self.in_block = False  # a repeat's block: it passes partial sums over the micro-batches on
        self._uses: dict[int, int] = {}  # id(Tensor) -> readers in this plan, plus 1 if an output
        self.counted = False
        # ids of a backward block's values passed on lazily, as partial sums, to each of their
        # readers, all linear in them (einsums too): reduced where the readers' results are, not
        # themselves (:func:`.repeat._lazy_through`); whether one was met partial where the rules
        # alone might have chosen otherwise (the block is then lowered without them too).
        self.lazy_through: frozenset[int] = frozenset()
        self.through_used = False
        # What a rule shares between the nodes it lowers (the halo exchanges of lowering/halo.py).
        self.memo: dict = {}
        # id(Tensor) -> its params' scopes and dims, for a value computed from params alone or on its
        # way to their gradients (:mod:`.param_values`)
        self.param_scopes: dict[int, tuple] = {}
        # id(Tensor) -> the outputs that return it unchanged (an update's ``new/<k>``): laid out as
        # they are where nothing else reads it (:mod:`.update_values`)
        self.passed_on: dict[int, list] = {}

    # -- values
    def new_value(self, shape, dtype, sharding: Sharding) -> int:
        vid = len(self.values)
        self.values[vid] = Value(vid, shape, dtype, sharding)
        return vid

    def value(self, t: Tensor) -> int:
        try:
            return self.env[id(t)]
        except KeyError:
            raise GraphError(message(f"compile: {t!r} is used before it is defined in this plan.",
                                     rule="a plan is built from one graph's nodes",
                                     fix="do not mix tensors from different graphs or blocks")) from None

    def count_readers(self, outputs, kept=(), summed=()) -> bool:
        """Count, for :meth:`num_uses`, the readers among the nodes ``outputs`` and ``kept`` need.

        Called once per lowerer with everything it will be asked to lower (a
        repeat's body lowers its outputs in two calls of :func:`lower_into`).
        ``kept``: values handed on as they are made, not read (activations a repeat
        saves for its backward to recompute from): they do not count as a reader.
        ``summed``: those of ``outputs`` a loop adds up over its layers before
        anything reduces them (a backward block's gradients of the tensors it reads
        from outside): a value's reads by the linear ops that lead only to them
        count as one reader at most (see :func:`_summed_reads`).  Returns whether
        that counted any value's readers fewer.
        """
        outputs = list(outputs)
        self.counted = True
        nodes = topo_nodes(outputs + list(kept), self.env)  # values already bound are not recomputed
        for n in nodes:
            for x in n.inputs:
                self._uses[id(x)] = self._uses.get(id(x), 0) + 1
        for t in outputs:
            self._uses[id(t)] = self._uses.get(id(t), 0) + 1
        fewer = False
        for x, reads in _summed_reads(nodes, summed).items():
            fewer |= self._uses[x] > 1
            self._uses[x] = max(1, self._uses[x] - reads)
        return fewer

    def num_uses(self, t: Tensor) -> int:
        """How many inputs of the nodes this plan lowers read ``t``, plus one if it is an output.

        Dead nodes of the graph (a gradient nobody asked for) do not count: a
        partial sum with one reader here may stay lazy (see :mod:`.generic`).
        """
        return self._uses.get(id(t), 0)

    def sharding(self, vid: int) -> Sharding:
        return self.values[vid].sharding

    def bind(self, t: Tensor, vid: int) -> None:
        self.env[id(t)] = vid
        self.keep.append(t)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    # -- layout targets
    def targets(self, t: Tensor, strict: bool = False) -> list[tuple[Sharding, str]]:
        key = id(t)
        if key not in self._targets:
            own = self.layout.targets(t.shape, t.scopes, self.mesh, t.name, strict)
            if not strict and not t.scopes:   # (a value of params alone, or of their gradients: also laid as they are)
                own = with_output_targets(self, t, with_param_targets(self, t, own))
            self._targets[key] = own
        return self._targets[key]

    def set_target(self, t: Tensor, to: Sharding, why: str) -> None:
        """Lay ``t`` out at ``to`` (the only target its lowering is offered), for ``why``."""
        self._targets[id(t)] = [(to, why)]

    def target(self, t: Tensor) -> Sharding:
        return self.targets(t)[0][0]

    # -- steps
    def emit(self, kind: str, node: Node | None, ins, outs, axes=(), args=None, nbytes: int = 0,
             flops: int = 0, note: str = "", *, op: str | None = None, label: str | None = None,
             phase: str | None = None, subplans: tuple = (), times: int = 1) -> Step:
        """Append a step of ``kind`` for ``node`` (op, label and phase default to the node's).

        Raises:
          LayoutError: a collective over the micro-batch axis other than an allreduce: a
            process folds its micro-batches by sums only (``comm/microbatch.py``), and the
            lowering rules price every other move over it at infinity, so only an op
            with no other lowering gets here.
        """
        if MB_AXIS in axes and kind != "allreduce":
            raise LayoutError(message(
                f"compile: {self.describe(node)} cannot be micro-batched with this layout.",
                inputs=[f"mesh: {self.mesh}", f"layout: {self.layout}"],
                bullets=[f"{kind} over {tuple(axes)}" + (f": {note}" if note else "")],
                rule="a value split by micro-batches only leaves them as a partial sum, reduced by an allreduce; "
                     "an op that needs every micro-batch's rows at once (all of a split batch gathered: a "
                     "contrastive loss's [batch, batch] logits, a batch norm) cannot run one micro-batch at a time",
                fix="use microbatches=1, a layout that keeps the batch dim split where this op reads it, or make "
                    "the op read one micro-batch's rows (in-batch negatives within each micro-batch)"))
        step = Step(kind, node.id if node else -1, op or (node.op.name if node else "output"),
                    label or (node.name if node else "output"), phase or (node.phase if node else "forward"),
                    tuple(ins), tuple(outs), tuple(axes), step_args(kind, args), nbytes, flops, note,
                    tuple(subplans), times, written=self._written(node))
        self.steps.append(step)
        if kind == "local" and made_from_nothing(self, node, step):
            self.made_from_nothing[step.outs[0]] = (step, node)
        return step

    def _written(self, node: Node | None) -> str:
        """An einsum ``node`` as the user wrote it, for its steps (:attr:`.plan.Step.written`), made once."""
        if node is None or node.op.name != "einsum":
            return ""
        memo = self.__dict__.setdefault("_written_memo", {})
        if id(node) not in memo:   # (ids of nodes: a block's graph numbers its nodes from 0 again)
            memo[id(node)] = written(node)
        return memo[id(node)]

    def relayout(self, vid: int, to: Sharding, node: Node | None, why: str = "") -> int:
        """Emit the collectives that bring value ``vid`` to sharding ``to``.

        Raises:
          LayoutError: a move over the micro-batch axis other than a sum (see :meth:`emit`).
        """
        v = self.values[vid]
        if v.sharding == to:
            return vid
        key = (vid, to)
        if key in self._relaid:
            return self._relaid[key]
        src = self._made_from.get(vid)
        if src is not None and self.values[src].sharding == to:
            # ``vid`` is a re-laid copy (a local cut) of a value already at ``to``: read that one,
            # not a gather of the cut (a carry held whole, cut by ``hidden:model``, renamed whole again)
            self._relaid[key] = src
            return src
        remade = remake(self, vid, to, why)
        if remade is not None:
            self._relaid[key] = remade
            self._held[vid] = self.held(vid) | {to}
            return remade
        for m in plan_moves(v.shape, v.sharding, to, self.mesh):
            args = move_args(m, v.shape, self.mesh)
            out = self.new_value(v.shape, v.dtype, m.after)
            self.emit(m.kind, node, [vid], [out], m.axes, args,
                      move_bytes(m, v.shape, self.mesh, v.dtype.itemsize),
                      note=f"re-layout {why}: {m.before} -> {m.after}" if why else "")
            vid = out
        self._relaid[key] = vid
        self._held[key[0]] = self.held(key[0]) | {to}
        if vid != key[0]:
            self._made_from.setdefault(vid, key[0])
        return vid

    def held(self, vid: int) -> frozenset:
        """The shardings value ``vid`` was already brought to (:meth:`relayout`: free again)."""
        return self._held.get(vid, frozenset())

    def remade_whole(self, vid: int) -> tuple:
        """``((whole sharding, seconds),)`` where value ``vid``, split, can be made again whole on
        each rank (:func:`.remake.remake_cost`: the seconds of its compute), else ``()``: the generic
        rule prices that way to the whole value beside the gather."""
        v = self.values[vid]
        whole = Sharding.replicated(v.shape)
        if v.sharding == whole or vid not in self.made_from_nothing:
            return ()
        cost = remake_cost(self, vid, whole)
        return ((whole, cost),) if cost is not None else ()

    def hold(self, vid: int, to: Sharding, copy: int) -> None:
        """Record that value ``copy`` is value ``vid`` at sharding ``to`` (a repeat's backward is
        given the forward's re-laid copy of a saved activation): :meth:`relayout` returns it."""
        self._relaid[(vid, to)] = copy
        self._held[vid] = self.held(vid) | {to}

    def cut_from(self, vid: int) -> int | None:
        """The value :meth:`relayout` made value ``vid`` from, or None (``vid`` made otherwise)."""
        return next((src for (src, _), out in self._relaid.items() if out == vid and src != vid), None)

    def relaid(self, vid: int, to: Sharding) -> bool:
        """Whether value ``vid`` was already brought to sharding ``to`` (:meth:`relayout`: free again)."""
        return (vid, to) in self._relaid

    @staticmethod
    def describe(node: Node | None) -> str:
        """How messages name ``node``: as :func:`.users_terms.called` does, or ``"an output"``."""
        return called(node.name, node.op.name, node) if node is not None else "an output"

    def reduced(self, vid: int) -> int:
        """An already-reduced copy of partial value ``vid`` if one was made, else ``vid``.

        Reusing it is free, while passing the partial sum on would cost another reduction.
        """
        if not self.values[vid].sharding.partial:
            return vid
        for (src, to), out in self._relaid.items():
            if src == vid and not to.partial:
                return out
        return vid

    def bind_leaf(self, node: Node, kind: str) -> None:
        t = node.outputs[0]
        sh = self.targets(t, strict=True)[0][0]
        vid = self.new_value(t.shape, t.dtype, sh)
        self.emit(kind, node, [], [vid], args={"name": node.name, "tensor": t})
        (self.params if kind == "param" else self.inputs)[node.name] = vid
        self.bind(t, vid)


def _graph_dims(nodes, user_names=None) -> tuple[dict[str, int], set[str]]:
    """Every dim of the graph (sub-graphs included) and the tensor names a layout may scope.

    Those names are the ones the user gave: params and inputs, and in a sub-graph
    (a repeat block) the names the op lets the layout see (its stacked params),
    never internal placeholders such as the carry.
    """
    dims: dict[str, int] = {}
    names: set[str] = set()
    for n in nodes:
        for t in n.outputs:
            for d in t.shape:
                dims.setdefault(d.name, d.size)
        if n.op.name in ("param", "input") and (user_names is None or n.name in user_names):
            names.add(n.name)
        if n.op.name == "placeholder" and user_names is not None and n.name in user_names:
            names.add(n.name)
        for graph, visible in n.op.subgraphs(n):
            d2, n2 = _graph_dims(graph.nodes, set(visible))
            for k, v in d2.items():
                dims.setdefault(k, v)
            names |= n2
    return dims, names


def lower_into(lw: Lowerer, outputs: dict[str, Tensor], lazy: bool = False) -> dict[str, int]:
    """Lower the nodes ``outputs`` need into ``lw``; returns output name -> value id.

    Each output is brought to its layout right after its node is lowered, so its
    collectives (gradient reductions, typically) are issued as early as possible
    and an executor can overlap them with the compute that follows.
    """
    wanted: dict[int, list[str]] = {}
    for name, t in outputs.items():
        wanted.setdefault(id(t.node), []).append(name)
    out = {}
    # Tensors already bound (an earlier call's, or values given to a block) are not recomputed.
    nodes = topo_nodes(list(outputs.values()), lw.env)
    # What this plan reads: a node with optional outputs (a repeat's saved activations) lowers only those.
    lw.used.update(id(t) for n in nodes for t in n.inputs)
    lw.used.update(id(t) for t in outputs.values())
    lw.passed_on.update(passed_on(outputs))   # (an update's value, laid out as its new/<k>)
    if offers(lw, nodes):   # (values computed from params alone, offered their params' layout)
        lw.param_scopes = param_scopes(nodes, lw.param_scopes, outputs.values())
    if not lw.counted:
        lw.count_readers(outputs.values())
    absorbed = absorbed_parts(lw, nodes)   # per-part concats, built from their parts' source (None: a part)
    for node in nodes:
        rule = absorbed.get(id(node), rule_for(node.op.name))
        # a second call reuses what the first lowered
        if rule is not None and not all(id(t) in lw.env for t in node.outputs):
            rule(lw, node)
        for name in wanted.get(id(node), ()):
            t = outputs[name]
            tgt = lw.target(t)
            vid = lw.value(t)
            if lazy:
                cur = lw.sharding(vid)
                tgt = tgt.with_partial(tuple(a for a in cur.partial if a not in tgt.used_axes))
            out[name] = lw.relayout(vid, tgt, t.node, f"output '{name}'")
    return out


#: Recently compiled plans, least recently used first: key -> (plan, graph).
_CACHE: OrderedDict = OrderedDict()
CACHE_SIZE = 64


def _check_outputs(outputs: dict) -> None:
    """Every output is a Tensor of one graph (node ids are per graph, so mixing would mislower)."""
    first = None
    for name, t in outputs.items():
        if not isinstance(t, Tensor):
            raise GraphError(message(f"compile: output '{name}' is {t!r} ({type(t).__name__}), not a Tensor.",
                                     rule="outputs are meshdsl Tensors of one graph",
                                     fix="pass the Tensors returned by ops, e.g. {'loss': loss}"))
        if first is None:
            first = (name, t)
        elif t.graph is not first[1].graph:
            raise GraphError(message(
                f"compile: outputs '{first[0]}' and '{name}' belong to different graphs.",
                inputs=[f"'{first[0]}': {first[1]!r} in graph '{first[1].graph.name}' (#{first[1].graph.uid})",
                        f"'{name}': {t!r} in graph '{t.graph.name}' (#{t.graph.uid})"],
                rule="a plan is compiled from one graph", fix="build everything in one 'with Graph():' block, "
                                                                "or compile each graph on its own"))


@checked_call
def compile(outputs, mesh, layout=None, cost: CostModel = DEFAULT, fuse: bool = True,  # noqa: A001
            microbatches: int = 1, schedule: str = "gpipe", bucket_mb: float = DEFAULT_BUCKET_MB,
            strict_splits: bool = False, stage_layers=None) -> Plan:
    """Lower the graph behind ``outputs`` into an SPMD plan.

    Args:
      outputs: a Tensor, a list of Tensors, or a dict name -> Tensor.
      mesh: a mesh string such as ``"data:2; model:2"``, a dict, or a Mesh.
      layout: a layout string such as ``"batch:data; d_ff:model"``, a dict, or a Layout.
      cost: the cost model used to choose among valid lowerings.
      fuse: merge local kernels whose intermediate nothing else reads (see
        :mod:`.fuse`); False keeps one step per lowered kernel.
      microbatches: cut the ``batch`` dim into this many micro-batches; gradients
        accumulate over them (see :mod:`.pipeline`).
      schedule: the pipeline schedule when the layout splits a repeat's layer dim
        over a mesh axis (``"layer:stage"``): ``"gpipe"``, ``"1f1b"``, ``"zbh1"`` or
        ``"interleaved:v"`` (v chunks of layers per rank, :mod:`.interleave`)
        (see :mod:`.schedule_gen`).
      bucket_mb: reduce gradients in buckets of about this many MB (see :mod:`.bucket`);
        0 keeps one collective per gradient.  A pipeline buckets its final segment's
        gradient reductions (per stage).
      strict_splits: refuse a dim its axes do not divide; by default it is split
        unevenly, as ``torch.tensor_split`` cuts (see :mod:`.uneven`), and the plan's
        notes say so with each part's size.
      stage_layers: the pipelined repeat's layers per stage, e.g. ``(3, 5)`` on ``stage:2``
        (see :mod:`.stage_layers`); None splits them evenly.

    Returns:
      The :class:`Plan`: steps, values, outputs, params, inputs, notes.

    Raises:
      ParseError, LayoutError, MeshError: on bad mesh or layout strings, a bad
        pipeline (layer split over two axes, a batch the micro-batches do not divide, ...),
        a split dim smaller than its axes, or an uneven split with ``strict_splits``.
      ScheduleError: an unknown schedule.
    """
    outputs = outputs_dict(outputs)   # (not a Tensor: _check_outputs says so)
    if not outputs:
        raise GraphError(message("compile: no outputs given.", rule="a plan computes at least one tensor",
                                 fix="pass the loss (and gradients) to compile"))
    _check_outputs(outputs)
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not 0 <= bucket_mb < float("inf"):
        raise GraphError(message(f"compile: bucket_mb={bucket_mb!r} is not a size in MB.",
                                 rule="gradients are reduced in buckets of bucket_mb >= 0 megabytes (0: no buckets)",
                                 fix=f"pass e.g. bucket_mb={DEFAULT_BUCKET_MB:g}, or 0 to turn bucketing off"))
    _check_options(fuse=fuse, strict_splits=strict_splits, schedule=schedule)
    mesh = Mesh.parse(mesh)
    layout = Layout.parse(layout)
    g = next(iter(outputs.values())).graph
    if stage_layers is not None and not isinstance(stage_layers, str):
        stage_layers = tuple(stage_layers)
    key = (g.uid, len(g.nodes), tuple((k, id(t)) for k, t in outputs.items()), mesh, str(layout), cost, fuse,
           microbatches, schedule, bucket_mb, bool(strict_splits), stage_layers)
    hit = _CACHE.get(key)
    if hit is not None and hit[1] is g:
        _CACHE.move_to_end(key)
        return hit[0]
    plan = _lower(outputs, mesh, layout, cost, fuse, microbatches, schedule, bucket_mb, strict_splits, stage_layers)
    plan = dataclasses.replace(plan, graph_params=graph_params_of(outputs))
    _CACHE[key] = (plan, g)
    if len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    return plan


def graph_params_of(outputs: dict) -> dict:
    """Every param of the outputs' graph (or graphs): name -> (shape, dtype), for
    :attr:`Plan.graph_params`; the cache key's node count keeps it current."""
    graphs = {id(t.graph): t.graph for t in outputs.values()}
    return {k: (t.shape, t.dtype) for g in graphs.values() for k, t in g.params.items()}


#: How a plan note on an option given that changes nothing reads (``schedule '1f1b' has no effect: ...``).
NO_EFFECT = "has no effect:"


def ignored_options(plan: Plan) -> list[str]:
    """The notes of ``plan`` on options given that change nothing, such as a schedule for a
    layout that pipelines nothing: ``meshdsl plan`` lists them with its other notes, and every
    command or call that compiles and runs a plan says them too (a one-line notice each)."""
    return [n for n in plan.notes if NO_EFFECT in n]


def _check_options(fuse, strict_splits, schedule) -> None:
    """``compile``'s switches are bools and its schedule a name: a string such as ``"no"`` would
    otherwise pass as true."""
    for name, value in (("fuse", fuse), ("strict_splits", strict_splits)):
        if not isinstance(value, bool):
            raise GraphError(message(f"compile: {name}={value!r} ({type(value).__name__}) is not True or False.",
                                     rule=f"{name} is a switch", fix=f"pass {name}=True or {name}=False"))
    if not isinstance(schedule, str):
        raise GraphError(message(f"compile: schedule={schedule!r} ({type(schedule).__name__}) is not a schedule name.",
                                 rule="a pipeline schedule is named by a string",
                                 fix="pass one of 'gpipe', '1f1b', 'zbh1', 'interleaved:V', 'interleaved-zb:V'"))


def _lower(outputs: dict, mesh: Mesh, layout: Layout, cost: CostModel, fuse: bool, microbatches: int,
           schedule: str, bucket_mb: float, strict_splits: bool, stage_layers=None) -> Plan:
    """:func:`compile`'s work once its arguments are checked and the cache missed: the layout
    checked against the graph, the lowering, fusion, then the pipeline's partition, gradient
    accumulation's segments or the gradient buckets."""
    nodes = topo_nodes(list(outputs.values()))
    dims, names = _graph_dims(nodes)
    layout.validate(mesh, dims, names, has_repeat=any(n.op.name == "repeat" for n in nodes))
    layout = implied_layout(nodes, mesh, layout, bool(strict_splits))   # the splits reshapes carry over (noted if uneven)
    args = (outputs, nodes, dims, mesh, cost, fuse, microbatches, schedule, bucket_mb, strict_splits, stage_layers)
    try:
        return _lower_laid(layout, *args)
    except NotCyclic as e:   # a block-cyclic dim split otherwise somewhere: lowered without its rule
        plan = _lower_laid(layout.with_implied(tuple((r, why) for r, why in layout.implied
                                                     if r.key[1] not in layout.cyclic_blocks)), *args)
        return dataclasses.replace(plan, notes=plan.notes + (str(e),))


def _lowered(outputs: dict, nodes, mesh: Mesh, layout: Layout, cost: CostModel, schedule: str, uneven, spec,
             foreseen: dict | None = None, shared: dict | None = None,
             wanted: dict | None = None, pack: bool = False,
             through: frozenset = frozenset()) -> tuple[Lowerer, dict[str, int]]:
    """The lowerer that lowered ``outputs`` (its notes and steps), and their value ids;
    ``foreseen``: the shardings some tensors will be moved to anyway, ``wanted``: the one sharding
    every reader of some tensors moves them to (:mod:`.shared_moves`);
    ``shared``: the terms of sums reduced once (:mod:`.shared_sums`); ``pack``: partial inputs
    reduced together as one packed allreduce (:func:`.generic.packable`); ``through``: values
    passed on partial to every reader, all linear in them (:func:`.shared_sums.meeting_sums`)."""
    lw = Lowerer(mesh, layout, cost)
    for _, why in layout.implied:
        lw.note(why)
    for u in uneven:
        lw.note(u.note(mesh))
    lw.pipeline_axis = spec.axis if spec else None
    if schedule != "gpipe" and (spec is None or spec.axis is None):
        lw.note(f"schedule '{schedule}' {NO_EFFECT} the layout pipelines no repeat "
                "(a 'layer:<axis>' rule over an axis of size > 1 does)")
    # (a normalised param's gradient; RNN-T's joint's, summed over t and over u)
    lw.lazy_through = through | lazy_to_gradients(nodes, outputs.values()) | lazy_to_smaller_sums(nodes, cost, mesh)
    lw.foreseen = dict(foreseen or {})
    lw.wanted = dict(wanted or {})
    lw.shared_sums = dict(shared or {})
    lw.pack_reductions = pack
    return lw, lower_into(lw, outputs)


def _chosen(outputs: dict, nodes, mesh: Mesh, layout: Layout, cost: CostModel, schedule: str, uneven,
            spec) -> tuple[Lowerer, dict[str, int]]:
    """:func:`_offered`'s lowering with einsums of a split concat lowered per part
    (:mod:`.concat_contract`), kept where :func:`better` than without."""
    args = (outputs, nodes, mesh, layout, cost, schedule, uneven, spec)
    with summing_parts(True) as rec:
        made = _offered(*args)
    if not rec.used:
        return made
    with summing_parts(False):
        plain = _offered(*args)
    buckets = spec is None or (spec.axis is None and spec.num_microbatches == 1)   # (as :func:`_offered` prices)
    return made if better(made, plain, cheaper, buckets) else plain


def _offered(outputs: dict, nodes, mesh: Mesh, layout: Layout, cost: CostModel, schedule: str, uneven,
             spec) -> tuple[Lowerer, dict[str, int]]:
    """The cheapest of :func:`_lowered`'s lowerings: values computed from params alone offered their
    params' layout or not (:mod:`.param_values`), then lowered again foreseeing the moves of a
    split tensor that one reader gathers and another reduces around (:mod:`.shared_moves`), then
    again foreseeing one no reader moves gathered where several projections reduce around it
    (:func:`.shared_moves.projected_once`), then again pricing the terms of a sum as sharing its
    one reduction (:mod:`.shared_sums`), then again passing a partial sum read by several linear
    ops on to where they meet (:func:`.shared_sums.meeting_sums`), then again reducing partial
    inputs of one op together (:func:`.generic.packable`)."""
    lw, outs, on = least_offered(lambda: _lowered(outputs, nodes, mesh, layout, cost, schedule, uneven, spec),
                                 cheaper, buckets=spec is None or (spec.axis is None and spec.num_microbatches == 1))
    seen = foresee(lw)   # a split tensor moved by one reader, reduced around by another; or sliced, each slice moved
    ahead, wanted = gathered_in_pieces(lw, dict(seen.held)), seen.wanted
    if ahead or wanted:
        with offering(on):
            again = _lowered(outputs, nodes, mesh, layout, cost, schedule, uneven, spec, ahead, wanted=wanted)
        if cheaper(again[0], lw):
            lw, outs = again
        else:
            ahead, wanted = {}, {}   # (the lowering kept did not foresee them)
    once = projected_once(lw) if spec is None else {}   # a split input several projections reduce around
    if once:
        with offering(on):
            again = _lowered(outputs, nodes, mesh, layout, cost, schedule, uneven, spec, {**ahead, **once},
                             wanted=wanted)
        if cheaper_packed(*again, lw, outs):   # (as coalesced: their reductions would go as one)
            (lw, outs), ahead = again, {**ahead, **once}
    shared = summed_terms(nodes, outputs.values())   # terms of one sum, whose inputs were moved
    if shared and moved_around(lw, shared, nodes):
        with offering(on):
            again = _lowered(outputs, nodes, mesh, layout, cost, schedule, uneven, spec, ahead, shared, wanted)
        if cheaper(again[0], lw, sent=False):   # (fewer collectives may send more bytes: time decides)
            lw, outs = again
    meet = meeting_sums(nodes, outputs.values())   # a partial sum whose linear readers meet again
    if meet and any(lw.values[lw.env[t]].sharding.partial for t in meet if t in lw.env):
        with offering(on):
            again = _lowered(outputs, nodes, mesh, layout, cost, schedule, uneven, spec, ahead, lw.shared_sums,
                             wanted, through=meet)
        if cheaper_packed(*again, lw, outs):
            lw, outs = again
    if lw.packable and spec is None:   # reductions at one op packed (a masked loss's numerator and count)
        with offering(on):
            again = _lowered(outputs, nodes, mesh, layout, cost, schedule, uneven, spec, lw.foreseen, lw.shared_sums,
                             lw.wanted, pack=True, through=lw.lazy_through)   # (with what the kept lowering foresaw)
        if cheaper_packed(*again, lw, outs):
            lw, outs = again
    return lw, outs


def _lower_laid(layout: Layout, outputs: dict, nodes, dims, mesh: Mesh, cost: CostModel, fuse: bool,
                microbatches: int, schedule: str, bucket_mb: float, strict_splits: bool, stage_layers) -> Plan:
    """:func:`_lower` once the layout's implied rules are known."""
    uneven = find_uneven(nodes, mesh, layout, bool(strict_splits), stage_layers)
    with with_given(mesh, layout, microbatches):   # a schedule's sizes refused: with what compile was given
        spec = detect_pipeline(nodes, mesh, layout, dims, microbatches, schedule, stage_layers)
    given = (mesh, layout)
    if spec is not None and spec.axis is not None and layout.cyclic:
        raise NotCyclic(f"{', '.join(map(repr, layout.cyclic_blocks))} whole, not block-cyclic: a pipeline's "
                        "stages store no block-cyclic dim but the layers")
    if spec is not None:  # lowered with the micro-batch axis (when m > 1)
        mesh, layout = spec.mesh, spec.layout.with_implied(layout.implied, layout.cyclic)
    with users_terms((mesh, layout), given, microbatches):   # errors speak of the user's mesh and layout
        lw, outs = _chosen(outputs, nodes, mesh, layout, cost, schedule, uneven, spec)
        steps = live_steps(lw.steps, outs.values())   # (collectives nothing reads: :mod:`.dead_moves`)
        steps = store_cyclic(steps, lw.values, lw.mesh, layout)   # (block-cyclic dims: :mod:`.cyclic_dims`)
        steps = fuse_steps(steps, lw.values, outs) if fuse else steps
        holders = {}
        if spec is not None and spec.axis is not None:
            steps, holders = partition(steps, lw.values, outs, spec, bucket_mb)
            for line in stack_lines(spec):   # several stacks: the layers of each on each stage
                lw.note(line)
        elif spec is not None and spec.num_microbatches > 1:  # gradient accumulation: one micro-batch at a time
            steps = accumulate(steps, lw.values, outs, spec, bucket_mb)
        else:
            steps = bucket_steps(steps, lw.values, outs, bucket_mb, lw.mesh)
            steps = coalesce(steps, lw.values, outs, cost, lw.mesh)   # (small allreduces made back to back, as one)
        return Plan(mesh, layout, steps, lw.values, outs, lw.params, lw.inputs, lw.notes, holders)
