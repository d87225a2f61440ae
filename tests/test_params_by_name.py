"""Params given by name: ``md.run_dense``, ``md.run_simulated`` and ``md.check`` follow one rule.

A param of the outputs' graph that they do not read (a batch norm's running statistics next to a
training loss) is accepted and ignored; a name that is no param of the graph (a typo) is refused
with the closest name; a param of another shape or dtype than declared is refused, read or not.

Legend: ``batch`` examples, ``d`` features in, ``f`` features out.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from meshdsl.errors import GraphError
from meshdsl.train.model import load_module

B, D, F = md.Dim("batch", 4), md.Dim("d", 3), md.Dim("f", 2)
MESH, LAYOUT = "data:2", "batch:data"


def _tiny():
    """A loss that reads ``w``, in a graph that also holds ``unread`` (as running statistics are)."""
    with md.Graph() as g:
        x = md.input("x", [B, D])
        w = md.param("w", [D, F])
        md.param("unread", [F], init="zeros")
        loss = md.reduce_sum(md.einsum("batch d, d f -> batch f", x, w))
    gen = torch.Generator().manual_seed(0)
    feeds = {"x": torch.randn(4, 3, generator=gen)}
    return g, {"loss": loss}, feeds, {"w": torch.randn(3, 2, generator=gen)}


def _run(how: str, outputs, feeds, params):
    """The loss as ``how`` computes it from ``params`` (check: its result)."""
    if how == "run_dense":
        return md.run_dense(outputs, feeds, params=params)["loss"]
    if how == "run_simulated":
        return md.run_simulated(md.compile(outputs, MESH, LAYOUT), feeds, params=params)["loss"]
    return md.check(outputs, MESH, LAYOUT, feeds, params=params)


HOW = ["run_dense", "run_simulated", "check"]


@pytest.mark.parametrize("how", HOW)
def test_a_param_the_outputs_do_not_read_is_accepted_and_ignored(how):
    _, outputs, feeds, params = _tiny()
    got = _run(how, outputs, feeds, {**params, "unread": torch.ones(2)})
    if how == "check":
        assert got.ok, str(got)
        return
    want = (feeds["x"] @ params["w"]).sum()
    # fp32: a sum of 8 products in another order (and over 2 simulated ranks): a few ulps of ~|10|.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", HOW)
def test_a_name_that_is_no_param_of_the_graph_is_refused_with_the_closest(how):
    _, outputs, feeds, params = _tiny()
    with pytest.raises(GraphError) as e:
        _run(how, outputs, feeds, {**params, "unraed": torch.ones(2)})
    text = str(e.value)
    assert text.startswith(f"{how}: 1 of the 2 params given")
    assert "'unraed' is no param of the outputs' graph. Did you mean 'unread'?" in text
    assert "params of the graph: unread, w" in text


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("name", ["w", "unread"])
def test_a_param_of_another_shape_is_refused_read_or_not(how, name):
    _, outputs, feeds, params = _tiny()
    given = {**params, "unread": torch.zeros(2)}
    given[name] = torch.zeros(5)
    with pytest.raises(GraphError) as e:
        _run(how, outputs, feeds, given)
    want = "(3, 2) ([d:3, f:2])" if name == "w" else "(2,) ([f:2])"
    assert f"param '{name}' is of shape (5,), not of shape {want}" in str(e.value)


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("name", ["w", "unread"])
def test_a_param_of_another_dtype_is_refused_read_or_not(how, name):
    _, outputs, feeds, params = _tiny()
    given = {**params, "unread": torch.zeros(2)}
    given[name] = given[name].double()
    with pytest.raises(GraphError) as e:
        _run(how, outputs, feeds, given)
    assert f"param '{name}' is torch.float64, not torch.float32 (its declared dtype)" in str(e.value)


def test_check_takes_every_param_of_a_model_with_running_statistics():
    """The held-out ResNet's loss and gradients, given every param of its graph (its batch
    norms' running means and variances too, which the training loss does not read)."""
    mod = load_module(str(Path(__file__).parent / "heldout_resnetpool.py"))
    model = mod.build(mod.Config.tiny())
    grads = md.grad(model.loss, list(model.params.values()))
    outputs = {"loss": model.loss, **{f"grad/{k}": d for k, d in zip(model.params, grads)}}
    gen = torch.Generator().manual_seed(1)
    every = {k: torch.rand(t.shape.sizes, generator=gen) + 0.5 for k, t in model.graph.params().items()}
    assert set(every) - set(model.params), "the model keeps frozen running statistics"
    r = md.check(outputs, MESH, LAYOUT, model.make_feeds(0), params=every)
    assert r.ok, str(r)
