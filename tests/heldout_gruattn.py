"""Held-out model (round 16a): a GRU encoder-decoder with Bahdanau (additive) attention.

The encoder is a stack of GRU layers (``enc=stack``: an outer ``md.repeat`` over ``layer``
whose block runs an inner ``md.repeat`` over the source time steps ``tk``) or one GRU scanned
by an outer repeat over ``tk`` (``enc=scan``). The decoder is a GRU over the target steps
``tq`` fed the previous target token (teacher forcing). Each decoder state then attends over
the encoder states with additive scores ``v . tanh(W q + U k)``, a ``[batch, tq, tk, d_att]``
intermediate, and the context and state predict the next token (cross-entropy).

Legend: b = batch, tk = source steps, tq = target steps, h = hidden, a = d_att, v = vocab.
"""
from dataclasses import dataclass

import torch

import meshdsl as md

_PARAMS: dict = {}   # name -> param of the model being built (filled by _param)


def _param(name, shape, **kw):
    _PARAMS[name] = md.param(name, shape, **kw)
    return _PARAMS[name]


@dataclass
class Config:
    batch: int = 16
    tk: int = 12
    tq: int = 10
    vocab: int = 32
    hidden: int = 64
    d_att: int = 32
    layers: int = 2
    enc: str = "stack"           # stack | scan
    remat: str = "none"          # none | full | selective (the layer stack)

    @classmethod
    def tiny(cls):
        return cls(batch=4, tk=5, tq=4, vocab=7, hidden=6, d_att=4, layers=2)


def _gru_step(h, x, w):
    """One GRU step: state h [batch, hidden], input x [batch, d_in], weights dict with 'wx'
    [d_in, gate, hidden_out], 'wh' [hidden, gate, hidden_out], 'b' [gate, hidden_out]."""
    gx = md.einsum("batch d_in, d_in gate hidden_out -> batch gate hidden_out", x, w["wx"])
    gh = md.einsum("batch hidden, hidden gate hidden_out -> batch gate hidden_out", h, w["wh"])
    gx, gh = md.rename(gx + w["b"], {"hidden_out": "hidden"}), md.rename(gh, {"hidden_out": "hidden"})

    def gate(t, i):
        return md.squeeze(md.slice_(t, "gate", i, i + 1), "gate")

    r = md.sigmoid(gate(gx, 0) + gate(gh, 0))
    z = md.sigmoid(gate(gx, 1) + gate(gh, 1))
    n = md.tanh(gate(gx, 2) + r * gate(gh, 2))
    return (1.0 - z) * n + z * h


def _gru_weights(prefix, d_in, H, G, stack=()):
    Ho = md.Dim("hidden_out", H.size)
    lead = [s.name for s in stack]
    return {"wx": _param(f"{prefix}wx", [*stack, d_in, G, Ho], fan_out=[*lead, "gate", "hidden_out"]),
            "wh": _param(f"{prefix}wh", [*stack, H, G, Ho], fan_out=[*lead, "gate", "hidden_out"]),
            "b": _param(f"{prefix}b", [*stack, G, Ho], init="zeros")}


def _encoder(cfg, x_kbh, B, H, G):
    """Encoder states [tk, batch, hidden] of the embedded source [tk, batch, hidden]."""
    h0 = md.constant(torch.zeros(B.size, H.size), [B, H])
    if cfg.enc == "scan":
        w = _gru_weights("enc_", md.Dim("d_in", H.size), H, G)

        def step(h, p):
            h = _gru_step(h, md.rename(p["x"], {"hidden": "d_in"}), w)
            return h, {"h": h}

        return md.repeat(step, h0, {"x": x_kbh}, "tk")[1]["h"]
    L = md.Dim("layer", cfg.layers)
    w = _gru_weights("enc_", md.Dim("d_in", H.size), H, G, stack=[L])
    x_bkh = md.transpose(x_kbh, ["batch", "tk", "hidden"])

    def layer(xs, p):
        def step(h, q):
            h = _gru_step(h, md.rename(q["x"], {"hidden": "d_in"}), p)
            return h, {"h": h}

        hs = md.repeat(step, h0, {"x": md.transpose(xs, ["tk", "batch", "hidden"])}, "tk")[1]["h"]
        return xs + md.transpose(hs, ["batch", "tk", "hidden"])   # a residual GRU stack

    remat = None if cfg.remat == "none" else cfg.remat
    return md.transpose(md.repeat(layer, x_bkh, w, "layer", remat=remat), ["tk", "batch", "hidden"])


def build(cfg: Config) -> md.Model:
    if cfg.enc not in ("stack", "scan"):
        raise ValueError(f"enc must be 'stack' or 'scan', not {cfg.enc!r}")
    B, TK, TQ = md.Dim("batch", cfg.batch), md.Dim("tk", cfg.tk), md.Dim("tq", cfg.tq)
    V, H, A, G = md.Dim("vocab", cfg.vocab), md.Dim("hidden", cfg.hidden), md.Dim("d_att", cfg.d_att), md.Dim("gate", 3)
    _PARAMS.clear()
    with md.Graph() as g:
        src = md.input("src", [TK, B], dtype=torch.int64)
        tgt_in = md.input("tgt_in", [TQ, B], dtype=torch.int64)      # BOS then the target, shifted
        tgt_out = md.input("tgt_out", [B, TQ], dtype=torch.int64)
        emb_src, emb_tgt = _param("emb_src", [V, H], scale=1.0), _param("emb_tgt", [V, H], scale=1.0)
        enc_kbh = _encoder(cfg, md.gather(emb_src, src, "vocab"), B, H, G)
        w_dec = _gru_weights("dec_", md.Dim("d_in", H.size), H, G)

        def dec_step(h, p):
            h = _gru_step(h, md.rename(p["x"], {"hidden": "d_in"}), w_dec)
            return h, {"h": h}

        dec_qbh = md.repeat(dec_step, md.constant(torch.zeros(B.size, H.size), [B, H]), {"x": md.gather(emb_tgt, tgt_in, "vocab")}, "tq")[1]["h"]
        w_q, w_k = _param("att_wq", [H, A], fan_out=[A]), _param("att_wk", [H, A], fan_out=[A])
        v_att = _param("att_v", [A], fan_out=[A])
        q_bqa = md.einsum("tq batch hidden, hidden d_att -> batch tq d_att", dec_qbh, w_q)
        k_bka = md.einsum("tk batch hidden, hidden d_att -> batch tk d_att", enc_kbh, w_k)
        e_bqk = md.einsum("batch tq tk d_att, d_att -> batch tq tk", md.tanh(q_bqa + k_bka), v_att)
        att = md.softmax(e_bqk, "tk")
        ctx_bqh = md.einsum("batch tq tk, tk batch hidden -> batch tq hidden", att, enc_kbh)
        w_c = _param("out_wc", [H, md.Dim("d_out", cfg.hidden)], fan_out=["d_out"])
        w_s = _param("out_ws", [H, md.Dim("d_out", cfg.hidden)], fan_out=["d_out"])
        o = md.tanh(md.einsum("batch tq hidden, hidden d_out -> batch tq d_out", ctx_bqh, w_c)
                    + md.einsum("tq batch hidden, hidden d_out -> batch tq d_out", dec_qbh, w_s))
        logits = md.einsum("batch tq d_out, d_out vocab -> batch tq vocab", o, _param("out_w", [md.Dim("d_out", cfg.hidden), V], fan_out=[V]))
        loss = md.reduce_mean(md.cross_entropy(logits, tgt_out, "vocab"))

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        tgt = torch.randint(1, cfg.vocab, (cfg.batch, cfg.tq), generator=gen)
        return {"src": torch.randint(1, cfg.vocab, (cfg.tk, cfg.batch), generator=gen),
                "tgt_in": torch.cat([torch.zeros(cfg.batch, 1, dtype=torch.int64), tgt[:, :-1]], 1).T.contiguous(),
                "tgt_out": tgt}

    return md.Model(g, loss, dict(_PARAMS), make_feeds, cfg, outputs={"attention": att})
