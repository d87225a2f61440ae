"""Held-out model (round 22a): an attentive neural process (Kim et al. 2019), from the docs alone.

Legend: b = batch (tasks), c = context points, t = target points, x/y = point features
(d_x, d_y), d = d_model, h = heads, e = d_head, z = d_z (the latent).

A deterministic path (self-attention over the context, cross-attention from the target x's)
and a latent path (mean-pooled encodings -> a Gaussian; the posterior reads context and targets,
the prior the context alone; z reparameterised with fed noise) feed a decoder whose Gaussian
NLL on the target y's plus KL(posterior || prior) is the loss.
"""
import math
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    ctx: int = 16
    tgt: int = 16
    d_x: int = 2
    d_y: int = 2
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_z: int = 8

    @classmethod
    def tiny(cls):
        return cls(batch=4, ctx=6, tgt=6, d_x=2, d_y=2, d_model=8, heads=2, d_head=4, d_z=4)


def _encode(x, y, p, pre):
    """relu(x W_x + y W_y + b): a point's (x, y) pair embedded; [.., d_model]."""
    h = md.einsum("... d_x, d_x d_model -> ... d_model", x, p[pre + "wx"])
    h = h + md.einsum("... d_y, d_y d_model -> ... d_model", y, p[pre + "wy"])
    return md.relu(h + p[pre + "b"])


def _heads(x, w, pt):
    return md.einsum(f"batch {pt} d_model, d_model heads d_head -> batch {pt} heads d_head", x, w)


def _latent(s, pt, p):
    """Mean-pooled encodings -> (mu, sigma) of the latent Gaussian."""
    pooled = md.reduce_mean(s, pt)
    mu = md.einsum("batch d_model, d_model d_z -> batch d_z", pooled, p["w_mu"])
    raw = md.einsum("batch d_model, d_model d_z -> batch d_z", pooled, p["w_sig"])
    return mu, 0.1 + 0.9 * md.sigmoid(raw)


def _deterministic(xc, yc, xt, p):
    """Self-attention over the context, then cross-attention from the targets: [b, t, d]."""
    r = _encode(xc, yc, p, "det_")
    ck = md.rename(r, ctx="ctx_k")
    att = md.attention(_heads(r, p["sa_q"], "ctx"), _heads(ck, p["sa_k"], "ctx_k"),
                       _heads(ck, p["sa_v"], "ctx_k"), "ctx", "ctx_k", "d_head", causal=False)
    r = r + md.einsum("batch ctx heads d_head, heads d_head d_model -> batch ctx d_model", att, p["sa_o"])
    qt = md.relu(md.einsum("batch tgt d_x, d_x d_model -> batch tgt d_model", xt, p["q_x"]))
    kc = md.relu(md.einsum("batch ctx d_x, d_x d_model -> batch ctx d_model", xc, p["q_x"]))
    ca = md.attention(_heads(qt, p["ca_q"], "tgt"), _heads(kc, p["ca_k"], "ctx"),
                      _heads(r, p["ca_v"], "ctx"), "tgt", "ctx", "d_head", causal=False)
    return md.einsum("batch tgt heads d_head, heads d_head d_model -> batch tgt d_model", ca, p["ca_o"])


def _kl(mu_q, sig_q, mu_p, sig_p):
    """KL(N(mu_q, sig_q) || N(mu_p, sig_p)), summed over d_z: [batch]."""
    kl = md.log(sig_p / sig_q) + (sig_q ** 2 + (mu_q - mu_p) ** 2) / (2.0 * sig_p ** 2) - 0.5
    return md.reduce_sum(kl, "d_z")


def build(cfg: Config) -> md.Model:
    B, C, T = md.Dim("batch", cfg.batch), md.Dim("ctx", cfg.ctx), md.Dim("tgt", cfg.tgt)
    X, Y, D = md.Dim("d_x", cfg.d_x), md.Dim("d_y", cfg.d_y), md.Dim("d_model", cfg.d_model)
    H, E, Z = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_z", cfg.d_z)
    with md.Graph() as g:
        xc, yc = md.input("xc", [B, C, X]), md.input("yc", [B, C, Y])
        xt, yt = md.input("xt", [B, T, X]), md.input("yt", [B, T, Y])
        eps = md.input("eps", [B, Z])
        p = {}
        for pre in ("det_", "lat_"):
            p[pre + "wx"] = md.param(pre + "wx", [X, D], fan_out=[D])
            p[pre + "wy"] = md.param(pre + "wy", [Y, D], fan_out=[D])
            p[pre + "b"] = md.param(pre + "b", [D], init="zeros")
        for n in ("sa_q", "sa_k", "sa_v", "ca_q", "ca_k", "ca_v"):
            p[n] = md.param(n, [D, H, E], fan_out=[H, E])
        for n in ("sa_o", "ca_o"):
            p[n] = md.param(n, [H, E, D], fan_out=[D])
        p["q_x"] = md.param("q_x", [X, D], fan_out=[D])
        p["w_mu"], p["w_sig"] = md.param("w_mu", [D, Z], fan_out=[Z]), md.param("w_sig", [D, Z], fan_out=[Z])
        p["dec_x"] = md.param("dec_x", [X, D], fan_out=[D])
        p["dec_r"] = md.param("dec_r", [md.Dim("d_r", cfg.d_model), D], fan_out=[D])
        p["dec_z"] = md.param("dec_z", [Z, D], fan_out=[D])
        p["out_mu"], p["out_sig"] = md.param("out_mu", [D, Y], fan_out=[Y]), md.param("out_sig", [D, Y], fan_out=[Y])

        r = _deterministic(xc, yc, xt, p)
        mu_p, sig_p = _latent(_encode(xc, yc, p, "lat_"), "ctx", p)
        all_x = md.concat([xc, md.rename(xt, tgt="ctx")], "ctx")
        all_y = md.concat([yc, md.rename(yt, tgt="ctx")], "ctx")
        mu_q, sig_q = _latent(_encode(all_x, all_y, p, "lat_"), "ctx", p)
        z = mu_q + sig_q * eps
        dec = md.einsum("batch tgt d_x, d_x d_model -> batch tgt d_model", xt, p["dec_x"])
        dec = dec + md.einsum("batch tgt d_r, d_r d_model -> batch tgt d_model",
                              md.rename(r, d_model="d_r"), p["dec_r"])
        dec = md.relu(dec + md.einsum("batch d_z, d_z d_model -> batch d_model", z, p["dec_z"]))
        mu_y = md.einsum("batch tgt d_model, d_model d_y -> batch tgt d_y", dec, p["out_mu"])
        sig_y = 0.1 + 0.9 * md.softplus(md.einsum("batch tgt d_model, d_model d_y -> batch tgt d_y",
                                                  dec, p["out_sig"]))
        nll = 0.5 * math.log(2 * math.pi) + md.log(sig_y) + 0.5 * ((yt - mu_y) / sig_y) ** 2
        nll = md.reduce_mean(md.reduce_sum(nll, "d_y"))
        kl = md.reduce_mean(_kl(mu_q, sig_q, mu_p, sig_p)) / cfg.tgt
        loss = nll + kl
    shapes = {"xc": (B, C, X), "yc": (B, C, Y), "xt": (B, T, X), "yt": (B, T, Y), "eps": (B, Z)}

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        return {k: torch.randn(*[d.size for d in v], generator=gen) for k, v in shapes.items()}

    return md.Model(g, loss, g.params(), make_feeds, cfg, outputs={"nll": nll, "kl": kl})


REF_INPUTS = ("xc", "yc", "xt", "yt", "eps")


def reference_loss(cfg: Config, p: dict, xc, yc, xt, yt, eps):
    """The same loss in plain torch (F.scaled_dot_product_attention, the Gaussians written out)."""
    import torch.nn.functional as F

    def enc(x, y, pre):
        return F.relu(x @ p[pre + "wx"] + y @ p[pre + "wy"] + p[pre + "b"])

    def attend(q_in, k_in, v_in, q, k, v, o):           # heads first for sdpa
        qh, kh, vh = (torch.einsum("bnd,dhe->bhne", t, p[w]) for t, w in ((q_in, q), (k_in, k), (v_in, v)))
        return torch.einsum("bhne,hed->bnd", F.scaled_dot_product_attention(qh, kh, vh), p[o])

    def latent(s):
        pooled = s.mean(1)
        return pooled @ p["w_mu"], 0.1 + 0.9 * torch.sigmoid(pooled @ p["w_sig"])

    r = enc(xc, yc, "det_")
    r = r + attend(r, r, r, "sa_q", "sa_k", "sa_v", "sa_o")
    r = attend(F.relu(xt @ p["q_x"]), F.relu(xc @ p["q_x"]), r, "ca_q", "ca_k", "ca_v", "ca_o")
    mu_p, sig_p = latent(enc(xc, yc, "lat_"))
    mu_q, sig_q = latent(enc(torch.cat([xc, xt], 1), torch.cat([yc, yt], 1), "lat_"))
    z = mu_q + sig_q * eps
    dec = F.relu(xt @ p["dec_x"] + r @ p["dec_r"] + (z @ p["dec_z"])[:, None])
    mu_y, sig_y = dec @ p["out_mu"], 0.1 + 0.9 * F.softplus(dec @ p["out_sig"])
    nll = -torch.distributions.Normal(mu_y, sig_y).log_prob(yt).sum(-1).mean()
    kl = torch.distributions.kl_divergence(torch.distributions.Normal(mu_q, sig_q),
                                           torch.distributions.Normal(mu_p, sig_p)).sum(-1).mean()
    return nll + kl / cfg.tgt
