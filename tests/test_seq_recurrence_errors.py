"""A recurrence over a dim of the inputs (``seq``) written as the OUTERMOST ``md.repeat``, under a
layout that splits that dim (``seq:model``): the split makes ``model`` the repeat's pipeline axis
(:mod:`meshdsl.lowering.pipeline`), which is not the sequence parallelism the user asked for.  Every
refusal on that path says so and gives the fix (nest the recurrence in a one-layer block, an inner
repeat, which gathers the dim it scans; or scan a renamed dim the layout leaves whole), and both
fixes run and match the dense program.  A pipeline over a stack of layers (``layer`` is no input's
dim) keeps its messages.

Legend: b batch, s seq, d features, t tags (to), f tag_from.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from meshdsl.errors import LayoutError

CRF = str(Path(__file__).parent / "heldout_crf.py")
SAYS = "that makes 'model' its pipeline axis"
FIX = "for sequence parallelism make the recurrence an inner repeat"


def _crf_scan(num_seq: int, form: str = "outer", collective: bool = False, sliced: bool = False):
    """A CRF forward algorithm over emissions [batch, seq, tags] made from an input; ``form``
    ``outer`` scans ``seq`` at the top level, ``nested`` inside a one-layer block (the fix),
    ``renamed`` over ``step``, the stacked emissions' seq renamed (the other fix).  With
    ``collective`` the emissions are a softmax over ``seq`` (an allreduce over a split seq); with
    ``sliced`` the repeat scans all but the first position (as the held-out CRF does)."""
    b, s, d = md.Dim("batch", 2), md.Dim("seq", num_seq), md.Dim("d", 3)
    t, f = md.Dim("tags", 3), md.Dim("tag_from", 3)
    with md.Graph():
        x = md.input("x", [b, s, d])
        w, trans, alpha0 = md.param("w", [d, t]), md.param("trans", [f, t]), md.param("alpha0", [b, t])
        emit = md.einsum("batch seq d, d tags -> batch seq tags", x, w)
        emit = md.softmax(emit, "seq") if collective else emit

        def step(alpha, p):
            return md.logsumexp(md.rename(alpha, tags="tag_from") + trans, "tag_from") + p["e"]
        if form == "outer":
            alpha = md.repeat(step, alpha0, {"e": md.slice_(emit, "seq", 1, num_seq) if sliced else emit}, "seq")
        elif form == "nested":
            alpha = md.repeat(lambda a, _: md.repeat(step, a, {"e": emit}, "seq"), alpha0, {}, md.Dim("once", 1))
        else:
            alpha = md.repeat(step, alpha0, {"e": md.rename(emit, seq="step")}, "step")
        loss = md.reduce_mean(md.logsumexp(alpha, "tags")) + 0.1 * md.reduce_mean(emit * emit)
        params = {"w": w, "trans": trans, "alpha0": alpha0}
        return {"loss": loss, **md.grad(loss, params)}


def _refusal(outputs, layout: str) -> str:
    with pytest.raises(LayoutError) as e:
        md.compile(outputs, "model:2", layout)
    return str(e.value)


def test_the_crf_scan_under_seq_model_says_the_split_makes_a_pipeline():
    """The held-out CRF (``form=scan``, 7 steps on ``model:2``): the uneven-layers refusal names
    the split as the repeat's pipeline and gives the sequence-parallel fix, under a caret."""
    model = md.load_model(CRF, tiny=True, form="scan")
    msg = _refusal(model.loss, "seq:model")
    assert "has 7 layers" in msg and SAYS in msg and FIX in msg, msg
    assert "'seq:model' splits 'seq', the dim the outermost repeat" in msg, msg
    assert "    seq:model\n    ^^^^^^^^^" in msg, msg   # the rule's caret stays
    assert "md.Dim('once', 1)" in msg and "md.rename(t, seq='step')" in msg, msg


@pytest.mark.parametrize("num_seq,layout,kw,what", [
    (4, "seq:model", {"collective": True}, "allreduce over the pipeline axis 'model'"),   # even: the partition's
    (4, "seq:model; tag_from:model", {}, "uses the pipeline axis 'model'"),   # the axis splits another dim
    (5, "seq:model", {}, "has 5 layers"),                                     # uneven steps
    # even steps (4) sliced off an uneven seq (5): the dim of that size is named, not called the layers
    (5, "seq:model", {"sliced": True}, "dim 'seq' (5) of 'x', the dim repeat 'repeat' scans (4 layers)"),
], ids=["even-collective", "axis-splits-another-dim", "uneven", "uneven-other-size"])
def test_each_refusal_of_an_outer_scan_over_split_seq_gives_the_fix(num_seq, layout, kw, what):
    """Whichever check refuses it, the message says the split made the axis a pipeline and how to
    get sequence parallelism instead."""
    msg = _refusal(_crf_scan(num_seq, **kw), layout)
    assert what in msg and SAYS in msg and FIX in msg, msg
    assert msg.count("Fix:") == 1 and "Rule:" in msg, msg


@pytest.mark.parametrize("form,num_seq", [("nested", 5), ("renamed", 4)])
def test_the_fixes_the_refusal_gives_run_and_match_dense(form, num_seq):
    """Both fixes compile under ``seq:model`` (uneven 5 too) and give the dense loss and every
    gradient (``md.check``: 1e-4 of each output's magnitude covers fp32 sums in another order)."""
    outputs = _crf_scan(num_seq, form, collective=True)
    feeds = {"x": torch.randn(2, num_seq, 3, generator=torch.Generator().manual_seed(0))}
    result = md.check(outputs, "model:2", "seq:model", feeds)
    assert result.ok and {o.name for o in result.outputs} == {"loss", "w", "trans", "alpha0"}, result


def test_a_pipeline_of_layers_keeps_its_message():
    """A repeat over ``layer`` (a stack of params, no input's dim) gets no sequence-parallel fix."""
    b, dm, h, n = md.Dim("batch", 2), md.Dim("d_model", 4), md.Dim("heads", 2), md.Dim("layer", 2)
    with md.Graph():
        x, w, v = md.input("x", [b, dm]), md.param("w", [n, dm]), md.param("v", [dm, h])
        y = md.repeat(lambda c, p: c * p["w"], x, {"w": w}, "layer")
        loss = md.reduce_mean(md.einsum("batch d_model, d_model heads -> batch heads", y, v) ** 2)
    msg = _refusal(loss, "layer:model; heads:model")
    assert "uses the pipeline axis 'model'" in msg and SAYS not in msg and FIX not in msg, msg
