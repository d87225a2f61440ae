"""Held-out model (round 20b): a Hierarchical Attention Network document classifier.

Written from the user docs alone. Documents are token ids ``[batch, sents, words]``. Each word is
embedded, a bidirectional GRU runs over the words of each sentence (two ``md.repeat`` over
``words``, nested in a one-layer block so a split ``words`` stays split around them; the backward
direction reads the words reversed by an anti-diagonal one-hot einsum), and attention pooling
(``u = tanh(W h + b)``, a learned context vector, softmax over ``words``) makes one vector per
sentence. A sentence-level attention pooling over ``sents`` makes one vector per document, and a
linear classifier ends in the cross-entropy over ``classes``.

Legend: b batch, s sents, w words, e d_emb, g hidden (per direction), d d_sent (= 2 hidden),
a d_att, c classes.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    batch: int = 8
    sents: int = 4
    words: int = 6
    d_emb: int = 16
    hidden: int = 8
    d_att: int = 16
    classes: int = 5

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, batch=4, sents=3, words=4, d_emb=4, hidden=3, d_att=4, classes=3)


def _reverse(x, dim):
    """x reversed along dim (no flip op: an anti-diagonal one-hot matrix)."""
    d = x.shape[dim]
    rev = md.Dim(f"{dim}_rev", d.size)
    anti = md.cast(md.equal(md.arange(d) + md.arange(rev), d.size - 1), torch.float32)
    names = " ".join(x.shape.names)
    out = md.einsum(f"{names}, {dim} {dim}_rev -> {names.replace(dim, dim + '_rev')}", x, anti)
    return md.rename(out, {f"{dim}_rev": dim})


def _gru_params(prefix, d_in, g):
    g_in = md.Dim("hidden_in", g.size)
    return {**{f"w{n}": md.param(f"{prefix}_w{n}", [d_in, g], fan_out=["hidden"]) for n in "rzn"},
            **{f"u{n}": md.param(f"{prefix}_u{n}", [g_in, g], fan_out=["hidden"]) for n in "rzn"},
            **{f"b{n}": md.param(f"{prefix}_b{n}", [g], init="zeros") for n in "rzn"}}


def _gru(x_wbse, w, h0):
    """A GRU over the leading 'words' dim of x; per-step states [words, batch, sents, hidden]."""
    def step(h, p):
        xin = lambda n: md.einsum("batch sents d_emb, d_emb hidden -> batch sents hidden",  # noqa: E731
                                  p["x"], w[f"w{n}"])
        hin = lambda n: md.einsum("batch sents hidden_in, hidden_in hidden -> batch sents hidden",  # noqa: E731
                                  md.rename(h, hidden="hidden_in"), w[f"u{n}"])
        r = md.sigmoid(xin("r") + hin("r") + w["br"])
        upd = md.sigmoid(xin("z") + hin("z") + w["bz"])
        n = md.tanh(xin("n") + r * hin("n") + w["bn"])
        h = (1.0 - upd) * n + upd * h
        return h, {"h": h}

    return md.repeat(step, h0, {"x": x_wbse}, "words")


def _word_encoder(emb, cfg):
    """BiGRU over words: [batch, sents, words, d_emb] -> [batch, sents, words, d_sent]."""
    G = md.Dim("hidden", cfg.hidden)
    fw, bw = _gru_params("gru_fw", emb.shape["d_emb"], G), _gru_params("gru_bw", emb.shape["d_emb"], G)
    x_fw = md.transpose(emb, ["words", "batch", "sents", "d_emb"])
    x_bw = md.transpose(_reverse(emb, "words"), ["words", "batch", "sents", "d_emb"])
    h0 = md.constant(0.0, [emb.shape["batch"], emb.shape["sents"], G])

    def once(h, _):
        _, f = _gru(x_fw, fw, h)
        _, b = _gru(x_bw, bw, h)
        return h, {"fw": f["h"], "bw": b["h"]}

    _, per = md.repeat(once, h0, {}, md.Dim("once", 1))
    fw_h = md.transpose(md.squeeze(per["fw"], "once"), ["batch", "sents", "words", "hidden"])
    bw_h = _reverse(md.transpose(md.squeeze(per["bw"], "once"), ["batch", "sents", "words", "hidden"]),
                    "words")
    both = md.concat([md.rename(fw_h, hidden="d_half"), md.rename(bw_h, hidden="d_half")], "d_half")
    return md.rename(both, d_half="d_sent")


def _attend_pool(h, dim, prefix, cfg):
    """Attention pooling over dim: softmax(ctx . tanh(W h + b)) weighted sum of h."""
    A = md.Dim("d_att", cfg.d_att)
    w = md.param(f"{prefix}_w", [h.shape["d_sent"], A], fan_out=["d_att"])
    b = md.param(f"{prefix}_b", [A], init="zeros")
    ctx = md.param(f"{prefix}_ctx", [A])
    u = md.tanh(md.einsum("... d_sent, d_sent d_att -> ... d_att", h, w) + b)
    att = md.softmax(md.einsum("... d_att, d_att -> ...", u, ctx), dim)
    rest = [n for n in h.shape.names if n != dim]
    return md.einsum(f"{' '.join(h.shape.names)}, {' '.join(att.shape.names)} -> {' '.join(rest)}", h, att)


def build(cfg: Config = Config()) -> md.Model:
    B, S, W = md.Dim("batch", cfg.batch), md.Dim("sents", cfg.sents), md.Dim("words", cfg.words)
    V, E, C = md.Dim("vocab", cfg.vocab), md.Dim("d_emb", cfg.d_emb), md.Dim("classes", cfg.classes)
    with md.Graph("han") as g:
        ids = md.input("ids", [B, S, W], torch.int64)
        labels = md.input("labels", [B], torch.int64)
        emb = md.gather(md.param("emb", [V, E], scale=1.0), ids, "vocab")
        h = _word_encoder(emb, cfg)
        sent = _attend_pool(h, "words", "word_att", cfg)                  # [batch, sents, d_sent]
        doc = _attend_pool(sent, "sents", "sent_att", cfg)                # [batch, d_sent]
        logits = md.einsum("batch d_sent, d_sent classes -> batch classes", doc,
                           md.param("cls_w", [md.Dim("d_sent", 2 * cfg.hidden), C], fan_out=["classes"]))
        logits = logits + md.param("cls_b", [C], init="zeros")
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))
        acc = md.reduce_mean(md.cast(md.equal(md.argmax(logits, "classes"), labels), torch.float32))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.sents, cfg.words), generator=gen)
        return {"ids": ids, "labels": ids[:, 0, 0] % cfg.classes}        # learnable: the first word

    return md.Model(g, loss, g.params(), feeds, cfg, metrics={"accuracy": acc})


def reference_loss(cfg: Config, params: dict, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The same network in plain torch (float64, GRU loops): the loss."""
    p = {k: v.double() for k, v in params.items()}
    x = p["emb"][ids]                                                     # [b, s, w, e]

    def gru(prefix, xs):
        h, out = torch.zeros(*xs.shape[:2], cfg.hidden, dtype=torch.float64), []
        for t in range(xs.shape[2]):
            xt = xs[:, :, t]
            r = torch.sigmoid(xt @ p[f"{prefix}_wr"] + h @ p[f"{prefix}_ur"] + p[f"{prefix}_br"])
            u = torch.sigmoid(xt @ p[f"{prefix}_wz"] + h @ p[f"{prefix}_uz"] + p[f"{prefix}_bz"])
            n = torch.tanh(xt @ p[f"{prefix}_wn"] + r * (h @ p[f"{prefix}_un"]) + p[f"{prefix}_bn"])
            h = (1 - u) * n + u * h
            out.append(h)
        return torch.stack(out, 2)

    h = torch.cat([gru("gru_fw", x), gru("gru_bw", x.flip(2)).flip(2)], -1)

    def pool(h, prefix, dim):
        u = torch.tanh(h @ p[f"{prefix}_w"] + p[f"{prefix}_b"])
        a = (u @ p[f"{prefix}_ctx"]).softmax(dim)
        return (h * a.unsqueeze(-1)).sum(dim)

    doc = pool(pool(h, "word_att", 2), "sent_att", 1)
    logits = doc @ p["cls_w"] + p["cls_b"]
    return torch.nn.functional.cross_entropy(logits, labels)


REF_INPUTS = ("ids", "labels")
