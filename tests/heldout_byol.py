"""BYOL and MoCo v3 self-supervised training of a small token encoder, written from the README and
docs/ alone (a held-out model, in the user's own dim names).

Each example comes as two augmented views, ``x [imgs, view, tok, pix]`` (``view`` = 2). The online
branch is an encoder (a linear token embedding plus learned positions, pre-norm blocks under
``md.repeat`` over ``layer``: fused non-causal attention and a gelu MLP; mean pooling over ``tok``),
a projector (linear, LayerNorm, relu, linear to ``proj``) and a predictor (the same shape, ``proj``
to ``proj``). The target branch is an encoder and projector of the same shapes whose params
(``t_*``, their stack over ``t_layer``) are left out of the Model's params: frozen, given as loaded
weights or, as BYOL's, the online weights' moving average (``ema``), updated in the compiled step
(``Model(updates=)``), and its output passes ``md.stop_gradient``.

``loss="byol"``: symmetric: each view's prediction against the other view's target projection,
``2 - 2 cos(p, z')``, the other view picked by ``md.roll`` over ``view``; averaged over examples
and views. ``loss="moco"``: MoCo v3's symmetric InfoNCE: each view's L2-normalised prediction
against the other view's target keys of every example in the batch (``[imgs, keys]`` logits over
a temperature; the label of example i is key i, made by ``md.arange``), times ``2 * tau``.

Legend: imgs (examples), view, tok (tokens), pix (a token's raw features), emb (model width),
heads, dh (head width), hid (MLP width), proj (projection), pred_hid (predictor width), keys.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    imgs: int = 16
    tokens: int = 16
    pix: int = 24
    emb: int = 32
    heads: int = 4
    dh: int = 8
    hid: int = 64
    proj: int = 16
    pred_hid: int = 32
    layers: int = 2
    tau: float = 0.2
    ema: float = 0.99           # the target's momentum (updated in the step: Model(updates=))
    loss: str = "byol"          # or "moco"
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(imgs=4, tokens=4, pix=6, emb=8, heads=2, dh=4, hid=16, proj=6, pred_hid=8, layers=2)


def _encoder(cfg: Config, pre: str, x: md.Tensor, layer: md.Dim, dims: dict) -> tuple[md.Tensor, dict]:
    """Token embedding, the block stack over ``layer`` and mean pooling: ``[imgs, view, emb]``."""
    emb, tok, heads, dh, hid = (dims[k] for k in ("emb", "tok", "heads", "dh", "hid"))
    lay = layer.name
    p = {
        "w_in": md.param(f"{pre}w_in", [dims["pix"], emb], fan_out=["emb"]),
        "pos": md.param(f"{pre}pos", [tok, emb], scale=0.02),
    }
    st = {
        "ln1": md.param(f"{pre}ln1", [layer, emb], init="ones"),
        "wq": md.param(f"{pre}wq", [layer, emb, heads, dh], fan_out=[lay, "heads", "dh"]),
        "wk": md.param(f"{pre}wk", [layer, emb, heads, dh], fan_out=[lay, "heads", "dh"]),
        "wv": md.param(f"{pre}wv", [layer, emb, heads, dh], fan_out=[lay, "heads", "dh"]),
        "wo": md.param(f"{pre}wo", [layer, heads, dh, emb], fan_out=[lay, "emb"]),
        "ln2": md.param(f"{pre}ln2", [layer, emb], init="ones"),
        "w1": md.param(f"{pre}w1", [layer, emb, hid], fan_out=[lay, "hid"]),
        "w2": md.param(f"{pre}w2", [layer, hid, emb], fan_out=[lay, "emb"]),
    }

    def block(h: md.Tensor, q: dict) -> md.Tensor:
        n = md.rms_norm(h, "emb", q["ln1"])
        proj = "imgs view tok emb, emb heads dh -> imgs view tok heads dh"
        qh = md.einsum(proj, n, q["wq"])
        kh = md.rename(md.einsum(proj, n, q["wk"]), tok="ktok")
        vh = md.rename(md.einsum(proj, n, q["wv"]), tok="ktok")
        o = md.attention(qh, kh, vh, "tok", "ktok", "dh", causal=False)
        h = h + md.einsum("imgs view tok heads dh, heads dh emb -> imgs view tok emb", o, q["wo"])
        n = md.rms_norm(h, "emb", q["ln2"])
        m = md.gelu(md.einsum("imgs view tok emb, emb hid -> imgs view tok hid", n, q["w1"]))
        return h + md.einsum("imgs view tok hid, hid emb -> imgs view tok emb", m, q["w2"])

    h = md.einsum("imgs view tok pix, pix emb -> imgs view tok emb", x, p["w_in"]) + p["pos"]
    h = md.repeat(block, h, st, lay, remat=cfg.remat)
    return md.reduce_mean(h, "tok"), {**p, **st}


def _mlp(pre: str, x: md.Tensor, d_in: md.Dim, d_hid: md.Dim, d_out: md.Dim) -> tuple[md.Tensor, dict]:
    """linear -> LayerNorm -> relu -> linear (BYOL's projector and predictor, LayerNorm for BN)."""
    p = {"a": md.param(f"{pre}a", [d_in, d_hid], fan_out=[d_hid.name]),
         "g": md.param(f"{pre}g", [d_hid], init="ones"), "b": md.param(f"{pre}b", [d_hid], init="zeros"),
         "o": md.param(f"{pre}o", [d_hid, d_out], fan_out=[d_out.name])}
    h = md.einsum(f"imgs view {d_in.name}, {d_in.name} {d_hid.name} -> imgs view {d_hid.name}", x, p["a"])
    h = md.relu(md.layer_norm(h, d_hid.name, p["g"], p["b"]))
    y = md.einsum(f"imgs view {d_hid.name}, {d_hid.name} {d_out.name} -> imgs view {d_out.name}", h, p["o"])
    return y, p


def _l2(x: md.Tensor, dim: str) -> md.Tensor:
    return x * md.rsqrt(md.reduce_sum(x * x, dim) + 1e-12)


def build(cfg: Config = Config()) -> md.Model:
    if cfg.loss not in ("byol", "moco"):
        raise ValueError(f"loss={cfg.loss!r}: 'byol' or 'moco'")
    dims = {"emb": md.Dim("emb", cfg.emb), "tok": md.Dim("tok", cfg.tokens), "heads": md.Dim("heads", cfg.heads),
            "dh": md.Dim("dh", cfg.dh), "hid": md.Dim("hid", cfg.hid), "pix": md.Dim("pix", cfg.pix)}
    imgs, view = md.Dim("imgs", cfg.imgs), md.Dim("view", 2)
    proj, proj_hid, pred_hid = md.Dim("proj", cfg.proj), md.Dim("proj_hid", cfg.hid), md.Dim("pred_hid", cfg.pred_hid)
    with md.Graph("heldout_byol") as graph:
        x = md.input("x", [imgs, view, dims["tok"], dims["pix"]])
        y, online = _encoder(cfg, "", x, md.Dim("layer", cfg.layers), dims)
        z, p_proj = _mlp("proj_", y, dims["emb"], proj_hid, proj)
        pred, p_pred = _mlp("pred_", z, proj, pred_hid, md.Dim("proj", cfg.proj))
        ty, t_enc = _encoder(cfg, "t_", x, md.Dim("t_layer", cfg.layers), dims)
        tz, t_proj = _mlp("t_proj_", ty, dims["emb"], proj_hid, proj)
        target = md.stop_gradient(md.roll(tz, "view", 1))        # the other view's target
        q, k = _l2(pred, "proj"), _l2(target, "proj")
        if cfg.loss == "byol":
            loss = md.reduce_mean(2.0 - 2.0 * md.reduce_sum(q * k, "proj"))
        else:
            keys = md.rename(k, imgs="keys")
            logits = md.einsum("imgs view proj, keys view proj -> imgs view keys", q, keys) * (1.0 / cfg.tau)
            labels = md.broadcast_to(md.arange(imgs), [imgs, view])
            loss = md.reduce_mean(md.cross_entropy(logits, labels, "keys")) * (2.0 * cfg.tau)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        base = torch.randn(cfg.imgs, 1, cfg.tokens, cfg.pix, generator=gen)
        views = base + 0.3 * torch.randn(cfg.imgs, 2, cfg.tokens, cfg.pix, generator=gen)
        return {"x": views}

    params = {**online, **{f"proj_{k}": v for k, v in p_proj.items()}, **{f"pred_{k}": v for k, v in p_pred.items()}}
    # the target follows the online encoder and projector by an EMA, in the compiled step
    pairs = [(f"t_{k}", t, online[k]) for k, t in t_enc.items()] + \
        [(f"t_proj_{k}", t, p_proj[k]) for k, t in t_proj.items()]
    updates = {name: cfg.ema * t + (1 - cfg.ema) * (md.rename(o, layer="t_layer") if "layer" in o.shape.names else o)
               for name, t, o in pairs}
    return md.Model(graph, loss, params, feeds, cfg, updates=updates)
