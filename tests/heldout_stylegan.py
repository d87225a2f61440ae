"""StyleGAN2-lite, written from the docs alone: a mapping MLP z -> w, a stack of modulated 3x3
convs with weight demodulation and fed noise, a toRGB head, a small discriminator and the
non-saturating GAN loss (``loss=gan``) or a regression to a target image (``loss=regress``).

``form=fused`` builds each sample's own weights ``w' = W * s`` normalised over in-channels x taps
and convolves by one einsum per tap (shifted inputs); ``form=conv`` builds the same weights and
convolves by one ``md.conv(..., per="batch")`` (each sample its own filters); ``form=scaled`` scales
the input by ``s``, runs a plain ``md.conv`` and scales the output by the demodulation factor (the
same numbers).

Legend: b batch, h height, w width, c channels (in), o c_out, z z_dim, s style (w_dim), l layer.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    z_dim: int = 16
    w_dim: int = 16
    channels: int = 16
    res: int = 16
    layers: int = 4
    map_layers: int = 2
    d_channels: int = 16
    form: str = "fused"      # fused | conv | scaled
    loss: str = "gan"        # gan | regress
    remat: str = "none"

    @classmethod
    def tiny(cls):
        return cls(batch=4, z_dim=6, w_dim=6, channels=6, res=6, layers=4, map_layers=2, d_channels=5)


def _dims(cfg):
    return dict(b=md.Dim("batch", cfg.batch), z=md.Dim("z_dim", cfg.z_dim), s=md.Dim("w_dim", cfg.w_dim),
                c=md.Dim("channels", cfg.channels), o=md.Dim("c_out", cfg.channels),
                h=md.Dim("height", cfg.res), w=md.Dim("width", cfg.res), kh=md.Dim("kh", 3), kw=md.Dim("kw", 3),
                l=md.Dim("layer", cfg.layers), m=md.Dim("map_layer", cfg.map_layers),
                d=md.Dim("d_channels", cfg.d_channels), rgb=md.Dim("rgb", 3))


def _mapping(z, p):
    """The mapping MLP: z normalised (pixel norm), then leaky-relu layers z_dim -> w_dim."""
    z = z * md.rsqrt(md.reduce_mean(z * z, "z_dim") + 1e-8)
    h = md.leaky_relu(md.einsum("batch z_dim, z_dim w_dim -> batch w_dim", z, p["map_in"]), 0.2)

    def layer(x, q):
        y = md.einsum("batch w_dim, w_dim w_out -> batch w_out", x, q["map_w"])
        return md.leaky_relu(md.rename(y, w_out="w_dim") + q["map_b"], 0.2)

    return md.repeat(layer, h, {"map_w": p["map_w"], "map_b": p["map_b"]}, "map_layer")


def _demodulated(wt, style):
    """Per-sample weights w' = W * s, demodulated over (channels, kh, kw): [b, kh, kw, c, o]."""
    wmod = wt * style
    return wmod * md.rsqrt(md.reduce_sum(wmod * wmod, ["channels", "kh", "kw"]) + 1e-8)


def _modconv_conv(x, wt, style):
    """The per-sample weights by one conv: each sample's own 3x3 filters (per='batch')."""
    return md.conv(x, _demodulated(wt, style), {"height": "kh", "width": "kw"}, padding="same", per="batch")


def _modconv_fused(x, wt, style):
    """The per-sample weights by one einsum per tap (shifted inputs)."""
    wmod = _demodulated(wt, style)
    y = None
    for i in range(3):
        xh = md.shift(x, "height", 1 - i)
        for j in range(3):
            xs = md.shift(xh, "width", 1 - j)
            tap = md.squeeze(md.squeeze(md.slice_(md.slice_(wmod, "kh", i, i + 1), "kw", j, j + 1), "kh"), "kw")
            t = md.einsum("batch height width channels, batch channels c_out -> batch height width c_out", xs, tap)
            y = t if y is None else y + t
    return y


def _modconv_scaled(x, wt, style):
    """The same conv as input scaling: conv(x * s, W) * demod, demod from W and s alone."""
    demod = md.rsqrt(md.einsum("kh kw channels c_out, batch channels -> batch c_out", wt * wt, style * style) + 1e-8)
    y = md.conv(x * style, wt, {"height": "kh", "width": "kw"}, padding="same")
    return y * demod


def _generator(cfg, d, p, w_lat, noise):
    const = md.broadcast_to(p["const"], [d["b"], d["h"], d["w"], d["c"]])
    modconv = {"fused": _modconv_fused, "conv": _modconv_conv, "scaled": _modconv_scaled}[cfg.form]

    def block(x, q):
        style = md.einsum("batch w_dim, w_dim channels -> batch channels", w_lat, q["affine"]) + 1.0
        y = modconv(x, q["conv"], style)
        y = y + q["noise_strength"] * q["noise"] + q["bias"]
        return md.rename(md.leaky_relu(y, 0.2), c_out="channels")

    x = md.repeat(block, const, {"affine": p["affine"], "conv": p["conv"], "noise_strength": p["noise_strength"],
                                 "noise": noise, "bias": p["bias"]}, "layer", remat=cfg.remat)
    return md.einsum("batch height width channels, channels rgb -> batch height width rgb", x, p["to_rgb"])


def _discriminator(img, p):
    h = md.leaky_relu(md.conv(img, p["d_conv1"], {"height": "kh", "width": "kw"}, padding="same"), 0.2)
    h = md.leaky_relu(md.conv(md.rename(h, d_channels="d_in"), p["d_conv2"], {"height": "kh", "width": "kw"},
                              padding="same"), 0.2)
    pooled = md.reduce_mean(h, ["height", "width"])
    return md.einsum("batch d_channels, d_channels -> batch", pooled, p["d_out"])


def _params(cfg, d):
    m, l, c, o, s = d["m"], d["l"], d["c"], d["o"], d["s"]
    di = md.Dim("d_in", cfg.d_channels)
    return {
        "map_in": md.param("map_in", [d["z"], s], fan_out=["w_dim"]),
        "map_w": md.param("map_w", [m, s, md.Dim("w_out", cfg.w_dim)], fan_out=["map_layer", "w_out"]),
        "map_b": md.param("map_b", [m, s], init="zeros"),
        "const": md.param("const", [d["h"], d["w"], c], init="normal", scale=1.0),
        "affine": md.param("affine", [l, s, c], fan_out=["layer", "channels"]),
        "conv": md.param("conv", [l, d["kh"], d["kw"], c, o], init="normal", scale=1.0),
        "noise_strength": md.param("noise_strength", [l], init=0.1),
        "bias": md.param("bias", [l, o], init="zeros"),
        "to_rgb": md.param("to_rgb", [c, d["rgb"]], fan_out=["rgb"]),
        "d_conv1": md.param("d_conv1", [d["kh"], d["kw"], d["rgb"], d["d"]], fan_out=["d_channels"]),
        "d_conv2": md.param("d_conv2", [d["kh"], d["kw"], di, d["d"]], fan_out=["d_channels"]),
        "d_out": md.param("d_out", [d["d"]]),
    }


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("fused", "conv", "scaled") or cfg.loss not in ("gan", "regress"):
        raise ValueError(f"form must be fused|conv|scaled and loss gan|regress, got {cfg.form!r}, {cfg.loss!r}")
    d = _dims(cfg)
    with md.Graph() as g:
        z = md.input("z", [d["b"], d["z"]])
        noise = md.input("noise", [d["l"], d["b"], d["h"], d["w"]])
        p = _params(cfg, d)
        fake = _generator(cfg, d, p, _mapping(z, p), noise)
        if cfg.loss == "gan":
            real = md.input("real", [d["b"], d["h"], d["w"], d["rgb"]])
            g_loss = md.reduce_mean(md.softplus(-_discriminator(fake, p)))
            d_loss = md.reduce_mean(md.softplus(_discriminator(md.stop_gradient(fake), p))
                                    + md.softplus(-_discriminator(real, p)))
            loss = g_loss + d_loss
        else:
            target = md.input("real", [d["b"], d["h"], d["w"], d["rgb"]])
            loss = md.reduce_mean((fake - target) ** 2)

    def feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        r = cfg.res
        return {"z": torch.randn(cfg.batch, cfg.z_dim, generator=gen),
                "noise": torch.randn(cfg.layers, cfg.batch, r, r, generator=gen),
                "real": torch.rand(cfg.batch, r, r, 3, generator=gen) * 2 - 1}

    return md.Model(g, loss, g.params(), feeds, cfg)
