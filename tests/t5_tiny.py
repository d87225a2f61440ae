"""A tiny T5-style encoder-decoder whose decoder layers read tensors from outside their repeat.

Legend: b batch, s src_seq, t tgt_seq (k: tgt_key, the self-attention's key position),
d d_model, h heads, e d_head, f d_ff, v vocab.

The encoder is a stack over ``enc_layer``; the decoder a stack over ``layer`` (the one a
``layer:stage`` layout pipelines).  Every decoder layer reads, besides its carry and its
stacked params, four kinds of tensor of the enclosing graph (closed over, ``md.repeat``):

* ``enc_bsd``: the encoder's output, an activation made before the stack (cross-attention);
* ``src_mask``: an input split by batch (1 for a real source token, 0 for padding);
* ``pos_td``: an input without a batch dim, the same for every micro-batch (a position table);
* ``gate_d``: a param not stacked along ``layer``, whose gradient sums every layer's.

Built by :func:`build` for the tests; :func:`feeds` makes its inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md

PROJ = "batch {q} d_model, d_model heads d_head -> batch {q} heads d_head"
OUT = "batch {q} heads d_head, heads d_head d_model -> batch {q} d_model"


@dataclass(frozen=True)
class Config:
    vocab: int = 16
    d_model: int = 8
    heads: int = 2
    d_head: int = 4
    d_ff: int = 16
    enc_layers: int = 2
    dec_layers: int = 4
    src_seq: int = 6
    tgt_seq: int = 5
    batch: int = 8


def _mlp(z, p, q: str):
    u = md.gelu(md.einsum(f"batch {q} d_model, d_model d_ff -> batch {q} d_ff", z, p["w_fc"]))
    return md.einsum(f"batch {q} d_ff, d_ff d_model -> batch {q} d_model", u, p["w_proj"])


def _encoder_block(x_bsd, p):
    z = md.rms_norm(x_bsd, "d_model", p["ln1"])
    q, k, v = (md.einsum(PROJ.format(q="src_seq"), z, p[w]) for w in ("wq", "wk", "wv"))
    k, v = md.rename(k, src_seq="src_key"), md.rename(v, src_seq="src_key")
    y = md.attention(q, k, v, "src_seq", "src_key", "d_head")
    x_bsd = x_bsd + md.einsum(OUT.format(q="src_seq"), y, p["wo"])
    return x_bsd + _mlp(md.rms_norm(x_bsd, "d_model", p["ln2"]), p, "src_seq")


def _decoder_block(x_btd, p, enc_bsd, src_mask, pos_td, gate_d, cfg: Config):
    z = md.rms_norm(x_btd + pos_td, "d_model", p["ln1"])  # the table: read by every layer
    q, k, v = (md.einsum(PROJ.format(q="tgt_seq"), z, p[w]) for w in ("wq", "wk", "wv"))
    k, v = md.rename(k, tgt_seq="tgt_key"), md.rename(v, tgt_seq="tgt_key")
    y = md.attention(q, k, v, "tgt_seq", "tgt_key", "d_head", causal=True)
    x_btd = x_btd + md.einsum(OUT.format(q="tgt_seq"), y, p["wo"])
    # cross-attention: keys and values from the encoder's output, padding masked out
    z = md.rms_norm(x_btd, "d_model", p["ln_x"]) * gate_d  # the shared param: read by every layer
    q = md.einsum(PROJ.format(q="tgt_seq"), z, p["xq"])
    k = md.einsum(PROJ.format(q="src_seq"), enc_bsd, p["xk"])
    v = md.einsum(PROJ.format(q="src_seq"), enc_bsd, p["xv"])
    s = md.einsum("batch tgt_seq heads d_head, batch src_seq heads d_head -> batch heads tgt_seq src_seq", q, k)
    s = s * (cfg.d_head ** -0.5) + (src_mask - 1.0) * 1e4
    a = md.softmax(s, "src_seq")
    y = md.einsum("batch heads tgt_seq src_seq, batch src_seq heads d_head -> batch tgt_seq heads d_head", a, v)
    x_btd = x_btd + md.einsum(OUT.format(q="tgt_seq"), y, p["xo"])
    return x_btd + _mlp(md.rms_norm(x_btd, "d_model", p["ln2"]), p, "tgt_seq")


def _stack(name: str, layers: md.Dim, d, h, e, f, cross: bool) -> dict:
    l = layers
    w = {"ln1": md.param(f"{name}_ln1", [l, d], init="ones"),
         "wq": md.param(f"{name}_wq", [l, d, h, e], fan_out=[l, h, e]),
         "wk": md.param(f"{name}_wk", [l, d, h, e], fan_out=[l, h, e]),
         "wv": md.param(f"{name}_wv", [l, d, h, e], fan_out=[l, h, e]),
         "wo": md.param(f"{name}_wo", [l, h, e, d], fan_out=[l, d]),
         "ln2": md.param(f"{name}_ln2", [l, d], init="ones"),
         "w_fc": md.param(f"{name}_w_fc", [l, d, f], fan_out=[l, f]),
         "w_proj": md.param(f"{name}_w_proj", [l, f, d], fan_out=[l, d])}
    if cross:
        w.update({"ln_x": md.param(f"{name}_ln_x", [l, d], init="ones"),
                  "xq": md.param(f"{name}_xq", [l, d, h, e], fan_out=[l, h, e]),
                  "xk": md.param(f"{name}_xk", [l, d, h, e], fan_out=[l, h, e]),
                  "xv": md.param(f"{name}_xv", [l, d, h, e], fan_out=[l, h, e]),
                  "xo": md.param(f"{name}_xo", [l, h, e, d], fan_out=[l, d])})
    return w


def build(cfg: Config = Config()):
    """The model: (graph outputs ``loss`` and ``grad/<param>`` for every param, the params)."""
    b, s, t = md.Dim("batch", cfg.batch), md.Dim("src_seq", cfg.src_seq), md.Dim("tgt_seq", cfg.tgt_seq)
    d, h, e, f = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), \
        md.Dim("d_ff", cfg.d_ff)
    v = md.Dim("vocab", cfg.vocab)
    with md.Graph("t5"):
        src_bs = md.input("src", [b, s], torch.int64)
        tgt_bt = md.input("tgt", [b, t], torch.int64)
        labels_bt = md.input("labels", [b, t], torch.int64)
        src_mask = md.input("src_mask", [b, s])
        pos_td = md.input("pos", [t, d])
        emb_vd = md.param("emb", [v, d], scale=0.5)
        gate_d = md.param("gate", [d], init="ones")
        enc = _stack("enc", md.Dim("enc_layer", cfg.enc_layers), d, h, e, f, cross=False)
        dec = _stack("dec", md.Dim("layer", cfg.dec_layers), d, h, e, f, cross=True)
        lnf = md.param("lnf", [d], init="ones")

        x_bsd = md.gather(emb_vd, src_bs, "vocab")
        enc_bsd = md.rms_norm(md.repeat(_encoder_block, x_bsd, enc, "enc_layer"), "d_model", lnf)
        y_btd = md.repeat(lambda x, p: _decoder_block(x, p, enc_bsd, src_mask, pos_td, gate_d, cfg),
                          md.gather(emb_vd, tgt_bt, "vocab"), dec, "layer")
        logits = md.einsum("batch tgt_seq d_model, vocab d_model -> batch tgt_seq vocab", y_btd, emb_vd)
        loss = md.reduce_mean(md.cross_entropy(logits, labels_bt, "vocab"))
        params = {"emb": emb_vd, "gate": gate_d, "lnf": lnf, **{p.name: p for p in [*enc.values(), *dec.values()]}}
        grads = md.grad(loss, params)
    return {"loss": loss, **{f"grad/{k}": g for k, g in grads.items()}}, params


def feeds(cfg: Config = Config(), seed: int = 0) -> dict[str, torch.Tensor]:
    """Random token ids, labels, a padding mask (each sequence keeps at least 3 tokens) and a table."""
    gen = torch.Generator().manual_seed(seed)
    keep = torch.randint(3, cfg.src_seq + 1, (cfg.batch, 1), generator=gen)
    return {"src": torch.randint(0, cfg.vocab, (cfg.batch, cfg.src_seq), generator=gen),
            "tgt": torch.randint(0, cfg.vocab, (cfg.batch, cfg.tgt_seq), generator=gen),
            "labels": torch.randint(0, cfg.vocab, (cfg.batch, cfg.tgt_seq), generator=gen),
            "src_mask": (torch.arange(cfg.src_seq)[None, :] < keep).float(),
            "pos": torch.randn(cfg.tgt_seq, cfg.d_model, generator=gen) * 0.1}
