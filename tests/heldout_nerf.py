"""A NeRF-style radiance-field MLP with volume rendering, written from the README and docs/
alone (a held-out model).

Legend: ``batch`` the camera rays (named so: micro-batches cut that dim), ``samples`` the points
along each ray, ``xyz`` the 3 coordinates, ``freq`` the encoding's frequencies, ``rgb`` the 3
colours.

Each sample point is encoded as ``sin`` and ``cos`` of ``2^k * pi * x`` for every coordinate
and frequency (joined along ``freq`` by ``md.concat``, then merged with ``xyz`` by
``md.rearrange`` into one feature dim ``xyz_freq``). An MLP of ``md.repeat``-ed ReLU layers
reads it; its output is joined again with the encoding (NeRF's skip connection: ``md.concat``
along the feature dim), and two more layers give a density ``sigma`` (ReLU) and a colour
(sigmoid). Volume rendering along ``samples``: ``alpha = 1 - exp(-sigma * delta)``, the
transmittance ``T_i = prod_{j < i} (1 - alpha_j)`` (the docs offer ``md.cumsum`` with
``exclusive`` and no product, so ``exp(cumsum(log(1 - alpha + 1e-10), exclusive=True))``), the
weights ``T * alpha`` and the pixel's colour ``sum_samples weights * rgb``; the loss is the mean
squared error to the target colours.
"""
import math
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 64     # rays
    samples: int = 32
    freqs: int = 6
    d_hidden: int = 64
    layers: int = 4

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, samples=6, freqs=3, d_hidden=8, layers=2)


def build(cfg: Config = Config()) -> md.Model:
    batch, samples, xyz = md.Dim("batch", cfg.batch), md.Dim("samples", cfg.samples), md.Dim("xyz", 3)
    freq, rgb, layer = md.Dim("freq", cfg.freqs), md.Dim("rgb", 3), md.Dim("layer", cfg.layers)
    d_hidden, d_in = md.Dim("d_hidden", cfg.d_hidden), md.Dim("d_in", cfg.d_hidden)
    enc_size = 3 * 2 * cfg.freqs
    d_cat = md.Dim("d_cat", cfg.d_hidden + enc_size)
    xyz_freq = md.Dim("xyz_freq", enc_size)
    with md.Graph("heldout_nerf") as g:
        points = md.input("points", [batch, samples, xyz])
        deltas = md.input("deltas", [batch, samples])
        target = md.input("target", [batch, rgb])
        w_enc = md.param("w_enc", [xyz_freq, d_hidden], fan_out=[d_hidden])
        blocks = {
            "w": md.param("w", [layer, d_in, d_hidden], fan_out=["layer", d_hidden]),
            "b": md.param("b", [layer, d_hidden], init="zeros"),
        }
        w_skip = md.param("w_skip", [d_cat, d_in], fan_out=[d_in])
        w_sigma = md.param("w_sigma", [d_in], scale=0.3)
        w_rgb = md.param("w_rgb", [d_in, rgb], fan_out=[rgb])

        bands = md.constant(torch.tensor([2.0 ** k * math.pi for k in range(cfg.freqs)]), [freq], name="bands")
        angles = points * bands                                            # [batch, samples, xyz, freq]
        enc = md.concat([md.sin(angles), md.cos(angles)], "freq")          # freq: 2 * freqs
        enc = md.rearrange(enc, "batch samples xyz freq -> batch samples (xyz freq)")

        def block(h: md.Tensor, p: dict) -> md.Tensor:
            y = md.einsum("batch samples d_in, d_in d_hidden -> batch samples d_hidden", h, p["w"]) + p["b"]
            return md.rename(md.relu(y), d_hidden="d_in")

        h = md.relu(md.einsum("batch samples xyz_freq, xyz_freq d_hidden -> batch samples d_hidden", enc, w_enc))
        h = md.repeat(block, md.rename(h, d_hidden="d_in"), blocks, "layer")
        cat = md.rename(md.concat([h, md.rename(enc, xyz_freq="d_in")], "d_in"), d_in="d_cat")
        h = md.relu(md.einsum("batch samples d_cat, d_cat d_in -> batch samples d_in", cat, w_skip))
        sigma = md.relu(md.einsum("batch samples d_in, d_in -> batch samples", h, w_sigma))
        colour = md.sigmoid(md.einsum("batch samples d_in, d_in rgb -> batch samples rgb", h, w_rgb))

        alpha = 1.0 - md.exp(-sigma * deltas)
        trans = md.exp(md.cumsum(md.log(1.0 - alpha + 1e-10), "samples", exclusive=True))
        weights = trans * alpha
        pixel = md.einsum("batch samples, batch samples rgb -> batch rgb", weights, colour)
        loss = md.reduce_mean((pixel - target) ** 2)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        origin = torch.rand(cfg.batch, 1, 3, generator=gen) - 0.5
        direction = torch.nn.functional.normalize(torch.randn(cfg.batch, 1, 3, generator=gen), dim=-1)
        depth = torch.linspace(0.1, 1.5, cfg.samples + 1)
        mid = (depth[1:] + depth[:-1]) / 2
        return {"points": origin + direction * mid[None, :, None],
                "deltas": (depth[1:] - depth[:-1]).expand(cfg.batch, cfg.samples).contiguous(),
                "target": torch.rand(cfg.batch, 3, generator=gen)}

    params = {"w_enc": w_enc, **blocks, "w_skip": w_skip, "w_sigma": w_sigma, "w_rgb": w_rgb}
    return md.Model(g, loss, params, feeds, cfg, outputs={"alpha": alpha, "weights": weights})
