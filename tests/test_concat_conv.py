"""A conv over a concat along a split channel dim (meshdsl/lowering/concat_contract.py): each part
convolved with its own rows of the weight, the partial sums added locally and reduced once, the
weight's gradient the concat of each part's; instead of the concat trading halo rows and gathering.
The dense program's numbers.

A U-Net's skip: ``h = concat([up, skip], "c")`` renamed ``cat``, then ``conv(h, w [tap.., cat, co])``
under ``c:model`` (the weight's ``cat`` whole).  Legend: batch 2, seq 8 (1-D) or height 6 x width 5
(2-D), co 3 output channels, parts of ``c`` 4 4 (or uneven 3 5, 4 6 3).
"""
from __future__ import annotations

import pytest

import meshdsl as md
import meshdsl.lowering.compiler as compiler
from meshdsl.lowering import concat_contract
from conftest import assert_simulated_matches_dense, random_feeds

B, CO = 2, 3
SPATIAL = {1: {"seq": 8}, 2: {"height": 6, "width": 5}}


def _net(sizes, num_spatial=1, repeat=False, **conv):
    batch = md.Dim("batch", B)
    sp = [md.Dim(d, n) for d, n in SPATIAL[num_spatial].items()]
    taps = {d.name: f"k{d.name[0]}" for d in sp}
    parts = [md.input(f"x{k}", [batch, *sp, md.Dim("c", n)]) for k, n in enumerate(sizes)]
    layer = [md.Dim("layer", 2)] if repeat else []   # two layers, each its own weights
    scales = [md.param(f"v{k}", [*layer, md.Dim("c", n)]) for k, n in enumerate(sizes)]
    w = md.param("w", [*layer, *(md.Dim(t, 3) for t in taps.values()), md.Dim("cat", sum(sizes)),
                       md.Dim("co", CO)])

    def block(x, p):
        h = md.concat([md.tanh(x_k * p[f"v{k}"]) for k, x_k in enumerate(parts)], "c")
        y = md.conv(md.rename(h, c="cat"), p["w"], taps, **conv)
        return y if x is None else x + y

    if repeat:   # in the block the weight's gradient is built the other way round (dy, x)
        y0 = md.input("y0", [batch, *sp, md.Dim("co", CO)])
        y = md.repeat(block, y0, {"w": w, **{f"v{k}": v for k, v in enumerate(scales)}}, "layer")
        return _outputs(y, w, scales), parts + [y0]
    return _outputs(block(None, {"w": w, **{f"v{k}": v for k, v in enumerate(scales)}}), w, scales), parts


def _outputs(y, w, scales) -> dict:
    loss = md.reduce_sum(y * y)
    return {"y": y, "loss": loss} | md.grad(loss, {"g/w": w, **{f"g/v{k}": v for k, v in enumerate(scales)}})




def _per_part(plan) -> bool:
    return any("as the sum of each part's conv" in n for n in plan.notes)


def _bytes(plan) -> int:
    return sum(v["bytes"] for v in plan.totals().values())


def _count(plan) -> int:
    return sum(v["count"] for v in plan.totals().values())


def _plan(monkeypatch, sizes, mesh, layout, rule="chosen", **net):
    """A fresh graph's outputs, inputs and plan: the per-part rule ``chosen`` by the cost model,
    ``off``, or ``forced`` (kept whatever the cost: its numbers checked where it does not pay)."""
    with monkeypatch.context() as m:
        if rule == "off":
            m.setattr(compiler, "summing_parts", lambda on, orig=concat_contract.summing_parts: orig(False))
        elif rule == "forced":
            m.setattr(compiler, "better", lambda *a, **k: True)
        with md.Graph():
            outs, parts = _net(sizes, **net)
            return outs, parts, md.compile(outs, mesh, layout)


@pytest.mark.parametrize("conv", [{}, {"stride": 2, "padding": (1, 1)}], ids=["stride1", "stride2"])
def test_a_skip_concat_then_conv_moves_no_row_of_the_concat(monkeypatch, conv):
    """Before: the concat traded 2 halo permutes of its rows and gathered ``cat`` for the conv
    (3 collectives: 512 B, 768 B strided); now each rank convolves its own blocks of the parts (a
    strided conv: of their phases) with its rows of the weight: y's partial sum reduced once, the
    weight's gradient parts gathered in one buffer (2 collectives: 336 B, 240 B)."""
    outs, parts, plan = _plan(monkeypatch, [4, 4], "model:2", "c:model", **conv)
    _, _, plain = _plan(monkeypatch, [4, 4], "model:2", "c:model", rule="off", **conv)
    assert _per_part(plan), plan.notes
    assert "permute" not in plan.totals() and "permute" in plain.totals(), (plan.totals(), plain.totals())
    assert _bytes(plan) < _bytes(plain) and _count(plan) <= _count(plain), (plan.totals(), plain.totals())
    assert_simulated_matches_dense(plan, outs, random_feeds(parts))


CASES = {   # id: (parts of c, mesh, conv's keywords)
    "uneven-parts": ([3, 5], "model:2", {}),
    "three-parts-3way": ([4, 6, 3], "model:3", {}),
    "valid": ([4, 4], "model:2", {"padding": "valid"}),
    "causal-dilated": ([4, 4], "model:2", {"padding": "causal", "dilation": 2}),
    "2d": ([4, 4], "model:2", {"num_spatial": 2}),
    "2d-uneven-pad": ([3, 5], "model:3", {"num_spatial": 2, "padding": (2, 0)}),
    "stride2": ([3, 5], "model:2", {"stride": 2, "padding": (1, 1)}),
    "2d-stride2-odd": ([4, 4], "model:2", {"num_spatial": 2, "stride": 2}),   # width 5: a pad, then phases
}


@pytest.mark.parametrize("case", list(CASES))
def test_per_part_convs_match_dense(monkeypatch, case):
    """Forward and gradients (the weight's, and each part's through its scale) as dense, the rule
    forced where the cost model would not keep it."""
    sizes, mesh, kw = CASES[case]
    outs, parts, plan = _plan(monkeypatch, sizes, mesh, "c:model", rule="forced", **kw)
    assert _per_part(plan), plan.notes
    assert_simulated_matches_dense(plan, outs, random_feeds(parts))


def test_in_a_layer_stack_the_weight_gradient_taken_the_other_way_round_is_per_part(monkeypatch):
    """In a repeat's block the weight's gradient reads (dy, x): the concat is its second operand,
    its dim an output channel of that form; each part's gradient concatenated as dense."""
    outs, parts, plan = _plan(monkeypatch, [3, 5], "model:2", "c:model", rule="forced", repeat=True)
    assert _per_part(plan), plan.notes
    assert any("as the concat of each part's weight gradient" in n for n in plan.notes), plan.notes
    assert_simulated_matches_dense(plan, outs, random_feeds(parts))


def test_where_the_weight_rows_would_move_instead_the_cost_model_keeps_the_concat(monkeypatch):
    """Under ``cat:model`` too the weight's rows are split as the concat, not as the parts: per part,
    they (and the weight gradient's parts) would move instead of the activations' rows, more bytes
    here (batch 2): the rule is not kept, and the plan kept sends no more than the forced one."""
    outs, parts, plan = _plan(monkeypatch, [4, 4], "model:2", "c:model; cat:model")
    _, _, forced = _plan(monkeypatch, [4, 4], "model:2", "c:model; cat:model", rule="forced")
    assert not _per_part(plan) and _per_part(forced), plan.notes
    assert _bytes(plan) < _bytes(forced), (plan.totals(), forced.totals())
    assert_simulated_matches_dense(plan, outs, random_feeds(parts))
