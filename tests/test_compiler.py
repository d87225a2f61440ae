"""compile() itself (:mod:`meshdsl.lowering.compiler`): the bounded plan cache, and
the tensor names a layout error lists."""
from __future__ import annotations

import re

import pytest

import meshdsl as md
from meshdsl.lowering import compiler

B, D, F, L = md.Dim("batch", 8), md.Dim("d_model", 4), md.Dim("d_ff", 8), md.Dim("layer", 2)


def _model():
    with md.Graph():
        x = md.input("x", [B, D])
        w = md.param("w", [D, F])
        return md.reduce_sum(md.einsum("batch d_model, d_model d_ff -> batch d_ff", x, w) ** 2)


def test_cache_returns_the_same_plan_and_is_bounded():
    loss = _model()
    first = md.compile({"loss": loss}, "data:2", "batch:data")
    assert md.compile({"loss": loss}, "data:2", "batch:data") is first
    # Many other compilations: the cache keeps only the most recent CACHE_SIZE.
    for _ in range(compiler.CACHE_SIZE + 8):
        md.compile({"loss": _model()}, "data:2", "batch:data")
        assert len(compiler._CACHE) <= compiler.CACHE_SIZE
    assert len(compiler._CACHE) == compiler.CACHE_SIZE
    again = md.compile({"loss": loss}, "data:2", "batch:data")
    assert again is not first and again.signature() == first.signature()


def test_cache_keeps_recently_used_plans():
    loss = _model()
    plan = md.compile({"loss": loss}, "data:2", "batch:data")
    for _ in range(compiler.CACHE_SIZE * 2):
        md.compile({"loss": _model()}, "data:2", "batch:data")
        assert md.compile({"loss": loss}, "data:2", "batch:data") is plan  # a hit moves it to the back


def _block(h, p):
    return h + md.einsum("batch d_ff, d_ff d_model -> batch d_model",
                         md.relu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", h, p["w_in"])), p["w_out"])


def _repeat_outputs():
    with md.Graph():
        x = md.input("x", [B, D])
        ws = {"w_in": md.param("blocks_in", [L, D, F]), "w_out": md.param("blocks_out", [L, F, D])}
        loss = md.reduce_sum(md.repeat(_block, x, ws, "layer") ** 2)
        g_in, g_out = md.grad(loss, [ws["w_in"], ws["w_out"]])
    return {"loss": loss, "g_in": g_in, "g_out": g_out}


def test_layout_errors_list_only_user_names():
    """Internal names of a repeat's blocks (carry, cotangent) are not tensors a user can scope."""
    outs = _repeat_outputs()
    with pytest.raises(md.LayoutError) as e:
        md.compile(outs, "data:2", "carry.batch:data")
    (line,) = [ln for ln in str(e.value).splitlines() if "named tensors:" in ln]
    assert line.split("named tensors:")[1].strip() == "blocks_in, blocks_out, w_in, w_out, x"
    # Every name it lists is one a layout may scope.
    md.compile(outs, "data:2", "x.batch:data; blocks_in.d_ff:data; w_out.d_ff:data")


@pytest.mark.parametrize("kw,said", [(dict(fuse="no"), "fuse='no' (str) is not True or False"),
                                     (dict(strict_splits=1), "strict_splits=1 (int) is not True or False"),
                                     (dict(schedule=3), "schedule=3 (int) is not a schedule name")])
def test_compile_refuses_a_switch_that_is_not_a_bool(kw, said):
    # "no" would pass as true: a switch given as anything but a bool is refused by name
    B, D = md.Dim("batch", 8), md.Dim("d_model", 4)
    with md.Graph():
        x = md.input("x", [B, D])
        loss = md.reduce_mean(x * x)
    with pytest.raises(md.GraphError, match=re.escape(said)):
        md.compile({"loss": loss}, "data:2", "batch:data", **kw)


def test_a_schedule_with_nothing_pipelined_is_noted():
    """A schedule name only acts on a pipeline: without one the plan says it had no effect."""
    loss = _model()
    plan = md.compile(loss, "data:2", "batch:data", microbatches=2, schedule="1f1b")
    assert any("schedule '1f1b' has no effect" in n for n in plan.notes), plan.notes
    assert not any("schedule" in n for n in md.compile(loss, "data:2", "batch:data").notes)


def test_the_schedule_note_is_what_every_run_prints():
    """compiler.ignored_options: the notes train, fit, check and run print, as plan lists them."""
    loss = _model()
    plan = md.compile(loss, "data:2", "batch:data", schedule="zbh1")
    assert compiler.ignored_options(plan) == [n for n in plan.notes if "schedule 'zbh1' has no effect" in n] != []
    assert compiler.ignored_options(md.compile(loss, "data:2", "batch:data")) == []


def test_a_schedules_refused_sizes_carry_the_mesh_and_layout():
    """interleaved:2 with one micro-batch: refused as other compile errors are, with what compile was given."""
    with md.Graph():
        x = md.input("x", [B, D])
        w = md.param("w", [md.Dim("layer", 4), D, md.Dim("e", 4)], fan_out=["layer", "e"])
        y = md.repeat(lambda h, p: md.tanh(md.rename(md.einsum("batch d_model, d_model e -> batch e", h, p["w"]),
                                                     e="d_model")), x, {"w": w}, "layer")
        loss = md.reduce_sum(y)
    with pytest.raises(md.MeshDSLError) as e:
        md.compile({"loss": loss, **md.grad(loss, {"w": w})}, "stage:2", "layer:stage", schedule="interleaved:2")
    text = str(e.value)
    assert text.splitlines()[:4] == [
        "compile: schedule 'interleaved:2' with 2 rank(s) and 1 micro-batch(es): 1 is not a multiple of the 2 ranks.",
        "  mesh: stage:2", "  layout: layer:stage", "  micro-batches: 1"], text
    assert "\nRule: " in text and "\nFix: " in text and "microbatches=2" in text, text


def test_an_empty_layout_in_a_pipeline_refusal_reads_no_rules():
    """A refusal of the micro-batch count with no layout rules shows '(no rules)', as the others do."""
    with pytest.raises(md.LayoutError) as e:
        md.compile({"loss": _model()}, "data:1", "", microbatches=3)
    assert "\n  mesh: data:1\n  layout: (no rules)\n" in str(e.value), e.value
