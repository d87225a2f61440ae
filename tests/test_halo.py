"""Halo exchanges (meshdsl/lowering/halo.py): a window of a split dim moves only its halo.

A width-5 "same" convolution on ``seq:data``, written three ways (``md.conv``, ``pad`` then a
``slice_`` per tap, a ``shift`` per tap: tests/conv_tiny.py), trades 2 rows with each
neighbour and nothing else, on meshes of 2 and 4 ranks, and gives the dense program's
forward values and gradients.  Exact bytes: a halo of ``r`` rows of ``[batch, rows,
channels]`` fp32 is ``r * channels * batch * 4`` bytes per message.

An unevenly split dim (16 over 3: blocks 6, 5, 5) trades halos as well: each rank's output
block is cut from the output's length as ``torch.tensor_split`` cuts it, and reads its window
from its own input block and its neighbours'.

Legend: batch 2, seq 16, channels 3 (c_in and c_out), 5 taps.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from meshdsl.comm.distributed import TorchComm
from meshdsl.processes.launcher import spawn
from meshdsl.lowering.halo import Reach, cut_by
from meshdsl.tools.report import plan_report
from meshdsl.train.jobs import check_job

import conv_tiny

MODEL = Path(__file__).with_name("conv_tiny.py")

BATCH, SEQ, CH, TAPS = 2, 16, 3, 5
ROW = CH * BATCH * 4   # bytes of one seq row of a [batch, seq, channels] fp32 tensor
FORMS = conv_tiny.FORMS


def _coll(plan):
    return [(s.kind, s.args.get("offset"), s.bytes) for s, _ in plan.collectives()]


def _layer(form: str, causal: bool = False):
    """One conv layer of ``form`` with a cotangent; returns (outputs, feeds, params)."""
    b, s, ci, co = md.Dim("batch", BATCH), md.Dim("seq", SEQ), md.Dim("c_in", CH), md.Dim("c_out", CH)
    x = md.input("x", [b, s, ci])
    w = md.param("w", [md.Dim("tap", TAPS), ci, co])
    y = conv_tiny.conv_layer(x, w, TAPS, form, causal)
    cot = md.input("cot", y.shape)
    gx, gw = md.grad(md.reduce_sum(y * cot), [x, w])
    gen = torch.Generator().manual_seed(3)
    feeds = {"x": torch.randn(BATCH, SEQ, CH, generator=gen), "cot": torch.randn(BATCH, SEQ, CH, generator=gen)}
    return {"y": y, "gx": gx, "gw": gw}, feeds, {"w": torch.randn(TAPS, CH, CH, generator=gen)}


def _check_dense(plan, outs, feeds, params):
    got = md.run_simulated(plan, {k: v for k, v in feeds.items() if k in plan.inputs}, params)
    want = md.run_dense(outs, {k: v for k, v in feeds.items() if k in plan.inputs}, params)
    for k in want:
        # fp32, the taps summed in another order on each rank: rounding only (values O(10)).
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("form", FORMS)
def test_same_conv_forward_moves_only_its_halo(form, p):
    with md.Graph():
        outs, feeds, params = _layer(form)
        plan = md.compile({"y": outs["y"]}, f"data:{p}", "seq:data")
        # 2 rows from the left neighbour (sent right: offset +1) and 2 from the right one.
        assert _coll(plan) == [("permute", 1, 2 * ROW), ("permute", -1, 2 * ROW)]
        _check_dense(plan, {"y": outs["y"]}, feeds, params)
        assert not any(s.op == "pad" for s in plan.steps)   # read through: never materialised


@pytest.mark.parametrize("p", [2, 4])
def test_conv_op_training_moves_the_halos_of_x_and_of_the_gradient(p):
    with md.Graph():
        outs, feeds, params = _layer("op")
        plan = md.compile(outs, f"data:{p}", "seq:data", bucket_mb=0)
        # Forward: x's halo.  Backward: the output gradient's (the input gradient is a conv of
        # it); the weight gradient reuses x's halo and is a partial sum over data.
        assert _coll(plan) == [("permute", 1, 2 * ROW), ("permute", -1, 2 * ROW),
                               ("permute", 1, 2 * ROW), ("permute", -1, 2 * ROW),
                               ("allreduce", None, TAPS * CH * CH * 4)]
        _check_dense(plan, outs, feeds, params)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("form", FORMS)
def test_every_form_trains_by_halos(form, p):
    # The hand-written forms' backward shifts or pads each tap's gradient, a tensor of its
    # own: one halo per tap there, still no gather.
    with md.Graph():
        outs, feeds, params = _layer(form, causal=True)
        plan = md.compile(outs, f"data:{p}", "seq:data", bucket_mb=0)
        kinds = [k for k, _, _ in _coll(plan)]
        assert kinds[:1] == ["permute"] and _coll(plan)[0] == ("permute", 1, 4 * ROW)   # causal: 4 rows, left only
        assert set(kinds) == {"permute", "allreduce"} and kinds.count("allreduce") == 1
        _check_dense(plan, outs, feeds, params)


def test_halos_under_gradient_accumulation():
    # Micro-batches run each segment on a view of the ranks; the end ranks' halo permutes give
    # them nothing on the side with no neighbour, which the value store must hand on as such.
    m = md.load_model(str(MODEL), tiny=True)
    outs = {"loss": m.loss, **{f"grad/{k}": g for k, g in m.grads().items()}}
    plan = md.compile(outs, "data:2", "seq:data", microbatches=2)
    assert {k for k, _, _ in _coll(plan)} == {"permute", "allreduce", "bucket_allreduce"}
    got, want = md.run_simulated(plan, m.feeds(0)), md.run_dense(outs, m.feeds(0))
    for k in want:
        # fp32, micro-batch sums added in another order: rounding only.
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda s, k=k: f"{k}: {s}")


def test_shift_taps_share_one_exchange_in_the_plan_report():
    with md.Graph():
        outs, _, _ = _layer("shift")
        report = plan_report(md.compile({"y": outs["y"]}, "data:2", "seq:data"))
    rows = [e for e in report["ops"] if e["collectives"]]
    assert len(rows) == 1 and [c["kind"] for c in rows[0]["collectives"]] == ["permute", "permute"]
    assert "halo: 2 'seq' rows from the left neighbour, shared by 5 readers" in rows[0]["notes"]
    assert report["totals"] == {"permute": {"count": 2, "bytes": 4 * ROW}}


@pytest.mark.parametrize("reach, n, p, want", [
    (Reach(2, 16, 4), 16, 4, (2, 2)),                 # a same conv, 5 taps
    (Reach(4, 16, 4), 16, 4, (4, 0)),                 # causal: only from the left
    (Reach(0, 12, 4), 16, 4, (3, 3)),                 # valid: output blocks of 3 over input blocks of 4
    (Reach(-2, 8), 16, 2, (2, 0)),                    # slice [2:10]: rank 1 reads [6:10)
    (Reach(3, 16, wrap=True), 16, 4, (3, 0)),         # roll by 3: rank 0 takes the end of the last rank
    (Reach(0, 8), 16, 4, None),                       # slice [0:8]: rank 3 reads rank 1's block
    (Reach(0, 6), 16, 4, None),                       # an output size 4 ranks do not divide
    (Reach(5, 16), 16, 4, None),                      # a shift longer than a block
])
def test_reach_widths(reach, n, p, want):
    assert reach.widths(n, p) == want


@pytest.mark.parametrize("reach, n, mesh, want", [
    (Reach(2, 16, 4), 16, "data:3", (2, 2)),                 # same conv, 5 taps, blocks 6, 5, 5
    (Reach(1, 16), 16, "data:3", (1, 0)),                    # shift by 1
    (Reach(-2, 16, wrap=True), 16, "data:3", (0, 2)),        # roll by -2
    (Reach(4, 16, 4), 16, "data:7", None),                   # 4 rows from a neighbour of 2
    (Reach(0, 12, 4), 16, "data:3", (3, 2)),                 # valid conv: outputs 4, 4, 4 over 6, 5, 5
    (Reach(2, 18), 16, "data:3", (2, 0)),                    # pad 2 before: outputs 6, 6, 6 over 6, 5, 5
    (Reach(0, 2), 16, "data:3", None),                       # fewer output rows than ranks
])
def test_reach_widths_over_uneven_blocks(reach, n, mesh, want):
    m = md.Mesh.parse(mesh)
    assert reach.widths(n, m.axis_size(("data",)), cut_by(m, ("data",))) == want


@pytest.mark.parametrize("form, mesh, layout", [
    *((f, "data:3", "seq:data") for f in FORMS),
    # blocks of 2 and 3 rows: the pad form's slices of the padded 20 rows (4, 3, 3, 4, 3, 3
    # per rank) reach past a neighbour there, so only the op and the shifts
    *((f, "a:2; b:3", "seq:(a,b)") for f in ("op", "shift")),
])
def test_an_uneven_split_trades_halos_too(form, mesh, layout):
    """seq 16 over 3 (6, 5, 5) or over 2 x 3 (3, 3, 2, 3, 3, 2): a 'same' conv (as the op, as
    shifts, or as a pad read by slices of other lengths, each output block cut as
    tensor_split cuts its own length) trades 2 rows a side, forward and backward."""
    with md.Graph():
        outs, feeds, params = _layer(form)
        plan = md.compile(outs, mesh, layout, bucket_mb=0)
        assert {k for k, _, _ in _coll(plan)} == {"permute", "allreduce"}, _coll(plan)
        assert _coll(plan)[:2] == [("permute", 1, 2 * ROW), ("permute", -1, 2 * ROW)]
        _check_dense(plan, outs, feeds, params)


def test_a_window_beyond_the_neighbours_gathers_and_says_so():
    with md.Graph():
        x = md.input("x", [md.Dim("batch", BATCH), md.Dim("seq", SEQ)])
        y = md.slice_(x, "seq", 0, 8)
        plan = md.compile({"y": y}, "data:4", "seq:data")
    assert [k for k, _, _ in _coll(plan)][:1] == ["allgather"]
    assert any("no exchange with the neighbours" in n for n in plan.notes)
    feed = torch.randn(BATCH, SEQ, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(md.run_simulated(plan, {"x": feed})["y"], feed[:, :8], rtol=0, atol=0)


@pytest.mark.parametrize("mesh", ["data:4", "data:3"])
def test_a_few_rows_sliced_to_a_whole_output_are_summed_not_gathered(mesh):
    """Rows [5:7) of seq 16 split 4 or 3 ways (6, 5, 5: they straddle ranks 0 and 1), wanted
    whole (a [CLS] row under seq:model): each rank places what it holds, a partial sum reduced
    after the linear einsum, so the sequence is never gathered; exact (one term is not zero)."""
    with md.Graph():
        x = md.input("x", [md.Dim("batch", BATCH), md.Dim("seq", SEQ), md.Dim("c_in", CH)])
        w = md.param("w", [md.Dim("c_in", CH), md.Dim("c_out", 4)], scale=1.0)
        rows = md.slice_(x, "seq", 5, 7)
        y = md.einsum("batch seq c_in, c_in c_out -> batch seq c_out", rows, w)
        loss = md.reduce_sum(md.tanh(y))
        outs = {"y": y, "loss": loss, **md.grad(loss, {"gx": x, "gw": w})}
        plan = md.compile(outs, mesh, "seq:data")
    kinds = {k for k, _, _ in _coll(plan)}
    assert "allgather" not in kinds and "allreduce" in kinds, _coll(plan)
    assert any("summed from the ranks that hold them" in n for n in plan.notes), plan.notes
    feeds = {"x": torch.randn(BATCH, SEQ, CH, generator=torch.Generator().manual_seed(4))}
    got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    for k in want:
        # the slice is exact; y, the loss and the gradients sum the same terms (fp32 rounding)
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_the_cost_model_gathers_when_the_output_is_wanted_whole():
    # Only x is split: a halo exchange and then a gather of the output would cost two
    # permutes more than gathering x first.
    with md.Graph():
        x = md.input("x", [md.Dim("batch", BATCH), md.Dim("seq", SEQ)])
        y = md.shift(x, "seq", 1)
        plan = md.compile({"y": y}, "data:2", "x.seq:data")
    assert [k for k, _, _ in _coll(plan)] == ["allgather"]


def test_a_pad_with_other_readers_is_materialised():
    with md.Graph():
        x = md.input("x", [md.Dim("batch", BATCH), md.Dim("seq", SEQ)])
        xp = md.pad(x, "seq", 2, 2)
        outs = {"mid": md.slice_(xp, "seq", 1, 17), "scaled": xp * 2.0}
        plan = md.compile(outs, "data:2", "seq:data")
    assert any(s.op == "pad" for s in plan.steps)
    feed = torch.randn(BATCH, SEQ, generator=torch.Generator().manual_seed(2))
    want = md.run_dense(outs, {"x": feed})
    got = md.run_simulated(plan, {"x": feed})
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)   # data movement and one exact doubling


# ----------------------------------------------------------------------------- on gloo processes

def _gloo_cases(rank: int):
    torch.set_num_threads(1)
    comm = TorchComm("data:2")
    return [check_job(comm, str(MODEL), True, "data:2", "seq:data", config={"form": f}) for f in FORMS]


def test_conv_model_on_two_gloo_processes_matches_dense():
    results = spawn(_gloo_cases, 2, timeout=180)[0]
    for form, got in zip(FORMS, results):
        m = md.load_model(str(MODEL), tiny=True, form=form)
        want = md.run_dense({"loss": m.loss, **{f"grad/{k}": g for k, g in m.grads().items()}}, m.feeds(0))
        assert set(got) == set(want)
        for k in want:
            # fp32; gloo and the halo'd kernels sum in another order than the dense ones: rounding only.
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda s, k=k: f"{form} {k}: {s}")


def test_a_shift_beyond_the_neighbours_permutes_the_rows_it_reads():
    """seq 8 on model:4 (2 rows a rank): a shift by |k| >= 2 reads the block of the rank k // 2
    away and k % 2 edge rows of the next one (a shift by 7: the block 3 ranks away, its edge row
    is beyond the dim's end).  Two permutes, or one, instead of gathering seq, where the cost
    model finds them cheaper: at 2 channels one allgather beats two permutes (k = 3), at 8192
    channels the bytes decide.  The gradient, a shift by -k, is lowered alike."""
    S = md.Dim("seq", 8)
    for channels, k, kinds in ((2, 4, ["permute"]), (2, 7, ["permute"]), (2, -4, ["permute"]), (2, 3, ["allgather"]),
                               (8192, 3, ["permute", "permute"]), (8192, -5, ["permute", "permute"])):
        C = md.Dim("c", channels)
        with md.Graph():
            x = md.input("x", [S, C])
            w = md.input("w", [S, C])
            y = md.shift(x, "seq", k)
            outs = {"y": y, "dx": md.grad(md.reduce_sum(y * w), {"x": x})["x"]}
        plan = md.compile(outs, "model:4", "seq:model")
        got_kinds = [s.kind for s, _ in plan.collectives() if s.phase == "forward"]
        assert got_kinds == kinds, (channels, k, got_kinds)
        assert [s.kind for s, _ in plan.collectives() if s.phase == "backward"] == kinds, (channels, k)
        gen = torch.Generator().manual_seed(channels + k)
        feeds = {"x": torch.randn(8, channels, generator=gen), "w": torch.randn(8, channels, generator=gen)}
        want, got = md.run_dense(outs, feeds), md.run_simulated(plan, feeds)
        for name in outs:
            # a shift copies rows: no arithmetic, so the same bits
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=f"{name} {channels} {k}")
