"""Python-API input validation: meshes, layouts and dims given as Python values.

A catalogue of bad inputs.  Each must raise the named
:class:`meshdsl.MeshDSLError` subclass (never a ZeroDivisionError, a bare
ValueError or a silently truncated value), with a message that names the
problem; for strings, the caret must underline the offending text.  Mesh dicts,
``Mesh(...)`` and mesh strings follow one set of rules: axis names are ASCII
identifiers, sizes are ints >= 1, no axis twice, and an empty mesh only when
asked for explicitly (``Mesh(())`` or ``{}``).
"""
from __future__ import annotations

import re

import pytest
import torch

import meshdsl as md
from meshdsl.errors import LayoutError, MeshDSLError, MeshError, ParseError, ShapeError

B, D, F = md.Dim("batch", 8), md.Dim("d_model", 4), md.Dim("d_ff", 8)


def _loss():
    with md.Graph():
        x = md.input("x", [B, D])
        w = md.param("w", [D, F])
        return md.reduce_mean(md.einsum("batch d_model, d_model d_ff -> batch d_ff", x, w) ** 2)


def compile_with(mesh, layout="batch:data"):
    return lambda: md.compile(_loss(), mesh, layout)


_LONG_LAYOUT = "; ".join([f"dim{i}:data" for i in range(8_000)] + ["batch data"])

# (id, thunk, exception class, key phrases, text the caret must underline or None)
CASES = [
    # ------------------------------------------------ meshes as dicts
    ("dict_negative_size", compile_with({"data": -2}), MeshError,
     ["Invalid mesh {'data': -2}: axis 'data' has size -2.", "positive integers"], None),
    ("dict_zero_size", compile_with({"data": 0}), MeshError, ["axis 'data' has size 0."], None),
    ("dict_float_size", compile_with({"data": 2.9}), MeshError, ["has size 2.9 (float)"], None),
    ("dict_float_integral", compile_with({"data": 2.0}), MeshError, ["has size 2.0 (float)"], None),
    ("dict_str_size", compile_with({"data": "two"}), MeshError, ["has size 'two' (str)"], None),
    ("dict_bool_size", compile_with({"data": True}), MeshError, ["has size True (bool)"], None),
    ("dict_unicode_name", compile_with({"dätä": 2}), MeshError,
     ["axis name 'dätä' is not a valid name", "ASCII identifier"], None),
    ("dict_int_name", compile_with({3: 2}), MeshError, ["axis name 3 (int) is not a valid name"], None),
    ("dict_empty_name", compile_with({"": 2}), MeshError, ["axis name '' is not a valid name"], None),
    ("dict_spaced_name", compile_with({"da ta": 2}), MeshError, ["'da ta' is not a valid name"], None),
    # ------------------------------------------------ meshes built directly
    ("mesh_twice", lambda: md.Mesh((("data", 2), ("data", 2))), MeshError,
     ["axis 'data' is named twice.", "each mesh axis has a unique name", "size 4"], None),
    ("mesh_zero", lambda: md.Mesh((("data", 0),)), MeshError, ["axis 'data' has size 0."], None),
    ("mesh_float", lambda: md.Mesh((("data", 1.5),)), MeshError, ["has size 1.5 (float)"], None),
    ("mesh_bad_name", lambda: md.Mesh((("9lives", 2),)), MeshError, ["'9lives' is not a valid name"], None),
    ("mesh_not_pairs", lambda: md.Mesh((("data",),)), MeshError,
     ["entry ('data',) is not a (name, size) pair"], None),
    ("mesh_from_str", lambda: md.Mesh("data:2"), MeshError,
     ["axes must be a tuple of (name, size) pairs, got str", "Mesh.parse"], None),
    # ------------------------------------------------ meshes of a wrong type
    ("mesh_list", compile_with([("data", 2)]), MeshError,
     ["expected a mesh, got list", "a dict {axis: size}"], None),
    ("mesh_tuple", compile_with((("data", 2),)), MeshError, ["expected a mesh, got tuple"], None),
    ("mesh_int", compile_with(4), MeshError, ["Invalid mesh 4: expected a mesh, got int"], None),
    ("mesh_none", compile_with(None), MeshError, ["expected a mesh, got NoneType"], None),
    # ------------------------------------------------ empty mesh strings
    ("mesh_empty_string", compile_with("", None), ParseError,
     ["the string names no mesh axis", "Mesh(())", "'data:1'"], None),
    ("mesh_only_separators", compile_with(";;;", None), ParseError,
     ["the string names no mesh axis"], ";;;"),
    ("mesh_only_comment", compile_with("# nothing", None), ParseError,
     ["the string names no mesh axis"], "# nothing"),
    ("mesh_crlf_size_zero", compile_with("data:2\r\nmodel:0", None), ParseError,
     ["line 2: model:0", "axis 'model' has size 0"], "0"),
    # ------------------------------------------------ layouts
    ("layout_cr_line_two", compile_with("data:2", "batch:data\rd_ff model"), ParseError,
     ["line 2: d_ff model", "Fix: write 'd_ff:model'."], "model"),
    ("layout_long", compile_with("data:2", _LONG_LAYOUT), ParseError,
     ["expected ':' or '.' after name 'batch'", "    ...", "Fix: write 'batch:data'."], "data"),
    ("layout_int", compile_with("data:2", 5), LayoutError, ["expected a layout, got int"], None),
    ("layout_list", compile_with("data:2", ["batch:data"]), LayoutError, ["expected a layout, got list"], None),
    ("layout_dict_unicode_dim", compile_with("data:2", {"bätch": "data"}), LayoutError,
     ["'bätch' is not a valid name", "ASCII identifier"], None),
    ("layout_dict_unicode_axis", compile_with("data:2", {"batch": "dätä"}), LayoutError,
     ["'dätä' is not a valid name"], None),
    ("layout_dict_empty_dim", compile_with("data:2", {"params.": "data"}), LayoutError,
     ["'' is not a valid name"], None),
    ("layout_dict_axis_twice", compile_with("data:2", {"batch": ("data", "data")}), LayoutError,
     ["not a mesh axis or a tuple of distinct axes"], None),
    ("layout_dict_int_axis", compile_with("data:2", {"batch": 3}), LayoutError,
     ["not a mesh axis or a tuple of distinct axes"], None),
    # ------------------------------------------------ dims
    ("dim_unicode", lambda: md.Dim("dätä", 2), ShapeError, ["bad name", "ASCII identifier"], None),
    ("dim_digit_first", lambda: md.Dim("1st", 2), ShapeError, ["bad name"], None),
    ("dim_empty", lambda: md.Dim("", 2), ShapeError, ["bad name"], None),
    ("dim_dotted", lambda: md.Dim("a.b", 2), ShapeError, ["bad name"], None),
    ("dim_not_str", lambda: md.Dim(3, 2), ShapeError, ["bad name"], None),
    ("dim_zero", lambda: md.Dim("batch", 0), ShapeError, ["size must be a positive int"], None),
    ("dim_negative", lambda: md.Dim("batch", -4), ShapeError, ["size must be a positive int"], None),
    ("dim_float", lambda: md.Dim("batch", 4.0), ShapeError, ["got 4.0 (float)"], None),
    ("dim_bool", lambda: md.Dim("batch", True), ShapeError, ["got True (bool)", "not a bool"], None),
    ("dim_str", lambda: md.Dim("batch", "4"), ShapeError, ["got '4' (str)"], None),
]


def _underlined(msg: str) -> str:
    """The text the caret line of ``msg`` underlines in the line above it."""
    lines = msg.splitlines()
    for shown, under in zip(lines, lines[1:]):
        m = re.fullmatch(r" *(\^+)", under)
        if m:
            return shown[m.start(1):m.end(1)]
    raise AssertionError(f"no caret line in:\n{msg}")


@pytest.mark.parametrize("thunk,exc,phrases,target", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_python_input(thunk, exc, phrases, target):
    with pytest.raises(MeshDSLError) as info:
        thunk()
    err = info.value
    assert type(err) is exc, f"{type(err).__name__}: {err}"
    msg = str(err)
    for phrase in phrases:
        assert phrase in msg, msg
    assert "Rule: " in msg and "Fix: " in msg, msg
    # One clean message: nothing internal chained to it.
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__), msg
    if target is not None:
        assert _underlined(msg) == target, msg


def test_good_dict_mesh_matches_the_string():
    loss = _loss()
    a, b = md.compile(loss, {"data": 2, "model": 2}, "batch:data"), md.compile(loss, "data:2; model:2", "batch:data")
    assert a.mesh.axes == b.mesh.axes == (("data", 2), ("model", 2))
    assert [s.bytes for s in a.steps] == [s.bytes for s in b.steps]
    assert md.Mesh([["data", 2]]).axes == (("data", 2),)  # lists are normalised; the Mesh stays hashable
    assert hash(md.Mesh([["data", 2]])) == hash(md.Mesh((("data", 2),)))


@pytest.mark.parametrize("mesh", [md.Mesh(()), {}], ids=["Mesh(())", "{}"])
def test_explicit_empty_mesh_runs_on_one_device(mesh):
    loss = _loss()
    plan = md.compile({"loss": loss}, mesh)
    assert plan.mesh.size == 1 and str(plan.mesh) == "(no axes)"
    feeds, params = {"x": torch.randn(8, 4)}, {"w": torch.randn(4, 8)}
    want = md.run_dense({"loss": loss}, feeds, params)
    got = md.run_simulated(plan, feeds, params)
    # One device, nothing split: the plan may still pick another matmul kernel
    # than the dense program, so allow fp32 rounding of a 4-term sum, no more.
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
