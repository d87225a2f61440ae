"""Plans of values computed from params alone under FSDP (``meshdsl/lowering/param_values.py``).

A weight normalised in the graph (nGPT's ``w * rsqrt(sum(w * w, d_model))``) under
``params.d_model:data`` was gathered twice: ``w * w`` for the sum, then the normalised weight.
Offered its param's layout, the chain runs split: the small row sums are allreduced and the
normalised weight gathered once, where the einsum reads it.  A weight whose pieces are read apart
(a depthwise conv's taps) is not gathered piece by piece twice: the lowering that would is priced
against the one without the offer and dropped; one foreseen gathered whole is gathered once.  The
backward's gradients of such values are offered their params' layout too: the gradient wrt a LoRA
merge or a normalised weight is reduce-scattered where it is made, not allreduced whole or
multiplied, partial, by a gathered weight.  The dense program is the oracle of every plan here.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md

FSDP = "batch:data; params.d_model:data"
B, D, F, R = md.Dim("batch", 4), md.Dim("d_model", 16), md.Dim("d_ff", 8), md.Dim("rank", 2)
W_BYTES = D.size * F.size * 4      # the whole fp32 weight [d_model, d_ff]
ROWS_BYTES = F.size * 4            # its row sums [d_ff]
B_BYTES = R.size * F.size * 4      # a LoRA factor [rank, d_ff], whole under FSDP (no d_model)


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
    # per layer: each of the two weights gathered once (the two in one buffer: lowering/coalesce.py),
    # normalised; its row sums allreduced
    assert sum(len(s.ins) * n for s, n in plan.collectives()
               if s.phase == "forward" and s.kind in ("allgather", "bucket_allgather")) == 2 * 2, fwd
    assert all(nbytes <= ROWS_BYTES for _, kind, nbytes, _ in fwd if kind == "allreduce"), fwd
    feeds = {"x": torch.randn(4, 16)}
    assert md.check(out, "data:2", FSDP, feeds).ok
    # pipelined over two stages, micro-batched: the same numbers as the dense program
    assert md.check(out, "data:2; stage:2", FSDP + "; layer:stage", feeds, microbatches=2, schedule="1f1b").ok


def _backward(plan) -> list[tuple[str, int]]:
    return [(kind, nbytes) for phase, kind, nbytes, _ in _collectives(plan.steps) if phase == "backward"]


def test_a_normalised_weights_gradient_is_reduce_scattered_before_the_norms_backward():
    """The gradient wrt ``w / ||w||``, partial over the split batch, was passed on to the norm's
    backward, which gathered ``w`` to multiply it (and reduce-scattered ``w``'s gradient after):
    reduce-scattered first, the backward runs on ``w``'s split, its [d_ff] row sums allreduced."""
    out = _normed_weight_graph()
    plan = md.compile(out, "data:2", FSDP)
    assert sorted(_backward(plan)) == [("allreduce", ROWS_BYTES), ("reduce_scatter", W_BYTES)], _backward(plan)
    assert md.check(out, "data:2", FSDP, {"x": torch.randn(4, 16)}).ok


def _lora_graph():
    with md.Graph():
        x = md.input("x", [B, D])
        w, a, b = md.param("w", [D, F]), md.param("a", [D, R]), md.param("b", [R, F])
        merged = w + md.einsum("d_model rank, rank d_ff -> d_model d_ff", a, b)
        loss = md.reduce_sum(md.einsum("batch d_model, d_model d_ff -> batch d_ff", x, merged) ** 2)
        return {"loss": loss, **{f"grad/{k}": g for k, g in md.grad(loss, {"w": w, "a": a, "b": b}).items()}}


def test_a_lora_merges_gradient_is_reduce_scattered_not_allreduced_whole():
    """``w + a @ b`` under FSDP: its gradient was allreduced whole, though ``w``'s and ``a``'s
    gradients are split anyway; reduce-scattered, only ``b``'s small gradient is allreduced."""
    out = _lora_graph()
    plan = md.compile(out, "data:2", FSDP)
    assert sorted(_backward(plan)) == [("allreduce", B_BYTES), ("reduce_scatter", W_BYTES)], _backward(plan)
    feeds = {"x": torch.randn(4, 16)}
    assert md.check(out, "data:2", FSDP, feeds).ok
    # two data ranks times two model ranks (the merge's d_ff split as well): the same numbers
    assert md.check(out, "data:2; model:2", FSDP + "; d_ff:model", feeds).ok


def test_a_normalised_head_outside_a_pipelined_stack_matches_the_dense_program():
    """A normalised unembedding read after a rematerialised stack: its gradient chain is offered
    the param's layout at the top level (reduce-scattered, its row sums allreduced, not multiplied
    by a gathered ``head``); pipelined, micro-batched, the micro-batches' partial sums keep it
    whole until they are added up.  The same numbers as the dense program either way."""
    L, V = md.Dim("layer", 2), md.Dim("vocab", 8)
    with md.Graph():
        x = md.input("x", [B, D])
        params = {"w_i": md.param("w_i", [L, D, F], fan_out=["layer", "d_ff"]),
                  "w_o": md.param("w_o", [L, F, D], fan_out=["layer", "d_model"])}
        head = md.param("head", [D, V])

        def block(h, p):
            u = md.tanh(md.einsum("batch d_model, d_model d_ff -> batch d_ff", h, p["w_i"]))
            return h + md.einsum("batch d_ff, d_ff d_model -> batch d_model", u, p["w_o"])

        y = md.repeat(block, x, params, "layer", remat="full")
        logits = md.einsum("batch d_model, d_model vocab -> batch vocab", y, _norm(head))
        loss = md.reduce_sum(logits * logits)
        out = {"loss": loss, **{f"grad/{k}": g for k, g in md.grad(loss, {**params, "head": head}).items()}}
    feeds = {"x": torch.randn(4, 16)}
    assert md.check(out, "data:2", FSDP, feeds).ok
    assert md.check(out, "data:2; stage:2", FSDP + "; layer:stage", feeds, microbatches=2, schedule="1f1b").ok


def test_a_weight_read_in_pieces_is_not_gathered_piece_by_piece_twice():
    """A depthwise conv's taps, read one by one from an FSDP weight [k, d_model]: offered the
    param's layout, each tap's product would stay split and be gathered again (2 gathers a tap);
    that lowering is priced against the one without the offer and dropped.  Each tap gathered on
    its own (3 collectives) is foreseen as the weight gathered once, where the taps read it."""
    S, K = md.Dim("seq", 6), md.Dim("k", 3)
    with md.Graph():
        x = md.input("x", [B, S, D])
        w = md.param("w", [K, D], fan_out=["d_model"])
        y = md.conv(x, w, {"seq": "k"}, padding="same")
        loss = md.reduce_sum(y * y)
        out = {"loss": loss, "grad/w": md.grad(loss, {"w": w})["w"]}
    plan = md.compile(out, "data:2", FSDP)
    gathers = [(kind, nbytes) for phase, kind, nbytes, _ in _collectives(plan.steps)
               if kind == "allgather" and phase == "forward"]
    # the weight gathered once (each rank's half sent), not tap by tap
    assert gathers == [("allgather", K.size * D.size * 4 // 2)], gathers
    assert md.check(out, "data:2", FSDP, {"x": torch.randn(4, 6, 16)}).ok
