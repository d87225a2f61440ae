"""Lowering of top_k: torch's kernel where the dim is whole, a two-round top-k where it is split.

The kernel needs the searched dim whole on a rank (``fixed`` in the op's spec), so lowered
generically a split dim is gathered: a sparse autoencoder's whole ``[batch, dict]``
pre-activations, to keep ``k`` of a dictionary of thousands.  The ``k`` largest of the whole dim
are among the ``k`` largest of each rank's part, so where the dim is split evenly into parts longer
than ``k``, the node is lowered as the composite of the same answer: each rank's top ``k`` of its
part (local), their global indices (the part's offset added), and the top ``k`` of those
``parts * k`` candidates, whose gather moves ``k`` values and ``k`` int64 indices a rank
instead of the part: where those are fewer bytes (``parts * k * (itemsize + 8) < size *
itemsize``; a tiny dim is gathered as before).
Values and indices equal to the dense kernel's: it keeps tied values lowest index first
(:func:`~meshdsl.ops.topk.first_of_ties`), as each part's top k and the candidates' order do.
"""
from __future__ import annotations

from ..layout.sharding import Sharding, is_even
from ..ops.elementwise import equal, where
from ..ops.embed import iota
from ..ops.reduce import reduce_sum
from ..ops.shape_ops import rearrange, transpose
from ..ops.topk import top_k
from .composite import lower_composite
from .generic import lower_generic
from .plan import MB_AXIS
from .rules import lowering


def composite_top_k(x, dim: str, new_dim, parts: int, lay=lambda t, d: None):
    """``top_k(x, dim, new_dim.size)`` from a top-k of each of ``parts`` equal parts of ``dim``
    and a top-k of their candidates (``x``'s other dims, in their order); ``lay(t, d)`` lays
    the sub-graph's tensor ``t`` out with its dim ``d`` split as ``dim`` arrives (each rank
    its own part's candidates)."""
    k, size = new_dim.size, x.shape.get(dim).size
    names = [d.name for d in x.shape]
    cut = rearrange(x, _split_pattern(names, dim), topk_per=size // parts)
    vals, idx = top_k(cut, "topk_per", k, new_dim="topk_cand")           # each part's own top k
    idx = idx + iota(cut.shape["topk_parts"]) * (size // parts)          # global positions
    cands = rearrange(vals, "... topk_parts topk_cand -> ... (topk_parts topk_cand)")
    gidx = rearrange(idx, "... topk_parts topk_cand -> ... (topk_parts topk_cand)")
    for t in (cut, vals, idx):
        lay(t, "topk_parts")
    for t in (cands, gidx):
        lay(t, "topk_parts_topk_cand")
    both = cands.shape["topk_parts_topk_cand"]
    out, pos = top_k(cands, both.name, k, new_dim=new_dim)
    hit = equal(pos, iota(both))                                         # [..., new_dim, both]
    out_idx = reduce_sum(where(hit, gidx, 0), both.name)
    order = [new_dim.name if n == dim else n for n in names]
    return transpose(out, order), transpose(out_idx, order)


def _split_pattern(names, dim: str) -> str:
    """``"a (topk_parts topk_per) b -> a b topk_parts topk_per"``: ``dim`` cut into its parts and
    their elements, last."""
    left = " ".join("(topk_parts topk_per)" if n == dim else n for n in names)
    return " ".join([left, "->", *(n for n in names if n != dim), "topk_parts", "topk_per"])


def _parts(lw, node) -> int:
    """The equal parts a split top_k's dim arrives in, where the two-round form pays: 0 otherwise."""
    dim, k = node.attrs["dim"], node.attrs["new_dim"].size
    cur = lw.sharding(lw.value(node.inputs[0]))
    axes = cur.axes_of(dim)
    size = node.inputs[0].shape.get(dim).size
    if not axes or MB_AXIS in axes or cur.parts or cur.cyclic:   # (the candidates' layout keeps plain splits only)
        return 0
    if not is_even(size, lw.mesh, axes):
        return 0
    parts = lw.mesh.axis_size(tuple(axes))
    # the candidates' values and int64 indices, against the dim's values gathered whole
    item = node.inputs[0].dtype.itemsize
    return parts if k < size // parts and parts * k * (item + 8) < size * item else 0


@lowering("top_k")
def lower_top_k(lw, node) -> None:
    """Lower a top_k; see the module docstring."""
    parts = _parts(lw, node)
    if not parts:
        lower_generic(lw, node)
        return
    dim, new_dim = node.attrs["dim"], node.attrs["new_dim"]
    split = dict(lw.sharding(lw.value(node.inputs[0])).split)
    axes = split.pop(dim)

    def lay(t, d):   # (one note, on the first: the plan's rows show the rest)
        why = f"top_k: each rank's top {new_dim.size} of its part of '{dim}'" if d == "topk_parts" and \
            t.node.op.name == "rearrange" else ""
        lw.set_target(t, Sharding.of(t.shape, {**split, d: axes}), why)

    lower_composite(lw, node, lambda x: list(composite_top_k(x, dim, new_dim, parts, lay)))
