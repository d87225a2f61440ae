"""A VQ-VAE over 1-D signals, written from the README and docs/ alone (a held-out model).

Dims: ``batch``, ``seq`` (positions of the signal), ``channels`` (its values per position),
``d_hidden``, ``d_code`` (the latent width), ``codes`` (codebook entries), ``tap`` (conv taps).
The encoder is a same-padded conv over ``seq`` then a per-position projection to ``z``; the
quantizer picks each position's nearest codebook entry (``top_k`` of minus the squared
distances: an index with no gradient), looks it up by a one-hot contraction or ``md.gather``
(``lookup="gather"``; either way the codebook gets the gradient of its chosen rows), and passes
the decoder's gradient straight through to ``z`` (``z + stop_gradient(q - z)``). The decoder
mirrors the encoder. The loss is van den Oord et al.'s: reconstruction MSE +
``||sg(z) - q||^2`` (codebook) + ``commit * ||z - sg(q)||^2``.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 16
    seq: int = 64
    channels: int = 4
    d_hidden: int = 64
    d_code: int = 16
    codes: int = 32
    taps: int = 3
    commit: float = 0.25
    lookup: str = "one_hot"         # or "gather": the codebook rows picked by md.gather

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, seq=8, channels=3, d_hidden=8, d_code=4, codes=6)


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, channels = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("channels", cfg.channels)
    d_hidden, d_code, codes = md.Dim("d_hidden", cfg.d_hidden), md.Dim("d_code", cfg.d_code), md.Dim("codes", cfg.codes)
    tap = md.Dim("tap", cfg.taps)
    with md.Graph("heldout_vqvae") as g:
        x = md.input("x", [batch, seq, channels])
        enc_conv = md.param("enc_conv", [tap, channels, d_hidden], fan_out=["d_hidden"])
        enc_out = md.param("enc_out", [d_hidden, d_code], fan_out=["d_code"])
        codebook = md.param("codebook", [codes, d_code], scale=0.5)
        dec_in = md.param("dec_in", [d_code, d_hidden], fan_out=["d_hidden"])
        dec_conv = md.param("dec_conv", [tap, d_hidden, channels], fan_out=["channels"])

        h = md.relu(md.conv(x, enc_conv, {"seq": "tap"}, padding="same"))
        z = md.einsum("batch seq d_hidden, d_hidden d_code -> batch seq d_code", h, enc_out)
        dist = (md.reduce_sum(z ** 2, "d_code") - 2 * md.einsum("batch seq d_code, codes d_code -> batch seq codes",
                                                                 z, codebook)
                + md.reduce_sum(codebook ** 2, "d_code"))                  # [batch, seq, codes]
        _, idx = md.top_k(md.stop_gradient(-dist), "codes", 1, "top")
        index = md.squeeze(idx, "top")                                      # [batch, seq], no gradient
        if cfg.lookup == "gather":
            q = md.gather(codebook, index, "codes")
        else:
            q = md.einsum("batch seq codes, codes d_code -> batch seq d_code", md.one_hot(index, codes), codebook)
        z_q = z + md.stop_gradient(q - z)                                   # straight-through
        hd = md.relu(md.einsum("batch seq d_code, d_code d_hidden -> batch seq d_hidden", z_q, dec_in))
        x_hat = md.conv(hd, dec_conv, {"seq": "tap"}, padding="same")
        recon = md.reduce_mean((x_hat - x) ** 2)
        codebook_loss = md.reduce_mean((md.stop_gradient(z) - q) ** 2)
        commitment = md.reduce_mean((z - md.stop_gradient(q)) ** 2)
        loss = recon + codebook_loss + cfg.commit * commitment
    params = {"enc_conv": enc_conv, "enc_out": enc_out, "codebook": codebook, "dec_in": dec_in, "dec_conv": dec_conv}

    def batches(seed: int, rows: slice | None = None) -> dict[str, torch.Tensor]:
        """Piecewise-constant signals: runs of 2-4 positions, each run one of ``codes // 2`` fixed
        prototype vectors plus a little noise (a signal a small codebook can describe)."""
        idx = range(cfg.batch)[rows or slice(None)]
        protos = torch.randn(max(cfg.codes // 2, 2), cfg.channels, generator=torch.Generator().manual_seed(5))
        out = []
        for r in idx:
            gen = md.row_generator(seed, r)
            runs = torch.randint(0, len(protos), (cfg.seq,), generator=gen)
            lengths = torch.randint(2, 5, (cfg.seq,), generator=gen)
            which = torch.repeat_interleave(runs, lengths)[:cfg.seq]
            out.append(protos[which] + 0.1 * torch.randn(cfg.seq, cfg.channels, generator=gen))
        return {"x": torch.stack(out) if out else torch.zeros(0, cfg.seq, cfg.channels)}

    return md.Model(g, loss, params, batches=batches, config=cfg,
                    outputs={"index": index, "recon": recon, "commitment": commitment})
