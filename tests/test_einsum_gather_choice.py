"""An einsum contracting a split dim against an operand every rank can make whole: a one-hot
dispatch ``[batch, experts, cap, seq]`` of a top-k gathered over ``seq`` (expert-choice MoE,
``tests/heldout_ecmoe.py``), made split by ``seq:model``, is made again whole from the top-k's
indices (:mod:`meshdsl.lowering.remake`), and the generic rule prices that beside gathering it.
So where the result is bigger than the split operand ``h [batch, seq, d_model]`` the plan gathers
``h`` and contracts locally (was: the partial ``[batch, experts, cap, d_model]`` allreduced), and
where it is smaller the partial sum is still reduced. Values and gradients are the dense program's."""
from __future__ import annotations

import pytest
import torch

import meshdsl as md

B, D = 4, 8


def _graph(seq: int, experts: int, cap: int):
    b, s, d = md.Dim("batch", B), md.Dim("seq", seq), md.Dim("d_model", D)
    x = md.Dim("experts", experts)
    with md.Graph():
        inp = md.input("inp", [b, s, d])
        w_in = md.param("w_in", [d, md.Dim("d_in", D)], fan_out=["d_in"])
        router = md.param("router", [md.Dim("d_in", D), x], fan_out=["experts"])
        h = md.rename(md.einsum("batch seq d_model, d_model d_in -> batch seq d_in", inp, w_in), d_in="d_model")
        scores = md.einsum("batch seq d_model, d_model experts -> batch seq experts", h,
                           md.rename(router, d_in="d_model"))
        gate, idx = md.top_k(scores, "seq", cap, "cap")
        dispatch = md.one_hot(idx, s)                                   # [batch, experts, cap, seq]
        xin = md.einsum("batch experts cap seq, batch seq d_model -> batch experts cap d_model", dispatch, h)
        loss = md.reduce_sum(md.gelu(xin) * gate)
    return {"loss": loss, "xin": xin, **md.grad(loss, {"grad/w_in": w_in, "grad/router": router})}


def _feeds(seq):
    return {"inp": torch.randn(B, seq, D, generator=torch.Generator().manual_seed(0))}


def _dispatch_moves(plan):
    """(forward reductions of a partial sum: only the dispatch einsum contracts a split dim; the
    values ``[batch, seq, d_model]`` the forward gathers: only the dispatch einsum reads h other
    than split, maybe in one bucket with the top-k's gather, lowering/coalesce.py)."""
    forward = [s for s in plan.steps if s.phase == "forward"]
    reduced = [s for s in forward if s.kind == "allreduce" and "partial(model)" in s.note]
    gathered = [plan.values[v] for s in forward if s.kind in ("allgather", "bucket_allgather") for v in s.ins
                if plan.values[v].shape.names == ("batch", "seq", "d_model")]
    return reduced, gathered


# seq 8, 4 experts x cap 4: the result [4, 4, 4, 8] is twice h [4, 8, 8]; seq 16, 2 x 2: a quarter
CASES = {"gathers": (8, 4, 4), "reduces": (16, 2, 2)}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mesh,layout", [("model:2", "seq:model"), ("data:2; model:2", "batch:data; seq:model")])
def test_dispatch_einsum_matches_dense(case, mesh, layout):
    outputs = _graph(*CASES[case])
    want = md.run_dense(outputs, _feeds(CASES[case][0]))
    got = md.run_simulated(md.compile(outputs, mesh, layout), _feeds(CASES[case][0]))
    # fp32 sums in another order: ~1e-7 relative; a wrongly picked token or a double-counted
    # partial sum is O(1) off
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5 * float(want[k].abs().max()))


def test_a_result_bigger_than_the_split_operand_gathers_the_operand():
    """seq:model, 2 ranks: h's half is 4*4*8*4 = 512 B a rank; the partial result would be 2 KiB."""
    seq, experts, cap = CASES["gathers"]
    plan = md.compile(_graph(seq, experts, cap), "model:2", "seq:model")
    reduced, gathered = _dispatch_moves(plan)
    assert not reduced, [(s.label, s.bytes, s.note) for s in reduced]
    assert [v.local_bytes(plan.mesh) for v in gathered] == [B * seq // 2 * D * 4], gathered


def test_a_result_smaller_than_the_split_operand_is_reduced():
    """seq 16 over 2 ranks: h's half is 4*8*8*4 = 1 KiB a rank; the result [4, 2, 2, 8] 512 B."""
    seq, experts, cap = CASES["reduces"]
    plan = md.compile(_graph(seq, experts, cap), "model:2", "seq:model")
    reduced, gathered = _dispatch_moves(plan)
    assert [s.bytes for s in reduced] == [B * experts * cap * D * 4], [(s.label, s.bytes, s.note) for s in reduced]
    assert not gathered, gathered
