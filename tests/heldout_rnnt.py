"""Held-out model (round 16a): the RNN-T (transducer) loss, written from the docs alone.

An encoder (a projection and residual layers under ``md.repeat`` over ``layer``) maps acoustic
frames to ``[batch, t, d_joint]``; a prediction network embeds blank-then-labels ``[batch, u]``
(``u = U + 1``) and mixes each with its predecessor (``md.shift``); the joint network gives
``log_softmax(W tanh(enc + pred))`` ``[batch, t, u, vocab]``. The forward variable over the
``(t, u)`` lattice, in log space,
``alpha[t, u] = logaddexp(alpha[t-1, u] + blank[t-1, u], alpha[t, u-1] + label[t, u-1])``,
is an outer ``md.repeat`` over ``t`` carrying ``alpha[t-1] + blank[t-1]``; along ``u`` each
row is either a closed form (``alpha=cumsum``: with ``C`` the exclusive cumulative sum of the
label log-probs, ``alpha[t, u] = C[u] + logsumexp_{u' <= u}(above[u'] - C[u'])``, a masked
logsumexp over ``[u, u_from]``) or an inner ``md.repeat`` over ``u`` (``alpha=scan``). The loss
is the negative log-likelihood ``-(alpha[T-1, U] + blank[T-1, U])``, averaged over the batch.

Legend: b = batch, t = frames, u = label positions + 1, v = vocab (0 is blank), j = d_joint.
"""
from dataclasses import dataclass

import torch

import meshdsl as md

NEG = -1e4     # log 0 that stays finite (exp underflows to 0, no inf - inf)


@dataclass
class Config:
    batch: int = 8
    t: int = 12
    labels: int = 6              # U
    vocab: int = 16
    d_feat: int = 16
    d_joint: int = 32
    layers: int = 2
    alpha: str = "cumsum"        # cumsum | scan
    remat: str = "none"          # none | full | selective (the layer stack)

    @classmethod
    def tiny(cls):
        return cls(batch=3, t=6, labels=4, vocab=5, d_feat=4, d_joint=6, layers=2)


class _Params(dict):
    def __call__(self, name, shape, **kw):
        self[name] = md.param(name, shape, **kw)
        return self[name]


def _logaddexp(a, b):
    m = md.stop_gradient(md.maximum(a, b))
    return m + md.log(md.exp(a - m) + md.exp(b - m))


def _row_cumsum(above_bu, lab_bu, U):
    """alpha[t, :] from above[u] = alpha[t-1, u] + blank[t-1, u] and lab[u] = label[t, u]."""
    c = md.cumsum(lab_bu, "u") - lab_bu                        # exclusive: sum_{k < u} label[t, k]
    Uf = md.Dim("u_from", U.size)
    src = md.rename(above_bu - c, {"u": "u_from"})
    keep = md.greater_equal(md.arange(U), md.arange(Uf))       # [u, u_from]: u_from <= u
    return c + md.logsumexp(md.where(keep, src, NEG), "u_from")


def _row_scan(above_bu, lab_bu, B):
    """alpha[t, :] by an inner repeat over u, carrying alpha[t, u-1] [batch]."""
    prev_lab = md.shift(lab_bu, "u", 1)                        # label[t, u-1], 0 at u = 0
    first = md.equal(md.arange(above_bu.shape["u"]), 0)
    into = md.where(first, NEG, prev_lab)                      # no move into u = 0 from the left

    def step(left_b, p):
        a = _logaddexp(p["above"], left_b + p["into"])
        return a, {"alpha": a}

    stacked = {"above": md.transpose(above_bu, ["u", "batch"]), "into": md.transpose(into, ["u", "batch"])}
    left0 = md.constant(torch.full((B.size,), NEG), [B])
    return md.transpose(md.repeat(step, left0, stacked, "u")[1]["alpha"], ["batch", "u"])


def build(cfg: Config) -> md.Model:
    if cfg.alpha not in ("cumsum", "scan"):
        raise ValueError(f"alpha must be 'cumsum' or 'scan', not {cfg.alpha!r}")
    B, T, U = md.Dim("batch", cfg.batch), md.Dim("t", cfg.t), md.Dim("u", cfg.labels + 1)
    V, F, J, L = md.Dim("vocab", cfg.vocab), md.Dim("d_feat", cfg.d_feat), md.Dim("d_joint", cfg.d_joint), md.Dim("layer", cfg.layers)
    P = _Params()
    with md.Graph() as g:
        frames = md.input("frames", [B, T, F])
        pred_in = md.input("pred_in", [B, U], dtype=torch.int64)    # blank (0), then the labels
        targets = md.input("targets", [B, U], dtype=torch.int64)    # the labels, then a pad (0)
        enc = md.einsum("batch t d_feat, d_feat d_joint -> batch t d_joint", frames, P("enc_in", [F, J], fan_out=["d_joint"]))

        def enc_layer(h, p):
            y = md.einsum("batch t d_joint, d_joint d_ff -> batch t d_ff", h, p["w1"])
            return h + md.einsum("batch t d_ff, d_ff d_joint -> batch t d_joint", md.gelu(y), p["w2"])

        Dff = md.Dim("d_ff", 2 * cfg.d_joint)
        enc = md.repeat(enc_layer, enc, {"w1": P("enc_w1", [L, J, Dff], fan_out=["layer", "d_ff"]),
                                         "w2": P("enc_w2", [L, Dff, J], fan_out=["layer", "d_joint"])}, "layer",
                        remat=None if cfg.remat == "none" else cfg.remat)
        emb = md.gather(P("pred_emb", [V, J], scale=1.0), pred_in, "vocab")        # [batch, u, d_joint]
        pred = md.tanh(emb + md.shift(emb, "u", 1) * P("pred_mix", [J], init=0.5))
        joint = md.tanh(enc + pred)                                                 # [batch, t, d_joint, u]
        logits = md.einsum("batch t u d_joint, d_joint vocab -> batch t u vocab", joint, P("joint_out", [J, V], fan_out=["vocab"]))
        lp = md.log_softmax(logits, "vocab")
        blank = md.squeeze(md.slice_(lp, "vocab", 0, 1), "vocab")                  # [batch, t, u]
        label = md.reduce_sum(lp * md.one_hot(targets, V), "vocab")                 # [batch, t, u]
        above0 = md.where(md.equal(md.arange(U), 0), 0.0, md.constant(torch.full((cfg.batch, cfg.labels + 1), NEG), [B, U]))

        def frame(above, p):
            row = _row_cumsum(above, p["label"], U) if cfg.alpha == "cumsum" else _row_scan(above, p["label"], B)
            return row + p["blank"]

        last = md.repeat(frame, above0, {"label": md.transpose(label, ["t", "batch", "u"]),
                                         "blank": md.transpose(blank, ["t", "batch", "u"])}, "t")
        loglik = md.squeeze(md.slice_(last, "u", cfg.labels, cfg.labels + 1), "u")
        loss = -md.reduce_mean(loglik)

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        lab = torch.randint(1, cfg.vocab, (cfg.batch, cfg.labels), generator=gen)
        zero = torch.zeros(cfg.batch, 1, dtype=torch.int64)
        return {"frames": torch.randn(cfg.batch, cfg.t, cfg.d_feat, generator=gen),
                "pred_in": torch.cat([zero, lab], 1), "targets": torch.cat([lab, zero], 1)}

    return md.Model(g, loss, dict(P), make_feeds, cfg, outputs={"loglik": loglik, "log_probs": lp})
