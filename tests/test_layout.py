"""Layout targets and mesh axis sizes, which the compiler asks for once per tensor and per
candidate: both are remembered, and what they remember must never change an answer."""
from __future__ import annotations

import pytest

from meshdsl.core.shape import Dim, Shape
from meshdsl.errors import LayoutError
from meshdsl.layout.layout import Layout
from meshdsl.layout.mesh import Mesh

MESH = Mesh.parse("data:2; model:2; one:1")
SHAPE = Shape([Dim("batch", 4), Dim("d_ff", 8)])


def test_targets_are_the_same_fresh_list_every_time():
    lay = Layout.parse("batch:data; d_ff:(model,one)")
    first = lay.targets(SHAPE, (), MESH, "h", strict=False)
    first.append("a caller's own change")   # must not reach the remembered answer
    again = lay.targets(SHAPE, (), MESH, "another tensor", strict=False)
    assert again == lay._targets_of(SHAPE, (), MESH, "x", False)
    assert len(again) == 1 and again[0][0].split == {"batch": ("data",), "d_ff": ("model",)}


def test_conflicts_are_resolved_the_same_way_when_asked_again():
    lay = Layout.parse("batch:data; d_ff:data")
    got = [lay.targets(SHAPE, (), MESH, "h", strict=False) for _ in range(2)]
    assert got[0] == got[1] and len(got[0]) == 2
    assert got[0][0][0].split == {"batch": ("data",)} and "axis conflict resolved" in got[0][0][1]


def test_an_error_names_each_tensor_that_asks():
    # A conflict is an error for params (strict); the answer to a lax ask is not reused for it,
    # and each strict ask names its own tensor.
    lay = Layout.parse("batch:data; d_ff:data")
    lay.targets(SHAPE, (), MESH, "h", strict=False)
    for what in ("w1", "w2"):
        with pytest.raises(LayoutError, match=f"Tensor '{what}'"):
            lay.targets(SHAPE, (), MESH, what, strict=True)


def test_scopes_and_meshes_are_told_apart():
    lay = Layout.parse("batch:data; params.d_ff:model")
    plain = lay.targets(SHAPE, (), MESH, "h", strict=False)[0][0]
    scoped = lay.targets(SHAPE, ("params",), MESH, "w", strict=False)[0][0]
    other = lay.targets(SHAPE, ("params",), Mesh.parse("data:2; model:1"), "w", strict=False)[0][0]
    assert plain.split == {"batch": ("data",)}
    assert scoped.split == {"batch": ("data",), "d_ff": ("model",)}
    assert other.split == {"batch": ("data",)}   # a size-1 axis splits nothing


@pytest.mark.parametrize("axes, size", [((), 1), (("data",), 2), (("data", "model"), 4), (["model", "one"], 2),
                                        (("one",), 1)])
def test_axis_size_of_a_tuple_or_a_list(axes, size):
    assert MESH.axis_size(axes) == size
    assert MESH.axis_size(axes) == size   # remembered for a tuple, computed for a list
    assert Mesh.parse("data:2; model:2; one:1").axis_size(axes) == size


def test_an_unknown_axis_is_never_remembered():
    with pytest.raises(KeyError):
        MESH.axis_size(("nope",))
    assert ("nope",) not in MESH._memo


def test_groups_are_the_same_asked_again_or_with_a_list():
    mesh = Mesh.parse("a:2; b:3")
    assert mesh.group(4, ("b",)) == (3, 4, 5) == mesh.group(4, ["b"])
    assert mesh.group(4, ("a", "b")) == tuple(range(6))
    assert mesh.groups(("a",)) == ((0, 3), (1, 4), (2, 5)) == mesh.groups(["a"])
    assert mesh.groups(()) == tuple((r,) for r in range(6))


def _implied(text: str):
    """An implied rule as the compiler makes it (meshdsl/lowering/implied.py): global, with its why."""
    (r,) = Layout.parse(text).rules
    return (r, f"implied by reshape: {r}")


def test_implied_rules_rank_after_the_written_ones():
    lay = Layout.parse("batch:data; params.d_ff:model").with_implied((_implied("d_ff:data"),))
    assert str(lay) == "batch:data; params.d_ff:model" and len(lay.rules) == 2   # what the user wrote
    # a tensor with both dims: the written batch:data wins the axis over the implied d_ff:data
    assert lay.targets(SHAPE, (), MESH, "h", strict=False)[0][0].split == {"batch": ("data",)}
    assert lay.targets(Shape([Dim("d_ff", 8)]), (), MESH, "h", strict=False)[0][0].split == {"d_ff": ("data",)}
    # a written scoped rule still places its tensors' dim
    assert lay.targets(SHAPE, ("w", "params"), MESH, "w", strict=True)[0][0].split == \
        {"batch": ("data",), "d_ff": ("model",)}


def test_a_written_global_rule_drops_the_implied_one():
    lay = Layout.parse("d_ff:model").with_implied((_implied("d_ff:data"),))
    assert lay.implied == ()
    assert lay.targets(SHAPE, (), MESH, "h", strict=False)[0][0].split == {"d_ff": ("model",)}
