"""An xLSTM language model of mLSTM blocks, written from the README and docs/ alone (a held-out model).

Tokens ``[batch, seq]``, embedded by ``md.gather``; blocks under ``md.repeat`` over ``layer``. An
mLSTM block (pre-norm, residual): queries, keys and values per head, a scalar input gate
``i~`` and forget gate ``f~`` per head and position, and the matrix-memory recurrence
``C_t = f_t C_{t-1} + i_t v_t k_t^T``, ``n_t = f_t n_{t-1} + i_t k_t``,
``h_t = C_t q_t / max(|n_t . q_t|, 1)`` with an exponential input gate ``i_t = exp(i~_t)`` and a
sigmoid forget gate, stabilised. It is written in the parallel (quadratic) form: with
``F_t = sum_{r<=t} log sigmoid(f~_r)`` (``md.cumsum`` over ``seq``), the decay matrix is
``log D[t, s] = F_t - F_s + i~_s`` for ``s <= t`` (causal, ``-inf`` above), stabilised by its
row max ``m_t``; ``S = (q . k / sqrt(dh)) * exp(log D - m)``, ``h = S v / max(|sum_s S|, exp(-m))``.
``form="recurrent"`` runs the recurrence itself instead, one step per entry of ``seq`` in a
``md.repeat`` nested in the block (as ``tests/heldout_lstm.py`` does), the state ``C``, ``n`` and
the stabiliser ``m_t = max(log f_t + m_{t-1}, i~_t)`` (``m_0 = -inf``) side by side along ``cv``
in one carry; it computes the same numbers. An output gate (sigmoid of a projection) and the
output projection follow. Head: LayerNorm, a
tied-free LM head, next-token cross entropy.

Legend: batch, seq, key_seq, d (width), heads, dh (head width), dv (a value's width in the
memory), cv (the carry's columns: dv of C, then n, then m), vocab.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    seq: int = 64
    d: int = 64
    heads: int = 4
    dh: int = 16
    vocab: int = 64
    layers: int = 2
    form: str = "parallel"      # or "recurrent": the recurrence itself, a repeat over seq
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, seq=8, d=8, heads=2, dh=4, vocab=12, layers=2)


def mlstm(q: md.Tensor, k: md.Tensor, v: md.Tensor, ig: md.Tensor, fg: md.Tensor, dh: int) -> md.Tensor:
    """The mLSTM's parallel form: q, k, v ``[batch, seq, heads, dh]``, the gates' preactivations
    ``[batch, seq, heads]``; returns ``[batch, seq, heads, dh]``."""
    seq, kseq = q.shape["seq"], md.Dim("key_seq", q.shape["seq"].size)
    logf = -md.softplus(-fg)                                                  # log sigmoid(f~)
    cum = md.cumsum(logf, "seq")                                              # F_t
    log_d = cum - md.rename(cum - ig, seq="key_seq")                        # [batch, seq, heads, key_seq]
    log_d = md.where(md.causal_mask(seq, kseq), log_d, -1e30)
    m = md.reduce_max(log_d, "key_seq")                                      # [batch, seq, heads]
    decay = md.exp(log_d - m)
    s = md.einsum("batch seq heads dh, batch key_seq heads dh -> batch seq heads key_seq", q,
                  md.rename(k, seq="key_seq")) * dh ** -0.5 * decay
    norm = md.maximum(md.abs(md.reduce_sum(s, "key_seq")), md.exp(-m))
    h = md.einsum("batch seq heads key_seq, batch key_seq heads dh -> batch seq heads dh", s,
                  md.rename(v, seq="key_seq"))
    return h / norm


def mlstm_recurrent(q: md.Tensor, k: md.Tensor, v: md.Tensor, ig: md.Tensor, fg: md.Tensor, dh: int) -> md.Tensor:
    """The mLSTM's recurrence, a repeat over ``seq``: the same inputs and result as :func:`mlstm`."""
    b, heads, dhd = q.shape["batch"], q.shape["heads"], q.shape["dh"]
    cv = md.Dim("cv", dh + 2)
    m_col = md.equal(md.arange(cv), dh + 1)
    carry0 = md.broadcast_to(md.where(m_col, -1e30, 0.0), [b, heads, dhd, cv])   # C = 0, n = 0, m = -inf
    steps = {"q": q, "k": k * dh ** -0.5, "v": md.rename(v, dh="dv"), "ig": ig, "logf": -md.softplus(-fg)}

    def step(carry: md.Tensor, x: dict):
        c = md.rename(md.slice_(carry, "cv", 0, dh), cv="dv")                  # [batch, heads, dh, dv]
        n = md.squeeze(md.slice_(carry, "cv", dh, dh + 1), "cv")               # [batch, heads, dh]
        m_prev = md.squeeze(md.squeeze(md.slice_(md.slice_(carry, "cv", dh + 1, dh + 2), "dh", 0, 1), "cv"), "dh")
        m = md.maximum(x["logf"] + m_prev, x["ig"])                             # [batch, heads]
        i_, f_ = md.exp(x["ig"] - m), md.exp(x["logf"] + m_prev - m)
        c = f_ * c + i_ * md.einsum("batch heads dh, batch heads dv -> batch heads dh dv", x["k"], x["v"])
        n = f_ * n + i_ * x["k"]
        num = md.einsum("batch heads dh dv, batch heads dh -> batch heads dv", c, x["q"])
        den = md.maximum(md.abs(md.reduce_sum(n * x["q"], "dh")), md.exp(-m))
        carry = md.concat([md.rename(c, dv="cv"), md.unsqueeze(n, "cv"),
                           md.unsqueeze(md.broadcast_to(m, [b, heads, dhd]), "cv")], "cv")
        return carry, {"h": md.rename(num / den, dv="dh")}

    _, out = md.repeat(step, carry0, steps, "seq")
    return md.transpose(out["h"], ["batch", "seq", "heads", "dh"])


def build(cfg: Config = Config()) -> md.Model:
    batch, seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    d, heads, dh = md.Dim("d", cfg.d), md.Dim("heads", cfg.heads), md.Dim("dh", cfg.dh)
    vocab, layer = md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    fo = ["layer", "heads", "dh"]
    with md.Graph("heldout_xlstm") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        p = {"embed": md.param("embed", [vocab, d], scale=1.0),
             "lnf": md.param("lnf", [d], init="ones"),
             "lm_head": md.param("lm_head", [d, md.Dim("out", cfg.vocab)], fan_out=["out"])}
        st = {"ln": md.param("ln", [layer, d], init="ones"),
              "wq": md.param("wq", [layer, d, heads, dh], fan_out=fo),
              "wk": md.param("wk", [layer, d, heads, dh], fan_out=fo),
              "wv": md.param("wv", [layer, d, heads, dh], fan_out=fo),
              "wo_gate": md.param("wo_gate", [layer, d, heads, dh], fan_out=fo),
              "wi": md.param("wi", [layer, d, heads], fan_out=["layer", "heads"]),
              "wf": md.param("wf", [layer, d, heads], fan_out=["layer", "heads"]),
              "bf": md.param("bf", [layer, heads], init=3.0),
              "wout": md.param("wout", [layer, heads, dh, d], fan_out=["layer", "d"])}

        def block(x: md.Tensor, q: dict) -> md.Tensor:                     # x [batch, seq, d]
            h = md.layer_norm(x, "d", q["ln"])
            proj = {n: md.einsum("batch seq d, d heads dh -> batch seq heads dh", h, q[w])
                    for n, w in (("q", "wq"), ("k", "wk"), ("v", "wv"), ("o", "wo_gate"))}
            ig = md.einsum("batch seq d, d heads -> batch seq heads", h, q["wi"])
            fg = md.einsum("batch seq d, d heads -> batch seq heads", h, q["wf"]) + q["bf"]
            cell = mlstm if cfg.form == "parallel" else mlstm_recurrent
            y = cell(proj["q"], proj["k"], proj["v"], ig, fg, cfg.dh) * md.sigmoid(proj["o"])
            return x + md.einsum("batch seq heads dh, heads dh d -> batch seq d", y, q["wout"])

        x = md.gather(p["embed"], ids, "vocab")
        x = md.repeat(block, x, st, "layer", remat=cfg.remat)
        logits = md.einsum("batch seq d, d out -> batch seq out", md.layer_norm(x, "d", p["lnf"]), p["lm_head"])
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "out"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, cfg.vocab, (cfg.batch, 1), generator=gen)
        step = torch.randint(1, 4, (cfg.batch, 1), generator=gen)
        toks = (start + step * torch.arange(cfg.seq + 1)) % cfg.vocab
        return {"ids": toks[:, :-1], "labels": toks[:, 1:]}

    return md.Model(g, loss, {**p, **st}, feeds, cfg, logits=logits)
