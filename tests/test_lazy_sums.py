"""Lazy partial sums (:mod:`meshdsl.lowering.generic`): partial values are added
locally and reduced once, forward and backward.

Dims (legend for tensor names): b batch, s seq, k key_seq, d d_model, h heads,
e d_head, f d_ff, v vocab, i d_in.
"""
from __future__ import annotations

import torch

import meshdsl as md
from meshdsl import Model

B, S, D = md.Dim("batch", 4), md.Dim("seq", 4), md.Dim("d_model", 8)
H, E, F, V = md.Dim("heads", 2), md.Dim("d_head", 4), md.Dim("d_ff", 8), md.Dim("vocab", 16)
# The counts below are per gradient, so the plans are compiled without gradient buckets (bucket_mb=0).
TP = ("model:2", "heads:model; d_ff:model")  # Megatron: q/k/v/w_fc split, wo/w_proj row-parallel

PROJ = "batch seq d_model, d_model heads d_head -> batch seq heads d_head"
SCORES = "batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq"
MIX = "batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head"
OUT = "batch seq heads d_head, heads d_head d_model -> batch seq d_model"


def _bert_block(x_bsd, p):
    """A post-norm BERT block: the attention input feeds q, k, v and the residual."""
    q_bshe = md.einsum(PROJ, x_bsd, p["wq"])
    k_bkhe = md.rename(md.einsum(PROJ, x_bsd, p["wk"]), seq="key_seq")
    v_bkhe = md.rename(md.einsum(PROJ, x_bsd, p["wv"]), seq="key_seq")
    att_bhsk = md.softmax(md.einsum(SCORES, q_bshe, k_bkhe) * (E.size ** -0.5), "key_seq")
    a_bsd = md.einsum(OUT, md.einsum(MIX, att_bhsk, v_bkhe), p["wo"])
    x_bsd = md.layer_norm(x_bsd + a_bsd, "d_model", p["ln1"], p["ln1_b"])
    u_bsf = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", x_bsd, p["w_fc"]))
    m_bsd = md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u_bsf, p["w_proj"])
    return md.layer_norm(x_bsd + m_bsd, "d_model", p["ln2"], p["ln2_b"])


def _bert(num_layers: int, stacked: bool) -> Model:
    """Token embedding, ``num_layers`` post-norm blocks (unrolled, or one ``md.repeat``) and a
    linear loss against a random target; the embedding is a param, so every block's input
    has a gradient."""
    shapes = {"wq": [D, H, E], "wk": [D, H, E], "wv": [D, H, E], "wo": [H, E, D], "w_fc": [D, F],
              "w_proj": [F, D], "ln1": [D], "ln1_b": [D], "ln2": [D], "ln2_b": [D]}
    init = {"ln1": "ones", "ln2": "ones", "ln1_b": "zeros", "ln2_b": "zeros"}
    with md.Graph("bert") as g:
        ids_bs = md.input("ids", [B, S], torch.int64)
        target_bsd = md.input("target", [B, S, D])
        wte_vd = md.param("wte", [V, D], scale=0.5)
        x_bsd = md.gather(wte_vd, ids_bs, "vocab")
        params = {"wte": wte_vd}
        if stacked:
            L = md.Dim("layer", num_layers)
            blocks = {k: md.param(k, [L, *shape], init=init.get(k, "normal")) for k, shape in shapes.items()}
            params.update(blocks)
            x_bsd = md.repeat(_bert_block, x_bsd, blocks, L)
        else:
            for layer in range(num_layers):
                blocks = {k: md.param(f"{k}_{layer}", shape, init=init.get(k, "normal"))
                          for k, shape in shapes.items()}
                params.update({f"{k}_{layer}": t for k, t in blocks.items()})
                x_bsd = _bert_block(x_bsd, blocks)
        loss = md.reduce_mean(x_bsd * target_bsd)

    def feeds(seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        return {"ids": torch.randint(0, V.size, (B.size, S.size), generator=gen),
                "target": torch.randn(B.size, S.size, D.size, generator=gen)}

    return Model(g, loss, params, feeds)


def _allreduces(plan, phase):
    return sum(m for s, m in plan.collectives() if s.kind == "allreduce" and s.phase == phase)


def _check_against_dense(outs, plan, feeds):
    ref = md.run_dense(outs, feeds)
    got = md.run_simulated(plan, feeds)
    for k in ref:
        # fp32 values of O(1); the shards sum in another order than the dense program.
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-5, msg=k)


def _two_branches():
    """``h + a + b``: h feeds two Megatron-split MLP branches a and b and the sum."""
    I = md.Dim("d_in", 8)
    with md.Graph():
        x_bi = md.input("x", [B, I])
        w0 = md.param("w0", [I, D])
        h_bd = md.einsum("batch d_in, d_in d_model -> batch d_model", x_bi, w0)
        params = {"w0": w0}
        branches = []
        for br in "ab":
            w1, w2 = md.param(f"{br}1", [D, F]), md.param(f"{br}2", [F, D])
            params.update({f"{br}1": w1, f"{br}2": w2})
            u_bf = md.relu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", h_bd, w1))
            branches.append(md.einsum("batch d_ff, d_ff d_model -> batch d_model", u_bf, w2))
        y_bd = h_bd + branches[0] + branches[1]
        loss = md.reduce_mean(y_bd * y_bd)
        grads = md.grad(loss, params)
    return {"loss": loss, **{f"grad/{k}": g for k, g in grads.items()}}


def test_two_split_branches_are_reduced_once_each_way():
    outs = _two_branches()
    plan = md.compile(outs, "model:2", "d_ff:model", bucket_mb=0)
    # Forward: a and b are partial over 'model'; h + a stays partial (h counted once), + b
    # adds locally, and the square needs the whole sum: one allreduce.  Backward: dh is
    # the sum of the residual's whole cotangent and the two branches' partial ones.
    assert _allreduces(plan, "forward") == 1
    assert _allreduces(plan, "backward") == 1
    assert plan.totals().keys() == {"allreduce"}
    _check_against_dense(outs, plan, {"x": torch.randn(B.size, 8, generator=torch.Generator().manual_seed(0))})


def test_post_norm_bert_two_allreduces_per_layer_each_way():
    model = _bert(2, stacked=False)
    outs = model.train_step(0.1)
    plan = md.compile(outs, *TP, bucket_mb=0)
    # Per layer, forward: the attention output and the MLP output (row-parallel, partial).
    # Backward: the block input's cotangent (q, k, v partial + the residual, added first)
    # and the MLP input's (w_fc partial + the residual).  The embedding reads a whole one.
    assert _allreduces(plan, "forward") == 2 * 2
    assert _allreduces(plan, "backward") == 2 * 2
    assert plan.totals()["allreduce"]["count"] == 8 and len(plan.totals()) == 1
    _check_against_dense(outs, plan, model.feeds(0))


def test_post_norm_bert_in_a_repeat_and_with_data_parallelism():
    model = _bert(3, stacked=True)
    outs = model.train_step(0.1)
    plan = md.compile(outs, "data:2; model:2", "batch:data; heads:model; d_ff:model", bucket_mb=0)
    on_model = {k: v["count"] for (k, axes), v in plan.totals_by_axis().items() if axes == ("model",)}
    assert on_model == {"allreduce": 3 * 4}  # per layer: 2 forward + 2 backward, counted per loop trip
    assert all(s.axes in (("model",), ("data",)) for s, _ in plan.collectives())
    _check_against_dense(outs, plan, model.feeds(1))


def test_a_partial_sum_with_two_readers_is_reduced_once():
    """Were ``a`` kept lazy in ``h + a``, both ``a`` (for relu) and the sum would need a reduction."""
    with md.Graph():
        x_bd = md.input("x", [B, D])
        w1, w2 = md.param("w1", [D, F]), md.param("w2", [F, D])
        a_bd = md.einsum("batch d_ff, d_ff d_model -> batch d_model", md.einsum(
            "batch d_model, d_model d_ff -> batch d_ff", x_bd, w1), w2)
        y_bd = (x_bd + a_bd) * md.relu(a_bd)
        outs = {"y": y_bd}
    plan = md.compile(outs, "model:2", "d_ff:model", bucket_mb=0)
    assert plan.totals()["allreduce"]["count"] == 1
    _check_against_dense(outs, plan, {"x": torch.randn(B.size, D.size, generator=torch.Generator().manual_seed(2))})


def test_a_broadcasting_add_reduces_the_smaller_partial_input():
    """The cost model chooses: a partial [batch] added to a whole [batch, d_model] is reduced
    before the add (4 floats), not after it (32 floats)."""
    with md.Graph():
        x_bd = md.input("x", [B, D])
        w = md.param("w", [D])
        s_b = md.einsum("batch d_model, d_model -> batch", x_bd, w)
        outs = {"y": md.exp(x_bd + s_b)}
    plan = md.compile(outs, "model:2", "w.d_model:model", bucket_mb=0)
    (red,) = [s for s, _ in plan.collectives() if s.kind == "allreduce"]
    assert red.bytes == B.size * 4
    _check_against_dense(outs, plan, {"x": torch.randn(B.size, D.size, generator=torch.Generator().manual_seed(3))})


def test_routed_moe_moves_only_tokens_and_gradients():
    """Top-2 MoE under expert parallelism: per layer 2 alltoalls forward (dispatch, combine) and
    2 backward; one allreduce of the loss (the balance loss's mean over groups is a lazy
    partial sum folded into it) and one per replicated param's gradient.  The gate moves
    nothing: its ``gate_experts`` dim is never laid out."""
    m = md.load_model("moe", tiny=True, layers=4)
    plan = md.compile(m.train_step(), "data:2", "batch:data; experts:data", bucket_mb=0)
    replicated = [k for k in m.params if k not in ("w_in", "w_out")]  # the experts' weights are split
    assert len(replicated) == 14
    assert {k: v["count"] for k, v in plan.totals().items()} == {"alltoall": 4 * 4, "allreduce": 1 + 14}
    for s, _ in plan.collectives():
        if s.kind == "alltoall":
            assert s.op == "rename"
        else:
            assert s.phase == "backward" and s.op == "stop_gradient" or s.phase == "forward" and s.bytes == 4


def _feature_map_grads(feats: int):
    """A feature map ``relu(q . proj)`` (proj a constant [d_head, feats]) read by a product
    whose other operand is split over ``e2``: the feature map's gradient arrives partial over
    ``model``, and ``dq`` (read by both weight and input gradients) is the first whole value."""
    M, E2, Q = md.Dim("feats", feats), md.Dim("e2", 4), md.Dim("d_head", 4)
    with md.Graph():
        x_bsd = md.input("x", [B, S, D])
        wq = md.param("wq", [D, Q], fan_out=[Q])
        proj = md.constant(torch.randn(Q.size, M.size, generator=torch.Generator().manual_seed(5)), [Q, M])
        st = md.param("st", [B, M, E2])
        q_bse = md.einsum("batch seq d_model, d_model d_head -> batch seq d_head", x_bsd, wq)
        f_bsm = md.relu(md.einsum("batch seq d_head, d_head feats -> batch seq feats", q_bse, proj))
        num = md.einsum("batch seq feats, batch feats e2 -> batch seq e2", f_bsm, st)
        loss = md.reduce_sum(num * num)
        grads = md.grad(loss, {"wq": wq, "x": x_bsd, "st": st})
    return {"loss": loss, **{f"grad/{k}": g for k, g in grads.items()}}


def test_an_einsum_passes_a_partial_operand_on_when_its_result_is_smaller():
    """The einsum ``dq = df . proj`` is linear in ``df``: the cost model reduces the smaller of
    ``df`` [batch, seq, feats=6] and ``dq`` [batch, seq, d_head=4]; it reduced ``df`` always."""
    feeds = {"x": torch.randn(B.size, S.size, D.size, generator=torch.Generator().manual_seed(6))}
    for feats, reduced in ((6, "d_head"), (2, "feats")):
        outs = _feature_map_grads(feats)
        plan = md.compile(outs, "model:2", "e2:model", bucket_mb=0)
        (red,) = [s for s, _ in plan.collectives() if s.phase == "backward"]
        size = {"d_head": 4, "feats": feats}[reduced]
        assert (red.kind, red.bytes) == ("allreduce", B.size * S.size * size * 4), (feats, red)
        _check_against_dense(outs, plan, feeds)


def _performer_backward_reductions(feature: str, check: bool = True):
    """The held-out Performer (tests/heldout_performer.py, tiny, one layer) under ``e2:model`` on
    2 ranks: each backward allreduce as (op, bytes); with ``check``, the gradients checked
    against the dense program."""
    from pathlib import Path
    model = md.load_model(str(Path(__file__).parent / "heldout_performer.py"), tiny=True, feature=feature,
                          layers=1)
    outs = {"loss": model.loss, **{f"grad/{k}": g for k, g in md.grad(model.loss, model.params).items()}}
    plan = md.compile(outs, "model:2", "e2:model", bucket_mb=0)
    if check:
        _check_against_dense(outs, plan, model.feeds(0))
    return sorted((s.op, s.bytes) for s, _ in plan.collectives()
                  if s.phase == "backward" and s.kind == "allreduce" and s.op != "stop_gradient")


def test_performer_feature_maps_pass_their_partial_sums_through():
    """phi(q) under ``e2:model``: its gradient arrives partial (the state's ``e2`` is split).
    With relu it passed through to the layer norm's backward, the one reduction; elu + 1
    (``where(y > 0, y + 1, exp(y))``, whose gradient is read by both of where's gradients, each
    linear in it) and FAVOR+ (``exp(w . x - |x|^2 / 2)``, the row sum's gradient broadcast back
    over ``d_head``) reduced early: 3 more allreduces (3.25 KiB) and 2 more (512 B).  The three
    now reduce the same one value."""
    want = _performer_backward_reductions("relu", check=False)   # (round 9b runs it against dense)
    assert [op for op, _ in want] == ["layer_norm_backward"]
    assert _performer_backward_reductions("elu") == want
    assert _performer_backward_reductions("favor") == want


def test_a_normalised_params_gradient_reaches_the_bucket():
    """A param normalised before use (SwAV's prototypes, ``w * rsqrt(sum(w * w))``) under a split
    batch: the gradient wrt the normalised tensor, partial over ``data``, is read twice by the
    normalisation's backward, both paths linear and ending in the param's gradient. It passes on
    to both (:mod:`meshdsl.lowering.lazy_grads`), so the gradient is reduced in the bucket with
    the bias's, as a plain param's is: one collective, not an allreduce of its own besides."""
    ex, e, p = md.Dim("ex", 8), md.Dim("emb", 6), md.Dim("proto", 5)
    with md.Graph():
        x = md.input("x", [ex, e])
        w = md.param("w", [e, p], fan_out=["proto"])
        b = md.param("b", [p], init="zeros")
        c = w * md.rsqrt(md.reduce_sum(w * w, "emb"))
        loss = md.reduce_mean(md.square(md.einsum("ex emb, emb proto -> ex proto", x, c) + b))
        outs = {"loss": loss, **md.grad(loss, {"w": w, "b": b})}
    plan = md.compile(outs, "data:2", "ex:data")
    _check_against_dense(outs, plan, {"x": torch.randn(8, 6, generator=torch.Generator().manual_seed(0))})
    assert [(s.kind, s.phase) for s, _ in plan.collectives()] == [("allreduce", "forward"),
                                                                  ("bucket_allreduce", "backward")]
