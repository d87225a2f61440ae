"""Plans of several lookups' backward into one split table: their gradients, added into the
table's one gradient, reduced once for all of them where the cost model prices that lower
(lowering/shared_sums.py), not each lookup gathering its own ids and rows.  Tiny graphs,
simulated mesh; each plan's numbers are checked against the dense program (md.check, its
default tolerance: fp32 sums added in another order)."""
import pytest
import torch

import meshdsl as md

MESH, LAYOUT = "data:2; model:2", "batch:(data,model); items:model"


def _lookups(items: int, num_lookups: int, one_hot: bool = False):
    """``num_lookups`` lookups of one table [items, d] (ids [batch] and [batch, negs], alternately),
    their rows multiplied together; the loss and the table's gradient.  ``one_hot``: each lookup a
    contraction of the ids' one-hot with the table (its gradient an einsum, not a scatter_add)."""
    b, n, i, d = md.Dim("batch", 8), md.Dim("negs", 3), md.Dim("items", items), md.Dim("d", 4)
    with md.Graph():
        ids = [md.input(f"ids{k}", [b] if k % 2 == 0 else [b, n], torch.int64) for k in range(num_lookups)]
        t = md.param("t", [i, d])
        rows = [md.einsum(f"{' '.join(x.shape.names)} items, items d -> {' '.join(x.shape.names)} d",
                          md.one_hot(x, i), t) if one_hot else md.gather(t, x, "items") for x in ids]
        prod = rows[0]
        for r in rows[1:]:
            prod = prod * r
        loss = md.reduce_mean(md.reduce_sum(prod, "d"))
        out = {"loss": loss, **md.grad(loss, {"t": t})}
    gen = torch.Generator().manual_seed(0)
    feeds = {f"ids{k}": torch.randint(0, items, (8,) if k % 2 == 0 else (8, 3), generator=gen)
             for k in range(num_lookups)}
    return out, feeds


def _backward_moves(plan):
    """(kind, axes) of the collectives of the backward (the table gradient's, and its lookups')."""
    return [(s.kind, s.axes) for s in plan.steps if s.is_collective and s.phase == "backward"]


@pytest.mark.parametrize("num_lookups,one_hot", [(2, False), (4, False), (2, True)],
                         ids=["2-gathers", "4-gathers", "2-one-hot-einsums"])
def test_several_lookups_gradients_are_reduced_once_not_gathered_per_lookup(num_lookups, one_hot):
    # Table 24 x 4 floats = 384 B.  Each lookup alone would rather gather its ids and rows (a few
    # dozen bytes each) than reduce a partial table: 2 allgathers per lookup.  Summed into one
    # gradient, the lookups' partial tables add up locally and are reduced once: a reduce-scatter
    # over 'model' (the table's split) and an allreduce over 'data' (it is whole there).  One-hot
    # lookups' einsum gradients each reduce-scattered their partial table: one reduce-scatter now.
    out, feeds = _lookups(24, num_lookups, one_hot)
    plan = md.compile(out, MESH, LAYOUT)
    assert _backward_moves(plan) == [("reduce_scatter", ("model",)), ("allreduce", ("data",))], _backward_moves(plan)
    assert md.check(out, MESH, LAYOUT, feeds).ok


def test_a_big_table_few_ids_still_gathers_per_lookup():
    # Table 16384 x 4 floats = 256 KiB: reducing it once (a reduce-scatter and an allreduce, ~300
    # us by the default cost model) costs more than gathering the two lookups' few ids and rows
    # (4 allgathers, ~200 us, latency mostly), so the cost model keeps each lookup's gathers.
    out, feeds = _lookups(16384, 2)
    plan = md.compile(out, MESH, LAYOUT)
    moves = _backward_moves(plan)
    assert moves and all(k in ("allgather", "bucket_allgather") for k, _ in moves), moves   # (lowering/coalesce.py)
    assert md.check(out, MESH, LAYOUT, feeds).ok
