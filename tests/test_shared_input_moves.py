"""Values several readers share, moved or reduced once for all of them (lowering/shared_moves.py,
lowering/generic.py's packable reductions, lowering/shared_sums.py).

* Three projections of one input split along the dim they contract (q, k, v of a normed input
  under ``d:model``), each with a small weight: each alone would rather reduce its result than
  gather the input and its weight (two latencies against one), three reductions sent as one
  packed allreduce of three results' bytes.  Gathering the input once and the three weights,
  one packed allgather, sends about a third of that: the plan now does so.
* A masked loss ``sum(ce * mask) / sum(mask)`` over a split batch: the count has two readers (the
  division and its gradient), so it is reduced at the division; the numerator's partial sum used
  to pass through the division lazily, the quotient reduced after it: two dependent 4-byte
  allreduces, two latencies.  Reduced beside the count, the two go as one packed allreduce.
* Informer's lazy queries under ``seq:model``: ``mean_key(v)`` of a ``v`` gathered for the
  attention.  The mean's gradient, a sum over the split queries broadcast back over ``key_seq``,
  was allreduced on its own before joining the attention's partial gradient of ``v``, which is
  reduce-scattered anyway: left partial, it joins that one reduce-scatter.

Each plan computes the dense program's numbers (loss and gradients) with fewer collectives.

Legend: b batch, d features (split), f projected features, V vocab; S seq (queries, split),
K key_seq, H heads, E d_head.
"""
from __future__ import annotations

import torch

import meshdsl as md


def _assert_dense(got: dict, want: dict) -> None:
    for k in want:
        # fp32 sums over the split dim added in another order than the dense program: ~1e-7
        # relative; a partial sum reduced twice or not at all is off by a factor of 2
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5 * max(1.0, float(want[k].abs().max())),
                                   msg=lambda m, k=k: f"{k}: {m}")


def _sent(plan, phase: str) -> list[tuple[str, int]]:
    """(kind, members) of each collective of ``phase``, in plan order."""
    return [(s.kind, len(s.ins)) for s, _ in plan.walk() if s.is_collective and s.phase == phase]


def _projections(batch: int) -> dict:
    """Loss and gradients of ``sum(q * k * v)``, three projections of ``x [batch, d]``."""
    b, d, f = md.Dim("batch", batch), md.Dim("d", 8), md.Dim("f", 8)
    with md.Graph():
        x = md.param("x", [b, d], scale=1.0)
        w = {f"w{i}": md.param(f"w{i}", [d, f]) for i in range(3)}
        q, k, v = (md.einsum("batch d, d f -> batch f", x, wi) for wi in w.values())
        loss = md.reduce_sum(q * k * v)
        return {"loss": loss, **md.grad(loss, {"x": x, **w})}


def test_an_input_three_projections_contract_is_gathered_once():
    outs = _projections(batch=64)
    plan = md.compile(outs, "model:2", "d:model")
    # was one bucket_allreduce of the three projections (6144 B): now x and the weights, once
    assert _sent(plan, "forward") == [("bucket_allgather", 4)]
    assert _sent(plan, "backward") == []   # every gradient made where its param is
    assert plan.totals() == {"bucket_allgather": {"count": 1, "bytes": 1408}}
    # (params at their deterministic init, the same in both)
    _assert_dense(md.run_simulated(plan, seed=2), md.run_dense(outs, seed=2))


def test_an_input_whose_projections_weigh_more_than_their_results_is_not_gathered():
    """With 4 rows, gathering x and the 8x8 weights sends more than reducing q, k and v."""
    plan = md.compile(_projections(batch=4), "model:2", "d:model")
    assert [k for k, _ in _sent(plan, "forward")] == ["bucket_allreduce"]


def _masked_loss() -> dict:
    b, d, V = md.Dim("batch", 8), md.Dim("d", 4), md.Dim("vocab", 6)
    with md.Graph():
        x = md.input("x", [b, d])
        labels = md.input("labels", [b], dtype=torch.int64)
        mask = md.input("mask", [b])
        w = md.param("w", [d, V])
        ce = md.cross_entropy(md.einsum("batch d, d vocab -> batch vocab", x, w), labels, "vocab")
        loss = md.reduce_sum(ce * mask) / md.reduce_sum(mask)
        return {"loss": loss, **md.grad(loss, {"w": w})}


def test_a_masked_loss_reduces_its_numerator_and_count_in_one_allreduce():
    outs = _masked_loss()
    plan = md.compile(outs, "data:2", "batch:data")
    # was [("allreduce", 1), ("allreduce", 1)]: the count before the division, the loss after it
    assert _sent(plan, "forward") == [("bucket_allreduce", 2)]
    g = torch.Generator().manual_seed(3)
    feeds = {"x": torch.randn(8, 4, generator=g), "labels": torch.randint(0, 6, (8,), generator=g),
             "mask": (torch.rand(8, generator=g) > 0.3).float()}
    params = {"w": torch.randn(4, 6, generator=g)}
    _assert_dense(md.run_simulated(plan, feeds, params), md.run_dense(outs, feeds, params))


def _lazy_queries(lazy: bool) -> dict:
    """Informer's attention of ``x`` with values ``v = x * wv``, plus, where ``lazy``, the
    queries' fallback ``mean_key(v)``."""
    b, S, H, E = md.Dim("batch", 4), md.Dim("seq", 16), md.Dim("heads", 2), md.Dim("d_head", 4)
    with md.Graph():
        x = md.input("x", [b, S, H, E])
        wv = md.param("wv", [H, E], fan_out=[])
        v = md.rename(x * wv, seq="key_seq")
        y = md.attention(x, md.rename(x, seq="key_seq"), v, "seq", "key_seq", "d_head", causal=False)
        if lazy:
            y = 0.5 * y + 0.5 * md.reduce_mean(v, "key_seq")
        loss = md.reduce_sum(y * y)
        return {"loss": loss, **md.grad(loss, {"wv": wv})}


def test_the_gradient_of_a_mean_of_gathered_values_joins_their_one_reduce_scatter():
    outs = _lazy_queries(lazy=True)
    plan = md.compile(outs, "model:2", "seq:model")
    # was 3 allreduces (164 B): the mean's gradient (128 B) reduced before it joined v's
    assert plan.totals() == md.compile(_lazy_queries(lazy=False), "model:2", "seq:model").totals()
    assert [k for k, _ in _sent(plan, "backward")] == ["reduce_scatter", "allreduce"]   # v's, wv's
    g = torch.Generator().manual_seed(4)
    feeds, params = {"x": torch.randn(4, 16, 2, 4, generator=g)}, {"wv": torch.randn(2, 4, generator=g)}
    _assert_dense(md.run_simulated(plan, feeds, params), md.run_dense(outs, feeds, params))
