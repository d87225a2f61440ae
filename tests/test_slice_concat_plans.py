"""A per-part concat (meshdsl/lowering/concat.py): parts cut off one tensor along a dim, each
shifted by its own slice_/pad, joined back over that dim (MusicGen's delay pattern).

Under a split concat dim each rank holds its parts' positions, so nothing moves (before: each
size-1 slice was a partial sum and the concat's output was reduce-scattered); over a split seq
the parts' shifts share one halo of the largest shift (before: one per slice and per pad).
Checked against the dense program on even, uneven and two-axis splits, gradients included.
Legend: b batch 2, k codebooks 4, s seq 6.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md

B, K, S = 2, 4, 6
SPECIAL = 7


def _delay(x, fill: float):
    """Codebook k of ``x [batch, codebooks, seq]`` shifted right by k frames, ``fill`` before."""
    parts = [md.pad(md.slice_(md.slice_(x, "codebooks", k, k + 1), "seq", 0, S - k), "seq", k, 0, value=fill)
             for k in range(K)]
    return md.concat(parts, "codebooks")


def _model():
    b, k, s = md.Dim("batch", B), md.Dim("codebooks", K), md.Dim("seq", S)
    x = md.input("x", [b, k, s])
    p = md.param("p", [k, s], scale=1.0)
    w = md.param("w", [k, s], scale=1.0)
    y = _delay(x * p, 0.5)
    loss = md.reduce_sum(md.tanh(y) * w)
    return {"y": y, "loss": loss, **md.grad(loss, {"g/x": x, "g/p": p, "g/w": w})}


def _feeds():
    return {"x": torch.randn(B, K, S, generator=torch.Generator().manual_seed(0))}


def _moves(plan, phase: str = "forward") -> list:
    """The collectives of ``phase`` but the loss's allreduce."""
    return [(s.kind, s.label) for s, _ in plan.collectives() if s.phase == phase and s.label != "reduce_sum"]


@pytest.mark.parametrize("mesh, layout", [
    ("model:2", "codebooks:model"),                   # even: 2 parts per rank
    ("model:3", "codebooks:model"),                   # uneven: 2, 1, 1 parts
    ("data:2; model:2", "codebooks:(data,model)"),    # over two axes: 1 part per rank
    ("model:2", "seq:model"),
    ("model:3", "seq:model"),                         # 6 frames over 3: shifts past a neighbour's 2
    ("data:2; model:2", "codebooks:data; seq:model"),
])
def test_a_per_part_delay_matches_dense(mesh, layout):
    with md.Graph():
        outs = _model()
        # exact windows and masks; tanh, the products and sums: fp32 rounding (md.check's default)
        res = md.check(outs, mesh, layout, _feeds())
    assert res.ok, str(res)


@pytest.mark.parametrize("mesh, layout", [("model:2", "codebooks:model"), ("model:3", "codebooks:model"),
                                          ("data:2; model:2", "codebooks:(data,model)")])
def test_a_delay_over_split_codebooks_moves_nothing(mesh, layout):
    with md.Graph():
        plan = md.compile(_model(), mesh, layout)
    # each rank's codebooks are its own parts (before: 4 allreduces forward, the gradient's sum
    # of 4 placed parts 4 reduce_scatters backward)
    assert _moves(plan) == [] and _moves(plan, "backward") == [], plan.collectives()


def test_the_shifts_of_one_tensor_over_a_split_seq_share_one_halo():
    with md.Graph():
        plan = md.compile(_model(), "model:2", "seq:model")
    moves = _moves(plan), _moves(plan, "backward")
    # shifts by 1, 2, 3 of the grid: one permute of its 3 edge rows each way (before: 5 permutes
    # forward, one per slice and pad, and 4 backward, with an allgather)
    assert [[k for k, _ in m] for m in moves] == [["permute"], ["permute"]], moves


def test_integer_codes_with_a_special_fill_match_dense():
    """MusicGen's form: integer codes, the padding a special id (a where of the shifted codes)."""
    with md.Graph():
        codes = md.input("codes", [md.Dim("batch", B), md.Dim("codebooks", K), md.Dim("seq", S)], dtype=torch.int64)
        y = _delay(codes, SPECIAL)
        feeds = {"codes": torch.randint(0, SPECIAL, (B, K, S), generator=torch.Generator().manual_seed(1))}
        want = md.run_dense({"y": y}, feeds)["y"]
        moves = {}
        for mesh, layout in (("model:2", "codebooks:model"), ("model:2", "seq:model"), ("model:3", "seq:model")):
            plan = md.compile({"y": y}, mesh, layout)
            assert torch.equal(md.run_simulated(plan, feeds)["y"], want), (mesh, layout)   # integers: exact
            moves[mesh, layout] = [k for k, _ in _moves(plan)]
    # before: 4 allreduces; 4 permutes and an allgather
    assert moves["model:2", "codebooks:model"] == [] and moves["model:2", "seq:model"] == ["permute"], moves


def test_parts_of_two_tensors_are_an_ordinary_concat():
    """Parts sliced off two different tensors: not rebuilt from one source (lowered as before)."""
    with md.Graph():
        b, k, s = md.Dim("batch", B), md.Dim("codebooks", K), md.Dim("seq", S)
        x, z = md.input("x", [b, k, s]), md.input("z", [b, k, s])
        y = md.concat([md.slice_(x, "codebooks", 0, 2), md.slice_(z, "codebooks", 2, 4)], "codebooks")
        feeds = {**_feeds(), "z": torch.randn(B, K, S, generator=torch.Generator().manual_seed(2))}
        plan = md.compile({"y": y}, "model:2", "codebooks:model")
        want = md.run_dense({"y": y}, feeds)["y"]
    assert torch.equal(md.run_simulated(plan, feeds)["y"], want)   # slices and a concat: exact


@pytest.mark.parametrize("mesh, layout", [("model:2", "codebooks:model"), ("model:3", "codebooks:model"),
                                          ("model:2", "seq:model")])
def test_parts_across_rank_boundaries_match_dense(mesh, layout):
    """Parts of 1, 2 and 1 codebooks (the 2 straddle the ranks' blocks), one md.shift right, one a
    slice_/pad left with a fill, one as it is: still each rank's positions from its own block."""
    with md.Graph():
        b, k, s = md.Dim("batch", B), md.Dim("codebooks", K), md.Dim("seq", S)
        x = md.input("x", [b, k, s])
        h = x * md.param("p", [k, s], scale=1.0)
        parts = [md.shift(md.slice_(h, "codebooks", 0, 1), "seq", 1),
                 md.pad(md.slice_(md.slice_(h, "codebooks", 1, 3), "seq", 2, S), "seq", 0, 2, value=-1.0),
                 md.slice_(h, "codebooks", 3, 4)]
        y = md.concat(parts, "codebooks")
        loss = md.reduce_sum(md.tanh(y) * md.param("w", [k, s], scale=1.0))
        outs = {"y": y, "loss": loss, **md.grad(loss, {"g/x": x})}
        plan = md.compile(outs, mesh, layout)
        res = md.check(outs, mesh, layout, _feeds())   # exact windows; fp32 rounding elsewhere
    assert res.ok, str(res)
    assert any("parts are windows of slices of one tensor" in n for n in plan.notes)
