"""Held-out model (round 20b): SwinV2-lite image classifier.

Written from the user docs alone. Images ``[batch, height, width, c_img]`` are patchified by
``md.rearrange`` and embedded. Stage 1 is a ``md.repeat`` over ``layer`` of block pairs (a window
block, then a shifted-window block: ``md.roll`` by half a window along ``height`` and ``width``
and a mask keeping each token to its own region, as Swin's). Attention is SwinV2's: cosine
similarity of normalised q and k times a learned per-head logit scale (``exp`` of a param clamped
at log 100), plus a continuous position bias, ``16 sigmoid(MLP(log-spaced relative
coordinates))``, and res-post-norm (``x + LN(attn(x))``). Patch merging concatenates each 2x2
neighbourhood (a rearrange) and maps ``4 d_model -> d_model2``; a stage-2 window block, a mean
pool and a linear head end in the cross-entropy.

Legend: b batch, y/x height/width (patch grid), wy/wx win_h/win_w (windows), q query (a token of
a window), k key, h heads, e d_head, d d_model, f d_ff, c cpb (hidden of the bias MLP).
"""
import math
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    image: int = 16
    c_img: int = 3
    patch: int = 2
    window: int = 4
    d_model: int = 16
    heads: int = 2
    d_ff: int = 32
    cpb: int = 16
    layers: int = 2          # pairs (window block, shifted block) in stage 1
    classes: int = 4
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, image=8, patch=2, window=2, d_model=8, heads=2, d_ff=16, cpb=4,
                   layers=2, classes=3)


def _log_coords(d, ws):
    """SwinV2's log-spaced relative coordinate of an integer offset d in (-ws, ws)."""
    t = md.cast(d, torch.float32) * (8.0 / max(ws - 1, 1))
    return md.sign(t) * md.log1p(md.abs(t)) / math.log(8.0)


def _position_bias(p, cfg, query, key):
    """16 sigmoid(MLP(log-spaced (dy, dx))): [query, key, heads]."""
    ws = cfg.window
    qi, ki = md.arange(query), md.arange(key)
    dy = _log_coords(qi // ws - ki // ws, ws)
    dx = _log_coords(qi % ws - ki % ws, ws)
    hid = md.relu(dy * p["cpb_wy"] + dx * p["cpb_wx"] + p["cpb_b"])          # [query, key, cpb]
    return 16.0 * md.sigmoid(md.einsum("query key cpb, cpb heads -> query key heads", hid, p["cpb_w2"]))


def _region_mask(cfg, grid, shift, win_h, win_w, query, key):
    """Shifted windows: a token attends to keys of its own region of the rolled grid only."""
    ws = cfg.window

    def label(win, idx_dim, along):
        pos = md.arange(win) * ws + along(md.arange(idx_dim))             # rolled grid position
        return md.cast(md.greater_equal(pos, grid - ws), torch.int64) + \
            md.cast(md.greater_equal(pos, grid - shift), torch.int64)

    row = lambda i: i // ws  # noqa: E731
    col = lambda i: i % ws  # noqa: E731
    lab_q = label(win_h, query, row) * 3 + label(win_w, query, col)
    lab_k = label(win_h, key, row) * 3 + label(win_w, key, col)
    return md.equal(lab_q, lab_k)                                          # [win_h, win_w, query, key]


def _window_attention(x, p, cfg, shift, dm):
    """(Shifted) window cosine attention over x [batch, height, width, dm]."""
    ws, grid = cfg.window, x.shape["height"].size
    if shift:
        x = md.roll(md.roll(x, "height", -shift), "width", -shift)
    win = md.rearrange(x, f"batch (win_h ih) (win_w iw) {dm} -> batch win_h win_w (ih iw) {dm}",
                       ih=ws, iw=ws)
    win = md.rename(win, ih_iw="query")
    proj = lambda w: md.einsum(f"... {dm}, {dm} heads d_head -> ... heads d_head", win, w)  # noqa: E731
    q, k, v = proj(p["wq"]), proj(p["wk"]), proj(p["wv"])
    unit = lambda t: t * md.rsqrt(md.reduce_sum(t * t, "d_head") + 1e-6)  # noqa: E731
    k, v = md.rename(unit(k), query="key"), md.rename(v, query="key")
    scores = md.einsum("batch win_h win_w query heads d_head, batch win_h win_w key heads d_head "
                       "-> batch win_h win_w heads query key", unit(q), k)
    scores = scores * md.exp(md.clamp(p["logit_scale"], max=math.log(100.0)))
    query, key = scores.shape["query"], scores.shape["key"]
    scores = scores + _position_bias(p, cfg, query, key)
    if shift:
        keep = _region_mask(cfg, grid, shift, scores.shape["win_h"], scores.shape["win_w"], query, key)
        scores = md.where(keep, scores, -100.0)
    att = md.softmax(scores, "key")
    o = md.einsum("batch win_h win_w heads query key, batch win_h win_w key heads d_head "
                  "-> batch win_h win_w query heads d_head", att, v)
    o = md.einsum(f"... heads d_head, heads d_head {dm} -> ... {dm}", o, p["wo"])
    o = md.rearrange(md.rename(o, query="ih_iw"),
                     f"batch win_h win_w (ih iw) {dm} -> batch (win_h ih) (win_w iw) {dm}", ih=ws)
    o = md.rename(o, win_h_ih="height", win_w_iw="width")
    if shift:
        o = md.roll(md.roll(o, "height", shift), "width", shift)
    return o


def _block(x, p, cfg, shift, dm, df):
    """Res-post-norm: x + LN(attn(x)), then x + LN(mlp(x))."""
    x = x + md.layer_norm(_window_attention(x, p, cfg, shift, dm), dm, p["ln1"], p["ln1_b"])
    h = md.gelu(md.einsum(f"... {dm}, {dm} {df} -> ... {df}", x, p["w1"]))
    h = md.einsum(f"... {df}, {df} {dm} -> ... {dm}", h, p["w2"])
    return x + md.layer_norm(h, dm, p["ln2"], p["ln2_b"])


def _block_params(prefix, cfg, dm, df, lead=()):
    """One block's params; lead=(layer,) stacks them (lead dims are fan-out, not fan-in)."""
    H, E, C = md.Dim("heads", cfg.heads), md.Dim("d_head", dm.size // cfg.heads), md.Dim("cpb", cfg.cpb)
    lead, fo = list(lead), [d.name for d in lead]
    mk = lambda n, dims, **kw: md.param(f"{prefix}{n}", lead + dims, **kw)  # noqa: E731
    return {
        "wq": mk("wq", [dm, H, E], fan_out=fo + ["heads", "d_head"]),
        "wk": mk("wk", [dm, H, E], fan_out=fo + ["heads", "d_head"]),
        "wv": mk("wv", [dm, H, E], fan_out=fo + ["heads", "d_head"]),
        "wo": mk("wo", [H, E, dm], fan_out=fo + [dm.name]),
        "logit_scale": mk("logit_scale", [H], init=math.log(10.0)),
        "cpb_wy": mk("cpb_wy", [C], scale=1.0), "cpb_wx": mk("cpb_wx", [C], scale=1.0),
        "cpb_b": mk("cpb_b", [C], init="zeros"), "cpb_w2": mk("cpb_w2", [C, H], fan_out=fo + ["heads"]),
        "ln1": mk("ln1", [dm], init="ones"), "ln1_b": mk("ln1_b", [dm], init="zeros"),
        "ln2": mk("ln2", [dm], init="ones"), "ln2_b": mk("ln2_b", [dm], init="zeros"),
        "w1": mk("w1", [dm, df], fan_out=fo + [df.name]), "w2": mk("w2", [df, dm], fan_out=fo + [dm.name]),
    }


def build(cfg: Config = Config()) -> md.Model:
    B, C = md.Dim("batch", cfg.batch), md.Dim("c_img", cfg.c_img)
    Y, X = md.Dim("img_h", cfg.image), md.Dim("img_w", cfg.image)
    D, F = md.Dim("d_model", cfg.d_model), md.Dim("d_ff", cfg.d_ff)
    D2, F2 = md.Dim("d_model2", 2 * cfg.d_model), md.Dim("d_ff2", 2 * cfg.d_ff)
    L, K = md.Dim("layer", cfg.layers), md.Dim("classes", cfg.classes)
    pin = md.Dim("patch_in", cfg.patch * cfg.patch * cfg.c_img)
    with md.Graph("swinv2") as g:
        img = md.input("image", [B, Y, X, C])
        labels = md.input("labels", [B], torch.int64)
        x = md.rearrange(img, "batch (height ph) (width pw) c_img -> batch height width (ph pw c_img)",
                         ph=cfg.patch, pw=cfg.patch)
        x = md.rename(x, ph_pw_c_img="patch_in")
        x = md.einsum("... patch_in, patch_in d_model -> ... d_model", x,
                      md.param("embed", [pin, D], fan_out=["d_model"]))
        x = md.layer_norm(x, "d_model", md.param("ln_emb", [D], init="ones"),
                          md.param("ln_emb_b", [D], init="zeros"))
        stacked = {f"{half}{k}": v for half in ("a_", "b_")
                   for k, v in _block_params(f"s1{half}", cfg, D, F, lead=(L,)).items()}

        def pair(h, p):
            h = _block(h, {k[2:]: v for k, v in p.items() if k.startswith("a_")}, cfg, 0, "d_model", "d_ff")
            return _block(h, {k[2:]: v for k, v in p.items() if k.startswith("b_")}, cfg,
                          cfg.window // 2, "d_model", "d_ff")

        x = md.repeat(pair, x, stacked, "layer", remat=None if cfg.remat == "none" else cfg.remat)
        x = md.rearrange(x, "batch (height ph) (width pw) d_model -> batch height width (ph pw d_model)",
                         ph=2, pw=2)
        x = md.layer_norm(md.rename(x, ph_pw_d_model="d_merge"), "d_merge",
                          md.param("ln_merge", [md.Dim("d_merge", 4 * cfg.d_model)], init="ones"))
        x = md.einsum("... d_merge, d_merge d_model2 -> ... d_model2", x,
                      md.param("merge", [md.Dim("d_merge", 4 * cfg.d_model), D2], fan_out=["d_model2"]))
        x = _block(x, _block_params("s2", cfg, D2, F2), cfg, 0, "d_model2", "d_ff2")
        pooled = md.reduce_mean(x, ["height", "width"])
        logits = md.einsum("batch d_model2, d_model2 classes -> batch classes", pooled,
                           md.param("head", [D2, K], fan_out=["classes"]))
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))
        acc = md.reduce_mean(md.cast(md.equal(md.argmax(logits, "classes"), labels), torch.float32))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)
        img = 0.3 * torch.randn(cfg.batch, cfg.image, cfg.image, cfg.c_img, generator=gen)
        img[:, :, :, 0] += labels[:, None, None].float() * torch.linspace(-1, 1, cfg.image)[None, :, None]
        return {"image": img, "labels": labels}

    return md.Model(g, loss, g.params(), feeds, cfg, metrics={"accuracy": acc})
