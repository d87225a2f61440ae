"""Three plan findings of held-out round 27b (XLNet's memory slot, TimesNet's folds, CoCa's refusal).

* A concat's gradient along a split dim (XLNet's keys ``concat([memory slot, keys], "key_seq")``
  under ``seq:model``): each slice takes its part of the partial sum, the token rows
  reduce-scattered to the split sequence and the slot's row reduced with its param's gradient
  (``lowering/window.py``), not the whole allreduced and cut.
* Two folds of ``time`` with the same dim names at different sizes (``cycles`` 4 and 3 under
  ``time:model`` over 2): a reshape carries no uneven split, so ``cycles`` takes no rule through
  the vote, and the unfold's ``cycles_period`` keeps the one it carries (``lowering/implied.py``).
* A micro-batch refusal of an einsum says which einsum: its equation and operand dims.

Legend: batch 2, seq 8 (or 7: uneven), heads 2, d_head 4, d_model 8; time 24, channels 4.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md


def _agree(plan, outs):
    got, want = md.run_simulated(plan), md.run_dense(outs)
    for k in want:
        # the same ops per element; only the reductions' order differs across ranks: fp32 rounding
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def _keys_with_memory(seq: int, memory: bool):
    b, s, h, e, d = md.Dim("batch", 2), md.Dim("seq", seq), md.Dim("heads", 2), md.Dim("d_head", 4), md.Dim("d_model", 8)
    x = md.param("x", [b, s, d], scale=1.0)
    wk = md.param("wk", [d, h, e])
    q = md.param("q", [b, s, h, e], scale=1.0)
    k = md.rename(md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, wk), seq="key_seq")
    wrt = {"x": x, "wk": wk, "q": q}
    if memory:
        wrt["m"] = m = md.param("m", [md.Dim("key_seq", 1), h, e], scale=1.0)
        k = md.concat([md.broadcast_to(m, [b, *m.shape]), k], "key_seq")
    y = md.attention(q, k, k, "seq", "key_seq", "d_head", causal=False)
    loss = md.reduce_sum(y * y)
    return {"loss": loss, **md.grad(loss, wrt)}


def _backward(plan):
    return [(st.kind, st.bytes, st.label) for st, _ in plan.walk() if st.is_collective and st.phase == "backward"]


@pytest.mark.parametrize("seq", [8, 7])
def test_a_concat_gradient_over_a_split_dim_reduces_each_part_where_it_goes(seq):
    """Before: ``allreduce grad_concat/slice`` of the whole [batch, 1 + seq, heads, d_head]
    gradient; now the token rows are reduce-scattered as without the slot (even and uneven
    splits), and the slot's row joins its param's gradient in the bucket."""
    with md.Graph():
        plain = md.compile(_keys_with_memory(seq, False), "model:2", "seq:model")
    with md.Graph():
        outs = _keys_with_memory(seq, True)
        plan = md.compile(outs, "model:2", "seq:model")
    back = _backward(plan)
    assert not any("concat" in label for _, _, label in back), back
    scattered = [(k, n) for k, n, _ in _backward(plain) if k == "reduce_scatter"]
    assert scattered and [(k, n) for k, n, _ in back if k == "reduce_scatter"] == scattered, back
    sent = sum(v["bytes"] for v in plan.totals().values())
    assert sent == sum(v["bytes"] for v in plain.totals().values()) + 2 * 4 * 4, (plan.totals(), plain.totals())
    _agree(plan, outs)


def _two_folds():
    b, t, c = md.Dim("batch", 2), md.Dim("time", 24), md.Dim("channels", 4)
    x = md.param("x", [b, t, c], scale=1.0)
    ws, ys = {}, []
    for i, period in enumerate((6, 8)):   # cycles 4 (even over 2) and 3 (uneven), the same names
        z = md.rearrange(x, "batch (cycles period) channels -> batch cycles period channels", period=period)
        ws[f"w{i}"] = w = md.param(f"w{i}", [md.Dim("kh", 3), md.Dim("kw", 3), c, md.Dim("c_out", 4)])
        z = md.rename(md.conv(z, w, {"cycles": "kh", "period": "kw"}), c_out="channels")
        z = md.rearrange(z, "batch cycles period channels -> batch (cycles period) channels")
        ys.append(md.rename(z, cycles_period="time"))
    loss = md.reduce_sum(md.square(x + ys[0] + ys[1]))
    return {"loss": loss, **md.grad(loss, {"x": x, **ws})}


def test_folds_sharing_dim_names_at_an_uneven_size_keep_the_unfolds_split():
    """Before: ``cycles:model`` implied through the vote (3 is odd: a reshape cannot carry it),
    ``cycles_period`` none: 5 allgathers and 8 permutes; now ``cycles_period:model``, x gathered
    once for both folds and the unfolds' gradient once."""
    with md.Graph():
        outs = _two_folds()
        plan = md.compile(outs, "model:2", "time:model")
    implied = [n for n in plan.notes if n.startswith("implied")]
    assert any("cycles_period:model" in n for n in implied) and not any(" cycles:model" in n for n in implied), implied
    totals = plan.totals()
    assert "permute" not in totals and totals["allgather"]["count"] == 2, totals
    _agree(plan, outs)


def test_a_micro_batch_refusal_names_the_einsum_as_written():
    """Before: ``'einsum' cannot be micro-batched``: which of the model's einsums?"""
    b = md.Dim("batch", 2)
    with md.Graph():
        z = md.param("z", [b, md.Dim("e", 3)], scale=1.0)
        md.einsum("batch e, e -> batch", z, md.param("v", [md.Dim("e", 3)]))   # another einsum, first
        sim = md.einsum("batch e, batch2 e -> batch batch2", z, md.rename(z, batch="batch2"))
        loss = md.reduce_mean(md.cross_entropy(sim, md.arange(b), "batch2"))
        with pytest.raises(md.LayoutError) as e:
            md.compile({"loss": loss, **md.grad(loss, {"z": z})}, "data:1", "", microbatches=2)
    assert "(md.einsum(\"batch e, batch2 e -> batch batch2\") of [batch:2, e:3] and [batch2:2, e:3]) " \
           "cannot be micro-batched" in str(e.value), str(e.value)
