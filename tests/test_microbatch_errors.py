"""Refusals under micro-batches speak of the user's mesh and layout (lowering/users_terms.py).

A plan with micro-batches is lowered on the mesh plus the virtual axis ``_mb`` with ``batch``
split over it; errors raised there are restated once, where they leave the lowering: the
user's mesh and layout, a ``micro-batches: m`` line, and the virtual axis in words.
"""
from __future__ import annotations

import pytest

import meshdsl as md
from meshdsl.errors import message
from meshdsl.lowering.pipeline import MB_AXIS
from meshdsl.lowering.users_terms import restate, users_terms

PIPE = {"microbatches": 2, "schedule": "1f1b"}


def _batch_scaled():
    """Each layer scaled by a statistic of the whole batch of its input (as a batch norm): a sum over
    the micro-batches in every layer (refused under micro-batches)."""
    b, d, layer = md.Dim("batch", 4), md.Dim("d_model", 3), md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [b, d])
        w = md.param("w", [layer, d, md.Dim("d_out", 3)], fan_out=["layer", "d_out"])

        def block(h, p):
            h = md.tanh(md.rename(md.einsum("batch d_model, d_model d_out -> batch d_out", h, p["w"]), d_out="d_model"))
            return h / md.reduce_sum(h ** 2)

        loss = md.reduce_sum(md.repeat(block, x, {"w": w}, "layer"))
        return {"loss": loss, **md.grad(loss, {"w": w})}


def _all_pairs():
    """A [batch, batch2] score of every pair of rows: it reads every micro-batch's rows at once."""
    b, d = md.Dim("batch", 8), md.Dim("d_model", 4)
    with md.Graph():
        x = md.input("x", [b, d])
        z = md.einsum("batch d_model, d_model d_out -> batch d_out", x, md.param("w", [d, md.Dim("d_out", 4)]))
        pairs = md.einsum("batch d_out, batch2 d_out -> batch batch2", z, md.rename(z, batch="batch2"))
        return {"loss": md.reduce_mean(md.tanh(pairs))}


def _refusal(outs, mesh, layout, **kw) -> str:
    with pytest.raises(md.LayoutError) as e:
        md.compile(outs, mesh, layout, **kw)
    return str(e.value)


@pytest.mark.parametrize("mesh, layout, kw, shown", [
    ("stage:2", "layer:stage", PIPE, "layer:stage"),                    # a pipeline
    ("data:1", "", {"microbatches": 2}, "(no rules)"),                  # plain gradient accumulation
    ("stage:2; data:2", "layer:stage; batch:data", {"microbatches": 2}, "layer:stage; batch:data"),
])
def test_a_sum_in_every_layer_is_refused_in_the_users_mesh_and_layout(mesh, layout, kw, shown):
    text = _refusal(_batch_scaled(), mesh, layout, **kw)
    assert "sums over the micro-batches in every layer" in text, text
    assert MB_AXIS not in text, text
    assert f"  mesh: {mesh}\n  layout: {shown}\n  micro-batches: 2\n" in text, text
    assert "allreduce over the micro-batches" in text or "allreduce over ('data',) and the micro-batches" in text, text


@pytest.mark.parametrize("mesh, layout", [("data:1", ""), ("data:2", "batch:data")])
def test_a_read_of_every_row_is_refused_in_the_users_mesh_and_layout(mesh, layout):
    text = _refusal(_all_pairs(), mesh, layout, microbatches=2)
    assert "cannot be micro-batched" in text and MB_AXIS not in text, text
    assert f"  mesh: {mesh}\n" in text and "  micro-batches: 2\n" in text, text
    bullet = next(line for line in text.splitlines() if line.startswith("  * "))
    # The gather and the split it undoes, in words (whether 'data' is gathered first is the lowering's choice).
    assert bullet.startswith("  * allgather over") and "the micro-batches: re-layout" in bullet, text
    assert "{batch2:micro-batches}" in bullet or "{batch2:(micro-batches,data)}" in bullet, text


def test_errors_raised_before_the_micro_batches_are_unchanged():
    """Refused before the lowering (in the user's terms already): a batch the micro-batches do not divide."""
    text = _refusal(_all_pairs(), "data:2", "batch:data", microbatches=3)
    assert "batch 8 is not divisible by 3 micro-batches" in text and "micro-batches: " not in text, text
    assert "  mesh: data:2\n  layout: batch:data\n" in text, text


def test_restate_maps_the_lowered_mesh_layout_and_axis_to_words():
    given = (md.Mesh.parse("stage:2; data:2"), md.Layout.parse("layer:stage; batch:data"))
    lowered = (md.Mesh.parse(f"stage:2; data:2; {MB_AXIS}:4"), md.Layout.parse(f"layer:stage; batch:({MB_AXIS},data)"))
    text = message(
        f"compile: mesh '{lowered[0]}' is odd.", inputs=[f"mesh: {lowered[0]}", f"layout: {lowered[1]}"],
        bullets=[f"allreduce over ('{MB_AXIS}', 'data'): {{batch:({MB_AXIS},data)}} partial({MB_AXIS})",
                 f"not divisible by mesh axes {MB_AXIS}:4 x data:2"])
    out = restate(text, lowered, given, 4)
    assert MB_AXIS not in out, out
    assert out.splitlines()[:4] == ["compile: mesh 'stage:2; data:2' is odd.", "  mesh: stage:2; data:2",
                                    "  layout: layer:stage; batch:data", "  micro-batches: 4"], out
    assert "allreduce over ('data',) and the micro-batches: {batch:(micro-batches,data)} partial(micro-batches)" in out
    assert "mesh axes 4 micro-batches x data:2" in out
    plain = message("compile: no axis.", inputs=["mesh: data:2"])
    assert restate(plain, lowered, given, 4) is plain


def test_the_error_keeps_its_type_and_traceback():
    lowered = (md.Mesh.parse(f"x:2; {MB_AXIS}:2"), md.Layout.parse(f"batch:{MB_AXIS}"))
    given = (md.Mesh.parse("x:2"), md.Layout.parse(""))
    err = md.ShapeError(message("bad.", inputs=[f"mesh: {lowered[0]}"]))
    with pytest.raises(md.ShapeError) as e:
        with users_terms(lowered, given, 2):
            raise err
    assert e.value is err and e.value.__traceback__ is not None
    assert str(e.value) == "bad.\n  mesh: x:2\n  micro-batches: 2"
    kept = md.ShapeError(message("bad.", inputs=[f"mesh: {lowered[0]}"]))
    with pytest.raises(md.ShapeError) as e:
        with users_terms(lowered, given, 1):   # no micro-batches: nothing to restate
            raise kept
    assert str(e.value) == f"bad.\n  mesh: {lowered[0]}"


def test_messages_name_nodes_as_the_user_wrote_them():
    """plan.called: a node by its name, the op only where the name does not say it; reduce_mean
    (built as a sum times 1/n) keeps its name, and a gradient's node names the op it is the gradient of."""
    from meshdsl.lowering.plan import called
    with md.Graph():
        mean = md.reduce_mean(md.input("x", [md.Dim("batch", 4)]))
    assert (mean.node.name, mean.node.op.name) == ("reduce_mean", "mul")
    assert called(mean.node.name, mean.node.op.name) == "'reduce_mean'"
    assert called("einsum_1", "einsum") == "'einsum_1'" and called("h", "add") == "'h' (add)"
    assert called("grad_layer_norm/layer_norm_backward", "layer_norm_backward") == \
        "'layer_norm_backward' (of layer_norm's gradient)"
    # a step of an md op built of others (md.concat's pads) by the op the user called
    assert called("concat_2/pad", "pad") == "'concat_2/pad' (a pad inside md.concat)"
    assert called("attn/einsum", "einsum") == "'attn/einsum' (einsum)"   # a user's own scope as it was
