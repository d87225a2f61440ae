"""An FT-Transformer for tabular data, written from the README and docs/ alone (a held-out model).

Every feature becomes a token: a numeric feature ``j`` with value ``x_j`` is ``x_j * W[j] + B[j]``
(its own weight and bias row), a categorical feature ``j`` with category ``c`` is row ``c`` of its
own table ``E[j]`` (a one-hot contraction, one table per feature) plus a bias. The numeric and
categorical tokens (renamed onto one ``tok`` dim) and a learned [CLS] token are concatenated;
pre-norm Transformer layers (non-causal attention, a ReGLU MLP) run over the tokens, and the
[CLS] row (sliced out and squeezed) feeds a LayerNorm-ReLU-linear head with a cross-entropy
over ``classes``.

Legend: b batch, n num_feat, c cat_feat, k card, t tok/key_tok, d d_model, h heads, e d_head.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    num_feat: int = 6
    cat_feat: int = 3
    card: int = 8
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 3
    classes: int = 5
    batch: int = 16
    cls: str = "first"       # or "last": where the [CLS] token goes
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(num_feat=4, cat_feat=2, card=5, d_model=16, heads=2, d_head=8, d_ff=24, layers=2,
                   classes=3, batch=6)


def build(cfg: Config = Config()) -> md.Model:
    b, n, c = md.Dim("batch", cfg.batch), md.Dim("num_feat", cfg.num_feat), md.Dim("cat_feat", cfg.cat_feat)
    k, d, h = md.Dim("card", cfg.card), md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads)
    e, f, L = md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    ncls, one = md.Dim("classes", cfg.classes), md.Dim("tok", 1)
    ntok = cfg.num_feat + cfg.cat_feat + 1
    with md.Graph("heldout_ftt") as graph:
        x_num = md.input("x_num", [b, n])
        x_cat = md.input("x_cat", [b, c], dtype=torch.int64)
        y = md.input("y", [b], dtype=torch.int64)
        w_num, b_num = md.param("w_num", [n, d], fan_out=["num_feat", "d_model"]), md.param("b_num", [n, d], scale=0.1)
        emb = md.param("emb", [c, k, d], fan_out=["cat_feat", "card", "d_model"])
        b_cat = md.param("b_cat", [c, d], scale=0.1)
        cls_tok = md.param("cls_tok", [one, d], scale=0.5)
        p = {
            "ln1": md.param("ln1", [L, d], init="ones"), "ln1_b": md.param("ln1_b", [L, d], init="zeros"),
            "wq": md.param("wq", [L, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [L, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wv": md.param("wv", [L, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wo": md.param("wo", [L, h, e, d], fan_out=["layer", "d_model"]),
            "ln2": md.param("ln2", [L, d], init="ones"), "ln2_b": md.param("ln2_b", [L, d], init="zeros"),
            "w_a": md.param("w_a", [L, d, f], fan_out=["layer", "d_ff"]),
            "w_g": md.param("w_g", [L, d, f], fan_out=["layer", "d_ff"]),
            "w_o": md.param("w_o", [L, f, d], fan_out=["layer", "d_model"]),
        }
        lnh, lnh_b = md.param("lnh", [d], init="ones"), md.param("lnh_b", [d], init="zeros")
        w_head = md.param("w_head", [d, ncls], fan_out=["classes"])

        num_tok = md.rename(x_num * w_num + b_num, num_feat="tok")                      # [b, n, d]
        cat_tok = md.einsum("batch cat_feat card, cat_feat card d_model -> batch cat_feat d_model",
                            md.one_hot(x_cat, k), emb) + b_cat
        cat_tok = md.rename(cat_tok, cat_feat="tok")
        cls_b = md.broadcast_to(cls_tok, [b, one, d])
        parts = [cls_b, num_tok, cat_tok] if cfg.cls == "first" else [num_tok, cat_tok, cls_b]
        x0 = md.concat(parts, "tok")

        def block(x, p):
            nx = md.layer_norm(x, "d_model", p["ln1"], p["ln1_b"])
            q = md.einsum("batch tok d_model, d_model heads d_head -> batch tok heads d_head", nx, p["wq"])
            nk = md.rename(nx, tok="key_tok")
            kk = md.einsum("batch key_tok d_model, d_model heads d_head -> batch key_tok heads d_head", nk, p["wk"])
            vv = md.einsum("batch key_tok d_model, d_model heads d_head -> batch key_tok heads d_head", nk, p["wv"])
            o = md.attention(q, kk, vv, "tok", "key_tok", "d_head", causal=False)
            x = x + md.einsum("batch tok heads d_head, heads d_head d_model -> batch tok d_model", o, p["wo"])
            nx = md.layer_norm(x, "d_model", p["ln2"], p["ln2_b"])
            a = md.einsum("batch tok d_model, d_model d_ff -> batch tok d_ff", nx, p["w_a"])
            g = md.einsum("batch tok d_model, d_model d_ff -> batch tok d_ff", nx, p["w_g"])
            return x + md.einsum("batch tok d_ff, d_ff d_model -> batch tok d_model", a * md.relu(g), p["w_o"])

        x = md.repeat(block, x0, p, "layer", remat=cfg.remat)
        at = 0 if cfg.cls == "first" else ntok - 1
        z = md.squeeze(md.slice_(x, "tok", at, at + 1), "tok")
        logits = md.einsum("batch d_model, d_model classes -> batch classes",
                           md.relu(md.layer_norm(z, "d_model", lnh, lnh_b)), w_head)
        loss = md.reduce_mean(md.cross_entropy(logits, y, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x_num = torch.randn(cfg.batch, cfg.num_feat, generator=g)
        x_cat = torch.randint(0, cfg.card, (cfg.batch, cfg.cat_feat), generator=g)
        y = ((x_num[:, 0] > 0).long() + x_cat[:, 0]) % cfg.classes
        return {"x_num": x_num, "x_cat": x_cat, "y": y}

    params = {"w_num": w_num, "b_num": b_num, "emb": emb, "b_cat": b_cat, "cls_tok": cls_tok, **p,
              "lnh": lnh, "lnh_b": lnh_b, "w_head": w_head}
    return md.Model(graph, loss, params, feeds, cfg, logits=logits)
