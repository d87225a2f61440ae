"""Matryoshka representation learning, written from the docs alone: an MLP encoder (an input
projection and a stack of residual gelu blocks under md.repeat) makes an embedding, and its first
m dims, for each m in ``widths`` (8, 16, 32, ...), feed a classifier; the loss is the sum over the
nested widths of each one's mean cross-entropy.

``heads=separate``: one classifier per width (MRL). ``heads=shared``: one classifier over the
whole embedding, each width reading its first m rows (MRL-E, the same weights sliced).
``heads=named``: as ``separate``, each head's rows a dim of its own (``embed_m``, the slice renamed to
it), so ``embed:model`` splits the embedding without reaching a head narrower than the axis.

Legend: b batch, x d_in, e embed, f d_ff, k classes, l layer.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 16
    d_in: int = 32
    embed: int = 64
    d_ff: int = 128
    classes: int = 10
    layers: int = 4
    widths: str = "8,16,32,64"
    heads: str = "separate"   # separate | shared | named
    remat: str = "none"

    @classmethod
    def tiny(cls):
        return cls(batch=6, d_in=5, embed=11, d_ff=8, classes=5, layers=4, widths="2,4,7,11")


def build(cfg: Config) -> md.Model:
    widths = [int(w) for w in str(cfg.widths).split(",")]
    if cfg.heads not in ("separate", "shared", "named") or sorted(widths) != widths or widths[-1] > cfg.embed:
        raise ValueError(f"heads must be separate|shared|named and widths increasing up to embed, got {cfg}")
    b, x_, e, f = md.Dim("batch", cfg.batch), md.Dim("d_in", cfg.d_in), md.Dim("embed", cfg.embed), md.Dim("d_ff", cfg.d_ff)
    k, l = md.Dim("classes", cfg.classes), md.Dim("layer", cfg.layers)
    with md.Graph() as g:
        x = md.input("x", [b, x_])
        labels = md.input("labels", [b], dtype=torch.int64)
        w_in = md.param("w_in", [x_, e], fan_out=["embed"])
        w1 = md.param("w1", [l, e, f], fan_out=["layer", "d_ff"])
        w2 = md.param("w2", [l, f, e], fan_out=["layer", "embed"])
        ln = md.param("ln", [l, e], init="ones")
        h = md.einsum("batch d_in, d_in embed -> batch embed", x, w_in)

        def block(h, q):
            y = md.gelu(md.einsum("batch embed, embed d_ff -> batch d_ff", md.layer_norm(h, "embed", q["ln"]), q["w1"]))
            return h + md.einsum("batch d_ff, d_ff embed -> batch embed", y, q["w2"])

        emb = md.repeat(block, h, {"w1": w1, "w2": w2, "ln": ln}, "layer", remat=cfg.remat)
        shared = md.param("head", [e, k], fan_out=["classes"]) if cfg.heads == "shared" else None
        loss = None
        for m in widths:
            part, e_m = md.slice_(emb, "embed", 0, m), "embed"
            if cfg.heads == "named":
                part, e_m = md.rename(part, embed=f"embed_{m}"), f"embed_{m}"
            head = (md.slice_(shared, "embed", 0, m) if shared is not None
                    else md.param(f"head{m}", [md.Dim(e_m, m), k], fan_out=["classes"]))
            logits = md.einsum(f"batch {e_m}, {e_m} classes -> batch classes", part, head)
            term = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))
            loss = term if loss is None else loss + term

    def feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(cfg.batch, cfg.d_in, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, g.params(), feeds, cfg)
