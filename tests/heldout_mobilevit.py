"""A MobileViT block classifier, written from the README and docs/ alone (a held-out model).

Images ``[batch, height, width, rgb]``: a 3x3 conv stem (``md.conv``, stride 1) to ``c``
channels, SiLU; then a MobileViT block: a local 3x3 conv and a 1x1 conv to ``d_model``; the map
unfolded into patches of ``ph x pw`` pixels by a rearrange, ``batch (h ph) (w pw) d_model ->
batch (ph pw) (h w) d_model``: each of the ``ph*pw`` pixel positions of a patch is a sequence of
``h*w`` tokens (one per patch), and a transformer (pre-norm, non-causal attention over ``h_w``,
a SiLU MLP, under ``md.repeat``) mixes the patches; folded back by the inverse rearrange, a 1x1
conv to ``c``, concatenated with the block's input on the channel dim and fused by a 3x3 conv;
global average pooling, a linear classifier and the cross entropy.

Legend: batch, height/width (the image), rgb, c chan (and c2, cat = 2c), d d_model, n heads,
e d_head, f d_ff, ph/pw (pixels in a patch), h/w (patches), ph_pw and h_w (merged), hk
(h_w renamed to key positions), kh/kw (taps), k classes, l layer.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    size: int = 32
    chan: int = 32
    d_model: int = 64
    heads: int = 4
    d_head: int = 16
    d_ff: int = 128
    patch: int = 2
    layers: int = 2
    classes: int = 10
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=2, size=8, chan=4, d_model=8, heads=2, d_head=4, d_ff=16, patch=2, layers=2, classes=5)


def build(cfg: Config = Config()) -> md.Model:
    P = cfg.patch
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.size), md.Dim("width", cfg.size)
    rgb, c, c2, cat = md.Dim("rgb", 3), md.Dim("chan", cfg.chan), md.Dim("c2", cfg.chan), md.Dim("cat", 2 * cfg.chan)
    d, n, e, f = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), \
        md.Dim("d_ff", cfg.d_ff)
    kh, kw, k, l = md.Dim("kh", 3), md.Dim("kw", 3), md.Dim("classes", cfg.classes), md.Dim("layer", cfg.layers)
    taps = {"height": "kh", "width": "kw"}
    with md.Graph("heldout_mobilevit") as g:
        img = md.input("images", [batch, height, width, rgb])
        label = md.input("label", [batch], torch.int64)
        p = {"stem": md.param("stem", [kh, kw, rgb, c], fan_out=[c]),
             "local": md.param("local", [kh, kw, c, c2], fan_out=[c2]),
             "to_d": md.param("to_d", [c2, d], fan_out=[d]),
             "from_d": md.param("from_d", [d, c2], fan_out=[c2]),
             "fuse": md.param("fuse", [kh, kw, cat, c2], fan_out=[c2]),
             "ln_f": md.param("ln_f", [d], init="ones"),
             "head": md.param("head", [c2, k], fan_out=[k])}
        blocks = {"ln1": md.param("ln1", [l, d], init="ones"),
                  "wq": md.param("wq", [l, d, n, e], fan_out=[l, n, e]),
                  "wk": md.param("wk", [l, d, n, e], fan_out=[l, n, e]),
                  "wv": md.param("wv", [l, d, n, e], fan_out=[l, n, e]),
                  "wo": md.param("wo", [l, n, e, d], fan_out=[l, d]),
                  "ln2": md.param("ln2", [l, d], init="ones"),
                  "w1": md.param("w1", [l, d, f], fan_out=[l, f]),
                  "w2": md.param("w2", [l, f, d], fan_out=[l, d])}

        def block(x, q):                                          # x [batch, ph_pw, h_w, d_model]
            z = md.layer_norm(x, "d_model", q["ln1"])
            proj = "batch ph_pw h_w d_model, d_model heads d_head -> batch ph_pw h_w heads d_head"
            kk = md.rename(md.einsum(proj, z, q["wk"]), h_w="hk")
            vv = md.rename(md.einsum(proj, z, q["wv"]), h_w="hk")
            y = md.attention(md.einsum(proj, z, q["wq"]), kk, vv, "h_w", "hk", "d_head", causal=False)
            x = x + md.einsum("batch ph_pw h_w heads d_head, heads d_head d_model -> batch ph_pw h_w d_model",
                              y, q["wo"])
            z = md.layer_norm(x, "d_model", q["ln2"])
            u = md.silu(md.einsum("batch ph_pw h_w d_model, d_model d_ff -> batch ph_pw h_w d_ff", z, q["w1"]))
            return x + md.einsum("batch ph_pw h_w d_ff, d_ff d_model -> batch ph_pw h_w d_model", u, q["w2"])

        x = md.silu(md.conv(img, p["stem"], taps, padding="same"))                     # [batch, height, width, chan]
        y = md.silu(md.conv(x, p["local"], taps, padding="same"))                      # [.., c2]
        y = md.einsum("batch height width c2, c2 d_model -> batch height width d_model", y, p["to_d"])
        y = md.rearrange(y, "batch (h ph) (w pw) d_model -> batch (ph pw) (h w) d_model", ph=P, pw=P)
        y = md.repeat(block, y, blocks, l, remat=cfg.remat)
        y = md.layer_norm(y, "d_model", p["ln_f"])
        y = md.rearrange(y, "batch (ph pw) (h w) d_model -> batch (h ph) (w pw) d_model",
                         ph=P, pw=P, h=cfg.size // P)
        y = md.rename(y, h_ph="height", w_pw="width")
        y = md.einsum("batch height width d_model, d_model c2 -> batch height width c2", y, p["from_d"])
        both = md.concat([md.rename(x, chan="cat"), md.rename(y, c2="cat")], "cat")
        y = md.silu(md.conv(both, p["fuse"], taps, padding="same"))                    # [.., c2]
        pooled = md.reduce_mean(y, ["height", "width"])
        logits = md.einsum("batch c2, c2 classes -> batch classes", pooled, p["head"])
        loss = md.reduce_mean(md.cross_entropy(logits, label, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        lab = torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)
        img = torch.randn(cfg.batch, cfg.size, cfg.size, 3, generator=gen) * 0.5
        img[..., 0] += lab[:, None, None].float() / cfg.classes            # a class cue in the red channel
        return {"images": img, "label": lab}

    return md.Model(g, loss, {**p, **blocks}, feeds, cfg)
