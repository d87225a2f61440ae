"""GFNet (Rao et al. 2021): a vision model whose token mixer is a global filter in the frequency domain.

Dims:
  batch   images            height, width  the patch grid
  pix     a patch's pixels  chan           embedding channels
  hidden  MLP width         fh             height's rfft frequencies (height // 2 + 1)
  reim    a complex value's (real, imaginary) parts
  layer   the block stack   classes        labels

    patches -> embed (pix chan) -> [layer x: x + GF(LN(x)); x + MLP(LN(x))] -> LN -> mean -> head
    GF(h) = irfft_height(ifft_width(filter * fft_width(rfft_height(h))))
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    height: int = 8
    width: int = 8
    pix: int = 12
    chan: int = 32
    hidden: int = 64
    layers: int = 4
    classes: int = 10

    remat: str | None = None          # what each layer saves (md.repeat remat=): None, "full", "selective"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, height=4, width=6, pix=6, chan=6, hidden=8, layers=2, classes=3)


def cmul(a, b):
    """(a_re + i a_im)(b_re + i b_im), both with a size-2 ``reim`` part dim."""
    ar, ai = (md.squeeze(md.slice_(a, "reim", k, k + 1), "reim") for k in (0, 1))
    br, bi = (md.squeeze(md.slice_(b, "reim", k, k + 1), "reim") for k in (0, 1))
    return md.concat([md.unsqueeze(ar * br - ai * bi, "reim"), md.unsqueeze(ar * bi + ai * br, "reim")], "reim")


def build(cfg: Config = Config()) -> md.Model:
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.height), md.Dim("width", cfg.width)
    pix, chan, hidden = md.Dim("pix", cfg.pix), md.Dim("chan", cfg.chan), md.Dim("hidden", cfg.hidden)
    layer, classes = md.Dim("layer", cfg.layers), md.Dim("classes", cfg.classes)
    fh, reim = md.Dim("fh", cfg.height // 2 + 1), md.Dim("reim", 2)
    with md.Graph("gfnet") as g:
        patches = md.input("patches", [batch, height, width, pix])
        labels = md.input("labels", [batch], dtype=torch.int64)
        w_embed = md.param("w_embed", [pix, chan], fan_out=[chan])
        stack = {
            "ln1": md.param("ln1", [layer, chan], init="ones"), "ln1_b": md.param("ln1_b", [layer, chan], init="zeros"),
            "filt": md.param("filt", [layer, fh, width, chan, reim], scale=0.5),
            "ln2": md.param("ln2", [layer, chan], init="ones"), "ln2_b": md.param("ln2_b", [layer, chan], init="zeros"),
            "w_fc": md.param("w_fc", [layer, chan, hidden], fan_out=[hidden]),
            "w_out": md.param("w_out", [layer, hidden, chan], fan_out=[chan]),
        }
        lnf, w_head = md.param("lnf", [chan], init="ones"), md.param("w_head", [chan, classes], fan_out=[classes])
        x = md.einsum("batch height width pix, pix chan -> batch height width chan", patches, w_embed)

        def block(x, p):
            h = md.layer_norm(x, "chan", p["ln1"], p["ln1_b"])
            f = md.fft(md.rfft(h, "height", freq="fh", part="reim"), "width", "reim")
            f = md.ifft(cmul(f, p["filt"]), "width", "reim")
            x = x + md.irfft(f, "fh", "reim", "height", n=cfg.height)
            h = md.layer_norm(x, "chan", p["ln2"], p["ln2_b"])
            h = md.gelu(md.einsum("batch height width chan, chan hidden -> batch height width hidden", h, p["w_fc"]))
            return x + md.einsum("batch height width hidden, hidden chan -> batch height width chan", h, p["w_out"])

        x = md.repeat(block, x, stack, "layer", remat=cfg.remat)
        pooled = md.reduce_mean(md.layer_norm(x, "chan", lnf), ["height", "width"])
        logits = md.einsum("batch chan, chan classes -> batch classes", pooled, w_head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int = 0) -> dict:
        gen = torch.Generator().manual_seed(seed)
        return {"patches": torch.randn(cfg.batch, cfg.height, cfg.width, cfg.pix, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("patches", "labels")


def reference_loss(cfg: Config, p: dict, patches, labels):
    """The same model in plain torch: torch.fft.rfft/fft/ifft/irfft and a complex filter."""
    F = torch.nn.functional
    x = patches @ p["w_embed"]
    for i in range(cfg.layers):
        h = F.layer_norm(x, (cfg.chan,), p["ln1"][i], p["ln1_b"][i])
        f = torch.fft.fft(torch.fft.rfft(h, dim=1), dim=2) * torch.view_as_complex(p["filt"][i])
        x = x + torch.fft.irfft(torch.fft.ifft(f, dim=2), n=cfg.height, dim=1)
        h = F.layer_norm(x, (cfg.chan,), p["ln2"][i], p["ln2_b"][i])
        x = x + F.gelu(h @ p["w_fc"][i]) @ p["w_out"][i]
    pooled = F.layer_norm(x, (cfg.chan,), p["lnf"]).mean((1, 2))
    return F.cross_entropy(pooled @ p["w_head"], labels)
