"""md.scatter_add (meshdsl/ops/embed.py): rows summed into a new table dim at integer ids.

torch's ``index_add`` and the dense program are the oracles, on a graph-network layer: each
edge's message is a gather of its source node's features through a linear map, summed at its
target node.  Split edges sum partial tables reduced once; a split node dim keeps the rows that
fall in each rank's slice.

Legend: nodes 6, edges 10, hidden/h2 4.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.errors import GraphError, ShapeError

N, E, H = 6, 10, 4


def _layer():
    h = md.input("h", [md.Dim("nodes", N), md.Dim("hidden", H)])
    src = md.input("src", [md.Dim("edges", E)], dtype=torch.int64)
    dst = md.input("dst", [md.Dim("edges", E)], dtype=torch.int64)
    w = md.param("w", [md.Dim("hidden", H), md.Dim("h2", H)])
    # the message's dims in another order than [edges, h2]: scatter_add takes any order
    msg = md.tanh(md.einsum("edges hidden, hidden h2 -> h2 edges", md.gather(h, src, "nodes"), w))
    agg = md.scatter_add(msg, dst, md.Dim("nodes", N))
    loss = md.reduce_sum(agg * agg)
    gh, gw = md.grad(loss, [h, w])
    return {"agg": agg, "loss": loss, "gh": gh, "gw": gw}


def _data():
    gen = torch.Generator().manual_seed(0)
    feeds = {"h": torch.randn(N, H, generator=gen), "src": torch.randint(0, N, (E,), generator=gen),
             "dst": torch.randint(0, N, (E,), generator=gen)}
    return feeds, {"w": torch.randn(H, H, generator=gen)}


def test_dense_is_torchs_index_add_with_autograd():
    with md.Graph():
        outs = _layer()
        feeds, params = _data()
        got = md.run_dense(outs, feeds, params)
    assert outs["agg"].shape.names == ("nodes", "h2")
    h, w = feeds["h"].clone().requires_grad_(), params["w"].clone().requires_grad_()
    agg = torch.zeros(N, H).index_add(0, feeds["dst"], torch.tanh(h[feeds["src"]] @ w))
    loss = (agg * agg).sum()
    gh, gw = torch.autograd.grad(loss, [h, w])
    # the same kernels; the gradients sum the edges' rows in another order: fp32 rounding of O(10)
    torch.testing.assert_close(got["agg"], agg.detach(), rtol=1e-6, atol=1e-6)
    for name, want in (("loss", loss), ("gh", gh), ("gw", gw)):
        torch.testing.assert_close(got[name], want.detach(), rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("mesh, layout", [
    ("data:2", "edges:data"),          # each rank sums its edges: a partial table, reduced once
    ("model:2", "nodes:model"),
    ("model:3", "nodes:model"),        # uneven: 2 rows a rank
    ("model:2", "hidden:model"),
    ("a:2; b:2", "edges:a, nodes:b"),
])
def test_split_layouts_match_the_dense_program(mesh, layout):
    with md.Graph():
        outs = _layer()
        plan = md.compile(outs, mesh, layout)
        feeds, params = _data()
        got, want = md.run_simulated(plan, feeds, params), md.run_dense(outs, feeds, params)
    for name in want:
        # split sums add the ranks' parts in another order: fp32 rounding of values O(10)
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{mesh} {n}: {m}")


def test_split_edges_reduce_the_table_once_not_the_rows():
    with md.Graph():
        plan = md.compile({"agg": _layer()["agg"]}, "data:2", "edges:data")
    assert [(s.kind, s.bytes) for s, _ in plan.collectives()] == [("allreduce", N * H * 4)]


def test_an_id_outside_the_table_is_a_clear_error_on_every_layout():
    with md.Graph():
        outs = _layer()
        feeds, params = _data()
        feeds["dst"][3] = N
        with pytest.raises(GraphError, match=r"scatter_add: ids range over \[\d, 6\], outside dim 'nodes' of size 6"):
            md.run_dense(outs, feeds, params)
        with pytest.raises(GraphError, match=r"scatter_add: ids range over"):
            md.run_simulated(md.compile(outs, "model:2", "nodes:model"), feeds, params)


def test_bad_arguments_name_the_rule_and_the_fix():
    with md.Graph():
        src = md.input("s", [md.Dim("edges", 3), md.Dim("hidden", 2)])
        ids = md.input("i", [md.Dim("edges", 3)], dtype=torch.int64)
        with pytest.raises(ShapeError, match=r"dim='nodes' must be a Dim"):
            md.scatter_add(src, ids, "nodes")
        with pytest.raises(ShapeError, match=r"ids are torch.float32: indices are integers"):
            md.scatter_add(src, md.input("f", [md.Dim("edges", 3)]), md.Dim("nodes", 4))
        with pytest.raises(ShapeError, match=r"src has no dim 'pairs' of ids"):
            md.scatter_add(src, md.input("p", [md.Dim("pairs", 3)], dtype=torch.int64), md.Dim("nodes", 4))
        with pytest.raises(ShapeError, match=r"'edges' has size 5 in ids and 3 in src"):
            md.scatter_add(src, md.input("j", [md.Dim("edges", 5)], dtype=torch.int64), md.Dim("nodes", 4))
        with pytest.raises(ShapeError, match=r"src already has a dim 'hidden'"):
            md.scatter_add(src, ids, md.Dim("hidden", 4))
