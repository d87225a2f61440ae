"""A dim kept whole by a layout rule, ``dim:()`` (no axis), and the fixes that name it.

The held-out HRNet (``tests/heldout_hrnet.py``) under ``ch:model; cl:model`` on ``model:2``
has params holding both dims (``up [layer, cl, ch]``, ``to_lo [ch, cl]``), refused; the fix
used to ask for ``'up.ch:OTHER_AXIS'``, which a one-axis mesh does not have, and no rule could
keep a dim whole in one tensor. ``up.cl:()`` does; every fix a layout error suggests names only
axes the mesh has (or ``()``), so following it compiles.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import meshdsl as md
from meshdsl.errors import ParseError
from meshdsl.layout.layout import Layout
from meshdsl.layout.mesh import Mesh
from meshdsl.search.space import candidates
from conftest import assert_heldout_case_matches_dense
from test_errors import repeat_model
from test_reshape import _merge, _plan as _reshape_plan

HRNET = str(Path(__file__).parent / "heldout_hrnet.py")
MRL = str(Path(__file__).parent / "heldout_matryoshka.py")


def _outputs(model):
    return {"loss": model.loss, **md.grad(model.loss, model.params)}


def _caret(msg: str) -> tuple[str, int, int]:
    """(the source line shown, the caret's column in it, its width) of an error message."""
    lines = msg.splitlines()
    i = next(i for i, line in enumerate(lines) if re.fullmatch(r" *\^+", line))
    shown = re.match(r"    (line \d+: )?", lines[i - 1])
    col = len(lines[i]) - len(lines[i].lstrip()) - shown.end()
    return lines[i - 1][shown.end():], col, lines[i].count("^")


def _suggested_rules(msg: str) -> list[str]:
    """The quoted rules of a message's Fix line, each 'scope.dim:axes' or 'dim:axes'."""
    fix = msg.split("Fix:", 1)[1]
    return re.findall(r"'([\w.]+:(?:\(\)|\w+))'", fix)


# ---------------------------------------------------------------- the syntax

def test_the_empty_group_is_a_rule_with_no_axis():
    layout = Layout.parse("ch:model; up.cl:( )  # whole in up\nto_lo.cl:()")
    assert [(r.key, r.axis_names) for r in layout.rules] == [
        ((None, "ch"), ("model",)), (("up", "cl"), ()), (("to_lo", "cl"), ())]
    assert str(layout) == "ch:model; up.cl:(); to_lo.cl:()"
    assert str(Layout.parse(str(layout))) == str(layout)          # printed plans parse back
    assert [r.key for r in Layout.parse({"ch": "model", "up.cl": ()}).rules] == [(None, "ch"), ("up", "cl")]
    with pytest.raises(md.LayoutError, match="Contradicting layout rules for 'up.cl'"):
        Layout.parse("up.cl:(); up.cl:model")


@pytest.mark.parametrize("source,line,col,fragments", [
    ("up.ch:", "up.ch:", 5, ["rule 'up.ch:' has no target after ':'", "'up.ch:()'"]),
    ("up.ch:; cl:model", "up.ch:; cl:model", 5, ["'up.ch:()'"]),
    ("ch:model\nteacher.wte.ch:\ncl:model", "teacher.wte.ch:", 14, ["'teacher.wte.ch:()' to keep 'ch' whole"]),
    ("up.ch:(,)", "up.ch:(,)", 7, ["expected a name or ')' after '('", "'scope.dim:()'"]),
    ("up.ch:(;cl:model", "up.ch:(;cl:model", 6, ["'(' is never closed"]),
    ("up.ch:() cl:model", "up.ch:() cl:model", 9, ["between rules", "Fix: write 'up.ch:(); cl:model'"]),
])
def test_bad_forms_of_the_whole_rule_show_a_caret(source, line, col, fragments):
    with pytest.raises(ParseError) as info:
        Layout.parse(source)
    msg = str(info.value)
    assert _caret(msg)[:2] == (line, col), msg
    for fragment in fragments:
        assert fragment in msg, msg


@pytest.mark.parametrize("layout", ["ch:model; cl:model; up.cl:none", {"ch": "model", "up.cl": None}])
def test_a_word_for_no_axis_is_refused_with_the_whole_rule(layout):
    """'none' (or a dict's None) is not a mesh axis here: the fix names the form that is."""
    with pytest.raises(md.LayoutError) as info:
        md.compile(_outputs(md.load_model(HRNET, tiny=True)), "model:2", layout)
    msg = str(info.value)
    assert "'up.cl:()'" in msg or "{'up.cl': ()}" in msg, msg
    if isinstance(layout, str):
        assert _caret(msg) == (layout, layout.index("none"), 4), msg


# ---------------------------------------------------------------- what it does

def test_hrnet_with_one_dim_whole_in_each_shared_param_matches_dense():
    """The held-out round's workaround without its size-1 axis: 'up' and 'to_lo' hold ch and cl,
    both split over model elsewhere; ch stays whole in those two params only."""
    assert_heldout_case_matches_dense((HRNET, {}, "model:2", "ch:model; cl:model; up.ch:(); to_lo.ch:()"))


@pytest.mark.parametrize("path,mesh,layout", [
    (HRNET, "model:2", "ch:model; cl:model"),   # two dims of one param on the one axis
    (MRL, "model:3", "embed:model"),           # a 2-row head on 3 ranks: no part may be empty
])
def test_the_fix_on_a_one_axis_mesh_can_be_followed(path, mesh, layout):
    """Each refusal's fix names only rules this mesh can take; adding its '()' rules (one per
    tensor it names), as often as the compiler asks, gives a layout that compiles."""
    model, axes = md.load_model(path, tiny=True), set(Mesh.parse(mesh).names)
    asked = []
    for _ in range(4):
        try:
            md.compile(_outputs(model), mesh, layout)
            break
        except md.LayoutError as e:
            msg = str(e)
            rules = _suggested_rules(msg)
            assert rules and all(set(r.axis_names) <= axes for r in Layout.parse("; ".join(rules)).rules), msg
            whole = [r for r in rules if r.endswith(":()")]
            asked.append(whole)
            layout += "; " + "; ".join(whole)
    else:
        pytest.fail(f"still refused after adding {asked}")
    assert asked, "the layout was expected to be refused first"
    if path == HRNET:   # the later rule, cl:model, gives way in both params, named by one compile
        assert asked == [["to_lo.cl:()", "up.cl:()"]]


def test_a_pipeline_axis_fix_without_another_axis_keeps_the_dim_whole():
    with pytest.raises(md.LayoutError) as info:
        md.compile(repeat_model(), "stage:2", "layer:stage; batch:stage")
    msg = str(info.value)
    assert "Fix: keep 'batch' whole: drop 'batch:stage'" in msg and "another axis" not in msg, msg
    md.compile(repeat_model(), "stage:2", "layer:stage", microbatches=2)   # the fix followed
    with pytest.raises(md.LayoutError, match=r"map 'batch' to another axis, e\.g\. 'batch:model'"):
        md.compile(repeat_model(), "data:2; model:2", "layer:data; batch:data")


def test_a_global_whole_rule_stops_an_implied_split():
    """'hw:()' is a written global rule for hw: no split is implied for it from height's."""
    got, plan = _reshape_plan(_merge, "x:2", "height:x; hw:()")
    assert plan.layout.implied == ()
    assert got == [("reshape", "allgather", ("x",), "forward")]


@pytest.mark.parametrize("path", [HRNET, "transformer"])
def test_the_search_never_writes_a_whole_rule(path):
    """The search leaves a dim whole by giving it no rule; its two-dim options are dims no tensor
    holds together, so no candidate needs '()'."""
    model = md.load_model(path, tiny=True)
    for nproc in (2, 4):
        layouts = [c.layout for c in candidates(model, nproc)]
        assert layouts
        for text in layouts:
            assert all(r.axis_names for r in Layout.parse(text).rules), text
