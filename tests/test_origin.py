"""Where a dim joined a tensor (:mod:`meshdsl.core.origin`): the walk behind the einsum error that
names the broadcast which brought an unwanted dim in.

Legend: batch (b) 2, tgt_seq (t) 3, src_seq (s) 5, d_model (d) 4, d_ff (f) 6.
"""
from __future__ import annotations

import meshdsl as md
from meshdsl.core.origin import dim_joined

B, T, S, D, F = (md.Dim(n, k) for n, k in (("batch", 2), ("tgt_seq", 3), ("src_seq", 5), ("d_model", 4),
                                           ("d_ff", 6)))


def test_the_walk_passes_ops_that_carry_the_dim_to_the_broadcast_that_brought_it():
    with md.Graph():
        x, pos = md.input("x", [B, T, D]), md.param("pos", [S, D])
        h = x + pos                                                   # the join: [batch, tgt_seq, d_model, src_seq]
        h = md.rms_norm(h * md.param("g", [B, T, D]), "d_model")      # an operand with the stream's dims, no src_seq
        u = md.einsum("batch tgt_seq d_model src_seq, d_model d_ff -> batch tgt_seq d_ff src_seq", h,
                      md.param("w", [D, F]))                          # carries src_seq on, with other dims
        j = dim_joined(md.tanh(u), "src_seq", ["batch", "tgt_seq", "d_ff"])
    assert j is not None and j.node.op.name == "add"
    assert (j.stream.name, j.carrier.name) == ("x", "pos")


def test_a_dim_the_tensor_had_from_a_leaf_or_a_broadcast_to_joined_nowhere():
    with md.Graph():
        x = md.input("x", [B, T, S])
        y = md.broadcast_to(md.input("y", [B, T]), [B, T, S])
        assert dim_joined(md.exp(x) * 2.0, "src_seq", ["batch", "tgt_seq"]) is None
        assert dim_joined(y + y, "src_seq", ["batch", "tgt_seq"]) is None
