"""Plans of values computed from params alone under FSDP (``meshdsl/lowering/param_values.py``).

A weight normalised in the graph (nGPT's ``w * rsqrt(sum(w * w, d_model))``) under
``params.d_model:data`` was gathered twice: ``w * w`` for the sum, then the normalised weight.
Offered its param's layout, the chain runs split: the small row sums are allreduced and the
normalised weight gathered once, where the einsum reads it.  A weight whose pieces are read apart
(a depthwise conv's taps) is not gathered piece by piece twice: the lowering that would is priced
against the one without the offer and dropped.  The dense program is the oracle of every plan here.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md

FSDP = "batch:data; params.d_model:data"
B, D, F = md.Dim("batch", 4), md.Dim("d_model", 16), md.Dim("d_ff", 8)
W_BYTES = D.size * F.size * 4      # the whole fp32 weight [d_model, d_ff]
ROWS_BYTES = F.size * 4            # its row sums [d_ff]


def _norm(w):
    return w * md.rsqrt(md.reduce_sum(w * w, "d_model") + 1e-8)


def _collectives(steps, times: int = 1) -> list[tuple[str, str, int, int]]:
    """``(phase, kind, bytes, times it runs)`` of every collective, a loop's sub-plans' included."""
    out = []
    for s in steps:
        if s.is_collective:
            out.append((s.phase, s.kind, s.bytes, times))
        for k, sub in enumerate(s.subplans):
            out += _collectives(sub.steps, times * s.runs(k))
    return out


def _normed_weight_graph():
    with md.Graph():
        x = md.input("x", [B, D])
        w = md.param("w", [D, F], fan_out=["d_ff"])
        loss = md.reduce_sum(md.einsum("batch d_model, d_model d_ff -> batch d_ff", x, _norm(w)) ** 2)
        return {"loss": loss, **{f"grad/{k}": g for k, g in md.grad(loss, {"w": w}).items()}}


def test_a_weight_normalised_in_the_graph_is_gathered_once_under_fsdp():
    out = _normed_weight_graph()
    plan = md.compile(out, "data:2", FSDP)
    fwd = [(kind, nbytes) for phase, kind, nbytes, _ in _collectives(plan.steps) if phase == "forward"]
    # one gather of the normalised weight where the einsum reads it; the row sums allreduced (and the loss)
    assert [c for c in fwd if c[0] == "allgather"] == [("allgather", W_BYTES // 2)], fwd
    assert all(nbytes <= ROWS_BYTES for kind, nbytes in fwd if kind != "allgather"), fwd
    assert md.check(out, "data:2", FSDP, {"x": torch.randn(4, 16)}).ok


def _layers(num_layers: int, remat: str):
    """A stack of ``h + w_o(tanh(w_i h))`` blocks, both weights normalised along ``d_model``."""
    L = md.Dim("layer", num_layers)
    with md.Graph():
        x = md.input("x", [B, D])
        params = {"w_i": md.param("w_i", [L, D, F], fan_out=["layer", "d_ff"]),
                  "w_o": md.param("w_o", [L, F, D], fan_out=["layer", "d_model"])}

        def block(h, p):
            u = md.tanh(md.einsum("batch d_model, d_model d_ff -> batch d_ff", h, _norm(p["w_i"])))
            return h + md.einsum("batch d_ff, d_ff d_model -> batch d_model", u, _norm(p["w_o"]))

        y = md.repeat(block, x, params, "layer", remat=remat)
        loss = md.reduce_sum(y * y)
        return {"loss": loss, **{f"grad/{k}": g for k, g in md.grad(loss, params).items()}}


@pytest.mark.parametrize("remat", ["none", "selective", "full"])
def test_a_layer_stack_gathers_each_normalised_weight_once_per_layer(remat):
    out = _layers(2, remat)
    plan = md.compile(out, "data:2", FSDP)
    fwd = [c for c in _collectives(plan.steps) if c[0] == "forward"]
    # per layer: each of the two weights gathered once, normalised; its row sums allreduced
    assert sum(n for _, kind, _, n in fwd if kind == "allgather") == 2 * 2, fwd
    assert all(nbytes <= ROWS_BYTES for _, kind, nbytes, _ in fwd if kind == "allreduce"), fwd
    feeds = {"x": torch.randn(4, 16)}
    assert md.check(out, "data:2", FSDP, feeds).ok
    # pipelined over two stages, micro-batched: the same numbers as the dense program
    assert md.check(out, "data:2; stage:2", FSDP + "; layer:stage", feeds, microbatches=2, schedule="1f1b").ok


def test_a_weight_read_in_pieces_is_not_gathered_piece_by_piece_twice():
    """A depthwise conv's taps, read one by one from an FSDP weight [k, d_model]: offered the
    param's layout, each tap's product would stay split and be gathered again (2 gathers a tap);
    that lowering is priced against the one without the offer and dropped."""
    S, K = md.Dim("seq", 6), md.Dim("k", 3)
    with md.Graph():
        x = md.input("x", [B, S, D])
        w = md.param("w", [K, D], fan_out=["d_model"])
        y = md.conv(x, w, {"seq": "k"}, padding="same")
        loss = md.reduce_sum(y * y)
        out = {"loss": loss, "grad/w": md.grad(loss, {"w": w})["w"]}
    plan = md.compile(out, "data:2", FSDP)
    gathers = [c for c in _collectives(plan.steps) if c[1] == "allgather" and c[0] == "forward"]
    assert len(gathers) <= K.size, gathers
    assert md.check(out, "data:2", FSDP, {"x": torch.randn(4, 6, 16)}).ok
