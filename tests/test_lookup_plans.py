"""Plans of lookups: a split table several lookups read is moved once for all of them
(lowering/shared_moves.py), and a table made only from iota and constants is recomputed where a
reader needs it whole rather than gathered (lowering/remake.py).  Tiny graphs, simulated mesh;
each plan's numbers are checked against the dense program (md.check, its default tolerance:
fp32 sums added in another order)."""
import pytest
import torch

import meshdsl as md


def _collectives(plan, axis=None):
    return [(s.kind, s.bytes) for s in plan.steps if s.is_collective and (axis is None or axis in s.axes)]


def _two_lookups(seq: int):
    """A history lookup [batch, seq] and a candidates' lookup [batch, seq, cand] of one item table,
    scored against each other; the loss and the table's gradient."""
    b, s, c = md.Dim("batch", 2), md.Dim("seq", seq), md.Dim("cand", 3)
    i, d = md.Dim("items", 16), md.Dim("d_model", 8)
    with md.Graph():
        ids, neg = md.input("ids", [b, s], torch.int64), md.input("neg", [b, s, c], torch.int64)
        t = md.param("t", [i, d])
        x = md.gather(t, ids, "items")
        y = md.gather(t, neg, "items")
        loss = md.reduce_mean(md.reduce_sum(x * y, "d_model"))
        out = {"loss": loss, **md.grad(loss, {"t": t})}
    gen = torch.Generator().manual_seed(0)
    feeds = {"ids": torch.randint(0, 16, (2, seq), generator=gen), "neg": torch.randint(0, 16, (2, seq, 3), generator=gen)}
    return out, feeds


@pytest.mark.parametrize("seq", [8, 4], ids=["rows-as-big-as-the-shard", "rows-smaller-than-the-shard"])
@pytest.mark.parametrize("mesh,layout", [("data:2; model:2", "batch:data; items:model"), ("model:2", "items:model")])
def test_two_lookups_of_a_split_table_share_one_gather(seq, mesh, layout):
    # The table's shard is 8 rows x 8 floats = 256 B.  The history's rows (batch/2 x seq x 8
    # floats under batch:data) are 256 B (seq 8, a tie: it was a masked lookup + an allreduce) or
    # fewer (seq 4: the masked lookup alone was cheaper); either way the candidates' lookup gathers
    # the table, and the history reads that gathered copy: one allgather over 'model', nothing
    # else there (the backward scatters each rank's rows into its own shard: no 'model' traffic).
    out, feeds = _two_lookups(seq)
    plan = md.compile(out, mesh, layout)
    assert _collectives(plan, "model") == [("allgather", 256)]
    assert md.check(out, mesh, layout, feeds).ok


def test_one_lookup_alone_keeps_its_masked_lookup():
    # With no other reader gathering the table, a small lookup reads its shard as it is (a masked
    # lookup, its rows' allreduce: 128 B) rather than gathering the table (256 B).
    b, s, i, d = md.Dim("batch", 2), md.Dim("seq", 2), md.Dim("items", 16), md.Dim("d_model", 8)
    with md.Graph():
        ids = md.input("ids", [b, s], torch.int64)
        t = md.param("t", [i, d])
        x = md.gather(t, ids, "items")
        loss = md.reduce_mean(md.reduce_sum(x * x, "d_model"))
    plan = md.compile({"loss": loss}, "model:2", "items:model")
    assert _collectives(plan, "model") == [("allreduce", 128)]


def _rotary_scores(inv: str = "constant"):
    """cos(arange(seq) * inv_freq), renamed seq -> key_seq and read by the keys (whole: key_seq has
    no rule), as a rotary table is; inv_freq a constant, a fed input [d_head] (whole on every rank),
    or a fed input [seq, d_head] (split by ``seq:model``)."""
    b, s, ks, e = md.Dim("batch", 2), md.Dim("seq", 8), md.Dim("key_seq", 8), md.Dim("d_head", 4)
    freqs = torch.tensor([1.0, 0.5, 0.25, 0.125])
    with md.Graph():
        k = md.input("k", [b, ks, e])
        inv_freq = {"constant": lambda: md.constant(freqs, [e]), "whole": lambda: md.input("inv", [e]),
                    "split": lambda: md.input("inv", [s, e])}[inv]()
        cos = md.cos(md.cast(md.arange(s), torch.float32) * inv_freq)            # [seq, d_head]
        y = md.reduce_sum(k * md.rename(cos, seq="key_seq"), "d_head")          # [batch, key_seq]
        q = md.input("q", [b, s])
        scores = md.einsum("batch seq, batch key_seq -> batch seq key_seq", q, y)
        loss = md.reduce_mean(scores * md.reduce_sum(cos, "d_head"))             # cos read split too
        out = {"loss": loss, **md.grad(loss, {"k": k, "q": q})}
    gen = torch.Generator().manual_seed(0)
    feeds = {"k": torch.randn(2, 8, 4, generator=gen), "q": torch.randn(2, 8, generator=gen)}
    if inv != "constant":
        feeds["inv"] = freqs if inv == "whole" else freqs.expand(8, 4).contiguous()
    return out, feeds


def _forward_gathers(plan):
    # (the backward gathers q's part, 2 x 4 floats: the scores' gradient is made from the table
    # alone, so each rank makes it whole and contracts seq locally instead of reducing y's partial
    # gradient, twice the bytes: lowering/remake.py)
    return [(s.label, s.bytes) for s in plan.steps if s.kind == "allgather" and s.phase == "forward"]


@pytest.mark.parametrize("mesh", ["model:2", "model:3"])   # model:3: seq 8 cut 3, 3, 2
def test_a_table_made_from_iota_and_constants_is_recomputed_whole_not_gathered(mesh):
    out, feeds = _rotary_scores("constant")
    plan = md.compile(out, mesh, "seq:model")
    assert not _forward_gathers(plan), _collectives(plan)
    assert md.check(out, mesh, "seq:model", feeds).ok


def test_a_table_made_from_a_whole_input_is_recomputed_too():
    # inv_freq fed whole: every rank holds it, so each makes the table whole from it as well
    out, feeds = _rotary_scores("whole")
    plan = md.compile(out, "model:2", "seq:model")
    assert not _forward_gathers(plan), _collectives(plan)
    assert md.check(out, "model:2", "seq:model", feeds).ok


def test_a_table_made_from_a_split_input_is_still_gathered():
    # inv_freq fed split over seq: no rank can make the other rows, so the rename gathers the
    # table (64 B: 4 of 8 rows x 4 floats).
    out, feeds = _rotary_scores("split")
    plan = md.compile(out, "model:2", "seq:model")
    assert ("rename", 64) in _forward_gathers(plan), _collectives(plan)
    assert md.check(out, "model:2", "seq:model", feeds).ok
