"""Two recurrences nested in one repeat's block, over a split dim: what the backward gathers again.

A bidirectional RNN written as two inner ``md.repeat`` over ``time`` in one outer block (HAN's
BiGRU) reads both directions' inputs from outside the block.  Under ``time:data`` each inner
repeat gathers its stacked input whole (``lowering/repeat.py``, ``_scan_target``); the gathers are
loop-invariant, so they are made once before the outer loop (``lowering/hoist.py``).  The outer
backward recomputes both recurrences under every remat policy and reads their inputs gathered
again: where the policy keeps them (``none``), the backward takes the forward's copies and gathers
nothing; under ``full`` the memory rule holds one copy, the forward's, which the backward takes
first, and gathers the other once.  The dense program is the oracle: loss and every gradient.

Legend: ``x_btd`` [batch, time, d] the input, ``x_tbd`` the same with ``time`` first (the inner
repeats' stacked input), ``h_bh`` [batch, hidden] a recurrence's state.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import assert_heldout_case_matches_dense

HAN = str(Path(__file__).parent / "heldout_han.py")


def _birnn(remat: str = "none", layers: int = 1) -> tuple[dict, dict]:
    """``layers`` outer layers, each running a forward and a backward-direction recurrence (two
    inner repeats over ``time``, each reading its own input from outside the block); the loss
    multiplies the two directions' per-step states.  The loss and every gradient, and the feeds."""
    batch, time, d, hidden = md.Dim("batch", 2), md.Dim("time", 4), md.Dim("d", 4), md.Dim("hidden", 2)
    layer = md.Dim("layer", layers)
    with md.Graph():
        x_btd = md.input("x", [batch, time, d])
        w = {k: md.param(f"w_{k}", [layer, d, hidden], fan_out=["hidden"]) for k in ("fw", "bw")}
        x_fw = md.transpose(x_btd, ["time", "batch", "d"])
        x_bw = md.transpose(x_btd * 2.0, ["time", "batch", "d"])

        def rnn(x_tbd, w_dh, h_bh):
            def step(h, p):
                h = md.tanh(h + md.einsum("batch d, d hidden -> batch hidden", p["x"], w_dh))
                return h, {"h": h}
            return md.repeat(step, h_bh, {"x": x_tbd}, "time")[1]["h"]

        def block(h_bh, p):
            fw, bw = rnn(x_fw, p["fw"], h_bh), rnn(x_bw, p["bw"], h_bh)
            return h_bh, {"fw": fw, "bw": bw}

        _, per = md.repeat(block, md.constant(0.0, [batch, hidden]), w, "layer")
        loss = md.reduce_sum(per["fw"] * per["bw"] * per["bw"])
        outs = {"loss": loss, **md.grad(loss, {**w, "x": x_btd}, remat=remat)}
    return outs, {"x": torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(0))}


def _input_gathers(plan, phases: tuple[str, ...], inside: bool = False) -> list[str]:
    """The allgathers of a recurrence's stacked input (``re-layout stacked param 'x'``) in ``phases``,
    its loops' sub-plans included; a bucket's members (lowering/coalesce.py: its note keeps theirs)
    each once."""
    out = []
    for s in plan.steps:
        if s.kind in ("allgather", "bucket_allgather") and s.phase in phases:
            where = f"{s.phase} {s.label}{' (in a loop)' if inside else ''}"
            out += [where] * (s.note or "").count("stacked param 'x'")
        for sub in s.subplans:
            out += _input_gathers(sub, phases, True)
    return out


def _assert_dense(outs: dict, feeds: dict, plan) -> None:
    got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    for k, w in want.items():
        # the recurrences run whole on every rank, as densely; only the sums over the split time
        # (the loss, the weights' gradients) add per-rank parts in another order: fp32 rounding, a
        # few 1e-7 of the magnitude, far below 1e-5 of it; a wrong or missing gather is off by O(1)
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-5 * float(w.abs().max()), msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("remat, again, layers", [("none", [], 1), ("full", ["recompute"], 1), ("none", [], 2)],
                         ids=["none", "full", "none-2-layers"])
def test_the_backward_reads_both_recurrences_inputs_as_the_forward_gathered_them(remat, again, layers):
    """The forward gathers each direction's input once, before the outer loop where the policy
    keeps them for the backward (``none``), or in its layer where the memory rule holds no more
    (``full``: one copy).  The backward (its recompute of the recurrences and their gradients)
    gathers nothing where the policy keeps them; under ``full`` it takes the forward's copy and
    gathers the other once in its layer's recompute.  Before, it gathered both again (one
    copy made before the backward loop, the other in its recompute) under either policy."""
    outs, feeds = _birnn(remat, layers)
    plan = md.compile(outs, "data:2", "time:data")
    assert len(_input_gathers(plan, ("forward",))) == 2, _input_gathers(plan, ("forward",))
    got = [g.split()[0] for g in _input_gathers(plan, ("backward", "recompute"))]
    assert got == again, _input_gathers(plan, ("backward", "recompute"))
    _assert_dense(outs, feeds, plan)


def test_han_reads_its_bigrus_gathered_words_once():
    """The held-out HAN (a BiGRU over ``words``: two inner repeats in a one-layer block) under
    ``words:data``: both directions' inputs gathered in the forward only (it gathered both again
    in the backward), and the dense numbers."""
    model = md.load_model(HAN, tiny=True)
    outs = {"loss": model.loss, **md.grad(model.loss, model.params)}
    plan = md.compile(outs, "data:2", "words:data")
    assert len(_input_gathers(plan, ("forward",))) == 2, _input_gathers(plan, ("forward",))
    assert _input_gathers(plan, ("backward", "recompute")) == []
    assert_heldout_case_matches_dense((HAN, {}, "data:2", "words:data"))
