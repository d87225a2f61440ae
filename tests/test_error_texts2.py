"""Refusals that name the op as the user wrote it, list every conflict at once, and give fixes the
mesh can take (task errfix2).

- A refusal built from plan steps names an einsum by its equation (``Step.written``), and a sum
  refused where it is reduced names the op that began it (:func:`meshdsl.lowering.plan.sum_begun_by`).
- A sum over a pipelined stack's layers made outside it is refused with the per-layer fix, with or
  without micro-batches (before: "split that dim over another axis" on a stage-only mesh).
- Every param with two dims on one mesh axis is named by one compile, each with its fix.
- A user's ``batch:()`` stays in the printed layout under micro-batches.
- Contradicting rules are printed as written.

Legend: batch 4, d 3, layer 4 (a stack of 4 layers on 2 stages).
"""
from __future__ import annotations

import re

import pytest

import meshdsl as md
from meshdsl.layout.layout import Layout
from meshdsl.lowering.users_terms import user_mesh_layout

B, D, L = md.Dim("batch", 4), md.Dim("d", 3), md.Dim("layer", 4)


def _refusal(outs, mesh, layout, **kw) -> str:
    with pytest.raises(md.LayoutError) as e:
        md.compile(outs, mesh, layout, **kw)
    return str(e.value)


def _stack_with_outside_term():
    """A pipelined stack, and an L2 term of its stacked param written as an einsum outside it."""
    x, w = md.input("x", [B, D]), md.param("w", [L, D])
    out = md.repeat(lambda a, p: md.tanh(a * md.reduce_sum(p["w"])), x, {"w": w}, "layer")
    loss = md.reduce_mean(out * out) + 0.1 * md.einsum("layer d, layer d ->", w, w)
    return {"loss": loss, "d/w": md.grad(loss, {"w": w})["w"]}


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_sum_over_the_layers_outside_the_stack_names_the_einsum_and_a_fix_the_mesh_can_take(microbatches):
    with md.Graph():
        text = _refusal(_stack_with_outside_term(), "stage:2", "layer:stage", microbatches=microbatches)
    # what and where: the reduction of the loss, on the last stage only; the einsum that began the sum
    assert "allreduce over the pipeline axis 'stage' on stage(s) [1] only" in text, text
    assert re.search(r"\* the sum over 'stage' is begun by 'einsum\w*' \(md\.einsum\(\"layer d, layer d -> \"\) "
                     r"of \[layer:4, d:3\] and \[layer:4, d:3\]\)", text), text
    assert "Rule: a pipeline axis splits the stacks' layers" in text, text
    # the fix: the term made per layer in the block; no other axis (stage:2 has none)
    assert "Fix: make the term in the block, per layer" in text and "another axis" not in text, text


def test_a_sum_over_the_batch_in_a_block_names_the_einsum_that_began_it():
    b, d, layer = md.Dim("batch", 4), md.Dim("d_model", 3), md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [b, d])
        w = md.param("w", [layer, d, md.Dim("d_out", 3)], fan_out=["layer", "d_out"])

        def block(h, p):
            h = md.tanh(md.rename(md.einsum("batch d_model, d_model d_out -> batch d_out", h, p["w"]), d_out="d_model"))
            return h / md.einsum("batch d_model, batch d_model ->", h, h)
        loss = md.reduce_sum(md.repeat(block, x, {"w": w}, "layer"))
        text = _refusal({"loss": loss, **md.grad(loss, {"w": w})}, "stage:2", "layer:stage", microbatches=2)
    assert "in its block sums over the micro-batches in every layer" in text, text
    assert re.search(r"\* the sum over the batch is begun by 'einsum_\d+' \(md\.einsum\(\"batch d_model, batch "
                     r"d_model -> \"\) of \[batch:4, d_model:3\] and \[batch:4, d_model:3\]\)", text), text
    assert "Rule: a repeat's layers run one micro-batch at a time" in text and "Fix: " in text, text


def _two_params_two_dims():
    ch, cl = md.Dim("ch", 4), md.Dim("cl", 6)
    x = md.input("x", [B, ch])
    up, down = md.param("up", [ch, cl]), md.param("down", [cl, ch])
    h = md.einsum("batch cl, cl ch -> batch ch", md.tanh(md.einsum("batch ch, ch cl -> batch cl", x, up)), down)
    loss = md.reduce_mean(h * h)
    return {"loss": loss, **md.grad(loss, {"up": up, "down": down})}


def test_every_param_with_two_dims_on_one_axis_is_named_at_once_with_its_fix():
    with md.Graph():
        outs = _two_params_two_dims()
        text = _refusal(outs, "model:2", "ch:model; cl:model")
        assert text.startswith("2 params or inputs each have two dims on one mesh axis: 'up', 'down'."), text
        assert "    ch:model; cl:model\n              ^^^^^^^^\n" in text, text    # the rule that gives way
        assert "  * Tensor 'up' [ch:4, cl:6]: mesh axis 'model' is used by dims ['ch', 'cl']\n" in text, text
        assert "  * Tensor 'down' [cl:6, ch:4]: mesh axis 'model' is used by dims ['cl', 'ch']\n" in text, text
        assert "Rule: a mesh axis may split at most one dim of a param or input" in text, text
        fix = text.split("Fix: ", 1)[1]
        assert fix.startswith("for 'up': keep 'cl' whole in this tensor with the rule 'up.cl:()'"), fix
        assert "; for 'down': keep 'cl' whole in this tensor with the rule 'down.cl:()'" in fix, fix
        assert "another axis" not in fix and "model:2" not in fix, fix
        # followed in one go (model:2 has no other axis), the layout compiles
        md.compile(outs, "model:2", "ch:model; cl:model; up.cl:(); down.cl:()")


def test_a_users_batch_kept_whole_stays_in_the_printed_layout_under_micro_batches():
    with md.Graph():
        x, w = md.input("x", [B, D]), md.param("w", [L, D])
        out = md.repeat(lambda a, p: md.tanh(a * p["w"]), x, {"w": w}, "layer")
        loss = md.reduce_mean(out * out)
        outs = {"loss": loss, "d/w": md.grad(loss, {"w": w})["w"]}
        written = user_mesh_layout(md.compile(outs, "stage:2", "layer:stage; batch:()", microbatches=2))
        added = user_mesh_layout(md.compile(outs, "stage:2", "layer:stage", microbatches=2))
    assert (str(written[0]), str(written[1])) == ("stage:2", "layer:stage; batch:()")
    assert str(added[1]) == "layer:stage"   # the micro-batches' own rule is still left out


@pytest.mark.parametrize("layout, what, fix", [
    ("d:(); d:model", "for 'd': 'd:()' and 'd:model'.",
     "Fix: keep one of 'd:()' and 'd:model', or scope one of them (e.g. 'params.d:...' for weights)"),
    ("params.d:model; params.d:(data, model)", "for 'params.d': 'params.d:model' and 'params.d:(data,model)'.",
     "Fix: keep one of 'params.d:model' and 'params.d:(data,model)'\n"),
])
def test_contradicting_rules_are_printed_as_written(layout, what, fix):
    with pytest.raises(md.LayoutError) as e:
        Layout.parse(layout)
    text = str(e.value) + "\n"
    assert text.startswith(f"Contradicting layout rules {what}\n    {layout}\n"), text
    assert "Rule: each (scope, dim) is mapped to one set of mesh axes" in text and fix in text, text
