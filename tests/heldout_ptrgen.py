"""Held-out model (round 17b): pointer-generator seq2seq (See et al. 2017's copy mechanism).

Legend: b = batch, s = src (source positions), t = tgt (target positions), v = vocab,
d = d_model, h = heads, e = d_head, f = d_ff, hid = one GRU direction's width (d_model / 2).

Encoder (``enc=transformer``): token + position embeddings, non-causal pre-norm blocks under
``md.repeat`` over ``enc_layer``; (``enc=gru``) a bidirectional GRU: one ``md.repeat`` over ``src``
per direction (the backward one reads the source reversed by a gather of reversed positions and its
states are reversed back), the two directions concatenated along ``hid``. Decoder: causal pre-norm
blocks (self-attention, cross-attention to the encoder, MLP) under ``md.repeat`` over ``dec_layer``.
Pointer: one attention head ``a [b, t, s]`` over the encoder states gives the context; p_gen =
sigmoid(w_c . ctx + w_s . state + w_x . input); the final distribution
``p_gen * softmax(vocab logits) + (1 - p_gen) * a`` scattered onto the vocab by ``one_hot(src_ids)``
(an einsum); the loss is its NLL of the labels.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    vocab: int = 64
    src: int = 16
    tgt: int = 12
    d_model: int = 32
    heads: int = 4
    d_ff: int = 64
    enc_layers: int = 2
    dec_layers: int = 2
    batch: int = 8
    enc: str = "transformer"    # transformer | gru
    remat: str = "none"         # every repeat's activation checkpointing

    @classmethod
    def tiny(cls):
        return cls(vocab=16, src=6, tgt=5, d_model=8, heads=2, d_ff=16, enc_layers=2, dec_layers=2, batch=4)


def _attn(x, wq, wk, wv, wo, kv, q_dim: str, k_dim: str, causal: bool):
    """Multi-head attention of ``x [batch, q_dim, d_model]`` over ``kv [batch, k_dim, d_model]``."""
    q = md.einsum(f"batch {q_dim} d_model, d_model heads d_head -> batch {q_dim} heads d_head", x, wq)
    kv = md.rename(kv, {k_dim: "key_pos"})          # self-attention: the queries' own positions
    k = md.einsum("batch key_pos d_model, d_model heads d_head -> batch key_pos heads d_head", kv, wk)
    v = md.einsum("batch key_pos d_model, d_model heads d_head -> batch key_pos heads d_head", kv, wv)
    y = md.attention(q, k, v, q_dim, "key_pos", "d_head", causal=causal)
    return md.einsum(f"batch {q_dim} heads d_head, heads d_head d_model -> batch {q_dim} d_model", y, wo)


def _mlp(x, w1, w2, pos: str):
    h = md.gelu(md.einsum(f"batch {pos} d_model, d_model d_ff -> batch {pos} d_ff", x, w1))
    return md.einsum(f"batch {pos} d_ff, d_ff d_model -> batch {pos} d_model", h, w2)


def _stacked(prefix: str, L, D, H, E, F) -> dict:
    shapes = {"ln1": [L, D], "wq": [L, D, H, E], "wk": [L, D, H, E], "wv": [L, D, H, E],
              "wo": [L, H, E, D], "ln2": [L, D], "w1": [L, D, F], "w2": [L, F, D]}
    fan = {"wq": ["heads", "d_head"], "wk": ["heads", "d_head"], "wv": ["heads", "d_head"],
           "wo": ["d_model"], "w1": ["d_ff"], "w2": ["d_model"]}
    out = {}
    for k, shape in shapes.items():
        if k.startswith("ln"):
            out[k] = md.param(f"{prefix}_{k}", shape, init="ones")
        else:
            out[k] = md.param(f"{prefix}_{k}", shape, fan_out=[L.name, *fan[k]])
    return out


def _transformer_encoder(x, cfg, D, H, E, F):
    L = md.Dim("enc_layer", cfg.enc_layers)
    ps = _stacked("enc", L, D, H, E, F)

    def block(h, p):
        a = md.layer_norm(h, "d_model", p["ln1"])
        h = h + _attn(a, p["wq"], p["wk"], p["wv"], p["wo"], a, "src", "src", causal=False)
        return h + _mlp(md.layer_norm(h, "d_model", p["ln2"]), p["w1"], p["w2"], "src")

    return md.repeat(block, x, ps, L, remat=cfg.remat), ps


def _gru_direction(x_sbd, name: str, D, Hd):
    """One GRU direction over ``src`` (the repeat's dim): the states ``[src, batch, hid]``."""
    wx = {gate: md.param(f"gru_{name}_wx{gate}", [D, Hd], fan_out=["hid"]) for gate in "zrn"}
    wh = {gate: md.param(f"gru_{name}_wh{gate}", [Hd, md.Dim("hid_in", Hd.size)], fan_out=["hid_in"])
          for gate in "zrn"}
    b = {gate: md.param(f"gru_{name}_b{gate}", [Hd], init="zeros") for gate in "zrn"}

    def step(h, s):
        x = s["x"]
        hh = md.rename(h, hid="hid_in")

        def lin(gate, hin):
            return (md.einsum("batch d_model, d_model hid -> batch hid", x, wx[gate]) + b[gate]
                    + md.einsum("batch hid_in, hid hid_in -> batch hid", hin, wh[gate]))
        z, r = md.sigmoid(lin("z", hh)), md.sigmoid(lin("r", hh))
        n = md.tanh(md.einsum("batch d_model, d_model hid -> batch hid", x, wx["n"]) + b["n"]
                    + r * md.einsum("batch hid_in, hid hid_in -> batch hid", hh, wh["n"]))
        h = (1.0 - z) * n + z * h
        return h, {"h": h}

    B = x_sbd.shape["batch"]
    h0 = md.broadcast_to(md.constant(0.0), [B, Hd])
    _, outs = md.repeat(step, h0, {"x": x_sbd}, x_sbd.shape["src"])
    params = {**{f"gru_{name}_wx{k}": v for k, v in wx.items()},
              **{f"gru_{name}_wh{k}": v for k, v in wh.items()}, **{f"gru_{name}_b{k}": v for k, v in b.items()}}
    return outs["h"], params


def _reverse_src(x, S):
    """``x`` with its ``src`` positions reversed (a gather of the reversed positions)."""
    rev = (S.size - 1) - md.arange(S)
    return md.gather(md.rename(x, src="src_in"), rev, "src_in")


def _gru_encoder(x, cfg, D):
    S, Hd = x.shape["src"], md.Dim("hid", cfg.d_model // 2)
    x_sbd = md.transpose(x, ["src", "batch", "d_model"])
    fwd, pf = _gru_direction(x_sbd, "f", D, Hd)
    bwd, pb = _gru_direction(_reverse_src(x_sbd, S), "b", D, Hd)
    both = md.concat([fwd, _reverse_src(bwd, S)], "hid")               # [src, batch, hid 2x]
    return md.rename(md.transpose(both, ["batch", "src", "hid"]), hid="d_model"), {**pf, **pb}


def build(cfg: Config) -> md.Model:
    if cfg.enc not in ("transformer", "gru"):
        raise ValueError(f"enc must be 'transformer' or 'gru', not {cfg.enc!r}")
    B, S, T = md.Dim("batch", cfg.batch), md.Dim("src", cfg.src), md.Dim("tgt", cfg.tgt)
    V, D, H = md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads)
    E, F = md.Dim("d_head", cfg.d_model // cfg.heads), md.Dim("d_ff", cfg.d_ff)
    with md.Graph() as g:
        src_ids = md.input("src_ids", [B, S], dtype=torch.int64)
        tgt_in = md.input("tgt_in", [B, T], dtype=torch.int64)
        labels = md.input("labels", [B, T], dtype=torch.int64)
        wte = md.param("wte", [V, D], scale=0.5)
        pos_src, pos_tgt = md.param("pos_src", [S, D], scale=0.1), md.param("pos_tgt", [T, D], scale=0.1)
        x = md.gather(wte, src_ids, "vocab") + pos_src
        if cfg.enc == "transformer":
            enc, eps = _transformer_encoder(x, cfg, D, H, E, F)
            eps = {f"enc_{k}": v for k, v in eps.items()}
        else:
            enc, eps = _gru_encoder(x, cfg, D)
        ln_enc = md.param("ln_enc", [D], init="ones")
        enc = md.layer_norm(enc, "d_model", ln_enc)

        L = md.Dim("dec_layer", cfg.dec_layers)
        dps = _stacked("dec", L, D, H, E, F)
        cross = {k: md.param(f"dec_c{k}", shape, fan_out=["dec_layer", *fo]) for k, shape, fo in (
            ("wq", [L, D, H, E], ["heads", "d_head"]), ("wk", [L, D, H, E], ["heads", "d_head"]),
            ("wv", [L, D, H, E], ["heads", "d_head"]), ("wo", [L, H, E, D], ["d_model"]))}
        ln_c = md.param("dec_lnc", [L, D], init="ones")

        def dec_block(h, p):
            a = md.layer_norm(h, "d_model", p["ln1"])
            h = h + _attn(a, p["wq"], p["wk"], p["wv"], p["wo"], a, "tgt", "tgt", causal=True)
            c = md.layer_norm(h, "d_model", p["lnc"])
            h = h + _attn(c, p["cwq"], p["cwk"], p["cwv"], p["cwo"], enc, "tgt", "src", causal=False)
            return h + _mlp(md.layer_norm(h, "d_model", p["ln2"]), p["w1"], p["w2"], "tgt")

        y = md.gather(wte, tgt_in, "vocab") + pos_tgt
        stacked = {**dps, **{f"c{k}": v for k, v in cross.items()}, "lnc": ln_c}
        ln_dec = md.param("ln_dec", [D], init="ones")
        state = md.layer_norm(md.repeat(dec_block, y, stacked, L, remat=cfg.remat), "d_model", ln_dec)

        # pointer: one head over the encoder states
        w_ptr = md.param("w_ptr", [D, md.Dim("d_key", cfg.d_model)], fan_out=["d_key"])
        keys = md.rename(enc, d_model="d_key")
        att = md.softmax(md.einsum("batch tgt d_model, d_model d_key, batch src d_key -> batch tgt src",
                                   state, w_ptr, keys) * cfg.d_model ** -0.5, "src")
        ctx = md.einsum("batch tgt src, batch src d_model -> batch tgt d_model", att, enc)
        w_c, w_s, w_x = (md.param(n, [D], scale=cfg.d_model ** -0.5) for n in ("pg_c", "pg_s", "pg_x"))
        b_gen = md.param("pg_b", [], init="zeros")
        p_gen = md.sigmoid(md.reduce_sum(ctx * w_c + state * w_s + y * w_x, "d_model") + b_gen)  # [batch, tgt]
        w_out = md.param("w_out", [D, V], fan_out=["vocab"])
        p_vocab = md.softmax(md.einsum("batch tgt d_model, d_model vocab -> batch tgt vocab", state, w_out), "vocab")
        copy = md.einsum("batch tgt src, batch src vocab -> batch tgt vocab", att, md.one_hot(src_ids, V))
        final = p_gen * p_vocab + (1.0 - p_gen) * copy
        picked = md.reduce_sum(final * md.one_hot(labels, V), "vocab")
        loss = md.reduce_mean(-md.log(picked + 1e-9))

    params = {"wte": wte, "pos_src": pos_src, "pos_tgt": pos_tgt, "ln_enc": ln_enc, **eps,
              **{f"dec_{k}": v for k, v in dps.items()}, **{f"dec_c{k}": v for k, v in cross.items()},
              "dec_lnc": ln_c, "ln_dec": ln_dec, "w_ptr": w_ptr, "pg_c": w_c, "pg_s": w_s, "pg_x": w_x, "pg_b": b_gen,
              "w_out": w_out}

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        src = torch.randint(1, cfg.vocab, (cfg.batch, cfg.src), generator=gen)
        # targets copy source tokens half the time, else any token
        pick = torch.randint(0, cfg.src, (cfg.batch, cfg.tgt), generator=gen)
        free = torch.randint(1, cfg.vocab, (cfg.batch, cfg.tgt), generator=gen)
        lab = torch.where(torch.rand(cfg.batch, cfg.tgt, generator=gen) < 0.5, src.gather(1, pick), free)
        tgt_in = torch.cat([torch.zeros(cfg.batch, 1, dtype=torch.int64), lab[:, :-1]], 1)
        return {"src_ids": src, "tgt_in": tgt_in, "labels": lab}

    return md.Model(g, loss, params, make_feeds, cfg)
