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
    # own: one halo per tap there (those to one neighbour may go as one: bucket_permute), still no gather.
    with md.Graph():
        outs, feeds, params = _layer(form, causal=True)
        plan = md.compile(outs, f"data:{p}", "seq:data", bucket_mb=0)
        kinds = [k for k, _, _ in _coll(plan)]
        assert kinds[:1] == ["permute"] and _coll(plan)[0] == ("permute", 1, 4 * ROW)   # causal: 4 rows, left only
        assert set(kinds) <= {"permute", "bucket_permute", "allreduce"} and kinds.count("allreduce") == 1
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


# ----------------------------------------------------------------------------- uneven blocks, past a neighbour

def test_routes_over_uneven_blocks_fetch_from_the_ranks_that_hold_the_rows():
    """11 rows on 3 ranks (4, 4, 3), a causal window of 8 rows back (a dilated conv, 5 taps
    dilated 2): rank 1 reads rows 0..4 (its neighbour's block), rank 2 rows 0..8 (4 from its
    neighbour, 4 from the rank 2 away); the shortest block is 3, so no neighbour-only exchange."""
    from meshdsl.lowering.halo_routes import routes
    m = md.Mesh.parse("data:3")
    reach, cut = Reach(8, 11, 8), cut_by(m, ("data",))
    assert reach.widths(11, 3, cut) is None and reach.far_widths(11, 3, cut) == (8, 0)
    got = [(r.left, r.hop, r.width, r.sends, r.places) for r in routes([reach], 11, cut, 8, 0)]
    # (sender offset, its first row sent), (receiver offset, where in its 8 rows before, how many)
    assert got == [(True, 1, 4, ((0, 0), (4, 0)), ((4, 4, 4), (8, 4, 4))),
                   (True, 2, 4, ((0, 0),), ((8, 0, 4),))]


def _uneven_conv(dilation: int, taps: int, batch: int):
    """A causal dilated conv over seq 11 and its gradients (x and w), with a cotangent."""
    b, s, ci, co = md.Dim("batch", batch), md.Dim("seq", 11), md.Dim("c_in", 8), md.Dim("c_out", 8)
    x = md.input("x", [b, s, ci])
    w = md.param("w", [md.Dim("tap", taps), ci, co])
    y = md.conv(x, w, {"seq": "tap"}, padding="causal", dilation=dilation)
    cot = md.input("cot", y.shape)
    gx, gw = md.grad(md.reduce_sum(y * cot), [x, w])
    gen = torch.Generator().manual_seed(5)
    feeds = {"x": torch.randn(batch, 11, 8, generator=gen), "cot": torch.randn(batch, 11, 8, generator=gen)}
    return {"y": y, "gx": gx, "gw": gw}, feeds, {"w": torch.randn(taps, 8, 8, generator=gen)}


def _check_dense_scaled(plan, outs, feeds, params):
    got = md.run_simulated(plan, {k: v for k, v in feeds.items() if k in plan.inputs}, params)
    want = md.run_dense(outs, {k: v for k, v in feeds.items() if k in plan.inputs}, params)
    for k in want:
        # fp32: the weight gradient sums 512 * 11 products per element, in another order on the
        # ranks: ~sqrt(n) * 2**-24 of its magnitude (O(100)), far below 1e-5 of it; a wrong row is O(1) of it.
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5 * float(want[k].abs().max()),
                                   msg=lambda m, k=k: f"{k}: {m}")


def test_a_window_past_the_shortest_uneven_block_takes_rows_from_further_ranks():
    """seq 11 on data:4 (3, 3, 3, 2), a causal conv of 3 taps dilated 2 (4 rows back, more than a
    block): x's rows come from the left neighbour (3) and the rank 2 away (1), dy's (the input
    gradient's transposed conv) from the right alike, not an allgather (9 rows a rank); at batch
    512 a row is 16 KiB, where two permutes cost less.  The weight gradient reads x's exchange."""
    with md.Graph():
        outs, feeds, params = _uneven_conv(2, 3, 512)
        plan = md.compile(outs, "data:4", "seq:data", bucket_mb=0)
    row = 512 * 8 * 4
    perms = [(o, b) for k, o, b in _coll(plan) if k == "permute"]
    assert "allgather" not in {k for k, _, _ in _coll(plan)}, _coll(plan)
    assert perms == [(1, 3 * row), (2, row), (-1, 3 * row), (-2, row)], perms
    _check_dense_scaled(plan, outs, feeds, params)


def test_an_uneven_far_window_the_gather_beats_says_so():
    """seq 11 on data:3 (4, 4, 3), 5 taps dilated 2 (8 rows back): the permutes would move 8 rows,
    as many as the allgather, with a latency more; it gathers, and the plan says so."""
    with md.Graph():
        outs, feeds, params = _uneven_conv(2, 5, 512)
        plan = md.compile(outs, "data:3", "seq:data", bucket_mb=0)
    assert "allgather" in {k for k, _, _ in _coll(plan)}
    assert any("for less than gathering it" in n for n in plan.notes), plan.notes
    _check_dense_scaled(plan, outs, feeds, params)


def test_far_shifts_over_uneven_blocks_share_one_exchange():
    """A dilated causal conv written as shifts (by 4, 2 and 0) of x over seq 11 on data:4 (3, 3, 3,
    2): both shifts of x read one exchange (3 rows from the left neighbour, 1 from the rank 2
    away); the gradient's shifts by -2 and -4 are of two tensors (w1's and w0's): 2 rows from the
    right neighbour, and 2 rows and 1 from the ranks 1 and 2 to the right; no allgather."""
    b, s, c = md.Dim("batch", 512), md.Dim("seq", 11), md.Dim("c", 8)
    with md.Graph():
        x = md.input("x", [b, s, c])
        wts = [md.input(f"w{k}", [b, s, c]) for k in range(3)]
        y = md.shift(x, "seq", 4) * wts[0] + md.shift(x, "seq", 2) * wts[1] + x * wts[2]
        outs = {"y": y, "dx": md.grad(md.reduce_sum(y), {"x": x})["x"]}
        plan = md.compile(outs, "data:4", "seq:data")
    row = 512 * 8 * 4
    assert [(k, o, n) for k, o, n in _coll(plan)] == [
        ("permute", 1, 3 * row), ("permute", 2, row), ("permute", -1, 2 * row), ("permute", -1, 2 * row),
        ("permute", -2, row)], _coll(plan)
    gen = torch.Generator().manual_seed(6)
    feeds = {"x": torch.randn(512, 11, 8, generator=gen), **{f"w{k}": torch.randn(512, 11, 8, generator=gen)
                                                             for k in range(3)}}
    want, got = md.run_dense(outs, feeds), md.run_simulated(plan, feeds)
    for k in want:
        # rows copied and the same three products summed in the same order: rounding only
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_a_sliding_window_past_the_shortest_uneven_block_and_its_gradient_return():
    """Causal window 6 over seq 11 on data:4 (3, 3, 3, 2): ranks 2 and 3 read 5 key rows back, 3
    from the neighbour and 2 from the rank 2 away; the backward sends the halo keys' and values'
    gradient rows back the same two ways (k and v are one tensor: one exchange forward)."""
    b, s, f = md.Dim("batch", 16), md.Dim("seq", 11), md.Dim("f", 512)
    with md.Graph():
        x = md.input("x", [b, s, f])
        k = md.rename(x, {"seq": "key_seq"})
        y = md.attention(x, k, k, "seq", "key_seq", "f", causal=True, window=6)
        cot = md.input("cot", y.shape)
        outs = {"y": y, "dx": md.grad(md.reduce_sum(y * cot), {"x": x})["x"]}
        plan = md.compile(outs, "data:4", "seq:data; key_seq:data")
    row = 16 * 512 * 4
    perms = [(o, n) for kind, o, n in _coll(plan) if kind == "permute"]
    assert "allgather" not in {kind for kind, _, _ in _coll(plan)}, _coll(plan)
    assert perms == [(1, 3 * row), (2, 2 * row)] + [(-1, 3 * row), (-2, 2 * row)] * 2, perms
    gen = torch.Generator().manual_seed(7)
    feeds = {"x": torch.randn(16, 11, 512, generator=gen), "cot": torch.randn(16, 11, 512, generator=gen)}
    want, got = md.run_dense(outs, feeds), md.run_simulated(plan, feeds)
    for name in want:
        # fp32 softmax over the same keys, in blocks: rounding only (values O(1))
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_an_uneven_far_conv_in_a_repeat_matches_dense():
    """Two layers of md.repeat, each ``h + tanh(conv(h))`` (3 taps dilated 2, causal) over seq 11
    on data:4 (3, 3, 3, 2): the forward block takes h's rows from 1 and 2 ranks left, the backward
    block dy's from the right; no allgather; every gradient is the dense program's."""
    b, s, c, co, layer = md.Dim("batch", 512), md.Dim("seq", 11), md.Dim("c", 8), md.Dim("c_out", 8), md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [b, s, c])
        w = md.param("w", [layer, md.Dim("tap", 3), c, co])

        def block(h, p):
            y = md.conv(h, p["w"], {"seq": "tap"}, padding="causal", dilation=2)
            return h + md.tanh(md.rename(y, {"c_out": "c"}))
        y = md.repeat(block, x, {"w": w}, "layer")
        cot = md.input("cot", y.shape)
        loss = md.reduce_sum(y * cot)
        outs = {"loss": loss, **md.grad(loss, {"gx": x, "gw": w})}
        plan = md.compile(outs, "data:4", "seq:data", bucket_mb=0)
    kinds = {(k, o) for k, o, _ in _coll(plan)}
    assert {("permute", 1), ("permute", 2), ("permute", -1), ("permute", -2)} <= kinds, _coll(plan)
    assert "allgather" not in {k for k, _ in kinds}, _coll(plan)
    gen = torch.Generator().manual_seed(8)
    feeds = {"x": torch.randn(512, 11, 8, generator=gen), "cot": torch.randn(512, 11, 8, generator=gen)}
    _check_dense_scaled(plan, outs, feeds, {"w": torch.randn(2, 3, 8, 8, generator=gen) * 0.3})


@pytest.mark.parametrize("n, gathered", [(10, True), (12, False)])
def test_a_strided_conv_over_uneven_phases_gathers_and_says_why(n, gathered):
    """A stride-2 conv over seq 10 on data:3 (4, 3, 3): its phases' 5 rows cut 2, 2, 1 need parts
    4, 4, 2, so the phase rearrange gathers seq and the plan says why; over 12 (4, 4, 4; phases
    2, 2, 2) it stays split.  Both give the dense values."""
    b, s, ci, co = md.Dim("batch", BATCH), md.Dim("seq", n), md.Dim("c_in", CH), md.Dim("c_out", CH)
    with md.Graph():
        x = md.input("x", [b, s, ci])
        w = md.param("w", [md.Dim("tap", 3), ci, co])
        y = md.conv(x, w, {"seq": "tap"}, padding="same", stride=2)
        cot = md.input("cot", y.shape)
        gx, gw = md.grad(md.reduce_sum(y * cot), [x, w])
        outs = {"y": y, "gx": gx, "gw": gw}
        plan = md.compile(outs, "data:3", "seq:data", bucket_mb=0)
    noted = any("do not cut at multiples of the stride 2" in t for t in plan.notes)
    assert noted == gathered and ("allgather" in {k for k, _, _ in _coll(plan)}) == gathered, (plan.notes, _coll(plan))
    gen = torch.Generator().manual_seed(9)
    feeds = {"x": torch.randn(BATCH, n, CH, generator=gen), "cot": torch.randn(BATCH, n // 2, CH, generator=gen)}
    _check_dense(plan, outs, feeds, {"w": torch.randn(3, CH, CH, generator=gen)})
