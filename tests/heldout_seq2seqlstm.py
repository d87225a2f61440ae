"""Held-out model (round 26d): a seq2seq LSTM with Luong attention, teacher forcing and CE.

Written from README.md and docs/guide/*.md only. A stack of `layers` layers, each one an encoder
LSTM layer and a decoder LSTM layer; the stack's carry is the tuple (encoder sequence, decoder
sequence), so `layer:stage` pipelines it. Inside a layer each LSTM is an inner `md.repeat` over
time whose carry is the tuple (h, c) and whose per-step output is h; the decoder starts from the
encoder's final (h, c) and its block attends over the encoder's outputs, read from outside it.

Legend: b batch, s src (encoder time), t tgt (decoder time), h hidden, i hid_in (the hidden
features a matmul reads), g gate (i, f, g, o), v vocab, L layer.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    vocab: int = 32
    hidden: int = 32
    src: int = 12
    tgt: int = 10
    layers: int = 4
    batch: int = 8
    remat: str | None = None     # the layer stack's activation checkpointing (md.repeat's remat=)

    @classmethod
    def tiny(cls):
        return cls(vocab=11, hidden=6, src=5, tgt=4, layers=3, batch=6)


def lstm_step(x_bi, h_bh, c_bh, wx, wh, bias):
    """One LSTM step: x and h read through their own [hid_in, gate, hidden] weights."""
    h_bi = md.rename(h_bh, hidden="hid_in")
    g_bgh = (md.einsum("batch hid_in, hid_in gate hidden -> batch gate hidden", x_bi, wx)
             + md.einsum("batch hid_in, hid_in gate hidden -> batch gate hidden", h_bi, wh) + bias)
    i, f, g, o = (md.squeeze(md.slice_(g_bgh, "gate", k, k + 1), "gate") for k in range(4))
    c_bh = md.sigmoid(f) * c_bh + md.sigmoid(i) * md.tanh(g)
    return md.sigmoid(o) * md.tanh(c_bh), c_bh


def encoder_layer(x_bsh, p):
    """The encoder LSTM over `src`: (h, c) carried, h per step; returns outputs and final (h, c)."""
    xs = md.transpose(md.rename(x_bsh, hidden="hid_in"), ["src", "batch", "hid_in"])
    zero = md.constant(0.0, [x_bsh.shape["batch"], x_bsh.shape["hidden"]])

    def step(hc, s):
        h, c = lstm_step(s["x"], *hc, p["enc_wx"], p["enc_wh"], p["enc_b"])
        return (h, c), {"h": h}

    (h, c), per = md.repeat(step, (zero, zero), {"x": xs}, "src")
    return md.transpose(per["h"], ["batch", "src", "hidden"]), h, c


def decoder_layer(y_bth, enc_bsh, hc0, p):
    """The decoder LSTM over `tgt` from the encoder's final state, attending over `enc_bsh`."""
    ys = md.transpose(md.rename(y_bth, hidden="hid_in"), ["tgt", "batch", "hid_in"])

    def step(hc, s):
        h, c = lstm_step(s["y"], *hc, p["dec_wx"], p["dec_wh"], p["dec_b"])
        att_bs = md.softmax(md.einsum("batch hidden, batch src hidden -> batch src", h, enc_bsh)
                            * h.shape["hidden"].size ** -0.5, "src")
        ctx_bi = md.rename(md.einsum("batch src, batch src hidden -> batch hidden", att_bs, enc_bsh),
                           hidden="hid_in")
        out = md.tanh(md.einsum("batch hid_in, hid_in hidden -> batch hidden", ctx_bi, p["dec_wc"])
                      + md.einsum("batch hid_in, hid_in hidden -> batch hidden",
                                  md.rename(h, hidden="hid_in"), p["dec_wo"]))
        return (h, c), {"out": out}

    _, per = md.repeat(step, hc0, {"y": ys}, "tgt")
    return md.transpose(per["out"], ["batch", "tgt", "hidden"])


def build(cfg: Config) -> md.Model:
    b, s, t = md.Dim("batch", cfg.batch), md.Dim("src", cfg.src), md.Dim("tgt", cfg.tgt)
    h, i, g = md.Dim("hidden", cfg.hidden), md.Dim("hid_in", cfg.hidden), md.Dim("gate", 4)
    v, L = md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph() as graph:
        src_ids = md.input("src_ids", [b, s], dtype=torch.int64)
        tgt_in, tgt_out = md.input("tgt_in", [b, t], dtype=torch.int64), md.input("tgt_out", [b, t], dtype=torch.int64)
        emb_src, emb_tgt = md.param("emb_src", [v, h], scale=1.0), md.param("emb_tgt", [v, h], scale=1.0)
        stack = {}
        for side in ("enc", "dec"):
            stack[f"{side}_wx"] = md.param(f"{side}_wx", [L, i, g, h], fan_out=["layer", "gate", "hidden"])
            stack[f"{side}_wh"] = md.param(f"{side}_wh", [L, i, g, h], fan_out=["layer", "gate", "hidden"])
            stack[f"{side}_b"] = md.param(f"{side}_b", [L, g, h], scale=0.1)
        stack["dec_wc"] = md.param("dec_wc", [L, i, h], fan_out=["layer", "hidden"])
        stack["dec_wo"] = md.param("dec_wo", [L, i, h], fan_out=["layer", "hidden"])
        w_out = md.param("w_out", [h, v], fan_out=["vocab"])

        def layer(xy, p):
            enc_bsh, h_n, c_n = encoder_layer(xy[0], p)
            return enc_bsh, decoder_layer(xy[1], enc_bsh, (h_n, c_n), p)

        x0, y0 = md.gather(emb_src, src_ids, "vocab"), md.gather(emb_tgt, tgt_in, "vocab")
        _, dec_bth = md.repeat(layer, (x0, y0), stack, "layer", remat=cfg.remat)
        logits = md.einsum("batch tgt hidden, hidden vocab -> batch tgt vocab", dec_bth, w_out)
        loss = md.reduce_mean(md.cross_entropy(logits, tgt_out, "vocab"))

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        src_ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.src), generator=gen)
        # a copy task, reversed and shifted: the target is learnable from the source
        tgt = (src_ids.flip(1)[:, :cfg.tgt + 1] + 1) % cfg.vocab
        return {"src_ids": src_ids, "tgt_in": tgt[:, :-1].contiguous(), "tgt_out": tgt[:, 1:].contiguous()}

    return md.Model(graph, loss, graph.params(), make_feeds, cfg)


# ----------------------------------------------------------------------------- torch reference

REF_INPUTS = ["src_ids", "tgt_in", "tgt_out"]


def _ref_lstm(x, h, c, wx, wh, b):
    g = torch.einsum("bi,igh->bgh", x, wx) + torch.einsum("bi,igh->bgh", h, wh) + b
    c = torch.sigmoid(g[:, 1]) * c + torch.sigmoid(g[:, 0]) * torch.tanh(g[:, 2])
    return torch.sigmoid(g[:, 3]) * torch.tanh(c), c


def reference_loss(cfg: Config, p: dict, src_ids, tgt_in, tgt_out):
    """The same model in plain torch: loops over layers and time steps."""
    x, y = p["emb_src"][src_ids], p["emb_tgt"][tgt_in]
    for layer in range(cfg.layers):
        w = {k: v[layer] for k, v in p.items() if k.startswith(("enc_", "dec_"))}
        h = c = torch.zeros(cfg.batch, cfg.hidden, dtype=x.dtype)
        enc = []
        for s in range(cfg.src):
            h, c = _ref_lstm(x[:, s], h, c, w["enc_wx"], w["enc_wh"], w["enc_b"])
            enc.append(h)
        enc = torch.stack(enc, 1)
        dec = []
        for t in range(cfg.tgt):
            h, c = _ref_lstm(y[:, t], h, c, w["dec_wx"], w["dec_wh"], w["dec_b"])
            att = torch.softmax(torch.einsum("bh,bsh->bs", h, enc) * cfg.hidden ** -0.5, -1)
            ctx = torch.einsum("bs,bsh->bh", att, enc)
            dec.append(torch.tanh(ctx @ w["dec_wc"] + h @ w["dec_wo"]))
        x, y = enc, torch.stack(dec, 1)
    logits = y @ p["w_out"]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), tgt_out.reshape(-1))
