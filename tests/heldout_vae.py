"""A variational autoencoder with a reparameterised sample, written from the README and docs/
alone (a held-out model).

Binary-ish images flattened to ``pixels`` go through an MLP encoder to a mean and a
log-variance over ``latent``; the sample is ``mu + exp(logvar / 2) * eps`` with ``eps`` a fed
input (the reparameterisation trick: the noise is data, so every layout draws the same
sample). The decoder lifts ``z`` to ``d_hidden`` and runs residual MLP blocks under
``md.repeat`` (LayerNorm, SiLU) before the pixel logits. The loss per example is the
Bernoulli negative log-likelihood written stably by hand (``max(l, 0) - l x + log(1 +
exp(-|l|))``, summed over pixels) plus ``beta`` times the closed-form KL to the standard
normal (``-1/2 sum(1 + logvar - mu^2 - exp(logvar))`` over ``latent``), with "free bits": each
latent's KL term is clamped below at ``free_bits`` (``md.maximum``), averaged over the batch.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    pixels: int = 64
    d_hidden: int = 64
    d_ff: int = 128
    latent: int = 16
    layers: int = 2
    batch: int = 8
    beta: float = 0.5
    free_bits: float = 0.05

    @classmethod
    def tiny(cls) -> "Config":
        return cls(pixels=12, d_hidden=8, d_ff=16, latent=4, layers=2, batch=4)


def build(cfg: Config = Config()) -> md.Model:
    batch, pixels, d_hidden = md.Dim("batch", cfg.batch), md.Dim("pixels", cfg.pixels), md.Dim("d_hidden", cfg.d_hidden)
    d_ff, latent, layer = md.Dim("d_ff", cfg.d_ff), md.Dim("latent", cfg.latent), md.Dim("layer", cfg.layers)
    d_enc = md.Dim("d_enc", cfg.d_hidden)
    with md.Graph("heldout_vae") as g:
        x = md.input("x", [batch, pixels])
        eps = md.input("eps", [batch, latent])
        p = {
            "enc1": md.param("enc1", [pixels, d_enc], fan_out=[d_enc]),
            "enc1_b": md.param("enc1_b", [d_enc], init="zeros"),
            "w_mu": md.param("w_mu", [d_enc, latent], fan_out=[latent]),
            "w_logvar": md.param("w_logvar", [d_enc, latent], fan_out=[latent], scale=0.1),
            "dec_in": md.param("dec_in", [latent, d_hidden], fan_out=[d_hidden]),
            "dec_out": md.param("dec_out", [d_hidden, pixels], fan_out=[pixels]),
            "dec_out_b": md.param("dec_out_b", [pixels], init="zeros"),
        }
        blocks = {
            "ln": md.param("ln", [layer, d_hidden], init="ones"),
            "up": md.param("up", [layer, d_hidden, d_ff], fan_out=["layer", d_ff]),
            "down": md.param("down", [layer, d_ff, d_hidden], fan_out=["layer", d_hidden]),
        }

        def block(h: md.Tensor, q: dict) -> md.Tensor:
            u = md.silu(md.einsum("batch d_hidden, d_hidden d_ff -> batch d_ff", md.layer_norm(h, "d_hidden", q["ln"]), q["up"]))
            return h + md.einsum("batch d_ff, d_ff d_hidden -> batch d_hidden", u, q["down"])

        h = md.silu(md.einsum("batch pixels, pixels d_enc -> batch d_enc", x, p["enc1"]) + p["enc1_b"])
        mu = md.einsum("batch d_enc, d_enc latent -> batch latent", h, p["w_mu"])
        logvar = md.einsum("batch d_enc, d_enc latent -> batch latent", h, p["w_logvar"])
        z = mu + md.exp(logvar * 0.5) * eps
        h = md.einsum("batch latent, latent d_hidden -> batch d_hidden", z, p["dec_in"])
        h = md.repeat(block, h, blocks, "layer")
        logits = md.einsum("batch d_hidden, d_hidden pixels -> batch pixels", h, p["dec_out"]) + p["dec_out_b"]
        nll = md.maximum(logits, 0.0) - logits * x + md.log(1.0 + md.exp(-md.abs(logits)))
        kl = -0.5 * (1.0 + logvar - mu * mu - md.exp(logvar))
        kl = md.maximum(kl, cfg.free_bits)
        loss = md.reduce_mean(md.reduce_sum(nll, "pixels") + cfg.beta * md.reduce_sum(kl, "latent"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"x": (torch.rand(cfg.batch, cfg.pixels, generator=gen) > 0.5).float(),
                "eps": torch.randn(cfg.batch, cfg.latent, generator=gen)}

    return md.Model(g, loss, {**p, **blocks}, feeds, cfg)
