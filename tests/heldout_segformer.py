"""A SegFormer-style semantic segmenter, written from README.md and docs/ only (a held-out model).

A hierarchical encoder of two stages of different widths, each a ``md.repeat`` stack:

- stage 1: images ``[batch, height, width, channels]`` patchified (``patch x patch``) by
  ``md.rearrange`` and embedded to ``d1``: a grid ``[batch, h1, w1, d1]``; a stack over ``layer1``
  of pre-LN efficient self-attention (the keys and values from the grid reduced ``sr x sr`` by a
  strided reshape and a linear map, as SegFormer's spatial-reduction attention) and a Mix-FFN
  (a linear up, a 3x3 depthwise conv over ``h1``, ``w1``, gelu, a linear down);
- patch merging: ``(h2 r) (w2 s) d1 -> h2 w2 (r s d1)`` (a strided reshape) and a linear map to
  ``d2``; stage 2, a stack over ``layer2`` of the same blocks at width ``d2``.

The all-MLP decoder maps each stage's features to ``d_dec``, upsamples stage 2 to the stage-1
grid (nearest: each cell broadcast over ``r, s`` and merged back by a rearrange), concatenates
the two along ``d_cat``, fuses them with a linear map and a gelu, and predicts ``classes`` per
cell of the stage-1 grid; the loss is the per-pixel cross-entropy against ``labels
[batch, h1, w1]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 4
    size: int = 32
    channels: int = 3
    patch: int = 4
    d1: int = 16
    d2: int = 32
    heads: int = 2
    sr: int = 2
    layers1: int = 2
    layers2: int = 2
    d_dec: int = 32
    classes: int = 6

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=2, size=8, channels=2, patch=1, d1=8, d2=12, heads=2, sr=2, layers1=2, layers2=2,
                   d_dec=8, classes=3)


def build(cfg: Config = Config()) -> md.Model:
    g1 = cfg.size // cfg.patch
    assert g1 % 2 == 0 and g1 % cfg.sr == 0 and (g1 // 2) % cfg.sr == 0
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.size), md.Dim("width", cfg.size)
    channels, pix = md.Dim("channels", cfg.channels), md.Dim("pix", cfg.patch * cfg.patch * cfg.channels)
    heads, classes, d_dec = md.Dim("heads", cfg.heads), md.Dim("classes", cfg.classes), md.Dim("d_dec", cfg.d_dec)
    kh, kw = md.Dim("kh", 3), md.Dim("kw", 3)
    d1, d2 = md.Dim("d1", cfg.d1), md.Dim("d2", cfg.d2)

    def stage_params(i: int, d: md.Dim, L: md.Dim) -> dict[str, md.Tensor]:
        """Stage ``i``'s stacked params: width ``d`` (``d{i}``), head dim ``e{i}``, MLP ``f{i}``."""
        e, f = md.Dim(f"e{i}", d.size // cfg.heads), md.Dim(f"f{i}", 2 * d.size)
        red = md.Dim(f"red{i}", cfg.sr * cfg.sr * d.size)
        n, lo = L.name, [L.name]
        p = lambda name, shape, **kw: md.param(f"s{i}_{name}", shape, **kw)
        return {
            "ln1": p("ln1", [L, d], init="ones"),
            "wq": p("wq", [L, d, heads, e], fan_out=lo + ["heads", e.name]),
            "w_sr": p("w_sr", [L, red, d], fan_out=lo + [d.name]),
            "ln_sr": p("ln_sr", [L, d], init="ones"),
            "wk": p("wk", [L, d, heads, e], fan_out=lo + ["heads", e.name]),
            "wv": p("wv", [L, d, heads, e], fan_out=lo + ["heads", e.name]),
            "wo": p("wo", [L, heads, e, d], fan_out=lo + [d.name]),
            "ln2": p("ln2", [L, d], init="ones"),
            "w_up": p("w_up", [L, d, f], fan_out=lo + [f.name]),
            "w_dw": p("w_dw", [L, kh, kw, f], fan_out=lo + [f.name]),
            "w_down": p("w_down", [L, f, d], fan_out=lo + [d.name]),
        }

    def block_of(i: int):
        """Stage ``i``'s block over its grid ``[batch, h{i}, w{i}, d{i}]``."""
        h, w, d, e, f, red = f"h{i}", f"w{i}", f"d{i}", f"e{i}", f"f{i}", f"red{i}"
        grid = f"batch {h} {w}"

        def block(x, p):
            y = md.layer_norm(x, d, p["ln1"])
            q = md.einsum(f"{grid} {d}, {d} heads {e} -> {grid} heads {e}", y, p["wq"])
            # spatial reduction: sr x sr cells -> one key (a strided reshape, then a linear map)
            r = md.rename(md.rearrange(y, f"batch (sh r) (sw s) {d} -> batch (sh sw) (r s {d})", r=cfg.sr, s=cfg.sr),
                          sh_sw="keys", **{f"r_s_{d}": red})
            r = md.layer_norm(md.einsum(f"batch keys {red}, {red} {d} -> batch keys {d}", r, p["w_sr"]), d, p["ln_sr"])
            k, v = (md.einsum(f"batch keys {d}, {d} heads {e} -> batch keys heads {e}", r, p[n]) for n in ("wk", "wv"))
            s = md.einsum(f"{grid} heads {e}, batch keys heads {e} -> {grid} heads keys", q, k) * (q.shape[e].size ** -0.5)
            o = md.einsum(f"{grid} heads keys, batch keys heads {e} -> {grid} heads {e}", md.softmax(s, "keys"), v)
            x = x + md.einsum(f"{grid} heads {e}, heads {e} {d} -> {grid} {d}", o, p["wo"])
            y = md.einsum(f"{grid} {d}, {d} {f} -> {grid} {f}", md.layer_norm(x, d, p["ln2"]), p["w_up"])
            y = md.gelu(md.conv(y, p["w_dw"], {h: "kh", w: "kw"}, padding="same"))
            return x + md.einsum(f"{grid} {f}, {f} {d} -> {grid} {d}", y, p["w_down"])

        return block

    with md.Graph("heldout_segformer") as g:
        images = md.input("images", [batch, height, width, channels])
        labels = md.input("labels", [batch, md.Dim("h1", g1), md.Dim("w1", g1)], dtype=torch.int64)
        embed1 = md.param("embed1", [pix, d1], fan_out=["d1"])
        merge = md.Dim("merge", 4 * cfg.d1)
        embed2 = md.param("embed2", [merge, d2], fan_out=["d2"])
        st1 = stage_params(1, d1, md.Dim("layer1", cfg.layers1))
        st2 = stage_params(2, d2, md.Dim("layer2", cfg.layers2))
        dec = {
            "dec1": md.param("dec1", [d1, d_dec], fan_out=["d_dec"]),
            "dec2": md.param("dec2", [d2, d_dec], fan_out=["d_dec"]),
            "fuse": md.param("fuse", [md.Dim("d_cat", 2 * cfg.d_dec), d_dec], fan_out=["d_dec"]),
            "cls": md.param("cls", [d_dec, classes], fan_out=["classes"]),
        }

        px = md.rename(md.rearrange(images, "batch (h1 ph) (w1 pw) channels -> batch h1 w1 (ph pw channels)",
                                    ph=cfg.patch, pw=cfg.patch), ph_pw_channels="pix")
        x1 = md.einsum("batch h1 w1 pix, pix d1 -> batch h1 w1 d1", px, embed1)
        x1 = md.repeat(block_of(1), x1, st1, "layer1")
        m = md.rename(md.rearrange(x1, "batch (h2 r) (w2 s) d1 -> batch h2 w2 (r s d1)", r=2, s=2), r_s_d1="merge")
        x2 = md.einsum("batch h2 w2 merge, merge d2 -> batch h2 w2 d2", m, embed2)
        x2 = md.repeat(block_of(2), x2, st2, "layer2")

        f1 = md.rename(md.einsum("batch h1 w1 d1, d1 d_dec -> batch h1 w1 d_dec", x1, dec["dec1"]), d_dec="d_cat")
        f2 = md.einsum("batch h2 w2 d2, d2 d_dec -> batch h2 w2 d_dec", x2, dec["dec2"])
        up = md.broadcast_to(f2, [batch, f2.shape["h2"], md.Dim("r", 2), f2.shape["w2"], md.Dim("s", 2), d_dec])
        up = md.rename(md.rearrange(up, "batch h2 r w2 s d_dec -> batch (h2 r) (w2 s) d_dec"),
                       h2_r="h1", w2_s="w1", d_dec="d_cat")
        fused = md.gelu(md.einsum("batch h1 w1 d_cat, d_cat d_dec -> batch h1 w1 d_dec",
                                  md.concat([f1, up], "d_cat"), dec["fuse"]))
        logits = md.einsum("batch h1 w1 d_dec, d_dec classes -> batch h1 w1 classes", fused, dec["cls"])
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"images": torch.randn(cfg.batch, cfg.size, cfg.size, cfg.channels, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch, g1, g1), generator=gen)}

    params = {"embed1": embed1, "embed2": embed2, **{f"s1_{k}": t for k, t in st1.items()},
              **{f"s2_{k}": t for k, t in st2.items()}, **dec}
    return md.Model(g, loss, params, feeds, cfg)
