"""A held-out MLP-Mixer, written from README.md and docs/ only.

Legend: b batch, n patches, f pix = (ph pw channels), d d_model (the channels of the
mixer), t tok_hidden (the token-mixing MLP's width), e d_ff (the channel MLP's), c classes.

    images -> rearrange -> x_bnf -> w_embed -> [batch, patches, d_model]
      -> md.repeat over layers of a mixer block:
           token mixing:   h += einsum(gelu(einsum(LN(h), w_tok1 [patches, tok_hidden])),
                                       w_tok2 [tok_hidden, patches])   (contracts patches)
           channel mixing: h += einsum(gelu(einsum(LN(h), w_ch1 [d_model, d_ff])), w_ch2)
      -> layer norm -> mean over patches -> w_head
    loss = mean cross-entropy over classes

Data (``batches``): class k puts a bright patch in row band k at a random column, on noise.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 16
    size: int = 8
    channels: int = 2
    patch: int = 2
    d_model: int = 32
    tok_hidden: int = 32
    d_ff: int = 64
    layers: int = 2
    classes: int = 4
    noise: float = 0.3

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=6, size=8, channels=1, patch=2, d_model=8, tok_hidden=8, d_ff=16, layers=2)


def image(cfg: Config, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """One ``[size, size, channels]`` image: class k a bright patch on row-band k, on noise."""
    label = int(torch.randint(cfg.classes, (), generator=gen))
    n, p = cfg.size, cfg.patch
    img = cfg.noise * torch.randn(n, n, cfg.channels, generator=gen)
    r = (label * p) % n
    c = int(torch.randint(n // p, (), generator=gen)) * p
    img[r:r + p, c:c + p, :] += 1.0
    return img, label


def build(cfg: Config = Config()) -> md.Model:
    npatch = (cfg.size // cfg.patch) ** 2
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.size), md.Dim("width", cfg.size)
    channels, d_model = md.Dim("channels", cfg.channels), md.Dim("d_model", cfg.d_model)
    pix, patches = md.Dim("pix", cfg.patch * cfg.patch * cfg.channels), md.Dim("patches", npatch)
    tok_hidden, d_ff = md.Dim("tok_hidden", cfg.tok_hidden), md.Dim("d_ff", cfg.d_ff)
    layer, classes = md.Dim("layer", cfg.layers), md.Dim("classes", cfg.classes)
    with md.Graph("heldout_mixer") as g:
        images = md.input("images", [batch, height, width, channels])
        labels = md.input("labels", [batch], dtype=torch.int64)
        p = {
            "w_embed": md.param("w_embed", [pix, d_model], fan_out=[d_model]),
            "ln1": md.param("ln1", [layer, d_model], init="ones"),
            "w_tok1": md.param("w_tok1", [layer, patches, tok_hidden], fan_out=[tok_hidden]),
            "w_tok2": md.param("w_tok2", [layer, tok_hidden, patches], fan_out=[patches]),
            "ln2": md.param("ln2", [layer, d_model], init="ones"),
            "w_ch1": md.param("w_ch1", [layer, d_model, d_ff], fan_out=[d_ff]),
            "w_ch2": md.param("w_ch2", [layer, d_ff, d_model], fan_out=[d_model]),
            "lnf": md.param("lnf", [d_model], init="ones"),
            "w_head": md.param("w_head", [d_model, classes], fan_out=[classes]),
        }
        x = md.rearrange(images, "batch (hp ph) (wp pw) channels -> batch (hp wp) (ph pw channels)",
                         ph=cfg.patch, pw=cfg.patch)
        x = md.rename(x, hp_wp="patches", ph_pw_channels="pix")
        x = md.einsum("batch patches pix, pix d_model -> batch patches d_model", x, p["w_embed"])

        def block(h, w):
            a = md.layer_norm(h, "d_model", w["ln1"])
            t = md.gelu(md.einsum("batch patches d_model, patches tok_hidden -> batch tok_hidden d_model", a, w["w_tok1"]))
            h = h + md.einsum("batch tok_hidden d_model, tok_hidden patches -> batch patches d_model", t, w["w_tok2"])
            c = md.layer_norm(h, "d_model", w["ln2"])
            f = md.gelu(md.einsum("batch patches d_model, d_model d_ff -> batch patches d_ff", c, w["w_ch1"]))
            return h + md.einsum("batch patches d_ff, d_ff d_model -> batch patches d_model", f, w["w_ch2"])

        stacked = {n: p[n] for n in ("ln1", "w_tok1", "w_tok2", "ln2", "w_ch1", "w_ch2")}
        h = md.repeat(block, x, stacked, "layer")
        pooled = md.reduce_mean(md.layer_norm(h, "d_model", p["lnf"]), "patches")
        logits = md.einsum("batch d_model, d_model classes -> batch classes", pooled, p["w_head"])
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))
        correct = md.greater_equal(md.reduce_sum(logits * md.one_hot(labels, classes), "classes"),
                                   md.reduce_max(logits, "classes"))
        accuracy = md.reduce_mean(md.cast(correct, torch.float32))

    def batches(seed: int, rows: slice | None = None) -> dict[str, torch.Tensor]:
        drawn = [image(cfg, md.row_generator(seed, r)) for r in range(cfg.batch)[rows or slice(None)]]
        imgs = torch.stack([x for x, _ in drawn]) if drawn else torch.zeros(0, cfg.size, cfg.size, cfg.channels)
        return {"images": imgs, "labels": torch.tensor([k for _, k in drawn], dtype=torch.int64)}

    return md.Model(g, loss, p, batches=batches, config=cfg, metrics={"accuracy": accuracy})
