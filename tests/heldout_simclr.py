"""A SimCLR-style contrastive model with the NT-Xent loss, written from the README and docs/
alone (a held-out model).

Legend: ``view`` the two augmented views of each example, ``batch`` the examples, ``pair``
the ``2 * batch`` projections (view-major: ``view_batch`` of ``md.rearrange``), ``key`` the
same projections as the other side of the similarity matrix.

Both views go through one encoder (residual ReLU layers under ``md.repeat``, the ``view`` dim a
batch dim of every einsum) and a two-layer projection head; the projections are L2-normalised.
The ``[pair, key]`` cosine similarities over a temperature, the diagonal (each projection
against itself) masked to -1e9, are the logits of a cross-entropy over ``key`` whose label for
projection ``i`` is its other view, ``(i + batch) mod 2 * batch``: the batch dim is contracted
with itself.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    d_in: int = 32
    d_model: int = 64
    d_proj: int = 32
    layers: int = 2
    batch: int = 16
    temperature: float = 0.5

    @classmethod
    def tiny(cls) -> "Config":
        return cls(d_in=6, d_model=8, d_proj=4, layers=2, batch=4)


def build(cfg: Config = Config()) -> md.Model:
    view, batch, layer = md.Dim("view", 2), md.Dim("batch", cfg.batch), md.Dim("layer", cfg.layers)
    d_in, d_model, d_ff, d_proj = (md.Dim(n, s) for n, s in
                                   (("d_in", cfg.d_in), ("d_model", cfg.d_model), ("d_ff", cfg.d_model),
                                    ("d_proj", cfg.d_proj)))
    n = 2 * cfg.batch
    with md.Graph("heldout_simclr") as g:
        x = md.input("x", [view, batch, d_in])
        w_in = md.param("w_in", [d_in, d_model], fan_out=[d_model])
        blocks = {
            "w1": md.param("w1", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w2": md.param("w2", [layer, d_ff, d_model], fan_out=["layer", d_model]),
            "ln": md.param("ln", [layer, d_model], init="ones"),
        }
        p1 = md.param("p1", [d_model, d_ff], fan_out=[d_ff])
        p2 = md.param("p2", [d_ff, d_proj], fan_out=[d_proj])

        def block(h: md.Tensor, p: dict) -> md.Tensor:
            u = md.relu(md.einsum("view batch d_model, d_model d_ff -> view batch d_ff",
                                  md.layer_norm(h, "d_model", p["ln"]), p["w1"]))
            return h + md.einsum("view batch d_ff, d_ff d_model -> view batch d_model", u, p["w2"])

        h = md.repeat(block, md.einsum("view batch d_in, d_in d_model -> view batch d_model", x, w_in), blocks, "layer")
        z = md.einsum("view batch d_ff, d_ff d_proj -> view batch d_proj",
                      md.relu(md.einsum("view batch d_model, d_model d_ff -> view batch d_ff", h, p1)), p2)
        z = z * md.rsqrt(md.reduce_sum(z * z, "d_proj") + 1e-12)
        z = md.rearrange(z, "view batch d_proj -> (view batch) d_proj")       # [view_batch: 2B, d_proj]
        sim = md.einsum("view_batch d_proj, key d_proj -> view_batch key", z, md.rename(z, view_batch="key"))
        i, j = md.arange(md.Dim("view_batch", n)), md.arange(md.Dim("key", n))
        logits = md.where(md.equal(i, j), -1e9, sim * (1.0 / cfg.temperature))
        labels = (i + cfg.batch) - md.cast(md.greater_equal(i, cfg.batch), torch.int64) * n
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "key"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        base = torch.randn(1, cfg.batch, cfg.d_in, generator=gen)
        scale = 1 + 0.2 * torch.randn(2, cfg.batch, 1, generator=gen)           # two augmentations
        return {"x": base * scale + 0.3 * torch.randn(2, cfg.batch, cfg.d_in, generator=gen)}

    params = {"w_in": w_in, **blocks, "p1": p1, "p2": p2}
    return md.Model(g, loss, params, feeds, cfg, outputs={"z": z})
