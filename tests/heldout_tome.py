"""A ViT with token merging (ToMe, Bolya et al.), a held-out model written from the docs alone.

Every block runs attention (proportional: each key's score gets ``log(size)``, its count of
merged patches) and an MLP, then merges ``r`` pairs of patch tokens by bipartite soft matching:
the tokens are cut into even (``a``) and odd (``b``) ones, each ``a`` finds its most similar
``b`` by the cosine similarity of their keys (mean over heads; ``md.argmax``), the ``r`` ``a``
tokens with the best matches (``md.top_k``) are averaged into their partners weighted by size,
and the remaining ``a`` tokens are kept. Picking rows per example is a one-hot contraction, as
the docs' per-sample gather. The class token is never merged; its final state goes through a
LayerNorm to the class logits and the cross-entropy.

Forms (``--config form=...``):
  tome: the merging blocks above, unrolled (each block has fewer tokens than the one before).
  vit:  no merging, the blocks under ``md.repeat`` (a plain ViT, for the pipeline layouts).

Legend: b batch, t tok (patches), k key_tok, a/b even/odd tokens, h heads, e d_head, d d_model,
f d_ff, c classes.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    image: int = 16
    patch: int = 4
    channels: int = 3
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    r: int = 3
    classes: int = 5
    form: str = "tome"
    remat: str = "none"

    @classmethod
    def tiny(cls):
        return cls(batch=4, image=8, patch=2, channels=2, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, r=2, classes=3)


def attention_block(x, size, p):
    """Pre-norm proportional attention and MLP over x [batch, tok, d_model] with token sizes
    size [batch, tok]; returns the new x and the keys averaged over heads [batch, tok, d_head]."""
    y = md.layer_norm(x, "d_model", p["ln1"])
    q = md.einsum("batch tok d_model, d_model heads d_head -> batch tok heads d_head", y, p["wq"])
    k = md.einsum("batch tok d_model, d_model heads d_head -> batch tok heads d_head", y, p["wk"])
    v = md.einsum("batch tok d_model, d_model heads d_head -> batch tok heads d_head", y, p["wv"])
    k_, v_ = md.rename(k, tok="key_tok"), md.rename(v, tok="key_tok")
    scores = md.einsum("batch tok heads d_head, batch key_tok heads d_head -> batch heads tok key_tok", q, k_)
    att = md.softmax(scores * q.shape["d_head"].size ** -0.5 + md.log(md.rename(size, tok="key_tok")), "key_tok")
    o = md.einsum("batch heads tok key_tok, batch key_tok heads d_head -> batch tok heads d_head", att, v_)
    x = x + md.einsum("batch tok heads d_head, heads d_head d_model -> batch tok d_model", o, p["wo"])
    y = md.layer_norm(x, "d_model", p["ln2"])
    h = md.gelu(md.einsum("batch tok d_model, d_model d_ff -> batch tok d_ff", y, p["w1"]))
    return x + md.einsum("batch tok d_ff, d_ff d_model -> batch tok d_model", h, p["w2"]), md.reduce_mean(k, "heads")


def _halves(t):
    """Even and odd tokens of t [batch, tok, ...] as dims ``a`` and ``b``."""
    rest = " ".join(n for n in t.shape.names if n not in ("batch", "tok"))
    pairs = md.rearrange(t, f"batch (half two) {rest} -> batch half two {rest}", two=2)
    a = md.rename(md.squeeze(md.slice_(pairs, "two", 0, 1), "two"), half="a")
    b = md.rename(md.squeeze(md.slice_(pairs, "two", 1, 2), "two"), half="b")
    return a, b


def merge(x, size, key, r: int):
    """Bipartite soft matching: merge the r best-matched even tokens into their odd partners."""
    ka, kb = _halves(key)
    ka = ka * md.rsqrt(md.reduce_sum(ka * ka, "d_head"))
    kb = kb * md.rsqrt(md.reduce_sum(kb * kb, "d_head"))
    sim = md.einsum("batch a d_head, batch b d_head -> batch a b", ka, kb)
    best, partner = md.reduce_max(sim, "b"), md.argmax(sim, "b")               # [batch, a]
    num_a = best.shape["a"]
    _, merged_ids = md.top_k(best, "a", r, new_dim="m")
    _, kept_ids = md.top_k(-best, "a", num_a.size - r, new_dim="u")
    merged = md.reduce_sum(md.one_hot(merged_ids, num_a), "m")                  # [batch, a]: 1 if merged
    send = merged * md.one_hot(partner, kb.shape["b"])                           # [batch, a, b]
    xa, xb = _halves(x * size)
    sa, sb = _halves(size)
    pick = md.one_hot(kept_ids, num_a)                                           # [batch, u, a]
    kept_x = md.einsum("batch u a, batch a d_model -> batch u d_model", pick, xa)
    kept_s = md.einsum("batch u a, batch a -> batch u", pick, sa)
    xb = xb + md.einsum("batch a b, batch a d_model -> batch b d_model", send, xa)
    sb = sb + md.einsum("batch a b, batch a -> batch b", send, sa)
    new_s = md.concat([md.rename(kept_s, u="tok"), md.rename(sb, b="tok")], "tok")
    new_x = md.concat([md.rename(kept_x, u="tok"), md.rename(xb, b="tok")], "tok")
    return new_x / new_s, new_s


def _block_params(cfg, lead, fo, suffix=""):
    D, H, E, F = (md.Dim(n, s) for n, s in [("d_model", cfg.d_model), ("heads", cfg.heads), ("d_head", cfg.d_head), ("d_ff", cfg.d_ff)])
    return {
        "ln1": md.param(f"ln1{suffix}", lead + [D], init="ones"),
        "ln2": md.param(f"ln2{suffix}", lead + [D], init="ones"),
        "wq": md.param(f"wq{suffix}", lead + [D, H, E], fan_out=fo + ["heads", "d_head"]),
        "wk": md.param(f"wk{suffix}", lead + [D, H, E], fan_out=fo + ["heads", "d_head"]),
        "wv": md.param(f"wv{suffix}", lead + [D, H, E], fan_out=fo + ["heads", "d_head"]),
        "wo": md.param(f"wo{suffix}", lead + [H, E, D], fan_out=fo + ["d_model"]),
        "w1": md.param(f"w1{suffix}", lead + [D, F], fan_out=fo + ["d_ff"]),
        "w2": md.param(f"w2{suffix}", lead + [F, D], fan_out=fo + ["d_model"]),
    }


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("tome", "vit"):
        raise md.ModelError(f"tome: form={cfg.form!r}; expected 'tome' or 'vit'")
    n = cfg.image // cfg.patch
    if cfg.form == "tome" and (n * n) // 2 - cfg.layers * cfg.r < 1 + cfg.r:
        raise md.ModelError(f"tome: {n * n} patches cannot lose r={cfg.r} tokens in each of {cfg.layers} layers")
    B, Hh, Ww, Cc = (md.Dim(k, s) for k, s in [("batch", cfg.batch), ("height", cfg.image), ("width", cfg.image), ("channels", cfg.channels)])
    D, C = md.Dim("d_model", cfg.d_model), md.Dim("classes", cfg.classes)
    P = md.Dim("pix", cfg.patch * cfg.patch * cfg.channels)
    with md.Graph() as g:
        img = md.input("image", [B, Hh, Ww, Cc])
        labels = md.input("labels", [B], dtype=torch.int64)
        params = {"w_patch": md.param("w_patch", [P, D], fan_out=["d_model"]),
                  "pos": md.param("pos", [md.Dim("tok", n * n), D], scale=0.02),
                  "cls": md.param("cls", [md.Dim("tok", 1), D], scale=0.02),
                  "lnf": md.param("lnf", [D], init="ones"),
                  "head": md.param("head", [D, C], fan_out=["classes"])}
        patches = md.rearrange(img, "batch (ph p1) (pw p2) channels -> batch (ph pw) (p1 p2 channels)", p1=cfg.patch, p2=cfg.patch)
        patches = md.rename(patches, ph_pw="tok", p1_p2_channels="pix")
        x = md.einsum("batch tok pix, pix d_model -> batch tok d_model", patches, params["w_patch"]) + params["pos"]
        x = md.concat([md.broadcast_to(params["cls"], [B, md.Dim("tok", 1), D]), x], "tok")
        ones = md.broadcast_to(md.constant(1.0), [B, md.Dim("tok", n * n + 1)])
        if cfg.form == "vit":
            stacked = _block_params(cfg, [md.Dim("layer", cfg.layers)], ["layer"])
            params.update(stacked)
            x = md.repeat(lambda h, p: attention_block(h, ones, p)[0], x, stacked, "layer", remat=cfg.remat)
        else:
            size = ones
            for i in range(cfg.layers):
                p = _block_params(cfg, [], [], str(i))
                params.update({f"{k}{i}": v for k, v in p.items()})
                x, key = attention_block(x, size, p)
                num = x.shape["tok"].size
                cls_x, cls_s = md.slice_(x, "tok", 0, 1), md.slice_(size, "tok", 0, 1)
                rest_x, rest_s = md.slice_(x, "tok", 1, num), md.slice_(size, "tok", 1, num)
                new_x, new_s = merge(rest_x, rest_s, md.slice_(key, "tok", 1, num), cfg.r)
                x, size = md.concat([cls_x, new_x], "tok"), md.concat([cls_s, new_s], "tok")
        cls_out = md.layer_norm(md.squeeze(md.slice_(x, "tok", 0, 1), "tok"), "d_model", params["lnf"])
        logits = md.einsum("batch d_model, d_model classes -> batch classes", cls_out, params["head"])
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        return {"image": torch.randn(cfg.batch, cfg.image, cfg.image, cfg.channels, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, params, make_feeds, cfg)
