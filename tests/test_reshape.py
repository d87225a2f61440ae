"""Reshapes that keep their splits (meshdsl/lowering/reshape.py): which plans they make.

Each case is a reshape or rearrange of a param ``x`` into ``y``, and ``loss =
sum(y * w)`` with a param ``w`` of ``y``'s dims, so the whole plan is known: the
loss's allreduce of a scalar plus what the reshape and its gradient (a reshape
back) move.  Every plan also runs on the simulated mesh against the dense program
(loss and both gradients).  Meshes ``x:2`` and ``x:2; y:2``.  Layouts name the new
dims (Mesh-TF's way), or leave them to the rules the reshapes imply
(meshdsl/lowering/implied.py).

Legend: b batch 2, h height 8, w width 4, c channels 3; hw the merged (height width).
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.layout.mesh import Mesh
from meshdsl.lowering.reshape import carry

B, H, W, C = md.Dim("batch", 2), md.Dim("height", 8), md.Dim("width", 4), md.Dim("channels", 3)
HW = md.Dim("hw", 32)


def _case(make):
    """(outputs, dense reference) of ``loss = sum(make(x) * w)`` and its gradients."""
    torch.manual_seed(0)
    with md.Graph():
        x = md.param("x", [B, H, W, C], scale=1.0)
        y = make(x)
        w = md.param("w", y.shape, scale=1.0)
        loss = md.reduce_sum(y * w)
        gx, gw = md.grad(loss, [x, w])
        outs = {"loss": loss, "grad_x": gx, "grad_w": gw}
    return outs, md.run_dense(outs, {})


def _plan(make, mesh, layout):
    """The plan's collectives as (op, kind, axes, phase), checked against the dense program."""
    outs, ref = _case(make)
    plan = md.compile(outs, mesh, layout, bucket_mb=0)
    got = md.run_simulated(plan, {})
    for k, want in ref.items():
        # fp32 values of O(1): a reshape moves values without arithmetic, only the loss's and the
        # gradients' sums are split over ranks (another summation order than the dense program).
        torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"'{k}': {m}")
    return [(s.op, s.kind, s.axes, s.phase) for s in plan.steps if s.is_collective], plan


def _merge(x):
    return md.reshape(x, [B, HW, C])


def _merge_rearrange(x):
    return md.rearrange(x, "batch height width channels -> batch (height width) channels")


def _split(x):
    return md.reshape(x, [B, md.Dim("hp", 2), md.Dim("ph", 4), W, C])


def _split_rearrange(x):
    return md.rearrange(x, "batch (hp ph) width channels -> batch hp ph width channels", ph=4)


def _loss(axes):
    return [("reduce_sum", "allreduce", axes, "forward")]   # the loss, a partial sum over the axes that split y


# (id, make, mesh, layout, the plan's collectives)
CASES = [
    # merge: the split dim is the outer part of the merged dim: it stays split
    ("merge", _merge, "x:2", "height:x; hw:x", _loss(("x",))),
    ("merge_rearrange", _merge_rearrange, "x:2", "height:x; height_width:x", _loss(("x",))),
    ("merge_2x2", _merge, "x:2; y:2", "batch:y; height:x; hw:x", _loss(("x", "y"))),
    ("merge_nested", _merge, "x:2; y:2", "height:(x,y); hw:(x,y)", _loss(("x", "y"))),
    # split: the split lands on the outer factor (and, nested, on the next one)
    ("split", _split, "x:2", "height:x; hp:x", _loss(("x",))),
    ("split_rearrange", _split_rearrange, "x:2", "height:x; hp:x", _loss(("x",))),
    ("split_nested", _split, "x:2; y:2", "height:(x,y); hp:x; ph:y", _loss(("x", "y"))),
    ("split_2x2", _split, "x:2; y:2", "width:y; height:x; hp:x", _loss(("x", "y"))),
    # the split must move to another dim: one alltoall each way, never an allgather
    ("merge_moves", _merge, "x:2", "width:x; hw:x",
     [("reshape", "alltoall", ("x",), "forward")] + _loss(("x",)) + [("reshape", "alltoall", ("x",), "backward")]),
    ("merge_moves_rearrange", _merge_rearrange, "x:2", "width:x; height_width:x",
     [("rearrange", "alltoall", ("x",), "forward")] + _loss(("x",))
     + [("rearrange", "alltoall", ("x",), "backward")]),
    ("merge_moves_2x2", _merge, "x:2; y:2", "batch:y; width:x; hw:x",
     [("reshape", "alltoall", ("x",), "forward")] + _loss(("x", "y")) + [("reshape", "alltoall", ("x",), "backward")]),
    ("split_moves", _split, "x:2", "height:x; ph:x",
     [("reshape", "alltoall", ("x",), "forward")] + _loss(("x",)) + [("reshape", "alltoall", ("x",), "backward")]),
]


@pytest.mark.parametrize("make, mesh, layout, want", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_minimal_collectives(make, mesh, layout, want):
    got, _ = _plan(make, mesh, layout)
    assert got == want


def test_plan_says_the_split_is_kept():
    _, plan = _plan(_merge, "x:2", "height:x; hw:x")
    (fwd,) = [s for s in plan.steps if s.op == "reshape" and s.phase == "forward"]
    assert fwd.note == "keeps the split: {height:x} -> {hw:x}"
    assert plan.values[fwd.outs[0]].local_shape(plan.mesh) == (2, 16, 3)


def _chain(x):
    return md.reshape(_merge(x), [B, md.Dim("hq", 4), md.Dim("hr", 8), C])


# A dim a reshape makes, which no rule names, inherits the split its reshape carries over
# (meshdsl/lowering/implied.py): the layout names the source dim only, and no data move.
# (id, make, mesh, layout, the implied rules)
IMPLIED = [
    ("merge", _merge, "x:2", "height:x", ["hw:x"]),
    ("merge_rearrange", _merge_rearrange, "x:2", "height:x", ["height_width:x"]),
    ("merge_nested", _merge, "x:2; y:2", "height:(x,y)", ["hw:(x,y)"]),
    ("split", _split, "x:2", "height:x", ["hp:x"]),
    ("split_rearrange", _split_rearrange, "x:2", "height:x", ["hp:x"]),
    ("split_nested", _split, "x:2; y:2", "height:(x,y)", ["hp:x", "ph:y"]),
    ("chain", _chain, "x:2", "height:x", ["hw:x", "hq:x"]),   # hq is the outer part of hw
]


@pytest.mark.parametrize("make, mesh, layout, rules", [c[1:] for c in IMPLIED], ids=[c[0] for c in IMPLIED])
def test_implied_split_moves_nothing(make, mesh, layout, rules):
    """Forward and backward: only the loss's scalar allreduce (the gradient of ``w``, split like
    ``y``, needs none), and the plan's notes name each implied rule."""
    got, plan = _plan(make, mesh, layout)
    axes = tuple(a for a in ("x", "y") if a in mesh)
    assert got == _loss(axes)
    assert [str(r) for r, _ in plan.layout.implied] == rules
    assert str(plan.layout) == layout   # the written layout, as the report prints it
    assert plan.notes[:len(rules)] == tuple(why for _, why in plan.layout.implied)


def test_implied_rule_note():
    _, plan = _plan(_merge, "x:2", "height:x")
    assert "implied by reshape: hw:x (from height)" in plan.notes


@pytest.mark.parametrize("make, mesh, layout, want", [
    # the split on the inner part of the merge carries nothing: hw stays whole (gathered once)
    (_merge, "x:2", "width:x", [("reshape", "allgather", ("x",), "forward")]),
    # a written rule wins: hp:y, not the implied hp:x
    (_split, "x:2; y:2", "height:x; hp:y",
     [("reshape", "allgather", ("x",), "forward"), ("reduce_sum", "allreduce", ("y",), "forward"),
      ("reshape", "allgather", ("y",), "backward")]),
    # hw:x would put w's batch and hw on x (w.batch:x): no rule is implied (w's gradient is made
    # at w's own layout, so the backward moves nothing: lowering/param_values.py)
    # (x's gather for the reshape and w's for the mul, both params', go in one buffer: coalesce.py)
    (_merge, "x:2", "x.height:x; w.batch:x",
     [("reshape", "bucket_allgather", ("x",), "forward")]),
], ids=["inner_part", "written_rule_wins", "param_conflict"])
def test_nothing_implied(make, mesh, layout, want):
    got, plan = _plan(make, mesh, layout)
    assert plan.layout.implied == ()
    assert got == want


def test_scoped_rule_wins_for_its_tensor():
    """``w.hw:y`` places w's hw; the implied global ``hw:x`` places every other tensor's."""
    got, plan = _plan(_merge, "x:2; y:2", "height:x; w.hw:y")
    assert [str(r) for r, _ in plan.layout.implied] == ["hw:x"]
    assert plan.values[plan.params["w"]].sharding.split == {"hw": ("y",)}
    assert ("reshape", "allgather", ("x",), "forward") not in got


def test_implied_inside_a_repeat():
    """A block's reshapes imply rules too: merged and split back in every layer, with the
    stacked param over the merged dim, ``height:x`` alone moves nothing in either loop."""
    layer = md.Dim("layer", 2)
    torch.manual_seed(0)
    with md.Graph():
        x = md.param("x", [B, H, W], scale=1.0)
        w = md.param("w", [layer, HW], scale=1.0)
        y = md.repeat(lambda h, p: md.reshape(md.tanh(md.reshape(h, [B, HW]) * p["w"]), [B, H, W]),
                      x, {"w": w}, layer)
        gx, gw = md.grad(md.reduce_sum(y * y), [x, w])
        outs = {"y": y, "grad_x": gx, "grad_w": gw}
    plan = md.compile(outs, "x:2", "height:x", bucket_mb=0)
    got, want = md.run_simulated(plan, {}), md.run_dense(outs, {})
    for k in want:
        # fp32 of O(1): elementwise per layer; only grad_w sums over the batch, in the same order
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"'{k}': {m}")
    assert plan.notes == ("implied by reshape: hw:x (from height)",)
    assert [s for s in plan.steps if s.is_collective] == []
    assert [t for s in plan.steps for sub in s.subplans for t in sub.steps if t.is_collective] == []


def test_rename_keeps_a_split_on_the_dim_it_makes():
    """A rename of a dim the user split, to a dim the rename makes and no op holds with the old
    one, keeps the split there: no data moves (an MoE's tokens under ``batch:data``, which it
    allgathered); one of a dim whose rule is implied passes the rule on (the patchify below).
    Where the layout puts the axis on another dim of the output, the rename moves the split
    (Mesh-TF's expert parallelism): one alltoall, and one back in the backward."""
    coll, plan = _plan(lambda x: md.rename(_merge(x), batch="b2"), "x:2; y:2", "batch:x; height:y")
    assert sorted(str(r) for r, _ in plan.layout.implied) == ["b2:x", "hw:y"]
    assert [c for c in coll if c[0] == "rename"] == []
    coll, plan = _plan(lambda x: md.rename(_merge(x), batch="b2", channels="c2"), "x:2; y:2",
                       "batch:x; height:y; c2:x")
    assert [str(r) for r, _ in plan.layout.implied] == ["hw:y"]
    assert [c for c in coll if c[0] == "rename"] == [("rename", "alltoall", ("x",), phase)
                                                     for phase in ("forward", "backward")]


def test_patchify_moves_no_image_data():
    """A ViT's patchify (tests/patchify_tiny.py) split over height: the only collectives are the
    pooled activations' sum and the embedding's gradient, none for the images (it allgathered
    them before), with the patch dims written or implied by ``height:...`` alone."""
    from patchify_tiny import Config, build
    model = build(Config.tiny())
    (g_embed, g_head) = md.grad(model.loss, [model.params["w_embed"], model.params["w_head"]])
    outs = {"loss": model.loss, "grad/w_embed": g_embed, "grad/w_head": g_head}
    feeds = model.feeds(0)
    ref = md.run_dense(outs, feeds)
    # the rearrange's merged dim (hp wp) is named hp_wp; the model renames it to patches
    for mesh, layout in [("data:2", "height:data; hp_wp:data; patches:data"), ("data:2", "height:data"),
                         ("data:2; sp:2", "batch:data; height:sp; hp_wp:sp; patches:sp"),
                         ("x:2; y:2", "height:(x,y)")]:
        plan = md.compile(outs, mesh, layout, bucket_mb=0)
        got = md.run_simulated(plan, feeds)
        for k, want in ref.items():
            # fp32 of O(1): the patch sums are split over ranks, another summation order
            torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"'{k}': {m}")
        # only sums: the head's input (a mean over split patches), the loss, the gradients
        assert {s.kind for s in plan.steps if s.is_collective} == {"allreduce"}, layout
        coll = [(s.axes, s.label) for s in plan.steps if s.is_collective]
        if "sp" not in mesh:
            axes = ("data",) if mesh == "data:2" else ("x", "y")
            assert coll == [(axes, "einsum_1"), (axes, "grad/w_embed")], layout


def test_merged_batch_keeps_its_microbatches():
    """Merging batch into tokens keeps the micro-batch split (the batch's outer part), so a
    token-wise model accumulates gradients over micro-batches; it was refused before."""
    seq, d, f = md.Dim("seq", 4), md.Dim("d_model", 8), md.Dim("d_ff", 4)
    batch, tokens = md.Dim("batch", 8), md.Dim("tokens", 32)
    torch.manual_seed(0)
    with md.Graph():
        x = md.input("x", [batch, seq, d])
        w = md.param("w", [d, f], scale=1.0)
        y = md.einsum("tokens d_model, d_model d_ff -> tokens d_ff", md.reshape(x, [tokens, d]), w)
        loss = md.reduce_mean(md.reshape(md.tanh(y), [batch, seq, f]) ** 2)
        outs = {"loss": loss, "grad_w": md.grad(loss, [w])[0]}
    feeds = {"x": torch.randn(8, 4, 8, generator=torch.Generator().manual_seed(1))}
    ref = md.run_dense(outs, feeds)
    for layout in ("batch:data; tokens:data", "batch:data"):   # tokens:data written, or implied
        plan = md.compile(outs, "data:2", layout, microbatches=2)
        got = md.run_simulated(plan, feeds)
        for k, want in ref.items():
            # fp32 of O(1): sums over tokens split by ranks and micro-batches, another order
            torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"'{k}': {m}")
        assert set(plan.totals()) == {"allreduce"}, layout   # the loss and the gradient, nothing for the reshapes
        # the implied rule survives the micro-batch axis's layout
        assert [str(r) for r, _ in plan.layout.implied] == ([] if "tokens" in layout else ["tokens:data"])


def test_predicted_cost():
    """The layout search's price: a kept split costs no communication, and a split that moves
    costs one alltoall, less than the allgather of the same bytes that reshapes made before."""
    from meshdsl.search.calibrate import Calibration
    from meshdsl.search.predict import predict
    cal = Calibration.defaults()
    _, kept = _plan(_merge, "x:2", "height:x; hw:x")
    # by_op rows: (label, op or collective kind, compute seconds, communication seconds)
    assert [r for r in predict(kept, cal).by_op if r[0].endswith("reshape") and r[3]] == []
    _, moved = _plan(_merge, "x:2", "width:x; hw:x")
    rows = [r for r in predict(moved, cal).by_op if r[0].endswith("reshape") and r[3]]
    (a2a,) = [s for s in moved.steps if s.kind == "alltoall" and s.phase == "forward"]
    assert [r[1] for r in rows] == ["alltoall", "alltoall"]   # the forward's and the gradient's
    assert rows[0][3] == pytest.approx(cal.collective("alltoall", a2a.bytes, 2, 2))
    assert rows[0][3] < cal.collective("allgather", a2a.bytes, 2, 2)


MESH = Mesh.parse("x:2; y:2; z:4")


@pytest.mark.parametrize("ins, outs, want", [
    ([(8, ("x",)), (4, ())], [32], [("x",)]),                  # merge, the outer dim split
    ([(8, ()), (4, ("x",))], [32], None),                      # merge, the inner dim split: not one run
    ([(8, ("x", "y"))], [2, 4], [("x",), ("y",)]),             # split over two axes, one per part
    ([(8, ("z",))], [2, 4], None),                             # z:4 does not divide hp:2
    ([(2, ("x",)), (4, ("z",))], [8], [("x", "z")]),           # nested: the outer dim split whole
    ([(2, ()), (4, ("z",))], [8], None),                       # the outer dim whole, the inner split
    ([(1, ()), (8, ("x",))], [1, 2, 4], [(), ("x",), ()]),     # dims of size 1 are skipped
    ([(6, ("x",)), (10, ())], [4, 15], [("x",), ()]),          # regrouped: each half is rows 0-1 / 2-3 of [4, 15]
    ([(6, ("x",)), (10, ())], [3, 20], None),                  # x:2 does not divide 3
    ([(6, ("z",))], [6], [("z",)]),                            # one dim alone: its split, uneven too
])
def test_carry(ins, outs, want):
    assert carry(MESH, ins, outs) == want


def _frames_case():
    """Whisper's stride-2 conv stem in miniature: an input's frames projected, cut into
    ``(seq two)`` and the pairs summed, under ``seq:x``."""
    frames, seq, c = md.Dim("frames", 8), md.Dim("seq", 4), md.Dim("channels", 3)
    torch.manual_seed(0)
    with md.Graph():
        x = md.input("x", [B, frames, c])
        w0 = md.param("w0", [c, md.Dim("c_out", 3)], scale=1.0)
        h = md.tanh(md.einsum("batch frames channels, channels c_out -> batch frames c_out", x, w0))
        pairs = md.rearrange(h, "batch (seq two) c_out -> batch seq two c_out", two=2)
        w = md.param("w", [seq, md.Dim("c_out", 3)], scale=1.0)
        loss = md.reduce_sum(md.reduce_sum(pairs, "two") * w)
        outs = {"loss": loss, **{f"grad_{k}": g for k, g in zip(("w0", "w"), md.grad(loss, [w0, w]))}}
    feeds = {"x": torch.randn(2, 8, 3)}
    plan = md.compile(outs, "x:2", "seq:x", bucket_mb=0)
    got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    for k in want:
        # fp32 of O(1): only the loss and the weights' gradients sum over ranks (another order)
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"'{k}': {m}")
    return [(s.op, s.kind, s.phase) for s in plan.steps if s.is_collective], plan


def test_a_split_reaches_back_to_the_dim_a_rearrange_cuts():
    """Under ``seq:x`` the frames that ``(seq two)`` cuts are split too (``seq`` is their outer
    part): the rearrange's gradient keeps the split, where it allgathered ``seq`` (Whisper's conv
    stem); the projection's weight gradient is reduced instead."""
    coll, plan = _frames_case()
    assert [str(r) for r, _ in plan.layout.implied] == ["frames:x"]
    assert "implied by rearrange: frames:x (from seq)" in plan.notes
    # the loss's partial sum, and w0's gradient: a partial sum over the split frames
    assert coll == [("reduce_sum", "allreduce", "forward"), ("stop_gradient", "allreduce", "backward")]


def _fused_qkv(pattern):
    """A flat fused projection ``[d_model, flat]`` (a checkpoint's c_attn / query_key_value),
    its product rearranged by ``pattern`` and cut into q, k, v; ``loss = sum(q * k * v)``."""
    d = md.Dim("d_model", 4)
    torch.manual_seed(0)
    with md.Graph():
        x = md.param("x", [B, d], scale=1.0)
        wqkv = md.param("wqkv", [d, md.Dim("flat", 12)], scale=1.0)
        flat = md.einsum("batch d_model, d_model flat -> batch flat", x, wqkv)
        qkv = md.rearrange(flat, f"batch ({pattern}) -> batch qkv heads d_head", qkv=3, heads=2)
        q, k, v = (md.squeeze(md.slice_(qkv, "qkv", i, i + 1), "qkv") for i in range(3))
        loss = md.reduce_sum(q * k * v)
        gx, gw = md.grad(loss, [x, wqkv])
        outs = {"loss": loss, "grad_x": gx, "grad_wqkv": gw}
    plan = md.compile(outs, "x:2", "heads:x", bucket_mb=0)
    got, want = md.run_simulated(plan, {}), md.run_dense(outs, {})
    for k in want:
        # fp32 of O(1): products of 4 terms; the loss and grad_x sum over the ranks' heads
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"'{k}': {m}")
    return sorted((s.op, s.kind, s.phase) for s in plan.steps if s.is_collective), plan


def test_a_flat_fused_projection_with_heads_outer_keeps_heads_split():
    """GPT-NeoX / Megatron store qkv per head, ``(heads qkv d_head)``: ``heads:x`` reaches the flat
    dim (its outer part), so the weight is stored split there (column-parallel) and the
    projection runs on each rank's heads: the loss's and the input gradient's partial sums
    only, where the projection ran whole and its gradient was allgathered."""
    coll, plan = _fused_qkv("heads qkv d_head")
    assert [str(r) for r, _ in plan.layout.implied] == ["flat:x"]
    assert plan.values[plan.params["wqkv"]].sharding.split == {"flat": ("x",)}
    assert coll == [("reduce_sum", "allreduce", "forward"), ("stop_gradient", "allreduce", "backward")]


def test_a_flat_fused_projection_with_heads_inner_is_stored_block_cyclic():
    """nanoGPT / GPT-2's c_attn / Phi-3 store ``(qkv heads d_head)``: ``heads`` is an inner part, so
    no contiguous split of the flat dim reaches it, but a block-cyclic one does (rank r's rows of
    each of q, k, v: 3 blocks per rank, lowering/cyclic_dims.py): the weight is stored so and the
    collectives are those of ``(heads qkv d_head)``, where the gradient was allgathered."""
    coll, plan = _fused_qkv("qkv heads d_head")
    assert [str(r) for r, _ in plan.layout.implied] == ["flat:x"]
    assert "implied by rearrange: flat:x (from heads, block-cyclic: 3 blocks per rank)" in plan.notes
    assert plan.values[plan.params["wqkv"]].sharding.cyclic_blocks == {"flat": 3}
    assert coll == [("reduce_sum", "allreduce", "forward"), ("stop_gradient", "allreduce", "backward")]


def test_a_split_on_an_inner_part_is_named_in_the_notes():
    """``ph:(x,y)`` lands on the inner part of ``height = (hp ph)``, over two axes: no split of
    ``height`` carries over (a block-cyclic one is over one axis), so the plan says which dim and
    which parts (as for a flat fused qkv weight under ``heads:model``, tests/heldout_phi3.py); a
    split on the outer part says nothing, and ``ph:x`` makes ``height`` block-cyclic."""
    _, plan = _plan(_split_rearrange, "x:2; y:2", "ph:(x,y)")
    assert plan.notes == ("rearrange: 'ph:x,y' is an inner part of 'height' = (hp ph): no split of 'height' "
                          "carries over to it, so what makes 'height' runs without that split; kept as separate "
                          "dims hp, ph (a fused weight stored by dims, not flat), it would keep the split",)
    assert not [n for n in _plan(_split_rearrange, "x:2", "hp:x")[1].notes if "inner part" in n]
    coll, plan = _plan(_split_rearrange, "x:2", "ph:x")
    assert plan.notes == ("implied by rearrange: height:x (from ph, block-cyclic: 2 blocks per rank)",)
    assert coll == _loss(("x",))


def _uneven(kind: str, rows: int, mesh: str):
    """The collectives of ``loss = sum(y * y)``, ``y`` the ``kind`` of ``x * w`` that cuts
    ``height`` and passes ``batch`` (``rows`` of them, cut unevenly by ``batch:x``) alone, with
    ``x``'s and ``w``'s gradients checked against the dense program."""
    b, d = md.Dim("batch", rows), md.Dim("d", 2)
    torch.manual_seed(0)
    with md.Graph():
        x = md.param("x", [md.Dim("height", 4), b, d], scale=1.0)
        w = md.param("w", [d], scale=1.0)
        if kind == "rearrange":
            y = md.rearrange(x * w, "(h p) batch d -> h p batch d", p=2)
        else:
            y = md.reshape(x * w, [md.Dim("h", 2), md.Dim("p", 2), b, d])
        loss = md.reduce_sum(y * y)
        gx, gw = md.grad(loss, [x, w])
        outs = {"loss": loss, "grad_x": gx, "grad_w": gw}
    plan = md.compile(outs, mesh, "batch:x", bucket_mb=0)
    got, want = md.run_simulated(plan, {}), md.run_dense(outs, {})
    for k in want:
        # fp32 of O(1): sums of up to 48 squares; the loss and grad_w add the ranks' partial sums
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"'{k}': {m}")
    return sorted((s.op, s.kind, s.phase) for s in plan.steps if s.is_collective)


@pytest.mark.parametrize("kind", ["rearrange", "reshape"])
@pytest.mark.parametrize("rows, mesh", [(6, "x:4"), (3, "x:2"), (5, "x:2; y:2")])
def test_an_uneven_split_of_a_dim_the_reshape_passes_stays(kind, rows, mesh):
    """``batch`` 6 on 4 ranks is cut 2, 2, 1, 1 (3 on 2: 2, 1): it passes the
    reshape alone, so each rank reshapes its own rows (a reshape reads their number off its
    slice); it was allgathered and split again, forward and backward.  What moves is the
    loss's and ``w``'s gradient's partial sums."""
    assert _uneven(kind, rows, mesh) == [("reduce_sum", "allreduce", "forward"),
                                         ("stop_gradient", "allreduce", "backward")]


def _renamed(x_is_param: bool, mixed: bool = False):
    """``loss = sum(r * r)``, ``r`` = ``tanh(x * w)`` with ``height`` renamed ``row``, under ``row:x``
    (``mixed``: plus ``sum(x summed over height, squared)``, which mixes ``height``): the collectives,
    the implied rules, the gradient checked against the dense program."""
    b, h, d = md.Dim("batch", 2), md.Dim("height", 8), md.Dim("d", 3)
    torch.manual_seed(0)
    with md.Graph():
        x = (md.param if x_is_param else md.input)("x", [b, h, d])
        w = md.param("w", [d], scale=1.0)
        r = md.rename(md.tanh(x * w), height="row")
        loss = md.reduce_sum(r * r)
        if mixed:
            col = md.reduce_sum(x, "height")
            loss = loss + md.reduce_sum(col * col)
        outs = {"loss": loss, **md.grad(loss, {"w": w, **({"x": x} if x_is_param else {})})}
    feeds = {} if x_is_param else {"x": torch.randn(2, 8, 3)}
    plan = md.compile(outs, "x:2", "row:x", bucket_mb=0)
    got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    for k in want:
        # fp32 of O(1): sums of 48 squares of tanh; the loss and w's gradient add the ranks' partial sums
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"'{k}': {m}")
    return sorted((s.op, s.kind, s.phase) for s in plan.steps if s.is_collective), plan


def test_a_rename_passes_a_written_split_back_to_the_dim_it_renames():
    """FCOS renames its stem's ``height`` to the grid's ``row`` (tests/heldout_fcos.py): under
    ``row:x`` the stem ran whole on every rank and the rename's gradient was allgathered.  Where
    no param holds ``height``, ``height:x`` is implied: the stem runs on each rank's rows and
    only partial sums move.  A param holding ``height`` takes the split too where no op mixes its
    rows (FT-Transformer's per-feature weights): it is stored split and its gradient is made on
    each rank's rows, nothing gathered; where an op sums over ``height`` it keeps its own layout."""
    coll, plan = _renamed(x_is_param=False)
    assert [str(r) for r, _ in plan.layout.implied] == ["height:x"]
    assert coll == [("reduce_sum", "allreduce", "forward"), ("stop_gradient", "allreduce", "backward")]
    coll, plan = _renamed(x_is_param=True)
    assert [str(r) for r, _ in plan.layout.implied] == ["height:x"]
    assert plan.values[plan.params["x"]].sharding.split == {"height": ("x",)}
    assert coll == [("reduce_sum", "allreduce", "forward"), ("stop_gradient", "allreduce", "backward")]
    coll, plan = _renamed(x_is_param=True, mixed=True)
    assert plan.layout.implied == ()
    assert ("rename", "allgather", "backward") in coll


def _tokenizer():
    """FT-Transformer's tokenizer (tests/heldout_ftt.py) in small: 4 numeric features, each its own
    weight and bias row, renamed ``tok`` and joined after 2 learned tokens: (outputs, feeds)."""
    b, n, d, two = md.Dim("batch", 3), md.Dim("num_feat", 4), md.Dim("d", 5), md.Dim("cat_feat", 2)
    torch.manual_seed(0)
    with md.Graph():
        x = md.input("x", [b, n])
        w, bias = md.param("w", [n, d], scale=1.0), md.param("bias", [n, d], scale=1.0)
        extra = md.param("extra", [b, two, d], scale=1.0)
        tokens = md.concat([md.rename(md.tanh(extra), cat_feat="tok"), md.rename(x * w + bias, num_feat="tok")],
                           "tok")
        loss = md.reduce_sum(md.tanh(tokens) * md.tanh(tokens))
        outs = {"loss": loss, **md.grad(loss, {"w": w, "bias": bias, "extra": extra})}
    return outs, {"x": torch.randn(3, 4)}


def _tokenized():
    """:func:`_tokenizer` under ``tok:x`` on 3 ranks (6 tokens as 2, 2, 2; the numeric 4 as 2, 1,
    1): the plan's collectives and implied rules; the loss and every gradient checked against the
    dense program."""
    outs, feeds = _tokenizer()
    plan = md.compile(outs, "x:3", "tok:x", bucket_mb=0)
    got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    for k in want:
        # fp32 of O(1): sums of 90 squares of tanh; the loss and the gradients add the ranks' partial sums
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"'{k}': {m}")
    return sorted((s.op, s.kind, s.phase) for s in plan.steps if s.is_collective), plan


def test_a_rename_implies_an_uneven_split_on_per_feature_weights():
    """The numeric tokens' gradient was gathered (2 of 4 rows a rank, under 3 ranks) for the
    per-feature weights' gradients; with ``num_feat:x`` implied, uneven as ``tok``'s numeric part
    is, the weights are stored split and their gradients made on each rank's rows, not gathered.
    Under strict splits nothing uneven is implied: the refusal names the dim the user split."""
    coll, plan = _tokenized()
    assert [str(r) for r, _ in plan.layout.implied] == ["num_feat:x"]
    assert "uneven split: 'num_feat' (4) over x:3: parts 2, 1, 1 (x, w, bias and" in " ".join(plan.notes)
    assert ("rename", "allgather", "backward") not in coll
    assert plan.values[plan.params["w"]].sharding.split == {"num_feat": ("x",)}
    with pytest.raises(md.LayoutError, match="dim 'tok' of size 4"):
        md.compile(_tokenizer()[0], "x:3", "tok:x", strict_splits=True)
