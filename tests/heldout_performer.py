"""A Performer / linear-attention decoder, written from README.md and docs/ alone (a held-out model).

Legend: b batch, s seq, d d_model, h heads, e d_head (``e2`` the values' copy of it), m feats
(the feature map's width), f d_ff, v vocab, l layer.

Attention is softmax-free: phi(q) and phi(k) are positive features [b, s, h, m] and

    causal:  out_s = phi(q_s) . S_s / (phi(q_s) . z_s + eps),  S_s = sum_{t<=s} phi(k_t) (x) v_t
             (``md.cumsum`` over ``seq`` of the outer products [b, s, h, m, e2]), z_s = cumsum of phi(k)
    global:  the same with S and z summed over the whole sequence (``causal=False``)

``feature`` picks phi: ``elu`` (elu(x) + 1 = where(x > 0, x + 1, exp(x)), Katharopoulos et al.),
``favor`` (FAVOR+ positive random features exp(w . x - |x|^2 / 2) / sqrt(m), the projection
``w [d_head, feats]`` a fixed constant, Performer's) or ``relu``. ``chunked=True`` computes the
causal form per chunk of ``chunk`` positions: inside a chunk a masked quadratic term, across
chunks the exclusive cumsum over the ``chunks`` dim of each chunk's state (the chunked form of
linear attention in Mamba-2 / GLA style).  Pre-LN blocks under ``md.repeat``, a gelu MLP,
learned positions, an untied head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 4
    seq: int = 32
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    feats: int = 16
    d_ff: int = 64
    layers: int = 2
    feature: str = "elu"
    causal: bool = True
    chunked: bool = False
    chunk: int = 4
    eps: float = 1e-4
    remat: str = "none"       # what each layer saves for its backward (md.repeat remat=)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, seq=8, vocab=16, d_model=8, heads=2, d_head=4, feats=6, d_ff=16, layers=2, chunk=2)


def phi(x: md.Tensor, cfg: Config, proj: md.Tensor) -> md.Tensor:
    """The positive feature map over ``d_head`` -> ``feats``."""
    if cfg.feature == "favor":
        xs = x * cfg.d_head ** -0.25
        wx = md.einsum(f"{' '.join(x.shape.names)}, d_head feats -> "
                       f"{' '.join(n for n in x.shape.names if n != 'd_head')} feats", xs, proj)
        return md.exp(wx - 0.5 * md.reduce_sum(xs * xs, "d_head")) * cfg.feats ** -0.5
    y = md.einsum(f"{' '.join(x.shape.names)}, d_head feats -> "
                  f"{' '.join(n for n in x.shape.names if n != 'd_head')} feats", x, proj)
    if cfg.feature == "relu":
        return md.relu(y) + 1e-3
    return md.where(md.greater(y, 0.0), y + 1.0, md.exp(y))           # elu(y) + 1


def linear_attention(q, k, v, cfg: Config) -> md.Tensor:
    """q, k [b, s, h, feats] (features), v [b, s, h, e2] -> [b, s, h, e2]."""
    if not cfg.causal:
        state = md.einsum("batch seq heads feats, batch seq heads e2 -> batch heads feats e2", k, v)
        norm = md.reduce_sum(k, "seq")
        num = md.einsum("batch seq heads feats, batch heads feats e2 -> batch seq heads e2", q, state)
        return num / (md.einsum("batch seq heads feats, batch heads feats -> batch seq heads", q, norm) + cfg.eps)
    if not cfg.chunked:
        kv = md.einsum("batch seq heads feats, batch seq heads e2 -> batch seq heads feats e2", k, v)
        state, norm = md.cumsum(kv, "seq"), md.cumsum(k, "seq")
        num = md.einsum("batch seq heads feats, batch seq heads feats e2 -> batch seq heads e2", q, state)
        return num / (md.einsum("batch seq heads feats, batch seq heads feats -> batch seq heads", q, norm) + cfg.eps)
    split = "batch (chunks pos) heads {0} -> batch chunks pos heads {0}"
    qc = md.rearrange(q, split.format("feats"), pos=cfg.chunk)
    kc = md.rearrange(k, split.format("feats"), pos=cfg.chunk)
    vc = md.rearrange(v, split.format("e2"), pos=cfg.chunk)
    kpos = md.Dim("key_pos", cfg.chunk)
    kc2, vc2 = md.rename(kc, pos="key_pos"), md.rename(vc, pos="key_pos")
    mask = md.cast(md.causal_mask(qc.shape["pos"], kpos), torch.float32)                # [pos, key_pos]
    scores = md.einsum("batch chunks pos heads feats, batch chunks key_pos heads feats -> batch chunks heads pos key_pos",
                       qc, kc2) * mask
    intra = md.einsum("batch chunks heads pos key_pos, batch chunks key_pos heads e2 -> batch chunks pos heads e2",
                      scores, vc2)
    intra_norm = md.reduce_sum(scores, "key_pos")                                        # [b, chunks, h, pos]
    chunk_kv = md.einsum("batch chunks key_pos heads feats, batch chunks key_pos heads e2 -> batch chunks heads feats e2",
                         kc2, vc2)
    before = md.cumsum(chunk_kv, "chunks", exclusive=True)
    before_k = md.cumsum(md.reduce_sum(kc2, "key_pos"), "chunks", exclusive=True)        # [b, chunks, h, feats]
    inter = md.einsum("batch chunks pos heads feats, batch chunks heads feats e2 -> batch chunks pos heads e2", qc, before)
    inter_norm = md.einsum("batch chunks pos heads feats, batch chunks heads feats -> batch chunks pos heads", qc, before_k)
    out = (intra + inter) / (intra_norm + inter_norm + cfg.eps)
    return md.rearrange(out, "batch chunks pos heads e2 -> batch (chunks pos) heads e2")


def block(x: md.Tensor, p: dict, cfg: Config, proj: md.Tensor) -> md.Tensor:
    hdn = md.layer_norm(x, "d_model", p["ln1"])
    q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", hdn, p["wq"])
    k = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", hdn, p["wk"])
    v = md.einsum("batch seq d_model, d_model heads e2 -> batch seq heads e2", hdn, p["wv"])
    o = linear_attention(phi(q, cfg, proj), phi(k, cfg, proj), v, cfg)
    if cfg.chunked:
        o = md.rename(o, chunks_pos="seq")
    x = x + md.einsum("batch seq heads e2, heads e2 d_model -> batch seq d_model", o, p["wo"])
    hdn = md.layer_norm(x, "d_model", p["ln2"])
    u = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", hdn, p["w1"]))
    return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u, p["w2"])


def build(cfg: Config = Config()) -> md.Model:
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    h, e, e2 = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("e2", cfg.d_head)
    m, f = md.Dim("feats", cfg.feats), md.Dim("d_ff", cfg.d_ff)
    v, l = md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_performer") as g:
        ids = md.input("ids", [b, s], torch.int64)
        labels = md.input("labels", [b, s], torch.int64)
        wte = md.param("wte", [v, d], scale=0.5)
        wpe = md.param("wpe", [s, d], scale=0.1)
        proj = md.constant(torch.randn(cfg.d_head, cfg.feats, generator=torch.Generator().manual_seed(7))
                           * (1.0 if cfg.feature == "favor" else cfg.d_head ** -0.5), [e, m], name="feature_proj")
        blocks = {
            "ln1": md.param("ln1", [l, d], init="ones"),
            "wq": md.param("wq", [l, d, h, e], fan_out=[l, h, e]),
            "wk": md.param("wk", [l, d, h, e], fan_out=[l, h, e]),
            "wv": md.param("wv", [l, d, h, e2], fan_out=[l, h, e2]),
            "wo": md.param("wo", [l, h, e2, d], fan_out=[l, d]),
            "ln2": md.param("ln2", [l, d], init="ones"),
            "w1": md.param("w1", [l, d, f], fan_out=[l, f]),
            "w2": md.param("w2", [l, f, d], fan_out=[l, d]),
        }
        lnf = md.param("lnf", [d], init="ones")
        head = md.param("head", [v, d], fan_out=[v])
        x = md.repeat(lambda t, p: block(t, p, cfg, proj), md.gather(wte, ids, "vocab") + wpe, blocks, l, remat=cfg.remat)
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", md.layer_norm(x, "d_model", lnf), head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
        return {"ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    return md.Model(g, loss, {"wte": wte, "wpe": wpe, **blocks, "lnf": lnf, "head": head}, feeds, cfg, logits=logits)
