"""Held-out model (round 26d): an Evoformer-lite stack whose carry is the tuple (MSA, pair).

Written from README.md and docs/guide/*.md only. Each layer: MSA row attention with a bias from
the pair track, an outer product mean of the MSA into the pair track, and a triangle
multiplicative update (outgoing edges) of the pair track; layer norms before each. The loss
regresses the pair track onto a distance map and the MSA onto its own input (a denoising target).

Legend: b batch, r rows (MSA sequences), i res, j res_j, k res_k, m c_m, z c_z, n heads,
e d_head, o c_o / p c_p (outer product features), q c_t (triangle features), L layer.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 2
    rows: int = 8
    res: int = 16
    c_m: int = 32
    c_z: int = 16
    heads: int = 4
    d_head: int = 8
    c_o: int = 4
    c_t: int = 8
    layers: int = 4
    remat: str | None = None

    @classmethod
    def tiny(cls):
        return cls(batch=2, rows=3, res=6, c_m=6, c_z=6, heads=2, d_head=3, c_o=2, c_t=3, layers=3)


def row_attention(m, z, p):
    """Row-wise self-attention (no gate) over residues, biased per head by the pair track."""
    mn = md.layer_norm(m, "c_m", p["ln_m"])
    q = md.einsum("batch rows res c_m, c_m heads d_head -> batch rows res heads d_head", mn, p["wq"])
    k = md.rename(md.einsum("batch rows res c_m, c_m heads d_head -> batch rows res heads d_head", mn, p["wk"]),
                  res="res_j")
    v = md.rename(md.einsum("batch rows res c_m, c_m heads d_head -> batch rows res heads d_head", mn, p["wv"]),
                  res="res_j")
    bias = md.einsum("batch res res_j c_z, c_z heads -> batch heads res res_j",
                     md.layer_norm(z, "c_z", p["ln_z"]), p["wb"])
    s = md.einsum("batch rows res heads d_head, batch rows res_j heads d_head -> batch rows heads res res_j", q, k)
    att = md.softmax(s * q.shape["d_head"].size ** -0.5 + bias, "res_j")
    o = md.einsum("batch rows heads res res_j, batch rows res_j heads d_head -> batch rows res heads d_head", att, v)
    return m + md.einsum("batch rows res heads d_head, heads d_head c_m -> batch rows res c_m", o, p["wo"])


def outer_product_mean(m, z, p):
    mn = md.layer_norm(m, "c_m", p["ln_o"])
    a = md.einsum("batch rows res c_m, c_m c_o -> batch rows res c_o", mn, p["wa"])
    bb = md.rename(md.einsum("batch rows res c_m, c_m c_p -> batch rows res c_p", mn, p["wbo"]), res="res_j")
    outer = md.einsum("batch rows res c_o, batch rows res_j c_p -> batch res res_j c_o c_p", a, bb)
    outer = outer * (1.0 / m.shape["rows"].size)
    return z + md.einsum("batch res res_j c_o c_p, c_o c_p c_z -> batch res res_j c_z", outer, p["wz"])


def triangle_out(z, p):
    """z_ij += gate_ij * W(sum_k a_ik b_jk): the outgoing-edges multiplicative update."""
    zn = md.layer_norm(z, "c_z", p["ln_t"])
    a = md.rename(md.einsum("batch res res_j c_z, c_z c_t -> batch res res_j c_t", zn, p["wta"]), res_j="res_k")
    bz = md.rename(md.einsum("batch res res_j c_z, c_z c_t -> batch res res_j c_t", zn, p["wtb"]),
                   {"res": "res_j", "res_j": "res_k"})
    x = md.einsum("batch res res_k c_t, batch res_j res_k c_t -> batch res res_j c_t", a, bz)
    gate = md.sigmoid(md.einsum("batch res res_j c_z, c_z c_z2 -> batch res res_j c_z2", zn, p["wtg"]))
    upd = md.einsum("batch res res_j c_t, c_t c_z2 -> batch res res_j c_z2", md.layer_norm(x, "c_t"), p["wto"])
    return z + md.rename(gate * upd, c_z2="c_z")


def build(cfg: Config) -> md.Model:
    b, r, i, j = md.Dim("batch", cfg.batch), md.Dim("rows", cfg.rows), md.Dim("res", cfg.res), md.Dim("res_j", cfg.res)
    m_, z_, z2 = md.Dim("c_m", cfg.c_m), md.Dim("c_z", cfg.c_z), md.Dim("c_z2", cfg.c_z)
    n, e, L = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("layer", cfg.layers)
    o, pp, t = md.Dim("c_o", cfg.c_o), md.Dim("c_p", cfg.c_o), md.Dim("c_t", cfg.c_t)
    with md.Graph() as graph:
        msa, pair, dist = md.input("msa", [b, r, i, m_]), md.input("pair", [b, i, j, z_]), md.input("dist", [b, i, j])
        shapes = {"wq": [m_, n, e], "wk": [m_, n, e], "wv": [m_, n, e], "wo": [n, e, m_], "wb": [z_, n],
                  "wa": [m_, o], "wbo": [m_, pp], "wz": [o, pp, z_], "wta": [z_, t], "wtb": [z_, t],
                  "wtg": [z_, z2], "wto": [t, z2]}
        stack = {k: md.param(k, [L, *dims], fan_out=["layer", *(d.name for d in dims[-1:])])
                 for k, dims in shapes.items()}
        for k, d in {"ln_m": m_, "ln_z": z_, "ln_o": m_, "ln_t": z_}.items():
            stack[k] = md.param(k, [L, d], init="ones")
        w_dist = md.param("w_dist", [z_], fan_out=[])

        def layer(mz, p):
            m, z = mz
            m = row_attention(m, z, p)
            z = outer_product_mean(m, z, p)
            return m, triangle_out(z, p)

        m_out, z_out = md.repeat(layer, (msa, pair), stack, "layer", remat=cfg.remat)
        d_hat = md.einsum("batch res res_j c_z, c_z -> batch res res_j", z_out, w_dist)
        loss = md.reduce_mean((d_hat - dist) ** 2) + 0.1 * md.reduce_mean((m_out - msa) ** 2)

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        pos = torch.randn(cfg.batch, cfg.res, 3, generator=gen)
        return {"msa": torch.randn(cfg.batch, cfg.rows, cfg.res, cfg.c_m, generator=gen),
                "pair": torch.randn(cfg.batch, cfg.res, cfg.res, cfg.c_z, generator=gen),
                "dist": torch.cdist(pos, pos)}

    return md.Model(graph, loss, graph.params(), make_feeds, cfg)


# ----------------------------------------------------------------------------- torch reference

REF_INPUTS = ["msa", "pair", "dist"]


def _ln(x, scale=None):
    y = torch.nn.functional.layer_norm(x, x.shape[-1:])
    return y if scale is None else y * scale


def reference_loss(cfg: Config, p: dict, msa, pair, dist):
    """The same stack in plain torch, one layer at a time (F.scaled_dot_product_attention with the
    pair bias as its float mask)."""
    m, z = msa, pair
    for layer in range(cfg.layers):
        w = {k: v[layer] for k, v in p.items() if k != "w_dist"}
        mn = _ln(m, w["ln_m"])
        q, k, v = (torch.einsum("brim,mne->bnrie", mn, w[n]) for n in ("wq", "wk", "wv"))
        bias = torch.einsum("bijz,zn->bnij", _ln(z, w["ln_z"]), w["wb"])[:, :, None]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        m = m + torch.einsum("bnrie,nem->brim", o, w["wo"])
        mn = _ln(m, w["ln_o"])
        a, bo = mn @ w["wa"], mn @ w["wbo"]
        outer = torch.einsum("brio,brjp->bijop", a, bo) / cfg.rows
        z = z + torch.einsum("bijop,opz->bijz", outer, w["wz"])
        zn = _ln(z, w["ln_t"])
        x = torch.einsum("bikt,bjkt->bijt", zn @ w["wta"], zn @ w["wtb"])
        z = z + torch.sigmoid(zn @ w["wtg"]) * (_ln(x) @ w["wto"])
    d_hat = z @ p["w_dist"]
    return ((d_hat - dist) ** 2).mean() + 0.1 * ((m - msa) ** 2).mean()
