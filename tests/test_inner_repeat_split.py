"""An inner repeat (a recurrence over ``seq`` inside a layer's block) under layouts that split ``seq``.

The recurrence runs its steps in order, so it needs ``seq`` whole; the layout that splits ``seq``
(sequence parallelism for the rest of the model) is still valid: the compiler gathers the inner
repeat's stacked inputs at the repeat, runs the whole recurrence on every rank, and each reader
of the per-step outputs takes its own slice (``meshdsl/lowering/repeat.py``, ``_scan_target``).
The dense program is the oracle: loss and every gradient.

Legend (the RWKV-like model): ``x_bsd`` [batch, seq, d] the residual stream, ``ab_bad`` [batch,
ab, d] the recurrence's state (the weighted sums of values and of weights side by side along
``ab``), ``wkv_sbd`` [seq, batch, d] its per-step outputs, stacked over ``seq`` (first).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, heldout_case_id

HERE = Path(__file__).parent
XLSTM, GRIFFIN, LSTM = (str(HERE / f"heldout_{n}.py") for n in ("xlstm", "griffin", "lstm"))


def _rwkv(seq: int = 6, remat: str = "none") -> tuple[dict, dict]:
    """Two layers of an RWKV-like time mix (its WKV recurrence an inner ``md.repeat`` over
    ``seq``, reading the layer's decay and bonus from outside its block) and a squared-ReLU
    MLP, pointwise in ``seq``; the loss and every param's gradient (under ``remat``), and the feeds."""
    batch, s, d, ff = md.Dim("batch", 2), md.Dim("seq", seq), md.Dim("d", 4), md.Dim("d_ff", 8)
    layer, d_in, ab = md.Dim("layer", 2), md.Dim("d_in", 4), md.Dim("ab", 2)
    with md.Graph():
        x = md.input("x", [batch, s, d])
        p = {k: md.param(k, [layer, d_in, d], fan_out=["layer", "d"]) for k in ("w_k", "w_v", "w_r", "w_o")}
        p["w_1"] = md.param("w_1", [layer, d, ff], fan_out=["layer", "d_ff"])
        p["w_2"] = md.param("w_2", [layer, ff, d], fan_out=["layer", "d"])
        p["decay"], p["bonus"] = md.param("decay", [layer, d], scale=0.5), md.param("bonus", [layer, d], scale=0.5)
        ab0 = md.constant(torch.zeros(2, 2, 4), [batch, ab, d], name="ab0")

        def proj(x_bsd, w):
            return md.einsum("batch seq d_in, d_in d -> batch seq d", md.rename(x_bsd, d="d_in"), w)

        def block(x_bsd, q):
            k, v, r = proj(x_bsd, q["w_k"]), proj(x_bsd, q["w_v"]), proj(x_bsd, q["w_r"])
            fade = md.exp(-md.exp(q["decay"]))

            def step(ab_bad, t):
                a, b = (md.squeeze(md.slice_(ab_bad, "ab", i, i + 1), "ab") for i in (0, 1))
                now, ek = md.exp(q["bonus"] + t["k"]), md.exp(t["k"])
                wkv = (a + now * t["v"]) / (b + now)
                nxt = [md.unsqueeze(fade * a + ek * t["v"], md.Dim("ab", 1), 1),
                       md.unsqueeze(fade * b + ek, md.Dim("ab", 1), 1)]
                return md.concat(nxt, "ab"), {"wkv": wkv}

            _, per_step = md.repeat(step, ab0, {"k": k, "v": v}, "seq")
            wkv_bsd = md.transpose(per_step["wkv"], ["batch", "seq", "d"])
            x_bsd = x_bsd + proj(md.sigmoid(r) * wkv_bsd, q["w_o"])
            h = md.relu(md.einsum("batch seq d, d d_ff -> batch seq d_ff", x_bsd, q["w_1"])) ** 2
            return x_bsd + md.einsum("batch seq d_ff, d_ff d -> batch seq d", h, q["w_2"])

        loss = md.reduce_mean(md.repeat(block, x, p, "layer") ** 2)
        outs = {"loss": loss, **{f"grad/{k}": g for k, g in md.grad(loss, p, remat=remat).items()}}
    return outs, {"x": torch.randn(2, seq, 4, generator=torch.Generator().manual_seed(0))}


@pytest.mark.parametrize("seq, mesh, layout", [
    (6, "model:2", "seq:model"),
    (10, "model:3", "seq:model"),                    # uneven: parts 4, 3, 3
    (6, "data:2; model:2", "batch:model; seq:data"),  # the scanned dim on the other axis
    pytest.param(8, "data:2; model:2", "seq:(data, model)", marks=pytest.mark.slow),
], ids=["even", "uneven", "other-axis", "two-axes"])
def test_a_recurrence_over_a_split_seq_gives_the_dense_numbers(seq, mesh, layout):
    outs, feeds = _rwkv(seq)
    want = md.run_dense(outs, feeds)
    plan = md.compile(outs, mesh, layout)
    got = md.run_simulated(plan, feeds)
    assert any("scans 'seq'" in n and "gathered whole" in n for n in plan.notes), plan.notes
    _assert_dense(got, want, layout)


def _assert_dense(got: dict, want: dict, what: str) -> None:
    for k, w in want.items():
        # the recurrence runs whole on every rank, as densely; only the sums over the split seq
        # (the loss's mean, the weights' gradients) add per-rank parts in another order: fp32
        # rounding, a few 1e-7 of the output's magnitude (as under batch:model, seq whole), far
        # below 1e-5 of it; a wrong slice or a missed gather is off by O(1)
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-5 * float(w.abs().max()),
                                   msg=lambda m, k=k: f"{what}: {k}: {m}")


def _collectives(plan, inside: str = "") -> list[tuple[str, str, str]]:
    """(where, kind, note) of every collective of ``plan``, its repeats' sub-plans included."""
    out = []
    for s in plan.steps:
        if s.is_collective:
            out.append((inside, s.kind, s.note))
        for sub in s.subplans:
            out += _collectives(sub, f"{inside}/{s.label}")
    return out


def test_the_only_collectives_at_the_recurrence_are_its_gathers():
    """Under ``seq:model`` the plan moves, besides the loss's and the gradients' sums (those of
    ``batch:model`` too), only the gathers at the inner repeat: its stacked inputs ``k``, ``v``
    (in the forward only: the forward saves them gathered, and the backward's recompute of the
    recurrence reads them so) and its per-step output's gradient; the per-step outputs and the
    stacked inputs' gradients are read back as local slices (no reduce-scatter, no alltoall)."""
    outs, _ = _rwkv()
    split = _collectives(md.compile(outs, "model:2", "seq:model"))
    # k's and v's gathers, made back to back, go in one bucket (lowering/coalesce.py), its note
    # keeping each member's
    gathers = sorted((where.count("/"), note.split(":")[0]) for where, kind, note in split if kind == "allgather")
    assert gathers == [(2, "re-layout gradient of per-layer output 'wkv'")], split
    [(where, packed)] = [(where, note) for where, kind, note in split if kind == "bucket_allgather"]
    assert where.count("/") == 1 and packed.startswith("2 independent allgathers"), split
    assert "re-layout stacked param 'k'" in packed and "re-layout stacked param 'v'" in packed, packed
    rest = sorted(kind for _, kind, _ in split if kind not in ("allgather", "bucket_allgather"))
    assert rest == sorted(kind for _, kind, _ in _collectives(md.compile(outs, "model:2", "batch:model"))), split


@pytest.mark.parametrize("remat, regathered", [("none", 0), ("selective", 0), ("full", 2)])
def test_the_backward_reads_the_recurrences_inputs_as_the_forward_gathered_them(remat, regathered):
    """The outer backward recomputes the recurrence under ``selective`` and ``full``; under ``none``
    the forward saves the recurrence's own activations too (whole, as it ran on every rank) and the
    backward runs only its gradient.  Where the policy saves its stacked inputs (``k`` and ``v``,
    einsum outputs: ``none`` and ``selective``), the forward saves them gathered, the local slices
    are not saved besides, and the backward gathers nothing; under ``full`` the recompute gathers
    each once (the recurrence's gradient reads the same copy).  Nothing the forward saves goes
    unread by the backward (the recurrence's stacked carries, made again by a recompute, were
    saved before)."""
    outs, feeds = _rwkv(remat=remat)
    plan = md.compile(outs, "model:2", "seq:model")
    # (each a gather of its own, or members of one made back to back: lowering/coalesce.py)
    again = [note for where, kind, note in _collectives(plan) if kind in ("allgather", "bucket_allgather")
             and where.count("/") == 2 for _ in range(note.count("stacked param"))]
    assert len(again) == regathered, again
    fwd, bwd = (next(s for s in plan.steps if s.kind == "repeat" and s.args["backward"] == b) for b in (False, True))
    read = {v for s in bwd.subplans[0].steps for v in s.ins}
    assert all(bwd.subplans[0].inputs[n] in read for n in bwd.args["saved"]), bwd.args["saved"]
    assert fwd.args["saved"] == bwd.args["saved"]
    whole = [n for n in fwd.args["saved"] if not fwd.subplans[0].values[fwd.subplans[0].outputs[n]].sharding.used_axes]
    copies = [n for n in whole if "@" in n]
    assert len(copies) == (2 if remat != "full" else 0), whole   # k's and v's gathered copies
    # and under none the recurrence's 4 saved activations, stacked over seq (its terms; not its
    # stacked carries, which its gradient does not read)
    assert len(whole) - len(copies) == (4 if remat == "none" else 0), whole
    _assert_dense(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), f"seq:model, remat={remat}")


def test_a_pipeline_of_layers_gathers_each_stages_recurrence():
    """The outermost repeat still pipelines (``layer:stage``, micro-batched), and its stages
    gather their recurrences' split ``seq`` as a plain loop does."""
    outs, feeds = _rwkv()
    plan = md.compile(outs, "stage:2; model:2", "layer:stage; seq:model", microbatches=2, schedule="1f1b")
    assert any(s.kind == "pipeline" for s in plan.steps)
    _assert_dense(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), "layer:stage; seq:model")


HELDOUT = [
    (XLSTM, {"form": "recurrent"}, "model:3", "seq:model"),   # 8 over 3: uneven
    (GRIFFIN, {"scan": "repeat"}, "data:2; model:2", "batch:data; seq:model"),
    # more of the same kinds, with -m slow
    pytest.param((XLSTM, {"form": "recurrent"}, "model:2", "seq:model"), marks=pytest.mark.slow),
    pytest.param((LSTM, {"recurrence": "repeat", "seq": 4}, "data:2", "seq:data"), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case", HELDOUT, ids=lambda c: heldout_case_id(c))
def test_heldout_recurrences_over_a_split_seq_match_dense(case):
    assert_heldout_case_matches_dense(case)


def test_the_search_sees_a_recurrences_seq_as_no_pipeline():
    """The search's profile counts only the outermost repeat's dim as a layer dim (a pipeline's):
    a recurrence's ``seq`` is an ordinary dim, offered on the model axis."""
    from meshdsl.search.estimate import profile
    assert profile(_rwkv()[0]).layer_dims == ("layer",)


@pytest.mark.slow
def test_the_search_prices_a_split_seq_around_a_recurrence(monkeypatch, tmp_path):
    """``md.search_layouts`` offers ``seq`` on the model axis of a model whose recurrence scans it
    (priced, no error), and no pipeline over it (only the outermost repeat's dim pipelines)."""
    monkeypatch.setenv("MESHDSL_CACHE_DIR", str(tmp_path))
    model = md.load_model(XLSTM, tiny=True, form="recurrent")
    ranked = md.search_layouts(model, model.train_step(0.01), 2, md.load_calibration()).ranked
    layouts = [r.candidate.layout for r in ranked]
    assert "seq:model" in layouts and not any("seq:pipe" in x for x in layouts), layouts
