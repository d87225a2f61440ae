"""Unequal stages: a pipeline whose stages run given, unequal numbers of layers.

With ``stage_layers=(n_0, .., n_{p-1})`` stage s runs layers ``o_s .. o_s + n_s`` of the
stack (``o_s = n_0 + .. + n_{s-1}``), so the first stage (which also runs what feeds the
layers, the embedding) and the last (the head and the loss) may take fewer layers.

:mod:`.partition` cuts the plan as for equal stages; :func:`split_stages` then turns the
cut into unequal ones, as a pass on the segment lists:

* the pipelined repeat's forward and backward steps become one step per stage, over its
  own layers, with values of their own for its params and for what its forward keeps;
* the stacked params stay stored as the layout splits them (rank r holds layers
  ``r L / p ..``; when p does not divide L, as ``torch.tensor_split`` cuts, which only a
  given split allows: :mod:`.uneven`), so checkpoints, optimizer state and updates are
  unchanged: the prologue
  hands each stage its layers, and the final segment hands each stage's gradients, summed
  over the micro-batches and the data axes, back to the ranks storing them, which join them.

What :mod:`.interleave` refuses, this pass refuses too (the same hand-out of params).
"""
from __future__ import annotations

import dataclasses

import torch

from ..core.shape import Dim, Shape
from ..errors import LayoutError, message
from .interleave import _unsupported
from .pipeline_program import Segment, transfer_step
from .plan import Step, Value, step_args


def _narrow(ctx, attrs, x):
    """Some of a stacked tensor's local layers."""
    return x.narrow(attrs["dim"], attrs["start"], attrs["length"])


def _join(ctx, attrs, *parts):
    """Pieces of a stacked tensor, in layer order."""
    return torch.cat(parts, attrs["dim"])


def offsets(counts) -> list[int]:
    """The first layer of each part of ``counts`` layers, and the end."""
    out = [0]
    for n in counts:
        out.append(out[-1] + n)
    return out


def pieces(src: list[int], dst: list[int]) -> list[tuple[int, int, int, int]]:
    """``(from part, to part, first layer, end)`` of the layers parts cut at ``src`` hold that parts
    cut at ``dst`` want, in layer order."""
    out = []
    for t in range(len(dst) - 1):
        for r in range(len(src) - 1):
            lo, hi = max(src[r], dst[t]), min(src[r + 1], dst[t + 1])
            if lo < hi:
                out.append((r, t, lo, hi))
    return out


class _Split:
    """New values and steps for one unequal split."""

    def __init__(self, cut, lists, counts):
        self.cut, self.counts, self.p = cut, tuple(counts), cut.num_stages
        self.values, self.layer, self.spec = cut.values, cut.spec.layer, cut.spec
        self.tag = max((s.args["tag"] for pairs in lists.values() for s, _ in pairs if s.kind in ("send", "recv")),
                       default=1)

    def like(self, vid: int, layers: int) -> int:
        """A new value like the stacked ``vid``, holding ``layers`` layers on each rank."""
        old = self.values[vid]
        shape = Shape(Dim(d.name, layers * self.p) if d.name == self.layer else d for d in old.shape)
        new = max(self.values) + 1
        self.values[new] = Value(new, shape, old.dtype, old.sharding)
        return new

    def stored_layers(self, vid: int) -> list[int]:
        """Layers of the stacked ``vid`` each stage stores (a split the stages do not divide:
        the first ones one more, as ``torch.tensor_split`` cuts)."""
        mesh, axis, dim = self.spec.mesh, self.spec.axis, self.stacked_dim(vid)
        first = {mesh.coords(r)[axis]: r for r in reversed(range(mesh.size))}
        return [self.values[vid].local_shape(mesh, first[t])[dim] for t in range(self.p)]

    def stacked_dim(self, vid: int) -> int:
        return self.values[vid].shape.names.index(self.layer)

    def local(self, op, fn, ins, out, attrs, stage, label, phase="forward"):
        v = self.values[out]
        args = step_args("local", {"fn": fn, "attrs": attrs, "compute": v.sharding.split,
                                   "sizes": {d.name: d.size for d in v.shape}})
        return Step("local", -1, op, label, phase, tuple(ins), (out,), (), args), frozenset({stage})

    def move(self, src_vid: int, src: list, dst: list, dst_vids: list, phase: str, what: str) -> list:
        """Steps giving each part ``t`` of ``dst`` its layers in ``dst_vids[t]``, from the parts cut at
        ``src`` (``src_vid`` on each rank, or ``src_vid[r]``)."""
        dim, out, got = self.stacked_dim(dst_vids[0]), [], {t: [] for t in range(len(dst) - 1)}
        cuts = pieces(src, dst)
        for r, t, lo, hi in cuts:
            whole = len([c for c in cuts if c[1] == t]) == 1
            vid = src_vid[r] if isinstance(src_vid, list) else src_vid
            mine = dst_vids[t] if whole else self.like(dst_vids[t], hi - lo)
            attrs = {"dim": dim, "start": lo - src[r], "length": hi - lo}
            label = f"{what}: layers {lo}..{hi - 1} for stage {t}"
            if r == t:
                out.append(self.local("narrow", _narrow, (vid,), mine, attrs, r, label, phase))
            else:
                tmp = self.like(dst_vids[t], hi - lo)
                self.tag += 1
                sp = self.spec
                out += [self.local("narrow", _narrow, (vid,), tmp, attrs, r, label, phase),
                        (transfer_step("send", tmp, self.values, sp.mesh, sp.axis, t - r, self.tag, phase,
                                       f"{label} to rank {t}"), frozenset({r})),
                        (transfer_step("recv", mine, self.values, sp.mesh, sp.axis, t - r, self.tag, phase,
                                       f"{label} from rank {r}"), frozenset({t}))]
            got[t].append(mine)
        for t, parts in got.items():
            if parts != [dst_vids[t]]:
                out.append(self.local("join", _join, parts, dst_vids[t], {"dim": dim}, t, f"{what}: stage {t}",
                                      phase))
        return out


def check(cut, lists, counts) -> None:
    """Refuse what this pass cannot cut, with the reason."""
    why = _unsupported(cut, lists)
    if why is not None:
        spec = cut.spec
        raise LayoutError(message(
            f"compile (pipeline over '{spec.axis}', stage layers {','.join(map(str, counts))}): {why}.",
            inputs=[f"mesh: {spec.given[0]}", f"layout: {spec.given[1]}"],
            rule="unequal stages hand the pipelined layers' params out and pass only the carry between stages",
            fix="leave out stage_layers (--stage-layers) for equal stages"))


def split_stages(cut, lists: dict, counts) -> dict:
    """The segment lists of an equal cut (``lists``) with stage s running ``counts[s]`` layers."""
    check(cut, lists, counts)
    sp = _Split(cut, lists, counts)
    F = cut.steps[cut.F]
    B = cut.steps[cut.B] if cut.B is not None else None
    n = len(F.args["names"])
    stored = offsets(sp.stored_layers(F.ins[1]))
    run = offsets(counts)
    params = dict.fromkeys(F.ins[1:1 + n] + (B.ins[1:1 + n] if B is not None else ()))
    per_stage = {s: [sp.like(s, c) for c in counts] for s in params}
    hand_out = [x for s, vids in per_stage.items() for x in sp.move(s, stored, run, vids, "forward", "stacked param")]
    kept = [[sp.like(o, c) for o in F.outs[1:]] for c in counts]
    fwd = [(dataclasses.replace(F, ins=(F.ins[0], *(per_stage[s][t] for s in F.ins[1:1 + n]), *F.ins[1 + n:]),
                                outs=(F.outs[0], *kept[t]), times=c, label=f"{F.label} (stage {t})"),
            frozenset({t})) for t, c in enumerate(counts)]
    out = {Segment.PROLOGUE: list(lists[Segment.PROLOGUE]) + hand_out,
           Segment.FORWARD: _replace(lists[Segment.FORWARD], F, fwd),
           Segment.BACKWARD: list(lists[Segment.BACKWARD]), Segment.FINAL: list(lists[Segment.FINAL])}
    if B is None:
        return out
    grads, bwd = [], []
    for t, c in enumerate(counts):
        own = {**dict(zip(F.outs[1:], kept[t])), **{s: vids[t] for s, vids in per_stage.items()}}
        g = [sp.like(o, c) for o in B.outs[1:]]
        grads.append(g)
        bwd.append((dataclasses.replace(B, ins=tuple(own.get(x, x) for x in B.ins), outs=(B.outs[0], *g), times=c,
                                        label=f"{B.label} (stage {t})"), frozenset({t})))
    out[Segment.BACKWARD] = _replace(lists[Segment.BACKWARD], B, bwd)
    out[Segment.FINAL] = _gather_grads(sp, lists[Segment.FINAL], B, grads, run, stored)
    return out


def _replace(pairs: list, block: Step, per_stage: list) -> list:
    """A segment with the pipelined step replaced by its per-stage steps."""
    out = []
    for s, st in pairs:
        out += per_stage if s is block else [(s, st)]
    return out


def _gather_grads(sp: _Split, pairs: list, B: Step, grads: list, run: list, stored: list) -> list:
    """The final segment with each stacked gradient's sum over the micro-batches made per stage,
    then handed back to the ranks storing the param and joined there."""
    per_stage = {g: [grads[t][i] for t in range(sp.p)] for i, g in enumerate(B.outs[1:])}
    out = []
    for s, st in pairs:
        if s.kind != "allreduce" or s.ins[0] not in per_stage:
            out.append((s, st))
            continue
        sums = [sp.like(s.outs[0], c) for c in sp.counts]
        k = stored[1]   # the largest stored part's layers (the first's), which s.bytes counts
        for t, c in enumerate(sp.counts):
            out.append((dataclasses.replace(s, ins=(per_stage[s.ins[0]][t],), outs=(sums[t],),
                                            bytes=s.bytes * c // k, label=f"{s.label} (stage {t})"),
                        frozenset({t})))
        out += sp.move(sums, run, stored, [s.outs[0]] * sp.p, s.phase, "stacked gradient")
    return out


def check_counts(counts, layers: int, p: int, mesh, layout) -> tuple[int, ...]:
    """``counts`` as a tuple, or a LayoutError saying what is wrong with it."""
    counts = tuple(counts)
    bad = []
    if len(counts) != p:
        bad.append(f"{len(counts)} entries for {p} stages")
    if any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts):
        bad.append(f"entries {[c for c in counts if not isinstance(c, int) or isinstance(c, bool) or c < 1]} "
                   "are not positive integers")
    elif sum(counts) != layers:
        bad.append(f"they sum to {sum(counts)}, not the {layers} layers")
    if bad:
        raise LayoutError(message(
            f"compile: stage_layers={','.join(map(str, counts))} does not split {layers} layers over {p} stages.",
            inputs=[f"mesh: {mesh}", f"layout: {layout}"], bullets=bad,
            rule="one positive layer count per stage, summing to the pipelined repeat's layers",
            fix=f"give {p} counts summing to {layers}, e.g. {','.join(map(str, _even(layers, p)))}"))
    return counts


def _even(layers: int, p: int) -> list[int]:
    return [layers // p + (i < layers % p) for i in range(p)]
