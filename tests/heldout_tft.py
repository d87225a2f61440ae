"""Held-out model (round 16a): a Temporal Fusion Transformer, lite, written from the docs alone.

Each of ``vars`` scalar inputs per time step is embedded to ``d_model``; a variable selection
network runs a gated residual network (GRN) per variable and weighs the variables by a softmax
(over ``vars``) of a GRN of all of them. A GRN is ``LayerNorm(a + GLU(W2 elu(W1 a)))`` with
``GLU(x) = sigmoid(W4 x) * W5 x``. The temporal encoder is a causal conv (``enc=conv``) or a GRU
(``enc=gru``, an inner ``md.repeat`` over ``seq``). A stack of layers (``md.repeat`` over ``layer``)
then applies interpretable multi-head attention (per-head q and k, one V shared by the heads,
the heads' outputs averaged) and a GRN. The head predicts 3 quantiles per step; the loss is the
quantile (pinball) loss.

Legend: b = batch, t = seq, k = key_seq, v = vars, d = d_model, h = heads, e = d_head, q = quantiles.
"""
from dataclasses import dataclass

import torch

import meshdsl as md

QUANTILES = (0.1, 0.5, 0.9)


@dataclass
class Config:
    batch: int = 16
    seq: int = 24
    vars: int = 5
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    layers: int = 2
    taps: int = 3
    enc: str = "conv"            # conv | gru
    remat: str = "none"          # none | full | selective (the layer stack)

    @classmethod
    def tiny(cls):
        return cls(batch=4, seq=6, vars=3, d_model=8, heads=2, d_head=4, layers=2, taps=3)


class _Params(dict):
    def __call__(self, name, shape, **kw):
        self[name] = md.param(name, shape, **kw)
        return self[name]


def _glu(x, w4, w5, d_in, d_out, extra=""):
    a = md.einsum(f"{extra}batch seq {d_in}, {extra}{d_in} {d_out} -> {extra}batch seq {d_out}", x, w4)
    b = md.einsum(f"{extra}batch seq {d_in}, {extra}{d_in} {d_out} -> {extra}batch seq {d_out}", x, w5)
    return md.sigmoid(a) * b


def _grn_weights(P, prefix, D, lead=()):
    Dh = md.Dim("d_hid", D.size)
    Do = md.Dim("d_out", D.size)
    fo = [d.name for d in lead]
    return {"w1": P(f"{prefix}w1", [*lead, D, Dh], fan_out=[*fo, "d_hid"]),
            "b1": P(f"{prefix}b1", [*lead, Dh], init="zeros"),
            "w2": P(f"{prefix}w2", [*lead, Dh, md.Dim("d_glu", D.size)], fan_out=[*fo, "d_glu"]),
            "w4": P(f"{prefix}w4", [*lead, md.Dim("d_glu", D.size), Do], fan_out=[*fo, "d_out"]),
            "w5": P(f"{prefix}w5", [*lead, md.Dim("d_glu", D.size), Do], fan_out=[*fo, "d_out"]),
            "ln": P(f"{prefix}ln", [*lead, D], init="ones")}


def _grn(a, w, extra=""):
    """A gated residual network on ``a`` [extra... batch seq d_model] (weights with ``extra`` dims
    first: one GRN per entry of them)."""
    h = md.elu(md.einsum(f"{extra}batch seq d_model, {extra}d_model d_hid -> {extra}batch seq d_hid", a, w["w1"]) + w["b1"])
    h = md.einsum(f"{extra}batch seq d_hid, {extra}d_hid d_glu -> {extra}batch seq d_glu", h, w["w2"])
    g = md.rename(_glu(h, w["w4"], w["w5"], "d_glu", "d_out", extra), {"d_out": "d_model"})
    return md.layer_norm(a + g, "d_model", w["ln"])


def _select_variables(P, x_btv, D, Vd):
    """The variable selection network: [batch, seq, d_model] from [batch, seq, vars]."""
    emb = md.einsum("batch seq vars, vars d_model -> vars batch seq d_model", x_btv, P("var_emb", [Vd, D], scale=1.0))
    emb = emb + P("var_bias", [Vd, D], init="zeros")
    per_var = _grn(emb, _grn_weights(P, "var_grn_", D, lead=[Vd]), extra="vars ")
    flat = md.einsum("vars batch seq d_model, vars d_model d_sel -> batch seq d_sel", emb,
                     P("sel_w", [Vd, D, md.Dim("d_sel", D.size)], fan_out=["d_sel"]))
    logits = md.einsum("batch seq d_sel, d_sel vars -> batch seq vars", md.elu(flat), P("sel_out", [md.Dim("d_sel", D.size), Vd], fan_out=["vars"]))
    weights = md.softmax(logits, "vars")
    return md.einsum("batch seq vars, vars batch seq d_model -> batch seq d_model", weights, per_var)


def _encode(P, cfg, h, B, D):
    if cfg.enc == "conv":
        w = P("enc_conv", [md.Dim("tap", cfg.taps), md.Dim("c_in", D.size), md.Dim("c_out", D.size)], fan_out=["c_out"])
        y = md.conv(md.rename(h, {"d_model": "c_in"}), w, {"seq": "tap"}, padding="causal")
        return h + md.gelu(md.rename(y, {"c_out": "d_model"}))
    G, Do = md.Dim("gate", 2), md.Dim("d_out", D.size)
    wx = P("gru_wx", [D, G, Do], fan_out=["gate", "d_out"])
    wh = P("gru_wh", [md.Dim("d_prev", D.size), G, Do], fan_out=["gate", "d_out"])
    wn = P("gru_wn", [D, Do], fan_out=["d_out"])
    un = P("gru_un", [md.Dim("d_prev", D.size), Do], fan_out=["d_out"])

    def step(s, p):                      # a GRU cell, carry s [batch, d_prev]
        gz = md.sigmoid(md.einsum("batch d_model, d_model gate d_out -> batch gate d_out", p["x"], wx)
                        + md.einsum("batch d_prev, d_prev gate d_out -> batch gate d_out", s, wh))
        r = md.squeeze(md.slice_(gz, "gate", 0, 1), "gate")
        z = md.squeeze(md.slice_(gz, "gate", 1, 2), "gate")
        n = md.tanh(md.einsum("batch d_model, d_model d_out -> batch d_out", p["x"], wn)
                    + r * md.einsum("batch d_prev, d_prev d_out -> batch d_out", s, un))
        s = md.rename((1.0 - z) * n, {"d_out": "d_prev"}) + md.rename(z, {"d_out": "d_prev"}) * s
        return s, {"s": md.rename(s, {"d_prev": "d_model"})}

    s0 = md.constant(torch.zeros(B.size, D.size), [B, md.Dim("d_prev", D.size)])
    xs = md.transpose(h, ["seq", "batch", "d_model"])
    # an inner repeat (in a one-step outer one): seq:model gathers its inputs and runs the whole
    # recurrence on each rank; an outermost repeat over seq would make seq:model a pipeline
    once = md.repeat(lambda c, _: md.repeat(step, c, {"x": xs}, "seq"), s0, {}, md.Dim("once", 1))
    hs = md.squeeze(once[1]["s"], "once")
    return h + md.transpose(hs, ["batch", "seq", "d_model"])


def _attention_layer(h, p, cfg):
    """Interpretable multi-head attention (shared V, heads averaged) and a GRN."""
    q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"])
    k = md.rename(md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wk"]), {"seq": "key_seq"})
    v = md.rename(md.einsum("batch seq d_model, d_model d_head -> batch seq d_head", h, p["wv"]), {"seq": "key_seq"})
    s = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq", q, k) * cfg.d_head ** -0.5
    S, K = h.shape["seq"], md.Dim("key_seq", cfg.seq)
    att = md.softmax(md.where(md.causal_mask(S, K), s, -1e9), "key_seq")
    att_mean = md.reduce_mean(att, "heads")                     # the heads share V: average their weights
    o = md.einsum("batch seq key_seq, batch key_seq d_head -> batch seq d_head", att_mean, v)
    o = md.rename(md.einsum("batch seq d_head, d_head d_out -> batch seq d_out", o, p["wo"]), {"d_out": "d_model"})
    a = md.layer_norm(h + o, "d_model", p["ln_att"])
    return _grn(a, {k[4:]: t for k, t in p.items() if k.startswith("grn_")})


def build(cfg: Config) -> md.Model:
    if cfg.enc not in ("conv", "gru"):
        raise ValueError(f"enc must be 'conv' or 'gru', not {cfg.enc!r}")
    B, T, Vd, D = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("vars", cfg.vars), md.Dim("d_model", cfg.d_model)
    Hh, E, L, Q = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("layer", cfg.layers), md.Dim("quantiles", len(QUANTILES))
    P = _Params()
    with md.Graph() as g:
        x = md.input("x", [B, T, Vd])
        y = md.input("y", [B, T])
        h = _encode(P, cfg, _select_variables(P, x, D, Vd), B, D)
        stack = {"wq": P("wq", [L, D, Hh, E], fan_out=["layer", "heads", "d_head"]),
                 "wk": P("wk", [L, D, Hh, E], fan_out=["layer", "heads", "d_head"]),
                 "wv": P("wv", [L, D, E], fan_out=["layer", "d_head"]),
                 "wo": P("wo", [L, E, md.Dim("d_out", cfg.d_model)], fan_out=["layer", "d_out"]),
                 "ln_att": P("ln_att", [L, D], init="ones"),
                 **{f"grn_{k}": t for k, t in _grn_weights(P, "post_", D, lead=[L]).items()}}
        h = md.repeat(lambda c, p: _attention_layer(c, p, cfg), h, stack, "layer",
                      remat=None if cfg.remat == "none" else cfg.remat)
        pred = md.einsum("batch seq d_model, d_model quantiles -> batch seq quantiles", h, P("head", [D, Q], fan_out=["quantiles"]))
        err = y - pred
        qs = md.constant(torch.tensor(QUANTILES), [Q])
        loss = md.reduce_mean(md.maximum(qs * err, (qs - 1.0) * err))

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(cfg.batch, cfg.seq, cfg.vars, generator=gen)
        return {"x": x, "y": x.cumsum(1)[..., 0] * 0.3 + 0.1 * torch.randn(cfg.batch, cfg.seq, generator=gen)}

    return md.Model(g, loss, dict(P), make_feeds, cfg, outputs={"quantiles": pred})
