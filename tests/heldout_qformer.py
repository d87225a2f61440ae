"""A BLIP-2 Q-Former, written from the README and docs/ alone (a held-out model).

Learned queries read a frozen image encoder's features (fed as an input) through a stack whose
layer has two sub-layers: the first self-attends among the queries, cross-attends to the image
patches and runs an MLP; the second self-attends and runs an MLP (so cross-attention comes every
other sub-layer, as BLIP-2's ``cross_attention_freq=2``). A text encoder of its own stack
(``txt_layer``) reads the caption bidirectionally; its first token is the [CLS]. Two losses:

* image-text contrastive (ITC): each query's projection against each caption's [CLS] projection,
  both L2-normalised, the best query per (image, caption) pair, over a learned temperature; the
  cross-entropy over the batch both ways (image -> caption over ``pair``, caption -> image over
  ``batch``), with the matching row as the label;
* image-text matching (ITM): the pooled queries times the caption's [CLS] for the true caption
  and for the next row's caption (``md.roll`` over ``batch``: a negative), a 2-way head.

Legend: batch (images; pair: the same rows as captions), query, patch, d_img, tok (caption
position; key_tok as keys), d_model, heads, d_head, d_ff, d_proj, vocab, layer, txt_layer.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    d_img: int = 24
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    d_proj: int = 16
    queries: int = 8
    patches: int = 16
    tok: int = 12
    batch: int = 8
    layers: int = 2
    txt_layers: int = 2
    itm_weight: float = 1.0
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=20, d_model=12, d_img=10, heads=2, d_head=6, d_ff=24, d_proj=8, queries=4, patches=6, tok=6,
                   batch=6, layers=2, txt_layers=2)


def _dims(cfg):
    names = dict(batch=cfg.batch, pair=cfg.batch, query=cfg.queries, key_query=cfg.queries, patch=cfg.patches,
                 d_img=cfg.d_img, tok=cfg.tok, key_tok=cfg.tok, d_model=cfg.d_model, heads=cfg.heads,
                 d_head=cfg.d_head, d_ff=cfg.d_ff, d_proj=cfg.d_proj, vocab=cfg.vocab, layer=cfg.layers,
                 txt_layer=cfg.txt_layers, three=3, two=2)
    return {k: md.Dim(k, v) for k, v in names.items()}


def _sublayer_params(d, prefix, L, cross):
    def p(name, dims, fan_out=None, init="normal"):
        shape = [d[L]] + [d[x] for x in dims]
        return md.param(f"{prefix}{name}", shape, init=init, fan_out=[L, *(fan_out or [])])
    out = {"ln1": p("ln1", ["d_model"], init="ones"), "wqkv": p("wqkv", ["three", "d_model", "heads", "d_head"],
                                                               ["three", "heads", "d_head"]),
           "wo": p("wo", ["heads", "d_head", "d_model"], ["d_model"]), "ln2": p("ln2", ["d_model"], init="ones"),
           "w1": p("w1", ["d_model", "d_ff"], ["d_ff"]), "w2": p("w2", ["d_ff", "d_model"], ["d_model"])}
    if cross:
        out.update({"lnx": p("lnx", ["d_model"], init="ones"), "xq": p("xq", ["d_model", "heads", "d_head"], ["heads", "d_head"]),
                    "xk": p("xk", ["d_img", "heads", "d_head"], ["heads", "d_head"]),
                    "xv": p("xv", ["d_img", "heads", "d_head"], ["heads", "d_head"]),
                    "xo": p("xo", ["heads", "d_head", "d_model"], ["d_model"])})
    return out


def _self_attn_mlp(x, p, pos, kpos, img=None):
    """Post-norm BERT sub-layer over ``pos``: self-attention, (cross-attention to img), MLP."""
    qkv = md.einsum(f"batch {pos} d_model, three d_model heads d_head -> three batch {pos} heads d_head", x, p["wqkv"])
    q, k, v = (md.squeeze(md.slice_(qkv, "three", i, i + 1), "three") for i in range(3))
    o = md.attention(q, md.rename(k, {pos: kpos}), md.rename(v, {pos: kpos}), pos, kpos, "d_head", causal=False)
    x = md.layer_norm(x + md.einsum(f"batch {pos} heads d_head, heads d_head d_model -> batch {pos} d_model", o, p["wo"]),
                      "d_model", p["ln1"])
    if img is not None:
        q = md.einsum(f"batch {pos} d_model, d_model heads d_head -> batch {pos} heads d_head", x, p["xq"])
        k = md.einsum("batch patch d_img, d_img heads d_head -> batch patch heads d_head", img, p["xk"])
        v = md.einsum("batch patch d_img, d_img heads d_head -> batch patch heads d_head", img, p["xv"])
        o = md.attention(q, k, v, pos, "patch", "d_head", causal=False)
        x = md.layer_norm(x + md.einsum(f"batch {pos} heads d_head, heads d_head d_model -> batch {pos} d_model",
                                        o, p["xo"]), "d_model", p["lnx"])
    hid = md.gelu(md.einsum(f"batch {pos} d_model, d_model d_ff -> batch {pos} d_ff", x, p["w1"]))
    return md.layer_norm(x + md.einsum(f"batch {pos} d_ff, d_ff d_model -> batch {pos} d_model", hid, p["w2"]),
                         "d_model", p["ln2"])


def _normalise(x, dim):
    return x * md.rsqrt(md.reduce_sum(x * x, dim) + 1e-6)


def build(cfg: Config = Config()) -> md.Model:
    d = _dims(cfg)
    with md.Graph("heldout_qformer") as g:
        img = md.input("image_feats", [d["batch"], d["patch"], d["d_img"]])
        ids = md.input("ids", [d["batch"], d["tok"]], dtype=torch.int64)
        queries = md.param("queries", [d["query"], d["d_model"]], scale=0.5)
        img_ln = md.param("img_ln", [d["d_img"]], init="ones")
        qf_cross = _sublayer_params(d, "qc_", "layer", cross=True)
        qf_plain = _sublayer_params(d, "qp_", "layer", cross=False)
        txt = _sublayer_params(d, "tx_", "txt_layer", cross=False)
        wte = md.param("wte", [d["vocab"], d["d_model"]], scale=0.1)
        wpe = md.param("wpe", [d["tok"], d["d_model"]], scale=0.1)
        w_vproj = md.param("w_vproj", [d["d_model"], d["d_proj"]], fan_out=["d_proj"])
        w_tproj = md.param("w_tproj", [d["d_model"], d["d_proj"]], fan_out=["d_proj"])
        log_temp = md.param("log_temp", [], init=-2.0)
        w_itm = md.param("w_itm", [d["d_model"], d["two"]], fan_out=["two"])

        feats = md.layer_norm(img, "d_img", img_ln)

        def qformer_layer(x, p):
            x = _self_attn_mlp(x, {k[3:]: v for k, v in p.items() if k.startswith("qc_")}, "query", "key_query", feats)
            return _self_attn_mlp(x, {k[3:]: v for k, v in p.items() if k.startswith("qp_")}, "query", "key_query")

        stacked = {**{f"qc_{k}": v for k, v in qf_cross.items()}, **{f"qp_{k}": v for k, v in qf_plain.items()}}
        q_in = md.broadcast_to(queries, [d["batch"], d["query"], d["d_model"]])
        q_out = md.repeat(qformer_layer, q_in, stacked, "layer", remat=cfg.remat)
        t_out = md.repeat(lambda x, p: _self_attn_mlp(x, p, "tok", "key_tok"), md.gather(wte, ids, "vocab") + wpe, txt,
                          "txt_layer", remat=cfg.remat)
        cls = md.squeeze(md.slice_(t_out, "tok", 0, 1), "tok")                        # [batch, d_model]

        # ITC: sim[batch (image), pair (caption)] = max over queries, over a temperature
        zi = _normalise(md.einsum("batch query d_model, d_model d_proj -> batch query d_proj", q_out, w_vproj), "d_proj")
        zt = md.rename(_normalise(md.einsum("batch d_model, d_model d_proj -> batch d_proj", cls, w_tproj), "d_proj"),
                       batch="pair")
        sim = md.reduce_max(md.einsum("batch query d_proj, pair d_proj -> batch pair query", zi, zt), "query") / md.exp(log_temp)
        rows = md.arange(d["batch"])
        i2t = md.reduce_mean(md.cross_entropy(sim, rows, "pair"))
        t2i = md.reduce_mean(md.cross_entropy(md.rename(sim, {"batch": "img_row", "pair": "batch"}),
                                              rows, "img_row"))
        # ITM: the true caption (label 1) and the next row's (label 0)
        pooled = md.reduce_mean(q_out, "query")
        pos = md.einsum("batch d_model, d_model two -> batch two", pooled * cls, w_itm)
        neg = md.einsum("batch d_model, d_model two -> batch two", pooled * md.roll(cls, "batch", 1), w_itm)
        itm = md.reduce_mean(md.cross_entropy(pos, rows * 0 + 1, "two")) + \
            md.reduce_mean(md.cross_entropy(neg, rows * 0, "two"))
        loss = (i2t + t2i) / 2 + cfg.itm_weight * itm / 2

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"image_feats": torch.randn(cfg.batch, cfg.patches, cfg.d_img, generator=gen),
                "ids": torch.randint(0, cfg.vocab, (cfg.batch, cfg.tok), generator=gen)}

    params = {"queries": queries, "img_ln": img_ln, **{f"qc_{k}": v for k, v in qf_cross.items()},
              **{f"qp_{k}": v for k, v in qf_plain.items()}, **{f"tx_{k}": v for k, v in txt.items()}, "wte": wte,
              "wpe": wpe, "w_vproj": w_vproj, "w_tproj": w_tproj, "log_temp": log_temp, "w_itm": w_itm}
    return md.Model(g, loss, params, feeds, cfg)
