"""Index ops: iota (ranges), one_hot, gather (embedding lookup) and its gradient
scatter_add.

Each works on a split dim by knowing the global offset of its slice: iota adds
it, one_hot and gather shift the indices by it and mask what lies elsewhere.
A gather from a vocab-split table thus yields a lazy partial sum over the
vocab's axes (Megatron's vocab-parallel embedding).
"""
from __future__ import annotations

import functools
import math

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from ..core.graph import Graph, Tensor
from ..core.shape import Dim, Shape
from ..errors import GraphError, ShapeError, message
from .registry import ComputeSpec, Op, apply, register, run_device


@register
class Iota(Op):
    name = "iota"
    differentiable = False

    def infer(self, inputs, attrs):
        return [(Shape([attrs["dim"]]), attrs["dtype"])]

    def compute(self, ctx, attrs, *xs):
        d = attrs["dim"]
        off = ctx.offset(d.name)
        return torch.arange(off, off + ctx.size(d.name, d.size), dtype=attrs["dtype"], device=run_device())


@register
class OneHot(Op):
    name = "one_hot"
    differentiable = False

    def infer(self, inputs, attrs):
        (ids,) = inputs
        if ids.dtype.is_floating_point:
            raise ShapeError(message(f"one_hot: indices {ids!r} are {ids.dtype}.",
                                     rule="indices are integers", fix="cast them to torch.int64"))
        return [(Shape(list(ids.shape) + [attrs["dim"]]), attrs["dtype"])]

    def compute(self, ctx, attrs, ids):
        d = attrs["dim"]
        n = ctx.size(d.name, d.size)
        if attrs.get("check") and ids.numel() and get_proxy_mode() is None:
            # a cross-entropy's labels over a split class dim (ops/xent.py): out of range, the
            # whole dim's kernel raises, so every layout raises alike
            check_ids(ids, d.name, d.size, attrs["check"])
        local = ids - ctx.offset(d.name)
        return (local.unsqueeze(-1) == torch.arange(n, dtype=ids.dtype, device=ids.device)).to(attrs["dtype"])

    def grad(self, node, douts):
        return [None]


@register
class Gather(Op):
    """``table[ids]`` along ``dim``: out has ids' dims then the table's other dims."""

    name = "gather"

    def infer(self, inputs, attrs):
        ids, table = inputs
        name = attrs["dim"]
        attrs["pos"] = table.shape.index(name)
        rest = table.shape.without([name])
        clash = [d.name for d in rest if d.name in ids.shape]
        if clash:
            raise ShapeError(_shared_dims_message(ids, table, name, clash))
        return [(Shape(list(ids.shape) + list(rest)), table.dtype)]

    def spec(self, node):
        ids, table = node.inputs
        dims = {d.name: d.size for d in list(ids.shape) + list(table.shape)}
        return ComputeSpec(dims, reduce={node.attrs["dim"]: "sum"})

    def compute(self, ctx, attrs, ids, table):
        name, pos = attrs["dim"], attrs["pos"]
        # The ids' bounds are checked (check_ids), not while --compile traces a whole step
        # (runtime/whole.py): the compiled indexing checks its bounds, and a compiled step that
        # raises runs again eagerly, which raises here.
        traced = get_proxy_mode() is not None
        n = table.shape[pos]
        whole = n == attrs["size"] and ctx.offset(name) == 0
        if whole and ids.device.type == "cpu" and not traced:
            # the whole table on the CPU: index_select checks the bounds itself (no reduction first)
            try:
                out, err = table.index_select(pos, ids.reshape(-1)), None
            except (IndexError, RuntimeError) as e:
                err = e
            if err is not None:   # the GraphError is raised outside the except (no chained context)
                check_ids(ids, name, attrs["size"])
                raise err
            if pos:   # (the table's rows along its first dim, the usual case: no move)
                out = out.movedim(pos, 0)
            return out.reshape(*ids.shape, *[s for i, s in enumerate(table.shape) if i != pos])
        if ids.numel() and not traced:
            check_ids(ids, name, attrs["size"])
        local = ids - ctx.offset(name)
        if whole:
            out = table.index_select(pos, ids.reshape(-1))
            mask = None
        else:
            mask = (local >= 0) & (local < n)
            out = table.index_select(pos, torch.where(mask, local, 0).reshape(-1))
        out = out.movedim(pos, 0).reshape(*ids.shape, *[s for i, s in enumerate(table.shape) if i != pos])
        if mask is not None:
            out = out * mask.reshape(*ids.shape, *([1] * (table.dim() - 1))).to(out.dtype)
        return out

    def direct_for(self, attrs, ins, outs):
        # the whole table with its rows first (the usual embedding): one index_select, one view
        if attrs["pos"] or ins[1][0] != attrs["size"]:
            return None
        return functools.partial(_whole_rows, attrs["dim"], attrs["size"], outs[0])

    def flops(self, node, local):
        return math.prod(local.get(d.name, d.size) for d in node.outputs[0].shape)

    def grad(self, node, douts):
        ids, table = node.inputs
        return [None, apply("scatter_add", [ids, douts[0]], {"dim": table.shape.get(node.attrs["dim"]),
                                                             "table": table.shape})]


def _shared_dims_message(ids: Tensor, table: Tensor, name: str, clash: list[str]) -> str:
    """Why gather refuses ids and a table that share a dim (a per-sample gather, as an MAE's kept
    patches ``[batch, kept]`` from ``[batch, patches, d]``), and the one-hot contraction that does
    it, written out for these shapes."""
    out = list(ids.shape.names) + [d for d in table.shape.names if d != name and d not in ids.shape]
    eq = f"{' '.join(ids.shape.names)} {name}, {' '.join(table.shape.names)} -> {' '.join(out)}"
    return message(
        f"gather: ids {ids.shape} and table {table.shape} share dim(s) {clash} (gather along '{name}').",
        rule="gather picks rows of one table for every id: the output holds ids' dims then the table's "
             "other dims, once each; a dim in both would need a table per index of it (a per-sample, "
             "batched gather), which gather does not do",
        fix=f"for a per-sample gather, contract a one-hot of the ids: md.einsum(\"{eq}\", "
            f"md.one_hot(ids, table.shape[{name!r}]), table) (splits and gradients as any einsum); "
            f"if the shared names are different dims, rename one side's")


def _whole_rows(name: str, size: int, shape: tuple, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """:meth:`Gather.compute` for the whole table with its rows first, the output's local ``shape``
    given: the same checks (index_select's own on the CPU; before it elsewhere, unless traced)."""
    if not ids.is_cpu and get_proxy_mode() is None:
        check_ids(ids, name, size)
    try:
        out, err = table.index_select(0, ids.reshape(-1)), None
    except (IndexError, RuntimeError) as e:
        err = e
    if err is not None:   # the GraphError is raised outside the except (no chained context)
        check_ids(ids, name, size)
        raise err
    return out.view(shape)


def check_ids(ids: torch.Tensor, name: str, size: int, what: str = "gather: ids") -> None:
    """Raise a GraphError if an id is outside ``[0, size)`` (one reduction and one read back: on a
    GPU, one wait for the device).  Each rank sees global ids, so every layout raises alike.
    ``what`` names the caller and its indices (``"cross_entropy: labels"``)."""
    lo, hi = torch.stack(torch.aminmax(ids)).tolist()
    if lo < 0 or hi >= size:
        labels = what.startswith("cross_entropy")
        raise GraphError(message(
            f"{what} range over [{lo}, {hi}], outside dim '{name}' of size {size}.",
            rule=f"{'labels are class indices along' if labels else 'ids index the table along'} '{name}': "
                 f"0 <= {'label' if labels else 'id'} < {size}",
            fix="to leave out positions labelled with a marker such as -100, pass it: "
                "md.cross_entropy(logits, labels, dim, ignore_index=-100)"
                if labels else "check the fed ids (e.g. the vocabulary size) or clamp them"))


@register
class ScatterAdd(Op):
    """Sum rows of ``src`` into a zero table at ``ids`` along ``dim`` (gather's gradient)."""

    name = "scatter_add"
    linear = True
    # linear in the rows it sums: a partial sum of them (a gradient summed over a split batch or
    # the micro-batches) stays partial through it, reduced once on the table, not on the rows
    linear_args = (1,)

    def infer(self, inputs, attrs):
        ids, src = inputs
        return [(attrs["table"], src.dtype)]

    def spec(self, node):
        ids, src = node.inputs
        dims = {d.name: d.size for d in list(src.shape) + list(node.attrs["table"])}
        return ComputeSpec(dims, reduce={n: "sum" for n in ids.shape.names})

    def compute(self, ctx, attrs, ids, src):
        d, table = attrs["dim"], attrs["table"]
        if attrs.get("check") and ids.numel() and get_proxy_mode() is None:
            check_ids(ids, d.name, d.size, "scatter_add: ids")   # a user's ids (gather checked its own)
        n = ctx.size(d.name, d.size)
        local = ids.reshape(-1)
        rest = [ctx.size(t.name, t.size) for t in table if t.name != d.name]
        rows = src.reshape(local.numel(), *rest)
        out = torch.zeros(n, *rest, dtype=src.dtype, device=src.device)
        if n == d.size:   # the whole table here: every id is a row of it (gather checked them)
            out.index_add_(0, local, rows)
        else:
            local = local - ctx.offset(d.name)
            mask = (local >= 0) & (local < n)
            out.index_add_(0, torch.where(mask, local, 0), rows * mask.reshape(-1, *([1] * len(rest))).to(src.dtype))
        pos = table.index(d.name)
        return out.movedim(0, pos)

    def direct_for(self, attrs, ins, outs):
        # the whole table with its rows first (gather's gradient of the usual embedding): the
        # local sizes written in, the zeros made like ``src`` (its dtype and device)
        d, (ids, _), (out,) = attrs["dim"], ins, outs
        if attrs["table"].index(d.name) or out[0] != d.size or attrs.get("check"):
            return None
        return functools.partial(_into_rows, out, (math.prod(ids), *out[1:]))

    def flops(self, node, local):
        return math.prod(local.get(d.name, d.size) for d in node.inputs[1].shape)

    def grad(self, node, douts):
        """Each summed row's gradient is its table row's: a gather of the table's gradient,
        in ``src``'s dim order."""
        ids, src = node.inputs
        rows = gather(douts[0], ids, node.attrs["dim"].name)
        if rows.shape.names != src.shape.names:
            from .shape_ops import transpose
            rows = transpose(rows, list(src.shape.names))
        return [None, rows]


def scatter_add(src: Tensor, ids: Tensor, dim: Dim) -> Tensor:
    """Rows of ``src`` summed into a zero table along new dim ``dim`` at integer ``ids``
    (``torch.index_add``, a GNN's sum of messages at their target nodes); :func:`gather`'s
    transpose, and its gradient is a gather.

    Args:
      src: a float tensor holding every dim of ``ids`` and the row's dims, e.g. messages
        ``[edges, hidden]``.
      ids: integer indices into ``dim``, e.g. each edge's target node ``[edges]``.
      dim: the table's new dim, e.g. ``md.Dim("nodes", 100)``: ``0 <= id < dim.size``.

    Returns:
      ``[dim, ...]``: ``dim`` then ``src``'s dims that ``ids`` lacks, in ``src``'s order;
      ``out[j] = sum of src's rows whose id is j`` (zeros where none is).

    Layouts split the ids' dims (each rank sums its rows; the table is a partial sum reduced
    once) and ``dim`` (each rank keeps the rows that fall in its slice) without gathering.
    """
    if not isinstance(dim, Dim) or not isinstance(src, Tensor) or not isinstance(ids, Tensor):
        raise ShapeError(message(f"scatter_add: dim={dim!r} must be a Dim (src and ids Tensors).",
                                 rule="scatter_add makes a new table dim: a Dim with its name and size",
                                 fix="write md.scatter_add(src, ids, md.Dim('nodes', 100))"))
    bad = [f"ids are {ids.dtype}: indices are integers"] if ids.dtype.is_floating_point or ids.dtype == torch.bool \
        else []
    bad += [f"src has no dim '{d}' of ids" for d in ids.shape.names if d not in src.shape]
    bad += [f"'{d}' has size {ids.shape.get(d).size} in ids and {src.shape.get(d).size} in src"
            for d in ids.shape.names if d in src.shape and ids.shape.get(d).size != src.shape.get(d).size]
    bad += [f"src already has a dim '{dim.name}'"] if dim.name in src.shape else []
    bad += [f"src is {src.dtype}, not a float tensor"] if not src.dtype.is_floating_point else []
    if bad:
        raise ShapeError(message(f"scatter_add: cannot sum {src!r} at {ids!r} into '{dim.name}'.", bullets=bad,
                                 rule="src holds every dim of ids (one row per id) and the row's dims; the "
                                      "table's dim is new to src; ids are integers",
                                 fix="e.g. src [edges, hidden], ids [edges] and dim md.Dim('nodes', N)"))
    rest = [d for d in src.shape if d.name not in ids.shape]
    order = list(ids.shape.names) + [d.name for d in rest]
    if list(src.shape.names) != order:
        from .shape_ops import transpose
        src = transpose(src, order)
    return apply("scatter_add", [ids, src], {"dim": dim, "table": Shape([dim, *rest]), "check": True})


def _into_rows(shape: tuple, rows: tuple, ids: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """:meth:`ScatterAdd.compute` for the whole table with its rows first: ``src``'s rows (viewed
    as ``rows``) summed into a zero table of ``shape`` at ``ids``."""
    return src.new_zeros(shape).index_add_(0, ids.reshape(-1), src.reshape(rows))


def iota(dim: Dim, dtype=torch.int64) -> Tensor:
    """``[0, 1, ..., dim.size-1]`` along ``dim``."""
    Graph.current()
    if not isinstance(dim, Dim):
        raise ShapeError(message(f"iota: {dim!r} is not a Dim.", rule="iota counts along a Dim",
                                 fix="pass meshdsl.Dim(name, size)"))
    return apply("iota", [], {"dim": dim, "dtype": dtype})


def arange(dim: Dim, dtype=torch.int64) -> Tensor:
    """Position ids ``[0, 1, ..., dim.size-1]`` along ``dim`` (the same op as :func:`iota`).

    Each rank counts from its slice's offset, so positions stay global on a split dim.

    Args:
      dim: the Dim to count along, e.g. ``Dim("seq", 128)``.
      dtype: the result's dtype; ``torch.float32`` gives positions ready to scale
        (a rotary embedding's angles: ``md.arange(seq, torch.float32) * inv_freq``).

    Returns:
      A Tensor with the single dim ``dim``.

    Raises:
      ShapeError: ``dim`` is not a Dim.
    """
    if not isinstance(dim, Dim):
        raise ShapeError(message(f"arange: {dim!r} is not a Dim.", rule="arange counts along a Dim",
                                 fix="pass meshdsl.Dim(name, size), e.g. md.arange(md.Dim('seq', 128))"))
    return iota(dim, dtype)


def one_hot(ids: Tensor, dim: Dim, dtype=torch.float32, check: str = "") -> Tensor:
    """One-hot encode integer ``ids`` along new dim ``dim`` (an id outside it: a row of zeros).
    ``check`` (e.g. ``"cross_entropy: labels"``) raises a GraphError instead, naming that caller."""
    if not isinstance(dim, Dim) or not isinstance(dtype, torch.dtype):
        bad = f"dim={dim!r} ({type(dim).__name__})" if not isinstance(dim, Dim) else f"dtype={dtype!r}"
        raise ShapeError(message(f"one_hot: {bad} of ids {ids!r} is not a "
                                 + ("Dim." if not isinstance(dim, Dim) else "torch.dtype."),
                                 rule="one_hot adds a new dim, a Dim with its name and size, of a torch dtype",
                                 fix="write md.one_hot(ids, md.Dim('vocab', 100), dtype=torch.float32)"))
    return apply("one_hot", [ids], {"dim": dim, "dtype": dtype, **({"check": check} if check else {})})


def gather(table: Tensor, ids: Tensor, dim) -> Tensor:
    """Embedding lookup: rows of ``table`` along ``dim`` picked by integer ``ids``.

    The output has ids' dims then the table's other dims; ids and table share no dim (one table
    for every id). A per-sample gather (ids ``[batch, kept]`` into ``[batch, patches, d]``) is a
    one-hot contraction: ``einsum("batch kept patches, batch patches d -> batch kept d",
    one_hot(ids, table.shape["patches"]), table)``.
    """
    name = dim.name if isinstance(dim, Dim) else dim
    size = table.shape.get(name).size
    if ids.dtype.is_floating_point:
        raise ShapeError(message(f"gather: ids {ids!r} are {ids.dtype}.", rule="indices are integers",
                                 fix="cast them to torch.int64"))
    return apply("gather", [ids, table], {"dim": name, "size": size})


def causal_mask(q: Dim, k: Dim) -> Tensor:
    """Boolean [q, k] mask, True where key position <= query position."""
    from .elementwise import greater_equal
    if not isinstance(q, Dim) or not isinstance(k, Dim) or q.name == k.name:
        raise ShapeError(message(f"causal_mask({q!r}, {k!r}): needs two Dims with different names.",
                                 rule="the mask is [query, key]; the two positions are different dims",
                                 fix="name the key dim apart, e.g. causal_mask(Dim('seq', n), Dim('key_seq', n))"))
    return greater_equal(iota(q), iota(k))


__all__ = ["iota", "arange", "one_hot", "gather", "scatter_add", "causal_mask"]
