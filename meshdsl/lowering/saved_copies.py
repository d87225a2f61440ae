"""A repeat's saved activations, also saved as the forward block re-laid them out.

The forward block of a repeat often moves an activation it saves for the backward: Soft MoE's
slots go batch->experts (an alltoall) for the experts' MLP, and back for the combine.  The
backward reads the saved activation in those moved layouts too.  Given only the activation as
the forward made it, the backward repeated each exchange, every layer (6 alltoalls a layer where
4 do).  So the forward step also outputs, stacked over the layers, each copy it already made of a
saved activation that costs no more memory than the activation (:func:`worth_saving`), named
``saved/<i>@<k>``; the backward step takes them as inputs, and its sub-plan holds them as the
saved activation re-laid out (:meth:`.Lowerer.hold`): a reader that needs one reads it, no
collective.  The copies the backward does not read leave both steps (:func:`drop_unread`).

A saved activation the forward extended by a halo (a sliding-window attention's keys and values
under ``seq:model``, :func:`~.halo.extend`) is saved with the strips its neighbours sent
(``saved/<i>@h<k>``, :func:`halo_strips`): the backward glues them on again (:func:`reglue`), a
local step, where it repeated the exchange every layer (4 more permutes per 2 layers).  Memory
against bytes: the strips are ``hl + hr`` rows per layer, exactly what the permutes they replace
carry each layer; as for re-laid copies, they are kept where that is no more than the activation's
own part (a window reaching past the neighbours exchanges again).

A recurrence nested in the block (an inner repeat over a split ``seq``, :func:`~.repeat._scan_target`)
gathers its stacked inputs whole, and the backward recomputes the inner repeat under ``full`` and
``selective`` (under ``none`` the forward saves the inner repeat's own activations and the backward
runs only its gradient, :mod:`meshdsl.ir.remat`), reading them gathered in the recompute and in the
inner repeat's gradient.  The forward saves the gathered copy of each such
input the policy saves (:func:`gathered_for_scan`), ``p`` times its local part, and the backward
reads it, no allgather (DeltaNet under ``seq:model``: 4 allgathers per layer in the recompute
before); the local part, then read by nothing, is not saved (:func:`drop_unread`), so the cost is
``p - 1`` times the local part per input and layer, memory the forward holds anyway while the
recurrence runs.  The policy chooses: under ``none`` and ``selective`` where it saves the input,
the copy is saved; under ``full`` nothing is, and the recompute gathers once (the inner repeat's
gradient reads the same gathered value).  Likewise any saved activation the backward sub-plan
does not read (the inner repeat's stacked carries, which the recompute makes again) is dropped.

Under remat the backward recomputes what the policy does not save, and no copy is saved of that,
but for the results of the collectives the recompute would send again (:func:`saved_results`):
where a node the backward recomputes read, in the forward, a value the forward moved (reduced,
gathered, exchanged) from a value recomputed too, the forward step also outputs the moved value
(``saved/r<node>.<output>.<k>``) and the backward takes it as that tensor (:func:`bind_result`),
so its recompute starts there, no collective.  TokenFormer's L2 norms over split param tokens
under ``selective``: an allreduce per Pattention layer in the forward, again in the backward's
recompute (14 -> 28 allreduces) for lack of a 96-byte ``[batch, seq]`` sum per layer.  Memory
against bytes: such results are kept, smallest first, while together they are at most
:data:`RESULTS_SHARE` of the bytes the policy saves per layer (``selective`` recomputes the cheap
compute, not the communication, while its results are small next to what it keeps anyway).
``full`` saves nothing but each layer's input, by definition: its recompute sends every
collective of the layer again.  ``none`` recomputes no activation.

The memory report counts each copy with the saved activations (``args["saved"]``).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..core.shape import Dim, Shape
from ..ir.remat import recomputed
from ..layout.sharding import Sharding
from .compiler import Lowerer
from .plan import Plan, step_args

#: ``lw.memo`` key (with a saved activation's id): the stacked re-laid copies the forward step saved of it.
COPIES = "saved copies"


#: ``lw.memo`` key (with a stacked copy's value id): the :class:`Strip` it is, where it is one.
STRIPS = "saved strips"
#: ``lw.memo`` key (with a value id): the shardings an inner repeat gathered it to, its scanned dim whole.
SCANNED = "gathered for a scan"
#: ``lw.memo`` key prefix of :func:`~.halo.extend`'s exchanges: ``(HALO, vid, dim, wrap) -> (hl, hr, ext, ...)``.
HALO = "halo"
#: ``lw.memo`` key (with a forward repeat node's id): the stacked collective results its step saves
#: (:func:`saved_results`); (with one of them) ``(node id, output index)`` of the block tensor it is.
RESULTS = "saved results"
RESULT_OF = "saved result of"
#: The names of those results among a forward step's saved outputs begin so.
RESULT = "saved/r"
#: The most bytes per layer the saved collective results may add to a forward step's saved
#: activations, as a share of those activations' own bytes (:func:`saved_results`).
RESULTS_SHARE = 1 / 8


@dataclass(frozen=True)
class Strip:
    """Piece ``index`` of ``count`` glued onto a saved activation by the forward's halo exchange
    ``key`` (``(dim, wrap)``, ``hl`` and ``hr`` rows), the glue step's ``args``, and the rest of
    the exchange's record (``more``: what it serves, :func:`~.halo.extend`)."""

    key: tuple
    hl: int
    hr: int
    args: Mapping
    index: int
    count: int
    more: tuple = ()


def record(lw: Lowerer, t, vid: int, strip: Strip | None = None) -> None:
    """Note that the forward step outputs stacked value ``vid``, a re-laid copy of saved activation
    ``t`` (or one of the halo strips glued onto it: ``strip``)."""
    lw.memo.setdefault((COPIES, id(t)), []).append(vid)
    if strip is not None:
        lw.memo[(STRIPS, vid)] = strip


def copies_of(lw: Lowerer, t) -> list[int]:
    """The stacked re-laid copies of saved activation ``t`` the forward step outputs (:func:`record`)."""
    return list(lw.memo.get((COPIES, id(t)), ()))


def strip_of(lw: Lowerer, vid: int) -> Strip | None:
    """The :class:`Strip` stacked copy ``vid`` is (:func:`record`), or None (a re-laid copy)."""
    return lw.memo.get((STRIPS, vid))


def halo_strips(sub: Lowerer, vid: int) -> list[tuple[Strip, int]]:
    """``(strip, value)`` for each piece the forward block's halo exchanges glued onto saved value
    ``vid`` (:func:`~.halo.extend`, one per side and hop), in the glue step's order: those of an
    exchange whose pieces together are no larger than the value's own part, as for re-laid
    copies (:func:`worth_saving`; a window reaching past the neighbours exchanges again)."""
    out, mesh = [], sub.mesh
    own = sub.values[vid].sharding.local_numel(sub.values[vid].shape, mesh)
    for key, hit in list(sub.memo.items()):
        if not (isinstance(key, tuple) and len(key) == 4 and key[:2] == (HALO, vid)):
            continue
        hl, hr, ext = hit[:3]
        glue = next(s for s in sub.steps if s.outs == (ext,))
        if sum(sub.values[x].sharding.local_numel(sub.values[x].shape, mesh) for x in glue.ins[1:]) > own:
            continue
        out += [(Strip(key[2:], hl, hr, glue.args, k, len(glue.ins) - 1, tuple(hit[3:])), piece)
                for k, piece in enumerate(glue.ins[1:])]
    return out


def reglue(sub: Lowerer, node, vid: int, pieces: list[tuple[Strip, int]]) -> None:
    """Glue the saved strips ``pieces`` onto saved value ``vid`` in backward sub-plan ``sub`` as the
    forward did (a local step), and record the result as the exchange :func:`~.halo.extend` would
    make: the backward's readers of ``vid`` take it, no permute."""
    done: dict[tuple, list] = {}
    for strip, piece in pieces:
        done.setdefault(strip.key, []).append((strip, piece))
    v = sub.values[vid]
    for key, got in done.items():
        got.sort(key=lambda sp: sp[0].index)
        first = got[0][0]
        assert len(got) == first.count, (key, len(got), first.count)
        dim = key[0]
        grown = v.shape.get(dim).size + (first.hl + first.hr) * sub.mesh.axis_size(v.sharding.axes_of(dim))
        ext = sub.new_value(Shape(Dim(d.name, grown) if d.name == dim else d for d in v.shape), v.dtype,
                            v.sharding)
        sub.emit("local", node, [vid] + [p for _, p in got], [ext], args=dict(first.args),
                 op="saved", label=f"saved {node.name} (halo glued)")
        sub.memo[(HALO, vid, *key)] = (first.hl, first.hr, ext, *first.more)


def gathered_for_scan(lw: Lowerer, vid: int, to: Sharding) -> None:
    """Note that an inner repeat (a recurrence inside the block, :func:`~.repeat._scan_target`)
    read value ``vid`` gathered to ``to``, its scanned dim whole (:func:`worth_saving`)."""
    lw.memo.setdefault((SCANNED, vid), set()).add(to)


def worth_saving(sub: Lowerer, vid: int) -> list[Sharding]:
    """The shardings the forward block already brought saved value ``vid`` to (an einsum's
    operand moved by an alltoall) that the forward saves too, so a backward reading it there
    takes the copy instead of repeating the exchange: those whose local part is no larger
    than the value's own (an alltoall's, a further split's).  Memory against bytes: such a
    copy costs at most the activation's own size per layer and saves at least that many bytes
    each way per layer; a gathered copy (an allgather's, ``n`` times the memory) is not kept,
    the backward gathers again, except one a recurrence in the block reads (:func:`gathered_for_scan`):
    the backward's recompute of the recurrence reads it whole whatever it costs, and the local
    part it replaces is dropped.  Copies the backward does not read are dropped from the
    forward step after it is lowered (:func:`drop_unread`)."""
    v, mesh = sub.values[vid], sub.mesh
    own = v.sharding.local_numel(v.shape, mesh)
    scanned = sub.memo.get((SCANNED, vid), ())
    return sorted((to for to in sub.held(vid)
                   if not to.partial and (to.local_numel(v.shape, mesh) <= own or to in scanned)), key=str)


def saved_results(sub: Lowerer, node, ids: Mapping[str, int]) -> dict[str, int]:
    """Name -> value: the results of collectives of forward block sub-plan ``sub`` (repeat
    ``node``'s; ``ids``: its outputs so far) that its backward's recompute would send again,
    to be saved with its activations (see the module docstring).

    A value is offered where a node the backward recomputes (:func:`~meshdsl.ir.remat.recomputed`,
    under every gradient built of ``node`` whose policy saves some activation: not ``none`` nor
    ``full``) read it, and it was moved there by a collective from the value of a block tensor
    recomputed too, which nothing read unmoved (the recompute then reads the moved value as the
    forward did: the same numbers).  Kept smallest first, while together no more than
    :data:`RESULTS_SHARE` of the bytes of the saved activations ``saved/<i>``."""
    blocks = [g for g, _, _ in node.attrs.get("grad_blocks", {}).values() if g.extra["remat"].save]
    if not blocks:
        return {}
    again = frozenset().union(*(recomputed(g) for g in blocks))
    graph = node.attrs["block"].graph
    made: dict[int, object] = {}   # value -> a recomputed tensor of the block bound to it
    for t in sub.keep:
        if t.node.graph is graph and t.node.id in again and id(t) in sub.env:
            made.setdefault(sub.env[id(t)], t)
    made_by = {v: s for s in sub.steps for v in s.outs}
    read_as_is = {v for s in sub.steps if not s.is_collective and s.kind != "input" for v in s.ins}
    read_again = {v for s in sub.steps if s.node in again for v in s.ins}
    offers = []
    for vid, t in made.items():
        if vid in read_as_is or vid in ids.values():
            continue
        for k, to in enumerate(sorted(sub.held(vid), key=str)):
            got = sub.relayout(vid, to, None)   # made already: no new step
            if got in read_again and _sent(made_by, vid, got):
                v = sub.values[got]
                offers.append((v.sharding.local_numel(v.shape, sub.mesh) * v.dtype.itemsize, got,
                               f"{RESULT}{t.node.id}.{t.index}.{k}"))
    own = sum(sub.values[v].sharding.local_numel(sub.values[v].shape, sub.mesh) * sub.values[v].dtype.itemsize
              for n, v in ids.items() if n.startswith("saved/") and "@" not in n)
    budget, out = RESULTS_SHARE * own, {}
    for nbytes, got, name in sorted(offers):
        if nbytes <= budget:
            budget -= nbytes
            out[name] = got
    return out


def _sent(made_by: Mapping, src: int, vid: int) -> bool:
    """Whether the moves that made value ``vid`` from value ``src`` hold a collective."""
    while vid != src and vid in made_by:
        step = made_by[vid]
        if step.is_collective:
            return True
        vid = step.ins[0] if step.ins else src
    return False


def record_result(lw: Lowerer, node, name: str, vid: int) -> None:
    """Note that the step of forward repeat ``node`` outputs stacked value ``vid``, its saved
    collective result ``name`` (:func:`saved_results`)."""
    nid, index, _ = name[len(RESULT):].split(".")
    lw.memo.setdefault((RESULTS, id(node)), []).append(vid)
    lw.memo[(RESULT_OF, vid)] = (int(nid), int(index))


def results_of(lw: Lowerer, node) -> list[int]:
    """The stacked collective results the step of forward repeat ``node`` saves (:func:`record_result`)."""
    return list(lw.memo.get((RESULTS, id(node)), ()))


def bind_result(lw: Lowerer, sub: Lowerer, blk, vid: int, shape: Shape, sharding: Sharding) -> str:
    """Give backward sub-plan ``sub`` (of block ``blk``) stacked collective result ``vid``, one
    layer of it ``shape`` at ``sharding``, as an input: the block tensor it is takes it (or, one
    of its other results bound already, holds it there, :meth:`.Lowerer.hold`), so the recompute
    starts from it, no collective.  Returns the input's name."""
    nid, index = lw.memo[(RESULT_OF, vid)]
    t = blk.graph.nodes[nid].outputs[index]
    name = f"{RESULT}{nid}.{index}.{sum(n.startswith(f'{RESULT}{nid}.{index}.') for n in sub.inputs)}"
    got = sub.new_value(shape, t.dtype, sharding)
    sub.emit("input", t.node, [], [got], args={"name": name, "tensor": t}, op="saved",
             label=f"saved {t.name} (a collective's result)")
    sub.inputs[name] = got
    if id(t) in sub.env:
        sub.hold(sub.env[id(t)], sharding, got)
    else:
        sub.bind(t, got)
    return name


def drop_unread(lw: Lowerer, loop, plan: Plan, ins: list, names: list[str]) -> tuple:
    """``(plan, ins, names)`` without the saved copies the backward sub-plan ``plan`` does not
    read, each dropped from the forward step that saves it too (it keeps those read); likewise
    a saved activation this backward step alone is given and does not read (a recurrence's
    input, read as its gathered copy; the inner repeat's stacked carries, recomputed)."""
    read = {v for s in plan.steps for v in s.ins}
    glued = [s for s in plan.steps if s.kind == "local" and s.op == "saved" and s.outs[0] not in read]
    if glued:   # strips glued on again that no reader took (a conv's backward reads dy's halo instead)
        gone_ids = {id(s) for s in glued}
        plan = replace(plan, steps=[s for s in plan.steps if id(s) not in gone_ids])
        read = {v for s in plan.steps for v in s.ins}
    num_saved = len(loop.saved)
    at = len(ins) - len(loop.closed) - len(loop.copies) - num_saved
    mine = [n for n, t in zip(names, loop.saved) if lw.num_uses(t) == 1]
    unread = {n for n in mine + names[num_saved:] if plan.inputs[n] not in read}
    if not unread:
        return plan, ins, names
    gone = [v for n, v in zip(names, ins[at:]) if n in unread]
    for i, s in enumerate(lw.steps):   # the forward step: its outputs end with its saved values, in order
        if s.kind == "repeat" and not s.args["backward"] and set(gone) & set(s.outs):
            first = len(s.outs) - len(s.args["saved"])
            keep = [k for k, v in enumerate(s.outs[first:]) if v not in gone]
            sub = s.subplans[0]
            kept = [s.args["saved"][k] for k in keep]
            outputs = {n: v for n, v in sub.outputs.items() if not n.startswith("saved/") or n in kept}
            lw.steps[i] = replace(s, outs=s.outs[:first] + tuple(s.outs[first + k] for k in keep),
                                  args=step_args("repeat", {**s.args, "saved": tuple(kept)}),
                                  subplans=(replace(sub, outputs=outputs),))
    for key, vids in lw.memo.items():
        if isinstance(key, tuple) and key[0] in (COPIES, RESULTS):
            vids[:] = [v for v in vids if v not in gone]
    steps = [s for s in plan.steps if not (s.kind == "input" and s.args.get("name") in unread)]
    plan = replace(plan, steps=steps, inputs={n: v for n, v in plan.inputs.items() if n not in unread})
    return (plan, [v for k, v in enumerate(ins) if not (k >= at and v in gone)],
            [n for n in names if n not in unread])