"""Plans that read what they already hold (lowering/generic.py, lowering/halo.py).

Each checks the plan's collectives and its numbers against the dense program (tiny graphs,
simulated mesh)."""
from __future__ import annotations

import torch

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, assert_matches_scaled, heldout_outputs

EP = ("data:2", "batch:data; experts:data")


def _experts_block(use_repeat: bool):
    """Two layers of ``h + sum_experts(tanh((h * r) @ w))``: the product is batch-split, the
    einsum experts-split, so the forward moves it there (an alltoall) and ``tanh`` back."""
    b, e, d, L = md.Dim("batch", 4), md.Dim("experts", 2), md.Dim("d", 3), md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [b, d])
        r = md.param("r", [e], scale=1.0)
        w = md.param("w", [L, e, d, md.Dim("f", 3)], fan_out=["layer", "f"])

        def block(h, q):
            t = h * r
            u = md.einsum("batch experts d, experts d f -> batch experts f", t, q["w"])
            return h + md.rename(md.reduce_sum(md.tanh(u), "experts"), f="d")
        if use_repeat:
            y = md.repeat(block, x, {"w": w}, "layer")
        else:
            y = x
            for i in range(2):
                y = block(y, {"w": md.squeeze(md.slice_(w, "layer", i, i + 1), "layer")})
        loss = md.reduce_sum(y * y)
        outs = {"loss": loss, **md.grad(loss, {"w": w, "r": r})}
    return outs, {"x": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}


def _tanh_grad_moves(plan) -> list[str]:
    """The collectives of tanh's gradient (``1 - tanh**2`` times the cotangent), any sub-plan."""
    return [s.label for s, _ in plan.collectives() if s.label.startswith("grad_tanh/")]


def test_an_elementwise_backward_reads_the_saved_activations_held_copy():
    # tanh's saved value is experts-split; the forward moved it to the batch split for the sum
    # over experts, and the repeat's backward is given that copy.  Its gradient's elementwise
    # ops read the copy, so only their result moves to the experts split for the einsum (one
    # alltoall); they used to move the saved value to the cotangent's split and the product back.
    outs, feeds = _experts_block(True)
    plan = md.compile(outs, *EP)
    assert _tanh_grad_moves(plan) == [], _tanh_grad_moves(plan)
    assert plan.totals()["alltoall"]["count"] == 8, plan.totals()    # was 12, then 10
    # the backward makes dt, the product's gradient, experts-split; the router's gradient dt * h
    # moves it to the batch split, and the block lowered again knowing so (lowering/foresight.py)
    # reads that copy for dt * r too (r gathered, one number a rank), where its product was made
    # experts-split and moved as well: one alltoall of dt a layer, not two
    back = [(s.label, n) for s, n in plan.collectives() if s.kind == "alltoall" and s.phase == "backward"]
    assert sorted(back) == [("grad_einsum/einsum", 2), ("grad_mul/mul", 2)], back
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), "repeat EP", 1e-5)


def test_unrolled_layers_read_the_forwards_held_copy_too():
    outs, feeds = _experts_block(False)
    plan = md.compile(outs, *EP)
    assert _tanh_grad_moves(plan) == [], _tanh_grad_moves(plan)
    assert plan.totals()["alltoall"]["count"] == 9, plan.totals()    # was 11
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), "unrolled EP", 1e-5)


def _sliced_rows():
    """``tanh(x * w)``'s first 4 of 7 rows: over 3 ranks (blocks 3, 2, 2; the slice's 2, 1, 1)
    rank 1 reads rank 0's last row, rank 2 rank 1's first."""
    tok, d = md.Dim("tok", 7), md.Dim("d", 4)
    with md.Graph():
        x = md.input("x", [tok, d])
        w = md.param("w", [d])
        y = md.slice_(md.tanh(x * w), "tok", 0, 4)
        loss = md.reduce_sum(y * y)
        outs = {"loss": loss, **md.grad(loss, {"w": w})}
    return outs, {"x": torch.randn(7, 4, generator=torch.Generator().manual_seed(0))}


def _permutes(plan) -> dict[str, int]:
    return {s.label: s.bytes for s, _ in plan.collectives() if s.kind == "permute"}


def test_a_halo_over_uneven_blocks_sends_each_rank_the_rows_its_neighbour_reads():
    outs, feeds = _sliced_rows()
    plan = md.compile(outs, "m:3", "tok:m")
    # one row of 4 floats each way; every rank sent its last 2 rows alike (32 B)
    assert _permutes(plan) == {"slice": 16, "grad_slice/pad": 16}, _permutes(plan)
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), "tok:m", 1e-5)


def test_ft_transformers_last_token_concat_moves_one_row_each_way():
    case = ("tests/heldout_ftt.py", {"cls": "last"}, "model:3", "tok:model")
    plan = md.compile(heldout_outputs(md.load_model(case[0], tiny=True, **case[1])), *case[2:])
    assert _permutes(plan) == {"concat/pad": 384, "grad_concat/slice": 384}, _permutes(plan)   # was 768
    assert_heldout_case_matches_dense(case)


def test_debertas_backward_recomputes_its_relative_projections_from_the_gathered_weights():
    # k_r = rel_h . wk depends on params only: the backward recomputes it.  Under FSDP (wk split
    # along hid, the contraction) that was a partial sum, allreduced per layer for k_r and q_r,
    # while the backward gathers wk and wq anyway for their gradients: a lowering that foresees
    # those gathers reads them for the recompute too.
    case = ("tests/heldout_deberta.py", {}, "data:2", "ex:data; params.hid:data")
    plan = md.compile(heldout_outputs(md.load_model(case[0], tiny=True)), *case[2:])
    totals = plan.totals()
    # was 8 allreduces, 2600 B; the embedding's layer norm joins its statistics by one gather of
    # its parts' moments (64 B, lowering/norms.py) where the mean alone was allreduced (32 B): the
    # centred activation is gathered after it either way (its output is whole)
    # a masked mean's numerator and count go as one packed 8 B allreduce (lowering/generic.py)
    assert totals["allreduce"] == {"count": 1, "bytes": 512}, totals
    assert totals["bucket_allreduce"] == {"count": 1, "bytes": 8}, totals
    # the same gathers, and the moments (several made back to back in one buffer: lowering/coalesce.py)
    gathers = [(len(s.ins) * n, s.bytes * n) for s, n in plan.collectives()
               if s.kind in ("allgather", "bucket_allgather")]
    assert tuple(map(sum, zip(*gathers))) == (39, 16288), totals
    assert_heldout_case_matches_dense(case)
