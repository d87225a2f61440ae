"""A PoolFormer (MetaFormer) image classifier, written from the README and docs/ alone (a held-out model).

Images ``[batch, height, width, chan]``. Two stages, each a strided patch-embedding conv
(``md.conv`` 3x3, stride 2, padding (1, 1)) and blocks under ``md.repeat``. A block:
``x + ls1 * (pool(GN(x)) - GN(x))`` and ``x + ls2 * MLP(GN(x))``, GN a GroupNorm of one group
(mean and variance over height, width and channels, a per-channel scale and bias), the MLP two
1x1 convs (einsums) with a GELU, ``ls*`` layer scales. ``pool`` is a 3x3 average pool of stride 1
with ``count_include_pad=False`` (PoolFormer's): the 3x3 sum divided by the number of in-image
taps at each position (a constant ``[height, width]``). ``pool`` picks how the sum is written:
``"conv"`` a depthwise ``md.conv`` with a constant all-ones ``[kh, kw, chan]`` filter, ``"shift"``
the sum of nine 2-D ``md.shift``s. The head: GN, mean over the positions, a linear classifier, CE.

Legend: b batch, H/W height/width (stage 1: h1/w1, stage 2: h2/w2), c chan, d1/d2 stage widths,
f1/f2 MLP widths, K classes, l1/l2 layers.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    image: int = 32
    chan: int = 3
    d1: int = 32
    d2: int = 64
    layers1: int = 2
    layers2: int = 2
    classes: int = 10
    batch: int = 8
    pool: str = "conv"
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(image=8, chan=3, d1=4, d2=8, layers1=2, layers2=2, classes=5, batch=2)


def group_norm(x, hw: tuple[str, str], ch: str, scale, bias, eps: float = 1e-5):
    """GroupNorm with one group: statistics over the positions and the channels of each image."""
    over = [*hw, ch]
    mu = md.reduce_mean(x, over)
    xc = x - mu
    var = md.reduce_mean(xc * xc, over)
    return xc * md.rsqrt(var + eps) * scale + bias


def avg_pool(x, hw: tuple[str, str], ch: str, pool: str):
    """3x3 average, stride 1, padding 1, count_include_pad=False."""
    hd, wd, cd = x.shape[hw[0]], x.shape[hw[1]], x.shape[ch]
    if pool == "conv":
        ones = md.constant(torch.ones(3, 3, cd.size), [md.Dim("kh", 3), md.Dim("kw", 3), cd])
        total = md.conv(x, ones, {hw[0]: "kh", hw[1]: "kw"}, padding="same")
    else:
        total = None
        for i in (-1, 0, 1):
            for j in (-1, 0, 1):
                t = md.shift(md.shift(x, hw[0], i), hw[1], j)
                total = t if total is None else total + t
    rows = torch.tensor([min(i + 1, hd.size - 1) - max(i - 1, 0) + 1 for i in range(hd.size)], dtype=torch.float32)
    cols = torch.tensor([min(j + 1, wd.size - 1) - max(j - 1, 0) + 1 for j in range(wd.size)], dtype=torch.float32)
    return total / md.constant(rows[:, None] * cols[None, :], [hd, wd])


def stage_block(hw: tuple[str, str], dm: str, ff: str, pool: str):
    def block(x, p):
        z = group_norm(x, hw, dm, p["gn1"], p["gn1_b"])
        x = x + p["ls1"] * (avg_pool(z, hw, dm, pool) - z)
        z = group_norm(x, hw, dm, p["gn2"], p["gn2_b"])
        u = md.gelu(md.einsum(f"batch {hw[0]} {hw[1]} {dm}, {dm} {ff} -> batch {hw[0]} {hw[1]} {ff}", z, p["fc1"]) + p["fc1_b"])
        y = md.einsum(f"batch {hw[0]} {hw[1]} {ff}, {ff} {dm} -> batch {hw[0]} {hw[1]} {dm}", u, p["fc2"]) + p["fc2_b"]
        return x + p["ls2"] * y
    return block


def stage_params(prefix: str, L: md.Dim, d: md.Dim, f: md.Dim) -> dict:
    p = {k: md.param(f"{prefix}{k}", [L, d], init="ones") for k in ("gn1", "gn2")}
    p.update({k: md.param(f"{prefix}{k}", [L, d], init="zeros") for k in ("gn1_b", "gn2_b", "fc2_b")})
    p.update({k: md.param(f"{prefix}{k}", [L, d], scale=0.1) for k in ("ls1", "ls2")})
    p["fc1"] = md.param(f"{prefix}fc1", [L, d, f], fan_out=[L, f])
    p["fc1_b"] = md.param(f"{prefix}fc1_b", [L, f], init="zeros")
    p["fc2"] = md.param(f"{prefix}fc2", [L, f, d], fan_out=[L, d])
    return p


def build(cfg: Config = Config()) -> md.Model:
    b, c = md.Dim("batch", cfg.batch), md.Dim("chan", cfg.chan)
    H, W = md.Dim("height", cfg.image), md.Dim("width", cfg.image)
    d1, d2 = md.Dim("d1", cfg.d1), md.Dim("d2", cfg.d2)
    f1, f2 = md.Dim("f1", 4 * cfg.d1), md.Dim("f2", 4 * cfg.d2)
    K, l1, l2 = md.Dim("classes", cfg.classes), md.Dim("layer1", cfg.layers1), md.Dim("layer2", cfg.layers2)
    kh, kw = md.Dim("kh", 3), md.Dim("kw", 3)
    with md.Graph("heldout_poolformer") as g:
        images = md.input("images", [b, H, W, c])
        labels = md.input("labels", [b], torch.int64)
        embed1 = md.param("embed1", [kh, kw, c, d1], fan_out=[d1])
        embed1_b = md.param("embed1_b", [d1], init="zeros")
        embed2 = md.param("embed2", [kh, kw, d1, d2], fan_out=[d2])
        embed2_b = md.param("embed2_b", [d2], init="zeros")
        gn_f, gn_f_b = md.param("gn_f", [d2], init="ones"), md.param("gn_f_b", [d2], init="zeros")
        w_head = md.param("w_head", [d2, K], fan_out=[K])
        s1, s2 = stage_params("s1_", l1, d1, f1), stage_params("s2_", l2, d2, f2)

        x = md.conv(images, embed1, {"height": "kh", "width": "kw"}, padding=(1, 1), stride=2) + embed1_b
        x = md.rename(x, height="h1", width="w1")
        x = md.repeat(stage_block(("h1", "w1"), "d1", "f1", cfg.pool), x, s1, l1, remat=cfg.remat)
        x = md.conv(x, embed2, {"h1": "kh", "w1": "kw"}, padding=(1, 1), stride=2) + embed2_b
        x = md.rename(x, h1="h2", w1="w2")
        x = md.repeat(stage_block(("h2", "w2"), "d2", "f2", cfg.pool), x, s2, l2, remat=cfg.remat)
        pooled = md.reduce_mean(group_norm(x, ("h2", "w2"), "d2", gn_f, gn_f_b), ["h2", "w2"])
        logits = md.einsum("batch d2, d2 classes -> batch classes", pooled, w_head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"images": torch.randn(cfg.batch, cfg.image, cfg.image, cfg.chan, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    params = {"embed1": embed1, "embed1_b": embed1_b, "embed2": embed2, "embed2_b": embed2_b,
              "gn_f": gn_f, "gn_f_b": gn_f_b, "w_head": w_head,
              **{f"s1_{k}": t for k, t in s1.items()}, **{f"s2_{k}": t for k, t in s2.items()}}
    return md.Model(g, loss, params, feeds, cfg)
