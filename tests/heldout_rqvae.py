"""Held-out model (round 22a): a residual-quantised VAE (RQ-VAE, Lee et al. 2022), from the docs alone.

Legend: b = batch, h/w = height/width, c = channels (image), d = d_hid (latent features),
k = codes (one codebook's entries), kh/kw = conv taps.

A conv encoder, residual quantisation with `depth` codebooks (each picks the nearest code of
the residual left by the ones before: argmin of squared distances over `codes`, a one-hot
contraction to read it), a straight-through estimator written with md.stop_gradient, the
codebook and commitment losses, and a conv decoder with an MSE reconstruction loss.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    height: int = 16
    width: int = 16
    chan: int = 3
    d_hid: int = 32
    codes: int = 64
    depth: int = 3
    beta: float = 0.25

    @classmethod
    def tiny(cls):
        return cls(batch=2, height=8, width=8, chan=3, d_hid=8, codes=8, depth=2)


def _conv(x, w):
    """A 3x3 'same' conv (w [kh, kw, c_in, c_out])."""
    return md.conv(x, w, {"height": "kh", "width": "kw"}, padding="same")


def _quantise(r, book):
    """The nearest code of `book` [codes, d_hid] to each residual vector: (q, index)."""
    dist = (md.reduce_sum(r * r, "d_hid")
            - 2.0 * md.einsum("batch height width d_hid, codes d_hid -> batch height width codes", r, book)
            + md.reduce_sum(book * book, "d_hid"))
    idx = md.argmin(dist, "codes")
    q = md.einsum("batch height width codes, codes d_hid -> batch height width d_hid",
                  md.one_hot(idx, book.shape["codes"]), book)
    return q, idx


def build(cfg: Config) -> md.Model:
    B, Hh, W = md.Dim("batch", cfg.batch), md.Dim("height", cfg.height), md.Dim("width", cfg.width)
    C, D, K = md.Dim("chan", cfg.chan), md.Dim("d_hid", cfg.d_hid), md.Dim("codes", cfg.codes)
    KH, KW, Dm = md.Dim("kh", 3), md.Dim("kw", 3), md.Dim("d_mid", cfg.d_hid)
    with md.Graph() as g:
        x = md.input("x", [B, Hh, W, C])
        enc1 = md.param("enc1", [KH, KW, C, Dm], fan_out=[Dm])
        enc2 = md.param("enc2", [KH, KW, Dm, D], fan_out=[D])
        dec1 = md.param("dec1", [KH, KW, D, Dm], fan_out=[Dm])
        dec2 = md.param("dec2", [KH, KW, Dm, C], fan_out=[C])
        books = [md.param(f"book{i}", [K, D], scale=1.0) for i in range(cfg.depth)]

        z_e = _conv(md.relu(_conv(x, enc1)), enc2)
        r, z_q, vq = z_e, None, 0.0
        for book in books:
            q, _ = _quantise(r, book)
            # codebook loss moves the code to the residual; commitment moves the residual (beta)
            vq = vq + md.reduce_mean((md.stop_gradient(r) - q) ** 2)
            vq = vq + cfg.beta * md.reduce_mean((r - md.stop_gradient(q)) ** 2)
            z_q = q if z_q is None else z_q + q
            r = r - q
        z_st = z_e + md.stop_gradient(z_q - z_e)          # straight-through estimator
        x_hat = _conv(md.relu(_conv(z_st, dec1)), dec2)
        recon = md.reduce_mean((x_hat - x) ** 2)
        loss = recon + vq

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(cfg.batch, cfg.height, cfg.width, cfg.chan, generator=gen)}

    return md.Model(g, loss, g.params(), make_feeds, cfg, outputs={"recon": recon, "vq": vq})


def reference_loss(cfg: Config, params: dict, x):
    """The same loss in plain torch: F.conv2d, and each depth's nearest code by torch.cdist."""
    import torch.nn.functional as F

    def conv(t, w):                                   # t [batch, h, w, c]; w [kh, kw, c_in, c_out]
        return F.conv2d(t.permute(0, 3, 1, 2), w.permute(3, 2, 0, 1), padding=1).permute(0, 2, 3, 1)

    z_e = conv(F.relu(conv(x, params["enc1"])), params["enc2"])
    r, z_q, vq = z_e, torch.zeros_like(z_e), 0.0
    for i in range(cfg.depth):
        book = params[f"book{i}"]
        q = book[torch.cdist(r.reshape(-1, cfg.d_hid), book).argmin(1)].reshape(r.shape)
        vq = vq + F.mse_loss(q, r.detach()) + cfg.beta * F.mse_loss(r, q.detach())
        z_q, r = z_q + q, r - q
    z_st = z_e + (z_q - z_e).detach()
    return F.mse_loss(conv(F.relu(conv(z_st, params["dec1"])), params["dec2"]), x) + vq
