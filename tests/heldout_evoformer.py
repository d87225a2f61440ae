"""Held-out model (round 20a): Evoformer-lite (AlphaFold-style), written from the docs alone.

Two tracks: an MSA track ``m [batch, msa, res_i, c_pair]`` and a pair representation
``z [batch, res_i, res_j, c_pair]``. Each block: MSA row attention with a bias from the pair
(composite attention: the bias is added to the scores), MSA column attention (fused, over
``msa``), an MSA transition, the outer-product mean (MSA -> pair), the triangle
multiplicative updates outgoing (``sum_k a[i,k] b[j,k]``) and incoming (``sum_k a[k,i]
b[k,j]``), and a pair transition. The repeat's carry is one tensor, so the two tracks are
joined along a ``row`` dim: the MSA's ``msa`` rows and the pair's ``res_j`` rows, both of
width ``c_pair``, ``[batch, row, res_i, c_pair]``. Loss: a distogram head's cross-entropy
on the symmetrised pair against fed distance bins.

Legend: b batch, s msa, i res_i, j res_j, k res_k, c c_pair, h heads, e d_head, t c_tri.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 2
    msa: int = 8
    res: int = 16
    c_pair: int = 32
    heads: int = 4
    d_head: int = 8
    c_tri: int = 16
    c_opm: int = 8
    d_ff: int = 64
    bins: int = 16
    aa: int = 21
    layers: int = 2
    max_rel: int = 4
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=2, msa=3, res=6, c_pair=8, heads=2, d_head=4, c_tri=4, c_opm=3, d_ff=16,
                   bins=5, aa=7, layers=2, max_rel=2)


def _ln(x, p, name):
    return md.layer_norm(x, "c_pair", p[name], p[name + "_b"])


def _row_attention(m, z, p):
    """Attention along residues within each MSA row, biased per head by the pair."""
    h = _ln(m, p, "ln_row")
    q = md.einsum("batch msa res_i c_pair, c_pair heads d_head -> batch msa res_i heads d_head", h, p["rq"])
    k = md.rename(md.einsum("batch msa res_i c_pair, c_pair heads d_head -> batch msa res_i heads d_head", h, p["rk"]), res_i="res_j")
    v = md.rename(md.einsum("batch msa res_i c_pair, c_pair heads d_head -> batch msa res_i heads d_head", h, p["rv"]), res_i="res_j")
    bias = md.einsum("batch res_i res_j c_pair, c_pair heads -> batch heads res_i res_j", _ln(z, p, "ln_pb"), p["pb"])
    scores = md.einsum("batch msa res_i heads d_head, batch msa res_j heads d_head -> batch msa heads res_i res_j", q, k)
    att = md.softmax(scores * (q.shape["d_head"].size ** -0.5) + bias, "res_j")
    o = md.einsum("batch msa heads res_i res_j, batch msa res_j heads d_head -> batch msa res_i heads d_head", att, v)
    return m + md.einsum("batch msa res_i heads d_head, heads d_head c_pair -> batch msa res_i c_pair", o, p["ro"])


def _column_attention(m, p):
    """Attention along the MSA's sequences at each residue (one fused kernel)."""
    h = _ln(m, p, "ln_col")
    q = md.einsum("batch msa res_i c_pair, c_pair heads d_head -> batch msa res_i heads d_head", h, p["cq"])
    k = md.rename(md.einsum("batch msa res_i c_pair, c_pair heads d_head -> batch msa res_i heads d_head", h, p["ck"]), msa="msa_k")
    v = md.rename(md.einsum("batch msa res_i c_pair, c_pair heads d_head -> batch msa res_i heads d_head", h, p["cv"]), msa="msa_k")
    o = md.attention(q, k, v, "msa", "msa_k", "d_head", causal=False)
    return m + md.einsum("batch msa res_i heads d_head, heads d_head c_pair -> batch msa res_i c_pair", o, p["co"])


def _transition(x, p, pre):
    h = md.relu(md.einsum("... c_pair, c_pair d_ff -> ... d_ff", _ln(x, p, pre + "_ln"), p[pre + "_w1"]))
    return x + md.einsum("... d_ff, d_ff c_pair -> ... c_pair", h, p[pre + "_w2"])


def _outer_product_mean(m, z, p):
    h = _ln(m, p, "ln_opm")
    a = md.einsum("batch msa res_i c_pair, c_pair c_opm -> batch msa res_i c_opm", h, p["opm_a"])
    b = md.einsum("batch msa res_i c_pair, c_pair c_opm2 -> batch msa res_i c_opm2", h, p["opm_b"])
    o = md.einsum("batch msa res_i c_opm, batch msa res_j c_opm2 -> batch res_i res_j c_opm c_opm2",
                  a, md.rename(b, res_i="res_j")) / m.shape["msa"].size
    return z + md.einsum("batch res_i res_j c_opm c_opm2, c_opm c_opm2 c_pair -> batch res_i res_j c_pair", o, p["opm_o"])


def _triangle(z, p, pre, outgoing):
    h = _ln(z, p, pre + "_ln")
    a = md.sigmoid(md.einsum("batch res_i res_j c_pair, c_pair c_tri -> batch res_i res_j c_tri", h, p[pre + "_ga"])) * \
        md.einsum("batch res_i res_j c_pair, c_pair c_tri -> batch res_i res_j c_tri", h, p[pre + "_a"])
    b = md.sigmoid(md.einsum("batch res_i res_j c_pair, c_pair c_tri -> batch res_i res_j c_tri", h, p[pre + "_gb"])) * \
        md.einsum("batch res_i res_j c_pair, c_pair c_tri -> batch res_i res_j c_tri", h, p[pre + "_b"])
    if outgoing:   # out[i, j] = sum_k a[i, k] b[j, k]
        a_, b_ = md.rename(a, res_j="res_k"), md.rename(b, {"res_i": "res_j", "res_j": "res_k"})
    else:          # out[i, j] = sum_k a[k, i] b[k, j]
        a_, b_ = md.rename(a, {"res_i": "res_k", "res_j": "res_i"}), md.rename(b, res_i="res_k")
    o = md.einsum("batch res_i res_k c_tri, batch res_j res_k c_tri -> batch res_i res_j c_tri", a_, b_)
    o = md.layer_norm(o, "c_tri", p[pre + "_lno"], p[pre + "_lno_b"])
    gate = md.sigmoid(md.einsum("batch res_i res_j c_pair, c_pair c_out -> batch res_i res_j c_out", h, p[pre + "_g"]))
    o = md.rename(gate * md.einsum("batch res_i res_j c_tri, c_tri c_out -> batch res_i res_j c_out", o, p[pre + "_o"]), c_out="c_pair")
    return z + o


def _block(carry, p):
    n_msa = p["n_msa"]
    m = md.rename(md.slice_(carry, "row", 0, n_msa), row="msa")
    z = md.rename(md.slice_(carry, "row", n_msa, carry.shape["row"].size), row="res_j")
    m = _row_attention(m, z, p)
    m = _column_attention(m, p)
    m = _transition(m, p, "mt")
    z = _outer_product_mean(m, z, p)
    z = _triangle(z, p, "to", outgoing=True)
    z = _triangle(z, p, "ti", outgoing=False)
    z = _transition(z, p, "pt")
    return _join(m, z)


def _join(m, z):
    """The carry: the MSA's rows then the pair's, ``[batch, row, res_i, c_pair]``."""
    z = md.transpose(z, ["batch", "res_j", "res_i", "c_pair"])
    return md.concat([md.rename(m, msa="row"), md.rename(z, res_j="row")], "row")


def _stacked_params(cfg, l):
    c, h, e = md.Dim("c_pair", cfg.c_pair), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    t, f = md.Dim("c_tri", cfg.c_tri), md.Dim("d_ff", cfg.d_ff)
    o1, o2, co = md.Dim("c_opm", cfg.c_opm), md.Dim("c_opm2", cfg.c_opm), md.Dim("c_out", cfg.c_pair)
    p = {}
    for name in ["ln_row", "ln_pb", "ln_col", "mt_ln", "ln_opm", "to_ln", "ti_ln", "pt_ln"]:
        p[name] = md.param(name, [l, c], init="ones")
        p[name + "_b"] = md.param(name + "_b", [l, c], init="zeros")
    for pre in ["r", "c"]:
        for w in "qkv":
            p[pre + w] = md.param(pre + w, [l, c, h, e], fan_out=["layer", "heads", "d_head"])
        p[pre + "o"] = md.param(pre + "o", [l, h, e, c], fan_out=["layer", "c_pair"])
    p["pb"] = md.param("pb", [l, c, h], fan_out=["layer", "heads"])
    for pre in ["mt", "pt"]:
        p[pre + "_w1"] = md.param(pre + "_w1", [l, c, f], fan_out=["layer", "d_ff"])
        p[pre + "_w2"] = md.param(pre + "_w2", [l, f, c], fan_out=["layer", "c_pair"], scale=0.5)
    p["opm_a"] = md.param("opm_a", [l, c, o1], fan_out=["layer", "c_opm"])
    p["opm_b"] = md.param("opm_b", [l, c, o2], fan_out=["layer", "c_opm2"])
    p["opm_o"] = md.param("opm_o", [l, o1, o2, c], fan_out=["layer", "c_pair"])
    for pre in ["to", "ti"]:
        for w in ["a", "b", "ga", "gb"]:
            p[f"{pre}_{w}"] = md.param(f"{pre}_{w}", [l, c, t], fan_out=["layer", "c_tri"])
        p[pre + "_lno"] = md.param(pre + "_lno", [l, t], init="ones")
        p[pre + "_lno_b"] = md.param(pre + "_lno_b", [l, t], init="zeros")
        p[pre + "_g"] = md.param(pre + "_g", [l, c, co], fan_out=["layer", "c_out"])
        p[pre + "_o"] = md.param(pre + "_o", [l, t, co], fan_out=["layer", "c_out"], scale=0.5)
    return p


def build(cfg: Config = Config()) -> md.Model:
    b, s, i = md.Dim("batch", cfg.batch), md.Dim("msa", cfg.msa), md.Dim("res_i", cfg.res)
    j, c, a = md.Dim("res_j", cfg.res), md.Dim("c_pair", cfg.c_pair), md.Dim("aa", cfg.aa)
    nb, rel = md.Dim("bins", cfg.bins), md.Dim("rel", 2 * cfg.max_rel + 1)
    with md.Graph("evoformer") as g:
        msa_ids = md.input("msa_ids", [b, s, i], dtype=torch.int64)
        seq_ids = md.input("seq_ids", [b, i], dtype=torch.int64)
        bins = md.input("bins", [b, i, j], dtype=torch.int64)
        m = md.gather(md.param("msa_emb", [a, c], scale=0.5), msa_ids, "aa") + \
            md.gather(md.param("msa_seq_emb", [a, c], scale=0.5), seq_ids, "aa")
        left = md.gather(md.param("left_emb", [a, c], scale=0.5), seq_ids, "aa")
        right = md.rename(md.gather(md.param("right_emb", [a, c], scale=0.5), seq_ids, "aa"), res_i="res_j")
        offset = md.clamp(md.arange(j) - md.arange(i), -cfg.max_rel, cfg.max_rel) + cfg.max_rel   # [res_j, res_i]
        z = left + right + md.gather(md.param("relpos", [rel, c], scale=0.5), offset, "rel")
        p = _stacked_params(cfg, md.Dim("layer", cfg.layers))
        carry = _join(md.transpose(m, ["batch", "msa", "res_i", "c_pair"]), z)
        carry = md.repeat(lambda x, q: _block(x, {**q, "n_msa": cfg.msa}), carry, p, "layer", remat=cfg.remat)
        z = md.rename(md.slice_(carry, "row", cfg.msa, cfg.msa + cfg.res), row="res_j")
        z = md.layer_norm(z, "c_pair", md.param("lnf", [c], init="ones"), md.param("lnf_b", [c], init="zeros"))
        z = z + md.rename(z, {"res_i": "res_j", "res_j": "res_i"})
        logits = md.einsum("batch res_i res_j c_pair, c_pair bins -> batch res_i res_j bins", z,
                           md.param("disto", [c, nb], fan_out=["bins"]))
        loss = md.reduce_mean(md.cross_entropy(logits, bins, "bins"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        seq = torch.randint(0, cfg.aa, (cfg.batch, cfg.res), generator=gen)
        mut = torch.rand(cfg.batch, cfg.msa, cfg.res, generator=gen) < 0.3
        msa = torch.where(mut, torch.randint(0, cfg.aa, (cfg.batch, cfg.msa, cfg.res), generator=gen), seq[:, None])
        xyz = torch.cumsum(torch.randn(cfg.batch, cfg.res, 3, generator=gen), dim=1)
        dist = torch.cdist(xyz, xyz)
        edges = torch.linspace(0.5, 3.5, cfg.bins - 1)
        return {"msa_ids": msa, "seq_ids": seq, "bins": torch.bucketize(dist, edges)}

    return md.Model(g, loss, g.params(), feeds, cfg)
